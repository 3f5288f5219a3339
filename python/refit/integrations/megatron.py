"""Publishers: the parameters of a Megatron-LM (Megatron Core, Transformer Engine layer specs) GPT
model on one rank, turned into offers of the checkpoint tensors.

Layout rules, each with the Megatron-LM source file it follows, as read in Megatron Core 0.20
(NVIDIA/Megatron-LM main at commit d98e8a6, 2026-08-22), paths under megatron/core unless given.
workloads/src/megatron.rs generates the same pieces for synthetic tables.

- Names: `embedding.word_embeddings.weight`, `decoder.layers.{i}.…`, `decoder.final_layernorm.weight`,
  `output_layer.weight` (models/gpt/gpt_model.py, models/gpt/gpt_layer_specs.py); `i` is the layer's
  index within its pipeline stage, and `module.` prefixes of wrappers are ignored.
- Pipeline stages hold consecutive layers: the layer count split evenly, or the first / last stage
  given their own counts (transformer/transformer_block.py get_num_layers_to_build,
  transformer/transformer_layer.py get_transformer_layer_offset). The first stage holds the
  embedding, the last the final norm and the output layer (with tied embeddings, a last stage that
  is not also the first holds its own copy of the embedding as `output_layer.weight`).
- `linear_qkv` is one column-parallel weight interleaved by query group: for each of the kv_heads
  groups, its q heads, then its k head, then its v head (transformer/attention.py
  SelfAttention.get_query_key_value_tensors); tensor-parallel rank r holds rows [r*R/tp, (r+1)*R/tp)
  of it, which cut through groups when tp > kv_heads (the same function's all-gather branch).
- `linear_fc1` of a gated MLP is [gate rows of this rank; up rows of this rank]
  (transformer/mlp.py, apply_swiglu_sharded_factory); `linear_proj` and `linear_fc2` are
  row-parallel (this rank's block of columns). Layer norms before linear_qkv and linear_fc1 are
  fused into them (`layer_norm_weight`); a MoE layer has `pre_mlp_layernorm.weight` instead.
- Experts: expert-parallel rank e holds experts [e*E/ep, (e+1)*E/ep) (transformer/moe/moe_layer.py
  local_expert_indices), each split over expert-tensor-parallel ranks like a dense MLP (default
  expert TP size: the TP size, model_parallel_config.py). TEGroupedMLP keeps one weight per local
  expert, `mlp.experts.linear_fc1.weight{j}` and `linear_fc2.weight{j}`; with
  moe_single_grouped_weight they are stacked into one `linear_fc1.weight` / `linear_fc2.weight`
  (transformer/moe/experts.py, extensions/transformer_engine.py: torch.stack along dim 0). The
  router is `mlp.router.weight` [experts, hidden], replicated.
- Vocabulary: padded to a multiple of make_vocab_size_divisible_by * tp (default 128 * tp;
  training/vocab_utils.py), rows split evenly (tensor_parallel/layers.py VocabParallelEmbedding).
- Data-parallel replicas hold identical copies: the planner keeps one owner per replica set.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Mapping, Optional, Tuple

from ..plan import Table
from ..tensor import TensorLike
from .layout import (
    ModelShape,
    ParamBuilder,
    ParamLayout,
    add_params,
    check_rank,
    concat_rows,
    new_table,
    pad_to,
    split,
    vocab_rows,
)
from .._lib import invalid_argument


@dataclasses.dataclass(frozen=True)
class MegatronRanks:
    """This rank's place in Megatron's parallel groups. `etp` (expert tensor parallel size) and
    `etp_rank` default to `tp` / `tp_rank`, as Megatron's do. `dp` / `dp_rank` (data parallel)
    change no layout: replicas are identical. `first_stage_layers` / `last_stage_layers` are
    Megatron's --decoder-first/last-pipeline-num-layers. `grouped_experts`: experts stored as one
    stacked weight per layer (moe_single_grouped_weight) instead of one per expert."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: Optional[int] = None
    etp_rank: Optional[int] = None
    dp: int = 1
    dp_rank: int = 0
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    grouped_experts: bool = False
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        for what in ("tp", "pp", "ep", "dp"):
            check_rank(getattr(self, what + "_rank"), getattr(self, what), what)
        check_rank(self.expert_tp_rank, self.expert_tp, "expert tensor parallel")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_tp_rank(self) -> int:
        return (self.tp_rank % self.expert_tp) if self.etp_rank is None else self.etp_rank


def stage_layers(layers: int, ranks: MegatronRanks) -> range:
    """The global layer indices of this pipeline stage (get_transformer_layer_offset and
    get_num_layers_to_build, without virtual pipeline stages)."""
    first, last, pp = ranks.first_stage_layers, ranks.last_stage_layers, ranks.pp
    counts: List[int]
    if first is None and last is None:
        counts = [split(layers, pp, "layers")] * pp
    else:
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = layers - (first or 0) - (last or 0)
        per = split(middle_layers, middle_stages, "middle-stage layers") if middle_stages > 0 else 0
        if middle_stages <= 0 and middle_layers:
            raise invalid_argument(f"{middle_layers} layers left for no middle stage")
        counts = [per] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    start = sum(counts[: ranks.pp_rank])
    return range(start, start + counts[ranks.pp_rank])


def megatron_layouts(model: ModelShape, ranks: MegatronRanks) -> List[ParamLayout]:
    """Every parameter of this rank, in `named_parameters()` order."""
    tp, r = ranks.tp, ranks.tp_rank
    h, hd = model.hidden, model.head_dim
    if model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
        raise invalid_argument(f"{model.heads} q / {model.kv_heads} kv heads do not split over tp {tp}")
    q_local = model.q_dim // tp
    first_stage, last_stage = ranks.pp_rank == 0, ranks.pp_rank == ranks.pp - 1
    padded = pad_to(model.vocab, ranks.vocab_divisible_by * tp)
    out: List[ParamLayout] = []

    def vocab_param(name: str, tensor: str) -> ParamLayout:
        first, rows, per = vocab_rows(model.vocab, padded, tp, r)
        return ParamBuilder(name, (per, h)).rows(tensor, first, rows, 0).build()

    def vector(name: str, tensor: str, length: int) -> ParamLayout:
        return ParamBuilder(name, (length,)).vector(tensor, length).build()

    if first_stage:
        out.append(vocab_param("embedding.word_embeddings.weight", "model.embed_tokens.weight"))
    qpg = model.heads // model.kv_heads
    for local, g in enumerate(stage_layers(model.layers, ranks)):
        p, hf = f"decoder.layers.{local}", f"model.layers.{g}"
        out.append(vector(f"{p}.self_attention.linear_qkv.layer_norm_weight", f"{hf}.input_layernorm.weight", h))
        groups: List[Tuple[str, int, int]] = []
        for j in range(model.kv_heads):
            groups.append((f"{hf}.self_attn.q_proj.weight", j * qpg * hd, qpg * hd))
            groups.append((f"{hf}.self_attn.k_proj.weight", j * hd, hd))
            groups.append((f"{hf}.self_attn.v_proj.weight", j * hd, hd))
        total = model.kv_heads * (qpg + 2) * hd
        rows = total // tp
        qkv = ParamBuilder(f"{p}.self_attention.linear_qkv.weight", (rows, h))
        out.append(concat_rows(qkv, groups, r * rows, (r + 1) * rows).build())
        if model.qk_norm:
            out.append(vector(f"{p}.self_attention.q_layernorm.weight", f"{hf}.self_attn.q_norm.weight", hd))
            out.append(vector(f"{p}.self_attention.k_layernorm.weight", f"{hf}.self_attn.k_norm.weight", hd))
        proj = ParamBuilder(f"{p}.self_attention.linear_proj.weight", (h, q_local))
        out.append(proj.rows(f"{hf}.self_attn.o_proj.weight", 0, h, 0, (r * q_local, q_local)).build())
        if model.experts:
            out.append(vector(f"{p}.pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight", h))
            router = ParamBuilder(f"{p}.mlp.router.weight", (model.experts, h))
            out.append(router.rows(f"{hf}.mlp.gate.weight", 0, model.experts, 0).build())
            out.extend(_experts(model, ranks, p, hf))
        else:
            f = split(model.ffn, tp, "intermediate size")
            out.append(vector(f"{p}.mlp.linear_fc1.layer_norm_weight", f"{hf}.post_attention_layernorm.weight", h))
            fc1 = ParamBuilder(f"{p}.mlp.linear_fc1.weight", (2 * f, h))
            fc1.rows(f"{hf}.mlp.gate_proj.weight", r * f, f, 0).rows(f"{hf}.mlp.up_proj.weight", r * f, f, f)
            out.append(fc1.build())
            fc2 = ParamBuilder(f"{p}.mlp.linear_fc2.weight", (h, f))
            out.append(fc2.rows(f"{hf}.mlp.down_proj.weight", 0, h, 0, (r * f, f)).build())
    if last_stage:
        out.append(vector("decoder.final_layernorm.weight", "model.norm.weight", h))
        if not model.tie_embeddings:
            out.append(vocab_param("output_layer.weight", "lm_head.weight"))
        elif not first_stage:
            out.append(vocab_param("output_layer.weight", "model.embed_tokens.weight"))
    return out


def _experts(model: ModelShape, ranks: MegatronRanks, p: str, hf: str) -> List[ParamLayout]:
    local = split(model.experts, ranks.ep, "experts")
    f = split(model.moe_ffn, ranks.expert_tp, "expert intermediate size")
    r, h = ranks.expert_tp_rank, model.hidden
    experts = [ranks.ep_rank * local + j for j in range(local)]
    if ranks.grouped_experts:
        fc1 = ParamBuilder(f"{p}.mlp.experts.linear_fc1.weight", (local, 2 * f, h))
        fc2 = ParamBuilder(f"{p}.mlp.experts.linear_fc2.weight", (local, h, f))
        for j, e in enumerate(experts):
            x = f"{hf}.mlp.experts.{e}"
            fc1.rows(f"{x}.gate_proj.weight", r * f, f, j * 2 * f).rows(f"{x}.up_proj.weight", r * f, f, j * 2 * f + f)
            fc2.rows(f"{x}.down_proj.weight", 0, h, j * h, (r * f, f))
        return [fc1.build(), fc2.build()]
    out = []
    for j, e in enumerate(experts):
        x = f"{hf}.mlp.experts.{e}"
        fc1 = ParamBuilder(f"{p}.mlp.experts.linear_fc1.weight{j}", (2 * f, h))
        out.append(fc1.rows(f"{x}.gate_proj.weight", r * f, f, 0).rows(f"{x}.up_proj.weight", r * f, f, f).build())
    for j, e in enumerate(experts):
        fc2 = ParamBuilder(f"{p}.mlp.experts.linear_fc2.weight{j}", (h, f))
        out.append(fc2.rows(f"{hf}.mlp.experts.{e}.down_proj.weight", 0, h, 0, (r * f, f)).build())
    return out


class MegatronPublisher:
    """Offers one Megatron rank's parameters: `publisher.table(model.named_parameters(), process)`
    is that rank's Table of offers, for Plan.build beside the receivers' tables."""

    def __init__(self, model: ModelShape, ranks: MegatronRanks) -> None:
        self.model = model
        self.ranks = ranks
        self.layouts = megatron_layouts(model, ranks)

    def add_to(
        self,
        table: Table,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        strict: bool = True,
        digests: Optional[Mapping[str, int]] = None,
    ) -> int:
        """Adds this rank's offers to `table` (see layout.add_params); returns how many."""
        return add_params(table, self.model, self.layouts, named_parameters, process, True, device, strict, digests)

    def table(
        self,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        strict: bool = True,
        digests: Optional[Mapping[str, int]] = None,
    ) -> Table:
        """A new Table holding this rank's offers."""
        return new_table(lambda table: self.add_to(table, named_parameters, process, device, strict, digests))
