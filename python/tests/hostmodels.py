"""Test helpers for the integrations without torch: host-memory tensors shaped like torch's, and the
Megatron and vLLM parameter conventions written a second, independent way (whole matrices cut and
stacked the way each framework's loading code does), so a refit's received bytes can be compared
with what the framework itself would hold."""

from __future__ import annotations

import ctypes
from typing import Dict, List, Sequence, Tuple

from refit.integrations import MegatronRanks, ModelShape, VllmRanks
from refit.integrations.vllm import local_experts

POISON = 0xEEEE
Matrix = List[List[int]]


class Device:
    def __init__(self, index: int) -> None:
        self.type = "cpu"
        self.index = index


class HostTensor:
    """A contiguous uint16 buffer described as a bfloat16 tensor of `shape` (what add_params reads)."""

    dtype = "torch.bfloat16"

    def __init__(self, shape: Sequence[int], values: Sequence[int] = ()) -> None:
        self.shape = tuple(shape)
        n = 1
        for e in self.shape:
            n *= e
        self.buffer = (ctypes.c_uint16 * n)(*(values or [POISON] * n))
        self.device = Device(0)

    def data_ptr(self) -> int:
        return ctypes.addressof(self.buffer)

    def element_size(self) -> int:
        return 2

    def numel(self) -> int:
        return len(self.buffer)

    def stride(self) -> Tuple[int, ...]:
        strides = [1] * len(self.shape)
        for d in range(len(self.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.shape[d + 1]
        return tuple(strides)

    def values(self) -> List[int]:
        return list(self.buffer)


def checkpoint(model: ModelShape) -> Dict[str, Matrix]:
    """Every checkpoint tensor as rows of distinct element values (never POISON)."""
    out: Dict[str, Matrix] = {}
    for t, (name, shape) in enumerate(model.checkpoint_tensors().items()):
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        out[name] = [[(t * 7919 + (r * cols + c) * 104729 + 17) % 60000 + 1 for c in range(cols)] for r in range(rows)]
    return out


def row_chunk(m: Matrix, parts: int, i: int) -> Matrix:
    n = len(m) // parts
    return m[i * n : (i + 1) * n]


def col_chunk(m: Matrix, parts: int, i: int) -> Matrix:
    n = len(m[0]) // parts
    return [row[i * n : (i + 1) * n] for row in m]


def flat(*blocks: Matrix) -> List[int]:
    return [v for block in blocks for row in block for v in row]


def padded_vocab(m: Matrix, padded: int, parts: int, i: int, pad: int) -> Matrix:
    """Rows of shard i of the vocabulary padded to `padded` rows with rows of `pad`."""
    full = m + [[pad] * len(m[0]) for _ in range(padded - len(m))]
    return row_chunk(full, parts, i)


def megatron_params(model: ModelShape, ranks: MegatronRanks, ckpt: Dict[str, Matrix]) -> Dict[str, List[int]]:
    """One Megatron rank's parameters, built from the checkpoint as Megatron's checkpoint converters
    lay them out: linear_qkv interleaved per query group ([q heads | k | v] per group, then split by
    rows), fused [gate; up] per rank, columns of row-parallel weights, padded vocabulary."""
    tp, r, hd = ranks.tp, ranks.tp_rank, model.head_dim
    out: Dict[str, List[int]] = {}
    multiple = ranks.vocab_divisible_by * tp
    padded = -(-model.vocab // multiple) * multiple
    layers_per_stage = model.layers // ranks.pp
    first = ranks.pp_rank * layers_per_stage
    if ranks.pp_rank == 0:
        out["embedding.word_embeddings.weight"] = flat(padded_vocab(ckpt["model.embed_tokens.weight"], padded, tp, r, 0))
    for local in range(layers_per_stage):
        p, hf = f"decoder.layers.{local}", f"model.layers.{first + local}"
        out[f"{p}.self_attention.linear_qkv.layer_norm_weight"] = flat(ckpt[f"{hf}.input_layernorm.weight"])
        q, k, v = (ckpt[f"{hf}.self_attn.{x}_proj.weight"] for x in "qkv")
        qpg = model.heads // model.kv_heads
        interleaved: Matrix = []
        for g in range(model.kv_heads):
            interleaved += q[g * qpg * hd : (g + 1) * qpg * hd] + k[g * hd : (g + 1) * hd] + v[g * hd : (g + 1) * hd]
        out[f"{p}.self_attention.linear_qkv.weight"] = flat(row_chunk(interleaved, tp, r))
        if model.qk_norm:
            out[f"{p}.self_attention.q_layernorm.weight"] = flat(ckpt[f"{hf}.self_attn.q_norm.weight"])
            out[f"{p}.self_attention.k_layernorm.weight"] = flat(ckpt[f"{hf}.self_attn.k_norm.weight"])
        out[f"{p}.self_attention.linear_proj.weight"] = flat(col_chunk(ckpt[f"{hf}.self_attn.o_proj.weight"], tp, r))
        if model.experts:
            out[f"{p}.pre_mlp_layernorm.weight"] = flat(ckpt[f"{hf}.post_attention_layernorm.weight"])
            out[f"{p}.mlp.router.weight"] = flat(ckpt[f"{hf}.mlp.gate.weight"])
            local_n = model.experts // ranks.ep
            etp, er = ranks.expert_tp, ranks.expert_tp_rank
            fc1, fc2 = [], []
            for j in range(local_n):
                x = f"{hf}.mlp.experts.{ranks.ep_rank * local_n + j}"
                gate, up = ckpt[f"{x}.gate_proj.weight"], ckpt[f"{x}.up_proj.weight"]
                fc1.append(flat(row_chunk(gate, etp, er), row_chunk(up, etp, er)))
                fc2.append(flat(col_chunk(ckpt[f"{x}.down_proj.weight"], etp, er)))
            if ranks.grouped_experts:
                out[f"{p}.mlp.experts.linear_fc1.weight"] = [v for e in fc1 for v in e]
                out[f"{p}.mlp.experts.linear_fc2.weight"] = [v for e in fc2 for v in e]
            else:
                for j, weights in enumerate(fc1):
                    out[f"{p}.mlp.experts.linear_fc1.weight{j}"] = weights
                for j, weights in enumerate(fc2):
                    out[f"{p}.mlp.experts.linear_fc2.weight{j}"] = weights
        else:
            out[f"{p}.mlp.linear_fc1.layer_norm_weight"] = flat(ckpt[f"{hf}.post_attention_layernorm.weight"])
            gate, up = ckpt[f"{hf}.mlp.gate_proj.weight"], ckpt[f"{hf}.mlp.up_proj.weight"]
            out[f"{p}.mlp.linear_fc1.weight"] = flat(row_chunk(gate, tp, r), row_chunk(up, tp, r))
            out[f"{p}.mlp.linear_fc2.weight"] = flat(col_chunk(ckpt[f"{hf}.mlp.down_proj.weight"], tp, r))
    if ranks.pp_rank == ranks.pp - 1:
        out["decoder.final_layernorm.weight"] = flat(ckpt["model.norm.weight"])
        out["output_layer.weight"] = flat(padded_vocab(ckpt["lm_head.weight"], padded, tp, r, 0))
    return out


def vllm_params(model: ModelShape, ranks: VllmRanks, ckpt: Dict[str, Matrix], layers: range) -> Dict[str, List[int]]:
    """One vLLM worker's parameters as its weight loaders fill them: qkv_proj = [q shard; k shard;
    v shard] with kv shard tp_rank // replicas, gate_up = [gate shard; up shard], FusedMoE w13 per
    expert [w1 shard; w3 shard], vocabulary rows padded to 64 (padding stays POISON: no loader
    writes it, and neither does a refit)."""
    tp, r = ranks.tp, ranks.tp_rank
    out: Dict[str, List[int]] = {}
    padded = -(-model.vocab // 64) * 64
    if ranks.pp_rank == 0:
        out["model.embed_tokens.weight"] = flat(padded_vocab(ckpt["model.embed_tokens.weight"], padded, tp, r, POISON))
    replicas = max(1, tp // model.kv_heads)
    kv_shard, kv_parts = (r // replicas, model.kv_heads) if tp >= model.kv_heads else (r, tp)
    for g in layers:
        p = f"model.layers.{g}"
        out[f"{p}.input_layernorm.weight"] = flat(ckpt[f"{p}.input_layernorm.weight"])
        q, k, v = (ckpt[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
        out[f"{p}.self_attn.qkv_proj.weight"] = flat(
            row_chunk(q, tp, r), row_chunk(k, kv_parts, kv_shard), row_chunk(v, kv_parts, kv_shard)
        )
        if model.qk_norm:
            for x in ("q_norm", "k_norm"):
                out[f"{p}.self_attn.{x}.weight"] = flat(ckpt[f"{p}.self_attn.{x}.weight"])
        out[f"{p}.self_attn.o_proj.weight"] = flat(col_chunk(ckpt[f"{p}.self_attn.o_proj.weight"], tp, r))
        out[f"{p}.post_attention_layernorm.weight"] = flat(ckpt[f"{p}.post_attention_layernorm.weight"])
        if model.experts:
            out[f"{p}.mlp.gate.weight"] = flat(ckpt[f"{p}.mlp.gate.weight"])
            moe_tp, moe_r = (1, 0) if ranks.ep > 1 else (tp, r)
            w13, w2 = [], []
            for e in local_experts(model.experts, ranks):
                x = f"{p}.mlp.experts.{e}"
                w13 += flat(row_chunk(ckpt[f"{x}.gate_proj.weight"], moe_tp, moe_r))
                w13 += flat(row_chunk(ckpt[f"{x}.up_proj.weight"], moe_tp, moe_r))
                w2 += flat(col_chunk(ckpt[f"{x}.down_proj.weight"], moe_tp, moe_r))
            out[f"{p}.mlp.experts.routed_experts.w13_weight"] = w13
            out[f"{p}.mlp.experts.routed_experts.w2_weight"] = w2
        else:
            gate, up = ckpt[f"{p}.mlp.gate_proj.weight"], ckpt[f"{p}.mlp.up_proj.weight"]
            out[f"{p}.mlp.gate_up_proj.weight"] = flat(row_chunk(gate, tp, r), row_chunk(up, tp, r))
            out[f"{p}.mlp.down_proj.weight"] = flat(col_chunk(ckpt[f"{p}.mlp.down_proj.weight"], tp, r))
    if ranks.pp_rank == ranks.pp - 1:
        out["model.norm.weight"] = flat(ckpt["model.norm.weight"])
        out["lm_head.weight"] = flat(padded_vocab(ckpt["lm_head.weight"], padded, tp, r, POISON))
    return out
