"""A receiver's needs from a recording of the engine's own loader (recorder.py), for any engine.

`RecordedReceiver(recording).add_to(table, named_parameters, process, device, staging)` adds one need
per recorded box at the live parameter's address, and, for every checkpoint tensor the recording
staged, one need of the whole tensor into a staging buffer (`staging_buffers` allocates them);
after the refit ran, `load_staged(loader, staging)` hands those buffers to the engine's own loader.

Parameters the engine transforms after loading (`reloaded`: parameter -> why) get no boxes: every
checkpoint tensor that lands in one of them is staged too (`reload`), and the engine's own reload
path turns those into the live parameters (`reloaded_tensors(staging)` hands them over). Such a
tensor's staging buffer has its whole shape, but where the recording shows the loader reading only
boxes of it, all into reloaded parameters (a tensor-parallel share), only those boxes are delivered
into it (`reload_boxes`): the loader reads nothing else of it. Others are delivered whole.
Parameters the engine serves quantized (`quantized`: parameter -> QuantizedParam) receive their
recorded boxes as quantized needs: refit quantizes each box during the refit into the live codes at
its rows, and its scales into the scale parameter the QuantizedParam names (a row-major grid of one
scale per block, or per row). Every box must start on a block boundary of the parameter and fill its
blocks alone (`unfit_boxes` says why not): a block of two checkpoint tensors is no one need's box,
and a per-row scale is that of the whole row.
`paths` says, per parameter, which path it takes: "boxes", "loader", "reload" or "quantized".
The other live parameters must be the ones recorded (names, shapes, strides, dtypes): a model that
changed since is refused, never written blindly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Tuple

from .._lib import Fp8, Granularity, invalid_argument
from ..plan import Table
from ..quant import SOURCE_SIZES, SOURCE_TYPES, Quantization
from ..tensor import TensorLike, device_index, dtype_code, dtype_name
from .layout import ParamLayout, new_table, strip_wrappers
from .recorder import Recording

log = logging.getLogger("refit.integrations.receiver")


def _dtype(value: Any) -> str:
    return str(value).rsplit(".", 1)[-1]


# What a quantized need writes: the codes' dtype.
_TARGETS = {Fp8.E4M3FN: "float8_e4m3fn", Fp8.E5M2: "float8_e5m2"}


@dataclasses.dataclass(frozen=True)
class QuantizedParam:
    """A parameter served as FP8 codes of its recorded (high-precision) layout, quantized by refit:
    `scales` names the parameter holding its float32 scales, a row-major grid of one scale per
    block (Granularity.BLOCK) or per row (Granularity.ROW: [rows, 1]) of `quantization`, or its one
    scale (Granularity.TENSOR: any tensor of one element).
    `transposed`: the live codes are the transpose of row-major codes of the recorded shape (a
    [cols, rows] view with strides (1, cols), as vLLM's per-channel online FP8 serves them).
    `shared_amax`: the scales are the whole parameter's across every receiver holding a share of it
    (vLLM reduces their amax across the tensor-parallel ranks: per tensor, the one scale of any
    sharded layer; per channel, each row's scale of a row-parallel layer): each receiver gives its
    scales an amax key (Table.share_amax) that every receiver derives alike (amax_key: from the
    scale parameter's name, and per row from the box's first row)."""

    scales: str
    quantization: Quantization
    transposed: bool = False
    shared_amax: bool = False

    def block(self, shape: Tuple[int, ...]) -> Tuple[int, int]:
        """The elements sharing one scale in a parameter of `shape`."""
        return self.quantization.block_shape(shape[0], shape[1])

    @property
    def codes_dtype(self) -> str:
        return _TARGETS[self.quantization.target]

    def grid(self, shape: Tuple[int, ...]) -> Tuple[int, int]:
        return self.quantization.scale_grid(shape[0], shape[1])

    def unfit_live(self, layout: ParamLayout, codes: TensorLike, scales: TensorLike) -> Optional[str]:
        """Why the live `codes` and `scales` are not what the quantized needs write (None when they
        are): codes of the recorded shape (or its transpose), row-major, in the quantization's FP8
        type; float32 scales of the grid, row-major."""
        rows, cols = layout.shape
        grid = self.grid(layout.shape)
        codes_want = ((cols, rows), (1, cols)) if self.transposed else ((rows, cols), (cols, 1))
        scales_want = (grid, (grid[1], 1))
        if self.quantization.granularity == Granularity.TENSOR and math.prod(int(n) for n in scales.shape) == 1:
            scales_want = (tuple(int(n) for n in scales.shape), tuple(int(s) for s in scales.stride()))
        for tensor, name, (shape, strides), dtype in (
            (codes, layout.name, codes_want, self.codes_dtype),
            (scales, self.scales, scales_want, "float32"),
        ):
            got = (tuple(int(n) for n in tensor.shape), tuple(int(s) for s in tensor.stride()), dtype_name(tensor))
            if got != (tuple(shape), tuple(strides), dtype):
                return f"{name} is {list(got[0])}/{list(got[1])}/{got[2]}; quantized needs write {list(shape)}/{list(strides)}/{dtype}"
        return None


def amax_key(name: str) -> int:
    """A nonzero 64-bit key every process derives alike from a name (FNV-1a; Python's own hash
    differs between processes)."""
    key = 0xCBF29CE484222325
    for byte in name.encode():
        key = ((key ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return key or 1


def unfit_boxes(layout: ParamLayout, block: Tuple[int, int], checkpoint: Mapping[str, Any], one_scale: bool = False) -> Optional[str]:
    """Why the recorded boxes of a 2-D parameter cannot each be one quantized need (None when they
    can): every box must be a row-major rectangle of the parameter that starts on a block boundary
    and ends on one (or at the parameter's edge), so that no block mixes two boxes, and the boxes
    must cover every element (a block with an element no box writes would be scaled differently).
    `one_scale`: the parameter has one scale, which its boxes' needs share (per tensor: needs naming
    one scale take the amax of all of them), so boxes may end anywhere. `checkpoint`: name ->
    TensorSpec, whose dtype must be one quantizing reads."""
    if len(layout.shape) != 2:
        return f"{layout.name} is {len(layout.shape)}-dimensional, not a matrix"
    rows, cols = layout.shape
    block_rows, block_cols = block
    covered = 0
    for piece in layout.pieces:
        if len(piece.extent) != 2 or tuple(piece.strides) != (cols, 1):
            return f"{piece.tensor} lands in {layout.name} with strides {list(piece.strides)}, not as rows of it"
        if _dtype(checkpoint[piece.tensor].dtype) not in SOURCE_TYPES:
            return f"{piece.tensor} is {_dtype(checkpoint[piece.tensor].dtype)}, which refit does not quantize"
        row, col = divmod(piece.at, cols)
        end_row, end_col = row + piece.extent[0], col + piece.extent[1]
        if not one_scale and (row % block_rows or col % block_cols):
            return f"{piece.tensor} starts at row {row}, column {col} of {layout.name}, inside a {block_rows} x {block_cols} block"
        if not one_scale and ((end_row % block_rows and end_row != rows) or (end_col % block_cols and end_col != cols)):
            return f"{piece.tensor} ends at row {end_row}, column {end_col} of {layout.name}, inside a block another box shares"
        covered += piece.numel
    if covered != math.prod(layout.shape):
        return f"{layout.name}: boxes cover {covered} of {math.prod(layout.shape)} elements"
    return None


# Past this many distinct boxes of one reloaded tensor, it is delivered whole (checking that they
# are disjoint compares every pair).
MAX_RELOAD_BOXES = 64


def _reload_boxes(recording: Recording, reload: Mapping[str, str], reloaded: Mapping[str, str]) -> Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]:
    """Reloaded checkpoint tensor -> its distinct recorded boxes, for those the reload path reads in
    part only: not staged by the recording (nothing computed from it), every box of it landing in a
    reloaded parameter (none in a parameter of another path, which the reload's load would overwrite
    from the rest of the buffer), the boxes disjoint and not the whole tensor."""
    boxes: Dict[str, set] = {}
    elsewhere = set()
    for layout in recording.layouts:
        for piece in layout.pieces:
            if layout.name in reloaded:
                boxes.setdefault(piece.tensor, set()).add((tuple(piece.offset), tuple(piece.extent)))
            else:
                elsewhere.add(piece.tensor)
    out = {}
    for name in reload:
        distinct = sorted(boxes.get(name, ()))
        if name in recording.staged or name in elsewhere or not distinct or len(distinct) > MAX_RELOAD_BOXES:
            continue
        if sum(math.prod(extent) for _, extent in distinct) >= math.prod(recording.checkpoint[name].shape):
            continue  # all of it (disjoint boxes that many elements cover it): one need, whole
        if any(_meet(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:]):
            continue
        out[name] = distinct
    return out


def _meet(a: Tuple[Tuple[int, ...], Tuple[int, ...]], b: Tuple[Tuple[int, ...], Tuple[int, ...]]) -> bool:
    """Whether boxes a and b ((offset, extent) each) share an element."""
    return all(oa < ob + eb and ob < oa + ea for oa, ea, ob, eb in zip(a[0], a[1], b[0], b[1]))


class RecordedReceiver:
    """Needs of one engine process, from the recording of its loader."""

    def __init__(
        self,
        recording: Recording,
        reloaded: Optional[Mapping[str, str]] = None,
        quantized: Optional[Mapping[str, QuantizedParam]] = None,
        added: Collection[str] = (),
    ) -> None:
        """`reloaded`: parameter -> why the engine's reload path writes it; `quantized`: parameter
        -> how refit quantizes its boxes (see the module); `added`: parameters the engine creates
        after the recorded load (post-processing), which the live model may hold unrecorded."""
        self.recording = recording
        reloaded = dict(reloaded or {})
        self.quantized: Dict[str, QuantizedParam] = dict(quantized or {})
        recorded = {layout.name: layout for layout in recording.layouts}
        for name, spec in self.quantized.items():
            if name not in recorded or name in reloaded:
                raise invalid_argument(f"{name} is quantized but {'reloaded' if name in reloaded else 'receives no recorded boxes'}")
            if spec.quantization.granularity not in (Granularity.BLOCK, Granularity.ROW, Granularity.TENSOR):
                raise invalid_argument(f"{name}: quantized parameters take Granularity.BLOCK, ROW or TENSOR, not {spec.quantization.granularity!r}")
            if len(recorded[name].shape) != 2:
                raise invalid_argument(f"{name} is {len(recorded[name].shape)}-dimensional; quantized parameters are matrices")
            one_scale = spec.quantization.granularity == Granularity.TENSOR
            why = unfit_boxes(recorded[name], spec.block(recorded[name].shape), recording.checkpoint, one_scale=one_scale)
            if why is not None:
                raise invalid_argument(f"{name} cannot be quantized box by box: {why}")
        self.added = set(added) | {spec.scales for spec in self.quantized.values()}
        self.reload: Dict[str, str] = {}
        """Checkpoint tensor -> why it goes through the engine's reload path."""
        for layout in recording.layouts:
            if layout.name in reloaded:
                for piece in layout.pieces:
                    self.reload.setdefault(piece.tensor, reloaded[layout.name])
        for name, params in recording.staged_params.items():
            hit = [p for p in params if p in reloaded]
            if hit:
                self.reload.setdefault(name, reloaded[hit[0]])
        kept = [layout for layout in recording.layouts if layout.name not in reloaded]
        self.layouts = [layout for layout in kept if layout.name not in self.quantized]
        self.quantized_layouts = [layout for layout in kept if layout.name in self.quantized]
        self.staged = {name: why for name, why in recording.staged.items() if name not in self.reload}
        self.reload_boxes = _reload_boxes(recording, self.reload, reloaded)
        """Reloaded checkpoint tensor -> the boxes (offset, extent) delivered into its staging
        buffer, where not the whole tensor."""
        self.paths: Dict[str, str] = {layout.name: "boxes" for layout in self.layouts}
        for name, spec in self.quantized.items():
            self.paths[name] = self.paths[spec.scales] = "quantized"
        for name in self.staged:
            for param in recording.staged_params.get(name, ()):
                self.paths[param] = "loader"
        for param in reloaded:
            if param in recording.params or param in self.added:
                self.paths[param] = "reload"

    def _params(self, named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]]) -> Dict[str, TensorLike]:
        items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
        live = {strip_wrappers(name): tensor for name, tensor in items}
        recorded = self.recording.params
        only_live = sorted(set(live) - set(recorded) - self.added)
        only_recorded = sorted(set(recorded) - set(live))
        if only_live or only_recorded:
            raise invalid_argument(
                f"the parameters differ from the recorded ones: {len(only_live)} new (e.g. {only_live[:3]}), "
                f"{len(only_recorded)} gone (e.g. {only_recorded[:3]}); record the loader again"
            )
        # Only parameters written as boxes are checked: those the engine transforms after loading
        # (reloaded) may be reshaped by it, and its reload path writes them.
        changed = []
        for layout in self.layouts:
            tensor, info = live[layout.name], recorded[layout.name]
            shape = tuple(int(n) for n in tensor.shape)
            strides = tuple(int(s) for s in tensor.stride())
            if shape != info.shape or strides != info.strides or dtype_name(tensor) != _dtype(info.dtype):
                changed.append(f"{layout.name} {list(shape)}/{list(strides)}/{dtype_name(tensor)}")
        if changed:
            raise invalid_argument(
                f"{len(changed)} parameters changed shape, strides or dtype since the loader was recorded "
                f"(post-processed after loading?), e.g. {changed[:3]}"
            )
        missing = sorted(spec.scales for spec in self.quantized.values() if spec.scales not in live)
        if missing:
            raise invalid_argument(f"{len(missing)} scale parameters of quantized parameters are missing, e.g. {missing[:3]}")
        for layout in self.quantized_layouts:
            self._check_quantized(layout, live[layout.name], live[self.quantized[layout.name].scales])
        return live

    def _check_quantized(self, layout: ParamLayout, codes: TensorLike, scales: TensorLike) -> None:
        """The live codes and scales are what the quantized needs write (QuantizedParam.unfit_live)."""
        why = self.quantized[layout.name].unfit_live(layout, codes, scales)
        if why is not None:
            raise invalid_argument(why)

    def staging_buffers(self, allocate: Callable[[Tuple[int, ...], Any], TensorLike]) -> Dict[str, TensorLike]:
        """A buffer of its whole shape per staged checkpoint tensor (for the loader or the reload path):
        `allocate(shape, dtype)` makes it (e.g. `lambda shape, dtype: torch.empty(shape,
        dtype=dtype, device=device)`)."""
        specs = self.recording.checkpoint
        return {name: allocate(specs[name].shape, specs[name].dtype) for name in self._staged_tensors()}

    def _staged_tensors(self) -> List[str]:
        """Every checkpoint tensor delivered into staging (whole, or its `reload_boxes`)."""
        return list(self.staged) + [name for name in self.reload if name not in self.staged]

    def add_to(
        self,
        table: Table,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        staging: Optional[Mapping[str, TensorLike]] = None,
    ) -> int:
        """Adds every recorded box as a need of `process` at the live parameters' addresses, and
        every staged tensor into `staging` (required when the recording staged any): whole, or its
        `reload_boxes` at their places in it. Returns the number of needs added."""
        live = self._params(named_parameters)
        specs = self.recording.checkpoint
        indices: Dict[str, int] = {}

        def index(name: str, element_size: int) -> int:
            if name not in indices:
                spec = specs[name]
                indices[name] = table.add_tensor(name, spec.shape, element_size, dtype_code(_dtype(spec.dtype)))
            return indices[name]

        added = 0
        for layout in self.layouts:
            tensor = live[layout.name]
            base, es, dev = tensor.data_ptr(), tensor.element_size(), device_index(tensor, device)
            for piece in layout.pieces:
                table.add_need(index(piece.tensor, es), process, dev, base + piece.at * es, piece.offset, piece.extent, piece.strides)
                added += 1
        for layout in self.quantized_layouts:
            spec = self.quantized[layout.name]
            codes, scales = live[layout.name], live[spec.scales]
            dev = device_index(codes, device)
            (block_rows, block_cols), grid_cols, cols = spec.block(layout.shape), spec.grid(layout.shape)[1], layout.shape[1]
            for piece in layout.pieces:
                row, col = divmod(piece.at, cols)
                kind = SOURCE_TYPES[_dtype(specs[piece.tensor].dtype)]
                # Codes are one byte: element and byte strides agree; a transposed view's storage
                # holds them row-major from its data_ptr all the same. The box's scales start at
                # its first block's place in the grid.
                first_scale = (row // block_rows) * grid_cols + col // block_cols
                table.add_quantized_need(
                    index(piece.tensor, SOURCE_SIZES[kind]), process, dev, codes.data_ptr() + piece.at, piece.offset, piece.extent,
                    (cols, 1), spec.quantization, kind, scales.data_ptr() + 4 * first_scale, grid_cols,
                )
                added += 1
                if spec.shared_amax:
                    per_row = spec.quantization.granularity == Granularity.ROW
                    key = amax_key(f"{spec.scales}@{row}" if per_row else spec.scales)
                    table.share_amax(process, scales.data_ptr() + 4 * first_scale, key)
        whole = self._staged_tensors()
        if whole:
            missing = sorted(set(whole) - set(staging or {}))
            if missing:
                raise invalid_argument(f"{len(missing)} staged checkpoint tensors have no staging buffer, e.g. {missing[:3]}")
            assert staging is not None
            for name in whole:
                buffer = staging[name]
                spec = specs[name]
                if tuple(int(n) for n in buffer.shape) != spec.shape or dtype_name(buffer) != _dtype(spec.dtype):
                    raise invalid_argument(f"staging buffer of {name} is {list(buffer.shape)} {dtype_name(buffer)}; the checkpoint has {list(spec.shape)} {_dtype(spec.dtype)}")
                strides = tuple(int(s) for s in buffer.stride())
                tensor, dev, es = index(name, buffer.element_size()), device_index(buffer, device), buffer.element_size()
                for offset, extent in self.reload_boxes.get(name, [((0,) * len(spec.shape), spec.shape)]):
                    at = buffer.data_ptr() + es * sum(o * st for o, st in zip(offset, strides))
                    table.add_need(tensor, process, dev, at, offset, extent, strides)
                    added += 1
        return added

    def table(
        self,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        staging: Optional[Mapping[str, TensorLike]] = None,
    ) -> Table:
        """A new Table holding this process's needs."""
        return new_table(lambda table: self.add_to(table, named_parameters, process, device, staging))

    def load_staged(self, loader: Callable[[Iterable[Tuple[str, Any]]], Any], staging: Mapping[str, Any]) -> int:
        """Runs the engine's own loader on the staged tensors (after the refit wrote them); returns
        how many it was given."""
        if self.staged:
            log.info("refit: the engine's loader takes %d staged tensors (%s)", len(self.staged), ", ".join(sorted(set(self.staged.values()))))
            loader((name, staging[name]) for name in self.staged)
        return len(self.staged)

    def reloaded_tensors(self, staging: Mapping[str, Any]) -> List[Tuple[str, Any]]:
        """The staged checkpoint tensors of the parameters the engine transforms after loading, for
        the engine's reload path (after the refit wrote them)."""
        return [(name, staging[name]) for name in self.reload]
