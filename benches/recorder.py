"""Recording a full-size receiver from vLLM's own loader (python/refit/integrations/recorder.py):
vLLM 0.33's model class built on the meta device for one rank, its load_weights run over meta
stand-ins of every checkpoint tensor (names and shapes as transformers writes them), on one core.
Targets (issue 27): Qwen3-30B-A3B at TP 4 with expert parallelism <= 10 s and <= 1 GiB; DeepSeek-V3
<= 60 s. Writes benches/results/recorder.json (or $REFIT_BENCH_RESULTS/recorder.json).

Run in the frameworks venv (.ci/frameworks builds it), from the repository root:
    REFIT_LIBRARY=target/debug/librefit.so PYTHONPATH=python:python/tests/frameworks \\
        ~/.cache/refit/frameworks-<hash>/bin/python benches/recorder.py
No peer figure: vLLM's own weight-transfer backends do not record layouts (m2n_layout.py sends fused
parameters whole to every rank instead)."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import time

os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import vllm_harness as harness  # noqa: E402
from refit.integrations.recorder import record  # noqa: E402


def qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, norm_topk_prob=True,
    )


def deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, max_position_embeddings=163840,
        routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
    )


def kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def case(name, make, parallel):
    hf_config = make()
    specs = harness.meta_checkpoint_specs(hf_config)
    folder = harness.config_folder(name, hf_config)
    config = harness.engine_config(folder, parallel, dtype="bfloat16")
    with harness.as_rank(config, parallel, 0, 0):
        started = time.perf_counter()
        model = harness.build(config, "meta")
        built = time.perf_counter()
        params = list(model.named_parameters())
        with open("/proc/self/clear_refs", "w") as handle:  # resets the peak resident size
            handle.write("5")
        before = kib("VmRSS")
        cpu = time.process_time()
        recording = record(model.load_weights, params, specs, key=(name, parallel), cache=False)
        recorded = time.perf_counter()
        recorded_cpu = time.process_time() - cpu
        peak = kib("VmHWM")
        # vLLM's own loader over the same stand-ins without the recorder: the floor under record_s.
        stand_ins = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, (shape, dtype) in specs.items()]
        floor, floor_cpu = time.perf_counter(), time.process_time()
        model.load_weights(iter(stand_ins))
        floor, floor_cpu = time.perf_counter() - floor, time.process_time() - floor_cpu
    pieces = sum(len(layout.pieces) for layout in recording.layouts)
    result = {
        "name": name,
        "tp": parallel.tp,
        "expert_parallel": parallel.ep,
        "rank": 0,
        "checkpoint_tensors": len(specs),
        "parameters": len(params),
        "boxes": pieces,
        "staged_tensors": len(recording.staged),
        "build_on_meta_s": round(built - started, 3),
        "record_s": round(recorded - built, 3),
        "record_cpu_s": round(recorded_cpu, 3),
        "vllm_load_weights_alone_s": round(floor, 3),
        "vllm_load_weights_alone_cpu_s": round(floor_cpu, 3),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "record_peak_rss_increase_mib": round((peak - before) / 1024, 1),
        "process_peak_rss_mib": round(peak / 1024, 1),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    cases = [
        case("qwen3-30b-a3b", qwen3_30b_a3b, harness.Parallel(tp=4, ep=True)),
        case("deepseek-v3", deepseek_v3, harness.Parallel(tp=8, ep=True)),
    ]
    import importlib.metadata as metadata

    out = {
        "bench": "recorder",
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores_used": 1,
        "cores_on_machine": os.cpu_count(),
        "note": "one core pinned; the machine is shared (load_average_1min per case): record_cpu_s is the figure to hold against the targets",
        "vllm": metadata.version("vllm"),
        "torch": metadata.version("torch"),
        "targets_s": {"qwen3-30b-a3b": 10, "deepseek-v3": 60},
        "target_rss_mib": {"qwen3-30b-a3b": 1024},
        "cases": cases,
    }
    directory = pathlib.Path(os.environ.get("REFIT_BENCH_RESULTS", pathlib.Path(__file__).resolve().parent / "results"))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "recorder.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
