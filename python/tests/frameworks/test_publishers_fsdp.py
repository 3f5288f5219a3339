"""The DTensor publisher over real torch DTensors (and the HF publisher over a plain torch module): in one process, each rank of a fake world in turn
(torch's "fake" process group: collectives do nothing, which is all that building a rank's shards
needs), its parameters sharded by torch itself (distribute_tensor with each rank's own data, and
FSDP2's fully_shard, over 1-D and 2-D meshes, uneven last shards included). Every rank's offers are
checked against torch's compute_local_shape_and_global_offset, then planned into whole tensors on
the host backend and compared element by element with the unsharded tensors."""

from __future__ import annotations

import sys
import unittest

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    MISSING = None
except ImportError as error:  # the plain `cargo test` run has no torch
    torch = None
    MISSING = f"torch is not installed ({error})"

import fork_server
import refit
from refit.integrations.dtensor import DTensorPublisher
from refit.integrations.hf import HfPublisher
from refit.tensor import add_tensor_need, add_tensor_offer


def as_rank(rank: int, world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def fsdp_model() -> "torch.nn.Module":
    """Rows that do not split evenly over 2, 3 or 6 ranks (11 embeddings, 5 outputs)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 5), torch.nn.LayerNorm(5))


def fsdp_rank_offers(rank: int, mesh_shape) -> list:
    """Rank `rank`'s offers of fsdp_model() under fully_shard over a mesh of `mesh_shape` (HSDP on a
    2-D mesh): (name, global shape, offset, local shape, local values) each."""
    from torch.distributed.fsdp import fully_shard

    world = 1
    for n in mesh_shape:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = fsdp_model()
        names = ("replicate", "shard")[-len(mesh_shape) :]
        fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
        # Plain values: a tensor would travel back as a shared-memory handle of a process that ends.
        return [(o.name, o.shape, o.offset, tuple(o.local.shape), o.local.detach().flatten().tolist()) for o in DTensorPublisher(model).offers]
    finally:
        dist.destroy_process_group()


def refit_whole(tables, full: dict, device: int) -> dict:
    received = {name: torch.full_like(t, -1.0) for name, t in full.items()}
    receiver = refit.Table()
    for name, tensor in received.items():
        add_tensor_need(receiver, name, tensor, 0, device=device)
    tables = list(tables) + [receiver]
    with refit.Plan.build(tables) as plan, refit.Group(range(device + 1), refit.Backend.HOST) as group:
        for route in plan.routes():
            group.copy_batch(route.dst_device, route.segments)
    for table in tables:
        table.close()
    return received


@unittest.skipIf(MISSING, MISSING or "")
class RealDTensorTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        print(f"\ntorch {torch.__version__}", file=sys.stderr)

    def tearDown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def check_world(self, mesh_shape, placements: dict, full: dict) -> None:
        world = 1
        for n in mesh_shape:
            world *= n
        tables, keep = [], []
        for rank in range(world):
            as_rank(rank, world)
            mesh = init_device_mesh("cpu", mesh_shape)
            params = {name: distribute_tensor(t, mesh, placements[name], src_data_rank=None) for name, t in full.items()}
            publisher = DTensorPublisher(params)
            for offer in publisher.offers:
                local_shape, offset = compute_local_shape_and_global_offset(offer.shape, mesh, placements[offer.name])
                self.assertEqual((tuple(offer.local.shape), offer.offset), (tuple(local_shape), tuple(offset)), (rank, offer.name))
            keep.append(params)
            tables.append(publisher.table(0, device=rank))
        got = refit_whole(tables, full, world)
        for name, tensor in full.items():
            self.assertTrue(torch.equal(got[name], tensor), name)

    def test_uneven_shards_over_a_one_dimensional_mesh(self):
        full = {"embed": torch.arange(30.0).view(10, 3), "norm": torch.arange(5.0) + 100, "w": torch.arange(21.0).view(3, 7) + 200}
        placements = {"embed": [Shard(0)], "norm": [Replicate()], "w": [Shard(1)]}
        self.check_world((4,), placements, full)

    def test_two_dimensional_meshes(self):
        full = {"a": torch.arange(30.0).view(5, 6), "b": torch.arange(18.0).view(9, 2) + 50, "c": torch.arange(9.0).view(3, 3) + 90}
        placements = {"a": [Replicate(), Shard(0)], "b": [Shard(0), Shard(0)], "c": [Shard(1), Shard(0)]}
        self.check_world((2, 3), placements, full)

    def test_fsdp2_fully_shard_with_hsdp_and_uneven_shards(self):
        # One process per rank: FSDP2 interns its DTensor specs, so the ranks of a fake
        # world cannot share one process (a later rank's parameters would carry the first rank's
        # mesh coordinate).
        full = {name: t.detach().clone() for name, t in fsdp_model().state_dict().items()}
        context = fork_server.context(("torch.distributed.fsdp",), fsdp_rank_offers)
        for mesh_shape in ((2, 3),):
            world = 1
            for n in mesh_shape:
                world *= n
            with context.Pool(processes=min(world, 3), maxtasksperchild=1) as pool:
                ranks = pool.starmap_async(fsdp_rank_offers, [(rank, mesh_shape) for rank in range(world)]).get(timeout=300)
            tables, keep = [], []
            for rank, offers in enumerate(ranks):
                self.assertEqual(sorted(name for name, *_ in offers), sorted(full), rank)
                table = refit.Table()
                for name, shape, offset, local_shape, values in offers:
                    local = torch.tensor(values, dtype=torch.float32).view(local_shape)
                    keep.append(local)
                    if local.numel():
                        add_tensor_offer(table, name, local, 0, shape, offset, device=rank)
                tables.append(table)
            got = refit_whole(tables, full, world)
            for name, tensor in full.items():
                self.assertTrue(torch.equal(got[name], tensor), (mesh_shape, name))

    def test_a_plain_module_with_tied_weights_is_published_whole_by_the_hf_publisher(self):
        torch.manual_seed(1)
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(7, 3)
        model.head = torch.nn.Linear(3, 7, bias=False)
        model.head.weight = model.embed.weight  # tied, as tie_word_embeddings does
        model.norm = torch.nn.LayerNorm(3)
        model.register_buffer("scale", torch.arange(4.0))
        full = {name: t.detach().clone() for name, t in model.state_dict().items()}
        self.assertIn("head.weight", full)
        publisher = HfPublisher(model)
        self.assertEqual(sorted(o.name for o in publisher.offers), sorted(full))
        got = refit_whole([publisher.table(0, device=0)], full, 1)
        for name, tensor in full.items():
            self.assertTrue(torch.equal(got[name], tensor), name)

    def test_partial_and_strided_placements_are_refused(self):
        from torch.distributed.tensor import Partial

        as_rank(0, 2)
        mesh = init_device_mesh("cpu", (2,))
        pending = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()], run_check=False)
        with self.assertRaises(refit.RefitError) as caught:
            DTensorPublisher({"w": pending})
        self.assertIn("pending reduction", str(caught.exception))
        from torch.distributed.tensor.placement_types import _StridedShard

        strided = DTensor.from_local(torch.ones(2, 2), mesh, [_StridedShard(0, split_factor=2)], run_check=False, shape=(4, 2), stride=(2, 1))
        with self.assertRaises(refit.RefitError) as caught:
            DTensorPublisher({"w": strided})
        self.assertIn("_StridedShard", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
