"""The demo's synthetic receiver tables (workloads/src/vllm.rs, as examples/demo.rs uses them:
Qwen3-30B-A3B at full width, one layer, vLLM TP 2) equal what the recorder gives from vLLM 0.33's own
model class and loader for the same shapes: every parameter's size and every piece (checkpoint
tensor, byte offset in the parameter, box, strides), names compared exactly. The Rust side comes from
tests/integrations_match_workloads.rs (demo_receiver_tables), run through cargo."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile
import unittest
from typing import Dict, List, Tuple

import torch

import vllm_harness as harness
from refit.integrations.recorder import record

ROOT = pathlib.Path(__file__).resolve().parents[3]


def demo_tables() -> List[dict]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "demo.jsonl")
        env = dict(os.environ, REFIT_DEMO_TABLES=path)
        subprocess.run(
            ["cargo", "test", "--quiet", "--test", "integrations_match_workloads", "demo_receiver_tables"],
            cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
        )
        with open(path) as handle:
            return [json.loads(line) for line in handle if line.strip()]


def row_major(extent) -> Tuple[int, ...]:
    strides = [1] * len(extent)
    for d in range(len(extent) - 2, -1, -1):
        strides[d] = strides[d + 1] * extent[d + 1]
    return tuple(strides)


class DemoTablesTest(unittest.TestCase):
    def test_the_demo_receiver_tables_equal_the_recording_of_vllm(self) -> None:
        from transformers import Qwen3MoeConfig

        rust = demo_tables()
        hf_config = Qwen3MoeConfig(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
            max_position_embeddings=4096, tie_word_embeddings=False,
        )
        specs = harness.meta_checkpoint_specs(hf_config, torch.bfloat16)
        parallel = harness.Parallel(2)
        config = harness.engine_config(harness.config_folder("demo", hf_config), parallel, dtype="bfloat16")
        for rank in range(2):
            with harness.as_rank(config, parallel, rank, 0):
                model = harness.build(config, "meta")
                recording = record(model.load_weights, list(model.named_parameters()), specs, key=("demo", rank))
            self.assertEqual(recording.staged, {})
            ours: Dict[str, tuple] = {}
            for layout in recording.layouts:
                es = 2
                pieces = sorted((p.tensor, p.at * es, tuple(p.offset), tuple(p.extent)) for p in layout.pieces)
                for p in layout.pieces:
                    self.assertEqual(tuple(p.strides), row_major(p.extent), f"{layout.name}: a piece the demo stores row-major")
                numel = 1
                for n in layout.shape:
                    numel *= n
                ours[layout.name] = (numel * es, pieces)
            theirs: Dict[str, tuple] = {}
            for line in (line for line in rust if line["rank"] == rank):
                name = line["name"]
                pieces = sorted((t, at, tuple(off), tuple(ext)) for t, at, off, ext in line["pieces"])
                theirs[name] = (line["bytes"], pieces)
            self.assertEqual(sorted(theirs), sorted(ours), f"rank {rank}: parameter names")
            for name in ours:
                self.assertEqual(theirs[name], ours[name], f"rank {rank} {name}")


if __name__ == "__main__":
    unittest.main()
