/* refit_digest and refit_digest_many on the host backend (CI has no GPU): the value equals the digest
 * computed here from its definition in the header (bit by bit, modulo g), at every alignment; 0 bytes
 * digest to 1 at any address, the last one included; flipped bits and swapped words change it; each
 * of many ranges digests as refit_digest does alone; every bad argument has its status and message and
 * leaves the output alone. */
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

/* refit_digest_many: each range's digest equals refit_digest's of that range (and the definition),
 * for empty, unaligned, overlapping, repeated, tiny and long ranges in one call; count 0 writes nothing
 * and takes NULL lists; each bad argument has its status and a message naming it. */
static void test_many(refit_group *group, void *stream, const uint8_t *buffer) {
  enum { N = 40 };
  uint64_t addrs[N], lens[N], digests[N], one = 0;
  for (int i = 0; i < N; i++) {
    uint64_t offset = (uint64_t)(i * 7) % 23, len = i == N - 1 ? 277 : (uint64_t)(i * 13) % 40;
    addrs[i] = addr(buffer + offset);
    lens[i] = len;
  }
  addrs[3] = UINT64_MAX; /* 0 bytes at the last address */
  lens[3] = 0;
  addrs[4] = addrs[5]; /* repeated */
  lens[4] = lens[5];
  CHECK_OK(refit_digest_many(group, 1, addrs, lens, N, stream, digests));
  for (int i = 0; i < N; i++) {
    CHECK_OK(refit_digest(group, 1, addrs[i], lens[i], stream, &one));
    CHECK(digests[i] == one);
    CHECK(digests[i] == (lens[i] == 0 ? 1 : reference((const uint8_t *)(uintptr_t)addrs[i], lens[i])));
  }
  CHECK(digests[3] == 1);
  CHECK(digests[4] == digests[5]);

  /* count 0: success, nothing read or written, NULL lists accepted. */
  digests[0] = 77;
  CHECK_OK(refit_digest_many(group, 0, NULL, NULL, 0, NULL, NULL));
  CHECK_OK(refit_digest_many(group, 0, addrs, lens, 0, NULL, digests));
  CHECK(digests[0] == 77);

  /* Bad arguments: each its status and message; the digests are left alone. */
  for (int i = 0; i < N; i++) digests[i] = 77;
  CHECK_STATUS(refit_digest_many(NULL, 0, addrs, lens, N, NULL, digests), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "group") != NULL);
  CHECK_STATUS(refit_digest_many(group, 0, NULL, lens, N, NULL, digests), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "addrs is NULL") != NULL);
  CHECK_STATUS(refit_digest_many(group, 0, addrs, NULL, N, NULL, digests), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "lens is NULL") != NULL);
  CHECK_STATUS(refit_digest_many(group, 0, addrs, lens, N, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "digests is NULL") != NULL);
  CHECK_STATUS(refit_digest_many(group, 2, addrs, lens, N, NULL, digests), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "rank 2") != NULL);
  CHECK_STATUS(refit_digest_many(group, 2, NULL, NULL, 0, NULL, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "rank 2") != NULL);
  uint64_t saved_addr = addrs[7], saved_len = lens[7];
  addrs[7] = UINT64_MAX - 4; /* wraps the address space */
  lens[7] = 8;
  CHECK_STATUS(refit_digest_many(group, 0, addrs, lens, N, NULL, digests), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "range 7") != NULL);
  CHECK(strstr(refit_last_error_message(), "past the end") != NULL);
  addrs[7] = 0;
  CHECK_STATUS(refit_digest_many(group, 0, addrs, lens, N, NULL, digests), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "range 7: address is 0") != NULL);
  addrs[7] = saved_addr;
  lens[7] = saved_len;
  void *not_a_stream = (void *)(uintptr_t)0x3039;
  CHECK_STATUS(refit_digest_many(group, 0, addrs, lens, N, not_a_stream, digests), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "not a host stream") != NULL);
  for (int i = 0; i < N; i++) CHECK(digests[i] == 77);
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
  /* 0 bytes at any address, the last one of the address space included (issue 26, 6). */
  const uint64_t empty_at[4] = {1, UINT64_MAX - 16, UINT64_MAX - 1, UINT64_MAX};
  for (int i = 0; i < 4; i++) {
    digest = 0;
    CHECK_OK(refit_digest(group, 0, empty_at[i], 0, NULL, &digest));
    CHECK(digest == 1);
  }

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

  test_many(group, stream, buffer);
  refit_group_destroy(group);
  CHECK_DONE();
}
