"""The framework-neutral description of a refit: the checkpoint tensors both sides agree on (the
Hugging Face names and shapes that vLLM's `load_weights` consumes), and each framework parameter
as pieces of those tensors. Plain values, no torch: the layout rules in megatron.py and vllm.py
produce them, `add_params` binds them to real parameters (addresses) in a Table.

This mirrors the Rust generator in workloads/src (model.rs, param.rs), which builds the same pieces
for synthetic tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .._lib import invalid_argument
from ..plan import Table
from ..tensor import TensorLike, device_index, dtype_code, dtype_name

Shape = Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer of the Llama / Qwen3 family (dense or mixture-of-experts), as far
    as weight shapes go. `experts` is 0 for a dense model, whose MLP has intermediate size `ffn`;
    a MoE model's experts have intermediate size `moe_ffn`. `qk_norm`: per-head RMSNorm of q and k
    (Qwen3). `tie_embeddings`: the output layer shares the embedding (no lm_head tensor)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int = 0
    experts: int = 0
    moe_ffn: int = 0
    qk_norm: bool = False
    tie_embeddings: bool = False
    dtype: str = "bfloat16"
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, field) <= 0:
                raise invalid_argument(f"model {self.name}: {field} must be positive")
        if self.heads % self.kv_heads:
            raise invalid_argument(
                f"model {self.name}: {self.heads} query heads do not group over {self.kv_heads} key/value heads"
            )
        if self.experts and self.moe_ffn <= 0:
            raise invalid_argument(f"model {self.name}: {self.experts} experts need moe_ffn")
        if not self.experts and self.ffn <= 0:
            raise invalid_argument(f"model {self.name}: a dense model needs ffn")
        dtype_code(self.dtype)

    @property
    def elem_size(self) -> int:
        return _ELEM_SIZES[self.dtype]

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any, dtype: Optional[str] = None) -> ModelShape:
        """From a Hugging Face config (a transformers PretrainedConfig, or its dict) of a Llama,
        Qwen2/3 or Qwen3-MoE model. Refuses what these layouts do not describe (shared experts,
        dense layers inside a MoE model)."""

        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        experts = int(get("num_experts", 0) or get("num_local_experts", 0) or 0)
        if experts and (get("mlp_only_layers") or int(get("decoder_sparse_step", 1) or 1) != 1):
            raise invalid_argument("MoE models with dense layers (mlp_only_layers, decoder_sparse_step) are not described")
        if get("shared_expert_intermediate_size"):
            raise invalid_argument("MoE models with shared experts are not described")
        model_type = str(get("model_type", ""))
        name = get("_name_or_path") or model_type or "model"
        torch_dtype = dtype or str(get("torch_dtype", get("dtype", "bfloat16")) or "bfloat16")
        return cls(
            layers=int(get("num_hidden_layers")),
            hidden=hidden,
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            vocab=int(get("vocab_size")),
            ffn=0 if experts else int(get("intermediate_size")),
            experts=experts,
            moe_ffn=int(get("moe_intermediate_size") or 0) if experts else 0,
            qk_norm=model_type.startswith("qwen3"),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            dtype=torch_dtype.rsplit(".", 1)[-1],
            name=str(name),
        )

    def checkpoint_tensors(self) -> Dict[str, Shape]:
        """Every checkpoint tensor's name and global shape, in checkpoint order (workloads/src/model.rs
        Catalog)."""
        h = self.hidden
        out: Dict[str, Shape] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = (h,)
            out[f"{p}.self_attn.q_proj.weight"] = (self.q_dim, h)
            out[f"{p}.self_attn.k_proj.weight"] = (self.kv_dim, h)
            out[f"{p}.self_attn.v_proj.weight"] = (self.kv_dim, h)
            out[f"{p}.self_attn.o_proj.weight"] = (h, self.q_dim)
            if self.qk_norm:
                out[f"{p}.self_attn.q_norm.weight"] = (self.head_dim,)
                out[f"{p}.self_attn.k_norm.weight"] = (self.head_dim,)
            out[f"{p}.post_attention_layernorm.weight"] = (h,)
            if self.experts:
                out[f"{p}.mlp.gate.weight"] = (self.experts, h)
                for e in range(self.experts):
                    out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (self.moe_ffn, h)
                    out[f"{p}.mlp.experts.{e}.up_proj.weight"] = (self.moe_ffn, h)
                    out[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, self.moe_ffn)
            else:
                out[f"{p}.mlp.gate_proj.weight"] = (self.ffn, h)
                out[f"{p}.mlp.up_proj.weight"] = (self.ffn, h)
                out[f"{p}.mlp.down_proj.weight"] = (h, self.ffn)
        out["model.norm.weight"] = (h,)
        if not self.tie_embeddings:
            out["lm_head.weight"] = (self.vocab, h)
        return out


_ELEM_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}


@dataclasses.dataclass(frozen=True)
class Piece:
    """The box `offset`/`extent` (element coordinates) of checkpoint tensor `tensor`, stored from
    element `at` of a parameter, row-major over `extent` or with element strides `dst_strides` (one
    per tensor dimension; pieces recorded from an engine's loader carry them). Every piece the
    hand-written rules produce is contiguous (workloads/src/param.rs, Piece)."""

    tensor: str
    offset: Shape
    extent: Shape
    at: int
    dst_strides: Optional[Shape] = None

    @property
    def numel(self) -> int:
        n = 1
        for e in self.extent:
            n *= e
        return n

    @property
    def strides(self) -> Shape:
        """Element strides of the piece inside the parameter, one per tensor dimension: `dst_strides`
        when given (a recorded piece: a transposed or strided parameter), else row-major over the
        extent."""
        if self.dst_strides is not None:
            return tuple(self.dst_strides)
        strides = [1] * len(self.extent)
        for d in range(len(self.extent) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.extent[d + 1]
        return tuple(strides)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One framework parameter: its name in that framework, its shape, and the pieces it holds.
    Elements not covered by a piece are padding (a padded vocabulary) or belong to nobody."""

    name: str
    shape: Shape
    pieces: Tuple[Piece, ...]

    @property
    def numel(self) -> int:
        n = 1
        for e in self.shape:
            n *= e
        return n


class ParamBuilder:
    """Collects the pieces of one parameter whose rows are `row_len` elements long."""

    def __init__(self, name: str, shape: Sequence[int]) -> None:
        self.name = name
        self.shape = tuple(int(n) for n in shape)
        self.row_len = self.shape[-1]
        self.pieces: List[Piece] = []

    def rows(self, tensor: str, first: int, count: int, at_row: int, cols: Tuple[int, int] = (0, -1)) -> ParamBuilder:
        """Rows [first, first + count) (columns `cols` = (first, count); count -1: every column up to
        the parameter's row length) of a 2-D tensor, placed from row `at_row` of the parameter."""
        col0, ncols = cols
        ncols = self.row_len if ncols < 0 else ncols
        if count > 0:
            self.pieces.append(Piece(tensor, (first, col0), (count, ncols), at_row * self.row_len))
        return self

    def vector(self, tensor: str, length: int) -> ParamBuilder:
        self.pieces.append(Piece(tensor, (0,), (length,), 0))
        return self

    def build(self) -> ParamLayout:
        return ParamLayout(self.name, self.shape, tuple(self.pieces))


def concat_rows(
    builder: ParamBuilder, blocks: Iterable[Tuple[str, int, int]], start: int, stop: int, at_row: int = 0
) -> ParamBuilder:
    """Places rows [start, stop) of the row-wise concatenation of `blocks` ((tensor, first row, rows)
    each) from row `at_row` of the parameter: a tensor-parallel rank's slice of a fused
    column-parallel weight, which may cut through blocks."""
    cursor = 0
    for tensor, first, count in blocks:
        lo, hi = max(start, cursor), min(stop, cursor + count)
        if lo < hi:
            builder.rows(tensor, first + lo - cursor, hi - lo, at_row + lo - start)
        cursor += count
    return builder


def vocab_rows(vocab: int, padded: int, parts: int, part: int) -> Tuple[int, int, int]:
    """The rows of a vocabulary-parallel shard when the padded vocabulary splits evenly: (first row,
    real rows (possibly 0), rows the parameter has)."""
    if padded % parts:
        raise invalid_argument(f"padded vocabulary {padded} does not split over {parts} ranks")
    per = padded // parts
    first = min(part * per, vocab)
    return first, min((part + 1) * per, vocab) - first, per


def pad_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def split(total: int, parts: int, what: str) -> int:
    """total / parts, refusing an uneven split (the frameworks do too)."""
    if parts <= 0 or total % parts:
        raise invalid_argument(f"{what} {total} does not split over {parts} ranks")
    return total // parts


def check_rank(rank: int, size: int, what: str) -> None:
    if size <= 0 or not 0 <= rank < size:
        raise invalid_argument(f"{what} rank {rank} is outside a group of {size}")


def strip_wrappers(name: str) -> str:
    """A parameter name without the `module.` prefixes wrappers add (DDP, Float16Module)."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def add_params(
    table: Table,
    model: ModelShape,
    layouts: Sequence[ParamLayout],
    tensors: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
    process: int,
    offer: bool,
    device: Optional[int] = None,
    strict: bool = True,
    digests: Optional[Mapping[str, int]] = None,
) -> int:
    """Adds every piece of `layouts` to `table` as an offer (`offer`) or a need of `process`, at the
    address of the parameter of that name in `tensors` (a mapping, or `named_parameters()`), on its
    device (`device` for host-memory tensors). Returns the number of pieces added.

    Each parameter must be contiguous with the layout's number of elements and the model's element
    size. `strict` also refuses parameters of `tensors` that no layout describes (a bias, a layer
    the rules do not know), so nothing is silently left stale; pass False to ignore them.
    `digests` (checkpoint tensor name -> digest of the whole tensor's bytes) lets the planner check
    that replicas agree: only whole-tensor offers carry one."""
    by_name: Dict[str, TensorLike] = {}
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        by_name[strip_wrappers(name)] = tensor
    described = {layout.name for layout in layouts}
    missing = [layout.name for layout in layouts if layout.name not in by_name]
    if missing:
        raise invalid_argument(f"{len(missing)} parameters the layout describes are missing, e.g. {missing[:3]}")
    if strict:
        extra = sorted(name for name in by_name if name not in described)
        if extra:
            raise invalid_argument(
                f"{len(extra)} parameters are not described by the layout rules, e.g. {extra[:3]} "
                "(pass strict=False to leave them out of the refit)"
            )
    shapes = model.checkpoint_tensors()
    es, code = model.elem_size, dtype_code(model.dtype)
    indices: Dict[str, int] = {}
    added = 0
    for layout in layouts:
        tensor = by_name[layout.name]
        _check_param(layout, tensor, es, model.dtype)
        base, dev = tensor.data_ptr(), device_index(tensor, device)
        for piece in layout.pieces:
            index = indices.get(piece.tensor)
            if index is None:
                index = indices[piece.tensor] = table.add_tensor(piece.tensor, shapes[piece.tensor], es, code)
            addr = base + piece.at * es
            if offer:
                whole = piece.numel == _numel(shapes[piece.tensor])
                digest = digests.get(piece.tensor) if digests and whole else None
                table.add_offer(index, process, dev, addr, piece.offset, piece.extent, piece.strides, digest)
            else:
                table.add_need(index, process, dev, addr, piece.offset, piece.extent, piece.strides)
            added += 1
    return added


def new_table(fill: Callable[[Table], object]) -> Table:
    """A new Table after `fill(table)`; closed again when filling it fails."""
    table = Table()
    try:
        fill(table)
    except BaseException:
        table.close()
        raise
    return table


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for e in shape:
        n *= e
    return n


def _check_param(layout: ParamLayout, tensor: TensorLike, elem_size: int, dtype: str) -> None:
    shape = tuple(int(n) for n in tensor.shape)
    if _numel(shape) != layout.numel:
        raise invalid_argument(
            f"{layout.name} has shape {list(shape)}; the layout rules give {list(layout.shape)}"
        )
    if tensor.element_size() != elem_size or dtype_name(tensor) != dtype:
        raise invalid_argument(f"{layout.name} is {dtype_name(tensor)}; the model is {dtype}")
    expected = 1
    for size, stride in reversed(list(zip(shape, tensor.stride()))):
        if size != 1 and stride != expected:
            raise invalid_argument(f"{layout.name} is not contiguous (strides {list(tensor.stride())})")
        expected *= size

