"""The binding's argument checks (refit._args), one kind of refusal at a time: flags that are not
bools, integers that are floats, bools, strings or negative, sequences with a bad element, shapes,
device ordinals and enum values. Each refusal is a RefitError (INVALID_ARGUMENT, or INVALID_DEVICE)
that is also a TypeError (wrong type) or ValueError (wrong value), and its message names the argument
(with the element's index), the value given and what is accepted; nothing reaches the library."""

import ctypes
import unittest

import refit
from refit import Backend, Communicator, ExitMode, Group, Plan, RefitError, Status, Table, unique_id
from refit.tensor import add_tensor_offer


class FakeTensor:
    """Host memory shaped like a torch tensor (what refit.tensor reads)."""

    def __init__(self, shape=(4, 6)):
        self.shape = shape
        self.dtype = "float32"
        self.device = type("Device", (), {"type": "cpu"})()
        self._buffer = ctypes.create_string_buffer(4 * 24)

    def data_ptr(self):
        return ctypes.addressof(self._buffer)

    def element_size(self):
        return 4

    def stride(self):
        return (self.shape[1], 1)


class ArgumentTest(unittest.TestCase):
    def setUp(self):
        self.group = Group([0, 1], backend=Backend.HOST)
        self.source, self.target = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
        self.src, self.dst = ctypes.addressof(self.source), ctypes.addressof(self.target)
        self.offers, self.needs = Table(), Table()
        self.offers.add_offer(self.offers.add_tensor("w", (4,), 4), 0, 0, self.src, (0,), (4,))
        self.needs.add_need(self.needs.add_tensor("w", (4,), 4), 0, 1, self.dst, (0,), (4,), (1,))
        self.plan = Plan.build([self.offers, self.needs])

    def tearDown(self):
        for handle in (self.plan, self.offers, self.needs, self.group):
            handle.close()

    def refused(self, call, kind, *fragments, status=Status.INVALID_ARGUMENT):
        """Asserts that `call` raises a RefitError that is also `kind`, with `status`, whose message
        holds every fragment; returns the message."""
        with self.assertRaises(RefitError) as caught:
            call()
        error = caught.exception
        self.assertIsInstance(error, kind, error.message)
        self.assertIsInstance(error, refit.ArgumentTypeError if kind is TypeError else refit.ArgumentError)
        self.assertIs(error.status, status, error.message)
        for fragment in fragments:
            self.assertIn(fragment, error.message)
        return error.message

    def test_flags_take_only_bools(self):
        # verify="no" was taken as True; checked=1, coalesce=None, ipc="yes" likewise as flags.
        for value in ("no", 1, 0, None, 1.0, [True]):
            self.refused(
                lambda: self.plan.executor(self.group, 0, verify=value), TypeError, "verify must be a bool", repr(value)
            )
        segments = [(self.src, self.dst, 8)]
        self.refused(lambda: self.group.copy_batch(0, segments, checked="no"), TypeError, "checked", "'no' (str)")
        self.refused(lambda: self.group.prepare_copy(0, segments, checked=1), TypeError, "checked", "1 (int)")
        self.refused(lambda: Plan.build([self.offers, self.needs], coalesce="yes"), TypeError, "coalesce")
        self.refused(lambda: Plan.build_share([self.offers, self.needs], 0, coalesce=None), TypeError, "coalesce")
        self.refused(lambda: Communicator(unique_id(Backend.HOST), 1, 0, ipc="false"), TypeError, "ipc")
        self.refused(lambda: Communicator(unique_id(Backend.HOST), 1, 0, check_counts="no"), TypeError, "check_counts")
        # True and False themselves work, and nothing was copied by the refused calls.
        self.assertEqual(self.target.raw[:8], bytes(8))
        with self.plan.executor(self.group, 0, verify=True) as executor:
            self.assertTrue(executor.run().verified)

    def test_integers_refuse_floats_strings_bools_and_negatives(self):
        for value, shown in ((1.0, "1.0 (float)"), ("1", "'1' (str)"), (True, "True (bool)"), (None, "None")):
            message = self.refused(lambda: self.group.device(value), TypeError, "rank must be an integer", shown)
            self.assertNotIn("[i]", message)
        self.refused(lambda: self.group.device(-1), ValueError, "rank = -1 is not in [0, 2^32)")
        self.refused(lambda: self.group.digest(0, self.src, 2**64), ValueError, "length = 18446744073709551616")
        self.refused(lambda: self.group.digest(0, 2.5, 8), TypeError, "addr must be an integer, not 2.5 (float)")
        self.refused(lambda: self.plan.route(False), TypeError, "index must be an integer, not False (bool)")

    def test_a_bad_element_of_a_sequence_is_named_by_index_and_value(self):
        message = self.refused(
            lambda: self.group.allgather([self.src, self.src], [self.dst, self.dst], [4, -4]),
            ValueError,
            "counts[1] = -4",
        )
        self.assertIn("[0, 2^64)", message)
        self.refused(
            lambda: self.group.allgather([self.src, 1.5], [self.dst, self.dst], [4, 4]),
            TypeError,
            "send_ptrs[1] must be an integer, not 1.5 (float)",
        )
        self.refused(
            lambda: self.needs.add_need(0, 0, 1, self.dst, (0,), (4,), (1,), perm=[0.0]), TypeError, "perm[0]", "0.0"
        )
        self.refused(
            lambda: self.offers.add_offer(0, 0, 0, self.src, (0,), (4,), strides=(-1,)), ValueError, "strides[0] = -1"
        )
        self.refused(
            lambda: self.group.copy_batch(0, [(self.src, self.dst, 8), (self.src, self.dst, "8")]),
            TypeError,
            "segments[1].len must be an integer, not '8' (str)",
        )
        self.refused(
            lambda: self.group.copy_batch(0, [refit.Segment(self.src, self.dst, 8, count=(1, 2, 3))]),
            TypeError,
            "segments[0].count must be a pair of integers",
            "(1, 2, 3)",
        )
        self.refused(lambda: self.group.enter([0, object()]), TypeError, "caller_streams[1] must be a stream")
        self.refused(lambda: self.group.enter([0]), ValueError, "caller_streams has 1 entries; the group has 2 ranks")
        pair = "ranges[1] must be an (addr, length) pair"
        self.refused(lambda: self.group.digest_many(0, [(self.src, 8), (self.src,)]), TypeError, pair)
        self.refused(lambda: self.group.digest_many(0, [(self.src, 8), (self.src, -8)]), ValueError, "ranges[1] length")

    def test_shapes(self):
        # shape=(4, 6.0) said "shape must be an integer".
        with Table() as table:
            message = "shape[1] must be an integer, not 6.0 (float)"
            self.refused(lambda: table.add_tensor("t", (4, 6.0), 4), TypeError, message)
            self.refused(lambda: table.add_tensor("t", (4, -6), 4), ValueError, "shape[1] = -6 is not in [0, 2^64)")
            self.refused(lambda: table.add_tensor("t", (4, True), 4), TypeError, "shape[1]", "True (bool)")
            self.refused(lambda: table.add_tensor("t", 4, 4), TypeError, "shape must be a sequence, not 4 (int)")
            self.refused(
                lambda: add_tensor_offer(table, "t", FakeTensor(), 0, shape=(4, 6.0), device=0),
                TypeError,
                "shape[1] must be an integer, not 6.0 (float)",
            )
            self.refused(
                lambda: add_tensor_offer(table, "t", FakeTensor(), 0, offset=(0, 0.5), device=0), TypeError, "offset[1]"
            )
            self.refused(
                lambda: table.add_offer(0, 0, 0, self.src, (0, 0), (4,)),
                ValueError,
                "extent has 1 entries; the box has 2 dimensions",
            )
            self.refused(lambda: table.add_tensor("a\0b", (4,), 4), ValueError, "name = 'a\\x00b' contains NUL")

    def test_devices(self):
        # devices[i] was printed with a literal i.
        message = "devices[1] must be an integer, not 1.0 (float)"
        self.refused(lambda: Group([0, 1.0], backend=Backend.HOST), TypeError, message)
        self.refused(
            lambda: Group([0, 1, 2**40], backend=Backend.HOST),
            ValueError,
            "devices[2] = 1099511627776 is not a 32-bit device ordinal",
            status=Status.INVALID_DEVICE,
        )
        self.refused(
            lambda: Communicator(unique_id(Backend.HOST), 1, 0, device=-(2**31) - 1),
            ValueError,
            "device = -2147483649",
            status=Status.INVALID_DEVICE,
        )
        with Table() as table:
            tensor = FakeTensor()
            self.refused(lambda: add_tensor_offer(table, "t", tensor, 0, device=0.0), TypeError, "device", "0.0")

    def test_enum_values_name_the_accepted_members(self):
        accepted = "backend = 7 is not a Backend: AUTO (0), CUDA (1), HOST (2)"
        self.refused(lambda: Group([0], backend=7), ValueError, accepted)
        self.refused(lambda: Group([0], backend=Backend.HOST.name), TypeError, "backend must be an integer", "'HOST'")
        self.refused(lambda: self.group.exit(mode=9), ValueError, "mode = 9 is not a ExitMode")
        self.refused(lambda: self.group.exit(mode=True), TypeError, "mode", "True (bool)")
        self.refused(lambda: Plan.build([self.offers, self.needs], policy=3), ValueError, "policy = 3 is not a Policy")
        self.refused(
            lambda: self.group.allgather([self.src, self.src], [self.dst, self.dst], [4, 4], algorithm=8),
            ValueError,
            "algorithm = 8 is not a Algorithm",
        )
        self.refused(lambda: unique_id(backend=-1), ValueError, "backend = -1")
        # Members and their plain values work.
        self.assertEqual(Group([0], backend=int(Backend.HOST)).backend, Backend.HOST)
        self.assertEqual(ExitMode(0), ExitMode.SYNC)

    def test_handles_and_callables(self):
        not_a_group = "group must be a refit group, not a refit table"
        self.refused(lambda: refit.digest(self.offers, 0, self.src, 8), TypeError, not_a_group)
        self.refused(lambda: Plan.build([self.offers, None]), TypeError, "tables[1] must be a refit table, not None")
        self.refused(lambda: self.group.run(5), TypeError, "fn must be callable", "5 (int)")
        self.refused(lambda: refit.set_log_callback("print"), TypeError, "callback must be callable or None", "'print'")


if __name__ == "__main__":
    unittest.main()
