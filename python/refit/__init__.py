"""ctypes binding for librefit (see include/refit.h for the C API it wraps).

The library is found at $REFIT_LIBRARY, else next to this package, else in the repository's
target/release or target/debug. Every failing call raises RefitError carrying the status and the
library's message.
"""

from ._lib import RefitError, Status, abi_version, lib, version

__all__ = ["RefitError", "Status", "abi_version", "lib", "version"]
