"""The run sizes of benches/sweep_peer.py, which must be those of benches/gpu_sweep.rs (4 KiB .. 1 GiB by
powers of 4) for the two benches' points to sit side by side; runs without torch or a GPU (a stand-in
module takes torch's place)."""

import os
import sys
import types
import unittest
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.modules.setdefault("torch", types.ModuleType("torch"))

from sweep_peer import label, sizes  # noqa: E402


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


if __name__ == "__main__":
    unittest.main()
