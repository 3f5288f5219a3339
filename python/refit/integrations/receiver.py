"""A receiver's needs from a recording of the engine's own loader (recorder.py), for any engine.

`RecordedReceiver(recording).add_to(table, named_parameters, process, device, staging)` adds one need
per recorded box at the live parameter's address, and, for every checkpoint tensor the recording
staged, one need of the whole tensor into a staging buffer (`staging_buffers` allocates them);
after the refit ran, `load_staged(loader, staging)` hands those buffers to the engine's own loader.

Parameters the engine transforms after loading (`reloaded`: parameter -> why) get no boxes: every
checkpoint tensor that lands in one of them is staged whole too (`reload`), and the engine's own
reload path turns those into the live parameters (`reloaded_tensors(staging)` hands them over).
`paths` says, per parameter, which path it takes: "boxes", "loader" or "reload".
The other live parameters must be the ones recorded (names, shapes, strides, dtypes): a model that
changed since is refused, never written blindly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

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

    def __init__(self, recording: Recording, reloaded: Optional[Mapping[str, str]] = None) -> None:
        self.recording = recording
        reloaded = dict(reloaded or {})
        self.reload: Dict[str, str] = {}
        """Checkpoint tensor -> why it goes through the engine's reload path."""
        for layout in recording.layouts:
            if layout.name in reloaded:
                for piece in layout.pieces:
                    self.reload.setdefault(piece.tensor, reloaded[layout.name])
        for name, params in recording.staged_params.items():
            hit = [p for p in params if p in reloaded]
            if hit:
                self.reload.setdefault(name, reloaded[hit[0]])
        self.layouts = [layout for layout in recording.layouts if layout.name not in reloaded]
        self.staged = {name: why for name, why in recording.staged.items() if name not in self.reload}
        self.paths: Dict[str, str] = {layout.name: "boxes" for layout in self.layouts}
        for name in self.staged:
            for param in recording.staged_params.get(name, ()):
                self.paths[param] = "loader"
        for param in reloaded:
            if param in recording.params:
                self.paths[param] = "reload"

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
        # Only parameters written as boxes are checked: those the engine transforms after loading
        # (reloaded) may be reshaped by it, and its reload path writes them.
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
        """A buffer per staged checkpoint tensor (for the loader or the reload path):
        `allocate(shape, dtype)` makes it (e.g. `lambda shape, dtype: torch.empty(shape,
        dtype=dtype, device=device)`)."""
        specs = self.recording.checkpoint
        return {name: allocate(specs[name].shape, specs[name].dtype) for name in self._whole()}

    def _whole(self) -> List[str]:
        """Every checkpoint tensor delivered whole into staging."""
        return list(self.staged) + [name for name in self.reload if name not in self.staged]

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
        whole = self._whole()
        if whole:
            missing = sorted(set(whole) - set(staging or {}))
            if missing:
                raise invalid_argument(f"{len(missing)} staged checkpoint tensors have no staging buffer, e.g. {missing[:3]}")
            assert staging is not None
            for name in whole:
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

    def reloaded_tensors(self, staging: Mapping[str, Any]) -> List[Tuple[str, Any]]:
        """The staged checkpoint tensors of the parameters the engine transforms after loading, for
        the engine's reload path (after the refit wrote them)."""
        return [(name, staging[name]) for name in self.reload]
