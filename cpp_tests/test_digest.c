/* refit_digest on the host backend (CI has no GPU): the value equals the digest computed here from its
 * definition in the header (bit by bit, modulo g), at every alignment; flipped bits and swapped words
 * change it; every bad argument has its status and leaves the output alone. */
#include <stdint.h>

#include "check.h"

#define POLY 0x41aa24523c3d140fULL

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* The header's definition: sum of x^k over the set bits k, plus x^(8 len), modulo g. */
static uint64_t reference(const uint8_t *bytes, uint64_t len) {
  uint64_t sum = 0, power = 1; /* x^k mod g */
  for (uint64_t k = 0; k < 8 * len + 1; k++) {
    int bit = k == 8 * len ? 1 : (bytes[k / 8] >> (k % 8)) & 1;
    if (bit) sum ^= power;
    power = (power << 1) ^ ((power >> 63) ? POLY : 0);
  }
  return sum;
}

int main(void) {
  const int32_t devices[2] = {0, 1};
  refit_group *group = check_host_group(devices, 2);
  void *stream = NULL;
  CHECK_OK(refit_group_stream(group, 1, &stream));

  uint8_t buffer[300];
  for (int i = 0; i < 300; i++) buffer[i] = (uint8_t)(i * 37 + 11);
  uint64_t digest = 0;
  for (int offset = 0; offset < 16; offset += 3) {
    for (uint64_t len = 0; len < 280; len += 23) {
      CHECK_OK(refit_digest(group, 1, addr(buffer + offset), len, stream, &digest));
      CHECK(digest == reference(buffer + offset, len));
    }
  }
  CHECK_OK(refit_digest(group, 0, 0, 0, NULL, &digest)); /* nothing to read: the marker alone */
  CHECK(digest == 1);

  /* The same bytes at another address give the same digest; a flipped bit or two swapped words do not. */
  uint8_t copy[64];
  memcpy(copy, buffer + 5, 64);
  uint64_t original = 0;
  CHECK_OK(refit_digest(group, 0, addr(buffer + 5), 64, NULL, &original));
  CHECK_OK(refit_digest(group, 0, addr(copy), 64, NULL, &digest));
  CHECK(digest == original);
  copy[17] ^= 0x10;
  CHECK_OK(refit_digest(group, 0, addr(copy), 64, NULL, &digest));
  CHECK(digest != original);
  memcpy(copy, buffer + 5, 64);
  memcpy(copy + 8, buffer + 5 + 40, 8);
  memcpy(copy + 40, buffer + 5 + 8, 8);
  CHECK_OK(refit_digest(group, 0, addr(copy), 64, NULL, &digest));
  CHECK(digest != original);

  /* Bad arguments, each with its status; the output is left alone. */
  digest = 77;
  CHECK_STATUS(refit_digest(NULL, 0, addr(buffer), 8, NULL, &digest), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_digest(group, 0, addr(buffer), 8, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "digest") != NULL);
  CHECK_STATUS(refit_digest(group, 2, addr(buffer), 8, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "rank 2") != NULL);
  CHECK_STATUS(refit_digest(group, 0, 0, 8, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "address is 0") != NULL);
  CHECK_STATUS(refit_digest(group, 0, UINT64_MAX - 4, 8, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "past the end") != NULL);
  CHECK_STATUS(refit_digest(group, 0, addr(buffer), UINT64_MAX - 100, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT);
  void *not_a_stream = (void *)(uintptr_t)0x3039;
  CHECK_STATUS(refit_digest(group, 0, addr(buffer), 8, not_a_stream, &digest), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "not a host stream") != NULL);
  CHECK(digest == 77);

  refit_group_destroy(group);
  CHECK_DONE();
}
