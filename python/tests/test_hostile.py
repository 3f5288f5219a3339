"""A hostile caller: handles of one type passed as another, handles closed or used from other threads
while a call is using them, copied handle objects, and arguments of the wrong Python type (bools,
floats, strings, None, non-sequences) where ints, sequences or bytes are expected. Each must raise a
RefitError naming the argument, never crash, hang, leak or silently truncate. Calls that used to
crash or hang run in a subprocess, so that this suite survives them and reports which one."""

import ctypes
import gc
import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
import types
import unittest

import refit
from refit import Backend, Communicator, Group, Plan, RefitError, Status, Table, unique_id
from refit._lib import lib, stream_value
from refit.tensor import add_tensor_need, add_tensor_offer

# Shared by every subprocess: two host buffers, a one-route plan between them, and `refused`, which
# prints the status and message a call raised (or "no error").
PRELUDE = """
import copy, ctypes, pickle, threading, time
import refit
from refit import *

source, target = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
SRC, DST = ctypes.addressof(source), ctypes.addressof(target)

def tables():
    offers, needs = Table(), Table()
    offers.add_offer(offers.add_tensor("w", (4,), 4), 0, 0, SRC, (0,), (4,))
    needs.add_need(needs.add_tensor("w", (4,), 4), 0, 1, DST, (0,), (4,), (1,))
    return offers, needs

def refused(call):
    try:
        call()
    except RefitError as error:
        print(error.status.name, error.message)
    except Exception as error:
        print(type(error).__name__, error)
    else:
        print("no error")

def hammer(call, threads=4, seconds=0.1):
    # `call` from several threads at once; returns the statuses they raised other than the refusal.
    statuses, stop = set(), time.monotonic() + seconds
    def loop():
        while time.monotonic() < stop:
            try:
                call()
            except RefitError as error:
                statuses.add(error.status.name)
    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sorted(statuses - {"INVALID_STATE"})
"""


def isolated(test, body, timeout=20):
    """Runs PRELUDE + `body` in a fresh interpreter; its stdout lines, after checking it neither
    crashed nor hung."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired as expired:
        test.fail(f"hung (killed after {timeout} s); output so far:\n{expired.stdout}")
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    test.assertEqual(done.returncode, 0, f"crashed or failed:\n{output}")
    return done.stdout.splitlines()


def host_group(devices=(0, 1)):
    return Group(devices, backend=Backend.HOST)


class FakeTensor:
    """Host memory described as a torch tensor (what refit.tensor reads)."""

    def __init__(self, device_type="cpu", shape=(4,)):
        self.buffer = ctypes.create_string_buffer(64)
        self.shape, self.dtype = shape, "torch.float32"
        self.device = types.SimpleNamespace(type=device_type, index=None)

    def data_ptr(self):
        return ctypes.addressof(self.buffer)

    def element_size(self):
        return 4

    def stride(self):
        return (1,) * len(self.shape)


class HostileTest(unittest.TestCase):
    def assert_invalid(self, call, *fragments, status=Status.INVALID_ARGUMENT):
        with self.assertRaises(RefitError) as caught:
            call()
        self.assertIs(caught.exception.status, status)
        for fragment in fragments:
            self.assertIn(fragment, caught.exception.message)
        return caught.exception


class TypeConfusionTest(HostileTest):
    def test_a_handle_of_another_type_is_refused_not_read_as_this_one(self):
        # Each used to hand the library a pointer to another struct: segfaults, a Rust abort, or
        # (digest) a table read as a group.
        lines = isolated(
            self,
            """
            group, (offers, needs) = Group([0, 1], backend=Backend.HOST), tables()
            plan = Plan.build([offers, needs])
            comm = Communicator(unique_id(Backend.HOST), 1, 0)
            refused(lambda: Plan.build([offers, group]))
            refused(lambda: Plan.build_share([None], 0))
            refused(lambda: plan.executor(offers, 0))
            refused(lambda: Executor(group, group, 0))
            refused(lambda: plan.executor(group, 0, comm=offers))
            refused(lambda: PreparedCopy(offers, 0, []))
            refused(lambda: refit.digest(offers, 0, SRC, 4))
            refused(lambda: comm.build_plan(group))
            """,
        )
        self.assertEqual(
            lines,
            [
                "INVALID_ARGUMENT tables[1] must be a refit table, not a refit group",
                "INVALID_ARGUMENT tables[0] must be a refit table, not None (NoneType)",
                "INVALID_ARGUMENT group must be a refit group, not a refit table",
                "INVALID_ARGUMENT plan must be a refit plan, not a refit group",
                "INVALID_ARGUMENT comm must be a refit communicator, not a refit table",
                "INVALID_ARGUMENT group must be a refit group, not a refit table",
                "INVALID_ARGUMENT group must be a refit group, not a refit table",
                "INVALID_ARGUMENT table must be a refit table, not a refit group",
            ],
        )

    def test_handles_cannot_be_copied_or_pickled(self):
        # A copy shared the pointer: two releases, a double free at the latest at exit.
        lines = isolated(
            self,
            """
            for make in (Table, lambda: Group([0], backend=Backend.HOST), HostStream):
                handle = make()
                for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
                    refused(lambda: duplicate(handle))
                handle.close()
            """,
        )
        self.assertEqual(len(lines), 9)
        for line in lines:
            self.assertRegex(line, r"^TypeError a refit (table|group|host stream) owns a library handle")


class ThreadTest(HostileTest):
    def test_closing_a_group_inside_its_run_is_refused(self):
        # Used to hang: the rank thread waited for itself to stop.
        lines = isolated(
            self,
            """
            group = Group([0, 1], backend=Backend.HOST)
            refused(lambda: group.run(lambda rank, stream: group.close()))
            def with_block(rank, stream):
                with group:
                    pass
            refused(lambda: group.run(with_block))
            print(group.closed, group.size)
            """,
        )
        self.assertEqual(len(lines), 3)
        for line in lines[:2]:
            self.assertTrue(line.startswith("INVALID_STATE the group cannot be closed while a call"), line)
        self.assertEqual(lines[2], "False 2")

    def test_another_thread_cannot_close_or_drive_a_group_while_it_runs(self):
        lines = isolated(
            self,
            """
            group = Group([0, 1], backend=Backend.HOST)
            inside, release = threading.Event(), threading.Event()
            def body(rank, stream):
                inside.set()
                release.wait()
            runner = threading.Thread(target=lambda: group.run(body))
            runner.start()
            inside.wait()
            refused(group.close)
            refused(lambda: group.allgather([SRC, SRC], [DST, DST + 8], [4, 4]))
            refused(group.enter)
            print(group.size)  # queries stay allowed
            release.set()
            runner.join()
            group.close()
            print(group.closed)
            """,
        )
        self.assertEqual(len(lines), 5)
        self.assertTrue(lines[0].startswith("INVALID_STATE the group cannot be closed while a call"), lines[0])
        for line in lines[1:3]:
            self.assertTrue(line.startswith("INVALID_STATE the group is in use by a call on another thread"), line)
        self.assertEqual(lines[3:], ["2", "True"])

    def test_closing_while_another_thread_calls_is_refused_or_ends_its_calls(self):
        # Used to free the executor (double free) or the table (segfault) under the other thread.
        lines = isolated(
            self,
            """
            group, (offers, needs) = Group([0, 1], backend=Backend.HOST), tables()
            executor = Plan.build([offers, needs]).executor(group, 0)
            for handle, call in ((executor, executor.run), (offers, lambda: Plan.build([offers, needs]).close())):
                statuses, started = set(), threading.Event()
                def loop():
                    for _ in range(300):
                        started.set()
                        try:
                            call()
                        except RefitError as error:
                            statuses.add(error.status.name)
                            if handle.closed:
                                return
                worker = threading.Thread(target=loop)
                worker.start()
                started.wait()
                # Refused while a call is in progress; succeeds between calls or once the worker is done.
                while not handle.closed:
                    try:
                        handle.close()
                    except RefitError as error:
                        statuses.add(error.status.name)
                    time.sleep(0.0005)
                worker.join()
                print(sorted(statuses - {"INVALID_STATE"}))
            """,
        )
        self.assertEqual(lines, ["[]", "[]"])

    def test_calls_made_one_at_a_time_are_refused_from_a_second_thread(self):
        # Four threads on one table: heap corruption; on one executor or one group's allgather: hangs.
        lines = isolated(
            self,
            """
            table = Table()
            count = iter(range(10**9))
            print(hammer(lambda: table.add_tensor(f"w{next(count)}", (4,), 4)))
            print(Table.decode(table.encode()).encode() == table.encode())
            group, (offers, needs) = Group([0, 1], backend=Backend.HOST), tables()
            executor = Plan.build([offers, needs]).executor(group, 0)
            print(hammer(executor.run))
            print(hammer(lambda: group.allgather([SRC, SRC + 8], [DST, DST + 32], [8, 8])))
            executor.close()
            group.close()
            """,
        )
        self.assertEqual(lines, ["[]", "True", "[]", "[]"])

    def test_last_error_messages_are_per_thread(self):
        failures = []

        def fail_repeatedly(make_error, expected):
            for _ in range(200):
                try:
                    make_error()
                except RefitError as error:
                    if expected not in error.message or expected not in refit.last_error_message():
                        failures.append((expected, error.message, refit.last_error_message()))

        threads = [
            threading.Thread(target=fail_repeatedly, args=(lambda: Table.decode(b"junk"), "not a refit table")),
            threading.Thread(target=fail_repeatedly, args=(lambda: host_group([0, 0]), "appears twice")),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(failures, [])


class WrongTypeTest(HostileTest):
    def test_bools_are_not_integers(self):
        # check_range took True for 1: a device, a rank, an element size or an address of 1.
        with host_group() as group, Table() as table:
            self.assert_invalid(lambda: host_group([0, True]), "devices[1] must be an integer, not True (bool)")
            self.assert_invalid(lambda: group.device(True), "rank must be an integer, not True (bool)")
            self.assert_invalid(lambda: table.add_tensor("w", (4,), True), "elem_size")
            self.assert_invalid(lambda: group.copy_batch(0, [(True, 1, 1)]), "segments[0].src")
            self.assert_invalid(lambda: refit.set_log_callback(None, level=True), "level")
            protocol = types.SimpleNamespace(__cuda_stream__=(0, True))
            self.assert_invalid(lambda: stream_value(protocol), "__cuda_stream__ handle")

    def test_floats_and_strings_are_not_truncated_or_parsed(self):
        # int() made device 0.9 device 0 and "1" device 1; the tensor helpers' offset 0.5 offset 0.
        self.assert_invalid(lambda: host_group([0.9]), "devices[0] must be an integer, not 0.9 (float)")
        self.assert_invalid(lambda: host_group([0, "1"]), "devices[1] must be an integer, not '1' (str)")
        self.assert_invalid(lambda: Communicator(unique_id(Backend.HOST), 1, 0, device=0.5), "device")
        with Table() as table:
            tensor = FakeTensor()
            self.assert_invalid(lambda: add_tensor_offer(table, "w", tensor, 0, offset=(0.5,), device=0), "offset")
            self.assert_invalid(lambda: add_tensor_need(table, "w", tensor, 0, shape=(8.7,), device=0), "shape")
            self.assert_invalid(lambda: add_tensor_offer(table, "w", tensor, 0, device=True), "device")

    def test_tensors_neither_on_the_host_nor_on_cuda_are_refused(self):
        with Table() as table:
            self.assert_invalid(
                lambda: add_tensor_offer(table, "w", FakeTensor("meta"), 0, device=0), "neither in host memory"
            )

    def test_what_is_not_a_tensor_or_a_job_is_named(self):
        tensor = FakeTensor()
        with Table() as table, host_group((0,)) as group:
            for call, named in (
                (lambda: add_tensor_offer(table, "w", 5, 0, device=0), "tensor must be a tensor"),
                (lambda: add_tensor_need(table, "w", "x", 0, device=0), "tensor must be a tensor"),
                (lambda: refit.tensor.add_tensor_quantized_need(table, "w", tensor, None, 0, refit.Quantization(),
                                                                device=0), "scales must be a tensor"),
                (lambda: refit.tensor_job([1], tensor, tensor), "source must be a tensor"),
                (lambda: refit.tensor_job(tensor, tensor, tensor, "block"), "quantization must be"),
                (lambda: refit.quantize_batch(group, 0, [None]), "jobs[0] must be a refit.quant.QuantizeJob"),
                (lambda: refit.quantize_batch(group, 0, 7), "jobs must be a sequence"),
            ):
                with self.subTest(named):
                    error = self.assert_invalid(call, named)
                    self.assertIsInstance(error, TypeError)

    def test_non_sequences_are_named(self):
        with host_group() as group, Table() as table:
            w = table.add_tensor("w", (4,), 4)
            address = ctypes.addressof(ctypes.create_string_buffer(16))
            self.assert_invalid(lambda: host_group(0), "devices must be a sequence, not 0 (int)")
            self.assert_invalid(lambda: table.add_tensor("v", 4, 4), "shape must be a sequence, not 4 (int)")
            self.assert_invalid(lambda: table.add_offer(w, 0, 0, address, None, (4,)), "offset must be a sequence")
            self.assert_invalid(lambda: table.add_offer(w, 0, 0, address, (0,), (4,), 5), "strides must be a")
            self.assert_invalid(lambda: table.add_need(w, 0, 0, address, (0,), (4,), None), "strides must be a")
            self.assert_invalid(lambda: group.allgather([1, 1], [1, 1], None), "counts must be a sequence")
            self.assert_invalid(lambda: group.enter(0), "caller_streams must be a sequence")
            self.assert_invalid(lambda: group.copy_batch(0, None), "segments must be a sequence")
            self.assert_invalid(lambda: group.copy_batch(0, [(1, 2)]), "segments[0] must be a Segment")
            self.assert_invalid(lambda: Plan.build(None), "tables must be a sequence")

    def test_names_ids_and_encodings_must_be_strings_or_bytes(self):
        # bytes(0) was an empty name, bytes([104, 105]) the name "hi", bytes(5) five NULs to decode.
        with Table() as table:
            for name in (0, [104, 105], None):
                self.assert_invalid(lambda: table.add_tensor(name, (4,), 4), "name must be a str or bytes")
            self.assertEqual(table.add_tensor(bytearray(b"w"), (4,), 4), table.add_tensor("w", (4,), 4))
        for data in (5, None, "text"):
            self.assert_invalid(lambda: Table.decode(data), "data must be bytes-like")
        self.assert_invalid(lambda: Communicator(136, 1, 0), "comm_id must be bytes-like")

    def test_callables_are_checked_when_given(self):
        # A non-callable log sink failed on every record, on whatever thread logged it.
        self.assert_invalid(lambda: refit.set_log_callback(5), "callback must be callable")
        with host_group() as group:
            self.assert_invalid(lambda: group.run(None), "fn must be callable")


class LifetimeTest(HostileTest):
    def test_init_called_again_releases_the_handle_it_replaces(self):
        table = Table()
        released = []
        table._release = lambda pointer: (released.append(pointer), lib.refit_table_destroy(pointer))
        first = table.handle
        table.__init__()
        self.assertEqual(released, [first])
        second = table.handle
        del table
        gc.collect()
        self.assertEqual(released, [first, second])

    def test_rank_stream_refuses_a_host_group(self):
        # torch would take the host backend's queue handle for a CUstream.
        saved = {name: sys.modules.get(name) for name in ("torch", "refit.torch")}
        attribute = getattr(refit, "torch", None)
        try:
            if importlib.util.find_spec("torch") is None:
                sys.modules["torch"] = types.ModuleType("torch")
            sys.modules.pop("refit.torch", None)
            rt = importlib.import_module("refit.torch")
            with host_group() as group:
                self.assert_invalid(lambda: rt.rank_stream(group, 0), "needs a CUDA group")
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
            if attribute is None:
                vars(refit).pop("torch", None)
            else:
                refit.torch = attribute


if __name__ == "__main__":
    unittest.main()


class ForeignMemoryTest(HostileTest):
    """Addresses that are no memory of the caller on the host backend (unmapped since, a guard page,
    read-only memory written): each call that would read or write them raises INVALID_ARGUMENT
    naming the argument, in a subprocess so that a fault is reported as one."""

    def test_unmapped_guard_and_read_only_memory_are_refused(self):
        lines = isolated(
            self,
            """
            import mmap
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            page = mmap.PAGESIZE
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            base = libc.mmap(None, 3 * page, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
            guard, read_only = base + page, base + 2 * page
            assert libc.mprotect(guard, page, 0) == 0
            assert libc.mprotect(read_only, page, mmap.PROT_READ) == 0
            gone = libc.mmap(None, page, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
            assert libc.munmap(gone, page) == 0

            group = Group([0], backend=Backend.HOST)
            def plan(src, dst):
                table = Table()
                w = table.add_tensor("w", (16,), 1)
                table.add_offer(w, 0, 0, src, (0,), (16,))
                table.add_need(w, 0, 0, dst, (0,), (16,), (1,))
                return Plan.build([table])
            with Communicator(unique_id(Backend.HOST), 1, 0, 0) as comm:
                calls = [
                    lambda: group.copy_batch(0, [(gone, DST, 16)]),
                    lambda: group.copy_batch(0, [(guard - 8, DST, 16)]),
                    lambda: group.copy_batch(0, [(SRC, read_only, 16)]),
                    lambda: group.prepare_copy(0, [(SRC, guard, 16)]),
                    lambda: group.digest(0, gone, 8),
                    lambda: group.digest_many(0, [(SRC, 8), (guard, 8)]),
                    lambda: group.allgather([gone], [DST], [16]),
                    lambda: group.allgather([SRC], [read_only], [16]),
                    lambda: comm.allgather(SRC, guard, [16]),
                    lambda: plan(gone, DST).executor(group, 0),
                    lambda: plan(SRC, read_only).executor(group, 0),
                ]
                for call in calls:
                    refused(call)
                # Read-only memory may be read.
                group.copy_batch(0, [(read_only, DST, 16)])
                print("read", group.digest(0, read_only, 8) == group.digest(0, DST, 8))
            """,
        )
        expected = [
            "segment 0: its source", "segment 0: its source", "segment 0: its destination",
            "segment 0: its destination", "the range", "range 1", "send[0]", "recv[0]", "recv[0]",
            "its source", "its destination",
        ]
        self.assertEqual(len(lines), len(expected) + 1, lines)
        whys = ("is not mapped", "without read permission", "read-only")
        for line, fragment in zip(lines, expected):
            self.assertTrue(line.startswith("INVALID_ARGUMENT "), line)
            self.assertIn(fragment, line)
            self.assertTrue(any(why in line for why in whys), line)
        self.assertEqual(lines[-1], "read True")
