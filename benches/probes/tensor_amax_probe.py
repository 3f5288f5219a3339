"""How should per-tensor jobs' first phase read their source? (Issue 29: per tensor, the quantizing
copy was slower than torch.compile.) A per-tensor job reads its source twice: refit_quantize_amax
reduces the amax (a pass that only reads), then the wide entry point quantizes with it. This probe
times both launches of each library build in .gpu/variants/ (benches/probes/tensor_amax_variants.sh:
blocks per SM, loads per round, tiles per block), or of $REFIT_LIBRARY alone, on a 1 GiB bf16 matrix
(65536 x 8192) to e4m3 per tensor: the call's CUDA-event median over 10 back-to-back calls, each
kernel's duration under torch.profiler, and every code and the scale against torch with exact
division; a bf16 copy_ of the same tensor sets the bound (5 bytes per element). Each build runs in
a process of its own (one library per process). Writes $REFIT_BENCH_RESULTS/tensor_amax_probe.json.
"""

import glob
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROWS, COLS = 65536, 8192


def measure():
    """One library's figures (this process loads $REFIT_LIBRARY)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import refit
    from quant_peer import timed  # benches/quant_peer.py: CUDA-event medians of 10 back-to-back calls
    from refit import Fp8, Granularity, Group, Quantization

    torch.manual_seed(29)
    x = torch.randn(ROWS, COLS, device="cuda").to(torch.bfloat16)
    out = torch.empty(ROWS, COLS, dtype=torch.uint8, device="cuda")
    scales = torch.empty((1, 1), dtype=torch.float32, device="cuda")

    copy = torch.empty_like(x)
    copy_ms = timed(lambda: copy.copy_(x))
    group = Group([torch.cuda.current_device()])
    jobs = [refit.tensor_job(x, out, scales, Quantization(Fp8.E4M3FN, Granularity.TENSOR, None))]
    stream = torch.cuda.current_stream()
    call_ms = timed(lambda: refit.quantize_batch(group, 0, jobs, stream))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            refit.quantize_batch(group, 0, jobs, stream)
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type.name == "CUDA" and event.name.startswith("refit_"):
            kernels.setdefault(event.name, []).append(event.device_time_total / 1000)
    amax = x.abs().amax().float().clamp_min(1e-10)
    want_scale = amax / torch.full_like(amax, 448.0)
    want = (x.float() / want_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    mismatched = int((out != want).sum()) + int(scales.view(torch.int32).item() != want_scale.view(torch.int32).item())
    group.close()
    return {
        "copy_ms": round(copy_ms, 4),
        "bound_ms": round(copy_ms * 5 / 4, 4),
        "call_ms": round(call_ms, 4),
        "kernel_ms": {name: round(statistics.median(times), 4) for name, times in kernels.items()},
        "mismatched_bytes_vs_torch_exact": mismatched,
    }


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "measure":
        print("RESULT " + json.dumps(measure()))
        return
    libraries = sorted(glob.glob(".gpu/variants/*.so")) or [os.environ["REFIT_LIBRARY"]]
    results = []
    for library in libraries:
        env = dict(os.environ, REFIT_LIBRARY=os.path.abspath(library))
        run = subprocess.run([sys.executable, __file__, "measure"], env=env, capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[0][len("RESULT "):]) if lines else {"error": run.stderr[-2000:]}
        result["library"] = os.path.basename(library)
        results.append(result)
        print(json.dumps(result), flush=True)
    print("\n| library | call ms | refit_quantize_amax ms | refit_quantize ms | bound ms | bound / call | bytes differing |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['library']} | failed | | | | | |")
            continue
        k = r["kernel_ms"]
        print(
            f"| {r['library']} | {r['call_ms']:.3f} | {k.get('refit_quantize_amax', float('nan')):.3f} "
            f"| {k.get('refit_quantize', float('nan')):.3f} | {r['bound_ms']:.3f} | {r['bound_ms'] / r['call_ms']:.2f} "
            f"| {r['mismatched_bytes_vs_torch_exact']} |"
        )
    directory = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tensor_amax_probe.json"), "w") as f:
        json.dump({"bench": "tensor_amax_probe", "shape": [ROWS, COLS], "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
