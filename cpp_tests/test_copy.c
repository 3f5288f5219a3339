/* The batched copy's C API on the host backend (CI has no GPU): one-shot and prepared batches copy
 * the right bytes (checked against a byte loop written here), strided segments, the checked mode's
 * REFIT_STATUS_OVERLAP with nothing copied, and every bad argument with its status. */
#include <stdint.h>

#include "check.h"

#define ROWS 32
#define HALF 24

int main(void) {
  const int32_t devices[2] = {0, 1};
  refit_group *group = check_host_group(devices, 2);
  void *stream = NULL;
  CHECK_OK(refit_group_stream(group, 1, &stream));

  /* Gather two column halves into full rows (interleaved destinations) plus a misaligned run. */
  uint8_t left[ROWS * HALF], right[ROWS * HALF], full[ROWS * 2 * HALF + 64], want[ROWS * 2 * HALF + 64];
  for (int i = 0; i < ROWS * HALF; i++) {
    left[i] = (uint8_t)(i * 7 + 1);
    right[i] = (uint8_t)(i * 13 + 5);
  }
  memset(full, 0xCD, sizeof full);
  memset(want, 0xCD, sizeof want);
  for (int r = 0; r < ROWS; r++) {
    for (int b = 0; b < HALF; b++) {
      want[r * 2 * HALF + b] = left[r * HALF + b];
      want[r * 2 * HALF + HALF + b] = right[r * HALF + b];
    }
  }
  for (int b = 0; b < 37; b++) want[ROWS * 2 * HALF + 3 + b] = left[5 + b];
  refit_segment segments[4];
  for (int side = 0; side < 2; side++) {
    segments[side] = check_contiguous(side ? right : left, full + side * HALF, HALF);
    segments[side].count[0] = ROWS;
    segments[side].src_stride[0] = HALF;
    segments[side].dst_stride[0] = 2 * HALF;
  }
  segments[2] = check_contiguous(left + 5, full + ROWS * 2 * HALF + 3, 37);
  segments[3] = check_contiguous(NULL, NULL, 0); /* empty: ignored whatever its addresses */

  CHECK_OK(refit_copy_batch(group, 1, stream, segments, 4, REFIT_COPY_CHECKED));
  CHECK(memcmp(full, want, sizeof full) == 0); /* complete on return on the host backend */
  memset(full, 0xCD, sizeof full);
  CHECK_OK(refit_copy_batch(group, 0, NULL, segments, 4, 0));
  CHECK(memcmp(full, want, sizeof full) == 0);
  CHECK_OK(refit_copy_batch(group, 0, NULL, NULL, 0, 0)); /* empty batch */

  /* A prepared batch launched several times reads the sources at each launch. */
  refit_prepared_copy *batch = NULL;
  CHECK_OK(refit_copy_batch_prepare(group, 1, segments, 4, REFIT_COPY_CHECKED, &batch));
  CHECK(batch != NULL);
  for (int round = 0; round < 5; round++) {
    for (int i = 0; i < ROWS * HALF; i++) left[i] = (uint8_t)(left[i] + 1);
    for (int r = 0; r < ROWS; r++)
      for (int b = 0; b < HALF; b++) want[r * 2 * HALF + b] = left[r * HALF + b];
    for (int b = 0; b < 37; b++) want[ROWS * 2 * HALF + 3 + b] = left[5 + b];
    memset(full, 0xCD, sizeof full);
    CHECK_OK(refit_copy_batch_launch(batch, stream));
    CHECK(memcmp(full, want, sizeof full) == 0);
  }
  /* On the host backend a stream handle must be a host stream. */
  void *not_a_stream = (void *)(uintptr_t)0x3039;
  CHECK_STATUS(refit_copy_batch_launch(batch, not_a_stream), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "not a host stream") != NULL);
  CHECK_STATUS(refit_copy_batch(group, 1, not_a_stream, segments, 4, 0), REFIT_STATUS_INVALID_ARGUMENT);
  refit_copy_batch_destroy(batch);
  refit_copy_batch_destroy(NULL);

  /* Checked mode: overlapping destinations are rejected and nothing is copied. */
  uint8_t src[64], dst[64];
  memset(src, 1, sizeof src);
  memset(dst, 0xCD, sizeof dst);
  refit_segment overlap[2] = {check_contiguous(src, dst, 16), check_contiguous(src, dst + 8, 16)};
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, overlap, 2, REFIT_COPY_CHECKED), REFIT_STATUS_OVERLAP);
  CHECK(strstr(refit_last_error_message(), "segments 0 and 1") != NULL);
  refit_prepared_copy *untouched = (refit_prepared_copy *)0x1;
  CHECK_STATUS(refit_copy_batch_prepare(group, 0, overlap, 2, REFIT_COPY_CHECKED, &untouched), REFIT_STATUS_OVERLAP);
  CHECK(untouched == (refit_prepared_copy *)0x1);
  for (int i = 0; i < 64; i++) CHECK(dst[i] == 0xCD);

  /* Bad arguments, each with its status. */
  CHECK_STATUS(refit_copy_batch(NULL, 0, NULL, overlap, 1, 0), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, NULL, 3, 0), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_copy_batch(group, 2, NULL, overlap, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "rank 2") != NULL);
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, overlap, 1, 4), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "flags") != NULL);
  refit_segment zero = check_contiguous(NULL, dst, 4);
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, &zero, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  refit_segment wraps = check_contiguous(src, dst, 4);
  wraps.count[0] = UINT64_MAX;
  wraps.count[1] = 2;
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, &wraps, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_copy_batch_prepare(group, 0, overlap, 1, 0, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_copy_batch_prepare(NULL, 0, overlap, 1, 0, &batch), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_copy_batch_prepare(group, 0, NULL, 3, 0, &batch), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_copy_batch_prepare(group, 5, overlap, 1, 0, &batch), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_copy_batch_prepare(group, 0, overlap, 1, 2, &batch), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_copy_batch_launch(NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  for (int i = 0; i < 64; i++) CHECK(dst[i] == 0xCD);

  /* Addresses where no memory can be (the first page): refused before anything is copied, by the
   * one-shot and the prepared batch, naming the segment, the side and the address. */
  refit_segment near_zero[2] = {check_contiguous(src, dst, 8), check_contiguous((void *)(uintptr_t)0x10, dst + 8, 8)};
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, near_zero, 2, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "segment 1: its source [0x10") != NULL);
  CHECK(strstr(refit_last_error_message(), "first page") != NULL);
  near_zero[1] = check_contiguous(src, (void *)(uintptr_t)0xff8, 16);
  CHECK_STATUS(refit_copy_batch(group, 0, NULL, near_zero, 2, REFIT_COPY_CHECKED), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "destination") != NULL);
  CHECK_STATUS(refit_copy_batch_prepare(group, 1, near_zero, 2, 0, &untouched), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(untouched == (refit_prepared_copy *)0x1);
  for (int i = 0; i < 64; i++) CHECK(dst[i] == 0xCD);

  refit_group_destroy(group);
  CHECK_DONE();
}
