"""Publishers: the parameters of a Megatron-LM (Megatron Core, local or Transformer Engine layer
specs) GPT model on one rank, turned into offers of the checkpoint tensors.

Two ways, one per situation:
- `MegatronModulePublisher(model, vocab=...)`, where a Megatron-core model exists: reads the model's
  own `sharded_state_dict()` (the trainer's description of every local shard: global shape,
  offsets over pipeline, tensor, expert and expert-tensor parallelism, vocabulary padding) and only
  names rows with the small rules of MEGATRON_TO_HF below (fused QKV per query group, fc1 gate then
  up, norm names of both layer specs; Multi-Latent Attention and shared experts under DeepSeek's
  names). Tested against megatron-core itself (frameworks/test_megatron_publisher.py,
  frameworks/test_megatron_mla.py).
- `MegatronPublisher(model_shape, ranks)` / `megatron_layouts`, where no model runs (synthetic
  tables, planning ahead of a trainer, torch-free tests): the hand rules that follow describe what
  the sharded state dict would say (which rows of which global Megatron tensor a rank holds); the
  rows are then named by the same MEGATRON_TO_HF rules as the module publisher's.

Layout rules of `megatron_layouts`, each with the Megatron-LM source file it follows, as read in Megatron Core 0.20
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
import re
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from ..plan import Table
from ..tensor import TensorLike
from .layout import (
    ModelShape,
    ParamBuilder,
    ParamLayout,
    add_params,
    check_rank,
    new_table,
    pad_to,
    split,
    vocab_rows,
)
from .._lib import invalid_argument
from .offers import Offer, add_offers, check_unique


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
        total = model.kv_heads * (qpg + 2) * hd
        blocks = _qkv_blocks(hf, "weight", (total, h), AttentionShape(model.heads, model.kv_heads, hd))
        rows = total // tp
        qkv = ParamBuilder(f"{p}.self_attention.linear_qkv.weight", (rows, h))
        out.append(_place(qkv, blocks, r * rows, (r + 1) * rows).build())
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
            _local_fc1(fc1, f"{hf}.mlp", model.ffn, r, f, 0)
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
            _local_fc1(fc1, x, model.moe_ffn, r, f, j * 2 * f)
            fc2.rows(f"{x}.down_proj.weight", 0, h, j * h, (r * f, f))
        return [fc1.build(), fc2.build()]
    out = []
    for j, e in enumerate(experts):
        x = f"{hf}.mlp.experts.{e}"
        fc1 = ParamBuilder(f"{p}.mlp.experts.linear_fc1.weight{j}", (2 * f, h))
        out.append(_local_fc1(fc1, x, model.moe_ffn, r, f, 0).build())
    for j, e in enumerate(experts):
        fc2 = ParamBuilder(f"{p}.mlp.experts.linear_fc2.weight{j}", (h, f))
        out.append(fc2.rows(f"{hf}.mlp.experts.{e}.down_proj.weight", 0, h, 0, (r * f, f)).build())
    return out


def _place(builder: ParamBuilder, blocks: List[RowBlock], start: int, stop: int, at_row: int = 0) -> ParamBuilder:
    """Rows [start, stop) of a global Megatron tensor (named by `blocks`, the rules the module
    publisher applies to the sharded metadata), placed from row `at_row` of the parameter."""
    for block in blocks:
        lo, hi = max(start, block.first), min(stop, block.first + block.rows)
        if lo < hi:
            builder.rows(block.name, block.hf_first + lo - block.first, hi - lo, at_row + lo - start)
    return builder


def _local_fc1(builder: ParamBuilder, hf: str, ffn: int, rank: int, rows: int, at_row: int) -> ParamBuilder:
    """A TP rank's gated fc1: its rows of the gate half, then its rows of the up half of the global
    [gate; up] tensor (what apply_swiglu_sharded_factory's two shards say)."""
    blocks = _fc1_blocks(hf, "weight", (2 * ffn, builder.row_len), True)
    _place(builder, blocks, rank * rows, (rank + 1) * rows, at_row)
    return _place(builder, blocks, ffn + rank * rows, ffn + (rank + 1) * rows, at_row + rows)


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


# --- Offers from Megatron-core's own sharded state dict -------------------------------------------
#
# `megatron_layouts` above describes a rank without a model (synthetic tables, planning before a
# trainer starts); where a Megatron-core model exists, its `sharded_state_dict()` is the trainer's
# own description and is read instead: each ShardedTensor gives the key of a global Megatron tensor
# (layers and experts stacked on prepended axes, or numbered in the key under
# singleton_local_shards), its global shape, this rank's offset, and a view of the local
# parameter (ShardedTensorFactory pieces, as the gated fc1's gate and up halves, are built first).
# Pipeline stage, TP, EP and expert-TP offsets and vocabulary padding all come from there; the only
# rules left map a global Megatron tensor's rows to Hugging Face tensors (MEGATRON_TO_HF: megatron_to_hf
# with _LAYER_NAMES, _MLA_NAMES, _TOP_NAMES, _qkv_blocks and _fc1_blocks).


@dataclasses.dataclass(frozen=True)
class RowBlock:
    """Rows [first, first + rows) of a global Megatron tensor are rows [hf_first, hf_first + rows)
    of checkpoint tensor `name`, of global shape `shape` (the other dimensions unchanged)."""

    name: str
    shape: Tuple[int, ...]
    first: int
    rows: int
    hf_first: int = 0


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What the fused QKV rule needs from Megatron's TransformerConfig."""

    heads: int
    query_groups: int
    head_dim: int
    gated: bool = True
    # Multi-Latent Attention (MLATransformerConfig.multi_latent_attention): no fused QKV, and
    # q_layernorm / kv_layernorm are the latent norms (q_a_layernorm / kv_a_layernorm) rather than
    # the per-head QK norms of Qwen3 that the same Megatron names mean in SelfAttention.
    latent: bool = False

    @classmethod
    def from_config(cls, config: Any) -> AttentionShape:
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_query_groups", None) or heads)
        head_dim = int(getattr(config, "kv_channels", None) or config.hidden_size // heads)
        gated = bool(getattr(config, "gated_linear_unit", False))
        return cls(heads, groups, head_dim, gated, bool(getattr(config, "multi_latent_attention", False)))


def _qkv_blocks(hf: str, kind: str, shape: Tuple[int, ...], attention: AttentionShape) -> List[RowBlock]:
    """linear_qkv: per query group, its q heads, its k head, its v head
    (transformer/attention.py SelfAttention.get_query_key_value_tensors)."""
    hd, groups = attention.head_dim, attention.query_groups
    qpg = attention.heads // groups
    rest = shape[1:]
    if shape[0] != (attention.heads + 2 * groups) * hd:
        raise invalid_argument(f"linear_qkv has {shape[0]} rows; {attention} gives {(attention.heads + 2 * groups) * hd}")
    q, k, v = (f"{hf}.self_attn.{x}_proj.{kind}" for x in "qkv")
    blocks = []
    for j in range(groups):
        base = j * (qpg + 2) * hd
        blocks.append(RowBlock(q, (attention.heads * hd, *rest), base, qpg * hd, j * qpg * hd))
        blocks.append(RowBlock(k, (groups * hd, *rest), base + qpg * hd, hd, j * hd))
        blocks.append(RowBlock(v, (groups * hd, *rest), base + (qpg + 1) * hd, hd, j * hd))
    return blocks


def _fc1_blocks(hf: str, kind: str, shape: Tuple[int, ...], gated: bool) -> List[RowBlock]:
    """linear_fc1 of a gated MLP: all gate rows, then all up rows (the global tensor that
    transformer/mlp.py apply_swiglu_sharded_factory shards as two halves)."""
    if not gated:
        return [RowBlock(f"{hf}.up_proj.{kind}", shape, 0, shape[0])]
    half = shape[0] // 2
    rest = shape[1:]
    return [
        RowBlock(f"{hf}.gate_proj.{kind}", (half, *rest), 0, half),
        RowBlock(f"{hf}.up_proj.{kind}", (half, *rest), half, half),
    ]


# Layer-relative Megatron keys -> Hugging Face names under model.layers.{i}. Both layer specs: the
# local spec's input_layernorm / pre_mlp_layernorm are keyed in the sharded state dict as the
# Transformer Engine spec's fused names (gpt_layer_specs.py sharded_state_dict_keys_map), and both
# spellings are accepted.
_LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "input_layernorm.": "input_layernorm.",
    "self_attention.linear_proj.": "self_attn.o_proj.",
    "self_attention.q_layernorm.": "self_attn.q_norm.",
    "self_attention.k_layernorm.": "self_attn.k_norm.",
    "mlp.linear_fc1.layer_norm_": "post_attention_layernorm.",
    "pre_mlp_layernorm.": "post_attention_layernorm.",
    "mlp.linear_fc2.": "mlp.down_proj.",
    "mlp.router.": "mlp.gate.",
    "mlp.shared_experts.linear_fc2.": "mlp.shared_experts.down_proj.",
}
# Multi-Latent Attention (transformer/multi_latent_attention.py MLASelfAttention), DeepSeek-V2/V3's
# Hugging Face names. Every one is a plain row-for-row rename: linear_q_proj / linear_q_up_proj
# rows are [head][qk_head_dim nope, qk_pos_emb_head_dim rope] (q.view(..., heads, q_head_dim) then
# split [nope, rope]), linear_kv_up_proj rows [head][qk_head_dim k_nope, v_head_dim v] (kv.view
# then split [k_nope, v]), linear_kv_down_proj rows [kv_lora_rank latent, rope k] (split
# [kv_lora_rank, qk_pos_emb_head_dim]): the orders of DeepSeek's q_proj / q_b_proj, kv_b_proj and
# kv_a_proj_with_mqa. The rope rows keep DeepSeek's interleaved pairs: Megatron de-interleaves
# them at run time (rope_utils.py apply_rotary_pos_emb, mla_rotary_interleaved=True), as
# DeepSeek's own modeling code does. Which rows a rank holds (heads split over TP; the down
# projections split over TP by the local spec's ColumnParallelLinear and gathered at run time, or
# whole under Transformer Engine's duplicated TELinear) is the sharded state dict's to say.
# Norms: the local spec's q_layernorm / kv_layernorm, or the Transformer Engine spec's fused
# layer_norm_weight of the up projections they feed (mla_qk_norm_config.py). Tested with both specs
# (frameworks/test_megatron_mla.py, test_megatron_te_mla.py: Transformer Engine's own modules, its
# compiled kernels stood in).
# With qk_layernorm and no q LoRA, megatron-core fuses a Q norm into linear_q_proj that DeepSeek's
# checkpoint has no tensor for: it stays unnamed (None), so a strict publisher refuses it rather
# than offering it under an invented name.
_MLA_NAMES: Dict[str, Optional[str]] = {
    "self_attention.linear_q_proj.layer_norm_": None,
    "self_attention.linear_q_proj.": "self_attn.q_proj.",
    "self_attention.linear_q_down_proj.": "self_attn.q_a_proj.",
    "self_attention.linear_q_up_proj.layer_norm_": "self_attn.q_a_layernorm.",
    "self_attention.linear_q_up_proj.": "self_attn.q_b_proj.",
    "self_attention.q_layernorm.": "self_attn.q_a_layernorm.",
    "self_attention.linear_kv_down_proj.": "self_attn.kv_a_proj_with_mqa.",
    "self_attention.linear_kv_up_proj.layer_norm_": "self_attn.kv_a_layernorm.",
    "self_attention.linear_kv_up_proj.": "self_attn.kv_b_proj.",
    "self_attention.kv_layernorm.": "self_attn.kv_a_layernorm.",
}
_TOP_NAMES = {
    "decoder.final_layernorm.": "model.norm.",
    "embedding.word_embeddings.": "model.embed_tokens.",
    "output_layer.": "lm_head.",
}
_LAYER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.experts\.(?:(\d+)\.)?(linear_fc[12])\.(weight|bias)(_w|_v)?$")


def megatron_to_hf(
    key: str, shape: Tuple[int, ...], attention: AttentionShape, vocab: Optional[int] = None
) -> Optional[List[RowBlock]]:
    """The row blocks of global Megatron tensor `key` (layer and expert indices resolved into the
    key: `decoder.layers.3.mlp.experts.5.linear_fc1.weight`) of `shape`; None for a key no rule
    names. `vocab` (the checkpoint's vocabulary) drops the padding rows of the embedding and the
    output layer."""
    for prefix, hf in _TOP_NAMES.items():
        if key.startswith(prefix):
            name = hf + key[len(prefix) :]
            if prefix != "decoder.final_layernorm." and vocab is not None:
                return [RowBlock(name, (vocab, *shape[1:]), 0, min(vocab, shape[0]))]
            return [RowBlock(name, shape, 0, shape[0])]
    layer = _LAYER.match(key)
    if layer is None or layer.group(1) is None:
        return None
    hf, rest = f"model.layers.{layer.group(1)}", layer.group(2)
    expert = _EXPERT.match(rest)
    if expert is not None:
        number, which, kind, half = expert.groups()
        if number is None:
            return None
        x = f"{hf}.mlp.experts.{number}"
        if which == "linear_fc2":
            return [RowBlock(f"{x}.down_proj.{kind}", shape, 0, shape[0])]
        if half:
            return [RowBlock(f"{x}.{'gate' if half == '_w' else 'up'}_proj.{kind}", shape, 0, shape[0])]
        return _fc1_blocks(x, kind, shape, attention.gated)
    if attention.latent:
        for prefix, name in _MLA_NAMES.items():
            if rest.startswith(prefix):
                return None if name is None else [RowBlock(f"{hf}.{name}{rest[len(prefix):]}", shape, 0, shape[0])]
    # The shared experts' fc1 is fused [gate; up] as a dense MLP's (SharedExpertMLP is an MLP,
    # moe/shared_experts.py, sharded by the same apply_swiglu_sharded_factory).
    fused_mlps = {"mlp.linear_fc1.": f"{hf}.mlp", "mlp.shared_experts.linear_fc1.": f"{hf}.mlp.shared_experts"}
    for fused in ("self_attention.linear_qkv.", *fused_mlps):
        for kind in ("weight", "bias"):
            if rest == fused + kind:
                if fused.startswith("self"):
                    return _qkv_blocks(hf, kind, shape, attention)
                return _fc1_blocks(fused_mlps[fused], kind, shape, attention.gated)
            for half, part in (("_w", "gate"), ("_v", "up")):
                if fused in fused_mlps and rest == fused + kind + half:
                    return [RowBlock(f"{fused_mlps[fused]}.{part}_proj.{kind}", shape, 0, shape[0])]
    for prefix, name in _LAYER_NAMES.items():
        if rest.startswith(prefix):
            return [RowBlock(f"{hf}.{name}{rest[len(prefix):]}", shape, 0, shape[0])]
    return None


def sharded_tensors(state: Any) -> Iterator[Any]:
    """The ShardedTensors of a sharded state dict (nested dicts and lists walked, factories built,
    ShardedObjects such as extra state left out)."""
    if isinstance(state, Mapping):
        for value in state.values():
            yield from sharded_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from sharded_tensors(value)
    elif hasattr(state, "build_fn") and hasattr(state, "build"):
        yield from sharded_tensors(state.build())
    elif hasattr(state, "global_offset") and hasattr(state, "local_shape") and hasattr(state, "prepend_axis_num"):
        yield state


def resolved_key(sharded: Any) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    """(key with the prepended axes' indices written in, global shape, offset) of a ShardedTensor:
    the first prepended axis of `decoder.layers.` is the global layer, the next one of
    `mlp.experts.experts.` the global expert (transformer_block.py, moe/experts.py)."""
    prepend = int(sharded.prepend_axis_num)
    indices = [int(i) for i in sharded.global_offset[:prepend]]
    key = str(sharded.key)
    if indices and key.startswith("decoder.layers.") and not key[len("decoder.layers.") :][:1].isdigit():
        key = f"decoder.layers.{indices.pop(0)}.{key[len('decoder.layers.'):]}"
    marker = "mlp.experts.experts."
    at = key.find(marker)
    if indices and at >= 0 and not key[at + len(marker) :][:1].isdigit():
        key = f"{key[:at + len(marker)]}{indices.pop(0)}.{key[at + len(marker):]}"
    if indices:
        raise invalid_argument(f"{sharded.key}: {prepend} prepended axes, {len(indices)} not understood")
    shape = tuple(int(n) for n in sharded.global_shape[prepend:])
    offset = tuple(int(n) for n in sharded.global_offset[prepend:])
    return key, shape, offset


def sharded_offers(
    sharded_state_dict: Any, attention: AttentionShape, vocab: Optional[int] = None, strict: bool = True
) -> List[Offer]:
    """Offers of every ShardedTensor of a Megatron-core sharded state dict under Hugging Face names.
    `strict` refuses tensors no rule names (a learned position embedding, an unknown module)."""
    offers: List[Offer] = []
    unnamed: List[str] = []
    for sharded in sharded_tensors(sharded_state_dict):
        if getattr(sharded, "flattened_range", None) is not None:
            raise invalid_argument(f"{sharded.key}: a flattened (distributed optimizer) shard is not a box of a parameter")
        key, shape, offset = resolved_key(sharded)
        blocks = megatron_to_hf(key, shape, attention, vocab)
        if blocks is None:
            unnamed.append(key)
            continue
        local = sharded.data
        if tuple(int(n) for n in local.shape) != tuple(int(n) for n in sharded.local_shape):
            raise invalid_argument(f"{key}: data of shape {list(local.shape)} for a local shape {list(sharded.local_shape)}")
        start, count = offset[0], int(local.shape[0])
        for block in blocks:
            lo, hi = max(start, block.first), min(start + count, block.first + block.rows)
            if lo < hi:
                view = local.narrow(0, lo - start, hi - lo)
                offers.append(Offer(block.name, block.shape, (block.hf_first + lo - block.first, *offset[1:]), view))
    if strict and unnamed:
        raise invalid_argument(
            f"{len(unnamed)} Megatron tensors have no Hugging Face name, e.g. {unnamed[:3]} (pass strict=False to leave them out)"
        )
    check_unique(offers, "Megatron publisher")
    return offers


class MegatronModulePublisher:
    """Offers one rank's parameters of a Megatron-core model from its own `sharded_state_dict()`:
    `MegatronModulePublisher(gpt_model, vocab=hf_config.vocab_size).table(process)`. `vocab` drops
    the vocabulary padding (None: offer the padded rows as they are). Data-parallel and other
    replicas all offer; the planner keeps one owner per replica set."""

    def __init__(self, model: Any, vocab: Optional[int] = None, strict: bool = True, metadata: Optional[dict] = None) -> None:
        while hasattr(model, "module") and not hasattr(model, "sharded_state_dict"):
            model = model.module  # DDP / Float16Module wrappers
        attention = AttentionShape.from_config(model.config)
        state = model.sharded_state_dict(metadata=metadata) if metadata is not None else model.sharded_state_dict()
        self.offers = sharded_offers(state, attention, vocab, strict)

    def add_to(
        self, table: Table, process: int, device: Optional[int] = None, digests: Optional[Mapping[str, int]] = None
    ) -> int:
        """Adds this rank's offers to `table` (host tensors stand for `device`); returns how many."""
        return add_offers(table, self.offers, process, device, digests)

    def table(self, process: int, device: Optional[int] = None, digests: Optional[Mapping[str, int]] = None) -> Table:
        """A new Table holding this rank's offers."""
        return new_table(lambda table: self.add_to(table, process, device, digests))
