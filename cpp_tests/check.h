/* Minimal assertion helpers shared by the C and C++ tests. Each test program exits non-zero on the
 * first failed check and prints "N passed, 0 failed" when every check held. */
#ifndef REFIT_CPP_TESTS_CHECK_H
#define REFIT_CPP_TESTS_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "refit.h"

static int check_passed = 0;

#define CHECK(cond)                                                                         \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);              \
      printf("%d passed, 1 failed\n", check_passed);                                        \
      exit(1);                                                                              \
    }                                                                                       \
    check_passed++;                                                                         \
  } while (0)

/* Checks a call's status and, on failure, prints the library's message. */
#define CHECK_STATUS(call, expected)                                                        \
  do {                                                                                      \
    refit_status check_got_ = (call);                                                       \
    if (check_got_ != (expected)) {                                                         \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__, __LINE__,     \
              #call, refit_status_string(check_got_), refit_status_string(expected),        \
              refit_last_error_message());                                                  \
      printf("%d passed, 1 failed\n", check_passed);                                        \
      exit(1);                                                                              \
    }                                                                                       \
    check_passed++;                                                                         \
  } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, REFIT_STATUS_SUCCESS)

#define CHECK_DONE()                                                                        \
  do {                                                                                      \
    printf("%d passed, 0 failed\n", check_passed);                                          \
    return 0;                                                                               \
  } while (0)

/* A host-backend group over `devices` (the simulated devices every CPU test runs on). */
static inline refit_group *check_host_group(const int32_t *devices, size_t n) {
  refit_group_options options;
  CHECK_OK(refit_group_options_init(&options));
  options.backend = REFIT_BACKEND_HOST;
  refit_group *group = NULL;
  CHECK_OK(refit_group_create(devices, n, &options, &group));
  return group;
}

/* One contiguous run of `len` bytes from `src` to `dst` (host addresses, as the host backend takes). */
static inline refit_segment check_contiguous(const void *src, void *dst, uint64_t len) {
  refit_segment s;
  memset(&s, 0, sizeof s);
  s.src = (uint64_t)(uintptr_t)src;
  s.dst = (uint64_t)(uintptr_t)dst;
  s.len = len;
  s.count[0] = 1;
  s.count[1] = 1;
  return s;
}

#endif
