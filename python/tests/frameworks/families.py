"""Tiny Hugging Face configs of the families the suite builds with vLLM, and the parallel layouts
each is tried at. Sizes are small but keep what matters: grouped kv heads (replicated when TP
exceeds them), biases, tied embeddings, a vocabulary that TP does not divide, MoE with and without
shared experts and expert groups, dense layers before MoE ones; fused checkpoint tensors (Phi-3,
GraniteMoE, GPT-2's Conv1D), hybrid attention (Qwen3-Next) and vLLM's Transformers modeling
backend (OLMo 2, GPT-BigCode)."""

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


def gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, sliding_window=64, **COMMON)


def gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, sliding_window=64, **COMMON)


def phi3() -> Any:
    from transformers import Phi3Config

    # The checkpoint holds fused qkv_proj and gate_up_proj.
    return Phi3Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, pad_token_id=0, **COMMON)


def mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON)


def qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    # A shared expert with its own gate beside the routed ones.
    return Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100, **COMMON,
    )


def olmoe() -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100, pad_token_id=0, **COMMON)


def olmo2() -> Any:
    from transformers import Olmo2Config

    # Served through vLLM's Transformers modeling backend, which makes the modules it keeps on a
    # real device even under the meta one (refit.integrations.vllm.meta_only).
    return Olmo2Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, pad_token_id=0, **COMMON)


def granite() -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, **COMMON)


def granitemoe() -> Any:
    from transformers import GraniteMoeConfig

    # Experts fused in the checkpoint (input_linear, output_linear).
    return GraniteMoeConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100, **COMMON)


def granitemoeshared() -> Any:
    from transformers import GraniteMoeSharedConfig

    return GraniteMoeSharedConfig(
        intermediate_size=16, shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        vocab_size=100, **COMMON,
    )


def glm4() -> Any:
    from transformers import Glm4Config

    return Glm4Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, pad_token_id=0, **COMMON)


def glm4_moe() -> Any:
    from transformers import Glm4MoeConfig

    # 4 layers: vLLM's Glm4MoeForCausalLM refuses a pipeline stage without a MoE layer.
    return Glm4MoeConfig(
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, num_hidden_layers=4, vocab_size=100, head_dim=8,
        pad_token_id=0, **COMMON,
    )


def deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    # q LoRA, e_score_correction_bias (noaux_tc routing), expert groups.
    return DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
        vocab_size=100, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        topk_method="noaux_tc",
    )


def phimoe() -> Any:
    from transformers import PhimoeConfig

    return PhimoeConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100, **COMMON)


def gpt2() -> Any:
    from transformers import GPT2Config

    # Conv1D weights, stored transposed, and a fused c_attn.
    return GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=256, vocab_size=100)


def gptj() -> Any:
    from transformers import GPTJConfig

    return GPTJConfig(n_embd=32, n_head=4, n_layer=2, n_positions=256, vocab_size=100, rotary_dim=4)


def gpt_bigcode() -> Any:
    from transformers import GPTBigCodeConfig

    # Transformers modeling backend, multi-query attention.
    return GPTBigCodeConfig(n_embd=32, n_head=4, n_layer=2, n_positions=256, vocab_size=100, multi_query=True)


def falcon() -> Any:
    from transformers import FalconConfig

    # Falcon-7B's layout: multi-query, parallel attention, no bias.
    return FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=100, multi_query=True,
                        new_decoder_architecture=False, parallel_attn=True, bias=False)


def falcon_new() -> Any:
    from transformers import FalconConfig

    # Falcon-40B's: the new decoder architecture, grouped kv heads.
    return FalconConfig(hidden_size=32, num_attention_heads=4, num_kv_heads=2, num_hidden_layers=2, vocab_size=100,
                        new_decoder_architecture=True, bias=False)


def starcoder2() -> Any:
    from transformers import Starcoder2Config

    return Starcoder2Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, **COMMON)


def qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    # Hybrid: gated delta net layers (their RMSNormGated built on the platform's device) and full
    # attention every second layer; MoE with a shared expert.
    return Qwen3NextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, head_dim=8,
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, vocab_size=100, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2,
    )


FAMILIES: Dict[str, Callable[[], Any]] = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "deepseek_v2_lite": deepseek_v2_lite,
    "mixtral": mixtral,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "phi3": phi3,
    "mistral": mistral,
    "qwen2_moe": qwen2_moe,
    "olmoe": olmoe,
    "olmo2": olmo2,
    "granite": granite,
    "granitemoe": granitemoe,
    "granitemoeshared": granitemoeshared,
    "glm4": glm4,
    "glm4_moe": glm4_moe,
    "deepseek_v3": deepseek_v3,
    "phimoe": phimoe,
    "gpt2": gpt2,
    "gptj": gptj,
    "gpt_bigcode": gpt_bigcode,
    "falcon": falcon,
    "falcon_new": falcon_new,
    "starcoder2": starcoder2,
    "qwen3_next": qwen3_next,
}

# Architectures whose Hugging Face class name is not the one vLLM registers natively (transformers
# saves PhimoeForCausalLM, which vLLM would serve through its Transformers backend).
ARCHITECTURES: Dict[str, str] = {"phimoe": "PhiMoEForCausalLM"}

P = Parallel
MATRIX: Dict[str, List[Parallel]] = {
    "llama": [P(1), P(2), P(4), P(2, 2)],
    "qwen2": [P(1), P(4), P(2, 2)],
    "qwen3": [P(2), P(4, 2)],
    "qwen3_moe": [P(1), P(2), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(2, 2, ep=True)],
    "deepseek_v2_lite": [P(1), P(2), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(1, 2)],
    "mixtral": [P(2), P(2, ep=True), P(1, 2)],
    "gemma2": [P(2), P(1, 2)],
    "gemma3": [P(1), P(4), P(2, 2)],
    "phi3": [P(1), P(2), P(4)],
    "mistral": [P(2)],
    "qwen2_moe": [P(1), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(2, 2, ep=True)],
    "olmoe": [P(2), P(2, ep=True), P(1, 2)],
    "olmo2": [P(1), P(2)],
    "granite": [P(2)],
    "granitemoe": [P(2), P(2, ep=True), P(1, 2)],
    "granitemoeshared": [P(2, ep=True)],
    "glm4": [P(2), P(1, 2)],
    "glm4_moe": [P(1), P(2, ep=True), P(2, 2, ep=True)],
    "deepseek_v3": [P(1), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(1, 2)],
    "phimoe": [P(2), P(2, ep=True), P(1, 2)],
    "gpt2": [P(1), P(4), P(1, 2)],
    "gptj": [P(2)],
    "gpt_bigcode": [P(1), P(2)],
    "falcon": [P(2)],
    "falcon_new": [P(2), P(4)],
    "starcoder2": [P(2), P(1, 2)],
    "qwen3_next": [P(1), P(2), P(1, 2)],
}
