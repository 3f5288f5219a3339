"""Tensors as table entries: a tensor's address, shape, strides, dtype and device turned into the
offers and needs of a refit Table, for torch tensors or anything shaped like one (TensorLike).

Nothing here imports torch: any object with torch's few tensor methods works, which is how the
tests describe host memory as tensors. refit.torch re-exports these for torch users.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Tuple

Shape = Tuple[int, ...]

from ._args import integer, integers, tensor_like
from ._lib import invalid_argument
from .plan import Table

# Codes the tables carry for element types (the planner only compares them: both sides of a refit
# must describe a tensor alike). Names are torch's (`str(torch.bfloat16)` without "torch.").
DTYPE_CODES = {
    "float32": 1,
    "bfloat16": 2,
    "float16": 3,
    "float64": 4,
    "float8_e4m3fn": 5,
    "float8_e5m2": 6,
    "int8": 7,
    "uint8": 8,
    "int16": 9,
    "int32": 10,
    "int64": 11,
    "bool": 12,
}


class TensorLike(Protocol):
    """The part of torch.Tensor these helpers read."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def device(self) -> Any: ...

    def data_ptr(self) -> int: ...

    def element_size(self) -> int: ...

    def stride(self) -> Sequence[int]: ...


def dtype_name(tensor: TensorLike) -> str:
    """torch's name of the tensor's element type ("bfloat16" for torch.bfloat16)."""
    return str(tensor.dtype).rsplit(".", 1)[-1]


def dtype_code(name: str) -> int:
    """The table's code for a dtype name (DTYPE_CODES); INVALID_ARGUMENT for an unknown name."""
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise invalid_argument(f"dtype {name!r} has no refit dtype code; known: {', '.join(DTYPE_CODES)}") from None


def device_index(tensor: TensorLike, device: Optional[int] = None) -> int:
    """The device ordinal of a CUDA tensor; `device` for a tensor in host memory (a device the host
    backend simulates), which must then be given. A given `device` must match a CUDA tensor's.
    Tensors elsewhere (meta, mps, xpu, ...) are refused: their data_ptr() is no address refit reads."""
    if device is not None:
        device = integer(device, "device")
    kind = getattr(tensor.device, "type", str(tensor.device))
    if kind == "cuda":
        index = tensor.device.index
        index = 0 if index is None else int(index)
        if device is not None and device != index:
            raise invalid_argument(f"device = {device} given for a tensor on cuda:{index}: pass {index} or None")
        return index
    if kind != "cpu":
        raise invalid_argument(f"a tensor on {tensor.device} is neither in host memory nor on a CUDA device")
    if device is None:
        raise invalid_argument(
            f"a tensor on {tensor.device} needs device= (an integer: the simulated device it stands for), not None"
        )
    return device


def _ints(values: Sequence[int], what: str) -> Shape:
    # Not int(): it would silently turn an offset of 0.5 into 0.
    return tuple(integers(values, what))


def _box(tensor: TensorLike, shape: Optional[Sequence[int]], offset: Optional[Sequence[int]]) -> Tuple[Shape, Shape, Shape]:
    extent = _ints(tensor.shape, "tensor.shape")
    full = extent if shape is None else _ints(shape, "shape")
    at = (0,) * len(full) if offset is None else _ints(offset, "offset")
    if len(full) != len(extent) or len(at) != len(extent):
        raise invalid_argument(
            f"shape = {list(full)} and offset = {list(at)} for a {len(extent)}-dimensional tensor: each needs "
            f"{len(extent)} entries"
        )
    return full, at, extent


def add_tensor_offer(
    table: Table,
    name: str,
    tensor: TensorLike,
    rank: int,
    shape: Optional[Sequence[int]] = None,
    offset: Optional[Sequence[int]] = None,
    device: Optional[int] = None,
    digest: Optional[int] = None,
) -> int:
    """Offers `tensor` as the box at `offset` (default: the origin) of the global tensor `name` of
    `shape` (default: the tensor's own shape, i.e. the whole tensor), held by `rank` on the tensor's
    device. Reads the address, strides, element size and dtype from the tensor; returns the tensor
    index in `table`. A non-contiguous view (a slice, a transpose) is offered with its strides."""
    full, at, extent = _box(tensor_like(tensor, "tensor"), shape, offset)
    index = table.add_tensor(name, full, tensor.element_size(), dtype_code(dtype_name(tensor)))
    strides = _ints(tensor.stride(), "tensor.stride()")
    table.add_offer(index, rank, device_index(tensor, device), tensor.data_ptr(), at, extent, strides, digest)
    return index


def add_tensor_need(
    table: Table,
    name: str,
    tensor: TensorLike,
    rank: int,
    shape: Optional[Sequence[int]] = None,
    offset: Optional[Sequence[int]] = None,
    device: Optional[int] = None,
) -> int:
    """Asks for the box at `offset` of the global tensor `name` of `shape` (defaults as in
    add_tensor_offer) to be written into `tensor` (any strides, e.g. a slice of a fused parameter)
    on `rank`. Returns the tensor index in `table`."""
    full, at, extent = _box(tensor_like(tensor, "tensor"), shape, offset)
    index = table.add_tensor(name, full, tensor.element_size(), dtype_code(dtype_name(tensor)))
    strides = _ints(tensor.stride(), "tensor.stride()")
    table.add_need(index, rank, device_index(tensor, device), tensor.data_ptr(), at, extent, strides)
    return index


# Element types a quantized need's source may have, by torch's name: (REFIT_SOURCE_* code, bytes).
SOURCE_DTYPES = {"bfloat16": (1, 2), "float16": (2, 2), "float32": (3, 4)}


def add_tensor_quantized_need(
    table: Table,
    name: str,
    codes: TensorLike,
    scales: TensorLike,
    rank: int,
    quantization: Any,
    source_dtype: str = "bfloat16",
    shape: Optional[Sequence[int]] = None,
    offset: Optional[Sequence[int]] = None,
    device: Optional[int] = None,
    staging: Optional[TensorLike] = None,
) -> int:
    """Asks for the box at `offset` of the global tensor `name` of `shape` (elements of
    `source_dtype`, as its publishers describe it) as FP8 codes in `codes` (one byte per element, the
    box's shape, rows contiguous: a float8 or uint8 tensor, or a slice of one) and scales in `scales`
    (the scale grid of each matrix as refit_need_quantization lays it out: its last dimension the
    grid's columns, contiguous; the one before, grid rows; the one before that, matrices), quantized
    as `quantization` (a refit.quant.Quantization) says. `staging` (optional): a contiguous tensor of
    `source_dtype` with room for the box, on the same device, where the elements land when they
    cannot be quantized where they are offered. Returns the tensor index in `table`."""
    from .quant import Quantization

    if not isinstance(quantization, Quantization):
        raise invalid_argument(f"quantization is {quantization!r}; expected a refit.quant.Quantization")
    if source_dtype not in SOURCE_DTYPES:
        raise invalid_argument(f"source_dtype {source_dtype!r}: one of {', '.join(SOURCE_DTYPES)}")
    source_code, source_size = SOURCE_DTYPES[source_dtype]
    codes, scales = tensor_like(codes, "codes"), tensor_like(scales, "scales")
    staging = None if staging is None else tensor_like(staging, "staging")
    if codes.element_size() != 1:
        raise invalid_argument(f"codes has {codes.element_size()}-byte elements ({codes.dtype}); FP8 codes take 1")
    full, at, extent = _box(codes, shape, offset)
    at_device = device_index(codes, device)
    _on_device(scales, "scales", at_device)
    rows = extent[-2] if len(extent) >= 2 else 1
    cols = extent[-1] if extent else 1
    matrices = 1
    for e in extent[:-2]:
        matrices *= e
    grid_rows, grid_cols = quantization.scale_grid(rows, cols)
    if scales.element_size() != quantization.scale_size:
        raise invalid_argument(
            f"scales has {scales.element_size()}-byte elements ({scales.dtype}); this quantization's scales are "
            f"{quantization.scale_size} bytes ({'e8m0' if quantization.scale_size == 1 else 'float32'})"
        )
    scale_strides = _ints(scales.stride(), "scales.stride()")
    scale_shape = _ints(scales.shape, "scales.shape")
    if scale_shape and scale_shape[-1] > 1 and scale_strides[-1] != 1:
        raise invalid_argument(f"scales.stride() is {list(scale_strides)}: a grid row's scales must be contiguous")
    row_stride = scale_strides[-2] if len(scale_shape) >= 2 else grid_cols
    matrix_stride = scale_strides[-3] if len(scale_shape) >= 3 else (grid_rows * row_stride if matrices > 1 else 0)
    span = (matrices - 1) * matrix_stride + (grid_rows - 1) * row_stride + grid_cols
    if _numel(scale_shape) < span:
        raise invalid_argument(
            f"scales of shape {list(scale_shape)} hold {_numel(scale_shape)} scales; {matrices} matrix(es) of "
            f"{grid_rows} x {grid_cols} scales with these strides span {span}"
        )
    staging_at = 0
    if staging is not None:
        staging_shape = _ints(staging.shape, "staging.shape")
        if staging.element_size() != source_size or _numel(staging_shape) < _numel(extent):
            raise invalid_argument(
                f"staging holds {_numel(staging_shape)} elements of {staging.element_size()} bytes; the box needs "
                f"{_numel(extent)} of {source_size} ({source_dtype})"
            )
        _on_device(staging, "staging", at_device)
        staging_at = staging.data_ptr()
    index = table.add_tensor(name, full, source_size, dtype_code(source_dtype))
    code_strides = _ints(codes.stride(), "codes.stride()")
    table.add_quantized_need(
        index, rank, at_device, codes.data_ptr(), at, extent, code_strides, quantization, source_code,
        scales.data_ptr(), row_stride, matrix_stride, staging_at,
    )
    return index


def _on_device(tensor: TensorLike, what: str, device: int) -> None:
    """INVALID_ARGUMENT unless `tensor` is on `device`, the codes' (a host tensor stands for it)."""
    kind = getattr(tensor.device, "type", str(tensor.device))
    if device_index(tensor, None if kind == "cuda" else device) != device:
        raise invalid_argument(f"{what} is on {tensor.device}, the codes on device {device}: both on the receiver")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for e in shape:
        n *= e
    return n
