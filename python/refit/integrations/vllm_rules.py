"""The vLLM layouts written out by hand: for processes where no loader can run (no torch or vLLM
in the process: the torch-less tests, examples/python/shim.py, and the Rust demo's synthetic tables
in workloads/src/vllm.rs, which follow the same rules). A vLLM worker never uses them:
`vllm.VllmReceiver.from_engine` records the engine's own loader instead (recorder.py). The
real-framework suite (python/tests/frameworks/test_demo_tables.py) checks these rules against what the
recorder gives from vLLM 0.33 itself for the demo's shapes, so they cannot drift unnoticed.

Known to differ from vLLM 0.33 (found by that suite, and why the worker records instead): Qwen2's
qkv_proj.bias has no rule; 0.33 names a Qwen3-MoE layer's experts `mlp.experts.routed_experts.*`;
it builds embed_tokens, norm and lm_head on every pipeline stage of a MoE model; and it falls back
from round-robin to linear expert placement for models without expert groups.

Layout rules (Llama, Qwen2/3, Qwen3-MoE), each with the vLLM source file it follows (vllm-project/vllm, paths under vllm/), as
read on its main branch in 2026-12 (V1 engine); the rules below read the same in the older versions
of those files we compared (the weight loaders' narrow/copy logic has not changed in substance).
workloads/src/vllm.rs generates the same pieces for synthetic tables.

- Names are the model's `named_parameters()`: `model.embed_tokens.weight`, `model.layers.{i}.…` with
  `i` the global layer index on every pipeline stage, `model.norm.weight`, `lm_head.weight`
  (model_executor/models/llama.py, qwen3.py, qwen3_moe.py; their stacked_params_mapping).
- `self_attn.qkv_proj` (QKVParallelLinear, model_executor/layers/linear.py): this rank's q rows, then
  its k rows, then its v rows. With fewer kv heads than ranks, each kv head is replicated on
  tp / kv_heads consecutive ranks (num_kv_head_replicas; shard tp_rank // replicas).
- `mlp.gate_up_proj` (MergedColumnParallelLinear): this rank's gate rows, then its up rows;
  `o_proj`, `down_proj` (RowParallelLinear): this rank's block of columns.
- FusedMoE experts (model_executor/layers/fused_moe/layer.py; vLLM 0.33 names them
  `mlp.experts.routed_experts.*`): `w13_weight` [local experts,
  2 * ffn / tp, hidden] with each expert's gate rows (w1) then up rows (w3) (_load_w13),
  `w2_weight` [local experts, hidden, ffn / tp] (_load_w2). Without expert parallelism every rank
  holds every expert, split over TP; with it (enable_expert_parallel) experts are whole and each
  rank holds its own: "linear" placement gives rank r a contiguous block, the first
  experts % ep ranks one more; "round_robin" gives experts r, r + ep, ... (determine_expert_map).
  The router `mlp.gate.weight` is replicated (ReplicatedLinear).
- Vocabulary (VocabParallelEmbedding, ParallelLMHead in model_executor/layers/vocab_parallel_embedding.py):
  padded to a multiple of 64 (DEFAULT_VOCAB_PADDING_SIZE), rows split evenly; rows past the real
  vocabulary are padding no refit writes.
- Pipeline stages (distributed/utils.py get_pp_indices): layers split evenly, the remainder given
  one each to the stages before the last, from the second-to-last backwards
  (VLLM_PP_LAYER_PARTITION overrides: `pp_partition`). The first stage holds embed_tokens (the
  last too when embeddings are tied), the last the final norm and lm_head.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from .._lib import invalid_argument
from .layout import ModelShape, ParamBuilder, ParamLayout, check_rank, pad_to, split, vocab_rows


@dataclasses.dataclass(frozen=True)
class VllmRanks:
    """This worker's place in vLLM's parallel groups. `ep` > 1 means expert parallelism is enabled
    (its size is tp * dp in vLLM; `ep_rank` this worker's rank in it). `pp_partition`: per-stage
    layer counts (VLLM_PP_LAYER_PARTITION)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    expert_placement: str = "linear"
    pp_partition: Optional[Tuple[int, ...]] = None
    vocab_padding: int = 64

    def __post_init__(self) -> None:
        for what in ("tp", "pp", "ep"):
            check_rank(getattr(self, what + "_rank"), getattr(self, what), what)
        if self.expert_placement not in ("linear", "round_robin"):
            raise invalid_argument(f"expert placement {self.expert_placement!r}: linear or round_robin")

    @classmethod
    def from_vllm(cls) -> VllmRanks:
        """This process's ranks, read from vLLM's parallel state (inside a vLLM worker)."""
        from vllm.distributed import parallel_state as ps  # type: ignore[import-not-found]

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        pp_group = ps.get_pp_group()
        ep, ep_rank = 1, 0
        get_ep_group = getattr(ps, "get_ep_group", None)
        if get_ep_group is not None:
            try:
                ep_group = get_ep_group()
                ep, ep_rank = ep_group.world_size, ep_group.rank_in_group
            except (AssertionError, AttributeError):  # no expert-parallel group in this setup
                pass
        return cls(tp, tp_rank, pp_group.world_size, pp_group.rank_in_group, ep, ep_rank)


def stage_layers(layers: int, ranks: VllmRanks) -> range:
    """The global layer indices of this pipeline stage (get_pp_indices)."""
    if ranks.pp_partition is not None:
        counts = list(ranks.pp_partition)
        if len(counts) != ranks.pp or sum(counts) != layers:
            raise invalid_argument(f"pp_partition {counts} does not give {layers} layers to {ranks.pp} stages")
    else:
        counts = [layers // ranks.pp] * ranks.pp
        for i in range(2, layers % ranks.pp + 2):
            counts[-i] += 1
    start = sum(counts[: ranks.pp_rank])
    return range(start, start + counts[ranks.pp_rank])


def local_experts(experts: int, ranks: VllmRanks) -> List[int]:
    """The global indices of this worker's experts, in local order (determine_expert_map)."""
    if ranks.ep == 1:
        return list(range(experts))
    if ranks.expert_placement == "round_robin":
        return list(range(ranks.ep_rank, experts, ranks.ep))
    base, extra = divmod(experts, ranks.ep)
    count = base + (ranks.ep_rank < extra)
    start = ranks.ep_rank * base + min(ranks.ep_rank, extra)
    return list(range(start, start + count))


def vllm_layouts(model: ModelShape, ranks: VllmRanks) -> List[ParamLayout]:
    """Every parameter of this worker, in `named_parameters()` order."""
    tp, r = ranks.tp, ranks.tp_rank
    h, hd = model.hidden, model.head_dim
    if model.heads % tp:
        raise invalid_argument(f"{model.heads} query heads do not split over tp {tp}")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise invalid_argument(f"{model.kv_heads} key/value heads neither split nor replicate over tp {tp}")
    q_local = model.q_dim // tp
    if model.kv_heads >= tp:
        kv_n = model.kv_heads // tp
        kv_first = r * kv_n
    else:
        kv_n, kv_first = 1, r // (tp // model.kv_heads)
    kv_local = kv_n * hd
    first_stage, last_stage = ranks.pp_rank == 0, ranks.pp_rank == ranks.pp - 1
    padded = pad_to(model.vocab, ranks.vocab_padding)
    out: List[ParamLayout] = []

    def vocab_param(name: str, tensor: str) -> ParamLayout:
        first, rows, per = vocab_rows(model.vocab, padded, tp, r)
        return ParamBuilder(name, (per, h)).rows(tensor, first, rows, 0).build()

    def vector(name: str, length: int) -> ParamLayout:
        return ParamBuilder(name, (length,)).vector(name, length).build()

    if first_stage or (model.tie_embeddings and last_stage):
        out.append(vocab_param("model.embed_tokens.weight", "model.embed_tokens.weight"))
    for g in stage_layers(model.layers, ranks):
        p = f"model.layers.{g}"
        out.append(vector(f"{p}.input_layernorm.weight", h))
        qkv = ParamBuilder(f"{p}.self_attn.qkv_proj.weight", (q_local + 2 * kv_local, h))
        qkv.rows(f"{p}.self_attn.q_proj.weight", r * q_local, q_local, 0)
        qkv.rows(f"{p}.self_attn.k_proj.weight", kv_first * hd, kv_local, q_local)
        qkv.rows(f"{p}.self_attn.v_proj.weight", kv_first * hd, kv_local, q_local + kv_local)
        out.append(qkv.build())
        if model.qk_norm:
            out.append(vector(f"{p}.self_attn.q_norm.weight", hd))
            out.append(vector(f"{p}.self_attn.k_norm.weight", hd))
        o = ParamBuilder(f"{p}.self_attn.o_proj.weight", (h, q_local))
        out.append(o.rows(f"{p}.self_attn.o_proj.weight", 0, h, 0, (r * q_local, q_local)).build())
        out.append(vector(f"{p}.post_attention_layernorm.weight", h))
        if model.experts:
            gate = ParamBuilder(f"{p}.mlp.gate.weight", (model.experts, h))
            out.append(gate.rows(f"{p}.mlp.gate.weight", 0, model.experts, 0).build())
            out.extend(_fused_moe(model, ranks, p))
        else:
            f = split(model.ffn, tp, "intermediate size")
            gate_up = ParamBuilder(f"{p}.mlp.gate_up_proj.weight", (2 * f, h))
            gate_up.rows(f"{p}.mlp.gate_proj.weight", r * f, f, 0).rows(f"{p}.mlp.up_proj.weight", r * f, f, f)
            out.append(gate_up.build())
            down = ParamBuilder(f"{p}.mlp.down_proj.weight", (h, f))
            out.append(down.rows(f"{p}.mlp.down_proj.weight", 0, h, 0, (r * f, f)).build())
    if last_stage:
        out.append(vector("model.norm.weight", h))
        if not model.tie_embeddings:
            out.append(vocab_param("lm_head.weight", "lm_head.weight"))
    return out


def _fused_moe(model: ModelShape, ranks: VllmRanks, p: str) -> List[ParamLayout]:
    experts = local_experts(model.experts, ranks)
    # Expert parallelism keeps experts whole; otherwise every expert is split over TP.
    moe_tp, moe_rank = (1, 0) if ranks.ep > 1 else (ranks.tp, ranks.tp_rank)
    f = split(model.moe_ffn, moe_tp, "expert intermediate size")
    h = model.hidden
    w13 = ParamBuilder(f"{p}.mlp.experts.routed_experts.w13_weight", (len(experts), 2 * f, h))
    w2 = ParamBuilder(f"{p}.mlp.experts.routed_experts.w2_weight", (len(experts), h, f))
    for j, e in enumerate(experts):
        x = f"{p}.mlp.experts.{e}"
        w13.rows(f"{x}.gate_proj.weight", moe_rank * f, f, j * 2 * f)
        w13.rows(f"{x}.up_proj.weight", moe_rank * f, f, j * 2 * f + f)
        w2.rows(f"{x}.down_proj.weight", 0, h, j * h, (moe_rank * f, f))
    return [w13.build(), w2.build()]
