"""benches/transfer_bytes.py on a tiny Qwen3-MoE at TP 2: refit's figure is the rank's parameter
bytes and is what a refit plan really moves into that rank; vLLM nccl_m2n's figure is what vLLM's
own resolve_parameter_destinations decides (replacing that function changes the figure); nccl's is
every checkpoint tensor whole."""

from __future__ import annotations

import importlib.util
import math
import os
import unittest
from unittest import mock

import torch

import vllm_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("transfer_bytes", os.path.join(HERE, "..", "..", "..", "benches", "transfer_bytes.py"))
transfer_bytes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(transfer_bytes)  # type: ignore[union-attr]


def tiny_moe():
    from transformers import Qwen3MoeConfig

    # A vocabulary of 128 (a multiple of 64 * TP) and as many kv heads as ranks: no padding, no
    # replicated rows, so every parameter byte is a checkpoint byte.
    return Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
        max_position_embeddings=256, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )


class TransferBytesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.hf = tiny_moe()
        cls.specs = vllm_ranks.checkpoint_specs(cls.hf, torch.float32)
        cls.config = vllm_ranks.engine_config(vllm_ranks.config_folder(cls.hf), 2, dtype="float32")

    def test_refit_takes_exactly_its_parameter_bytes_and_a_plan_moves_exactly_those(self):
        import refit
        from refit.integrations.vllm import VllmReceiver

        ckpt = {name: torch.randn(shape) for name, (shape, _) in self.specs.items()}
        for rank in range(2):
            with vllm_ranks.as_rank(self.config, rank):
                model = vllm_ranks.build(self.config, "cpu")
                figure = transfer_bytes.param_bytes(model)
                self.assertEqual(figure, sum(p.numel() * p.element_size() for _, p in model.named_parameters()))
                # The needs recorded from vLLM's loader, every parameter as boxes: the GPU's
                # unquantized MoE path keeps the checkpoint layout (the CPU platform's repack, staged
                # and reloaded whole, is test_vllm_postprocess's).
                receiver = VllmReceiver(VllmReceiver.from_engine(self.config, self.specs).recording)
                with receiver.table(list(model.named_parameters()), 1, 0) as needs, refit.Table() as offers:
                    for name, tensor in ckpt.items():
                        refit.tensor.add_tensor_offer(offers, name, tensor, 0, device=0)
                    with refit.Plan.build([offers, needs]) as plan:
                        self.assertEqual(plan.receiver_stats(1, 0).needed_bytes, figure, rank)

    def test_nccl_m2n_figure_is_what_vllms_resolution_decides(self):
        from vllm.distributed.weight_transfer import m2n_layout

        calls = []
        real = m2n_layout.resolve_parameter_destinations

        def recording(*args, **kwargs):
            calls.append(real(*args, **kwargs))
            return calls[-1]

        with vllm_ranks.as_rank(self.config, 0):
            model = vllm_ranks.build(self.config, "meta")
            with mock.patch.object(m2n_layout, "resolve_parameter_destinations", recording):
                got = transfer_bytes.m2n_bytes(model, self.specs, 2, (1, 2))
            self.assertEqual(len(calls), 1)
            expected = 0
            for destination in calls[0]:
                shape, _ = self.specs[destination.name]
                expected += destination.tensor.numel() * 4 if destination.direct else math.prod(shape) * 4
            self.assertEqual(got["bytes"], expected)
            fused = [d for d in calls[0] if d.name.endswith(("q_proj.weight", "gate_proj.weight"))]
            self.assertTrue(fused and not any(d.direct for d in fused), "fused parameters take vLLM's fallback")
            self.assertGreater(got["direct_params"], 0)
            # Everything on the fallback (vLLM's allow_direct=False): the figure follows vLLM's answer.
            everything_fallback = lambda *a, **k: real(*a, **{**k, "allow_direct": False})  # noqa: E731
            with mock.patch.object(m2n_layout, "resolve_parameter_destinations", everything_fallback):
                self.assertEqual(transfer_bytes.m2n_bytes(model, self.specs, 2, (1, 2))["bytes"], transfer_bytes.broadcast_bytes(self.specs))

    def test_nccl_broadcast_is_every_checkpoint_tensor(self):
        total = sum(math.prod(shape) * 4 for shape, _ in self.specs.values())
        self.assertEqual(transfer_bytes.broadcast_bytes(self.specs), total)
        self.assertIn("model.layers.1.mlp.experts.3.down_proj.weight", self.specs)


if __name__ == "__main__":
    unittest.main()
