/* refit_quantize_batch on the host backend (CI has no GPU): every FP8 code and scale equals the
 * header's arithmetic computed here from its text (amax, scale = max(amax, 1e-10) / 448 or MX's 2^e,
 * DEEPGEMM's and DEEPGEMM_UE8M0's floor, reciprocal and power-of-two scales,
 * the nearest FP8 value of x / scale found by search over all codes, ties to even, saturating); every
 * bad argument has its status and message, and a refused batch writes nothing; per-tensor jobs naming
 * one scale share it (the amax of both), and sharing with another target is refused. */
#include <math.h>
#include <stdint.h>

#include "check.h"

/* vLLM's fmaxf(-448, fminf(q, 448)) written out (C's fminf returns the operand that is not NaN, so a
 * NaN q gives 448). */
static float vllm_clamp(float q) {
  if (q != q) return 448.0f;
  return q > 448.0f ? 448.0f : q < -448.0f ? -448.0f : q;
}

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* 2^e exactly (no libm: the C tests link only librefit). */
static double pow2(int e) {
  double x = 1.0;
  for (; e > 0; e--) x *= 2.0;
  for (; e < 0; e++) x /= 2.0;
  return x;
}
static double absd(double x) { return x < 0 ? -x : x; }

static float from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
static uint32_t to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

/* The value of an e4m3fn code (NaN for 0x7f / 0xff). */
static double e4m3(uint8_t code) {
  int field = (code >> 3) & 15, mantissa = code & 7;
  double sign = (code & 0x80) ? -1.0 : 1.0;
  if (field == 15 && mantissa == 7) return NAN;
  if (field == 0) return sign * mantissa * pow2(-9);
  return sign * (8 + mantissa) * pow2(field - 10);
}

/* The header's cast: the nearest finite code of the clamped value, ties to the even code. */
static uint8_t cast(float q) {
  if (isnan(q)) return 0x7f;
  double x = q > 448.0f ? 448.0 : (q < -448.0f ? -448.0 : (double)q);
  int negative = signbit(q) != 0;
  uint8_t best = 0;
  double best_distance = INFINITY;
  for (int c = 0; c < 256; c++) {
    double v = e4m3((uint8_t)c);
    if (isnan(v) || ((c & 0x80) != 0) != negative) continue;
    double d = absd(v - x);
    if (d < best_distance || (d == best_distance && (c & 1) == 0)) {
      best = (uint8_t)c;
      best_distance = d;
    }
  }
  return best;
}

#define ROWS 130
#define COLS 136
#define STRIDE 144

static uint16_t source[ROWS * STRIDE] __attribute__((aligned(16)));
static uint8_t codes[ROWS * STRIDE];
static float scales[2 * 2];
static uint8_t mx_scales[ROWS * 5];

static float element(int r, int c) { return from_bits((uint32_t)source[r * STRIDE + c] << 16); }

/* The amax of 128 x 128 block (i, j): the largest f32 bit pattern of |x| (NaN above infinity). */
static float block_amax(int i, int j) {
  uint32_t amax = 0;
  for (int r = i * 128; r < ROWS && r < (i + 1) * 128; r++) {
    for (int c = j * 128; c < COLS && c < (j + 1) * 128; c++) {
      uint32_t m = to_bits(element(r, c)) & 0x7fffffffu;
      if (m > amax) amax = m;
    }
  }
  return from_bits(amax);
}

int main(void) {
  const int32_t devices[1] = {0};
  refit_group *group = check_host_group(devices, 1);

  /* Values over many binades, a zero block (rows 128.., cols 128..), a -0.0 and an infinity. */
  uint32_t seed = 12345;
  for (int r = 0; r < ROWS; r++) {
    for (int c = 0; c < STRIDE; c++) {
      seed = seed * 1103515245u + 12345u;
      float x = (float)((1.0 + (double)(seed >> 16 & 0xff) / 256.0) * pow2((int)(seed >> 24) % 24 - 12));
      if (seed & 0x10) x = -x;
      if (r >= 128 && c >= 128) x = 0.0f;
      source[r * STRIDE + c] = (uint16_t)(to_bits(x) >> 16);
    }
  }
  source[129 * STRIDE + 130] = 0x8000; /* -0.0 */
  source[3 * STRIDE + 133] = 0x7f80;   /* +inf in block (0, 1) */

  refit_quantize_job job;
  memset(&job, 0, sizeof job);
  job.quantization.target = REFIT_FP8_E4M3FN;
  job.quantization.granularity = REFIT_QUANT_BLOCK;
  job.quantization.block_rows = 128;
  job.quantization.block_cols = 128;
  job.source_type = REFIT_SOURCE_BF16;
  job.src = addr(source);
  job.rows = ROWS;
  job.cols = COLS;
  job.src_row_stride = STRIDE;
  job.dst = addr(codes);
  job.dst_row_stride = STRIDE;
  job.scales = addr(scales);
  job.scale_row_stride = 2;
  memset(codes, 0xab, sizeof codes);
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));

  for (int i = 0; i < 2; i++) {
    for (int j = 0; j < 2; j++) {
      float a = block_amax(i, j);
      float scale = (a > 1e-10f ? a : 1e-10f) / 448.0f;
      CHECK(to_bits(scales[i * 2 + j]) == to_bits(scale));
      for (int r = i * 128; r < ROWS && r < (i + 1) * 128; r++) {
        for (int c = j * 128; c < COLS && c < (j + 1) * 128; c++) {
          uint8_t want = cast(element(r, c) / scale);
          if (codes[r * STRIDE + c] != want) {
            printf("(%d, %d): %#x, expected %#x\n", r, c, codes[r * STRIDE + c], want);
            CHECK(0);
            goto done;
          }
        }
        for (int c = COLS; c < STRIDE; c++) CHECK(codes[r * STRIDE + c] == 0xab); /* padding untouched */
      }
    }
  }
done:
  CHECK(isinf(scales[1]));
  CHECK(codes[3 * STRIDE + 133] == 0x7f); /* inf / inf */
  CHECK(codes[129 * STRIDE + 130] == 0x80);
  CHECK(codes[129 * STRIDE + 129] == 0x00);
  CHECK(to_bits(scales[3]) == to_bits(1e-10f / 448.0f));

  /* The same blocks under REFIT_ARITHMETIC_DEEPGEMM: the amax floored at 1e-4 (the zero block's
   * scale tells it from the default's), each quotient the product by the scale's f32 reciprocal;
   * under _DEEPGEMM_UE8M0 each finite scale first rounded up to a power of two (its exponent field,
   * plus one when a mantissa bit is set, clamped to 1..254). */
  const uint32_t reciprocal_arithmetics[2] = {REFIT_ARITHMETIC_DEEPGEMM, REFIT_ARITHMETIC_DEEPGEMM_UE8M0};
  for (int k = 0; k < 2; k++) {
    job.arithmetic = reciprocal_arithmetics[k];
    CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
    for (int i = 0; i < 2; i++) {
      for (int j = 0; j < 2; j++) {
        float a = block_amax(i, j);
        float scale = (a > 1e-4f ? a : 1e-4f) / 448.0f;
        if (job.arithmetic == REFIT_ARITHMETIC_DEEPGEMM_UE8M0 && !isinf(scale)) {
          uint32_t bits = to_bits(scale), field = (bits >> 23) + ((bits & 0x7fffffu) != 0);
          scale = from_bits((field < 1 ? 1 : field > 254 ? 254 : field) << 23);
        }
        float reciprocal = 1.0f / scale;
        CHECK(to_bits(scales[i * 2 + j]) == to_bits(scale));
        for (int r = i * 128; r < ROWS && r < (i + 1) * 128; r++) {
          for (int c = j * 128; c < COLS && c < (j + 1) * 128; c++) {
            float x = element(r, c);
            uint8_t want = isinf(scale) ? cast(x / scale) : cast(x * reciprocal);
            CHECK(codes[r * STRIDE + c] == want);
          }
        }
      }
    }
  }
  CHECK(to_bits(scales[3]) == to_bits(pow2(-22))); /* UE8M0: 1e-4 / 448 = 2.2e-7 rounds up to 2^-22 */

  /* REFIT_ARITHMETIC_VLLM_TENSOR (vLLM's online per-tensor weights, here over the same blocks): the
   * amax not floored, each quotient the product by the scale's f32 reciprocal, then vLLM's clamp
   * fmaxf(-448, fminf(q, 448)), which takes a NaN to +448: the zero block (scale 0, 0 * inf) is all
   * 0x7e, and so is the infinity over its block's infinite scale (inf * 0). */
  job.arithmetic = REFIT_ARITHMETIC_VLLM_TENSOR;
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
  for (int i = 0; i < 2; i++) {
    for (int j = 0; j < 2; j++) {
      float scale = block_amax(i, j) / 448.0f, reciprocal = 1.0f / scale;
      CHECK(to_bits(scales[i * 2 + j]) == to_bits(scale));
      for (int r = i * 128; r < ROWS && r < (i + 1) * 128; r++) {
        for (int c = j * 128; c < COLS && c < (j + 1) * 128; c++) {
          CHECK(codes[r * STRIDE + c] == cast(vllm_clamp(element(r, c) * reciprocal)));
        }
      }
    }
  }
  CHECK(to_bits(scales[3]) == 0);
  CHECK(codes[129 * STRIDE + 129] == 0x7e && codes[129 * STRIDE + 130] == 0x7e);
  CHECK(codes[3 * STRIDE + 133] == 0x7e);
  job.arithmetic = REFIT_ARITHMETIC_DIVIDE;

  /* MXFP8 over the same rows: e8m0 = floor(log2(amax)) - 8 + 127 per 32 elements. */
  job.quantization.granularity = REFIT_QUANT_MXFP8;
  job.quantization.block_rows = 0;
  job.quantization.block_cols = 0;
  job.scales = addr(mx_scales);
  job.scale_row_stride = 5;
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
  for (int r = 0; r < ROWS; r++) {
    for (int b = 0; b < 5; b++) {
      uint32_t amax_bits = 0;
      for (int c = b * 32; c < COLS && c < (b + 1) * 32; c++) {
        uint32_t m = to_bits(element(r, c)) & 0x7fffffffu;
        if (m > amax_bits) amax_bits = m;
      }
      float amax = from_bits(amax_bits);
      if (isinf(amax)) {
        CHECK(mx_scales[r * 5 + b] == 0xff);
        continue;
      }
      int e = amax == 0.0f ? -127 : (int)(amax_bits >> 23) - 127 - 8; /* no subnormal amax here */
      if (e < -127) e = -127;
      CHECK(mx_scales[r * 5 + b] == (uint8_t)(e + 127));
      for (int c = b * 32; c < COLS && c < (b + 1) * 32; c++) {
        CHECK(codes[r * STRIDE + c] == cast(element(r, c) / (float)pow2(e)));
      }
    }
  }

  /* Bad arguments: each with its status and a message naming it; nothing is written. */
  refit_quantize_job bad;
  memset(codes, 0xab, sizeof codes);
  job.quantization.granularity = REFIT_QUANT_ROW;
  job.scales = addr(scales);
  job.scale_row_stride = 1;
  job.rows = 4;
  CHECK_STATUS(refit_quantize_batch(NULL, 0, NULL, &job, 1, 0), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, NULL, 1, 0), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs is NULL") != NULL);
  CHECK_OK(refit_quantize_batch(group, 0, NULL, NULL, 0, 0)); /* nothing to do */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &job, SIZE_MAX / 8, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "too large") != NULL);
  CHECK_STATUS(refit_quantize_batch(group, 1, NULL, &job, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &job, 1, 4), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "flags") != NULL);

  bad = job;
  bad.quantization.target = 9;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs[0].quantization.target is 9") != NULL);
  bad = job;
  bad.cols = 4294967281u; /* 2^32 - 15: a row's vectors no longer count in 32 bits */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "x 4294967281 is too large") != NULL);
  bad = job;
  bad.quantization.granularity = REFIT_QUANT_NONE;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "REFIT_QUANT_NONE") != NULL);
  bad = job;
  bad.quantization.block_cols = 128; /* a block shape for REFIT_QUANT_ROW */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "only REFIT_QUANT_BLOCK") != NULL);
  bad = job;
  bad.quantization.granularity = REFIT_QUANT_BLOCK;
  bad.quantization.block_rows = 0;
  bad.quantization.block_cols = 128;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "block shape is 0 x 128") != NULL);
  bad.quantization.block_rows = 128;
  bad.quantization.block_cols = 100;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "multiple of 8") != NULL);
  bad = job;
  bad.source_type = 0;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "source_type is 0") != NULL);
  bad = job;
  bad.arithmetic = 5; /* one past REFIT_ARITHMETIC_VLLM_TENSOR */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs[0].arithmetic is 5") != NULL);
  CHECK(strstr(refit_last_error_message(), "_VLLM_TENSOR (4)") != NULL);
  bad = job;
  bad.quantization.granularity = REFIT_QUANT_MXFP8;
  bad.arithmetic = REFIT_ARITHMETIC_DEEPGEMM;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "MXFP8") != NULL);
  bad.arithmetic = REFIT_ARITHMETIC_VLLM_TENSOR;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "MXFP8") != NULL);
  bad = job;
  bad.src = addr(source) + 2; /* rows must start on 16 bytes */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "misaligned source rows") != NULL);
  bad = job;
  bad.src_row_stride = 137;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "misaligned source rows") != NULL);
  bad = job;
  bad.dst_row_stride = 100; /* a destination too small for its rows */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "dst_row_stride 100 is below cols 136") != NULL);
  bad = job;
  bad.dst = 0;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  /* Memory that is not the device's is refused before anything runs (on the host backend: the first
   * page, where no allocation lies), naming the job and the region. */
  bad = job;
  bad.src = 1024;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs[0]: its source") != NULL);
  bad = job;
  bad.dst = 16;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs[0]: its destination") != NULL);
  bad = job;
  bad.scales = 64;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs[0]: its scales") != NULL);
  bad = job;
  bad.scales = addr(codes) + 16; /* scales inside the destination */
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, &bad, 1, 0), REFIT_STATUS_OVERLAP);
  CHECK(strstr(refit_last_error_message(), "jobs[0]'s destination and jobs[0]'s scales overlap") != NULL);
  refit_quantize_job two[2] = {job, job};
  two[1].scales = addr(mx_scales);
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, two, 2, 0), REFIT_STATUS_OVERLAP);
  CHECK(strstr(refit_last_error_message(), "jobs[1]'s destination") != NULL);
  for (size_t i = 0; i < sizeof codes; i++) {
    if (codes[i] != 0xab) {
      CHECK(0);
      break;
    }
  }

  /* Per-tensor jobs naming one scale share it: rows 4..40 and 40..100 as two jobs, one scale from the
   * amax of both (as a fused QKV from its parts); the codes divided by it. */
  float shared_scale = 0.0f;
  source[70 * STRIDE + 5] = 0x4600; /* 8192, above every other element: the second job's */
  uint32_t amax_first = 0, amax_second = 0, amax_both = 0;
  for (int r = 4; r < 100; r++) {
    for (int c = 0; c < COLS; c++) {
      uint32_t m = to_bits(element(r, c)) & 0x7fffffffu;
      if (m > amax_both) amax_both = m;
      if (r < 40 && m > amax_first) amax_first = m;
      if (r >= 40 && m > amax_second) amax_second = m;
    }
  }
  CHECK(amax_first != amax_second); /* one of the jobs alone would have another scale */
  refit_quantize_job parts[2] = {job, job};
  for (int k = 0; k < 2; k++) {
    int first = k == 0 ? 4 : 40, rows = k == 0 ? 36 : 60;
    parts[k].quantization.granularity = REFIT_QUANT_TENSOR;
    parts[k].quantization.block_rows = 0;
    parts[k].quantization.block_cols = 0;
    parts[k].src = addr(source + first * STRIDE);
    parts[k].rows = (uint64_t)rows;
    parts[k].dst = addr(codes + first * STRIDE);
    parts[k].scales = addr(&shared_scale);
    parts[k].scale_row_stride = 1;
  }
  CHECK_OK(refit_quantize_batch(group, 0, NULL, parts, 2, 0));
  float want_scale = from_bits(amax_both) / 448.0f;
  CHECK(to_bits(shared_scale) == to_bits(want_scale));
  for (int r = 4; r < 100; r++) {
    for (int c = 0; c < COLS; c++) {
      if (codes[r * STRIDE + c] != cast(element(r, c) / want_scale)) {
        CHECK(0);
        r = 100;
        break;
      }
    }
  }
  /* Sharing takes one target and arithmetic. */
  parts[1].quantization.target = REFIT_FP8_E5M2;
  CHECK_STATUS(refit_quantize_batch(group, 0, NULL, parts, 2, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "jobs[1]: it shares jobs[0]'s per-tensor scale") != NULL);

  refit_group_destroy(group);
  CHECK_DONE();
}
