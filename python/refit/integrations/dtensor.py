"""Publisher for FSDP2 / DTensor trainers (verl, OpenRLHF, TRL, prime-rl, SkyRL): each parameter's
own placements and device mesh say which box of the checkpoint tensor this rank holds, so every
rank offers its local shard where it lies. Nothing is gathered to rank 0; the planner picks one
owner per replica.

The box follows torch's DTensor chunking rule (torch/distributed/tensor/placement_types.py,
Shard._local_shard_size_and_offset, applied mesh dimension by mesh dimension as
torch/distributed/tensor/_utils.py compute_local_shape_and_global_offset does): a dimension of size
n split over k ranks gives each ceil(n / k) elements, the last ones fewer or none.

- `Shard(d)`: this rank's chunk along d (uneven last chunk included; an empty chunk offers nothing).
- `Replicate()`: the whole extent; every rank of that mesh dimension offers the same box.
- Several mesh dimensions (HSDP's (Replicate, Shard(0)), a TP x FSDP mesh, the same dimension
  sharded twice) nest in mesh order, as torch does.
- Refused, with the parameter's name: `Partial` (a pending reduction: the local values are not the
  tensor's), `_StridedShard` (FSDP2 over tensor parallelism's shards: its interleaved chunks are not
  one box per rank, which this publisher does not describe).

vLLM's trainer-side `ModuleSource` (vllm/distributed/weight_transfer: `metadata()` lists each
parameter's name, dtype and global shape; iterating it all-gathers) is accepted by
`DTensorPublisher.from_weight_source`: its module is published shard by shard and its metadata
checked against the offers, without importing vLLM.

Placements are read by duck typing (the class name and `dim`, or torch's is_shard / is_replicate /
is_partial), so any parameter metadata shaped like a DTensor's works: torch's DTensor, or an
object with `placements`, a global `shape`, the mesh's `mesh_shape` and this rank's `coordinate`,
and the local tensor as `local_tensor` (a trainer's own shard records, for instance).
Names are the module's own (the Hugging Face names, for a transformers model) without wrapper
prefixes (`_orig_mod.`, `_checkpoint_wrapped_module.`, `module.`); `rename` maps them further.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from .._lib import invalid_argument
from ..plan import Table
from .layout import new_table
from .offers import Offer, Rename, Shape, add_offers, check_unique, renamed

Placement = Tuple[str, int]  # ("shard", dim) or ("replicate", -1)


def chunk(size: int, parts: int, index: int) -> Tuple[int, int]:
    """(offset, length) of chunk `index` when `size` elements split into `parts` chunks by torch's
    rule: ceil(size / parts) each, the last ones shorter or empty (an empty chunk sits at `size`)."""
    if parts <= 0 or not 0 <= index < parts:
        raise invalid_argument(f"chunk {index} of {parts} does not exist")
    full = -(-size // parts)
    start = full * index
    if start >= size:
        return size, 0
    return start, min(size, start + full) - start


def placement_kind(placement: Any, name: str) -> Placement:
    """("shard", dim) or ("replicate", -1) for a torch (or torch-shaped) placement; refuses the
    placements no box describes."""
    kind = type(placement).__name__
    if kind == "_StridedShard" or hasattr(placement, "split_factor"):
        raise invalid_argument(
            f"{name}: placement {placement!r} (_StridedShard, FSDP2 over tensor-parallel shards) holds interleaved "
            "chunks, not one box; not supported: publish the tensor-parallel layout, or unshard first"
        )
    if kind == "Partial" or _asks(placement, "is_partial"):
        raise invalid_argument(f"{name}: placement {placement!r} is a pending reduction; reduce it before a refit")
    if kind == "Replicate" or _asks(placement, "is_replicate"):
        return ("replicate", -1)
    if (kind == "Shard" or _asks(placement, "is_shard")) and hasattr(placement, "dim"):
        return ("shard", int(placement.dim))
    raise invalid_argument(f"{name}: placement {placement!r} is none of Shard(d), Replicate()")


def _asks(placement: Any, method: str) -> bool:
    probe = getattr(placement, method, None)
    if not callable(probe):
        return False
    try:
        return bool(probe())
    except TypeError:
        return False


def shard_box(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any], name: str = "tensor"
) -> Tuple[Shape, Shape]:
    """(offset, extent) of the box of a tensor of global `shape` that the rank at `coordinate` of a
    mesh of `mesh_shape` holds under `placements` (one per mesh dimension)."""
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise invalid_argument(
            f"{name}: {len(placements)} placements for a mesh of shape {list(mesh_shape)} at coordinate {list(coordinate)}"
        )
    offset = [0] * len(shape)
    extent = [int(n) for n in shape]
    for size, at, placement in zip(mesh_shape, coordinate, placements):
        kind, dim = placement_kind(placement, name)
        if kind == "replicate":
            continue
        if dim < 0:
            dim += len(shape)
        if not 0 <= dim < len(shape):
            raise invalid_argument(f"{name}: Shard({placement.dim}) of a {len(shape)}-dimensional tensor")
        start, length = chunk(extent[dim], int(size), int(at))
        offset[dim] += start
        extent[dim] = length
    return tuple(offset), tuple(extent)


def dtensor_offer(name: str, tensor: Any) -> Optional[Offer]:
    """The offer of one parameter under checkpoint name `name`: a DTensor's (or DTensor-shaped
    metadata's) local box, or a plain tensor whole. None when this rank is outside the mesh."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return Offer(name, _shape(tensor.shape), (0,) * len(tensor.shape), tensor)
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is not None:
        coordinate = mesh.get_coordinate()
        mesh_shape = tuple(mesh.shape)
    else:
        coordinate = getattr(tensor, "coordinate", None)
        mesh_shape = tuple(getattr(tensor, "mesh_shape", ()))
    if coordinate is None:
        return None
    _check_shard_order(name, tensor)
    local = tensor.to_local() if hasattr(tensor, "to_local") else getattr(tensor, "local_tensor")
    shape = _shape(getattr(tensor, "global_shape", None) or tensor.shape)
    offset, extent = shard_box(shape, mesh_shape, coordinate, placements, name)
    if _shape(local.shape) != extent:
        raise invalid_argument(
            f"{name}: the local tensor has shape {list(local.shape)}; placements {list(placements)} over mesh "
            f"{list(mesh_shape)} at {list(coordinate)} give {list(extent)}"
        )
    return Offer(name, shape, offset, local)


def _check_shard_order(name: str, tensor: Any) -> None:
    """Refuses a DTensor whose spec shards one dimension over several mesh dimensions in an order
    other than the mesh's (torch's shard_order): its chunks do not nest in mesh order."""
    order = getattr(getattr(tensor, "_spec", None), "shard_order", None)
    for entry in order or ():
        dims = list(getattr(entry, "mesh_dims", ()))
        if dims != sorted(dims):
            raise invalid_argument(f"{name}: tensor dimension {entry.tensor_dim} is sharded over mesh dimensions {dims} out of mesh order; not supported")


def named_tensors(source: Any) -> Iterable[Tuple[str, Any]]:
    """(name, tensor) pairs of a module (its state dict, parameters kept as they are), a mapping,
    or an iterable of pairs (named_parameters())."""
    if hasattr(source, "state_dict") and callable(source.state_dict):
        return source.state_dict(keep_vars=True).items()
    if isinstance(source, Mapping):
        return source.items()
    return source


def module_offers(source: Any, rename: Rename = None, what: str = "publisher") -> List[Offer]:
    """Every tensor of `source` (see named_tensors) as offers; non-tensor state entries (extra
    state) are skipped."""
    offers: List[Offer] = []
    for name, tensor in named_tensors(source):
        if not hasattr(tensor, "shape") or not (hasattr(tensor, "data_ptr") or hasattr(tensor, "placements")):
            continue
        checkpoint_name = renamed(name, rename)
        if checkpoint_name is None:
            continue
        offer = dtensor_offer(checkpoint_name, tensor)
        if offer is not None:
            offers.append(offer)
    check_unique(_distinct_storage(offers), what)
    return offers


def _distinct_storage(offers: List[Offer]) -> List[Offer]:
    """The offers without repeats of one tensor under one name (a tied weight listed twice)."""
    seen, out = set(), []
    for offer in offers:
        key = (offer.name, offer.offset, id(offer.local))
        if key not in seen:
            seen.add(key)
            out.append(offer)
    return out


def _shape(shape: Sequence[int]) -> Shape:
    return tuple(int(n) for n in shape)


_SOURCE_MODULE_ATTRIBUTES = ("module", "_module", "model", "_model")


def weight_source_offers(source: Any, rename: Rename = None) -> List[Offer]:
    """Offers of a vLLM trainer-side weight source (duck-typed, vLLM need not be installed): a
    `ModuleSource` wraps a module, whose parameters are published where they lie (its own iteration
    would all-gather every DTensor with full_tensor()); its `metadata()` (name, dtype, global shape
    per parameter) must agree with what is offered, name for name. A source without a module can
    only materialize whole tensors by a collective, which a refit does not need: refused."""
    module = next((getattr(source, a) for a in _SOURCE_MODULE_ATTRIBUTES if hasattr(getattr(source, a, None), "named_parameters")), None)
    if module is None:
        raise invalid_argument(
            f"{type(source).__name__} exposes no module; its iteration gathers whole tensors. "
            "Publish the module itself (DTensorPublisher(module)) or its named parameters"
        )
    offers = module_offers(module.named_parameters(), rename, "weight source")
    metadata = source.metadata() if callable(getattr(source, "metadata", None)) else []
    declared = {renamed(str(m.name), rename): _shape(m.shape) for m in metadata}
    offered = {offer.name: offer.shape for offer in offers}
    if metadata and declared != offered:
        differ = sorted(n for n in set(declared) | set(offered) if declared.get(n) != offered.get(n))
        raise invalid_argument(f"the source's metadata() and its module disagree on {len(differ)} parameters, e.g. {differ[:3]}")
    return offers


class DTensorPublisher:
    """Offers one rank's parameters of an FSDP2 / DTensor model (plain tensors in it are offered
    whole): `DTensorPublisher(model).table(process)` is this rank's Table for Plan.build.
    `source`: a module, a mapping of names to tensors, or (name, tensor) pairs."""

    def __init__(self, source: Any, rename: Rename = None) -> None:
        self.offers = module_offers(source, rename, "DTensor publisher")

    @classmethod
    def from_weight_source(cls, source: Any, rename: Rename = None) -> DTensorPublisher:
        """From vLLM's trainer-side `ModuleSource` (see weight_source_offers)."""
        publisher = cls.__new__(cls)
        publisher.offers = weight_source_offers(source, rename)
        return publisher

    def add_to(
        self, table: Table, process: int, device: Optional[int] = None, digests: Optional[Mapping[str, int]] = None
    ) -> int:
        """Adds this rank's offers to `table` (host tensors stand for `device`); returns how many."""
        return add_offers(table, self.offers, process, device, digests)

    def table(self, process: int, device: Optional[int] = None, digests: Optional[Mapping[str, int]] = None) -> Table:
        """A new Table holding this rank's offers."""
        return new_table(lambda table: self.add_to(table, process, device, digests))


__all__ = ["DTensorPublisher", "chunk", "dtensor_offer", "module_offers", "shard_box", "weight_source_offers"]
