"""The arithmetic of benches/side_by_side.py, which sets the overlap figures of record; runs without
torch or a GPU (a stand-in module takes torch's place, since only the arithmetic is exercised)."""

import os
import sys
import types
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.modules.setdefault("torch", types.ModuleType("torch"))

from side_by_side import rate_inside  # noqa: E402

GB = 1_000_000_000


class RateInside(unittest.TestCase):
    def test_counts_only_the_steps_that_ended_inside_the_load(self):
        # Steps of 1 GB ending every 10 ms inside the load (100 GB/s), every 1 ms outside it (1,000 GB/s).
        ends = [1, 2, 3, 10, 20, 30, 40, 41, 42]
        rate, bound = rate_inside(ends, 5, 35, GB)
        self.assertFalse(bound)
        self.assertAlmostEqual(rate, 100.0)

    def test_a_step_ending_on_the_load_s_edges_counts(self):
        rate, bound = rate_inside([10, 20, 30], 10, 30, GB)
        self.assertFalse(bound)
        self.assertAlmostEqual(rate, 100.0)

    def test_one_end_inside_gives_a_bound_of_two_steps(self):
        rate, bound = rate_inside([0, 50, 200], 40, 140, GB)
        self.assertTrue(bound)
        self.assertAlmostEqual(rate, 2 * GB / (100 * 1e6))

    def test_no_end_inside_gives_a_bound_of_one_step(self):
        rate, bound = rate_inside([0, 500], 100, 300, 2 * GB)
        self.assertTrue(bound)
        self.assertAlmostEqual(rate, 2 * GB / (200 * 1e6))


if __name__ == "__main__":
    unittest.main()
