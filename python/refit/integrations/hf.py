"""Publisher for a plain Hugging Face (or any torch) module on one rank: every tensor of its state
dict is offered whole under the module's own state-dict name (without wrapper prefixes). Tied
weights appear under each of their names, as the state dict lists them; a receiver takes the names
it needs. DTensor parameters are refused here: dtensor.DTensorPublisher describes their shards.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

from .._lib import invalid_argument
from ..plan import Table
from .dtensor import named_tensors
from .layout import new_table
from .offers import Offer, Rename, add_offers, renamed


def whole_offers(source: Any, rename: Rename = None) -> List[Offer]:
    """Each tensor of `source` (a module's state dict, a mapping, or (name, tensor) pairs) whole."""
    offers: List[Offer] = []
    for name, tensor in named_tensors(source):
        if getattr(tensor, "placements", None) is not None:
            raise invalid_argument(f"{name} is a DTensor (placements {list(tensor.placements)}): use DTensorPublisher")
        if not hasattr(tensor, "data_ptr"):
            continue  # extra state, not a tensor
        checkpoint_name = renamed(name, rename)
        if checkpoint_name is not None:
            shape = tuple(int(n) for n in tensor.shape)
            offers.append(Offer(checkpoint_name, shape, (0,) * len(shape), tensor))
    names = [offer.name for offer in offers]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise invalid_argument(f"{len(repeated)} checkpoint names are given to several tensors, e.g. {repeated[:3]}")
    return offers


class HfPublisher:
    """Offers a whole module held by one rank: `HfPublisher(model).table(process)`."""

    def __init__(self, source: Any, rename: Rename = None) -> None:
        self.offers = whole_offers(source, rename)

    def add_to(
        self, table: Table, process: int, device: Optional[int] = None, digests: Optional[Mapping[str, int]] = None
    ) -> int:
        """Adds the offers to `table` (host tensors stand for `device`); returns how many."""
        return add_offers(table, self.offers, process, device, digests)

    def table(self, process: int, device: Optional[int] = None, digests: Optional[Mapping[str, int]] = None) -> Table:
        """A new Table holding the offers."""
        return new_table(lambda table: self.add_to(table, process, device, digests))
