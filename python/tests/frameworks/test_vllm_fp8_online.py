"""What a vLLM engine that quantizes BF16 weights online (`quantization="fp8_per_block"`) serves,
against refit quantizing each checkpoint tensor's shard on its own, as a quantized need would.

vLLM 0.33 builds the engine's linear layers with Fp8PerBlockOnlineLinearMethod: the checkpoint's
BF16 tensors load into the layers (q, k and v fused into qkv_proj, gate and up into gate_up_proj,
each rank's tensor-parallel shard), then process_weights_after_loading quantizes each layer's
weight as one matrix in 128 x 128 blocks (DeepGEMM's per_block_cast_to_fp8) and hands it to the
FP8 GEMM kernel's own post-processing. refit's quantized needs are boxes of one checkpoint tensor
each: here every shard of every checkpoint tensor is quantized alone with REFIT_ARITHMETIC_DEEPGEMM
into its rows of the layer's codes and scales, and every code and scale must equal the engine's, at
tensor-parallel sizes 1 and 2 (the shards' row counts are multiples of 128, as real models' are).

One stand-in: the GEMM kernel. vLLM's CPU kernels for FP8 need AMX, which this machine lacks, so
kernel selection is replaced by one that returns CutlassFp8BlockScaledMMKernel, the kernel an H100 or
H200 runs these layers with when DeepGEMM is not installed: its weight post-processing (inherited
from Fp8BlockScaledMMLinearKernel) is vLLM's own code and runs here; its GEMM is never called.
Everything else (the layers, the loader, the fusion, the online quantization) is vLLM's own.
"""

from __future__ import annotations

import unittest
from typing import Dict, List, Tuple

import torch

import fp8_engines as fp8
import refit
import vllm_harness as harness
from refit import Arithmetic, Backend, Fp8, Granularity, Group, Quantization, QuantizeJob, SourceType

BLOCK = 128


def loaded(config, parallel: harness.Parallel, rank: int, checkpoint: Dict[str, torch.Tensor]):
    """Rank `rank`'s model with the checkpoint loaded and post-processed by vLLM's own loader."""
    with harness.as_rank(config, parallel, rank, 0):
        return fp8.served(config, checkpoint)


# The checkpoint tensors fused into each layer, in the order of its output rows.
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class VllmFp8OnlineTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kernel = fp8.use_kernel(fp8.cutlass_kernel())
        cls.folder = harness.hf_folder("qwen3-fp8", fp8.qwen3_config())
        generator = torch.Generator().manual_seed(5)
        specs = harness.checkpoint_specs(cls.folder)
        # Weights over several binades per row block, so that blocks' scales differ widely.
        cls.checkpoint = {}
        for name, (shape, _) in specs.items():
            t = torch.randn(shape, generator=generator)
            if len(shape) == 2:
                t = t * torch.logspace(-10, 4, shape[0], base=2)[:, None]
            cls.checkpoint[name] = t.to(torch.bfloat16)
        cls.group = Group([0], backend=Backend.HOST)

    @classmethod
    def tearDownClass(cls):
        cls.group.close()
        fp8.use_kernel(cls.kernel)

    def quantize_rows(self, pieces: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of the matrix `pieces` stack to, each piece quantized alone into its rows
        (its own quantized need) with DeepGEMM's arithmetic."""
        rows, cols = sum(p.shape[0] for p in pieces), pieces[0].shape[1]
        q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (BLOCK, BLOCK), Arithmetic.DEEPGEMM)
        codes = torch.zeros(rows, cols, dtype=torch.uint8)
        scales = torch.full((-(-rows // BLOCK), -(-cols // BLOCK)), float("nan"))
        jobs, at = [], 0
        for piece in pieces:
            piece = piece.contiguous()
            self.assertEqual(at % BLOCK, 0, "a piece starting inside a block: not one need's box")
            jobs.append(QuantizeJob(q, SourceType.BF16, piece.data_ptr(), piece.shape[0], cols, cols,
                                    codes[at:].data_ptr(), cols, scales[at // BLOCK:].data_ptr(), scales.shape[1]))
            at += piece.shape[0]
        refit.quantize_batch(self.group, 0, jobs)
        return codes, scales

    def check(self, parallel: harness.Parallel):
        fp8 = harness.engine_config(self.folder, parallel, "bfloat16", "fp8_per_block")
        bf16 = harness.engine_config(self.folder, parallel, "bfloat16")
        compared = 0
        for rank in range(parallel.tp):
            served = loaded(fp8, parallel, rank, self.checkpoint)
            plain = dict(loaded(bf16, parallel, rank, self.checkpoint).named_modules())
            for name, module in served.named_modules():
                if type(getattr(module, "quant_method", None)).__name__ != "Fp8PerBlockOnlineLinearMethod":
                    continue
                with self.subTest(rank=rank, layer=name):
                    self.assertEqual(module.weight.dtype, torch.float8_e4m3fn)
                    # The same layer of the BF16 engine holds this rank's shards of the checkpoint
                    # tensors, fused as vLLM fuses them; cut it back into them.
                    shard = plain[name].weight.data
                    sizes = getattr(module, "output_partition_sizes", [shard.shape[0]])
                    self.assertEqual(len(sizes), len(FUSED.get(name.rsplit(".", 1)[-1], [name])))
                    codes, scales = self.quantize_rows(list(torch.split(shard, sizes)))
                    mismatched = (codes != module.weight.data.view(torch.uint8)).sum().item()
                    self.assertEqual(mismatched, 0, f"codes differing of {codes.numel()}")
                    want_scales = module.weight_scale_inv.data
                    self.assertTrue(torch.equal(scales.view(torch.int32), want_scales.view(torch.int32)))
                    compared += codes.numel()
        # Every layer of both decoder layers: qkv, o, gate_up and down.
        self.assertEqual(compared, 2 * (1024 * 256 + 256 * 512 + 1024 * 256 + 256 * 512))

    def test_every_fp8_layer_equals_its_checkpoint_shards_quantized_one_by_one(self):
        self.check(harness.Parallel(tp=1))

    def test_every_rank_at_tensor_parallel_two(self):
        self.check(harness.Parallel(tp=2))


if __name__ == "__main__":
    unittest.main()
