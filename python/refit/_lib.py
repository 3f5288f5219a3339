"""Loads librefit and turns statuses into exceptions."""

import ctypes
import enum
import os
from pathlib import Path


def _candidates():
    explicit = os.environ.get("REFIT_LIBRARY")
    if explicit:
        yield Path(explicit)
        return
    here = Path(__file__).resolve().parent
    yield here / "librefit.so"
    root = here.parent.parent
    for profile in ("release", "debug"):
        yield root / "target" / profile / "librefit.so"


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            return ctypes.CDLL(str(path))
    raise OSError("librefit.so not found; searched: " + ", ".join(tried) + " (set REFIT_LIBRARY)")


lib = _load()


class Status(enum.IntEnum):
    """refit_status, read from the library so the two can never disagree."""

    @classmethod
    def _missing_(cls, value):
        return None


def _status_names():
    lib.refit_status_string.restype = ctypes.c_char_p
    lib.refit_status_string.argtypes = [ctypes.c_int32]
    names = {}
    code = 0
    while True:
        name = lib.refit_status_string(code).decode()
        if name == "REFIT_STATUS_UNKNOWN":
            return names
        names[name[len("REFIT_STATUS_"):]] = code
        code += 1


Status = enum.IntEnum("Status", _status_names())  # noqa: F811 (built from the library)


class RefitError(Exception):
    """A call returned a status other than SUCCESS."""

    def __init__(self, status, message):
        self.status = Status(status)
        self.message = message
        super().__init__(f"{self.status.name}: {message}")


lib.refit_last_error_message.restype = ctypes.c_char_p
lib.refit_last_error_message.argtypes = []


def check(status):
    """Raises RefitError unless `status` is SUCCESS."""
    if status != 0:
        raise RefitError(status, lib.refit_last_error_message().decode(errors="replace"))


lib.refit_version.restype = ctypes.c_char_p
lib.refit_version.argtypes = []
lib.refit_abi_version.restype = ctypes.c_uint32
lib.refit_abi_version.argtypes = []


def version():
    return lib.refit_version().decode()


def abi_version():
    return lib.refit_abi_version()
