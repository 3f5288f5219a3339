"""Executors on the host backend: test_plan's hand-made refit (ranks 0 and 1 each publishing on
device 0 and receiving on device 1) run through Plan.executor, one executor per process rank,
direct and staged, verified, on caller streams, rebound; the received bytes are compared with
ones built element by element in Python (test_plan.Refit). Then every bad argument."""

import ctypes
import os
import unittest

from refit import (Arm, Backend, Commit, Executor, Group, HostStream, Plan, RefitError, RouteKind, RunStats, Status,
                   Table)
from refit.executor import ExecutorInfo
from test_plan import POISON, Refit


class ExecutorTest(unittest.TestCase):
    def setUp(self):
        self.refit = Refit()
        self.group = Group([0, 1], backend=Backend.HOST)
        self.plan = Plan.build(self.refit.tables)

    def tearDown(self):
        self.plan.close()
        self.group.close()
        self.refit.close()

    def receivers(self):
        return self.refit.halves + self.refit.bias_halves + [self.refit.transposed]

    def poison(self):
        for buffer in self.receivers():
            ctypes.memset(buffer.addr, POISON, buffer.size)

    def untouched(self):
        return all(buffer.bytes() == bytes([POISON] * buffer.size) for buffer in self.receivers())

    def assert_received(self):
        for rank in range(2):
            self.assertEqual(self.refit.halves[rank].bytes(), self.refit.expected_half(rank), rank)
            self.assertEqual(self.refit.bias_halves[rank].bytes(), self.refit.expected_bias_half(rank))
        self.assertEqual(self.refit.transposed.bytes(), self.refit.expected_transposed())

    def executors(self, **options):
        return [self.plan.executor(self.group, process, **options) for process in range(2)]

    def test_each_process_runs_its_share_with_every_arm(self):
        for arm in (Arm.AUTO, Arm.KERNEL, Arm.COPY_ENGINE):
            self.poison()
            executors = self.executors(arm=arm, verify=arm == Arm.AUTO)
            for process, executor in enumerate(executors):
                with executor:
                    stats = executor.run()
                    self.assertIsInstance(stats, RunStats)
                    wanted = self.plan.receiver_stats(process, 1).needed_bytes
                    self.assertEqual(stats.bytes_of(RouteKind.PEER), wanted)
                    self.assertEqual(stats.bytes, (0, wanted, 0))
                    self.assertEqual(stats.installed_bytes, wanted)
                    self.assertEqual(stats.arm[RouteKind.LOCAL], Arm.NONE)
                    self.assertEqual(stats.arm[RouteKind.PEER], Arm.COPY_ENGINE if arm == Arm.COPY_ENGINE else Arm.KERNEL)
                    self.assertEqual(stats.verified, arm == Arm.AUTO)
                    self.assertTrue(stats.device_timed and stats.descriptors_reused)
                    self.assertLessEqual(stats.prepare_ns + stats.enqueue_ns + stats.wait_ns, stats.wall_ns)
            self.assert_received()

    def test_a_share_runs_for_its_own_process_only(self):
        self.poison()
        with Plan.build_share(self.refit.tables, 0) as own, own.executor(self.group, 0) as executor:
            executor.run()
        self.assertEqual(self.refit.halves[0].bytes(), self.refit.expected_half(0))
        # Process 1's share lacks process 0's routes: run for process 0, it would move part of them.
        with Plan.build_share(self.refit.tables, 1) as other:
            with self.assertRaises(RefitError) as raised:
                other.executor(self.group, 0)
        self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("process 1's share", raised.exception.message)

    def test_staged_commit_installs_only_on_commit(self):
        executors = self.executors(commit=Commit.STAGED, verify=True)
        self.poison()
        for executor in executors:
            executor.run()
        self.assertTrue(self.untouched())
        for executor in executors:
            stats = executor.commit()
            self.assertTrue(stats.verified)
            self.assertEqual(stats.slices, 0)
        self.assert_received()
        with self.assertRaises(RefitError) as raised:
            executors[0].commit()
        self.assertEqual(raised.exception.status, Status.INVALID_STATE)
        for executor in executors:
            executor.close()

    def test_runs_on_caller_streams_without_waiting(self):
        streams = [HostStream(), HostStream()]
        try:
            executors = self.executors()
            self.poison()
            for executor in executors:
                queued = executor.run(stream=streams)
                self.assertFalse(queued.device_timed)
                done = executor.stats()  # waits for the step
                self.assertTrue(done.device_timed)
                self.assertEqual(done.bytes, queued.bytes)
            self.assert_received()
            with self.assertRaises(RefitError) as raised:
                executors[0].run(stream=streams[0])
            self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("one stream each", raised.exception.message)
            for executor in executors:
                executor.close()
        finally:
            for stream in streams:
                stream.close()

    def test_rebound_receivers_get_the_bytes_at_their_new_place(self):
        apart = Plan.build(self.refit.tables, coalesce=False)
        executor = apart.executor(self.group, 0, verify=True)
        apart.close()  # the executor keeps what it needs
        executor.run()
        old = self.refit.halves[0]
        moved = (ctypes.c_uint8 * old.size)(*([POISON] * old.size))
        executor.rebind(1, old.addr, ctypes.addressof(moved), old.size)
        ctypes.memset(old.addr, POISON, old.size)
        stats = executor.run()
        self.assertFalse(stats.descriptors_reused)
        self.assertEqual(bytes(moved), self.refit.expected_half(0))
        self.assertEqual(old.bytes(), bytes([POISON] * old.size))
        with self.assertRaises(RefitError) as raised:
            executor.rebind(1, ctypes.addressof(moved), old.addr, old.size // 2)
        self.assertEqual(raised.exception.status, Status.PLAN_STALE)
        with self.assertRaises(RefitError) as raised:
            executor.rebind(1, old.addr, ctypes.addressof(moved), old.size)
        self.assertEqual(raised.exception.status, Status.NOT_FOUND)
        executor.close()

    def test_auto_picks_per_run_under_verify_and_under_a_budget(self):
        # A 16 MiB tensor and a 256-byte one from device 0 to device 1: a run long enough for the copy
        # engine between devices beside one for the kernel.
        sizes = {"big": 16 << 20, "small": 256}
        sources = {name: ctypes.create_string_buffer(os.urandom(size), size) for name, size in sizes.items()}
        targets = {name: ctypes.create_string_buffer(size) for name, size in sizes.items()}
        with Table() as table:
            for name, size in sizes.items():
                tensor = table.add_tensor(name, [size // 4], 4)
                table.add_offer(tensor, 0, 0, ctypes.addressof(sources[name]), [0], [size // 4])
                table.add_need(tensor, 0, 1, ctypes.addressof(targets[name]), [0], [size // 4], [1])
            plan = Plan.build([table])
        cases = [(dict(), Arm.SPLIT), (dict(verify=True), Arm.KERNEL), (dict(sm_budget=8), Arm.COPY_ENGINE)]
        with plan:
            for options, arm in cases:
                with self.subTest(options=options):
                    for target in targets.values():
                        ctypes.memset(target, POISON, len(target))
                    with plan.executor(self.group, 0, **options) as executor:
                        self.assertEqual(executor.run().arm[RouteKind.PEER], arm)
                    for name in sizes:
                        self.assertEqual(targets[name].raw, sources[name].raw, name)

    def test_addresses_that_are_no_memory_are_refused_at_create(self):
        received = (ctypes.c_uint32 * 16)()
        table = Table()
        w = table.add_tensor("w", [4, 4], 4)
        # An offer at 0 plans: the planner checks no address. Its segment starts in the first page.
        table.add_offer(w, 0, 0, 0, [0, 0], [4, 4])
        table.add_need(w, 0, 1, ctypes.addressof(received), [1, 0], [3, 4], [4, 1])
        with Plan.build([table]) as at_zero:
            with self.assertRaises(RefitError) as raised:
                at_zero.executor(self.group, 0)
        table.close()
        self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
        for words in ("tensor 'w' box offset [1, 0] extent [3, 4]", "its source [0x10", "first page"):
            self.assertIn(words, raised.exception.message)
        self.assertEqual(bytes(received), bytes(64))

    def test_staging_slices_are_known_at_create_and_can_be_refused(self):
        whole = Executor(self.plan, self.group, 0, commit=Commit.STAGED, single_slice=True)
        info = whole.info()
        self.assertIsInstance(info, ExecutorInfo)
        self.assertEqual(info.slices, 1)
        self.assertGreaterEqual(info.staging_bytes, self.plan.receiver_stats(0, 1).needed_bytes)
        self.assertGreater(info.address_check_ns, 0)
        whole.close()
        direct = Executor(self.plan, self.group, 0)
        self.assertEqual((direct.info().slices, direct.info().staging_bytes), (1, 0))
        direct.close()
        with self.assertRaises(RefitError) as raised:
            Executor(self.plan, self.group, 0, single_slice=True)
        self.assertIn("single_slice", raised.exception.message)
        with self.assertRaises(RefitError) as raised:
            Executor(self.plan, self.group, 0, commit=Commit.STAGED, single_slice="no")
        self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("single_slice='no'", raised.exception.message)

    def test_a_process_the_plan_never_names_is_refused(self):
        with self.assertRaises(RefitError) as raised:
            self.plan.executor(self.group, 7)
        self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("process 7", raised.exception.message)
        self.assertIn("[0, 1]", raised.exception.message)

    def test_a_rebind_that_moves_nothing_is_refused(self):
        executor = self.plan.executor(self.group, 0)
        half = self.refit.halves[0]
        with self.assertRaises(RefitError) as raised:
            executor.rebind(1, half.addr, half.addr, half.size)
        self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("has not moved", raised.exception.message)
        self.poison()
        executor.run()
        self.assertEqual(half.bytes(), self.refit.expected_half(0))
        executor.close()

    def test_bad_arguments_get_their_status(self):
        cases = [
            (dict(arm=9), Status.INVALID_ARGUMENT, "options.arm"),
            (dict(arm=Arm.SPLIT), Status.INVALID_ARGUMENT, "options.arm"),
            (dict(commit=5), Status.INVALID_ARGUMENT, "options.commit"),
            (dict(arm=Arm.COPY_ENGINE, sm_budget=4), Status.INVALID_ARGUMENT, "sm_budget"),
            (dict(staging_limit=1 << 20), Status.INVALID_ARGUMENT, "staged commit only"),
            (dict(commit=Commit.STAGED, staging_limit=10), Status.INVALID_ARGUMENT, "4096"),
            (dict(sm_budget=-1), Status.INVALID_ARGUMENT, "sm_budget"),
            (dict(staging_limit=1 << 64), Status.INVALID_ARGUMENT, "staging_limit"),
        ]
        for options, status, words in cases:
            with self.subTest(options=options):
                with self.assertRaises(RefitError) as raised:
                    self.plan.executor(self.group, 0, **options)
                self.assertEqual(raised.exception.status, status)
                self.assertIn(words, raised.exception.message)
        with self.assertRaises(RefitError) as raised:
            self.plan.executor(self.group, 1 << 32)
        self.assertEqual(raised.exception.status, Status.INVALID_ARGUMENT)
        lonely = Group([0], backend=Backend.HOST, host_devices=2)
        with self.assertRaises(RefitError) as raised:
            self.plan.executor(lonely, 0)
        self.assertEqual(raised.exception.status, Status.NOT_FOUND)
        lonely.close()

        executor = Executor(self.plan, self.group, 0)
        with self.assertRaises(RefitError) as raised:
            executor.commit()
        self.assertEqual(raised.exception.status, Status.INVALID_STATE)
        with self.assertRaises(RefitError) as raised:
            executor.stats()
        self.assertEqual(raised.exception.status, Status.INVALID_STATE)
        for bad in ((5, 1, 2, 3), (0, 1, 2, -3), (0, 1 << 64, 2, 3)):
            with self.assertRaises(RefitError) as raised:
                executor.rebind(*bad)
            self.assertIn(raised.exception.status, (Status.INVALID_DEVICE, Status.INVALID_ARGUMENT))
        executor.close()
        executor.close()  # idempotent
        with self.assertRaises(RefitError) as raised:
            executor.run()
        self.assertEqual(raised.exception.status, Status.INVALID_STATE)
        other = self.plan.executor(self.group, 0)
        self.group.close()
        with self.assertRaises(RefitError) as raised:
            other.run()
        self.assertEqual(raised.exception.status, Status.INVALID_STATE)
        self.assertIn("group is closed", raised.exception.message)
        other.close()


if __name__ == "__main__":
    unittest.main()
