"""refit.integrations.engine_link, the part of the engine backends (vLLM, SGLang) that needs no
framework: three processes on the host backend, a Megatron publisher (MegatronSource through
publisher_table) and two vLLM TP ranks (VllmReceiver needs), each with its own Link.

- The first round plans; a round with the same tables plans nothing; a receiver whose buffers moved
  (as vLLM's sleep / wake moves weights) makes every process plan again, and its new buffers get
  the bytes. Every received element is compared with the vLLM layout written independently
  (hostmodels.vllm_params), after each commit; before it, the receivers' buffers are untouched.
- A staging_memory_limit below what a receiver stages makes every process run directly: the bytes
  are installed by the step, with no commit.
"""

from __future__ import annotations

import multiprocessing
import traceback
import unittest

from hostmodels import POISON, HostTensor, checkpoint, megatron_params, vllm_params
from refit import Backend, unique_id
from refit.integrations import MegatronPublisher, MegatronRanks, ModelShape, VllmRanks, VllmReceiver
from refit.integrations.engine_link import Link, LinkOptions, MegatronSource, publisher_table

MODEL = ModelShape(layers=2, hidden=8, heads=4, kv_heads=2, head_dim=2, vocab=64, ffn=12, name="llama")


class Module:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return list(self.params.items())


def receiver_params(receiver):
    return {layout.name: HostTensor(layout.shape) for layout in receiver.layouts}


def scenario(comm_ids, rank, errors):
    try:
        ckpt = checkpoint(MODEL)
        if rank == 0:
            publisher = MegatronPublisher(MODEL, MegatronRanks())
            values = megatron_params(MODEL, MegatronRanks(), ckpt)
            source = MegatronSource(publisher, Module({layout.name: HostTensor(layout.shape, values[layout.name]) for layout in publisher.layouts}))

            def table():
                return publisher_table(source, source.tensors(), 0, 0)
        else:
            ranks = VllmRanks(tp=2, tp_rank=rank - 1)
            receiver = VllmReceiver(MODEL, ranks)
            expected = vllm_params(MODEL, ranks, ckpt, range(MODEL.layers))
            params = receiver_params(receiver)

            def table():
                return receiver.table(params, rank, 0)

            def check(what):
                for name, tensor in params.items():
                    assert tensor.values() == expected[name], f"rank {rank} {what}: {name}"

        link = Link(comm_ids[0], 3, rank, 0, Backend.HOST, LinkOptions(timeout_ms=30_000))
        replans = []
        for round_ in range(3):
            if round_ == 2 and rank == 2:
                params = receiver_params(receiver)  # the weights moved
            with table() as current:
                replans.append(link.prepare(current))
            link.run()
            if rank:
                assert all(t.values() == [POISON] * t.numel() for t in params.values()) or round_ > 0, "live before commit"
            link.commit()
            if rank:
                check(f"round {round_}")
        assert replans == [True, False, True], replans
        assert link.plans_built == 2 and link.staged
        link.close()

        direct = Link(comm_ids[1], 3, rank, 0, Backend.HOST, LinkOptions(timeout_ms=30_000, staging_memory_limit=1))
        if rank:
            params = receiver_params(receiver)
        with table() as current:
            direct.prepare(current)
        assert not direct.staged, "a receiver's staging exceeds the limit: every process runs directly"
        direct.run()
        if rank:
            check("direct")
        direct.close()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")


class EngineLinkTest(unittest.TestCase):
    def test_plans_once_replans_on_a_move_and_falls_back_to_direct(self):
        context = multiprocessing.get_context("spawn")
        errors = context.Queue()
        comm_ids = (unique_id(Backend.HOST), unique_id(Backend.HOST))
        processes = [context.Process(target=scenario, args=(comm_ids, rank, errors)) for rank in range(3)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
            if process.is_alive():
                process.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        self.assertEqual(failures, [])
        self.assertEqual([p.exitcode for p in processes], [0, 0, 0])


class Placement:
    def __init__(self, kind, dim=-1):
        self.kind, self.dim = kind, dim

    def is_shard(self):
        return self.kind == "shard"

    def is_replicate(self):
        return self.kind == "replicate"

    def is_partial(self):
        return False


class ShardRecord:
    """DTensor-shaped metadata (dtensor.py's duck typing): rank 1 of 2 holds rows 2..3 of a [4, 2]."""

    def __init__(self, local):
        self.local_tensor, self.shape = local, (4, 2)
        self.placements, self.mesh_shape, self.coordinate = (Placement("shard", 0),), (2,), (1,)


class SourcePublisherTest(unittest.TestCase):
    """source_tensors / publisher_table pick the trainer's own publisher, and round_signature says
    whether a round needs new tables."""

    def test_a_mapping_is_published_whole_and_an_unmoved_source_keeps_its_signature(self):
        from refit.integrations.engine_link import round_signature, source_publisher, source_tensors
        from refit.integrations.hf import HfPublisher

        weights = {"a.weight": HostTensor((2, 3)), "b.weight": HostTensor((4,))}
        self.assertIsInstance(source_publisher(weights), HfPublisher)
        first = source_tensors(weights)
        self.assertEqual([(name, offer.offset, offer.shape) for name, offer in first], [("a.weight", (0, 0), (2, 3)), ("b.weight", (0,), (4,))])
        self.assertEqual(round_signature(source_tensors(weights)), round_signature(first))
        weights["b.weight"] = HostTensor((4,))  # moved storage: a new table
        self.assertNotEqual(round_signature(source_tensors(weights)), round_signature(first))
        with publisher_table(weights, source_tensors(weights), 0, 0) as table:
            self.assertGreater(len(table.encode()), 0)

    def test_sharded_parameters_are_offered_where_they_lie(self):
        from refit.integrations.dtensor import DTensorPublisher
        from refit.integrations.engine_link import round_signature, source_publisher, source_tensors

        local = HostTensor((2, 2))
        source = {"w": ShardRecord(local)}
        self.assertIsInstance(source_publisher(source), DTensorPublisher)
        ((name, offer),) = source_tensors(source)
        self.assertEqual((name, offer.shape, offer.offset, offer.local.data_ptr()), ("w", (4, 2), (2, 0), local.data_ptr()))
        self.assertEqual(round_signature([(name, offer)]), [("w", local.data_ptr(), (2, 2), (2, 0), (4, 2))])


if __name__ == "__main__":
    unittest.main()
