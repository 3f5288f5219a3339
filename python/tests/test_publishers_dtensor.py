"""The DTensor and HF publishers without torch: torch's chunking rule (uneven last shards, empty
shards), placements over 1-D and 2-D meshes given as DTensor-shaped metadata over host tensors, the
refusals, and whole refits of the published shards into whole tensors on the host backend, compared
element by element. The same publishers over real torch DTensors (FSDP2's own sharding, torch's
compute_local_shape_and_global_offset) are tested in frameworks/test_publishers_fsdp.py."""

from __future__ import annotations

import unittest
from typing import Dict, List, Sequence, Tuple

import refit
from hostmodels import HostTensor
from refit.integrations.dtensor import DTensorPublisher, chunk, shard_box
from refit.integrations.hf import HfPublisher
from refit.integrations.offers import unwrap_name
from refit.tensor import add_tensor_need


class Shard:
    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


class Partial:
    pass


class _StridedShard(Shard):
    def __init__(self, dim: int, split_factor: int) -> None:
        super().__init__(dim)
        self.split_factor = split_factor


class ParamMeta:
    """DTensor-shaped metadata: a global shape, placements over a mesh, this rank's coordinate and
    its local tensor."""

    def __init__(self, shape, mesh_shape, coordinate, placements, local) -> None:
        self.shape = tuple(shape)
        self.mesh_shape = tuple(mesh_shape)
        self.coordinate = coordinate
        self.placements = tuple(placements)
        self.local_tensor = local


def values_of(shape: Sequence[int], seed: int) -> List[List[int]]:
    rows, cols = shape
    return [[seed * 1000 + r * cols + c + 1 for c in range(cols)] for r in range(rows)]


def box_values(full: List[List[int]], offset: Tuple[int, int], extent: Tuple[int, int]) -> List[int]:
    return [v for row in full[offset[0] : offset[0] + extent[0]] for v in row[offset[1] : offset[1] + extent[1]]]


def coordinates(mesh_shape: Sequence[int]) -> List[Tuple[int, ...]]:
    out: List[Tuple[int, ...]] = [()]
    for size in mesh_shape:
        out = [c + (i,) for c in out for i in range(size)]
    return out


def refit_whole(publisher_tables, checkpoint: Dict[str, List[List[int]]], devices: int) -> Dict[str, List[int]]:
    """Plans the publishers' tables against one receiver (device `devices`) that needs every
    checkpoint tensor whole, runs it on the host backend, returns what arrived."""
    received = {name: HostTensor((len(m), len(m[0]))) for name, m in checkpoint.items()}
    receiver = refit.Table()
    for name, tensor in received.items():
        add_tensor_need(receiver, name, tensor, 0, device=devices)
    tables = list(publisher_tables) + [receiver]
    with refit.Plan.build(tables) as plan, refit.Group(range(devices + 1), refit.Backend.HOST) as group:
        for route in plan.routes():
            group.copy_batch(route.dst_device, route.segments)
    for table in tables:
        table.close()
    return {name: tensor.values() for name, tensor in received.items()}


class ChunkRuleTest(unittest.TestCase):
    def test_chunks_follow_torch_chunk_sizes_with_uneven_and_empty_last_chunks(self):
        self.assertEqual([chunk(10, 4, i) for i in range(4)], [(0, 3), (3, 3), (6, 3), (9, 1)])
        self.assertEqual([chunk(5, 4, i) for i in range(4)], [(0, 2), (2, 2), (4, 1), (5, 0)])
        self.assertEqual([chunk(2, 4, i) for i in range(4)], [(0, 1), (1, 1), (2, 0), (2, 0)])
        self.assertEqual([chunk(8, 2, i) for i in range(2)], [(0, 4), (4, 4)])

    def test_mesh_dimensions_nest_in_mesh_order(self):
        # (Shard(1), Shard(1)) of a 2 x 5 tensor over a 2 x 2 mesh: torch's documented example
        # (compute_local_shape_and_global_offset): columns 0-1, 2, 3, 4.
        boxes = [shard_box((2, 5), (2, 2), c, (Shard(1), Shard(1))) for c in coordinates((2, 2))]
        self.assertEqual(boxes, [((0, 0), (2, 2)), ((0, 2), (2, 1)), ((0, 3), (2, 1)), ((0, 4), (2, 1))])
        # HSDP: replicated over the first mesh dimension, sharded over the second.
        self.assertEqual(shard_box((7, 3), (2, 3), (1, 2), (Replicate(), Shard(0))), ((6, 0), (1, 3)))
        self.assertEqual(shard_box((7, 3), (2, 3), (1, 2), (Shard(-1), Shard(0))), ((6, 2), (1, 1)))

    def test_placements_no_box_describes_are_refused_by_name(self):
        for placement, words in ((Partial(), "pending reduction"), (_StridedShard(0, 2), "_StridedShard"), (object(), "none of")):
            with self.assertRaises(refit.RefitError) as caught:
                shard_box((4, 4), (2,), (0,), (placement,), "layers.0.w")
            self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
            self.assertIn("layers.0.w", str(caught.exception))
            self.assertIn(words, str(caught.exception))
        with self.assertRaises(refit.RefitError):
            shard_box((4, 4), (2, 2), (0,), (Shard(0),), "w")
        with self.assertRaises(refit.RefitError):
            shard_box((4, 4), (2,), (0,), (Shard(2),), "w")


class DTensorPublisherTest(unittest.TestCase):
    def publish(self, mesh_shape, placements: Dict[str, tuple], checkpoint) -> List[refit.Table]:
        """Each rank of the mesh publishes its shards (cut from the checkpoint by shard_box) as a
        table of device = its rank; returns the tables (the tensors kept alive on self)."""
        self.keep = []
        tables = []
        for rank, coordinate in enumerate(coordinates(mesh_shape)):
            params = {}
            for name, full in checkpoint.items():
                shape = (len(full), len(full[0]))
                offset, extent = shard_box(shape, mesh_shape, coordinate, placements[name])
                local = HostTensor(extent, box_values(full, offset, extent))
                params["_orig_mod.model." + name] = ParamMeta(shape, mesh_shape, coordinate, placements[name], local)
            self.keep.append(params)
            tables.append(DTensorPublisher(params, rename=lambda n: n[len("model."):]).table(0, device=rank))
        return tables

    def test_uneven_shards_over_a_one_dimensional_mesh_refit_whole(self):
        checkpoint = {"embed": values_of((10, 3), 1), "norm": values_of((1, 5), 2), "w": values_of((3, 7), 3)}
        placements = {"embed": (Shard(0),), "norm": (Replicate(),), "w": (Shard(1),)}
        got = refit_whole(self.publish((4,), placements, checkpoint), checkpoint, 4)
        for name, full in checkpoint.items():
            self.assertEqual(got[name], [v for row in full for v in row], name)

    def test_two_dimensional_meshes_refit_whole(self):
        checkpoint = {"a": values_of((5, 6), 1), "b": values_of((9, 2), 2), "c": values_of((3, 3), 3)}
        placements = {"a": (Replicate(), Shard(0)), "b": (Shard(0), Shard(0)), "c": (Shard(1), Shard(0))}
        got = refit_whole(self.publish((2, 3), placements, checkpoint), checkpoint, 6)
        for name, full in checkpoint.items():
            self.assertEqual(got[name], [v for row in full for v in row], name)

    def test_a_local_tensor_that_disagrees_with_its_placements_is_refused(self):
        meta = ParamMeta((5, 2), (2,), (1,), (Shard(0),), HostTensor((3, 2)))
        with self.assertRaises(refit.RefitError) as caught:
            DTensorPublisher({"w": meta})
        self.assertIn("give [2, 2]", str(caught.exception))

    def test_a_rank_outside_the_mesh_offers_nothing_and_empty_shards_are_left_out(self):
        outside = ParamMeta((4, 2), (2,), None, (Shard(0),), HostTensor((2, 2)))
        self.assertEqual(DTensorPublisher({"w": outside}).offers, [])
        empty = ParamMeta((2, 2), (4,), (3,), (Shard(0),), HostTensor((0, 2)))
        publisher = DTensorPublisher({"w": empty})
        self.assertEqual(len(publisher.offers), 1)
        with publisher.table(0, device=0) as table:
            self.assertEqual(len(table.encode()) > 0, True)
        with refit.Table() as table:
            self.assertEqual(publisher.add_to(table, 0, device=0), 0)


class Meta:
    """vLLM's trainer-side ParamMeta: name, dtype, global shape."""

    def __init__(self, name, shape) -> None:
        self.name, self.dtype, self.shape = name, "torch.bfloat16", shape


class ModuleSource:
    """vLLM's ModuleSource as far as the publisher reads it: the module it wraps and metadata()."""

    def __init__(self, module, metadata) -> None:
        self.module = module
        self._metadata = metadata

    def metadata(self):
        return self._metadata

    def __iter__(self):
        raise AssertionError("iterating a source all-gathers: the publisher must not")


class Module:
    def __init__(self, params) -> None:
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


class WeightSourceTest(unittest.TestCase):
    def test_a_module_source_is_published_shard_by_shard_and_checked_against_its_metadata(self):
        checkpoint = {"w": values_of((5, 2), 1)}
        tables, keep = [], []
        for rank in range(2):
            offset, extent = shard_box((5, 2), (2,), (rank,), (Shard(0),))
            local = HostTensor(extent, box_values(checkpoint["w"], offset, extent))
            keep.append(local)
            source = ModuleSource(Module({"w": ParamMeta((5, 2), (2,), (rank,), (Shard(0),), local)}), [Meta("w", (5, 2))])
            tables.append(DTensorPublisher.from_weight_source(source).table(0, device=rank))
        got = refit_whole(tables, checkpoint, 2)
        self.assertEqual(got["w"], [v for row in checkpoint["w"] for v in row])

    def test_disagreeing_metadata_and_sources_without_a_module_are_refused(self):
        module = Module({"w": ParamMeta((5, 2), (2,), (0,), (Shard(0),), HostTensor((3, 2)))})
        with self.assertRaises(refit.RefitError) as caught:
            DTensorPublisher.from_weight_source(ModuleSource(module, [Meta("w", (6, 2))]))
        self.assertIn("disagree", str(caught.exception))

        class Exporter:
            def metadata(self):
                return [Meta("w", (5, 2))]

        with self.assertRaises(refit.RefitError) as caught:
            DTensorPublisher.from_weight_source(Exporter())
        self.assertIn("exposes no module", str(caught.exception))


class HfPublisherTest(unittest.TestCase):
    def test_a_whole_module_refits_under_its_own_names(self):
        checkpoint = {"model.embed_tokens.weight": values_of((6, 4), 1), "lm_head.weight": values_of((6, 4), 2)}
        params = {"module." + name: HostTensor((6, 4), [v for row in m for v in row]) for name, m in checkpoint.items()}
        publisher = HfPublisher(params.items())
        self.assertEqual(sorted(o.name for o in publisher.offers), sorted(checkpoint))
        got = refit_whole([publisher.table(0, device=0)], checkpoint, 1)
        for name, full in checkpoint.items():
            self.assertEqual(got[name], [v for row in full for v in row], name)

    def test_dtensors_and_name_collisions_are_refused(self):
        meta = ParamMeta((4, 2), (2,), (0,), (Shard(0),), HostTensor((2, 2)))
        with self.assertRaises(refit.RefitError) as caught:
            HfPublisher({"w": meta})
        self.assertIn("DTensorPublisher", str(caught.exception))
        with self.assertRaises(refit.RefitError) as caught:
            HfPublisher({"module.w": HostTensor((2,)), "w": HostTensor((2,))})
        self.assertIn("several tensors", str(caught.exception))

    def test_wrapper_prefixes_are_dropped_wherever_they_sit(self):
        self.assertEqual(unwrap_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.w"), "model.layers.0.mlp.w")


if __name__ == "__main__":
    unittest.main()
