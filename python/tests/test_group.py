"""Groups on the host backend (ranks are threads, device pointers host addresses): creation errors,
queries, ownership, run() and its exceptions, scopes, host streams and allgather, byte-exact."""

import ctypes
import threading
import unittest

import refit
from refit import Algorithm, Backend, ExitMode, Group, HostStream, RefitError, Status
from refit._lib import lib

POISON = 0xAB


def host_group(devices=(0, 1, 2), **options):
    return Group(devices, backend=Backend.HOST, **options)


def block(rank, count):
    """Rank `rank`'s allgather block: bytes that differ between ranks and positions."""
    return bytes((rank * 67 + i * 13 + 1) % 256 for i in range(count))


class Gather:
    """Send and receive buffers of one allgather, poisoned, with the expected result."""

    def __init__(self, counts, in_place=False):
        self.counts = list(counts)
        total = sum(self.counts)
        self.recv = [(ctypes.c_uint8 * max(total, 1))(*([POISON] * max(total, 1))) for _ in self.counts]
        self.expected = b"".join(block(rank, count) for rank, count in enumerate(self.counts))
        offsets = [sum(self.counts[:rank]) for rank in range(len(self.counts))]
        if in_place:
            # Rank r's block already sits at its offset in its receive buffer.
            self.send = None
            self.send_ptrs = []
            for rank, (offset, count) in enumerate(zip(offsets, self.counts)):
                ctypes.memmove(ctypes.addressof(self.recv[rank]) + offset, block(rank, count), count)
                self.send_ptrs.append(ctypes.addressof(self.recv[rank]) + offset)
        else:
            self.send = [
                ctypes.create_string_buffer(block(rank, count), max(count, 1))
                for rank, count in enumerate(self.counts)
            ]
            self.send_ptrs = [ctypes.addressof(buffer) for buffer in self.send]
        self.recv_ptrs = [ctypes.addressof(buffer) for buffer in self.recv]

    def received(self, rank):
        return bytes(self.recv[rank])[: sum(self.counts)]


class GroupCreateTest(unittest.TestCase):
    def assert_create_fails(self, status, devices, text=None, **options):
        with self.assertRaises(RefitError) as caught:
            host_group(devices, **options)
        self.assertIs(caught.exception.status, status)
        if text:
            self.assertIn(text, caught.exception.message)

    def test_each_bad_device_list_has_its_status(self):
        self.assert_create_fails(Status.EMPTY_DEVICE_LIST, [])
        self.assert_create_fails(Status.DUPLICATE_DEVICE, [1, 0, 1])
        self.assert_create_fails(Status.INVALID_DEVICE, [-3], "negative")
        self.assert_create_fails(Status.INVALID_DEVICE, [0, 1, 2], host_devices=2)
        self.assert_create_fails(Status.INVALID_DEVICE, [1 << 40], "32-bit")

    def test_bad_options_are_invalid_arguments(self):
        with self.assertRaises(RefitError) as caught:
            Group([0], backend=7)
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            Group([0], backend=Backend.HOST, host_devices=-1)
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("host_devices", caught.exception.message)


class GroupQueryTest(unittest.TestCase):
    def test_queries(self):
        with host_group((2, 0, 1)) as group:
            self.assertEqual(group.size, 3)
            self.assertEqual(len(group), 3)
            self.assertEqual(group.devices, [2, 0, 1])
            self.assertEqual(group.device(0), 2)
            self.assertIs(group.backend, Backend.HOST)
            streams = [group.stream(rank) for rank in range(3)]
            self.assertEqual(len(set(streams)), 3)
            self.assertNotIn(0, streams)
            self.assertEqual(group.stream(1), streams[1])
            self.assertTrue(group.peer_access(0, 2))
            self.assertIn("HOST", repr(group))
            for call in (lambda: group.device(3), lambda: group.stream(3), lambda: group.peer_access(0, 3)):
                with self.assertRaises(RefitError) as caught:
                    call()
                self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)

    def test_rank_of_is_the_inverse_of_device(self):
        with host_group((2, 0, 1)) as group:
            self.assertEqual([group.rank_of(device) for device in (2, 0, 1)], [0, 1, 2])
            for device in (3, -1, 1 << 31, -(1 << 31) - 1):
                with self.assertRaises(RefitError) as caught:
                    group.rank_of(device)
                self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
                self.assertIn(str(device), caught.exception.message)
            # Absent from the group: the library's message names the device and the group's devices.
            with self.assertRaises(RefitError) as caught:
                group.rank_of(7)
            self.assertIn("device 7", caught.exception.message)
            self.assertIn("[2, 0, 1]", caught.exception.message)
            for bad in (1.0, "1", True, None):
                with self.assertRaises(RefitError) as caught:
                    group.rank_of(bad)
                self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        with self.assertRaises(RefitError) as caught:
            group.rank_of(2)
        self.assertIs(caught.exception.status, Status.INVALID_STATE)

    def test_closed_group_refuses_use_and_closes_once(self):
        group = host_group()
        released = []
        # Counts releases without a reference back to the group (that would delay its collection).
        group._release = lambda pointer: (released.append(pointer), lib.refit_group_destroy(pointer))
        handle = group.handle
        with group:
            pass
        self.assertTrue(group.closed)
        group.close()
        del group
        self.assertEqual(released, [handle])
        group = host_group()
        group.close()
        for call in (lambda: group.size, lambda: group.stream(0), group.enter, lambda: group.run(print)):
            with self.assertRaises(RefitError) as caught:
                call()
            self.assertIs(caught.exception.status, Status.INVALID_STATE)
        self.assertIn("closed", repr(group))


class RunTest(unittest.TestCase):
    def setUp(self):
        self.group = host_group()

    def tearDown(self):
        self.group.close()

    def test_every_rank_runs_once_on_its_own_thread_with_its_stream(self):
        calls = []
        lock = threading.Lock()

        def body(rank, stream):
            with lock:
                calls.append((rank, stream, threading.get_ident()))

        self.group.run(body)
        self.assertEqual(sorted(rank for rank, _, _ in calls), [0, 1, 2])
        for rank, stream, _ in calls:
            self.assertEqual(stream, self.group.stream(rank))
        threads = {thread for _, _, thread in calls}
        self.assertEqual(len(threads), 3)
        self.assertNotIn(threading.get_ident(), threads)

    def gather_in_run(self, gather, fail_rank=None, statuses=None):
        def body(rank, _stream):
            if rank == fail_rank:
                raise ValueError(f"rank {rank} gives up")
            try:
                picked = self.group.allgather_rank(
                    rank, gather.send_ptrs[rank], gather.recv_ptrs[rank], gather.counts
                )
                self.assertIs(picked, Algorithm.PEER)
            except RefitError as error:
                if statuses is not None:
                    statuses[rank] = error.status
                raise

        self.group.run(body)

    def test_allgather_rank_in_run_is_byte_exact(self):
        gather = Gather([5, 9, 13])
        self.gather_in_run(gather)
        for rank in range(3):
            self.assertEqual(gather.received(rank), gather.expected)

    def test_exception_in_one_rank_is_reraised_and_the_group_stays_usable(self):
        statuses = {}
        with self.assertRaises(ValueError) as caught:
            self.gather_in_run(Gather([4, 4, 4]), fail_rank=1, statuses=statuses)
        self.assertEqual(str(caught.exception), "rank 1 gives up")
        cause = caught.exception.__cause__
        self.assertIsInstance(cause, RefitError)
        self.assertIs(cause.status, Status.CALLBACK_FAILED)
        self.assertIn("rank 1", cause.message)
        self.assertEqual(statuses, {0: Status.ABORTED, 2: Status.ABORTED})

        gather = Gather([3, 0, 7])
        self.gather_in_run(gather)
        for rank in range(3):
            self.assertEqual(gather.received(rank), gather.expected)

    def test_ranks_that_disagree_on_counts_all_fail_and_the_group_stays_usable(self):
        gather = Gather([5, 9, 13])
        statuses = {}

        def body(rank, _stream):
            counts = [5, 9, 12] if rank == 0 else gather.counts
            try:
                self.group.allgather_rank(rank, gather.send_ptrs[rank], gather.recv_ptrs[rank], counts)
            except RefitError as error:
                statuses[rank] = error.status
                raise

        with self.assertRaises(RefitError) as caught:
            self.group.run(body)
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("every rank must pass the same", caught.exception.message)
        self.assertEqual(statuses, {rank: Status.INVALID_ARGUMENT for rank in range(3)})

        self.gather_in_run(gather)
        for rank in range(3):
            self.assertEqual(gather.received(rank), gather.expected)

    def test_a_rank_that_returns_without_the_call_its_peers_are_in_releases_them(self):
        gather = Gather([4, 4, 4])
        statuses = {}

        def body(rank, _stream):
            if rank == 1:
                return  # never makes the call ranks 0 and 2 wait in
            try:
                self.group.allgather_rank(rank, gather.send_ptrs[rank], gather.recv_ptrs[rank], gather.counts)
            except RefitError as error:
                statuses[rank] = error.status  # swallowed: every fn returns normally

        with self.assertRaises(RefitError) as caught:
            self.group.run(body)
        self.assertIs(caught.exception.status, Status.ABORTED)
        self.assertIn("rank 1's callback returned", caught.exception.message)
        self.assertEqual(statuses, {0: Status.ABORTED, 2: Status.ABORTED})

        self.gather_in_run(gather)
        for rank in range(3):
            self.assertEqual(gather.received(rank), gather.expected)

    def test_scopes_are_refused_inside_a_rank_callback(self):
        statuses = {}

        def body(rank, _stream):
            for name, call in (("enter", self.group.enter), ("exit", self.group.exit)):
                try:
                    call()
                except RefitError as error:
                    statuses[(rank, name)] = error.status

        self.group.run(body)
        self.assertEqual(statuses, {(r, n): Status.INVALID_STATE for r in range(3) for n in ("enter", "exit")})

    def test_a_refit_error_in_a_rank_names_its_status(self):
        def body(rank, _stream):
            if rank == 2:
                self.group.device(99)

        with self.assertRaises(RefitError) as caught:
            self.group.run(body)
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("REFIT_STATUS_INVALID_ARGUMENT", caught.exception.__cause__.message)

    def test_whole_group_calls_from_a_rank_are_invalid_state(self):
        gather = Gather([1, 1, 1])
        calls = {
            "run": lambda: self.group.run(lambda rank, stream: None),
            "allgather": lambda: self.group.allgather(gather.send_ptrs, gather.recv_ptrs, gather.counts),
            "enter": self.group.enter,
        }
        for name, call in calls.items():
            with self.subTest(call=name):
                with self.assertRaises(RefitError) as caught:
                    self.group.run(lambda rank, stream: call() if rank == 0 else None)
                self.assertIs(caught.exception.status, Status.INVALID_STATE)

    def test_allgather_rank_outside_run_is_invalid_state(self):
        gather = Gather([1, 1, 1])
        with self.assertRaises(RefitError) as caught:
            self.group.allgather_rank(0, gather.send_ptrs[0], gather.recv_ptrs[0], gather.counts)
        self.assertIs(caught.exception.status, Status.INVALID_STATE)


class ScopeTest(unittest.TestCase):
    def setUp(self):
        self.group = host_group()

    def tearDown(self):
        self.group.close()

    def assert_status(self, status, call):
        with self.assertRaises(RefitError) as caught:
            call()
        self.assertIs(caught.exception.status, status)
        return caught.exception

    def test_misuse(self):
        self.assert_status(Status.INVALID_STATE, self.group.exit)
        self.group.enter()
        self.assert_status(Status.INVALID_STATE, self.group.enter)
        self.assert_status(Status.INVALID_ARGUMENT, lambda: self.group.exit(9))
        self.group.exit(ExitMode.ASYNC)
        self.assert_status(Status.INVALID_STATE, lambda: self.group.exit(ExitMode.ASYNC))

    def test_scope_closes_when_its_body_raises(self):
        with self.assertRaises(KeyError):
            with self.group.scope():
                raise KeyError("body")
        with self.group.scope(mode=ExitMode.ASYNC):
            pass
        # Nesting is refused; the outer scope still closes.
        with self.group.scope():
            self.assert_status(Status.INVALID_STATE, lambda: self.group.scope().__enter__())
        self.group.enter()
        self.group.exit()

    def test_caller_streams(self):
        with HostStream() as caller:
            gather = Gather([6, 2, 0])
            with self.group.scope([None, caller, caller.handle]):
                picked = self.group.allgather(gather.send_ptrs, gather.recv_ptrs, gather.counts)
            self.assertIs(picked, Algorithm.PEER)
            for rank in range(3):
                self.assertEqual(gather.received(rank), gather.expected)
            with self.group.scope([caller] * 3, mode=ExitMode.ASYNC):
                pass
        error = self.assert_status(Status.INVALID_ARGUMENT, lambda: self.group.enter([None, None]))
        self.assertIn("3 ranks", error.message)
        self.assert_status(Status.INVALID_ARGUMENT, lambda: self.group.enter([None, 12345, None]))
        self.assert_status(Status.INVALID_ARGUMENT, lambda: self.group.enter([None, "stream", None]))
        self.group.enter()  # the refused enters opened nothing
        self.group.exit()


class HostStreamTest(unittest.TestCase):
    def test_owned_and_released_once(self):
        stream = HostStream()
        handle = stream.handle
        self.assertNotEqual(handle, 0)
        stream.close()
        stream.close()
        self.assertTrue(stream.closed)
        with self.assertRaises(RefitError) as caught:
            stream.handle
        self.assertIs(caught.exception.status, Status.INVALID_STATE)
        # The library refuses a second destroy of the same stream (the binding never makes one).
        with self.assertRaises(RefitError) as caught:
            refit._lib.check(lib.refit_host_stream_destroy(handle))
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)


class AllgatherTest(unittest.TestCase):
    def setUp(self):
        self.group = host_group()

    def tearDown(self):
        self.group.close()

    def assert_gathers(self, counts, algorithm=Algorithm.AUTO, expected_pick=Algorithm.PEER, in_place=False):
        gather = Gather(counts, in_place=in_place)
        picked = self.group.allgather(gather.send_ptrs, gather.recv_ptrs, gather.counts, algorithm)
        self.assertIs(picked, expected_pick)
        for rank in range(len(counts)):
            self.assertEqual(gather.received(rank), gather.expected, f"rank {rank}")
            # Nothing past the gathered bytes is written.
            self.assertTrue(all(b == POISON for b in bytes(gather.recv[rank])[sum(counts):]))

    def test_equal_uneven_and_zero_sizes(self):
        for counts in ([16, 16, 16], [1, 300, 7], [0, 5, 0], [9, 0, 0], [0, 0, 0]):
            for algorithm, pick in (
                (Algorithm.AUTO, Algorithm.PEER),
                (Algorithm.PEER, Algorithm.PEER),
                (Algorithm.HOST, Algorithm.HOST),
            ):
                with self.subTest(counts=counts, algorithm=algorithm.name):
                    self.assert_gathers(counts, algorithm, pick)

    def test_in_place(self):
        for counts in ([8, 8, 8], [3, 0, 11]):
            for algorithm, pick in ((Algorithm.AUTO, Algorithm.PEER), (Algorithm.HOST, Algorithm.HOST)):
                with self.subTest(counts=counts, algorithm=algorithm.name):
                    self.assert_gathers(counts, algorithm, pick, in_place=True)

    def test_single_rank(self):
        with host_group([0]) as one:
            gather = Gather([10])
            self.assertIs(one.allgather(gather.send_ptrs, gather.recv_ptrs, gather.counts), Algorithm.PEER)
            self.assertEqual(gather.received(0), gather.expected)

    def test_bad_arguments(self):
        gather = Gather([4, 4, 4])
        send, recv, counts = gather.send_ptrs, gather.recv_ptrs, gather.counts
        gather_ = self.group.allgather
        cases = {
            "algorithm": (Status.INVALID_ARGUMENT, lambda: gather_(send, recv, counts, 17)),
            "nccl on host": (Status.UNSUPPORTED, lambda: gather_(send, recv, counts, Algorithm.NCCL)),
            "short send": (Status.INVALID_ARGUMENT, lambda: gather_(send[:2], recv, counts)),
            "long recv": (Status.INVALID_ARGUMENT, lambda: gather_(send, recv + [0], counts)),
            "short counts": (Status.INVALID_ARGUMENT, lambda: gather_(send, recv, counts[:1])),
            "negative count": (Status.INVALID_ARGUMENT, lambda: gather_(send, recv, [4, -4, 4])),
            "negative pointer": (Status.INVALID_ARGUMENT, lambda: gather_([-1] + send[1:], recv, counts)),
            "null buffer": (Status.NULL_ARGUMENT, lambda: gather_([0] + send[1:], recv, counts)),
            "overlap": (Status.OVERLAP, lambda: gather_(send, [recv[0], recv[0] + 1, recv[2]], counts)),
        }
        for name, (status, call) in cases.items():
            with self.subTest(case=name):
                with self.assertRaises(RefitError) as caught:
                    call()
                self.assertIs(caught.exception.status, status)
                self.assertNotEqual(caught.exception.message, "")
        self.assertTrue(all(b == POISON for rank in range(3) for b in bytes(gather.recv[rank])))


if __name__ == "__main__":
    unittest.main()
