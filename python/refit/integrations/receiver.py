"""A receiver's needs from a recording of the engine's own loader (recorder.py), for any engine.

`RecordedReceiver(recording).add_to(table, named_parameters, process, device, staging)` adds one need
per recorded box at the live parameter's address, and, for every checkpoint tensor the recording
staged, one need of the whole tensor into a staging buffer (`staging_buffers` allocates them);
after the refit ran, `load_staged(loader, staging)` hands those buffers to the engine's own loader.
The live parameters must be the ones recorded (names, shapes, strides, dtypes): a model that changed
since (an engine that replaced parameters after loading) is refused, never written blindly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from .._lib import invalid_argument
from ..plan import Table
from ..tensor import TensorLike, device_index, dtype_code, dtype_name
from .layout import new_table, strip_wrappers
from .recorder import Recording

log = logging.getLogger("refit.integrations.receiver")


def _dtype(value: Any) -> str:
    return str(value).rsplit(".", 1)[-1]


class RecordedReceiver:
    """Needs of one engine process, from the recording of its loader."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.layouts = recording.layouts
        self.staged = dict(recording.staged)

    def _params(self, named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]]) -> Dict[str, TensorLike]:
        items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
        live = {strip_wrappers(name): tensor for name, tensor in items}
        recorded = self.recording.params
        only_live = sorted(set(live) - set(recorded))
        only_recorded = sorted(set(recorded) - set(live))
        if only_live or only_recorded:
            raise invalid_argument(
                f"the parameters differ from the recorded ones: {len(only_live)} new (e.g. {only_live[:3]}), "
                f"{len(only_recorded)} gone (e.g. {only_recorded[:3]}); record the loader again"
            )
        changed = []
        for layout in self.layouts:
            tensor, info = live[layout.name], recorded[layout.name]
            shape = tuple(int(n) for n in tensor.shape)
            strides = tuple(int(s) for s in tensor.stride())
            if shape != info.shape or strides != info.strides or dtype_name(tensor) != _dtype(info.dtype):
                changed.append(f"{layout.name} {list(shape)}/{list(strides)}/{dtype_name(tensor)}")
        if changed:
            raise invalid_argument(
                f"{len(changed)} parameters changed shape, strides or dtype since the loader was recorded "
                f"(post-processed after loading?), e.g. {changed[:3]}"
            )
        return live

    def staging_buffers(self, allocate: Callable[[Tuple[int, ...], Any], TensorLike]) -> Dict[str, TensorLike]:
        """A buffer per staged checkpoint tensor: `allocate(shape, dtype)` makes it (e.g.
        `lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)`)."""
        specs = self.recording.checkpoint
        return {name: allocate(specs[name].shape, specs[name].dtype) for name in self.staged}

    def add_to(
        self,
        table: Table,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        staging: Optional[Mapping[str, TensorLike]] = None,
    ) -> int:
        """Adds every recorded box as a need of `process` at the live parameters' addresses, and
        every staged tensor whole into `staging` (required when the recording staged any). Returns
        the number of needs added."""
        live = self._params(named_parameters)
        specs = self.recording.checkpoint
        indices: Dict[str, int] = {}

        def index(name: str, tensor: TensorLike) -> int:
            if name not in indices:
                spec = specs[name]
                indices[name] = table.add_tensor(name, spec.shape, tensor.element_size(), dtype_code(_dtype(spec.dtype)))
            return indices[name]

        added = 0
        for layout in self.layouts:
            tensor = live[layout.name]
            base, es, dev = tensor.data_ptr(), tensor.element_size(), device_index(tensor, device)
            for piece in layout.pieces:
                table.add_need(index(piece.tensor, tensor), process, dev, base + piece.at * es, piece.offset, piece.extent, piece.strides)
                added += 1
        if self.staged:
            missing = sorted(set(self.staged) - set(staging or {}))
            if missing:
                raise invalid_argument(f"{len(missing)} staged checkpoint tensors have no staging buffer, e.g. {missing[:3]}")
            assert staging is not None
            for name in self.staged:
                buffer = staging[name]
                spec = specs[name]
                if tuple(int(n) for n in buffer.shape) != spec.shape or dtype_name(buffer) != _dtype(spec.dtype):
                    raise invalid_argument(f"staging buffer of {name} is {list(buffer.shape)} {dtype_name(buffer)}; the checkpoint has {list(spec.shape)} {_dtype(spec.dtype)}")
                strides = tuple(int(s) for s in buffer.stride())
                table.add_need(index(name, buffer), process, device_index(buffer, device), buffer.data_ptr(), (0,) * len(spec.shape), spec.shape, strides)
                added += 1
        return added

    def table(
        self,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        staging: Optional[Mapping[str, TensorLike]] = None,
    ) -> Table:
        """A new Table holding this process's needs."""
        return new_table(lambda table: self.add_to(table, named_parameters, process, device, staging))

    def load_staged(self, loader: Callable[[Iterable[Tuple[str, Any]]], Any], staging: Mapping[str, Any]) -> int:
        """Runs the engine's own loader on the staged tensors (after the refit wrote them); returns
        how many it was given."""
        if self.staged:
            log.info("refit: the engine's loader takes %d staged tensors (%s)", len(self.staged), ", ".join(sorted(set(self.staged.values()))))
            loader((name, staging[name]) for name in self.staged)
        return len(self.staged)
