"""Ownership of one library handle: released exactly once, by close(), the end of a `with` block or,
as a fallback, garbage collection; and never while a call is using it."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, TypeVar

from ._args import shown
from ._lib import ArgumentTypeError, RefitError, Status

Self = TypeVar("Self", bound="Handle")

# Guards every handle's bookkeeping below; held for a few bytecodes only, never across a C call.
_bookkeeping = threading.Lock()


class Handle:
    """Owns a pointer from a refit_*_create/build/decode call and releases it with `_release`.

    close() is idempotent; using the object after it raises RefitError(INVALID_STATE). The wrappers
    make their C calls inside `_borrow()`: close() refuses (INVALID_STATE) while one is in progress,
    since the library would free what the call is still reading, and a call the library allows
    from one thread at a time is refused while another thread's is in progress (it would corrupt
    the handle or wait forever).
    """

    _what = "handle"
    _busy_hint = ""  # appended to the in-use refusals
    # Class defaults, so that close() and __del__ also work on an object whose __init__ failed.
    _pointer: Optional[int] = None
    _users = 0  # calls in progress
    _owner: Optional[int] = None  # the thread of the exclusive calls in progress
    _exclusive = 0  # exclusive calls in progress (nested ones of the owner included)

    def __init__(self, pointer: Optional[int]) -> None:
        self.close()  # __init__ called again must not leak the handle it replaces
        self._pointer = pointer

    def _release(self, pointer: int) -> None:
        raise NotImplementedError

    @property
    def handle(self) -> int:
        """The raw pointer as an int, for calls into the C API directly (not kept from close())."""
        if not self._pointer:
            raise RefitError(Status.INVALID_STATE, f"the {self._what} is closed")
        return self._pointer

    @property
    def closed(self) -> bool:
        return not self._pointer

    @contextlib.contextmanager
    def _borrow(self, exclusive: bool = False) -> Iterator[int]:
        """The pointer, for a call made inside the block; `exclusive` for the calls the library
        allows from one thread at a time (nested ones on that thread are allowed)."""
        thread = threading.get_ident()
        with _bookkeeping:
            pointer = self.handle
            if exclusive:
                if self._exclusive and self._owner != thread:
                    raise RefitError(
                        Status.INVALID_STATE,
                        f"the {self._what} is in use by a call on another thread{self._busy_hint}; "
                        "its calls are made one at a time",
                    )
                self._owner, self._exclusive = thread, self._exclusive + 1
            self._users += 1
        try:
            yield pointer
        finally:
            with _bookkeeping:
                self._users -= 1
                if exclusive:
                    self._exclusive -= 1

    def close(self) -> None:
        """Releases the handle now; later calls do nothing. Refused (INVALID_STATE) while a call on
        another thread uses it."""
        with _bookkeeping:
            if self._users:
                raise RefitError(
                    Status.INVALID_STATE,
                    f"the {self._what} cannot be closed while a call on another thread uses it{self._busy_hint}",
                )
            pointer, self._pointer = self._pointer, None
        if pointer:
            self._release(pointer)

    def __enter__(self: Self) -> Self:
        self.handle  # refuses a closed handle
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __reduce__(self) -> object:
        # A copy (copy.copy, deepcopy, pickle) would share the pointer and release it twice.
        raise TypeError(f"a refit {self._what} owns a library handle and cannot be copied or pickled")

    def __del__(self) -> None:
        # Fallback only. Without _bookkeeping: the collector may run this on any thread at any
        # allocation, also while that thread holds the lock (in another handle's _borrow or close),
        # and the lock is not reentrant. Nothing else can reach an object being collected, so no
        # call is using it and no other thread closes it. During interpreter teardown the library
        # may already be unloaded.
        pointer, self._pointer = self._pointer, None
        if pointer:
            try:
                self._release(pointer)
            except Exception:
                pass


def borrow(value: object, kind: str, what: str, exclusive: bool = False) -> contextlib.AbstractContextManager[int]:
    """`value._borrow(exclusive)` once `value` is checked to be a refit `kind` (its class's _what):
    the library would read a handle of another type as this one's struct."""
    if not isinstance(value, Handle) or value._what != kind:
        given = f"a refit {value._what}" if isinstance(value, Handle) else shown(value)
        raise ArgumentTypeError(f"{what} must be a refit {kind}, not {given}")
    return value._borrow(exclusive)
