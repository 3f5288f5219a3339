"""benches/sweep_peer.py without torch or a GPU (a stand-in module takes torch's place): its run sizes,
which must be those of benches/gpu_sweep.rs (4 KiB .. 1 GiB by powers of 4) for the two benches' points
to sit side by side, and how it sets AUTO beside the best peer of each point."""

import os
import sys
import types
import unittest
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.modules.setdefault("torch", types.ModuleType("torch"))

from sweep_peer import combine, label, sizes  # noqa: E402


class Sizes(unittest.TestCase):
    def test_default_sizes_are_the_rust_bench_s(self):
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop("REFIT_SWEEP_SIZES", None)
            self.assertEqual(sizes(), [4096 << (2 * k) for k in range(10)])
            self.assertEqual(sizes()[-1], 1 << 30)

    def test_listed_sizes_are_taken_as_given(self):
        with mock.patch.dict(os.environ, {"REFIT_SWEEP_SIZES": "4096, 1048576"}):
            self.assertEqual(sizes(), [4096, 1048576])

    def test_labels(self):
        self.assertEqual([label(4096), label(16 << 20), label(1 << 30), label(100)],
                         ["4 KiB", "16 MiB", "1 GiB", "100 B"])


def rust_point(shape, run, auto, loop, ceiling=2000.0):
    return {"shape": shape, "run_bytes": run, "auto": {"gbps": auto, "method": "kernel"},
            "per_run_loop": {"gbps": loop}, "ceiling": {"gbps": ceiling}}


class Combine(unittest.TestCase):
    def test_best_peer_is_the_fastest_of_the_loop_and_torch(self):
        sweep = {"payload_bytes": 64, "points": [rust_point("strided", 4096, 1500.0, 100.0)]}
        torch_rows = [{"shape": "strided", "run_bytes": 4096, "_foreach_copy_": {"gbps": 900.0},
                       "per-run copy_": {"gbps": 80.0}, "column-block copy_": {"gbps": 1800.0}}]
        [c] = combine(sweep, torch_rows, 64)
        self.assertEqual(c["best_peer"], "torch column-block copy_")
        self.assertAlmostEqual(c["auto_vs_best_peer"], 1500.0 / 1800.0)
        self.assertAlmostEqual(c["auto_vs_ceiling"], 0.75)

    def test_points_torch_lacks_compare_with_the_loop(self):
        sweep = {"payload_bytes": 64, "points": [rust_point("receivers", 1 << 20, 1000.0, 1250.0),
                                                 rust_point("contiguous", 1 << 20, 1000.0, 10.0)]}
        torch_rows = [{"shape": "contiguous", "run_bytes": 4096, "_foreach_copy_": {"gbps": 5000.0}}]
        first, second = combine(sweep, torch_rows, 64)
        self.assertEqual(first["best_peer"], "per-run cuMemcpyAsync")
        self.assertAlmostEqual(first["auto_vs_best_peer"], 0.8)
        self.assertEqual(second["best_peer"], "per-run cuMemcpyAsync")

    def test_other_payloads_are_not_compared(self):
        sweep = {"payload_bytes": 128, "points": [rust_point("contiguous", 4096, 1.0, 1.0)]}
        self.assertEqual(combine(sweep, [], 64), [])


if __name__ == "__main__":
    unittest.main()
