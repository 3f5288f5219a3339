"""refit.quantize_batch (refit_quantize_batch): on the host backend every code and scale equals the
header's arithmetic computed here in Python (f32 quotients by rounding the exact double quotient,
the nearest FP8 value by search, ties to even); bad jobs raise with their status and a message
naming the job and field. With torch and a CUDA device: the GPU's bytes equal torch's float8 cast
of every bf16 value in range, and a torch 128 x 128 block quantizer's codes and scales."""

import bisect
import ctypes
import importlib.util
import math
import random
import struct
import unittest

import refit
from refit import Arithmetic, Backend, Fp8, Granularity, Group, Quantization, QuantizeJob, RefitError, SourceType, Status

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

HAVE_GPU = HAVE_TORCH and torch.cuda.is_available()


def f32(x):
    """x rounded to the nearest f32 (the exact quotient of two f32s, rounded once)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bf16_value(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def fp8_value(target, code):
    m, bias = (3, 7) if target == Fp8.E4M3FN else (2, 15)
    field, mantissa = (code >> m) & ((1 << (7 - m)) - 1), code & ((1 << m) - 1)
    if field == 0:
        return mantissa * 2.0 ** (1 - bias - m)
    return ((1 << m) + mantissa) * 2.0 ** (field - bias - m)


MAX = {Fp8.E4M3FN: 448.0, Fp8.E5M2: 57344.0}
# Each arithmetic's floor under the amax, and whether a quotient is the product by the f32 reciprocal.
FLOOR = {Arithmetic.DIVIDE: f32(1e-10), Arithmetic.DEEPGEMM: f32(1e-4), Arithmetic.VLLM_CHANNEL: 2.0**-9,
         Arithmetic.DEEPGEMM_UE8M0: f32(1e-4), Arithmetic.VLLM_TENSOR: 0.0}
BY_RECIPROCAL = {Arithmetic.DIVIDE: False, Arithmetic.DEEPGEMM: True, Arithmetic.VLLM_CHANNEL: False,
                 Arithmetic.DEEPGEMM_UE8M0: True, Arithmetic.VLLM_TENSOR: True}
# The arithmetic whose NaN quotients give +FP8_MAX (vLLM's fminf / fmaxf clamp), not 0x7f.
NAN_TO_MAX = {Arithmetic.VLLM_TENSOR}
F32_MAX = (2.0 - 2.0**-23) * 2.0**127


def f32_reciprocal(divisor):
    """1 / divisor rounded to f32: +inf for 0 and where it rounds past the largest f32."""
    if divisor == 0:
        return math.inf
    r = 1.0 / divisor
    return math.inf if r >= F32_MAX + 2.0**103 else f32(r)
MAX_CODE = {Fp8.E4M3FN: 0x7E, Fp8.E5M2: 0x7B}
POSITIVE = {t: [fp8_value(t, c) for c in range(MAX_CODE[t] + 1)] for t in MAX}


def cast(target, q):
    """The header's cast: NaN to 0x7f; clamp to +-FP8_MAX; the nearest value, ties to the even code."""
    if math.isnan(q):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, q) < 0 else 0
    a = min(abs(q), MAX[target])
    values = POSITIVE[target]
    i = bisect.bisect_left(values, a)
    if i == len(values) or (i > 0 and (a - values[i - 1] < values[i] - a or (a - values[i - 1] == values[i] - a and (i - 1) % 2 == 0))):
        i -= 1
    return sign | i


def reference(q, bits, rows, cols, stride):
    """Codes (dict (r, c) -> byte) and scales (dict (i, j) -> stored int) of bf16 `bits` (a flat
    list, rows `stride` apart) under Quantization `q`."""
    block_rows, block_cols = q.block_shape(rows, cols)
    grid_rows, grid_cols = q.scale_grid(rows, cols)
    codes, scales = {}, {}
    for i in range(grid_rows):
        for j in range(grid_cols):
            cells = [(r, c) for r in range(i * block_rows, min(rows, (i + 1) * block_rows))
                     for c in range(j * block_cols, min(cols, (j + 1) * block_cols))]
            amax_bits = max((bits[r * stride + c] << 16) & 0x7FFFFFFF for r, c in cells)
            amax = struct.unpack("<f", struct.pack("<I", amax_bits))[0]
            if q.granularity == Granularity.MXFP8:
                if amax_bits >= 0x7F800000:
                    stored, divisor = 0xFF, math.nan
                else:
                    e = -1000 if amax == 0 else math.frexp(amax)[1] - 1
                    e = max(-127, min(127, e - (8 if q.target == Fp8.E4M3FN else 15)))
                    stored, divisor = e + 127, 2.0**e
            elif amax_bits > 0x7F800000:
                stored, divisor = 0x7FFFFFFF, math.nan
            else:
                divisor = f32(max(amax, FLOOR[q.arithmetic]) / MAX[q.target]) if amax != math.inf else math.inf
                if q.arithmetic == Arithmetic.DEEPGEMM_UE8M0 and divisor != math.inf:
                    divisor = 2.0 ** math.ceil(math.log2(divisor))  # scales here lie in 2^-126 .. 2^127
                stored = f32_bits(divisor)
            scales[i, j] = stored
            for r, c in cells:
                x = bf16_value(bits[r * stride + c])
                if math.isnan(divisor) or (math.isinf(x) and math.isinf(divisor)):
                    quotient = math.nan
                elif BY_RECIPROCAL[q.arithmetic] and not math.isinf(divisor):
                    product = x * f32_reciprocal(divisor)  # 0 * inf is NaN
                    quotient = product if math.isnan(product) or math.isinf(product) else f32(product)
                else:
                    quotient = f32(x / divisor)
                nan_to_max = math.isnan(quotient) and q.arithmetic in NAN_TO_MAX
                codes[r, c] = MAX_CODE[q.target] if nan_to_max else cast(q.target, quotient)
    return codes, scales


def random_bits(rng, n):
    """bf16 patterns over many binades, with zeros, -0.0, subnormals, infinities and a NaN or two."""
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.05:
            out.append(rng.choice([0x0000, 0x8000]))
        elif roll < 0.08:
            out.append(rng.randrange(1, 0x80) | rng.choice([0, 0x8000]))
        elif roll < 0.085:
            out.append(rng.choice([0x7F80, 0xFF80, 0x7FC0]))
        else:
            out.append(((rng.randrange(100, 150) << 7) | rng.randrange(128)) | rng.choice([0, 0x8000]))
    return out


class HostQuantizeTest(unittest.TestCase):
    def setUp(self):
        self.group = Group([0], backend=Backend.HOST)

    def tearDown(self):
        self.group.close()

    def run_case(self, q, rows, cols, stride, bits, scale_stride):
        grid_rows, grid_cols = q.scale_grid(rows, cols)
        source = (ctypes.c_uint16 * (rows * stride + 8)).from_buffer_copy(struct.pack(f"<{len(bits)}H", *bits) + bytes(16))
        src = ctypes.addressof(source)
        self.assertEqual(src % 16, 0)
        dst = (ctypes.c_uint8 * (rows * stride))(*([0xAB] * (rows * stride)))
        scales = (ctypes.c_uint8 * (grid_rows * scale_stride * q.scale_size))()
        job = QuantizeJob(q, SourceType.BF16, src, rows, cols, stride, ctypes.addressof(dst), stride,
                          ctypes.addressof(scales), scale_stride)
        refit.quantize_batch(self.group, 0, [job])
        codes, want_scales = reference(q, bits, rows, cols, stride)
        for (r, c), code in codes.items():
            self.assertEqual(dst[r * stride + c], code, (q, r, c, hex(bits[r * stride + c])))
        for r in range(rows):
            for c in range(cols, stride):
                self.assertEqual(dst[r * stride + c], 0xAB)
        raw = bytes(scales)
        for (i, j), stored in want_scales.items():
            at = (i * scale_stride + j) * q.scale_size
            got = raw[at] if q.scale_size == 1 else struct.unpack("<I", raw[at : at + 4])[0]
            self.assertEqual(got, stored, (q, i, j))

    def test_every_granularity_matches_the_headers_arithmetic(self):
        rng = random.Random(7)
        rows, cols, stride = 37, 72, 80
        bits = random_bits(rng, rows * stride)
        for target in (Fp8.E4M3FN, Fp8.E5M2):
            for q, scale_stride in (
                (Quantization(target, Granularity.BLOCK, (16, 32)), 4),
                (Quantization(target, Granularity.ROW), 1),
                (Quantization(target, Granularity.TENSOR), 1),
                (Quantization(target, Granularity.MXFP8), 3),
            ):
                with self.subTest(q=q):
                    self.run_case(q, rows, cols, stride, bits, scale_stride)

    def test_every_arithmetic_matches_the_headers_arithmetic(self):
        rng = random.Random(8)
        rows, cols, stride = 40, 64, 64
        # Rows over binades from 2^-27 up, so that the floors (1e-10, 1e-4, 2^-9) decide some scales.
        bits = []
        for r in range(rows):
            exponent = 100 + 3 * (r % 10)
            bits += [(exponent << 7 | rng.randrange(128)) | rng.choice([0, 0x8000]) for _ in range(stride)]
        bits[5] = 0x7F80
        bits[-2 * stride:] = [rng.choice([0, 0x8000]) for _ in range(2 * stride)]  # zero blocks
        for arithmetic in Arithmetic:
            for q, scale_stride in (
                (Quantization(Fp8.E4M3FN, Granularity.BLOCK, (4, 32), arithmetic), 2),
                (Quantization(Fp8.E5M2, Granularity.ROW, None, arithmetic), 1),
                (Quantization(Fp8.E4M3FN, Granularity.TENSOR, None, arithmetic), 1),
            ):
                with self.subTest(q=q):
                    self.run_case(q, rows, cols, stride, bits, scale_stride)

    def test_per_tensor_jobs_naming_one_scale_share_it(self):
        # A fused QKV with one scale from three jobs (q, k and v rows in buffers of their own): the
        # codes and the scale equal the header's arithmetic over the fused matrix, which no part alone
        # reaches (v's magnitudes are the largest).
        rng = random.Random(9)
        cols, parts = 40, (24, 8, 8)
        bits = []
        for part, rows in enumerate(parts):
            bits += [((120 + 4 * part + rng.randrange(4)) << 7 | rng.randrange(128)) | rng.choice([0, 0x8000])
                     for _ in range(rows * cols)]
        for arithmetic in (Arithmetic.DIVIDE, Arithmetic.DEEPGEMM):
            q = Quantization(Fp8.E4M3FN, Granularity.TENSOR, None, arithmetic)
            dst = (ctypes.c_uint8 * (sum(parts) * cols))()
            scale = (ctypes.c_uint8 * 4)()
            sources, jobs, first = [], [], 0
            for rows in parts:
                part = bits[first * cols:(first + rows) * cols]
                sources.append((ctypes.c_uint16 * (rows * cols + 8)).from_buffer_copy(
                    struct.pack(f"<{len(part)}H", *part) + bytes(16)))
                jobs.append(QuantizeJob(q, SourceType.BF16, ctypes.addressof(sources[-1]), rows, cols, cols,
                                        ctypes.addressof(dst) + first * cols, cols, ctypes.addressof(scale), 1))
                first += rows
            refit.quantize_batch(self.group, 0, jobs)
            codes, scales = reference(q, bits, sum(parts), cols, cols)
            self.assertEqual(struct.unpack("<I", bytes(scale))[0], scales[0, 0])
            self.assertEqual(bytes(dst), bytes(codes[r, c] for r in range(sum(parts)) for c in range(cols)))
            _, alone = reference(q, bits[:parts[0] * cols], parts[0], cols, cols)
            self.assertNotEqual(alone[0, 0], scales[0, 0], "q alone would have had the fused scale")
        # Sharing takes one target and arithmetic.
        with self.assertRaises(RefitError) as caught:
            q = Quantization(Fp8.E4M3FN, Granularity.TENSOR)
            job = QuantizeJob(q, SourceType.BF16, ctypes.addressof(sources[0]), 8, cols, cols, ctypes.addressof(dst),
                              cols, ctypes.addressof(scale), 1)
            other = QuantizeJob(Quantization(Fp8.E5M2, Granularity.TENSOR), SourceType.BF16, ctypes.addressof(sources[1]),
                                8, cols, cols, ctypes.addressof(dst) + 8 * cols, cols, ctypes.addressof(scale), 1)
            refit.quantize_batch(self.group, 0, [job, other])
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("jobs[1]: it shares jobs[0]'s per-tensor scale", str(caught.exception))

    def test_mxfp8_takes_only_the_default_arithmetic(self):
        q = Quantization(Fp8.E4M3FN, Granularity.MXFP8, None, Arithmetic.DEEPGEMM)
        self.bad(Status.INVALID_ARGUMENT, ["jobs[0]: arithmetic 1 for MXFP8", "REFIT_ARITHMETIC_DIVIDE"], quantization=q,
                 scale_row_stride=8)
        q = Quantization(Fp8.E4M3FN, Granularity.ROW, None, 9)
        self.bad(Status.INVALID_ARGUMENT, ["jobs[0].arithmetic is 9", "_DEEPGEMM_UE8M0 (3)"], quantization=q,
                 scale_row_stride=1)

    def test_zero_blocks_get_the_epsilon_scale(self):
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (8, 8))
        bits = [0x8000 if i == 3 else 0 for i in range(64)]
        self.run_case(q, 8, 8, 8, bits, 1)

    def bad(self, status, words, **changes):
        fields = dict(quantization=Quantization(), source_type=SourceType.BF16, src=1 << 20, rows=256, cols=256,
                      src_row_stride=256, dst=1 << 24, dst_row_stride=256, scales=1 << 28, scale_row_stride=2)
        fields.update(changes)
        with self.assertRaises(RefitError) as caught:
            refit.quantize_batch(self.group, 0, [QuantizeJob(**fields)])
        self.assertEqual(caught.exception.status, status)
        for word in words:
            self.assertIn(word, str(caught.exception))

    def test_bad_jobs_raise_with_what_is_wrong(self):
        self.bad(Status.INVALID_ARGUMENT, ["jobs[0].quantization.target is 7"], quantization=Quantization(7))
        self.bad(Status.INVALID_ARGUMENT, ["REFIT_QUANT_NONE"], quantization=Quantization(granularity=Granularity.NONE))
        self.bad(Status.INVALID_ARGUMENT, ["block shape is 0 x 128"],
                 quantization=Quantization(granularity=Granularity.BLOCK, block=(0, 128)))
        self.bad(Status.INVALID_ARGUMENT, ["multiple of 8"],
                 quantization=Quantization(granularity=Granularity.BLOCK, block=(128, 100)))
        self.bad(Status.INVALID_ARGUMENT, ["only Granularity.BLOCK"],
                 quantization=Quantization(granularity=Granularity.ROW, block=(1, 8)))
        self.bad(Status.INVALID_ARGUMENT, ["source_type is 9"], source_type=9)
        self.bad(Status.INVALID_ARGUMENT, ["x 4294967281 is too large", "columns up to 2^32 - 16"],
                 cols=(1 << 32) - 15, src_row_stride=1 << 32, dst_row_stride=1 << 32)
        self.bad(Status.INVALID_ARGUMENT, ["misaligned source rows"], src=(1 << 20) + 8)
        self.bad(Status.INVALID_ARGUMENT, ["dst_row_stride 200 is below cols 256"], dst_row_stride=200)
        self.bad(Status.INVALID_ARGUMENT, ["scale_row_stride 1"], scale_row_stride=1)
        self.bad(Status.INVALID_ARGUMENT, ["src is 0"], src=0)
        self.bad(Status.INVALID_ARGUMENT, ["src = -1"], src=-1)
        self.bad(Status.OVERLAP, ["jobs[0]'s destination and jobs[0]'s scales overlap"], scales=(1 << 24) + 64)
        with self.assertRaises(RefitError) as caught:
            refit.quantize_batch(self.group, 1, [])
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        refit.quantize_batch(self.group, 0, [])  # nothing to do


class FakeTensor:
    """The parts of a torch tensor tensor_job reads, over a ctypes buffer."""

    def __init__(self, buffer, shape, dtype, element_size, strides=None):
        self.buffer, self.shape, self.dtype, self._size = buffer, shape, dtype, element_size
        self._strides = strides or (tuple(shape[1:]) + (1,) if len(shape) == 2 else (1,))

    def data_ptr(self):
        return ctypes.addressof(self.buffer)

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def element_size(self):
        return self._size

    def numel(self):
        return math.prod(self.shape)


class TensorJobTest(unittest.TestCase):
    def test_a_job_from_tensors_quantizes_as_the_reference(self):
        group = Group([0], backend=Backend.HOST)
        rng = random.Random(3)
        rows, cols = 4, 256
        bits = random_bits(rng, rows * cols)
        raw = (ctypes.c_uint16 * (rows * cols + 8)).from_buffer_copy(struct.pack(f"<{len(bits)}H", *bits) + bytes(16))
        out = (ctypes.c_uint8 * (rows * cols))()
        scales = (ctypes.c_float * 2)()
        q = Quantization()
        job = refit.tensor_job(
            FakeTensor(raw, (rows, cols), "torch.bfloat16", 2),
            FakeTensor(out, (rows, cols), "torch.uint8", 1),
            FakeTensor(scales, (1, 2), "torch.float32", 4),
            q,
        )
        self.assertEqual((job.rows, job.cols, job.src_row_stride, job.dst_row_stride, job.scale_row_stride), (4, 256, 256, 256, 2))
        refit.quantize_batch(group, 0, [job])
        codes, want_scales = reference(q, bits, rows, cols, cols)
        self.assertEqual([out[r * cols + c] for r, c in sorted(codes)], [codes[k] for k in sorted(codes)])
        self.assertEqual([f32_bits(v) for v in scales], [want_scales[0, 0], want_scales[0, 1]])
        group.close()

    def test_tensors_that_cannot_make_a_job_are_refused(self):
        raw = (ctypes.c_uint8 * 4096)()
        source = FakeTensor(raw, (4, 256), "torch.bfloat16", 2)
        out = FakeTensor(raw, (4, 256), "torch.uint8", 1)
        scales = FakeTensor(raw, (1, 2), "torch.float32", 4)
        cases = (
            ((FakeTensor(raw, (4, 256), "torch.int32", 4), out, scales), "source dtype"),
            ((source, FakeTensor(raw, (4, 128), "torch.uint8", 1), scales), "same 2-D shape"),
            ((source, FakeTensor(raw, (4, 256), "torch.bfloat16", 2), scales), "one byte per element"),
            ((source, out, FakeTensor(raw, (1, 1), "torch.float32", 4)), "scale grid needs 1 x 2"),
            ((FakeTensor(raw, (4, 256), "torch.bfloat16", 2, (512, 2)), out, scales), "not contiguous"),
        )
        for arguments, words in cases:
            with self.subTest(words=words), self.assertRaises(RefitError) as caught:
                refit.tensor_job(*arguments)
            self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn(words, str(caught.exception))


@unittest.skipUnless(HAVE_GPU, "needs torch with a CUDA device")
class TorchQuantizeTest(unittest.TestCase):
    def setUp(self):
        self.group = Group([torch.cuda.current_device()])

    def tearDown(self):
        self.group.close()

    def quantize(self, x, q, grid):
        out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        scales = torch.empty(grid, dtype=torch.uint8 if q.scale_size == 1 else torch.float32, device=x.device)
        refit.quantize_batch(self.group, 0, [refit.tensor_job(x, out, scales, q)], torch.cuda.current_stream())
        torch.cuda.synchronize()
        return out, scales

    def test_the_cast_of_every_bf16_value_in_range_equals_torchs(self):
        every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
        for target, dtype in ((Fp8.E4M3FN, torch.float8_e4m3fn), (Fp8.E5M2, torch.float8_e5m2)):
            values = every[every.float().abs() <= MAX[target]]
            values = torch.cat([torch.tensor([MAX[target]], dtype=torch.bfloat16, device="cuda"), values])
            cols = 64
            values = torch.cat([values, values.new_zeros((-values.numel()) % cols)]).view(-1, cols)
            # Per tensor with amax FP8_MAX: scale 1, every code the cast of the element itself.
            out, scales = self.quantize(values, Quantization(target, Granularity.TENSOR), (1, 1))
            self.assertEqual(scales.item(), 1.0)
            want = values.float().to(dtype).view(torch.uint8)
            mismatch = (out != want).nonzero()
            self.assertEqual(mismatch.numel(), 0, f"{target}: first mismatches {mismatch[:5].tolist()}")

    def test_block_quantization_equals_a_torch_block_quantizer(self):
        torch.manual_seed(0)
        rows, cols = 384, 640
        x = (torch.randn(rows, cols, device="cuda") * torch.logspace(-8, 8, rows, base=2, device="cuda")[:, None]).to(torch.bfloat16)
        x[128:256, 256:384] = 0
        out, scales = self.quantize(x, Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128)), (3, 5))
        blocks = x.float().view(3, 128, 5, 128)
        amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-10)
        # Divisions by tensors: torch divides by a CPU scalar as a multiplication by its reciprocal.
        want_scales = amax / torch.full_like(amax, 448.0)
        quotient = blocks / want_scales[:, None, :, None]
        want = quotient.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).view(rows, cols)
        self.assertTrue(torch.equal(scales.view(torch.int32), want_scales.view(torch.int32)))
        self.assertEqual((out != want).sum().item(), 0)

    def test_the_deepgemm_arithmetic_equals_a_torch_reciprocal_block_quantizer(self):
        # As DeepGEMM's per_block_cast_to_fp8 (vLLM's online block quantization) computes on the GPU:
        # the amax floored at 1e-4, the quotient a product by the scale's reciprocal.
        torch.manual_seed(1)
        rows, cols = 384, 640
        x = (torch.randn(rows, cols, device="cuda") * torch.logspace(-20, 8, rows, base=2, device="cuda")[:, None]).to(torch.bfloat16)
        x[128:256, 256:384] = 0
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DEEPGEMM)
        out, scales = self.quantize(x, q, (3, 5))
        blocks = x.float().view(3, 128, 5, 128)
        want_scales = blocks.abs().amax(dim=(1, 3)).clamp(1e-4) / torch.full((3, 5), 448.0, device="cuda")
        want = (blocks * (1.0 / want_scales)[:, None, :, None]).to(torch.float8_e4m3fn).view(torch.uint8).view(rows, cols)
        self.assertTrue(torch.equal(scales.view(torch.int32), want_scales.view(torch.int32)))
        self.assertEqual((out != want).sum().item(), 0)
        divide, _ = self.quantize(x, Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128)), (3, 5))
        self.assertGreater((divide != want).sum().item(), 0)



class QuantizedNeedTest(unittest.TestCase):
    """A quantized need planned and run on the host backend: a 2 x 32 x 64 bf16 tensor offered in two
    shards over two devices, received as codes and scales, checked element by element against this
    file's own reference quantizer over each whole matrix."""

    ROWS, COLS, MATRICES = 32, 64, 2

    def setUp(self):
        self.group = Group([0, 1], backend=Backend.HOST)
        rng = random.Random(21)
        self.bits = random_bits(rng, self.MATRICES * self.ROWS * self.COLS)
        self.keep = []

    def tearDown(self):
        self.group.close()

    def buffer(self, size, fill=0):
        memory = (ctypes.c_uint8 * (size + 16))(*([fill] * (size + 16)))
        self.keep.append(memory)
        return ctypes.addressof(memory) + (-ctypes.addressof(memory)) % 16

    def shard(self, table, tensor, device, lo, ext):
        """Offers the box `lo`/`ext` of the tensor from its own buffer on `device`."""
        words = []
        for m in range(lo[0], lo[0] + ext[0]):
            for r in range(lo[1], lo[1] + ext[1]):
                for c in range(lo[2], lo[2] + ext[2]):
                    words.append(self.bits[(m * self.ROWS + r) * self.COLS + c])
        addr = self.buffer(2 * len(words))
        ctypes.memmove(addr, struct.pack(f"<{len(words)}H", *words), 2 * len(words))
        table.add_offer(tensor, 0, device, addr, lo, ext)

    def run_need(self, q, cut_dim, cut_at, staging, commit=refit.Commit.DIRECT):
        rows, cols, matrices = self.ROWS, self.COLS, self.MATRICES
        table = refit.Table()
        tensor = table.add_tensor("w", [matrices, rows, cols], 2)
        first_ext = [matrices, rows, cols]
        first_ext[cut_dim] = cut_at
        second_lo = [0, 0, 0]
        second_lo[cut_dim] = cut_at
        second_ext = [matrices, rows, cols]
        second_ext[cut_dim] -= cut_at
        self.shard(table, tensor, 0, [0, 0, 0], first_ext)
        self.shard(table, tensor, 1, second_lo, second_ext)
        grid_rows, grid_cols = q.scale_grid(rows, cols)
        codes = self.buffer(matrices * rows * cols, 0xAB)
        scales = self.buffer(matrices * grid_rows * grid_cols * q.scale_size, 0xAB)
        stage = self.buffer(2 * matrices * rows * cols) if staging else 0
        table.add_quantized_need(tensor, 0, 0, codes, [0, 0, 0], [matrices, rows, cols], [rows * cols, cols, 1], q,
                                 SourceType.BF16, scales, grid_cols, grid_rows * grid_cols, stage)
        plan = refit.Plan.build([table])
        stats = plan.stats
        routes = plan.quant_routes()
        path = refit.QuantPath.STAGED if staging else refit.QuantPath.IN_PLACE
        self.assertTrue(routes and all(r.path == path and r.tensor == "w" and r.need == 0 for r in routes), routes)
        self.assertEqual(sum(r.elements for r in routes), matrices * rows * cols)
        # In place, each device quantizes its own shard; staged, the receiver (device 0) all of it.
        runners = {r.runner_device for r in routes}
        self.assertEqual(runners, {0} if staging else {0, 1})
        executor = plan.executor(self.group, 0, commit=commit)
        # Memory held beside staging_limit: codes and scales quantized in place are staged until the
        # commit (each job's region padded to 16 bytes), and verify quantizes every job once more.
        codes_and_scales = matrices * rows * cols + matrices * grid_rows * grid_cols * q.scale_size
        staged_in_place = commit == refit.Commit.STAGED and not staging
        for verify, copies in ((False, int(staged_in_place)), (True, int(staged_in_place) + 1)):
            info = (plan.executor(self.group, 0, commit=commit, verify=True) if verify else executor).info()
            self.assertGreaterEqual(info.quantization_bytes, copies * codes_and_scales, (verify, info))
            self.assertLessEqual(info.quantization_bytes, copies * (codes_and_scales + 1024), (verify, info))
            self.assertEqual(info.landing_bytes, 0)
        ran = executor.run()
        done = ran.quantized_elements + (executor.commit().quantized_elements if commit == refit.Commit.STAGED else 0)
        self.assertEqual(done, matrices * rows * cols)
        got_codes = ctypes.string_at(codes, matrices * rows * cols)
        got_scales = ctypes.string_at(scales, matrices * grid_rows * grid_cols * q.scale_size)
        for m in range(matrices):
            want_codes, want_scales = reference(q, self.bits[m * rows * cols:], rows, cols, cols)
            for (r, c), code in want_codes.items():
                self.assertEqual(got_codes[(m * rows + r) * cols + c], code, (q, m, r, c))
            for (i, j), stored in want_scales.items():
                at = (m * grid_rows * grid_cols + i * grid_cols + j) * q.scale_size
                value = got_scales[at] if q.scale_size == 1 else struct.unpack("<I", got_scales[at:at + 4])[0]
                self.assertEqual(value, stored, (q, m, i, j))
        return stats

    def test_blocks_whole_in_each_shard_are_quantized_in_place(self):
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (16, 32))
        for commit in (refit.Commit.DIRECT, refit.Commit.STAGED):
            stats = self.run_need(q, 1, 16, staging=False, commit=commit)
            self.assertEqual((stats.quantized_needs, stats.quantized_staged_bytes), (1, 0))
            self.assertEqual(stats.quantized_direct_bytes, 2 * self.MATRICES * self.ROWS * self.COLS)

    def test_the_needs_arithmetic_reaches_its_codes_and_scales(self):
        # UE8M0 scales are powers of two, so every scale tells this arithmetic from the default one.
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (16, 32), Arithmetic.DEEPGEMM_UE8M0)
        self.run_need(q, 1, 16, staging=False)
        self.run_need(Quantization(Fp8.E5M2, Granularity.ROW, None, Arithmetic.VLLM_CHANNEL), 2, 16, staging=True)

    def test_a_need_with_an_arithmetic_its_granularity_does_not_take_is_refused(self):
        table = refit.Table()
        tensor = table.add_tensor("w", [self.ROWS, self.COLS], 2)
        for q, words in ((Quantization(Fp8.E4M3FN, Granularity.MXFP8, None, Arithmetic.DEEPGEMM), "arithmetic 1 for MXFP8"),
                         (Quantization(Fp8.E4M3FN, Granularity.ROW, None, 5), "quantization->arithmetic is 5")):
            with self.subTest(q=q), self.assertRaises(RefitError) as caught:
                table.add_quantized_need(tensor, 0, 0, 1 << 20, [0, 0], [self.ROWS, self.COLS], [self.COLS, 1], q,
                                         SourceType.BF16, 1 << 24, 1, self.ROWS * 2, 0)
            self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn(words, str(caught.exception))

    def test_blocks_across_shards_go_through_staging(self):
        for q in (Quantization(Fp8.E5M2, Granularity.ROW), Quantization(Fp8.E4M3FN, Granularity.MXFP8),
                  Quantization(Fp8.E4M3FN, Granularity.TENSOR)):
            with self.subTest(q=q):
                stats = self.run_need(q, 2, 16 if q.granularity != Granularity.MXFP8 else 48, staging=True)
                self.assertEqual(stats.quantized_direct_bytes, 0)
                self.assertEqual(stats.quantized_staged_bytes, 2 * self.MATRICES * self.ROWS * self.COLS)

    def test_blocks_whole_in_another_process_are_quantized_by_that_process(self):
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (16, 32))
        rows, cols, matrices = self.ROWS, self.COLS, self.MATRICES
        table = refit.Table()
        tensor = table.add_tensor("w", [matrices, rows, cols], 2)
        addr = self.buffer(2 * matrices * rows * cols)
        table.add_offer(tensor, 1, 0, addr, [0, 0, 0], [matrices, rows, cols])
        grid_rows, grid_cols = q.scale_grid(rows, cols)
        codes = self.buffer(matrices * rows * cols)
        scales = self.buffer(matrices * grid_rows * grid_cols * q.scale_size)
        table.add_quantized_need(tensor, 0, 0, codes, [0, 0, 0], [matrices, rows, cols], [rows * cols, cols, 1], q,
                                 SourceType.BF16, scales, grid_cols, grid_rows * grid_cols, 0)
        plan = refit.Plan.build([table])
        routes = plan.quant_routes()
        self.assertEqual([(r.path, r.runner_rank, r.receiver_rank) for r in routes], [(refit.QuantPath.SENDER, 1, 0)])
        stats = plan.stats
        self.assertEqual((stats.quantized_sent_bytes, stats.quantized_direct_bytes, stats.quantized_staged_bytes),
                         (2 * matrices * rows * cols, 0, 0))
        # The codes cross processes: an executor without a communicator refuses, naming the tensor.
        with self.assertRaises(RefitError) as caught:
            plan.executor(self.group, 0)
        self.assertEqual(caught.exception.status, Status.UNSUPPORTED)
        self.assertIn("'w'", str(caught.exception))

    def test_a_need_without_a_path_is_refused_naming_the_tensor(self):
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (16, 32))
        with self.assertRaises(RefitError) as caught:
            self.run_need(q, 1, 8, staging=False)
        self.assertEqual(caught.exception.status, Status.UNSUPPORTED)
        self.assertIn("'w'", str(caught.exception))
        table = refit.Table()
        tensor = table.add_tensor("w", [4, 64], 2)
        with self.assertRaises(RefitError) as caught:
            table.add_quantized_need(tensor, 0, 0, 1 << 20, [0, 0], [4, 64], [64, 1], "block", SourceType.BF16, 1 << 24, 1)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            table.add_quantized_need(tensor, 0, 0, 1 << 20, [0, 0], [4, 64], [64, 2], Quantization(), SourceType.BF16,
                                     1 << 24, 1)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("contiguous", str(caught.exception))

    def test_shards_on_two_devices_sharing_an_amax_key_take_the_whole_matrix_scale(self):
        # Matrix 0 of the tensor, its rows split between devices 0 and 1 (each with its own scale,
        # both keyed alike), quantized per tensor from the whole matrix offered on device 1; or
        # offered in the same halves on the two devices, each quantizing its own with the amax
        # exchanged between them.
        q = Quantization(Fp8.E4M3FN, Granularity.TENSOR, None, Arithmetic.VLLM_TENSOR)
        rows, cols, half = self.ROWS, self.COLS, self.ROWS // 2
        # Finite values, the second half's binades above the first's: its amax is the matrix's.
        rng = random.Random(5)
        bits = [(rng.randrange(100, 120) + (10 if i >= half * cols else 0)) << 7 | rng.randrange(128)
                | rng.choice([0, 0x8000]) for i in range(rows * cols)]
        for keyed, split in ((True, False), (False, False), (True, True)):
            table = refit.Table()
            tensor = table.add_tensor("w", [rows, cols], 2)
            addr = self.buffer(2 * rows * cols)
            ctypes.memmove(addr, struct.pack(f"<{rows * cols}H", *bits), 2 * rows * cols)
            if split:
                for device in (0, 1):
                    table.add_offer(tensor, 0, device, addr + 2 * device * half * cols, [device * half, 0], [half, cols])
            else:
                table.add_offer(tensor, 0, 1, addr, [0, 0], [rows, cols])
            codes = [self.buffer(half * cols, 0xAB) for _ in range(2)]
            scales = [self.buffer(4, 0xAB) for _ in range(2)]
            for device in (0, 1):
                table.add_quantized_need(tensor, 0, device, codes[device], [device * half, 0], [half, cols], [cols, 1],
                                         q, SourceType.BF16, scales[device], 1)
                if keyed:
                    table.share_amax(0, scales[device], 0xC0FFEE)
            plan = refit.Plan.build([table])
            runners = {0, 1} if split else {1}
            self.assertEqual({(r.path, r.runner_device) for r in plan.quant_routes()},
                             {(refit.QuantPath.IN_PLACE, d) for d in runners})
            self.assertEqual({r.amax_exchanged for r in plan.quant_routes()}, {split})
            plan.executor(self.group, 0).run()
            want_codes, want_scales = reference(q, bits, rows, cols, cols)
            for device in (0, 1):
                got = struct.unpack("<I", ctypes.string_at(scales[device], 4))[0]
                if keyed:
                    self.assertEqual(got, want_scales[(0, 0)], device)
                    got_codes = ctypes.string_at(codes[device], half * cols)
                    for r in range(half):
                        for c in range(cols):
                            self.assertEqual(got_codes[r * cols + c], want_codes[(device * half + r, c)], (device, r, c))
                elif device == 0:
                    # Not vacuous: alone, a half has another scale here.
                    self.assertNotEqual(got, want_scales[(0, 0)])
        with self.assertRaises(RefitError) as caught:
            refit.Table().share_amax(0, 1 << 20, 0)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("key 0", str(caught.exception))


class HostArray:
    """A ctypes buffer described as a tensor (what refit.tensor reads), on simulated device 0."""

    class _Device:
        type, index = "cpu", None

    def __init__(self, shape, element_size, dtype, fill=0):
        self.shape, self._size, self.dtype, self.device = tuple(shape), element_size, dtype, self._Device()
        self.buffer = (ctypes.c_uint8 * (math.prod(shape) * element_size + 16))(*([fill] * (math.prod(shape) * element_size + 16)))
        self._at = ctypes.addressof(self.buffer) + (-ctypes.addressof(self.buffer)) % 16
        strides, step = [], 1
        for e in reversed(self.shape):
            strides.insert(0, step)
            step *= e
        self._strides = tuple(strides)

    def data_ptr(self):
        return self._at

    def stride(self):
        return self._strides

    def element_size(self):
        return self._size

    def bytes(self):
        return ctypes.string_at(self._at, math.prod(self.shape) * self._size)


class TensorQuantizedNeedTest(unittest.TestCase):
    """refit.tensor.add_tensor_quantized_need: codes, scales and staging read from tensors; the codes
    and scales a refit installs equal refit_quantize_batch's over each matrix of the box."""

    def test_codes_and_scales_from_tensors(self):
        from refit.tensor import add_tensor_offer, add_tensor_quantized_need

        group = Group([0], backend=Backend.HOST)
        rng = random.Random(5)
        experts, rows, cols = 3, 40, 64
        source = HostArray((experts, rows, cols), 2, "torch.bfloat16")
        ctypes.memmove(source.data_ptr(), struct.pack(f"<{experts * rows * cols}H", *random_bits(rng, experts * rows * cols)),
                       2 * experts * rows * cols)
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (16, 32))
        grid = q.scale_grid(rows, cols)
        codes = HostArray((experts, rows, cols), 1, "torch.float8_e4m3fn", 0xAB)
        scales = HostArray((experts,) + grid, 4, "torch.float32", 0xAB)
        table = refit.Table()
        add_tensor_offer(table, "experts", source, 0, device=0)
        add_tensor_quantized_need(table, "experts", codes, scales, 0, q, device=0)
        plan = refit.Plan.build([table])
        self.assertEqual([r.path for r in plan.quant_routes()], [refit.QuantPath.IN_PLACE])
        plan.executor(group, 0).run()
        want_codes = HostArray((experts, rows, cols), 1, "torch.uint8", 0xAB)
        want_scales = HostArray((experts,) + grid, 4, "torch.float32", 0xAB)
        jobs = [
            QuantizeJob(q, SourceType.BF16, source.data_ptr() + 2 * e * rows * cols, rows, cols, cols,
                        want_codes.data_ptr() + e * rows * cols, cols, want_scales.data_ptr() + 4 * e * grid[0] * grid[1],
                        grid[1])
            for e in range(experts)
        ]
        refit.quantize_batch(group, 0, jobs)
        self.assertEqual(codes.bytes(), want_codes.bytes())
        self.assertEqual(scales.bytes(), want_scales.bytes())
        # What cannot describe the need is refused, naming it.
        from refit.tensor import add_tensor_quantized_need as add

        for bad, word in (
            (dict(codes=source), "FP8 codes take 1"),
            (dict(scales=HostArray((experts,) + grid, 2, "torch.float16")), "scales"),
            (dict(scales=HostArray((1,) + grid, 4, "torch.float32")), "span"),
            (dict(staging=HostArray((1, 1, 8), 2, "torch.bfloat16")), "staging"),
            (dict(source_dtype="int8"), "source_dtype"),
            (dict(quantization="block"), "quantization"),
        ):
            arguments = dict(codes=codes, scales=scales, quantization=q)
            arguments.update(bad)
            with self.subTest(word=word), self.assertRaises(RefitError) as caught:
                add(refit.Table(), "experts", arguments["codes"], arguments["scales"], 0, arguments["quantization"],
                    device=0, **{k: v for k, v in bad.items() if k in ("staging", "source_dtype")})
            self.assertIn(word, str(caught.exception))
        group.close()

if __name__ == "__main__":
    unittest.main()
