"""Tiny Hugging Face configs of the families the suite builds with vLLM, and the parallel layouts
each is tried at. Sizes are small but keep what matters: grouped kv heads (replicated when TP
exceeds them), biases, tied embeddings, a vocabulary that TP does not divide, MoE with and without
shared experts and expert groups, dense layers before MoE ones."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from vllm_harness import Parallel

COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, **COMMON)


def qwen2() -> Any:
    from transformers import Qwen2Config

    # Biases on q/k/v; tied embeddings; 150 rows: padded to 192, 48 per rank at TP 4.
    return Qwen2Config(intermediate_size=64, num_hidden_layers=2, vocab_size=150, tie_word_embeddings=True, **COMMON)


def qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON)


def qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON,
    )


def deepseek_v2_lite() -> Any:
    from transformers import DeepseekV2Config

    # V2-Lite's shapes: MLA without q LoRA, shared experts, a dense first layer, expert groups (so
    # round-robin expert placement is real, not vLLM's linear fallback).
    return DeepseekV2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
        vocab_size=100, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
        topk_method="group_limited_greedy",
    )


def mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100, **COMMON)


FAMILIES: Dict[str, Callable[[], Any]] = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "deepseek_v2_lite": deepseek_v2_lite,
    "mixtral": mixtral,
}

P = Parallel
MATRIX: Dict[str, List[Parallel]] = {
    "llama": [P(1), P(2), P(4), P(2, 2)],
    "qwen2": [P(1), P(4), P(2, 2)],
    "qwen3": [P(2), P(4, 2)],
    "qwen3_moe": [P(1), P(2), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(2, 2, ep=True)],
    "deepseek_v2_lite": [P(1), P(2), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(1, 2)],
    "mixtral": [P(2), P(2, ep=True), P(1, 2)],
}
