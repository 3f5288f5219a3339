"""benches/inflight_peer.py's harness on the host backend (--dry: tiny sizes, no torch, no GPU): its
arithmetic, its layout and table (a refit plan built from them installs the shards whole), its
check of the installed bytes (a changed byte is caught), and a whole dry run's result."""

import ctypes
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))  # refit finds target/debug's library itself

import inflight_peer as bench  # noqa: E402
from refit import Backend, Commit, Group, Plan  # noqa: E402


class Arithmetic(unittest.TestCase):
    def test_step_time_counts_only_the_ends_inside_the_window(self):
        self.assertAlmostEqual(bench.step_time_inside([1, 2, 3, 10, 20, 30, 40, 41], 5, 35), 10.0)
        self.assertIsNone(bench.step_time_inside([1, 20, 40], 5, 35))
        self.assertAlmostEqual(bench.slowdown(2.0, 3.0), 0.5)
        self.assertIsNone(bench.slowdown(2.0, None))

    def test_layout_puts_every_shard_once_and_every_tensor_whole(self):
        layout = bench.model_layout(3, 4, 8)
        size = 4 * 8 * 2
        self.assertEqual([e["dst"] for e in layout], [0, size, 2 * size])
        sources = sorted(e[k] for e in layout for k in ("src0", "src1"))
        self.assertEqual(sources, [i * size // 2 for i in range(6)])


class HarnessOnHost(unittest.TestCase):
    def test_a_staged_step_installs_the_shards_and_the_check_catches_a_changed_byte(self):
        device = bench.HostDevice(4096)
        layout = bench.model_layout(2, 4, 8)
        total = sum(e["bytes"] for e in layout)
        src, dst = device.arena(total), device.arena(total)
        device.fill(src, 3)
        with bench.build_table(layout, 4, 8, device.addr(src), device.addr(dst), 0) as table, Plan.build([table]) as plan:
            with Group([0], backend=Backend.HOST) as group, plan.executor(group, 0, commit=Commit.STAGED) as executor:
                executor.run()
                self.assertEqual(bytes(dst), bytes(total), "live bytes before the commit")
                executor.commit()
        bench.check_installed(device, layout, src, dst)
        dst[5] ^= 0xFF
        with self.assertRaises(SystemExit):
            bench.check_installed(device, layout, src, dst)

    def test_a_dry_run_writes_every_budget_and_the_commit_figures(self):
        with tempfile.TemporaryDirectory() as out:
            os.environ["REFIT_BENCH_RESULTS"] = out
            try:
                result = bench.main(["--dry"])
            finally:
                del os.environ["REFIT_BENCH_RESULTS"]
            with open(os.path.join(out, "inflight_dry.json")) as handle:
                written = json.load(handle)
        self.assertEqual(written["budgets"], json.loads(json.dumps(result["budgets"])))
        self.assertEqual([row["budget"] for row in written["budgets"]], ["none (auto)", "8 SMs"])
        self.assertEqual(written["installed_bytes"], written["model_bytes"])
        for row in written["budgets"]:
            self.assertGreater(row["receive_ms"], 0)
            self.assertGreater(row["loop_ms_per_step_alone"], 0)
        self.assertEqual(len(written["commit"]["stalls_ms"]), 4)
        self.assertIn("met", written["commit"])


if __name__ == "__main__":
    unittest.main()
