"""Tensors as table entries: a tensor's address, shape, strides, dtype and device turned into the
offers and needs of a refit Table, for torch tensors or anything shaped like one (TensorLike).

Nothing here imports torch: any object with torch's few tensor methods works, which is how the
tests describe host memory as tensors. refit.torch re-exports these for torch users.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Tuple

Shape = Tuple[int, ...]

from ._args import integer, integers
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
    full, at, extent = _box(tensor, shape, offset)
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
    full, at, extent = _box(tensor, shape, offset)
    index = table.add_tensor(name, full, tensor.element_size(), dtype_code(dtype_name(tensor)))
    strides = _ints(tensor.stride(), "tensor.stride()")
    table.add_need(index, rank, device_index(tensor, device), tensor.data_ptr(), at, extent, strides)
    return index
