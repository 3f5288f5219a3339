"""Every handle type is released exactly once, whichever way it ends: close() (also twice), a `with`
block, or garbage collection alone."""

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import unittest

from refit import Backend, Group, HostStream, Plan, RefitError, Status, Table
from refit._lib import check, lib


def make_table():
    return Table()


def make_plan():
    with Table() as table:
        return Plan.build([table])


def make_prepared_copy():
    source = ctypes.create_string_buffer(8)
    target = ctypes.create_string_buffer(8)
    with Group([0], backend=Backend.HOST) as group:
        return group.prepare_copy(0, [(ctypes.addressof(source), ctypes.addressof(target), 8)])


def make_group():
    return Group([0, 1], backend=Backend.HOST)


# factory -> the C function that really releases what it makes
FACTORIES = {
    "table": (make_table, lambda p: lib.refit_table_destroy(p)),
    "plan": (make_plan, lambda p: lib.refit_plan_destroy(p)),
    "prepared copy": (make_prepared_copy, lambda p: lib.refit_copy_batch_destroy(p)),
    "group": (make_group, lambda p: lib.refit_group_destroy(p)),
    "host stream": (HostStream, lambda p: check(lib.refit_host_stream_destroy(p))),
}


def counted(factory, destroy):
    """A new handle object whose releases are recorded (without a reference back to the object,
    which would keep it from being collected)."""
    obj = factory()
    released = []
    obj._release = lambda pointer: (released.append(pointer), destroy(pointer))
    return obj, obj.handle, released


class HandleTest(unittest.TestCase):
    def test_close_twice_releases_once(self):
        for name, (factory, destroy) in FACTORIES.items():
            with self.subTest(handle=name):
                obj, handle, released = counted(factory, destroy)
                obj.close()
                obj.close()
                del obj
                gc.collect()
                self.assertEqual(released, [handle])

    def test_with_block_releases_once(self):
        for name, (factory, destroy) in FACTORIES.items():
            with self.subTest(handle=name):
                obj, handle, released = counted(factory, destroy)
                with obj as entered:
                    self.assertIs(entered, obj)
                    self.assertEqual(released, [])
                self.assertTrue(obj.closed)
                del obj, entered
                gc.collect()
                self.assertEqual(released, [handle])

    def test_garbage_collection_releases_once(self):
        for name, (factory, destroy) in FACTORIES.items():
            with self.subTest(handle=name):
                obj, handle, released = counted(factory, destroy)
                del obj
                gc.collect()
                self.assertEqual(released, [handle])

    def test_a_closed_handle_is_refused(self):
        for name, (factory, _) in FACTORIES.items():
            with self.subTest(handle=name):
                obj = factory()
                obj.close()
                with self.assertRaises(RefitError) as caught:
                    obj.handle
                self.assertIs(caught.exception.status, Status.INVALID_STATE)
                with self.assertRaises(RefitError):
                    with obj:
                        pass

    def test_a_collection_while_the_bookkeeping_lock_is_held_does_not_wait_for_it(self):
        # The collector runs finalizers at any allocation, also inside _borrow's critical section,
        # whose lock is not reentrant: a finalizer that took it would wait forever (seen on a GPU run
        # of this suite). In a child process, so that a deadlock fails this test, not the suite.
        code = textwrap.dedent("""
            import gc
            from refit._handle import Handle
            released = []

            class Collecting(Handle):
                _what = "test handle"

                def _release(self, pointer):
                    released.append(pointer)

                @property
                def handle(self):
                    gc.collect()  # inside _borrow's critical section
                    return Handle.handle.fget(self)

            garbage = Collecting(1)
            garbage.cycle = garbage  # only the collector frees it
            del garbage
            live = Collecting(2)
            with live._borrow() as pointer:
                assert pointer == 2 and released == [1], released
            live.close()
            assert released == [1, 2], released
            print("released", released)
        """)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
        except subprocess.TimeoutExpired:
            self.fail("a finalizer run inside _borrow waited for the lock its own thread holds")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("released [1, 2]", done.stdout)

    def test_the_library_refuses_released_and_mistyped_handle_values(self):
        # What a ctypes caller that goes around the wrappers gets: a status, never a crash.
        with Table() as table, make_group() as group:
            table_value, group_value = table.handle, group.handle
            size = ctypes.c_size_t(0)
            with self.assertRaises(RefitError) as caught:
                check(lib.refit_group_size(table_value, ctypes.byref(size)))
            self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("group is a refit_table, not a refit_group", str(caught.exception))
            check(lib.refit_group_size(group_value, ctypes.byref(size)))
            self.assertEqual(size.value, 2)
        for released in (table_value, group_value):
            with self.assertRaises(RefitError) as caught:
                check(lib.refit_group_size(released, ctypes.byref(size)))
            self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("not a live refit_group", str(caught.exception))
        # A second release of the same value releases nothing and says so.
        lib.refit_table_destroy(table_value)
        self.assertIn("destroyed already", lib.refit_last_error_message().decode())


if __name__ == "__main__":
    unittest.main()
