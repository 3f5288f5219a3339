// The header compiles as C++17 on its own and its declarations are usable from C++.
#include "refit.h"

#include <cstdio>
#include <cstring>
#include <type_traits>

static_assert(std::is_same<decltype(refit_abi_version()), uint32_t>::value, "abi version is uint32_t");
static_assert(REFIT_STATUS_SUCCESS == 0, "success is zero");

int main() {
  if (refit_abi_version() != REFIT_ABI_VERSION) return 1;
  if (std::strcmp(refit_version(), REFIT_VERSION_STRING) != 0) return 1;
  std::printf("2 passed, 0 failed\n");
  return 0;
}
