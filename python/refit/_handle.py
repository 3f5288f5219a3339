"""Ownership of one library handle: released exactly once, by close(), the end of a `with` block or,
as a fallback, garbage collection."""

from __future__ import annotations

from typing import Optional, TypeVar

from ._lib import RefitError, Status

Self = TypeVar("Self", bound="Handle")


class Handle:
    """Owns a pointer from a refit_*_create/build/decode call and releases it with `_release`.

    close() is idempotent; using the object after it raises RefitError(INVALID_STATE).
    """

    _what = "handle"

    def __init__(self, pointer: Optional[int]) -> None:
        self._pointer = pointer

    def _release(self, pointer: int) -> None:
        raise NotImplementedError

    @property
    def handle(self) -> int:
        """The raw pointer as an int, for calls into the C API directly."""
        if not self._pointer:
            raise RefitError(Status.INVALID_STATE, f"the {self._what} is closed")
        return self._pointer

    @property
    def closed(self) -> bool:
        return not self._pointer

    def close(self) -> None:
        """Releases the handle now; later calls do nothing."""
        pointer, self._pointer = self._pointer, None
        if pointer:
            self._release(pointer)

    def __enter__(self: Self) -> Self:
        self.handle  # refuses a closed handle
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Fallback only: during interpreter teardown the library may already be unloaded.
        try:
            self.close()
        except Exception:
            pass
