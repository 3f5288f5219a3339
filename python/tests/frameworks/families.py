"""Tiny Hugging Face configs of the families the suite builds with vLLM, and the parallel layouts
each is tried at. Sizes are small but keep what matters: grouped kv heads (replicated when TP
exceeds them), biases, tied embeddings, a vocabulary that TP does not divide, MoE with and without
shared experts and expert groups, dense layers before MoE ones; fused checkpoint tensors (Phi-3,
GraniteMoE, GPT-2's Conv1D, Bloom, Llama 4's experts), hybrid attention (Qwen3-Next), state-space
layers (Mamba, Mamba2, Jamba, Falcon-H1, Nemotron-H, GraniteMoeHybrid, Zamba2: A computed from
A_log), constructors that read values (Bloom, Apertus) and vLLM's Transformers modeling backend
(OLMo 2, GPT-BigCode, GPT-NeoX, Phi, HunYuan MoE); vision-language models (Qwen2/2.5/3-VL, Qwen3-VL-MoE,
Gemma 3, LLaVA, Mistral 3, Pixtral, Llama 4, GLM-4.1V/4.5V, InternVL, Idefics3, SmolVLM, PaliGemma,
Kimi-VL): their vision towers sharded by TP or replicated (the encoder data parallel), the Hub's
checkpoint names and vLLM's mapping of them; and the families of 2026: Qwen3.5 and Qwen3.5-MoE (gated
delta net hybrids; text only and multimodal as the Hub ships them), DeepSeek-V3.2 and GLM-5 (the sparse-attention indexer; alike in every shape, but
placing experts apart), GLM-4.7-Flash, Gemma 4 (dense, MoE, multimodal), MiniMax-M2, Ministral 3, Command A MoE and AFMoE.

Not covered, with what vLLM 0.33 does with the checkpoint transformers 5.20 writes, on CPU:
- Kimi Linear: the config is refused: "--mamba-block-size can only be set with --enable-prefix-caching".
- OLMo Hybrid: its gated delta net layer sets Triton's allocator when built, and the CPU has no
  Triton: "AttributeError: module 'triton' has no attribute 'set_allocator'".
- DBRX: vLLM's own loader fails on the fused experts: "KeyError: 'blocks.0.ffn.experts.w13_weight'".
- LongCat-Flash: transformers writes its zero experts as experts with weights, which vLLM's loader
  does not map: "KeyError: 'layers.0.mlp.experts.8.gate_proj.weight'".
- MiMo-V2-Flash: vLLM reads the Hub config's own fields (swa_num_attention_heads, hybrid_layer_pattern,
  layernorm_epsilon), which transformers' config does not keep.
- DeepSeek-V4: vLLM loads the Hub's own tensor names, not transformers': "KeyError: 'hc_head.hc_base'"
  (a hand-written checkpoint, as for InternLM2, would be needed)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from vllm_harness import HandWritten, ModuleNames, Parallel

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


def bloom() -> Any:
    from transformers import BloomConfig

    # Fused query_key_value, ALiBi: vLLM's BloomAttention reads its slopes (tolist) when built,
    # which the meta device cannot give (build_meta_model builds it again, values on the host).
    return BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=100)


def apertus() -> Any:
    from transformers import ApertusConfig

    # xIELU activation: parameters and buffers the constructor reads back with item().
    return ApertusConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, **COMMON)


def stablelm() -> Any:
    from transformers import StableLmConfig

    # (qk_layernorm: vLLM's StablelmAttention has no such norms and its loader refuses them.)
    return StableLmConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, use_qkv_bias=True, partial_rotary_factor=0.5, **COMMON)


def cohere() -> Any:
    from transformers import CohereConfig

    # Per-head q/k norms (use_qk_norm), tied embeddings, LayerNorm without bias.
    return CohereConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, use_qk_norm=True, **COMMON)


def cohere2() -> Any:
    from transformers import Cohere2Config

    return Cohere2Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, sliding_window=64, **COMMON)


def exaone4() -> Any:
    from transformers import Exaone4Config

    return Exaone4Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, sliding_window=64, **COMMON)


def nemotron() -> Any:
    from transformers import NemotronConfig

    # LayerNorm1p, partial rotary, a plain up/down MLP.
    return NemotronConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, partial_rotary_factor=0.5, **COMMON)


def minicpm3() -> Any:
    from transformers import MiniCPM3Config

    # MLA with q LoRA, muP scales.
    return MiniCPM3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, intermediate_size=64,
        num_hidden_layers=2, vocab_size=100, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    )


def opt() -> Any:
    from transformers import OPTConfig

    # Learned positions with an offset of 2, biases everywhere.
    return OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=100, word_embed_proj_dim=32, max_position_embeddings=256)


def gemma() -> Any:
    from transformers import GemmaConfig

    return GemmaConfig(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON)


def gemma3n() -> Any:
    from transformers import Gemma3nTextConfig

    # AltUp projections, LAuReL, per-layer input embeddings.
    return Gemma3nTextConfig(
        intermediate_size=64, num_hidden_layers=2, vocab_size=100, vocab_size_per_layer_input=100, head_dim=8,
        hidden_size_per_layer_input=8, sliding_window=64, laurel_rank=8, altup_num_inputs=4, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0, 0.0], layer_types=["sliding_attention", "full_attention"], **COMMON,
    )


def ernie45() -> Any:
    from transformers import Ernie4_5Config

    return Ernie4_5Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON)


def ernie45_moe() -> Any:
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(
        intermediate_size=64, moe_intermediate_size=16, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
        moe_layer_start_index=1, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON,
    )


def exaone_moe() -> Any:
    from transformers import ExaoneMoeConfig

    return ExaoneMoeConfig(
        intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        first_k_dense_replace=1, num_hidden_layers=2, vocab_size=100, head_dim=8, n_group=1, topk_group=1, **COMMON,
    )


def llama4() -> Any:
    from transformers import Llama4TextConfig

    # Experts fused in the checkpoint (gate_up_proj [E, hidden, 2 x inter]); q/k rows permuted
    # by the loader; under EP the loader reads its expert map (item()), so those tensors are staged.
    return Llama4TextConfig(
        intermediate_size=16, intermediate_size_mlp=64, num_hidden_layers=2, vocab_size=100, head_dim=8, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 0], attention_chunk_size=64, **COMMON,
    )


def gpt_neox() -> Any:
    from transformers import GPTNeoXConfig

    # Transformers modeling backend.
    return GPTNeoXConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, vocab_size=100, max_position_embeddings=256)


def phi() -> Any:
    from transformers import PhiConfig

    # Transformers modeling backend; its loader creates lm_head's bias (on a real device).
    return PhiConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, vocab_size=100,
                     max_position_embeddings=256, partial_rotary_factor=0.5)


def hunyuan_moe() -> Any:
    from transformers import HunYuanMoEV1Config

    # Transformers modeling backend for MoE.
    return HunYuanMoEV1Config(intermediate_size=16, num_experts=4, moe_topk=2, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON)


def lfm2() -> Any:
    from transformers import Lfm2Config

    # A short convolution layer beside attention.
    return Lfm2Config(
        intermediate_size=64, num_hidden_layers=2, vocab_size=100, layer_types=["conv", "full_attention"], block_dim=32, block_ff_dim=64,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, conv_dim=32, conv_L_cache=3, conv_bias=False, **COMMON,
    )


def lfm2_moe() -> Any:
    from transformers import Lfm2MoeConfig

    return Lfm2MoeConfig(
        intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_dense_layers=1, num_hidden_layers=2,
        vocab_size=100, layer_types=["conv", "full_attention"], **COMMON,
    )


def mamba() -> Any:
    from transformers import MambaConfig

    return MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, vocab_size=100, expand=2, conv_kernel=4)


def mamba2() -> Any:
    from transformers import Mamba2Config

    # Mamba2's loader writes A_log's rows into A, then -exp(A) over them (read back: staged).
    return Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=8, num_hidden_layers=2, vocab_size=100, expand=2, conv_kernel=4)


def falcon_h1() -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(
        intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, **COMMON,
    )


def nemotron_h() -> Any:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        intermediate_size=64, num_hidden_layers=3, hybrid_override_pattern="M*-", vocab_size=100, head_dim=8, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, expand=2, **COMMON,
    )


def granitemoehybrid() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        intermediate_size=16, shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, vocab_size=100, **COMMON,
    )


def jamba() -> Any:
    from transformers import JambaConfig

    # Mamba (v1) and attention layers; MoE every second layer.
    return JambaConfig(
        intermediate_size=64, num_hidden_layers=2, vocab_size=100, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=4, **COMMON,
    )


def zamba2() -> Any:
    from transformers import Zamba2Config

    # Mamba2 layers and one shared attention block, applied through per-layer adapters.
    return Zamba2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, intermediate_size=64,
        num_hidden_layers=2, vocab_size=100, layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_headdim=8,
        mamba_ngroups=2, n_mamba_heads=8, attention_head_dim=16, num_mem_blocks=1,
    )


def gpt_oss() -> Any:
    from transformers import GptOssConfig

    # Unquantized (a bf16 checkpoint's layout, no mxfp4): q/k/v and o with biases, attention sinks
    # per head, experts fused in the checkpoint with biases (gate_up_proj [E, hidden, 2 x inter],
    # gate and up interleaved), sliding and full attention layers. Only SGLang's test builds it (not in MATRIX).
    return GptOssConfig(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100, head_dim=8,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"], **COMMON,
    )


# Families whose modeling code is on the Hub only (trust_remote_code): their config.json and the
# tensor names and shapes their code saves, written by hand (vllm_harness.HandWritten).


def internlm2() -> Any:
    # wqkv: q, k and v rows interleaved per kv group in one tensor, split by vLLM's loader.
    H, I, V, L, nh, nkv, hd = 32, 64, 100, 2, 4, 2, 8
    t = {"model.tok_embeddings.weight": (V, H), "model.norm.weight": (H,), "output.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({
            p + "attention.wqkv.weight": ((nh + 2 * nkv) * hd, H), p + "attention.wo.weight": (H, nh * hd),
            p + "feed_forward.w1.weight": (I, H), p + "feed_forward.w3.weight": (I, H), p + "feed_forward.w2.weight": (H, I),
            p + "attention_norm.weight": (H,), p + "ffn_norm.weight": (H,),
        })
    return HandWritten(dict(
        architectures=["InternLM2ForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=I, num_attention_heads=nh,
        num_key_value_heads=nkv, num_hidden_layers=L, vocab_size=V, max_position_embeddings=256, rms_norm_eps=1e-6,
        hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False, bias=False, torch_dtype="float32",
    ), t)


def chatglm() -> Any:
    # GLM-4-9B's layout (vLLM's own ChatGLMConfig): fused query_key_value with bias, multi-query
    # groups, a fused dense_h_to_4h (gate and up).
    H, F, V, L, nh, groups, kvc = 32, 64, 100, 2, 4, 2, 8
    t = {"transformer.embedding.word_embeddings.weight": (V, H), "transformer.encoder.final_layernorm.weight": (H,),
         "transformer.output_layer.weight": (V, H)}
    for i in range(L):
        p = f"transformer.encoder.layers.{i}."
        t.update({
            p + "input_layernorm.weight": (H,), p + "self_attention.query_key_value.weight": ((nh + 2 * groups) * kvc, H),
            p + "self_attention.query_key_value.bias": ((nh + 2 * groups) * kvc,), p + "self_attention.dense.weight": (H, nh * kvc),
            p + "post_attention_layernorm.weight": (H,), p + "mlp.dense_h_to_4h.weight": (2 * F, H), p + "mlp.dense_4h_to_h.weight": (H, F),
        })
    return HandWritten(dict(
        architectures=["ChatGLMModel"], model_type="chatglm", num_layers=L, padded_vocab_size=V, hidden_size=H, ffn_hidden_size=F,
        kv_channels=kvc, num_attention_heads=nh, multi_query_attention=True, multi_query_group_num=groups, add_qkv_bias=True,
        add_bias_linear=False, rmsnorm=True, post_layer_norm=True, seq_length=256, original_rope=True,
        apply_residual_connection_post_layernorm=False, layernorm_epsilon=1e-5, tie_word_embeddings=False, torch_dtype="float32",
    ), t)


def bailing_moe() -> Any:
    # Ling (Bailing-MoE): fused query_key_value, a dense first layer, routed and shared experts.
    H, I, MI, V, L, nh, nkv, hd, E, S = 32, 64, 16, 100, 2, 4, 2, 8, 8, 1
    t = {"model.word_embeddings.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "attention.query_key_value.weight": ((nh + 2 * nkv) * hd, H), p + "attention.dense.weight": (H, nh * hd),
        })
        if i == 0:
            t.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
            continue
        t[p + "mlp.gate.weight"] = (E, H)
        for q, n in [(p + f"mlp.experts.{e}.", MI) for e in range(E)] + [(p + "mlp.shared_experts.", MI * S)]:
            t.update({q + "gate_proj.weight": (n, H), q + "up_proj.weight": (n, H), q + "down_proj.weight": (H, n)})
    return HandWritten(dict(
        architectures=["BailingMoeForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=I, moe_intermediate_size=MI,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, num_hidden_layers=L, vocab_size=V, max_position_embeddings=256,
        rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False, num_experts=E, num_shared_experts=S,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, use_bias=False, use_qkv_bias=False,
        embedding_dropout=0.0, torch_dtype="float32",
    ), t)


# Vision-language families: the image-text class saved as on the Hub (vllm_harness.hf_folder; Kimi-VL
# and Pixtral's own format written by hand), a language model as above beside a vision tower of 2
# layers (hidden 32, 4 heads, patches of 4) and its projector. Image and vision token ids lie inside
# the vocabulary of 160.

TEXT = dict(intermediate_size=64, num_hidden_layers=2, vocab_size=160, **COMMON)
QWEN_VISION = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=4, out_hidden_size=32)
QWEN_TOKENS = dict(image_token_id=151, video_token_id=152, vision_start_token_id=153, vision_end_token_id=154)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4, vision_use_head=False)


def mrope(*section: int, **more: Any) -> Dict[str, Any]:
    """Multimodal rotary parameters: `section` splits the rotary half of a head (t, h, w)."""
    return dict(rope_type="default", rope_theta=10000.0, mrope_section=list(section), **more)


def qwen2_5_vl() -> Any:
    from transformers import Qwen2_5_VLConfig

    # The Hub's names are the older ones (model.layers.*, visual.*, lm_head); a Conv3d patch
    # embedding; fused qkv and separate gate/up (stacked by vLLM) in the vision blocks; a merger MLP.
    return Qwen2_5_VLConfig(
        text_config=dict(rope_parameters=mrope(2, 1, 1), **TEXT),
        vision_config=dict(fullatt_block_indexes=[1], window_size=16, **QWEN_VISION), **QWEN_TOKENS,
    )


def qwen2_5_vl_module_names() -> Any:
    # Qwen2.5-VL under its transformers module's names (model.language_model.*, model.visual.*,
    # lm_head), which vLLM's hf_to_vllm_mapper maps as it does the Hub's.
    return ModuleNames(qwen2_5_vl())


def qwen2_vl() -> Any:
    from transformers import Qwen2VLConfig

    # Tied embeddings (Qwen2-VL-2B); QuickGELU in the vision MLP.
    return Qwen2VLConfig(
        text_config=dict(rope_parameters=mrope(2, 1, 1), **TEXT),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4),
        tie_word_embeddings=True, **QWEN_TOKENS,
    )


def qwen3_vl() -> Any:
    from transformers import Qwen3VLConfig

    # The newer names (model.language_model.*, model.visual.*); learned position embeddings, a
    # deepstack merger fed from vision layer 0, interleaved mrope.
    return Qwen3VLConfig(
        text_config=dict(head_dim=8, rope_parameters=mrope(2, 1, 1, mrope_interleaved=True), **TEXT),
        vision_config=dict(num_position_embeddings=16, deepstack_visual_indexes=[0], **QWEN_VISION), **QWEN_TOKENS,
    )


def qwen3_vl_moe() -> Any:
    from transformers import Qwen3VLMoeConfig

    # Experts fused in the checkpoint as the Hub stores them: gate_up_proj [experts, hidden, 2 x
    # inter], down_proj [experts, inter, hidden] (norm_topk_prob: vLLM reads it, transformers'
    # config does not declare it).
    text = dict(TEXT, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    return Qwen3VLMoeConfig(
        text_config=dict(head_dim=8, rope_parameters=mrope(2, 1, 1, mrope_interleaved=True), **text),
        vision_config=dict(num_position_embeddings=16, deepstack_visual_indexes=[0], **QWEN_VISION), **QWEN_TOKENS,
    )


def gemma3_mm() -> Any:
    from transformers import Gemma3Config

    # SigLIP (vision_tower.vision_model.*, fused into qkv_proj by vLLM), an average-pooling projector
    # with a bare weight (mm_input_projection_weight), tied embeddings.
    return Gemma3Config(
        text_config=dict(head_dim=8, sliding_window=64, **TEXT), vision_config=SIGLIP, mm_tokens_per_image=4,
        boi_token_index=151, eoi_token_index=152, image_token_index=153,
    )


def llava() -> Any:
    from transformers import LlavaConfig

    # Llama + CLIP (a class embedding, pre_layrnorm); vLLM builds the vision layers up to the
    # feature layer (-2) only, so layer 1 of the tower stays unread by both sides.
    return LlavaConfig(
        text_config=dict(model_type="llama", **TEXT), image_token_index=151, image_seq_length=16,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32),
    )


def mistral3() -> Any:
    from transformers import Mistral3Config

    # Pixtral vision tower (separate q/k/v, gated MLP: stacked by vLLM), a patch merger.
    return Mistral3Config(
        text_config=dict(model_type="mistral", head_dim=8, **TEXT), image_token_index=151, tie_word_embeddings=False,
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           head_dim=8, image_size=16, patch_size=4),
    )


def llama4_mm() -> Any:
    from transformers import Llama4Config

    # Llama 4's text model as llama4() (fused experts) and its vision model: a patch embedding that
    # is a Linear, q/k/v that vLLM stacks under TP and concatenates itself when the encoder runs
    # data parallel, a pixel-shuffle adapter.
    return Llama4Config(
        text_config=dict(llama4().to_dict(), vocab_size=160),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
                           vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5),
        boi_token_index=151, eoi_token_index=152, image_token_index=153,
    )


GLM_TOKENS = dict(image_token_id=151, video_token_id=152, image_start_token_id=153, image_end_token_id=154, video_start_token_id=155,
                  video_end_token_id=156)
GLM_VISION = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=4, image_size=16, out_hidden_size=32)


def glm4v() -> Any:
    from transformers import Glm4vConfig

    # GLM-4.1V: a Conv3d patch embedding, a Conv2d downsample, a merger; partial rotary (4 of 8).
    return Glm4vConfig(
        text_config=dict(rope_parameters=mrope(1, 1, 0, partial_rotary_factor=0.5), **TEXT), vision_config=GLM_VISION, **GLM_TOKENS,
    )


def glm4v_moe() -> Any:
    from transformers import Glm4vMoeConfig

    # GLM-4.5V: GLM-4-MoE's text model (a dense first layer, a shared expert) with GLM-4.1V's vision.
    return Glm4vMoeConfig(
        text_config=dict(
            TEXT, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            head_dim=8, use_qk_norm=False, rope_parameters=mrope(1, 1, 0, partial_rotary_factor=0.5),
        ),
        vision_config=GLM_VISION, **GLM_TOKENS,
    )


def internvl() -> Any:
    from transformers import InternVLConfig

    # The Hugging Face format of InternVL 3 (vLLM serves it as InternS1): a Qwen2 language model,
    # InternViT with a class token, layer scales (lambda_1, lambda_2), an MLP projector.
    return InternVLConfig(
        text_config=dict(model_type="qwen2", **TEXT), image_token_id=151, image_seq_length=4,
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4),
    )


def idefics3() -> Any:
    from transformers import Idefics3Config

    # A Llama text model under model.text_model, SigLIP under model.vision_model, a pixel-shuffle
    # connector.
    return Idefics3Config(text_config=dict(model_type="llama", **TEXT), vision_config=SIGLIP, image_token_id=151, scale_factor=2)


def smolvlm() -> Any:
    from transformers import SmolVLMConfig

    # Idefics3's layout with tied embeddings.
    return SmolVLMConfig(
        text_config=dict(model_type="llama", tie_word_embeddings=True, **TEXT), vision_config=SIGLIP, image_token_id=151,
        scale_factor=2, tie_word_embeddings=True,
    )


def paligemma() -> Any:
    from transformers import PaliGemmaConfig

    # Gemma with SigLIP and a linear projector; tied embeddings.
    return PaliGemmaConfig(
        text_config=dict(model_type="gemma", head_dim=8, **TEXT), vision_config=dict(SIGLIP, projection_dim=32), image_token_index=151,
        projection_dim=32, hidden_size=32, vocab_size=160,
    )


def kimi_vl() -> Any:
    # Kimi-VL (modeling code on the Hub; vLLM has its own config class): DeepSeek-V3's text model,
    # its tensors as transformers writes them under language_model., and MoonViT (fused wqkv, a
    # Conv2d patch embedding, a 2-D learned position embedding) with a projector over 2 x 2 patches.
    from transformers import DeepseekV3Config

    from vllm_harness import meta_checkpoint_specs

    H, mlp, patch, pos, merged = 32, 64, 4, 4, 32 * 4
    text = DeepseekV3Config(**dict(deepseek_v3().to_dict(), vocab_size=160, n_group=1, topk_group=1, q_lora_rank=None))
    t = {"language_model." + name: shape for name, (shape, _) in meta_checkpoint_specs(text).items()}
    v, projector = "vision_tower.", "multi_modal_projector."
    t.update({
        v + "patch_embed.proj.weight": (H, 3, patch, patch), v + "patch_embed.proj.bias": (H,), v + "patch_embed.pos_emb.weight": (pos, pos, H),
        v + "encoder.final_layernorm.weight": (H,), v + "encoder.final_layernorm.bias": (H,), projector + "pre_norm.weight": (H,),
        projector + "pre_norm.bias": (H,), projector + "linear_1.weight": (merged, merged), projector + "linear_1.bias": (merged,),
        projector + "linear_2.weight": (H, merged), projector + "linear_2.bias": (H,),
    })
    for i in range(2):
        p = f"{v}encoder.blocks.{i}."
        t.update({
            p + "norm0.weight": (H,), p + "norm0.bias": (H,), p + "norm1.weight": (H,), p + "norm1.bias": (H,), p + "wqkv.weight": (3 * H, H),
            p + "wqkv.bias": (3 * H,), p + "wo.weight": (H, H), p + "wo.bias": (H,), p + "mlp.fc0.weight": (mlp, H), p + "mlp.fc0.bias": (mlp,),
            p + "mlp.fc1.weight": (H, mlp), p + "mlp.fc1.bias": (H,),
        })
    return HandWritten(dict(
        architectures=["KimiVLForConditionalGeneration"], model_type="kimi_vl", media_placeholder_token_id=151, torch_dtype="float32",
        text_config=text.to_dict(),
        vision_config=dict(model_type="moonvit", patch_size=patch, init_pos_emb_height=pos, init_pos_emb_width=pos, num_attention_heads=4,
                           num_hidden_layers=2, hidden_size=H, intermediate_size=mlp, merge_kernel_size=[2, 2]),
    ), t)


def pixtral() -> Any:
    # Mistral's own format (params.json, consolidated.safetensors; vLLM's Pixtral class), laid out as
    # Mistral Small 3.1: wq/wk/wv/wo and w1/w2/w3 in the language model (q and k rows permuted by
    # vLLM's loader for its rotary layout) and in the vision encoder (stacked by vLLM), a patch
    # merger, a norm before the adapter.
    H, I, V, L, nh, nkv, hd = 32, 64, 160, 2, 4, 2, 8
    t = {"tok_embeddings.weight": (V, H), "norm.weight": (H,), "output.weight": (V, H), "vision_encoder.patch_conv.weight": (H, 3, 4, 4),
         "vision_encoder.ln_pre.weight": (H,), "pre_mm_projector_norm.weight": (H,), "patch_merger.merging_layer.weight": (H, 4 * H),
         "vision_language_adapter.w_in.weight": (H, H), "vision_language_adapter.w_in.bias": (H,), "vision_language_adapter.w_out.weight": (H, H),
         "vision_language_adapter.w_out.bias": (H,)}
    for i in range(L):
        for p, q, kv in ((f"layers.{i}.", nh * hd, nkv * hd), (f"vision_encoder.transformer.layers.{i}.", H, H)):
            t.update({
                p + "attention.wq.weight": (q, H), p + "attention.wk.weight": (kv, H), p + "attention.wv.weight": (kv, H),
                p + "attention.wo.weight": (H, q), p + "attention_norm.weight": (H,), p + "ffn_norm.weight": (H,),
                p + "feed_forward.w1.weight": (I, H), p + "feed_forward.w2.weight": (H, I), p + "feed_forward.w3.weight": (I, H),
            })
    return HandWritten(dict(
        dim=H, n_layers=L, head_dim=hd, hidden_dim=I, n_heads=nh, n_kv_heads=nkv, rope_theta=1e6, norm_eps=1e-5, vocab_size=V,
        max_position_embeddings=256,
        vision_encoder=dict(
            hidden_size=H, num_channels=3, image_size=16, patch_size=4, rope_theta=10000.0, intermediate_size=I, num_hidden_layers=L,
            num_attention_heads=4, image_token_id=151, image_break_token_id=152, image_end_token_id=153, adapter_bias=True,
            spatial_merge_size=2, add_pre_mm_projector_layer_norm=True, mm_projector_id="patch_merge",
        ),
    ), t, ("params.json", "consolidated.safetensors"))


def qwen3_5() -> Any:
    from transformers import Qwen3_5TextConfig

    # Qwen3.5: gated delta net layers (fused in_proj_qkvz and in_proj_ba) beside full attention
    # with a gated q_proj, dense MLP.
    return Qwen3_5TextConfig(
        intermediate_size=64, num_hidden_layers=4, vocab_size=100, head_dim=8, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, layer_types=HYBRID, **COMMON,
    )


def qwen3_5_moe() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    # Qwen3.5's MoE: the hybrid layers above, 8 experts and a gated shared expert, no expert groups.
    return Qwen3_5MoeTextConfig(
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=4, vocab_size=100, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=HYBRID, **COMMON,
    )


def deepseek_v32() -> Any:
    from transformers import DeepseekV32Config

    # DeepSeek-V3's shapes with the sparse-attention indexer (wq_b, wk, k_norm, weights_proj) in
    # every layer; expert groups, so round-robin expert placement holds.
    return DeepseekV32Config(**SPARSE_MLA, n_group=2, topk_group=1)


def glm_moe_dsa() -> Any:
    from transformers import GlmMoeDsaConfig

    # GLM-5: the same tensors as DeepSeek-V3.2, but one expert group, so vLLM places experts linearly
    # where round-robin is asked: a recording must not be shared between the two.
    return GlmMoeDsaConfig(**SPARSE_MLA)


def glm4_moe_lite() -> Any:
    from transformers import Glm4MoeLiteConfig

    # GLM-4.7-Flash: MLA with q LoRA and MoE under GLM's names.
    return Glm4MoeLiteConfig(**{k: v for k, v in SPARSE_MLA.items() if not k.startswith(("index_", "layer_types"))})


def gemma4() -> Any:
    from transformers import Gemma4TextConfig

    # Per-layer input embeddings, sliding and full attention layers.
    return Gemma4TextConfig(
        intermediate_size=64, num_hidden_layers=2, vocab_size=100, vocab_size_per_layer_input=100, head_dim=8,
        hidden_size_per_layer_input=8, sliding_window=64, layer_types=["sliding_attention", "full_attention"], **COMMON,
    )


def gemma4_moe() -> Any:
    from transformers import Gemma4TextConfig

    # Gemma 4's MoE block beside its dense MLP, keys shared with values (attention_k_eq_v).
    return Gemma4TextConfig(**dict(gemma4().to_dict(), enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16, attention_k_eq_v=True))


def qwen3_5_text(**more: Any) -> Dict[str, Any]:
    """Qwen3.5's text model inside its multimodal checkpoints (rotary over the whole head here, so
    that the M-RoPE sections fill it)."""
    text = dict(
        TEXT, num_hidden_layers=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=HYBRID, **more,
    )
    return dict(head_dim=8, rope_parameters=mrope(2, 1, 1, mrope_interleaved=True, partial_rotary_factor=1.0), **text)


def qwen3_5_vl() -> Any:
    from transformers import Qwen3_5Config

    # Qwen3.5 as the Hub ships it: multimodal (model.language_model.*, model.visual.*).
    return Qwen3_5Config(text_config=qwen3_5_text(), vision_config=dict(num_position_embeddings=16, **QWEN_VISION), **QWEN_TOKENS)


def qwen3_5_moe_vl() -> Any:
    from transformers import Qwen3_5MoeConfig

    text = qwen3_5_text(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    return Qwen3_5MoeConfig(text_config=text, vision_config=dict(num_position_embeddings=16, **QWEN_VISION), **QWEN_TOKENS)


def gemma4_mm() -> Any:
    from transformers import Gemma4Config

    # Gemma 4's vision encoder (its own, pooled 2 x 2) and its embedder into the text model.
    text = dict(
        head_dim=8, sliding_window=64, vocab_size_per_layer_input=160, hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"], **TEXT,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2,
    )
    return Gemma4Config(text_config=text, vision_config=vision)


def minimax_m2() -> Any:
    from transformers import MiniMaxM2Config

    # q and k norms over all heads (sharded by TP with the heads), sigmoid routing with a bias.
    return MiniMaxM2Config(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=100,
        head_dim=8, rotary_dim=4, scoring_func="sigmoid", use_routing_bias=True, **COMMON,
    )


def ministral3() -> Any:
    from transformers import Ministral3Config

    return Ministral3Config(intermediate_size=64, num_hidden_layers=2, vocab_size=100, head_dim=8, **COMMON)


def cohere2_moe() -> Any:
    from transformers import Cohere2MoeConfig

    return Cohere2MoeConfig(
        intermediate_size=16, num_hidden_layers=2, vocab_size=100, head_dim=8, num_experts=4, num_experts_per_tok=2,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"], **COMMON,
    )


def afmoe() -> Any:
    from transformers import AfmoeConfig

    # A dense first layer, shared experts, sigmoid routing normalised.
    return AfmoeConfig(
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_dense_layers=1, vocab_size=100,
        head_dim=8, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1,
        sliding_window=64, score_func="sigmoid", route_norm=True, layer_types=["sliding_attention", "full_attention"],
        **COMMON,
    )


HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

# DeepSeek-V3.2's and GLM-5's tiny shapes: MLA with q LoRA, the indexer, a dense first layer, 8 routed
# experts and a shared one (noaux_tc routing, with its e_score_correction_bias).
SPARSE_MLA = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, intermediate_size=64,
    moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1, vocab_size=100, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, topk_method="noaux_tc", index_topk=8, index_head_dim=8, index_n_heads=2,
    layer_types=["indexed_attention"] * 3,
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
    "bloom": bloom,
    "apertus": apertus,
    "stablelm": stablelm,
    "cohere": cohere,
    "cohere2": cohere2,
    "exaone4": exaone4,
    "nemotron": nemotron,
    "minicpm3": minicpm3,
    "opt": opt,
    "gemma": gemma,
    "gemma3n": gemma3n,
    "ernie45": ernie45,
    "ernie45_moe": ernie45_moe,
    "exaone_moe": exaone_moe,
    "llama4": llama4,
    "gpt_neox": gpt_neox,
    "phi": phi,
    "hunyuan_moe": hunyuan_moe,
    "lfm2": lfm2,
    "lfm2_moe": lfm2_moe,
    "mamba": mamba,
    "mamba2": mamba2,
    "falcon_h1": falcon_h1,
    "nemotron_h": nemotron_h,
    "granitemoehybrid": granitemoehybrid,
    "jamba": jamba,
    "zamba2": zamba2,
    "gpt_oss": gpt_oss,
    "internlm2": internlm2,
    "chatglm": chatglm,
    "bailing_moe": bailing_moe,
    "qwen2_5_vl": qwen2_5_vl,
    "qwen2_5_vl_module_names": qwen2_5_vl_module_names,
    "qwen2_vl": qwen2_vl,
    "qwen3_vl": qwen3_vl,
    "qwen3_vl_moe": qwen3_vl_moe,
    "gemma3_mm": gemma3_mm,
    "llava": llava,
    "mistral3": mistral3,
    "llama4_mm": llama4_mm,
    "glm4v": glm4v,
    "glm4v_moe": glm4v_moe,
    "internvl": internvl,
    "idefics3": idefics3,
    "smolvlm": smolvlm,
    "paligemma": paligemma,
    "kimi_vl": kimi_vl,
    "pixtral": pixtral,
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
    "deepseek_v32": deepseek_v32,
    "glm_moe_dsa": glm_moe_dsa,
    "glm4_moe_lite": glm4_moe_lite,
    "gemma4": gemma4,
    "gemma4_moe": gemma4_moe,
    "qwen3_5_vl": qwen3_5_vl,
    "qwen3_5_moe_vl": qwen3_5_moe_vl,
    "gemma4_mm": gemma4_mm,
    "minimax_m2": minimax_m2,
    "ministral3": ministral3,
    "cohere2_moe": cohere2_moe,
    "afmoe": afmoe,
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
    "bloom": [P(2), P(1, 2)],
    "apertus": [P(2)],
    "stablelm": [P(2)],
    "cohere": [P(2)],
    "cohere2": [P(2)],
    "exaone4": [P(2)],
    "nemotron": [P(2)],
    "minicpm3": [P(2)],
    "opt": [P(2), P(1, 2)],
    "gemma": [P(2)],
    "gemma3n": [P(2)],
    "ernie45": [P(2)],
    "ernie45_moe": [P(2), P(2, ep=True)],
    "exaone_moe": [P(2, ep=True)],
    "llama4": [P(2), P(2, ep=True)],
    "gpt_neox": [P(2)],
    "phi": [P(2)],
    "hunyuan_moe": [P(2, ep=True)],
    "lfm2": [P(2)],
    "lfm2_moe": [P(2, ep=True)],
    "mamba": [P(2)],
    "mamba2": [P(2)],  # vLLM refuses PP for Mamba2 (no SupportsPP)
    "falcon_h1": [P(2)],
    "nemotron_h": [P(2)],
    "granitemoehybrid": [P(2, ep=True)],
    "jamba": [P(2), P(2, ep=True)],
    "zamba2": [P(2)],
    "internlm2": [P(2), P(4)],
    "chatglm": [P(2), P(1, 2)],
    "bailing_moe": [P(2), P(2, ep=True)],
    "qwen2_5_vl": [P(1), P(2), P(4), P(2, encoder="data"), P(2, 2)],
    "qwen2_5_vl_module_names": [P(2)],
    "qwen2_vl": [P(2), P(1, 2)],
    "qwen3_vl": [P(2), P(2, encoder="data"), P(1, 2)],
    "qwen3_vl_moe": [P(2), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(2, 2, ep=True)],
    "gemma3_mm": [P(2), P(1, 2)],
    "llava": [P(4)],
    "mistral3": [P(2)],
    "llama4_mm": [P(2), P(2, ep=True), P(2, encoder="data"), P(1, 2)],
    "glm4v": [P(2), P(2, encoder="data")],
    "glm4v_moe": [P(2), P(2, ep=True)],
    "internvl": [P(2)],  # InternS1 has no data-parallel encoder (vLLM runs it sharded)
    "idefics3": [P(2)],  # vLLM refuses PP for Idefics3 and SmolVLM
    "smolvlm": [P(2)],
    "paligemma": [P(2)],
    "kimi_vl": [P(2), P(2, ep=True), P(2, encoder="data"), P(1, 2)],
    "pixtral": [P(2), P(4)],
    "qwen3_5": [P(1), P(4), P(2, 2)],
    "qwen3_5_moe": [P(1), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(2, 2, ep=True)],
    "deepseek_v32": [P(1), P(2, ep=True), P(4, ep=True, placement="round_robin"), P(1, 2)],
    "glm_moe_dsa": [P(2), P(4, ep=True, placement="round_robin")],
    "glm4_moe_lite": [P(1), P(2, ep=True), P(1, 2)],
    "gemma4": [P(1), P(4), P(2, 2)],
    "gemma4_moe": [P(2, ep=True), P(1, 2)],
    "qwen3_5_vl": [P(2), P(2, encoder="data"), P(1, 2)],
    "qwen3_5_moe_vl": [P(2, ep=True), P(4)],
    "gemma4_mm": [P(2), P(1, 2)],
    "minimax_m2": [P(2), P(2, ep=True), P(1, 2)],
    "ministral3": [P(2)],
    "cohere2_moe": [P(2), P(2, ep=True)],
    "afmoe": [P(2), P(2, ep=True)],
}
