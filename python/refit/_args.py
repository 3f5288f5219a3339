"""The binding's argument checks, in one place: every public call turns its arguments into the C
types it passes through these, so a value ctypes would wrap, truncate or reinterpret is refused first.

Every refusal is a RefitError with status INVALID_ARGUMENT (INVALID_DEVICE for a device ordinal out
of range) whose message names the argument (with the index of a sequence's element: `shape[1]`), the
value given, and what is accepted. It is also the matching Python exception: ArgumentTypeError is a
TypeError (a value of the wrong type), ArgumentError a ValueError (the right type, a value out of
range), so callers may catch either.
"""

from __future__ import annotations

import ctypes
import enum
import operator
import sys
from typing import Any, Iterable, Optional, Sequence, Type, TypeVar

from ._lib import ArgumentError, ArgumentTypeError, Status, torch_cuda_in_use, torch_current_stream

E = TypeVar("E", bound=enum.IntEnum)

# How long a refused value's repr may get in a message before it is cut.
_SHOWN = 60


def shown(value: Any) -> str:
    """`value` as a message shows it: its repr (cut when long) and its type."""
    text = repr(value)
    if len(text) > _SHOWN:
        text = text[: _SHOWN - 3] + "..."
    return f"{text} ({type(value).__name__})"


def wrong_type(what: str, value: Any, accepted: str) -> ArgumentTypeError:
    """The refusal of `value` for `what`, which takes `accepted`."""
    return ArgumentTypeError(f"{what} must be {accepted}, not {shown(value)}")


def wrong_value(what: str, value: Any, accepted: str, status: int = Status.INVALID_ARGUMENT) -> ArgumentError:
    """The refusal of `value` for `what` (of the right type), which takes `accepted`."""
    return ArgumentError(f"{what} = {value!r} is not {accepted}", status)


def boolean(value: Any, what: str) -> bool:
    """`value`, a bool (or numpy's bool_), else refused: "no", 1 and None are not flags."""
    if isinstance(value, bool):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    raise wrong_type(what, value, "a bool (True or False)")


def integer(value: Any, what: str) -> int:
    """`value` as an int: an int or an integer scalar (__index__: numpy, torch), never a bool, a
    float or a string (int() would turn device 0.9 into 0, "1" into 1)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise wrong_type(what, value, "an integer")


def check_range(value: Any, bits: int, what: str) -> int:
    """`value` as an int in [0, 2^bits) (an unsigned C integer of `bits` bits)."""
    value = integer(value, what)
    if not 0 <= value < (1 << bits):
        raise wrong_value(what, value, f"in [0, 2^{bits})")
    return value


def device_ordinal(value: Any, what: str) -> int:
    """`value` as a CUDA device ordinal (a C int32); out of range is INVALID_DEVICE."""
    value = integer(value, what)
    if not -(1 << 31) <= value < (1 << 31):
        raise wrong_value(what, value, "a 32-bit device ordinal, in [-2^31, 2^31)", Status.INVALID_DEVICE)
    return value


def choice(value: Any, kind: Type[E], what: str) -> E:
    """`value` as a member of the enum `kind` (a member, or its integer value)."""
    number = integer(value, what)
    try:
        return kind(number)
    except ValueError:
        names = ", ".join(f"{member.name} ({member.value})" for member in kind)
        raise wrong_value(what, value, f"a {kind.__name__}: {names}") from None


def items(values: Any, what: str) -> list[Any]:
    """`values` (any iterable) as a list."""
    try:
        iterator = iter(values)
    except TypeError:
        raise wrong_type(what, values, "a sequence") from None
    return list(iterator)


def integers(values: Any, what: str, bits: Optional[int] = None) -> list[int]:
    """Every element of the sequence `values` as an int (in [0, 2^bits) when `bits` is given); a bad
    element is named by its index: `what[i]`."""
    check = integer if bits is None else (lambda value, name: check_range(value, bits, name))
    return [check(value, f"{what}[{index}]") for index, value in enumerate(items(values, what))]


def u64_array(values: Iterable[int], what: str) -> ctypes.Array[ctypes.c_uint64]:
    """A c_uint64 array of `values`, each checked to fit (ctypes would silently wrap)."""
    checked = integers(values, what, 64)
    return (ctypes.c_uint64 * len(checked))(*checked)


def same_length(values: Sequence[Any], expected: int, what: str, whole: str) -> None:
    """Refuses `values` unless it has `expected` entries (the C API reads exactly that many)."""
    if len(values) != expected:
        raise ArgumentError(f"{what} has {len(values)} entries; {whole}")


def byte_string(data: Any, what: str, expected: str = "bytes-like") -> bytes:
    """`data`, any bytes-like object, as bytes (bytes() would turn 5 into five NULs and [104, 105]
    into b"hi")."""
    try:
        return memoryview(data).tobytes()
    except TypeError:
        raise wrong_type(what, data, expected) from None


def callable_or_none(value: Any, what: str) -> Any:
    if value is not None and not callable(value):
        raise wrong_type(what, value, "callable or None")
    return value


def stream_value(stream: object = None, device: Optional[int] = None, host: bool = False, what: str = "stream") -> int:
    """A stream argument as the CUstream int the C API takes. Accepted:

    - an int: a CUstream / cudaStream_t handle (0 is the legacy default stream);
    - an object with `__cuda_stream__`, the CUDA stream protocol: a method (or attribute) giving
      (version, handle) with version 0 (cuda.core streams, recent torch and CuPy streams);
    - a torch.cuda.Stream or ExternalStream (`cuda_stream`), a CuPy stream (`ptr`), a HostStream;
    - None: torch's current stream of `device` (None: torch's current device) when torch is imported
      and has initialized CUDA, else 0. `host=True` (the call goes to a host-backend group) keeps
      None as 0, the simulated device's default stream.

    Anything else is refused, named `what`.
    """
    if stream is None:
        return torch_current_stream(device) if not host and torch_cuda_in_use() else 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return check_range(stream, 64, what)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if not (isinstance(value, tuple) and len(value) == 2 and value[0] == 0):
            raise wrong_value(f"{what}.__cuda_stream__", value, "(0, handle)")
        return check_range(value[1], 64, f"{what}.__cuda_stream__ handle")
    for attribute in ("cuda_stream", "ptr", "handle"):  # torch, CuPy, HostStream
        value = getattr(stream, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return check_range(value, 64, f"{what}.{attribute}")
    raise wrong_type(
        what,
        stream,
        "a stream: an int (CUstream), a torch or CuPy stream, an object with __cuda_stream__, a HostStream, or None",
    )


TENSOR_PARTS = ("shape", "dtype", "device", "data_ptr", "element_size", "stride")


def tensor_like(value: Any, what: str, parts: Sequence[str] = TENSOR_PARTS) -> Any:
    """`value` when it has the `parts` of a tensor a helper reads (by default TensorLike's;
    torch.Tensor has them all), else RefitError INVALID_ARGUMENT (an ArgumentTypeError) naming
    `what` and the parts missing."""
    missing = [part for part in parts if not hasattr(value, part)]
    if missing:
        raise wrong_type(what, value, f"a tensor (torch.Tensor, or an object with {', '.join(missing)})")
    return value
