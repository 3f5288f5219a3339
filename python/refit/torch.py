"""Helpers for torch users: tensors as offers and needs, tensor addresses, and CUDA streams.

Importable only where torch is (`import refit.torch` raises ImportError otherwise); nothing else in
the binding needs torch. Streams need no helper: every refit call taking a stream accepts a
torch.cuda.Stream and defaults to torch's current stream once torch uses CUDA. Any thread may call
these.
"""

from __future__ import annotations

import torch

from ._lib import Backend, invalid_argument
from .group import Group
from .tensor import (
    DTYPE_CODES,
    add_tensor_need,
    add_tensor_offer,
    add_tensor_quantized_need,
    device_index,
    dtype_code,
    dtype_name,
)

__all__ = [
    "DTYPE_CODES",
    "add_tensor_need",
    "add_tensor_offer",
    "add_tensor_quantized_need",
    "current_stream",
    "current_streams",
    "data_ptr",
    "device_index",
    "dtype_code",
    "dtype_name",
    "nbytes",
    "rank_stream",
]


def data_ptr(tensor: torch.Tensor) -> int:
    """The address of `tensor`'s first element as an int (a device pointer for a CUDA tensor)."""
    return int(tensor.data_ptr())


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` spans when contiguous; refuses a non-contiguous tensor (its bytes are not
    one block, so one pointer and a size would misdescribe it)."""
    if not tensor.is_contiguous():
        raise invalid_argument(
            f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not contiguous: pass a "
            "contiguous tensor (its bytes are one block)"
        )
    return int(tensor.numel() * tensor.element_size())


def current_stream(device: int) -> int:
    """torch's current CUDA stream of `device` as an int CUstream (0 is the legacy default)."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def current_streams(group: Group) -> list[int]:
    """torch's current stream of every rank's device, in rank order: what group.scope() waits for
    (and, with ExitMode.ASYNC, makes wait) by default once torch uses CUDA."""
    return [current_stream(device) for device in group.devices]


def rank_stream(group: Group, rank: int) -> torch.cuda.ExternalStream:
    """The group's stream of `rank` as a torch.cuda.ExternalStream, to queue torch work on it inside
    group.run(); owned by the group (valid until it closes)."""
    if group.backend != Backend.CUDA:
        # torch would take the host backend's queue handle for a CUstream and launch work on it.
        raise invalid_argument(
            f"group is a {group.backend.name} group; rank_stream needs a CUDA group (a host-backend group's "
            "streams are not CUDA streams)"
        )
    return torch.cuda.ExternalStream(group.stream(rank), device=torch.device("cuda", group.device(rank)))
