"""Receiver layouts recorded from an engine's own weight loader.

Any loader (a callable taking an iterable of (checkpoint name, tensor) pairs: a vLLM or SGLang
model's `load_weights`, a Hugging Face module's state-dict load, a user's function) decides where
every checkpoint element lands in the engine's parameters. `record` runs that loader once over
stand-ins of the checkpoint tensors that hold no memory (meta tensors) against parameters that hold
none either (a model built on the meta device), under a torch dispatch mode that sees every aten op:

- a view (narrow, slice, select, chunk, split, view, reshape, transpose, permute, expand, ...) needs
  no bookkeeping: the meta tensor it returns carries its storage offset and strides, and its
  storage says which checkpoint tensor or parameter it views;
- a pure copy into a new tensor (clone, contiguous, a same-dtype `to`) is remembered as a dense
  copy of the view it read, so later views of it map back onto the checkpoint tensor when they can
  (one across its dimensions, as reshape leaves a tensor it had to copy, split at them); so is a
  concatenation (cat, stack) of such views, part by part (a view across parts cut at them);
- `copy_` of a checkpoint view into a parameter view is the relation recorded: which box of which
  checkpoint tensor lands where (element offset and strides) in which parameter;
- anything else that reads a checkpoint tensor (arithmetic, dtype conversion, concatenation with
  anything else, quantization, an in-place change, a loader that needs the values) is never guessed:
  that checkpoint tensor is marked staged, with the reason: a receiver takes it whole into staging
  and runs the engine's own loader on it;
- a loader that needs a tensor's values raises on its meta stand-in (item(), tolist()): that tensor
  is staged, and the loader is given it once more, alone and holding zeros, so that the parameters
  it writes then (a fill with the value read, a copy) are known as the staged tensor's (SGLang's
  default_weight_loader fills a one-element parameter with `loaded_weight.item()`).

Nothing here knows a model family. The result (`Recording`) lists every parameter's pieces as
`layout.ParamLayout`s (a piece may carry destination strides of its own, e.g. a transposed
parameter) and the staged tensors; `record` caches it per (parameters' names, shapes, strides,
dtypes; checkpoint; the loader's class; caller's key, e.g. the ranks and the engine's configuration).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .layout import ParamLayout, Piece

Shape = Tuple[int, ...]
Loader = Callable[[Iterable[Tuple[str, Any]]], Any]

log = logging.getLogger("refit.integrations.recorder")

# A copy that is not one box is cut into boxes along its outer dimensions; past this many boxes
# for one copy the tensor is staged instead (a gather the planner would move element by element).
MAX_BOXES_PER_COPY = 4096
# A checkpoint tensor the loader raised on (it read its values) is given to the loader once more,
# alone and holding zeros, to learn which parameters it writes; not past this many elements.
MAX_PROBE_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor as the loader will be given it: name, global shape, torch dtype."""

    name: str
    shape: Shape
    dtype: Any


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter (or persistent buffer) as it was when recorded."""

    shape: Shape
    strides: Shape
    dtype: Any


@dataclasses.dataclass
class Recording:
    """What the loader did. `layouts`: every parameter that receives checkpoint elements as boxes,
    in `named_parameters()` order. `staged`: checkpoint tensor -> why it cannot be described as
    boxes (it is delivered whole into staging and the engine's loader runs on it). `params`: every
    parameter of the model. `unwritten`: parameters no checkpoint element reaches (neither as a box
    nor through a staged tensor). `padding`: parameter -> elements no box covers, for parameters
    that have boxes (a padded vocabulary)."""

    layouts: List[ParamLayout]
    staged: Dict[str, str]
    params: Dict[str, ParamInfo]
    checkpoint: Dict[str, TensorSpec]
    unwritten: List[str]
    padding: Dict[str, int]
    staged_params: Dict[str, List[str]]

    def summary(self) -> str:
        """The one log line: how many boxes, and which tensors took the staging path and why."""
        pieces = sum(len(layout.pieces) for layout in self.layouts)
        text = f"recorded {pieces} boxes into {len(self.layouts)} parameters from {len(self.checkpoint)} checkpoint tensors"
        if self.staged:
            reasons: Dict[str, List[str]] = {}
            for name, reason in self.staged.items():
                reasons.setdefault(reason, []).append(name)
            parts = [f"{len(names)} ({reason}, e.g. {names[0]})" for reason, names in reasons.items()]
            text += "; staged for the engine's loader: " + "; ".join(parts)
        return text


@dataclasses.dataclass(frozen=True)
class _View:
    """An affine view of a root tensor's storage (elements)."""

    root: int
    offset: int
    strides: Shape
    shape: Shape


@dataclasses.dataclass(frozen=True)
class _Dense:
    """A new tensor holding a pure copy of `source`: its element at index i is source's at i."""

    layout: _View
    source: _View


@dataclasses.dataclass(frozen=True)
class _Concat:
    """A new tensor (`layout`) concatenated along `dim`: part i, rows starts[i] .. starts[i+1] of
    that dimension, a dense copy of its own source (`parts[i]`, its layout that slab of `layout`)."""

    layout: _View
    dim: int
    starts: Shape
    parts: Tuple[_Dense, ...]


@dataclasses.dataclass(frozen=True)
class _Root:
    kind: str  # "checkpoint" or "param"
    name: str
    base: int  # the root tensor's own storage offset
    shape: Shape = ()


def _storage_key(tensor: Any) -> int:
    return int(tensor.untyped_storage()._cdata)


def _view_of(tensor: Any, root: int) -> _View:
    return _View(root, int(tensor.storage_offset()), tuple(int(s) for s in tensor.stride()), tuple(int(n) for n in tensor.shape))


def _row_major(shape: Sequence[int]) -> Shape:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return tuple(strides)


def _compose(dense: _Dense, view: _View) -> Optional[_View]:
    """`view` (of the dense copy's storage) as a view of the copy's source, or None when it does
    not map affinely (it runs across the copy's dimensions)."""
    layout = dense.layout
    dims = sorted((s, n, k) for k, (s, n) in enumerate(zip(layout.strides, layout.shape)) if n > 1)
    dims.reverse()  # outermost first
    rest = view.offset - layout.offset
    if rest < 0:
        return None
    start = [0] * len(layout.shape)
    for stride, size, k in dims:
        start[k], rest = divmod(rest, stride)
        if start[k] >= size:
            return None
    if rest:
        return None
    reach = list(start)
    strides: List[int] = []
    for stride, size in zip(view.strides, view.shape):
        if size == 1:
            strides.append(0)
            continue
        match = [(k, stride // s) for s, n, k in dims if stride >= s and stride % s == 0]
        if not match:
            return None
        k, multiple = match[0]  # the outermost dimension whose stride divides this one
        reach[k] += multiple * (size - 1)
        strides.append(multiple * dense.source.strides[k])
    if any(r >= n for r, n in zip(reach, layout.shape)):
        return None
    offset = dense.source.offset + sum(i * s for i, s in zip(start, dense.source.strides))
    return _View(dense.source.root, offset, tuple(strides), view.shape)


def _compose_split(dense: _Dense, view: _View) -> Optional[Tuple[_View, List[Shape]]]:
    """`view` (of the dense copy's storage) whose dimensions run across the copy's, as reshape
    leaves a tensor it could not view (a copy, then aten._unsafe_view merging its dimensions): each
    dimension split into factors that each step within one of the copy's dimensions, then composed
    as `_compose` does. Returns the refined view of the copy's source and each dimension's factor
    sizes (outermost first), or None when a dimension does not split so."""
    layout = dense.layout
    dims = sorted(((s, n) for s, n in zip(layout.strides, layout.shape) if n > 1), reverse=True)
    factors: List[Shape] = []
    sizes: List[int] = []
    strides: List[int] = []
    for stride, size in zip(view.strides, view.shape):
        parts: List[Tuple[int, int]] = []  # (size, stride), innermost first
        while size > 1:
            match = [(s, n) for s, n in dims if stride >= s and stride % s == 0]
            if not match:
                return None
            step, extent = match[0]
            if stride == step and size > extent and size % extent == 0:
                parts.append((extent, stride))  # a whole dimension of the copy, then the ones outside it
                size, stride = size // extent, stride * extent
                continue
            break
        parts.append((size, stride))
        parts.reverse()
        factors.append(tuple(n for n, _ in parts))
        sizes.extend(n for n, _ in parts)
        strides.extend(s for _, s in parts)
    if len(sizes) == len(view.shape):
        return None  # nothing split: _compose has said no already
    composed = _compose(dense, _View(view.root, view.offset, tuple(strides), tuple(sizes)))
    return None if composed is None else (composed, factors)


def _split(view: _View, factors: Sequence[Shape]) -> _View:
    """`view` with each dimension split into `factors` (sizes, outermost first)."""
    sizes: List[int] = []
    strides: List[int] = []
    for stride, parts in zip(view.strides, factors):
        inner: List[int] = []
        for n in reversed(parts):
            inner.append(stride)
            stride *= n
        sizes.extend(parts)
        strides.extend(reversed(inner))
    return _View(view.root, view.offset, tuple(strides), tuple(sizes))


def _compose_any(dense: _Dense, view: _View) -> Optional[Tuple[_View, Optional[List[Shape]]]]:
    """`view` as a view of the copy's source: as it is, or split (then with its factors)."""
    composed = _compose(dense, view)
    return (composed, None) if composed is not None else _compose_split(dense, view)


def _narrow(view: _View, dim: int, start: int, size: int) -> _View:
    shape = view.shape[:dim] + (size,) + view.shape[dim + 1 :]
    return _View(view.root, view.offset + start * view.strides[dim], view.strides, shape)


def _cut(concat: _Concat, view: _View) -> Optional[List[Tuple[int, int, int]]]:
    """`view` (of the concatenation's storage) cut at the parts it runs across: (its dimension that
    steps along the concatenated one, start, size) per piece, or None when it does not run across
    them as one of its dimensions."""
    layout = concat.layout
    rest = view.offset - layout.offset
    start = [0] * len(layout.shape)
    for k in sorted(range(len(layout.shape)), key=lambda k: layout.strides[k], reverse=True):
        start[k], rest = divmod(rest, layout.strides[k])
    along = [k for k, (s, n) in enumerate(zip(view.strides, view.shape)) if n > 1 and s == layout.strides[concat.dim]]
    if rest or min(start) < 0 or len(along) != 1:
        return None
    k, first = along[0], start[concat.dim]
    last = first + view.shape[k]
    if last > layout.shape[concat.dim]:
        return None
    bounds = list(concat.starts) + [layout.shape[concat.dim]]
    return [
        (k, max(a, first) - first, min(b, last) - max(a, first))
        for a, b in zip(bounds, bounds[1:]) if min(b, last) > max(a, first)
    ]


def _boxes(src: _View, dst: _View, tensor_shape: Shape) -> Optional[List[Tuple[Shape, Shape, Shape, int]]]:
    """The copy of `src` (a view of a row-major checkpoint tensor of `tensor_shape`) into `dst`
    (same shape after broadcasting) as boxes: (offset, extent, destination strides, destination
    element offset) each, or None when it would take more than MAX_BOXES_PER_COPY."""
    ndim = len(dst.shape)
    pad = ndim - len(src.shape)
    if pad < 0:
        return None
    src_strides = (0,) * pad + tuple(0 if n == 1 and m != 1 else s for s, n, m in zip(src.strides, src.shape, dst.shape[pad:]))
    levels = [(n, s, d) for n, s, d in zip(dst.shape, src_strides, dst.strides) if n != 1]
    if any(n == 0 for n in dst.shape):
        return []
    tstrides = _row_major(tensor_shape)
    out: List[Tuple[Shape, Shape, Shape, int]] = []

    def place(levels: List[Tuple[int, int, int]], src_off: int, dst_off: int) -> bool:
        origin = []
        rest = src_off
        for stride, size in zip(tstrides, tensor_shape):
            i, rest = divmod(rest, stride)
            origin.append(i)
        if rest or any(i >= n for i, n in zip(origin, tensor_shape)):
            return False
        extent = [1] * len(tensor_shape)
        strides = [1] * len(tensor_shape)
        for at, (n, s, d) in enumerate(levels):
            k = next((k for k, (ts, tn) in enumerate(zip(tstrides, tensor_shape)) if ts == s and tn > 1 and extent[k] == 1), None)
            if k is None:
                return explode(levels, at, src_off, dst_off)
            if origin[k] + n > tensor_shape[k]:
                # A flattened run across this dimension into the ones outside it: two levels.
                size = tensor_shape[k]
                if origin[k] or n % size or k == 0:
                    return explode(levels, at, src_off, dst_off)
                split = [(n // size, tstrides[k - 1], d * size), (size, s, d)]
                return place(levels[:at] + split + levels[at + 1 :], src_off, dst_off)
            extent[k], strides[k] = n, d
        if len(out) >= MAX_BOXES_PER_COPY:
            return False
        out.append((tuple(origin), tuple(extent), tuple(strides), dst_off))
        return True

    def explode(levels: List[Tuple[int, int, int]], at: int, src_off: int, dst_off: int) -> bool:
        """Cuts the copy into one copy per index of level `at` (a stride that is no box's)."""
        n, s, d = levels[at]
        if len(out) + n > MAX_BOXES_PER_COPY:
            return False
        rest = levels[:at] + levels[at + 1 :]
        return all(place(rest, src_off + i * s, dst_off + i * d) for i in range(n))

    if not place(levels, src.offset, dst.offset):
        return None
    return out


class _Mode:
    """The dispatch mode's state (kept apart from the torch class so this module imports without
    torch)."""

    def __init__(self) -> None:
        self.roots: Dict[int, _Root] = {}
        self.dense: Dict[int, _Dense] = {}
        self.concats: Dict[int, _Concat] = {}
        self.tainted: Dict[int, Tuple[frozenset, str]] = {}  # storage -> (checkpoint names, why)
        self.copies: List[Tuple[str, _View, str, _View]] = []  # (tensor, src view, param, dst view)
        self.staged: Dict[str, str] = {}
        self.staged_params: Dict[str, set] = {}
        self.params_written_by_staged: set = set()
        # Parameter storage -> checkpoint tensors the loader has put there (boxes or staged): a
        # loader that reads a parameter back after writing it (Mamba2's A = -exp(A_log), computed
        # on the parameter) computes from those tensors.
        self.param_sources: Dict[int, set] = {}
        self.param_keys: Dict[str, int] = {}  # parameter name -> its storage
        # The checkpoint tensor given to the loader alone, with values (see `_probe`): every
        # parameter written meanwhile is that staged tensor's.
        self.probing: Optional[str] = None
        self._tracked: set = set()
        # Every tensor whose storage is a key here stays alive while recording: a freed storage's
        # address can come back as a new tensor's (vLLM's online quantization allocates and frees
        # inside load_weights), which would then be taken for the checkpoint copy it no longer is.
        self._alive: List[Any] = []

    # What a tensor is: a view of a root, of a dense copy (resolved to its source when it maps),
    # or something computed from checkpoint tensors.
    def resolve(self, tensor: Any) -> Tuple[Optional[_View], Optional[Tuple[frozenset, str]]]:
        key = _storage_key(tensor)
        if key in self.roots:
            return _view_of(tensor, key), None
        if key in self.dense:
            dense = self.dense[key]
            view = _compose(dense, _view_of(tensor, key))
            if view is None:
                return None, (frozenset([self.roots[dense.source.root].name]), "a view across a copied tensor's dimensions")
            return view, None
        if key in self.concats:
            parts = self.concats[key].parts
            view = next((v for v in (_compose(part, _view_of(tensor, key)) for part in parts) if v is not None), None)
            if view is None:
                return None, (frozenset(self.roots[part.source.root].name for part in parts), "concatenation into a new tensor")
            return view, None
        if key in self.tainted:
            return None, self.tainted[key]
        return None, None

    def view_or_split(self, tensor: Any) -> Optional[Tuple[_View, Optional[List[Shape]]]]:
        """`tensor` as a view of a root: as `resolve` maps it (factors None), or across a dense
        copy's dimensions, split at them (`_compose_split`, with its factors); None otherwise."""
        view, _ = self.resolve(tensor)
        if view is not None:
            return view, None
        dense = self.dense.get(_storage_key(tensor))
        return None if dense is None else _compose_split(dense, _view_of(tensor, _storage_key(tensor)))

    def mapped(self, tensor: Any, target: _View) -> Optional[List[Tuple[_View, _View]]]:
        """A copy of `tensor` into `target` (same shape) that `resolve` cannot map as one view, as
        copies of checkpoint views, each with the part of `target` it lands in: a view across a
        dense copy's dimensions split at them (`_compose_split`), one of a concatenation cut at its
        parts (`_cut`), each part's piece split so in turn; or None."""
        key = _storage_key(tensor)
        view = _view_of(tensor, key)
        if key in self.dense:
            found = self.view_or_split(tensor)
            return None if found is None else [(found[0], target if found[1] is None else _split(target, found[1]))]
        concat = self.concats.get(key)
        pieces = _cut(concat, view) if concat is not None else None
        if pieces is None:
            return None
        out = []
        for dim, start, size in pieces:
            piece = _narrow(view, dim, start, size)
            found = next((c for c in (_compose_any(part, piece) for part in concat.parts) if c is not None), None)
            if found is None:
                return None
            source, factors = found
            into = _narrow(target, dim, start, size)
            out.append((source, into if factors is None else _split(into, factors)))
        return out

    @property
    def tracked(self) -> set:
        """Storages that hold checkpoint elements: stand-ins, copies of them, things computed from them."""
        return self._tracked

    def track_checkpoint(self, tensor: Any, name: str, shape: Shape) -> None:
        key = _storage_key(tensor)
        self.roots[key] = _Root("checkpoint", name, 0, shape)
        self._tracked.add(key)

    def keep_alive(self, tensor: Any) -> None:
        self._alive.append(tensor)

    def remember_copy(self, tensor: Any, source: _View) -> None:
        key = _storage_key(tensor)
        if key not in self.roots:
            self.dense[key] = _Dense(_view_of(tensor, key), source)
            self.tainted.pop(key, None)
            self.concats.pop(key, None)
            self._tracked.add(key)
            self.keep_alive(tensor)

    def remember_concat(self, tensor: Any, inputs: Sequence[Any], dim: int, stacked: bool) -> bool:
        """`tensor`, the concatenation (or stack) of `inputs` along `dim`, remembered part by part
        when every input is a view of a checkpoint tensor (or of a copy of one, split to map, as
        `mapped` does); False (nothing remembered) otherwise."""
        key = _storage_key(tensor)
        layout = _view_of(tensor, key)
        parts: List[_Dense] = []
        starts: List[int] = []
        at = 0
        for value in inputs:
            if value.numel() == 0:
                continue  # cat skips empty inputs
            found = self.view_or_split(value)
            if found is None or self.roots[found[0].root].kind != "checkpoint" or value.dtype != tensor.dtype:
                return False
            source, factors = found
            size = 1 if stacked else int(value.shape[dim])
            part = _narrow(layout, dim, at, size)
            if stacked:  # the new dimension, of size 1, is the source's too
                at_dim = dim if factors is None else sum(len(f) for f in factors[:dim])
                strides, shape = source.strides, source.shape
                source = _View(source.root, source.offset, strides[:at_dim] + (0,) + strides[at_dim:], shape[:at_dim] + (1,) + shape[at_dim:])
                factors = None if factors is None else factors[:dim] + [(1,)] + factors[dim:]
            parts.append(_Dense(part if factors is None else _split(part, factors), source))
            starts.append(at)
            at += size
        if not parts:
            return False
        self.concats[key] = _Concat(layout, dim, tuple(starts), tuple(parts))
        self.tainted.pop(key, None)
        self.dense.pop(key, None)
        self._tracked.add(key)
        self.keep_alive(tensor)
        return True

    def taint(self, tensor: Any, names: Iterable[str], why: str) -> None:
        key = _storage_key(tensor)
        if key not in self.roots:
            self.tainted[key] = (frozenset(names), why)
            self.dense.pop(key, None)
            self.concats.pop(key, None)
            self._tracked.add(key)
            self.keep_alive(tensor)

    def wrote_param(self, key: int, names: Iterable[str]) -> None:
        """The loader put (something computed from) `names` into the parameter of storage `key`."""
        self.param_sources.setdefault(key, set()).update(names)
        self._tracked.add(key)

    def sources(self, values: Iterable[Any]) -> Tuple[set, List[str]]:
        names: set = set()
        reasons: List[str] = []
        for value in values:
            view, taint = self.resolve(value)
            if view is not None and self.roots[view.root].kind == "checkpoint":
                names.add(self.roots[view.root].name)
            elif view is not None and self.param_sources.get(view.root):
                names |= self.param_sources[view.root]
                reasons.append(f"read back from {self.roots[view.root].name} after the loader wrote it")
            elif taint is not None:
                names |= taint[0]
                reasons.append(taint[1])
        return names, reasons

    def probed_write(self, target: Any) -> bool:
        """While probing, a write into a parameter (any part of it) is the probed tensor's: True
        when `target` is a view of a parameter and it was so attributed."""
        if self.probing is None:
            return False
        view, _ = self.resolve(target)
        root = self.roots.get(view.root) if view is not None else None
        if root is None or root.kind != "param":
            return False
        self.stage([self.probing], "the loader reads its values", root.name)
        self.params_written_by_staged.add(root.name)
        return True

    def stage(self, names: Iterable[str], reason: str, param: Optional[str] = None) -> None:
        names = list(names)
        for name in names:
            self.staged.setdefault(name, reason)
            if param is not None:
                self.staged_params.setdefault(name, set()).add(param)
        if param is not None:
            self.wrote_param(self.param_keys[param], names)


def _make_mode_class() -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    Tensor = torch.Tensor
    pure_copies = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default, aten.lift_fresh.default}
    fills = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
    kinds: Dict[Any, Any] = {}

    def kind_of(func: Any) -> Any:
        """copy, fill, view (returns an alias of an input: nothing to record), ("write", argument
        positions it changes in place) or other; once per op."""
        kind = kinds.get(func)
        if kind is None:
            schema = func._schema
            writes = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
            if func is aten.copy_.default:
                kind = "copy"
            elif func in fills:
                kind = "fill"
            elif writes:
                kind = ("write", writes)
            elif any(r.alias_info is not None for r in schema.returns):
                kind = "view"
            else:
                kind = "other"
            kinds[func] = kind
        return kind

    def tensors(values: Iterable[Any]) -> List[Any]:
        out = []
        for value in values:
            if isinstance(value, Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out.extend(v for v in value if isinstance(v, Tensor))
        return out

    class RecordingMode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # no dynamo wrapper around every op: the recording runs eagerly

        def __init__(self, state: _Mode) -> None:
            super().__init__()
            self.state = state

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            kind = kind_of(func)
            if kind == "view":
                return out
            if kind == "fill":
                self.fill(args[0], func.overloadpacket.__name__)
                return out
            if kind == "copy":
                self.copy(args[0], args[1])
                return out
            state = self.state
            if kind != "other" and state.probing is not None:
                for target in (args[i] for i in kind[1] if i < len(args) and isinstance(args[i], Tensor)):
                    state.probed_write(target)
            inputs = tensors(args)
            if kwargs:
                inputs += tensors(kwargs.values())
            tracked = state.tracked
            if not any(_storage_key(t) in tracked for t in inputs):
                return out
            names, reasons = state.sources(inputs)
            name = func.overloadpacket.__name__
            if kind != "other":
                for target in (args[i] for i in kind[1] if i < len(args) and isinstance(args[i], Tensor)):
                    view, _ = state.resolve(target)
                    root = state.roots.get(view.root) if view is not None else None
                    if root is not None and root.kind == "param":
                        state.stage(names, f"{name} into a parameter", root.name)
                        state.params_written_by_staged.add(root.name)
                    elif root is not None and root.kind == "checkpoint":
                        state.stage([root.name], f"changed in place by {name}")
                    else:
                        state.taint(target, names, reasons[0] if reasons else f"computed by {name}")
                return out
            outputs = tensors(out if isinstance(out, (list, tuple)) else [out])
            if outputs and all(_storage_key(o) in {_storage_key(i) for i in inputs} for o in outputs):
                # A view its schema does not declare (aten._unsafe_view, which reshape returns after
                # copying a tensor that cannot be viewed): its meta tensor carries offset and strides
                # into the input's storage, as a declared view's does.
                return out
            if func in (aten.cat.default, aten.stack.default):
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                if state.remember_concat(outputs[0], args[0], dim % outputs[0].dim(), func is aten.stack.default):
                    return out
            single = len(inputs) == 1 and len(outputs) == 1
            same_type = single and outputs[0].dtype == inputs[0].dtype
            if single and not reasons and (func in pure_copies or (func is aten._to_copy.default and same_type)):
                source, _ = state.resolve(inputs[0])
                if source is not None:
                    state.remember_copy(outputs[0], source)
                    return out
            if reasons and reasons[0].startswith("read back from"):
                why = reasons[0]
            elif func is aten._to_copy.default and single and not same_type:
                why = "dtype conversion"
            elif reasons:
                why = reasons[0]
            elif func.overloadpacket in (aten.cat, aten.stack):
                why = "concatenation into a new tensor"
            else:
                why = f"computed by {name}"
            for tensor in outputs:
                state.taint(tensor, names, why)
            return out

        def fill(self, target: Any, name: str) -> None:
            """A constant written over (part of) a tensor. A parameter needs nothing recorded (its
            padding, say), but a checkpoint tensor, or a copy of one, now holds values no box of the
            checkpoint carries (GPT-OSS's loader zeroes its row-parallel expert bias on every TP rank
            but the first, then copies it into the parameter): it is staged for the loader."""
            state = self.state
            if state.probed_write(target) or _storage_key(target) not in state.tracked:
                return
            view, _ = state.resolve(target)
            root = state.roots.get(view.root) if view is not None else None
            if root is not None and _storage_key(target) in state.roots:
                if root.kind == "checkpoint":
                    state.stage([root.name], f"changed in place by {name}")
                return
            names, _ = state.sources([target])
            if view is not None:
                names.add(state.roots[view.root].name)
            state.taint(target, names, f"changed in place by {name}")

        def copy(self, dst: Any, src: Any) -> None:
            state = self.state
            if _storage_key(src) not in state.tracked:
                state.probed_write(dst)  # a tensor made from values read (while probing)
                return  # nothing from the checkpoint (a parameter filled from a constant tensor)
            target, _ = state.resolve(dst)
            root = state.roots.get(target.root) if target is not None else None
            source, taint = state.resolve(src)
            pairs = [(source, target)] if source is not None else None
            if source is None and root is not None and root.kind == "param" and tuple(src.shape) == tuple(dst.shape):
                pairs = state.mapped(src, target)
            if root is None or root.kind != "param":
                if root is not None and root.kind == "checkpoint":
                    state.stage([root.name], "written by the loader")
                    return
                # A copy into a new tensor: it now holds (part of) a checkpoint tensor.
                if source is not None and tuple(src.shape) == tuple(dst.shape) and src.dtype == dst.dtype:
                    state.remember_copy(dst, source)
                else:
                    names, _ = state.sources([src])
                    state.taint(dst, names, taint[1] if taint else "copied into a new tensor")
                return
            if pairs is None:
                if taint is not None:
                    state.stage(taint[0], taint[1], root.name)
                    state.params_written_by_staged.add(root.name)
                return
            for source, _ in pairs:
                source_root = state.roots[source.root]
                if source_root.kind == "param":  # one parameter's elements copied into another
                    state.stage(state.param_sources.get(source.root, ()), f"read back from {source_root.name} after the loader wrote it", root.name)
                    state.params_written_by_staged.add(root.name)
                    return
            names = [state.roots[source.root].name for source, _ in pairs]
            if src.dtype != dst.dtype:
                state.stage(names, "dtype conversion", root.name)
                state.params_written_by_staged.add(root.name)
                return
            for name, (source, into) in zip(names, pairs):
                state.copies.append((name, source, root.name, into))
            state.wrote_param(target.root, names)

    return RecordingMode


_CACHE: Dict[Any, Recording] = {}


def record(
    loader: Loader,
    named_parameters: Mapping[str, Any] | Iterable[Tuple[str, Any]],
    checkpoint: Sequence[TensorSpec] | Mapping[str, Tuple[Shape, Any]],
    key: Any = None,
    cache: bool = True,
) -> Recording:
    """Runs `loader` over meta stand-ins of `checkpoint` (TensorSpecs, or name -> (shape, dtype)) and
    records where every element lands in `named_parameters` (the model's parameters and persistent
    buffers, on the meta device, as the loader sees them). `key` joins the cache key: whatever else
    the loader's placement depends on (the ranks, since two ranks with the same parameter shapes may
    place different boxes; the engine's configuration, since two models alike in shapes may place
    experts differently). The loader's own class (a bound method's owner) is part of the key too."""
    import torch

    specs = _specs(checkpoint)
    params = list(named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters)
    infos = {
        name: ParamInfo(tuple(int(n) for n in t.shape), tuple(int(s) for s in t.stride()), t.dtype) for name, t in params
    }
    owner = type(getattr(loader, "__self__", loader))
    cache_key = (
        tuple(sorted(infos.items(), key=lambda item: item[0])), tuple(specs.items()), f"{owner.__module__}.{owner.__qualname__}", key,
    )
    if cache and cache_key in _CACHE:
        return _CACHE[cache_key]
    not_meta = [name for name, t in params if t.device.type != "meta"]
    if not_meta:
        raise ValueError(f"record needs a model built on the meta device; {len(not_meta)} parameters are not, e.g. {not_meta[:3]}")
    RecordingMode = _make_mode_class()
    state = _Mode()
    keep: List[Any] = []  # the stand-ins stay alive, so no storage key is reused while recording
    for name, tensor in params:
        state.roots[_storage_key(tensor)] = _Root("param", name, int(tensor.storage_offset()), tuple(tensor.shape))
        state.param_keys[name] = _storage_key(tensor)
        state.keep_alive(tensor.detach())  # its storage, even where the loader rebinds the parameter's data
    order = list(specs.values())
    for spec in order:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        keep.append(tensor)
        state.track_checkpoint(tensor, spec.name, spec.shape)
    position = 0

    def stand_ins() -> Iterable[Tuple[str, Any]]:
        nonlocal position
        while position < len(order):
            position += 1
            yield order[position - 1].name, keep[position - 1]

    # Functions the loader runs under torch.compile (vLLM's per_block_cast_to_fp8, in its online
    # FP8 processing) run eagerly here: compiled, dynamo traced this mode's own bookkeeping, guarded
    # on its sets of storages and recompiled at every call until its limit, warning with each set.
    with torch.compiler.set_stance("force_eager"), RecordingMode(state):
        while position < len(order):
            try:
                loader(stand_ins())
            except Exception as error:  # e.g. the loader reads values a stand-in does not hold
                failed = order[position - 1]
                state.stage([failed.name], f"the loader raised {type(error).__name__}: {str(error)[:80]}")
                _probe(loader, state, failed)
    recording = _finish(state, infos, specs, [name for name, _ in params])
    log.info("%s", recording.summary())
    if cache:
        _CACHE[cache_key] = recording
    return recording


def _probe(loader: Loader, state: _Mode, spec: TensorSpec) -> None:
    """Gives the loader `spec`'s tensor once more, alone and holding zeros (it raised on the meta
    stand-in: it reads the values), so that the parameters it writes are known as that staged
    tensor's (`_Mode.probed_write`; a copy of the tensor itself is recorded as usual, then dropped
    with the staged tensor). Whatever the loader raises now is left: those parameters stay unknown."""
    import torch

    if math.prod(spec.shape) > MAX_PROBE_ELEMENTS:
        return
    values = torch.zeros(spec.shape, dtype=spec.dtype)
    state.track_checkpoint(values, spec.name, spec.shape)
    state.keep_alive(values)
    state.probing = spec.name
    try:
        loader(iter([(spec.name, values)]))
    except Exception:  # noqa: BLE001 - the loader may need more than zeros; nothing more is learnt
        pass
    finally:
        state.probing = None


def _specs(checkpoint: Sequence[TensorSpec] | Mapping[str, Tuple[Shape, Any]]) -> Dict[str, TensorSpec]:
    if isinstance(checkpoint, Mapping):
        return {name: TensorSpec(name, tuple(int(n) for n in shape), dtype) for name, (shape, dtype) in checkpoint.items()}
    return {spec.name: TensorSpec(spec.name, tuple(int(n) for n in spec.shape), spec.dtype) for spec in checkpoint}


def _finish(state: _Mode, infos: Dict[str, ParamInfo], specs: Dict[str, TensorSpec], order: List[str]) -> Recording:
    pieces: Dict[str, List[Piece]] = {}
    for tensor, source, param, target in state.copies:
        if tensor in state.staged:
            state.staged_params.setdefault(tensor, set()).add(param)
            continue
        boxes = _boxes(source, target, specs[tensor].shape)
        if boxes is None:
            state.stage([tensor], "not a set of boxes (a gather)", param)
            continue
        base = state.roots[target.root].base
        for offset, extent, strides, at in boxes:
            pieces.setdefault(param, []).append(Piece(tensor, offset, extent, at - base, strides))
    # Boxes of a tensor staged later (by another copy) go: the engine's loader writes all of it.
    for param in list(pieces):
        pieces[param] = [piece for piece in pieces[param] if piece.tensor not in state.staged]
    layouts = [ParamLayout(name, infos[name].shape, tuple(pieces[name])) for name in order if pieces.get(name)]
    staged_params = {name: sorted(params) for name, params in state.staged_params.items() if name in state.staged}
    reached = set(pieces) | {p for params in staged_params.values() for p in params} | state.params_written_by_staged
    unwritten = [name for name in order if name not in reached]
    padding = {}
    for layout in layouts:
        covered = sum(piece.numel for piece in layout.pieces)
        if covered < math.prod(layout.shape):
            padding[layout.name] = math.prod(layout.shape) - covered
    return Recording(layouts, dict(state.staged), infos, specs, unwritten, padding, staged_params)
