"""refit's quantizing copy against the quantizers of the real vLLM (and SGLang), byte for byte.

vLLM 0.33 quantizes BF16 weights to FP8 online (`quantization="fp8"` on a BF16 checkpoint, and
again after each layerwise reload) with two arithmetics that differ from refit's default
(REFIT_ARITHMETIC_DIVIDE, its per-token-group CUDA kernel's): 128 x 128 blocks through DeepGEMM's
`per_block_cast_to_fp8` (amax floored at 1e-4, each quotient the product by the scale's f32
reciprocal), and per-channel weights through `_fp8_channel_scale` and `_fp8_quant_per_channel` (the
scale floored at 1 / (448 * 512), true division); for DeepGEMM on Blackwell both vLLM and SGLang
round the block scales up to powers of two (UE8M0: REFIT_ARITHMETIC_DEEPGEMM_UE8M0). Here vLLM's own functions run on CPU over bf16
weights spanning many binades (some rows far below the floors, one block all zero), and refit's host
backend quantizes the same bytes with REFIT_ARITHMETIC_DEEPGEMM and _VLLM_CHANNEL: every code and
scale must be equal. The default arithmetic on the same weights must differ from both, or these
cases would not tell the arithmetics apart. Per-tensor online weights (REFIT_ARITHMETIC_VLLM_TENSOR)
take their scale from vLLM's own `weight_amax` and `_fp8_scale` here, and their codes from its
compiled `static_scaled_fp8_quant`, which vLLM's CPU wheel does not ship: fp8_engines' stand-in of its
kernel's arithmetic (times the f32 reciprocal, fmaxf / fminf clamp) takes its place, zero, infinite
and NaN weights included. The GPU kernel equals the host backend on every case, `tests/gpu_quant.rs`.
"""

from __future__ import annotations

import unittest

import torch
from vllm.model_executor.layers.quantization.online import fp8 as online
from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
from vllm.utils.deep_gemm import per_block_cast_to_fp8

import refit
from refit import Arithmetic, Backend, Fp8, Granularity, Group, Quantization, QuantizeJob, SourceType


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 weights whose rows span 2^-16 .. 2^6 (so some blocks' amax lies below 2^-9 and 1e-4),
    with one all-zero 128 x 128 block."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-16, 6, rows, base=2)[:, None]
    w = (torch.randn(rows, cols, generator=generator) * scale).to(torch.bfloat16)
    w[:128, 128:256] = 0
    return w


class VllmQuantizersTest(unittest.TestCase):
    def setUp(self):
        self.group = Group([0], backend=Backend.HOST)

    def tearDown(self):
        self.group.close()

    def refit_quantize(self, w: torch.Tensor, quantization: Quantization):
        rows, cols = w.shape
        grid_rows, grid_cols = quantization.scale_grid(rows, cols)
        codes = torch.zeros(rows, cols, dtype=torch.uint8)
        scales = torch.zeros(grid_rows, grid_cols, dtype=torch.float32)
        job = QuantizeJob(quantization, SourceType.BF16, w.data_ptr(), rows, cols, w.stride(0), codes.data_ptr(),
                          cols, scales.data_ptr(), grid_cols)
        refit.quantize_batch(self.group, 0, [job])
        return codes, scales

    def assert_same_bytes(self, got, want):
        (codes, scales), (want_codes, want_scales) = got, want
        self.assertEqual(tuple(scales.shape), tuple(want_scales.shape))
        scale_mismatch = (scales.view(torch.int32) != want_scales.float().view(torch.int32)).sum().item()
        code_mismatch = (codes != want_codes.view(torch.uint8)).sum().item()
        self.assertEqual((code_mismatch, scale_mismatch), (0, 0), f"of {codes.numel()} codes, {scales.numel()} scales")

    def count_differences(self, got, want) -> int:
        (codes, scales), (want_codes, want_scales) = got, want
        return int((codes != want_codes.view(torch.uint8)).sum() + (scales.view(torch.int32) != want_scales.float().view(torch.int32)).sum())

    def test_deepgemm_arithmetic_equals_vllms_online_block_quantization(self):
        for rows, cols, seed in ((512, 1024, 0), (384, 640, 1)):
            w = weights(rows, cols, seed)
            want_codes, want_scales = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)
            block = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DEEPGEMM)
            with self.subTest(shape=(rows, cols)):
                self.assert_same_bytes(self.refit_quantize(w, block), (want_codes, want_scales))
                divide = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DIVIDE)
                self.assertGreater(self.count_differences(self.refit_quantize(w, divide), (want_codes, want_scales)), 0)

    def test_ue8m0_arithmetic_equals_vllms_and_sglangs_power_of_two_block_scales(self):
        # DeepGEMM's UE8M0 scales (Blackwell): vLLM's per_block_cast_to_fp8 with use_ue8m0, and
        # SGLang's own per_block_cast_to_fp8 (its requantization for DeepGEMM), which always rounds.
        from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8 as sglang_per_block_cast_to_fp8

        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DEEPGEMM_UE8M0)
        for rows, cols, seed in ((512, 1024, 4), (384, 640, 5)):
            w = weights(rows, cols, seed)
            got = self.refit_quantize(w, q)
            with self.subTest(shape=(rows, cols), quantizer="vLLM"):
                self.assert_same_bytes(got, per_block_cast_to_fp8(w, [128, 128], use_ue8m0=True))
            with self.subTest(shape=(rows, cols), quantizer="SGLang"):
                self.assert_same_bytes(got, sglang_per_block_cast_to_fp8(w))
            deepgemm = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DEEPGEMM)
            self.assertGreater(self.count_differences(self.refit_quantize(w, deepgemm), got), 0)

    def test_vllm_channel_arithmetic_equals_vllms_online_per_channel_weights(self):
        # Fp8PtpcOnlineLinearMethod.process_weights_after_loading of an unsharded weight.
        for rows, cols, seed in ((512, 1024, 2), (300, 200, 3)):
            w = weights(rows, cols, seed)
            want_scales = online._fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
            want_codes = online._fp8_quant_per_channel(w, want_scales)
            row = Quantization(Fp8.E4M3FN, Granularity.ROW, None, Arithmetic.VLLM_CHANNEL)
            with self.subTest(shape=(rows, cols)):
                self.assert_same_bytes(self.refit_quantize(w, row), (want_codes, want_scales))
                divide = Quantization(Fp8.E4M3FN, Granularity.ROW, None, Arithmetic.DIVIDE)
                self.assertGreater(self.count_differences(self.refit_quantize(w, divide), (want_codes, want_scales)), 0)

    def test_vllm_tensor_arithmetic_equals_vllms_online_per_tensor_weights(self):
        # Fp8PerTensorOnlineLinearMethod.process_weights_after_loading of an unsharded weight: its
        # amax and scale by vLLM's functions, its codes by the stand-in of its CUDA op.
        import fp8_engines

        zeros = torch.zeros(128, 256, dtype=torch.bfloat16)
        specials = weights(256, 512, 7)
        specials[3, 5], specials[9, 1] = float("inf"), float("-inf")
        tensor = Quantization(Fp8.E4M3FN, Granularity.TENSOR, None, Arithmetic.VLLM_TENSOR)
        for name, w in (("ordinary", weights(512, 1024, 6)), ("ordinary", weights(300, 200, 8)), ("zeros", zeros),
                        ("infinities", specials)):
            scale = online._fp8_scale(weight_amax(w).reshape(1))
            want_codes, _ = fp8_engines.static_scaled_fp8_quant(w, scale)
            with self.subTest(weights=name, shape=tuple(w.shape)):
                self.assert_same_bytes(self.refit_quantize(w, tensor), (want_codes, scale.reshape(1, 1)))
        deepgemm = Quantization(Fp8.E4M3FN, Granularity.TENSOR, None, Arithmetic.DEEPGEMM)
        scale = online._fp8_scale(weight_amax(zeros).reshape(1))
        self.assertGreater(self.count_differences(self.refit_quantize(zeros, deepgemm),
                                                  (fp8_engines.static_scaled_fp8_quant(zeros, scale)[0], scale.reshape(1, 1))), 0)


if __name__ == "__main__":
    unittest.main()
