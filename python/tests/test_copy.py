"""Batched copies on the host backend: one-shot and prepared batches against a byte loop written
here, the checked mode, bad arguments, and a plan's routes executed through copy_batch from rank
callbacks."""

import ctypes
import unittest

from refit import Backend, Group, Plan, RefitError, Segment, Status
from test_plan import Refit

ROWS, HALF = 32, 24
POISON = 0xCD


def host_buffer(content):
    return (ctypes.c_uint8 * len(content))(*content)


def addr(buffer, offset=0):
    return ctypes.addressof(buffer) + offset


class CopyTest(unittest.TestCase):
    def setUp(self):
        self.group = Group([0, 1], backend=Backend.HOST)
        self.left = host_buffer([(i * 7 + 1) % 256 for i in range(ROWS * HALF)])
        self.right = host_buffer([(i * 13 + 5) % 256 for i in range(ROWS * HALF)])
        self.full = host_buffer([POISON] * (ROWS * 2 * HALF + 64))
        # Two column halves gathered into full rows (interleaved destinations), a misaligned
        # contiguous run, and an empty segment whose addresses do not matter.
        self.segments = [
            Segment(addr(side), addr(self.full, index * HALF), HALF, (ROWS, 1), (HALF, 0), (2 * HALF, 0))
            for index, side in enumerate((self.left, self.right))
        ] + [(addr(self.left, 5), addr(self.full, ROWS * 2 * HALF + 3), 37), Segment(0, 0, 0)]

    def tearDown(self):
        self.group.close()

    def expected(self):
        want = bytearray([POISON] * len(self.full))
        for row in range(ROWS):
            for b in range(HALF):
                want[row * 2 * HALF + b] = self.left[row * HALF + b]
                want[row * 2 * HALF + HALF + b] = self.right[row * HALF + b]
        for b in range(37):
            want[ROWS * 2 * HALF + 3 + b] = self.left[5 + b]
        return bytes(want)

    def reset(self):
        ctypes.memset(self.full, POISON, len(self.full))

    def test_copy_batch_is_byte_exact(self):
        for rank, stream, checked in ((1, self.group.stream(1), True), (0, None, False)):
            with self.subTest(rank=rank, checked=checked):
                self.reset()
                self.group.copy_batch(rank, self.segments, stream=stream, checked=checked)
                self.assertEqual(bytes(self.full), self.expected())
        self.group.copy_batch(0, [])  # an empty batch

    def test_prepared_copy_reads_the_sources_at_each_launch(self):
        with self.group.prepare_copy(1, self.segments, checked=True) as batch:
            for _ in range(5):
                for i in range(len(self.left)):
                    self.left[i] = (self.left[i] + 1) % 256
                self.reset()
                batch.launch(self.group.stream(1))
                self.assertEqual(bytes(self.full), self.expected())
        with self.assertRaises(RefitError) as caught:
            batch.launch()
        self.assertIs(caught.exception.status, Status.INVALID_STATE)

    def test_checked_mode_refuses_overlap_and_copies_nothing(self):
        source = host_buffer([1] * 64)
        target = host_buffer([POISON] * 64)
        overlap = [(addr(source), addr(target), 16), (addr(source), addr(target, 8), 16)]
        with self.assertRaises(RefitError) as caught:
            self.group.copy_batch(0, overlap, checked=True)
        self.assertIs(caught.exception.status, Status.OVERLAP)
        self.assertIn("segments 0 and 1", caught.exception.message)
        with self.assertRaises(RefitError) as caught:
            self.group.prepare_copy(0, overlap, checked=True)
        self.assertIs(caught.exception.status, Status.OVERLAP)
        self.assertEqual(bytes(target), bytes([POISON] * 64))

    def test_a_segment_that_repeats_its_destination_is_overlap_checked_or_not(self):
        source = host_buffer([1] * 64)
        target = host_buffer([POISON] * 64)
        # 2^61 copies of the same 4 bytes: refused at once, in either mode, not run.
        repeated = Segment(addr(source), addr(target), 4, count=(1, 1 << 61))
        for checked in (False, True):
            with self.assertRaises(RefitError) as caught:
                self.group.copy_batch(0, [repeated], checked=checked)
            self.assertIs(caught.exception.status, Status.OVERLAP)
            self.assertIn("writes its destination bytes more than once", caught.exception.message)
        self.assertEqual(bytes(target), bytes([POISON] * 64))

    def test_bad_arguments(self):
        source = host_buffer([1] * 64)
        target = host_buffer([POISON] * 64)
        ok = (addr(source), addr(target), 4)
        cases = {
            "rank": lambda: self.group.copy_batch(2, [ok]),
            "prepared rank": lambda: self.group.prepare_copy(5, [ok]),
            "zero address": lambda: self.group.copy_batch(0, [(0, addr(target), 4)]),
            "size wraps": lambda: self.group.copy_batch(0, [Segment(*ok, count=((1 << 64) - 1, 2))]),
            "negative len": lambda: self.group.copy_batch(0, [(addr(source), addr(target), -4)]),
            "three counts": lambda: self.group.copy_batch(0, [Segment(*ok, count=(1, 1, 1))]),
            "stream": lambda: self.group.copy_batch(0, [ok], stream="default"),
            "not a host stream": lambda: self.group.copy_batch(0, [ok], stream=0x3039),
            "prepared, not a host stream": lambda: self.group.prepare_copy(0, [ok]).launch(stream=0x3039),
        }
        for name, call in cases.items():
            with self.subTest(case=name):
                with self.assertRaises(RefitError) as caught:
                    call()
                self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        self.assertEqual(bytes(target), bytes([POISON] * 64))

    def test_addresses_where_no_memory_can_be_are_refused_before_any_copy(self):
        source = host_buffer([1] * 64)
        target = host_buffer([POISON] * 64)
        ok = (addr(source), addr(target), 8)
        cases = {
            "source in the first page": ([ok, (0x10, addr(target) + 8, 8)], "segment 1: its source [0x10"),
            "destination in the first page": ([(addr(source), 0xFF8, 16)], "segment 0: its destination [0xff8"),
        }
        for name, (segments, words) in cases.items():
            for call in (lambda: self.group.copy_batch(0, segments), lambda: self.group.prepare_copy(1, segments)):
                with self.subTest(case=name):
                    with self.assertRaises(RefitError) as caught:
                        call()
                    self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
                    self.assertIn(words, caught.exception.message)
                    self.assertIn("first page", caught.exception.message)
        self.assertEqual(bytes(target), bytes([POISON] * 64))


class PlanThroughCopyTest(unittest.TestCase):
    def test_each_rank_copies_the_routes_into_it(self):
        refit = Refit()
        with Plan.build(refit.tables) as plan, Group([0, 1], backend=Backend.HOST) as group:
            routes = plan.routes()
            self.assertEqual({route.dst_rank for route in routes}, {0, 1})

            def body(rank, stream):
                group.copy_batch(rank, [s for r in routes if r.dst_rank == rank for s in r.segments], stream)

            group.run(body)
        for rank in range(2):
            self.assertEqual(refit.halves[rank].bytes(), refit.expected_half(rank))
            self.assertEqual(refit.bias_halves[rank].bytes(), refit.expected_bias_half(rank))
        self.assertEqual(refit.transposed.bytes(), refit.expected_transposed())
        refit.close()


if __name__ == "__main__":
    unittest.main()
