"""Where the suite's rank and trainer processes come from: a fork server that has imported, once,
what every one of them imports (torch, vLLM, SGLang, the test module itself), so that each process
starts from those modules instead of importing them anew: on the two cores CI runs on, importing
them in every spawned process was most of the multi-process modules' time.

The server is a fresh interpreter, not the test process: it starts no thread of its own (torch's
and numpy's OpenBLAS start idle thread servers, which OpenBLAS re-creates after a fork) and joins no
process group before it forks, so each child sets up its world as a spawned process would.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext
from typing import Callable, Iterable


def context(preload: Iterable[str], *mains: Callable[..., object]) -> BaseContext:
    """The forkserver context whose server imports `preload` and the modules of `mains` (the
    processes' targets, which each child unpickles by module) before its first fork. A process runs
    one server, started by its first child; modules asked for after that are imported by each child
    itself, as under spawn (slower, and the same)."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["torch", *preload, *(main.__module__ for main in mains)])
    return server
