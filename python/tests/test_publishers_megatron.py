"""The Megatron module publisher's rules without torch or Megatron: ShardedTensor keys with their
prepended layer / expert axes resolved, and each global Megatron tensor's rows named as Hugging
Face rows, for both layer specs' spellings. The publisher against the real megatron-core is tested
in frameworks/test_megatron_publisher.py and (Multi-Latent Attention, shared experts)
frameworks/test_megatron_mla.py."""

from __future__ import annotations

import unittest

import refit
from refit.integrations.megatron import AttentionShape, RowBlock, megatron_to_hf, resolved_key, sharded_tensors

GQA = AttentionShape(heads=4, query_groups=2, head_dim=2)


class FakeSharded:
    """The fields of a Megatron ShardedTensor the publisher reads."""

    def __init__(self, key, global_shape, global_offset, prepend_axis_num, local_shape=(1,)) -> None:
        self.key = key
        self.global_shape = global_shape
        self.global_offset = global_offset
        self.prepend_axis_num = prepend_axis_num
        self.local_shape = local_shape


class FakeFactory:
    def __init__(self, pieces) -> None:
        self.pieces = pieces
        self.build_fn = None

    def build(self):
        return self.pieces


class MegatronRulesTest(unittest.TestCase):
    def test_prepended_layer_and_expert_axes_become_indices(self):
        layer = FakeSharded("decoder.layers.self_attention.linear_qkv.weight", (4, 32, 16), (3, 8, 0), 1)
        self.assertEqual(resolved_key(layer), ("decoder.layers.3.self_attention.linear_qkv.weight", (32, 16), (8, 0)))
        expert = FakeSharded("decoder.layers.mlp.experts.experts.linear_fc2.weight", (2, 8, 16, 4), (1, 5, 0, 4), 2)
        self.assertEqual(resolved_key(expert), ("decoder.layers.1.mlp.experts.experts.5.linear_fc2.weight", (16, 4), (0, 4)))
        # singleton_local_shards: indices already in the key, nothing prepended.
        single = FakeSharded("decoder.layers.7.mlp.experts.experts.2.linear_fc1.weight_w", (8, 16), (4, 0), 0)
        self.assertEqual(resolved_key(single)[0], "decoder.layers.7.mlp.experts.experts.2.linear_fc1.weight_w")
        with self.assertRaises(refit.RefitError):
            resolved_key(FakeSharded("embedding.word_embeddings.weight", (2, 8, 4), (1, 0, 0), 1))

    def test_factories_are_built_and_objects_left_out(self):
        a, b = FakeSharded("x", (2,), (0,), 0), FakeSharded("y", (2,), (0,), 0)
        state = {"fc1": FakeFactory([a, b]), "extra": object(), "nested": {"z": [a]}}
        self.assertEqual(list(sharded_tensors(state)), [a, b, a])

    def test_fused_qkv_rows_per_query_group(self):
        q, k, v = (f"model.layers.3.self_attn.{x}_proj.weight" for x in "qkv")
        blocks = megatron_to_hf("decoder.layers.3.self_attention.linear_qkv.weight", (16, 8), GQA)
        self.assertEqual(
            blocks,
            [
                RowBlock(q, (8, 8), 0, 4, 0), RowBlock(k, (4, 8), 4, 2, 0), RowBlock(v, (4, 8), 6, 2, 0),
                RowBlock(q, (8, 8), 8, 4, 4), RowBlock(k, (4, 8), 12, 2, 2), RowBlock(v, (4, 8), 14, 2, 2),
            ],
        )
        bias = megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.bias", (16,), GQA)
        self.assertEqual(bias[1], RowBlock("model.layers.0.self_attn.k_proj.bias", (4,), 4, 2, 0))
        with self.assertRaises(refit.RefitError):
            megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", (12, 8), GQA)

    def test_fc1_is_gate_then_up_whole_or_as_halves(self):
        self.assertEqual(
            megatron_to_hf("decoder.layers.1.mlp.linear_fc1.weight", (12, 8), GQA),
            [RowBlock("model.layers.1.mlp.gate_proj.weight", (6, 8), 0, 6), RowBlock("model.layers.1.mlp.up_proj.weight", (6, 8), 6, 6)],
        )
        self.assertEqual(
            megatron_to_hf("decoder.layers.1.mlp.linear_fc1.weight_v", (6, 8), GQA),
            [RowBlock("model.layers.1.mlp.up_proj.weight", (6, 8), 0, 6)],
        )
        self.assertEqual(
            megatron_to_hf("decoder.layers.0.mlp.experts.experts.5.linear_fc1.weight", (4, 8), GQA)[1],
            RowBlock("model.layers.0.mlp.experts.5.up_proj.weight", (2, 8), 2, 2),
        )
        plain = AttentionShape(heads=4, query_groups=2, head_dim=2, gated=False)
        self.assertEqual(
            megatron_to_hf("decoder.layers.1.mlp.linear_fc1.weight", (12, 8), plain),
            [RowBlock("model.layers.1.mlp.up_proj.weight", (12, 8), 0, 12)],
        )

    def test_multi_latent_attention_and_shared_experts(self):
        mla = AttentionShape(heads=4, query_groups=4, head_dim=8, latent=True)
        at = "model.layers.1.self_attn."
        for megatron, hf in (
            ("linear_q_proj.weight", "q_proj.weight"),
            ("linear_q_down_proj.weight", "q_a_proj.weight"),
            ("linear_q_up_proj.weight", "q_b_proj.weight"),
            ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
            ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
            ("q_layernorm.weight", "q_a_layernorm.weight"),  # local spec
            ("kv_layernorm.weight", "kv_a_layernorm.weight"),
            ("linear_q_up_proj.layer_norm_weight", "q_a_layernorm.weight"),  # Transformer Engine spec
            ("linear_kv_up_proj.layer_norm_weight", "kv_a_layernorm.weight"),
        ):
            self.assertEqual(megatron_to_hf(f"decoder.layers.1.self_attention.{megatron}", (20, 8), mla), [RowBlock(at + hf, (20, 8), 0, 20)])
        # A Q norm fused into linear_q_proj (Transformer Engine, no q LoRA) has no DeepSeek tensor.
        self.assertIsNone(megatron_to_hf("decoder.layers.1.self_attention.linear_q_proj.layer_norm_weight", (32,), mla))
        # The same Megatron name is Qwen3's per-head norm outside MLA.
        self.assertEqual(megatron_to_hf("decoder.layers.1.self_attention.q_layernorm.weight", (8,), GQA)[0].name, at + "q_norm.weight")
        shared = "model.layers.1.mlp.shared_experts."
        self.assertEqual(
            megatron_to_hf("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", (12, 8), mla),
            [RowBlock(shared + "gate_proj.weight", (6, 8), 0, 6), RowBlock(shared + "up_proj.weight", (6, 8), 6, 6)],
        )
        self.assertEqual(
            megatron_to_hf("decoder.layers.1.mlp.shared_experts.linear_fc1.weight_w", (3, 8), mla),
            [RowBlock(shared + "gate_proj.weight", (3, 8), 0, 3)],
        )
        self.assertEqual(
            megatron_to_hf("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", (8, 6), mla),
            [RowBlock(shared + "down_proj.weight", (8, 6), 0, 8)],
        )

    def test_both_layer_specs_norm_names(self):
        for te, local in (
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
        ):
            a = megatron_to_hf(f"decoder.layers.2.{te}", (8,), GQA)
            b = megatron_to_hf(f"decoder.layers.2.{local}", (8,), GQA)
            self.assertEqual(a, b)
        self.assertEqual(
            megatron_to_hf("decoder.layers.2.mlp.linear_fc1.layer_norm_bias", (8,), GQA),
            [RowBlock("model.layers.2.post_attention_layernorm.bias", (8,), 0, 8)],
        )
        self.assertEqual(
            megatron_to_hf("decoder.layers.2.self_attention.q_layernorm.weight", (2,), GQA),
            [RowBlock("model.layers.2.self_attn.q_norm.weight", (2,), 0, 2)],
        )

    def test_vocabulary_padding_is_dropped_and_unknown_keys_are_unnamed(self):
        self.assertEqual(
            megatron_to_hf("output_layer.weight", (128, 8), GQA, vocab=100), [RowBlock("lm_head.weight", (100, 8), 0, 100)]
        )
        self.assertEqual(megatron_to_hf("decoder.final_layernorm.weight", (8,), GQA, vocab=100)[0].shape, (8,))
        self.assertIsNone(megatron_to_hf("embedding.position_embeddings.weight", (32, 8), GQA))
        self.assertIsNone(megatron_to_hf("decoder.layers.mlp.linear_fc2.weight", (8, 8), GQA))


if __name__ == "__main__":
    unittest.main()
