"""Communicators between processes on the host backend (spawned Python processes; CI has no GPU):
allgather uneven and in place, byte-exact against blocks every process computes for every rank;
plans built across processes are each process's share of the plan built from all tables in one
process; a peer that
never takes part times the others out; ranks that pass other counts are refused on every rank,
naming the rank, and the communicator stays usable; an id with any byte changed, a rank taken while
the communicator lives and a spent id are refused at once; and the binding's and the library's
bad-argument errors."""

import ctypes
import multiprocessing
import time
import traceback
import unittest

from refit import Backend, Commit, Communicator, Group, Plan, Policy, RefitError, Status, Table, unique_id

POISON = 0xEE


def block(rank, count):
    return bytes((rank * 89 + i * 7 + (i >> 8)) % 256 for i in range(count))


def table_of(rank):
    """Ranks 0 and 1 publish replicas of "w" (4 x 8, 4-byte elements); rank 2 receives its column
    halves. Addresses are numbers only: planning reads no memory."""
    table = Table()
    w = table.add_tensor("w", (4, 8), 4, dtype=1)
    if rank < 2:
        table.add_offer(w, rank, 0, 0x100000 * (rank + 1), (0, 0), (4, 8))
    if rank == 2:
        for half in range(2):
            table.add_need(w, 2, 0, 0x900000 + 64 * half, (0, 4 * half), (4, 4), (4, 1))
    return table


def run_rank(scenario, comm_ids, rank, size, errors):
    """One process's part, given two fresh ids (an id forms one communicator); failures go to
    `errors` (the parent fails the test with them)."""
    try:
        SCENARIOS[scenario](comm_ids, rank, size)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def gather(comm_ids, rank, size):
    with Communicator(comm_ids[0], size, rank, timeout_ms=30_000) as comm:
        assert (comm.rank, comm.size, comm.backend) == (rank, size, Backend.HOST)
        counts = [3, 0, 200_001]
        total, offset = sum(counts), sum(counts[:rank])
        mine = block(rank, counts[rank])
        expected = b"".join(block(p, c) for p, c in enumerate(counts))
        for in_place in (False, True):
            recv = (ctypes.c_uint8 * total)(*([POISON] * total))
            send_buffer = (ctypes.c_uint8 * max(len(mine), 1)).from_buffer_copy(mine.ljust(1, b"\0"))
            send = ctypes.addressof(send_buffer)
            if in_place:
                ctypes.memmove(ctypes.addressof(recv) + offset, mine, len(mine))
                send = ctypes.addressof(recv) + offset
            comm.allgather(send, ctypes.addressof(recv), counts)
            comm.synchronize()
            assert bytes(recv) == expected, f"in place {in_place}: wrong bytes"


def plan_across(comm_ids, rank, size):
    with Communicator(comm_ids[0], size, rank, timeout_ms=30_000) as comm:
        tables = [table_of(r) for r in range(size)]
        for policy in (Policy.FIRST, Policy.BALANCED):
            with comm.build_plan(tables[rank], policy=policy) as across, Plan.build(tables, policy=policy) as whole:
                share = [r for r in whole.routes() if rank in (r.src_rank, r.dst_rank)]
                assert across.routes() == share, (across.routes(), share)
        try:
            comm.build_plan(tables[rank], coalesce=rank != 1)
        except RefitError as err:
            assert err.status == Status.INVALID_ARGUMENT, err
            assert "different plan options" in err.message, err
        else:
            raise AssertionError("ranks with other options built a plan")
        # Rank 1 passes rank 0's table, whose entries name process 0: every rank refuses it alike.
        try:
            comm.build_plan(tables[0 if rank == 1 else rank])
        except RefitError as err:
            assert err.status == Status.INVALID_ARGUMENT, err
            assert "rank 1's table has" in err.message and "on process 0" in err.message, err
        else:
            raise AssertionError("a table naming another process was planned")


def silent_peer(comm_ids, rank, size):
    with Communicator(comm_ids[0], size, rank, timeout_ms=500) as comm:
        if rank == 1:
            time.sleep(1.5)  # joined, but never takes part
            return
        started = time.monotonic()
        try:
            comm.build_plan(table_of(rank))
        except RefitError as err:
            assert err.status in (Status.TIMEOUT, Status.ABORTED), err
        else:
            raise AssertionError("a plan was built without rank 1")
        assert time.monotonic() - started < 1.4


def executor_across(comm_ids, rank, size):
    """Ranks 0 and 1 hold replicas of "w" (4 x 8 float32), rank 2 receives its column halves: the
    executor across the processes moves them, with and without IPC, direct and staged; rank 2
    checks every element against values computed here (staged: nothing live before the commit).
    Through staging, processes that ask for verify differently are refused first."""
    weight = (ctypes.c_float * 32)(*[float(r * 100 + c + 1) for r in range(4) for c in range(8)])
    want = [[float(r * 100 + 4 * half + c + 1) for r in range(4) for c in range(4)] for half in range(2)]
    halves = [(ctypes.c_float * 16)() for _ in range(2)]
    table = Table()
    w = table.add_tensor("w", (4, 8), 4, dtype=1)
    if rank < 2:
        table.add_offer(w, rank, 0, ctypes.addressof(weight), (0, 0), (4, 8))
    if rank == 2:
        for half in range(2):
            table.add_need(w, 2, 0, ctypes.addressof(halves[half]), (0, 4 * half), (4, 4), (4, 1))
    group = Group([0], backend=Backend.HOST)
    for comm_id, ipc in zip(comm_ids, (True, False)):
        with Communicator(comm_id, size, rank, timeout_ms=30_000, ipc=ipc) as comm:
            share = comm.build_plan(table)
            if not ipc:
                # Through staging, processes that ask for verify differently are refused on every rank.
                try:
                    share.executor(group, rank, verify=rank != 2, comm=comm)
                except RefitError as err:
                    assert err.status == Status.INVALID_ARGUMENT, err
                    assert "verify on in processes 0 and off in processes 2" in err.message, err
                else:
                    raise AssertionError("an executor although the processes ask for verify differently")
            for commit in (Commit.DIRECT, Commit.STAGED):
                with share.executor(group, rank, commit=commit, verify=commit == Commit.STAGED, comm=comm) as ex:
                    for half in halves:
                        ctypes.memset(half, 0xEE, ctypes.sizeof(half))
                    stats = ex.run()
                    assert stats.remote_received_bytes == (128 if rank == 2 else 0), stats
                    assert (stats.remote_ipc_bytes > 0) == (ipc and rank < 2 and stats.bytes[2] > 0), stats
                    comm.build_plan(table).close()  # every rank has run
                    if commit == Commit.STAGED:
                        if rank == 2:
                            assert bytes(halves[0]) == b"\xee" * 64, "live bytes before the commit"
                        ex.commit()
                    if rank == 2:
                        assert [list(h) for h in halves] == want, (ipc, commit, [list(h) for h in halves])
                    comm.build_plan(table).close()  # every rank is done with the executor
            share.close()
        comm.close()
    group.close()


def other_counts(comm_ids, rank, size):
    """Rank 1 passes other counts: every rank's allgather is refused (at synchronize) naming rank 1,
    nothing moves, and a correct allgather follows on the same communicator (check_counts False:
    the host backend compares counts whatever it says). Then, while it lives, a claim of this rank
    is refused at once; once every rank has closed it, its id is spent."""
    with Communicator(comm_ids[0], size, rank, timeout_ms=30_000, check_counts=False) as comm:
        counts = [4, 7, 2] if rank == 1 else [4, 6, 2]
        send = (ctypes.c_uint8 * 8)()
        recv = (ctypes.c_uint8 * 13)(*([POISON] * 13))
        comm.allgather(ctypes.addressof(send), ctypes.addressof(recv), counts)
        try:
            comm.synchronize()
        except RefitError as err:
            assert err.status == Status.INVALID_ARGUMENT, err
            assert "counts: ranks [1] differ" in err.message, err
        else:
            raise AssertionError("ranks with other counts were not refused")
        assert bytes(recv) == bytes([POISON] * 13), "bytes moved"
        comm.synchronize()  # reported once
        counts = [3, 5, 2]
        mine = block(rank, counts[rank])
        send = (ctypes.c_uint8 * len(mine)).from_buffer_copy(mine)
        recv = (ctypes.c_uint8 * 10)()
        comm.allgather(ctypes.addressof(send), ctypes.addressof(recv), counts)
        comm.synchronize()
        assert bytes(recv) == b"".join(block(p, c) for p, c in enumerate(counts)), "wrong bytes"
        started = time.monotonic()
        try:
            Communicator(comm_ids[0], size, rank, timeout_ms=30_000)
        except RefitError as err:
            # Every rank took part in the allgather, so every rank has registered: the id is spent.
            assert err.status == Status.INVALID_ARGUMENT and "the id is spent" in err.message, err
        else:
            raise AssertionError("a taken rank was joined")
        assert time.monotonic() - started < 5
        comm.build_plan(table_of(rank)).close()  # every rank is done claiming
    # Closed on this rank; others may still be closing, but the id is spent since it formed.
    try:
        Communicator(comm_ids[0], size, rank, timeout_ms=30_000)
    except RefitError as err:
        assert err.status == Status.INVALID_ARGUMENT, err
    else:
        raise AssertionError("a spent id formed a communicator")


SCENARIOS = {
    "other_counts": other_counts,
    "gather": gather,
    "plan_across": plan_across,
    "silent_peer": silent_peer,
    "executor_across": executor_across,
}


class CommunicatorTest(unittest.TestCase):
    def in_processes(self, scenario, size):
        context = multiprocessing.get_context("spawn")
        errors = context.Queue()
        comm_ids = (unique_id(Backend.HOST), unique_id(Backend.HOST))
        processes = [
            context.Process(target=run_rank, args=(scenario, comm_ids, rank, size, errors)) for rank in range(size)
        ]
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
        self.assertEqual([p.exitcode for p in processes], [0] * size)

    def test_allgather_across_processes(self):
        self.in_processes("gather", 3)

    def test_plans_across_processes(self):
        self.in_processes("plan_across", 3)

    def test_an_executor_across_processes(self):
        self.in_processes("executor_across", 3)

    def test_a_silent_peer_times_the_others_out(self):
        self.in_processes("silent_peer", 2)

    def test_ranks_that_pass_other_counts_are_refused_naming_the_rank(self):
        self.in_processes("other_counts", 3)

    def test_an_id_with_any_byte_changed_is_refused_and_an_id_forms_one_communicator(self):
        comm_id = unique_id(Backend.HOST)
        for at in range(len(comm_id)):
            changed = bytearray(comm_id)
            changed[at] ^= 0x01
            with self.assertRaises(RefitError, msg=f"byte {at}") as caught:
                Communicator(bytes(changed), 1, 0, timeout_ms=10_000)
            self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with Communicator(comm_id, 1, 0, timeout_ms=10_000) as comm:
            with self.assertRaises(RefitError) as caught:
                Communicator(comm_id, 1, 0, timeout_ms=10_000)
            self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("the id is spent", caught.exception.message)
            self.assertEqual(comm.size, 1)
        with self.assertRaises(RefitError) as caught:
            Communicator(comm_id, 1, 0, timeout_ms=10_000)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("the id is spent", caught.exception.message)

    def test_bad_arguments(self):
        comm_id = unique_id(Backend.HOST)
        self.assertEqual(len(comm_id), 136)
        self.assertNotEqual(comm_id, unique_id(Backend.HOST))
        with self.assertRaises(RefitError) as caught:
            Communicator(comm_id[:10], 1, 0)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            Communicator(bytes(136), 1, 0)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            Communicator(comm_id, 2, 2)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            Communicator(comm_id, 1, 0, timeout_ms=0)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            unique_id(9)
        self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            Communicator.adopt(0)
        self.assertEqual(caught.exception.status, Status.NULL_ARGUMENT)
        with Communicator(comm_id, 1, 0, device=2) as comm:
            self.assertEqual((comm.rank, comm.size, comm.device), (0, 1, 2))
            buffer = (ctypes.c_uint8 * 8)(*b"abcd\0\0\0\0")
            with self.assertRaises(RefitError) as caught:
                comm.allgather(ctypes.addressof(buffer), ctypes.addressof(buffer) + 4, [4, 4])
            self.assertEqual(caught.exception.status, Status.INVALID_ARGUMENT)
            with self.assertRaises(RefitError) as caught:
                comm.allgather(ctypes.addressof(buffer) + 1, ctypes.addressof(buffer), [4])
            self.assertEqual(caught.exception.status, Status.OVERLAP)
            comm.allgather(ctypes.addressof(buffer), ctypes.addressof(buffer) + 4, [4])
            comm.synchronize()
            self.assertEqual(bytes(buffer), b"abcdabcd")
            comm.abort()
            with self.assertRaises(RefitError) as caught:
                comm.synchronize()
            self.assertEqual(caught.exception.status, Status.ABORTED)
        with self.assertRaises(RefitError) as caught:
            comm.rank
        self.assertEqual(caught.exception.status, Status.INVALID_STATE)


if __name__ == "__main__":
    unittest.main()
