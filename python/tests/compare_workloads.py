"""Reads the Rust generator's parameters (JSON lines from tests/integrations_match_workloads.rs) and
checks that refit.integrations describes the same parameters: names in the same order per rank, the
same sizes, the same pieces. Prints "N parameters match" or every difference, and exits non-zero on
any."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from refit.integrations import MegatronRanks, ModelShape, VllmRanks, megatron_layouts, vllm_layouts

MOE = ModelShape(
    layers=2, hidden=16, heads=4, kv_heads=2, head_dim=4, vocab=512, experts=4, moe_ffn=8, qk_norm=True, name="moe"
)
DENSE = ModelShape(layers=2, hidden=16, heads=4, kv_heads=2, head_dim=4, vocab=512, ffn=24, name="llama")
# case -> (model, Megatron (tp, ep, grouped)); publisher i has TP rank i % tp and EP rank i % ep
# (expert TP 1), as workloads/src/megatron.rs numbers them; vLLM receiver i has TP rank i.
CASES = {
    "moe_tp1_ep4_grouped": (MOE, 1, 4, True),
    "moe_tp2_ep2": (MOE, 2, 2, False),
    "dense_tp2_dp2": (DENSE, 2, 1, True),
    "dense_tp1": (DENSE, 1, 1, True),
}


def python_side(case: str, side: str, rank: int, vllm_tp: int):
    model, tp, ep, grouped = CASES[case]
    if side == "megatron":
        etp = {"etp": 1, "etp_rank": 0} if model.experts else {}
        ranks = MegatronRanks(tp=tp, tp_rank=rank % tp, ep=ep, ep_rank=rank % ep, grouped_experts=grouped, **etp)
        return model, megatron_layouts(model, ranks)
    return model, vllm_layouts(model, VllmRanks(tp=vllm_tp, tp_rank=rank))


def main() -> int:
    rust = defaultdict(list)
    for line in sys.stdin:
        if line.strip():
            p = json.loads(line)
            rust[(p["case"], p["side"], p["rank"])].append(p)
    vllm_tp = {case: 1 + max(r for (c, s, r) in rust if c == case and s == "vllm") for case in CASES}
    problems, matched = [], 0
    for (case, side, rank), params in sorted(rust.items()):
        model, layouts = python_side(case, side, rank, vllm_tp[case])
        if [p["name"] for p in params] != [layout.name for layout in layouts]:
            problems.append(f"{case} {side} rank {rank}: names differ: {[p['name'] for p in params]} != {[l.name for l in layouts]}")
            continue
        for p, layout in zip(params, layouts):
            es = p["elem_size"]
            python_pieces = sorted((x.tensor, x.at * es, list(x.offset), list(x.extent)) for x in layout.pieces)
            rust_pieces = sorted((t, at, off, ext) for t, at, off, ext in p["pieces"])
            if p["bytes"] != layout.numel * es or python_pieces != rust_pieces:
                problems.append(f"{case} {side} rank {rank} {p['name']}: rust {p['bytes']} B {rust_pieces} python {layout.numel * es} B {python_pieces}")
            else:
                matched += 1
    for problem in problems:
        print(problem)
    print(f"{matched} parameters match, {len(problems)} differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
