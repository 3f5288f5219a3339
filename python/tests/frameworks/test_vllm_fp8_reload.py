"""Which path each layer of a vLLM 0.33 `fp8_per_block` engine takes, and that every path serves
what vLLM's own fresh load + process_weights_after_loading of the trainer's new BF16 checkpoint
serves (codes, scales and the BF16 parameters, bit for bit, through RefitWorkerExtension on the
host backend, TP 1).

- vLLM post-processes these layers inside `load_weights` (its online processing), so the meta
  copy's own post-processing run saw nothing: before, the receiver took them for plain boxes and
  refused the live model (8 unrecorded `weight_scale_inv`). With refit's quantizing off, they take
  vLLM's layerwise reload, exactly.
- A per-tensor engine (`quantization="fp8_per_tensor"`: one scale over each layer's whole weight,
  its CUDA quantizer fp8_engines' stand-in) at TP 1: every FP8 layer's boxes become per-tensor needs
  sharing the layer's one scale, quantized by refit exactly (and with refit's quantizing off, vLLM's
  layerwise reload, exactly).
- Kernel stand-ins whose weight post-processing changes what the quantizer returned keep the
  reload path: one re-lays the scales column-major (as DeepGEMM's kernels want theirs MN-major),
  one rescales them in place after quantizing.
- A model whose k and v shards are 64 rows (head_dim 64, one kv head): k and v end inside a block
  another tensor shares, so qkv_proj keeps the reload path while o, gate_up and down are quantized.
- DeepGEMM's quantizer asked for power-of-two scales (a stand-in between vLLM's method and it
  passes use_ue8m0=True, as vLLM does for DeepGEMM on Blackwell): the receiver reads that call and
  quantizes with Arithmetic.DEEPGEMM_UE8M0.

Each stand-in is installed for one test and put back after it.
"""

from __future__ import annotations

import logging
import unittest
from typing import Any, Dict, List

import torch

import fp8_engines as fp8
import refit
import vllm_harness as harness
from refit import Arithmetic


def column_major_scales_kernel() -> Any:
    """The CUTLASS block kernel, then its scales re-laid column-major (same values, other strides)."""
    from vllm.model_executor.utils import replace_parameter

    class ColumnMajorScales(fp8.cutlass_kernel()):  # type: ignore[misc]
        def process_weights_after_loading(self, layer: Any) -> None:
            super().process_weights_after_loading(layer)
            replace_parameter(layer, "weight_scale_inv", layer.weight_scale_inv.data.t().contiguous().t())

    return ColumnMajorScales


def rescaled_scales_kernel() -> Any:
    """The CUTLASS block kernel, then its scales doubled in place (same layout, other values)."""

    class RescaledScales(fp8.cutlass_kernel()):  # type: ignore[misc]
        def process_weights_after_loading(self, layer: Any) -> None:
            super().process_weights_after_loading(layer)
            layer.weight_scale_inv.data.mul_(2.0)

    return RescaledScales


def dynamo_frames() -> int:
    """Frames torch.compile has traced in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


class Fp8PathsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.folder = harness.hf_folder("qwen3-fp8-paths", fp8.qwen3_config(), torch.bfloat16)
        cls.initial, cls.update = fp8.bf16_checkpoints(cls.folder, 2, seed=11)

    def setUp(self) -> None:
        from refit.integrations import recorder

        self.kernel = fp8.use_kernel(fp8.cutlass_kernel())
        # Each test records anew: vLLM then quantizes the meta copy's layers inside its load_weights.
        recorder._CACHE.clear()

    def tearDown(self) -> None:
        fp8.use_kernel(self.kernel)

    def refit(self, folder: str, initial: Dict[str, torch.Tensor], update: Dict[str, torch.Tensor], quantize: bool = True,
              quantization: str = "fp8_per_block") -> Any:
        """Refits an engine served from `initial` to `update` through the worker extension; checks
        that it then serves what vLLM serves from `update`, in the same storage. Returns the
        receiver and the log lines of its recording."""
        parallel = harness.Parallel(1)
        config = harness.engine_config(folder, parallel, "bfloat16", quantization)
        with harness.as_rank(config, parallel, 0, 0):
            engine = fp8.served(config, initial)
            before = fp8.addresses(engine)
            worker = fp8.Worker(config, engine)
            frames = dynamo_frames()
            with self.assertLogs("refit.integrations.vllm", logging.INFO) as logs:
                worker.refit_needs(0, device=0, backend=refit.Backend.HOST, quantize=quantize)
            # vLLM's compiled per_block_cast_to_fp8 runs in the recording: eagerly, not traced.
            self.assertEqual(dynamo_frames(), frames, "the recording ran under torch.compile")
            receiver = worker._refit()["receiver"]
            worker.refit_receive([fp8.publisher_table(update)])
            compared = fp8.compare(fp8.served(config, update), engine)
            self.assertEqual(compared.mismatches, [])
            self.assertGreater(compared.codes, 0)
            self.assertGreater(compared.scales, 0)
            self.assertEqual(fp8.addresses(engine), before, "the live storage moved")
            worker.refit_close()
        return receiver, logs.output

    def layers_by_path(self, receiver: Any) -> Dict[str, List[str]]:
        out: Dict[str, List[str]] = {}
        for name, path in receiver.paths.items():
            if name.endswith((".weight_scale_inv", ".weight_scale")):
                out.setdefault(path, []).append(name.rsplit(".", 1)[0])
        return {path: sorted(layers) for path, layers in out.items()}

    def test_without_quantizing_the_online_layers_take_vllms_reload_exactly(self) -> None:
        receiver, logs = self.refit(self.folder, self.initial, self.update, quantize=False)
        self.assertEqual(len(self.layers_by_path(receiver)["reload"]), 8)
        self.assertEqual(receiver.quantized, {})
        self.assertTrue(any("16 in 8 layers go through vLLM's layerwise reload" in line for line in logs), logs)
        self.assertIn("post-processed while loading", " ".join(receiver.reload.values()))

    def test_per_tensor_layers_are_quantized_by_refit_at_tp_1_exactly(self) -> None:
        # One scale over each layer's whole weight (q, k and v together in qkv_proj, gate and up in
        # gate_up_proj): at TP 1 vLLM reduces no amax across ranks, so each checkpoint box becomes a
        # per-tensor need naming the layer's one scale (Arithmetic.VLLM_TENSOR), and the plan takes
        # the amax of all of them. vLLM's own kernel selection (its CPU per-tensor kernel). With
        # refit's quantizing off, the same layers take vLLM's reload; both serve vLLM's own load.
        fp8.use_kernel(self.kernel)
        self.addCleanup(fp8.use_scaled_fp8_quant, fp8.use_scaled_fp8_quant(fp8.static_scaled_fp8_quant))
        layers = sorted(f"model.layers.{i}.{layer}" for i in range(2)
                        for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
        receiver, logs = self.refit(self.folder, self.initial, self.update, quantization="fp8_per_tensor")
        self.assertEqual(self.layers_by_path(receiver), {"quantized": layers})
        self.assertEqual({spec.quantization.granularity for spec in receiver.quantized.values()}, {refit.Granularity.TENSOR})
        self.assertEqual({spec.quantization.arithmetic for spec in receiver.quantized.values()}, {Arithmetic.VLLM_TENSOR})
        receiver, logs = self.refit(self.folder, self.initial, self.update, quantize=False, quantization="fp8_per_tensor")
        self.assertEqual(self.layers_by_path(receiver), {"reload": layers})
        self.assertEqual(receiver.quantized, {})
        self.assertTrue(any("16 in 8 layers go through vLLM's layerwise reload" in line for line in logs), logs)

    def test_moe_experts_take_vllms_reload_exactly(self) -> None:
        # vLLM quantizes each expert's w13 and w2 in blocks inside its MoE method's processing (the
        # fused experts of a layer, one weight): they take its reload; attention and the router
        # gate are quantized by refit.
        self.addCleanup(fp8.use_triton_moe_backend())
        folder = harness.hf_folder("qwen3-moe-fp8", fp8.qwen3_moe_config(), torch.bfloat16)
        initial, update = fp8.bf16_checkpoints(folder, 2, seed=17)
        receiver, logs = self.refit(folder, initial, update)
        experts = {name: path for name, path in receiver.paths.items() if ".experts." in name}
        self.assertEqual(experts, {f"model.layers.{i}.mlp.experts.routed_experts.{w}_{p}": "reload" for i in range(2)
                                   for w in ("w13", "w2") for p in ("weight", "weight_scale_inv")})
        self.assertEqual(self.layers_by_path(receiver), {"quantized": sorted(
            f"model.layers.{i}.{layer}" for i in range(2) for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate"))})

    def test_scales_re_laid_by_the_kernel_keep_the_reload_path(self) -> None:
        fp8.use_kernel(column_major_scales_kernel())
        receiver, logs = self.refit(self.folder, self.initial, self.update)
        self.assertEqual(list(self.layers_by_path(receiver)), ["reload"])
        self.assertTrue(any("keeps vLLM's reload path" in line and "re-laid" in line for line in logs), logs)

    def test_scales_rewritten_after_quantizing_keep_the_reload_path(self) -> None:
        fp8.use_kernel(rescaled_scales_kernel())
        receiver, logs = self.refit(self.folder, self.initial, self.update)
        self.assertEqual(list(self.layers_by_path(receiver)), ["reload"])
        self.assertTrue(any("rewritten after quantizing" in line for line in logs), logs)

    def test_boxes_ending_inside_a_shared_block_keep_that_layer_on_the_reload_path(self) -> None:
        from transformers import Qwen3Config

        config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=160, head_dim=64,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                             tie_word_embeddings=False)
        folder = harness.hf_folder("qwen3-fp8-kv64", config, torch.bfloat16)
        initial, update = fp8.bf16_checkpoints(folder, 2, seed=13)
        receiver, logs = self.refit(folder, initial, update)
        layers = self.layers_by_path(receiver)
        self.assertEqual(layers["reload"], [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)])
        self.assertEqual(len(layers["quantized"]), 6)
        self.assertTrue(any("k_proj.weight ends at row 320" in line for line in logs), logs)

    def test_power_of_two_scales_asked_of_deepgemm_choose_that_arithmetic(self) -> None:
        from vllm.model_executor.layers.quantization.online import fp8 as online
        from vllm.utils import deep_gemm

        def asks_for_ue8m0(x: torch.Tensor, block_size: Any = None, use_ue8m0: bool = False) -> Any:
            return deep_gemm.per_block_cast_to_fp8(x, block_size, use_ue8m0=True)

        self.addCleanup(setattr, online, "per_block_cast_to_fp8", online.per_block_cast_to_fp8)
        online.per_block_cast_to_fp8 = asks_for_ue8m0
        receiver, logs = self.refit(self.folder, self.initial, self.update)
        self.assertEqual(len(self.layers_by_path(receiver)["quantized"]), 8)
        self.assertEqual({spec.quantization.arithmetic for spec in receiver.quantized.values()}, {Arithmetic.DEEPGEMM_UE8M0})
        self.assertTrue(any("DEEPGEMM_UE8M0" in line for line in logs), logs)


if __name__ == "__main__":
    unittest.main()
