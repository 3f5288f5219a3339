"""What a publisher hands the planner: boxes of checkpoint tensors, each held by a local tensor (a
view into a live parameter, any strides). The publishers (dtensor.py, hf.py, megatron.py's module
publisher) read the trainer's own description of its parameters and produce these; `add_offers`
puts them into a Table. No torch import: the views come from the caller's tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Optional, Sequence, Tuple

from .._lib import invalid_argument
from ..plan import Table
from ..tensor import TensorLike, add_tensor_offer

Shape = Tuple[int, ...]

# Prefixes that wrappers put in front of a module's own names: DDP and Megatron's Float16Module
# (`module.`), torch.compile (`_orig_mod.`), activation checkpointing and FSDP1 wrappers.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclasses.dataclass(frozen=True)
class Offer:
    """The box at `offset` (extent: `local`'s shape) of checkpoint tensor `name`, whose global shape
    is `shape`, held by `local`."""

    name: str
    shape: Shape
    offset: Shape
    local: TensorLike

    @property
    def whole(self) -> bool:
        return tuple(int(n) for n in self.local.shape) == self.shape


def unwrap_name(name: str) -> str:
    """`name` without wrappers' prefixes: leading `module.`s, and `_orig_mod.` / checkpoint and FSDP1
    wrapper names wherever they sit (they wrap inner modules too)."""
    while name.startswith("module."):
        name = name[len("module.") :]
    inner = {prefix[:-1] for prefix in WRAPPER_PREFIXES[1:]}
    return ".".join(part for part in name.split(".") if part not in inner)


def add_offers(
    table: Table,
    offers: Iterable[Offer],
    process: int,
    device: Optional[int] = None,
    digests: Optional[Mapping[str, int]] = None,
) -> int:
    """Adds every offer to `table` as held by `process` (on each tensor's CUDA device, or `device`
    for host memory); returns how many. `digests` (checkpoint name -> digest of the whole tensor's
    bytes) is attached to whole-tensor offers only: the planner compares replicas by it. Empty boxes
    (a rank past the end of an uneven split) are left out."""
    added = 0
    for offer in offers:
        if any(int(n) == 0 for n in offer.local.shape):
            continue
        digest = digests.get(offer.name) if digests and offer.whole else None
        add_tensor_offer(table, offer.name, offer.local, process, offer.shape, offer.offset, device, digest)
        added += 1
    return added


def check_unique(offers: Sequence[Offer], what: str) -> None:
    """Refuses two offers of one checkpoint tensor from one rank that overlap: a naming rule that
    sends two parameters to one name is a bug, not a replica."""
    seen: dict = {}
    for offer in offers:
        box = (offer.offset, tuple(int(n) for n in offer.local.shape))
        for other in seen.get(offer.name, ()):
            if _overlap(box, other):
                raise invalid_argument(f"{what}: two local tensors offer overlapping boxes of {offer.name}: {other} and {box}")
        seen.setdefault(offer.name, []).append(box)


def _overlap(a: Tuple[Shape, Shape], b: Tuple[Shape, Shape]) -> bool:
    return all(ao < bo + be and bo < ao + ae for ao, ae, bo, be in zip(a[0], a[1], b[0], b[1])) and all(
        e > 0 for e in a[1] + b[1]
    )


Rename = Optional[Callable[[str], Optional[str]]]


def renamed(name: str, rename: Rename) -> Optional[str]:
    """The checkpoint name of parameter `name`: unwrapped, then passed through `rename` (which may
    return None to leave the parameter out)."""
    name = unwrap_name(name)
    return rename(name) if rename is not None else name
