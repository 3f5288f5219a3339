"""Helpers for torch users: tensor addresses and CUDA streams as the ints refit takes.

Importable only where torch is (`import refit.torch` raises ImportError otherwise); nothing else in
the binding needs torch. Any thread may call these.
"""

import torch

from ._lib import invalid_argument


def data_ptr(tensor):
    """The address of `tensor`'s first element as an int (a device pointer for a CUDA tensor)."""
    return tensor.data_ptr()


def nbytes(tensor):
    """Bytes `tensor` spans when contiguous; refuses a non-contiguous tensor (its bytes are not
    one block, so one pointer and a size would misdescribe it)."""
    if not tensor.is_contiguous():
        raise invalid_argument("tensor is not contiguous")
    return tensor.numel() * tensor.element_size()


def current_stream(device):
    """torch's current CUDA stream of `device` as an int CUstream (0 is the legacy default)."""
    return torch.cuda.current_stream(device).cuda_stream


def current_streams(group):
    """torch's current stream of every rank's device, in rank order: the `caller_streams` that make a
    group.scope() wait for, and (with ExitMode.ASYNC) be waited for by, torch's work."""
    return [current_stream(device) for device in group.devices]


def rank_stream(group, rank):
    """The group's stream of `rank` as a torch.cuda.ExternalStream, to queue torch work on it inside
    group.run(); owned by the group (valid until it closes)."""
    return torch.cuda.ExternalStream(group.stream(rank), device=torch.device("cuda", group.device(rank)))
