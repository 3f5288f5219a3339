"""Bytes each receiving rank takes per weight update, computed on CPU from each backend's own code:

- refit: exactly the bytes the rank's parameters hold (the sum of its parameters' bytes in the
  model vLLM builds for that rank, on the meta device);
- vLLM `nccl_m2n`: vLLM's own destination resolution (m2n_layout.resolve_parameter_destinations,
  run on that same meta model with the checkpoint's names, dtypes and shapes): a "direct"
  parameter brings the rank its own slice (the live parameter's bytes), a "fallback" one the whole
  checkpoint tensor. Two destination meshes: vLLM's default (flat: shard axis 1) and the best case
  a user can declare, (1, TP);
- vLLM `nccl`: the broadcast backend sends every checkpoint tensor whole to every worker.

Shapes: Qwen3-30B-A3B and DeepSeek-V3 (their published Hugging Face config values, built in code;
BF16; DeepSeek-V3 without its MTP layer, which vLLM's main model does not load) at TP 8, expert
parallelism off and on. Run in the real-framework venv (vLLM 0.33 on CPU):

    VLLM_TARGET_DEVICE=cpu $VENV/bin/python benches/transfer_bytes.py [--out benches/results/transfer_bytes.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests", "frameworks"))

import vllm_ranks  # noqa: E402


def qwen3_30b_a3b() -> Any:
    from transformers import Qwen3MoeConfig

    # Qwen/Qwen3-30B-A3B config.json.
    return Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        torch_dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"],
    )


def deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    # deepseek-ai/DeepSeek-V3 config.json, in BF16 (no quantization_config).
    return DeepseekV3Config(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
        tie_word_embeddings=False, torch_dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"],
    )


MODELS = {"Qwen3-30B-A3B": qwen3_30b_a3b, "DeepSeek-V3": deepseek_v3}


def param_bytes(model: Any) -> int:
    """refit's figure: the bytes the rank's parameters hold."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def m2n_bytes(model: Any, specs: vllm_ranks.Specs, tp: int, mesh: tuple) -> Dict[str, int]:
    """What vLLM's nccl_m2n brings this rank, from its own resolution: direct parameters their
    slice, fallback ones the whole checkpoint tensor."""
    import torch
    from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

    names = list(specs)
    destinations = resolve_parameter_destinations(
        model,
        names,
        [specs[n][1] for n in names],
        [specs[n][0] for n in names],
        num_workers=tp,
        shard_axis_size=mesh[1],
        allow_direct=True,
    )
    out = {"direct_bytes": 0, "fallback_bytes": 0, "direct_params": 0, "fallback_params": 0}
    for destination in destinations:
        shape, dtype = specs[destination.name]
        if destination.direct:
            out["direct_bytes"] += destination.tensor.numel() * destination.tensor.element_size()
            out["direct_params"] += 1
        else:
            out["fallback_bytes"] += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            out["fallback_params"] += 1
    out["bytes"] = out["direct_bytes"] + out["fallback_bytes"]
    return out


def broadcast_bytes(specs: vllm_ranks.Specs) -> int:
    """vLLM's nccl backend: every checkpoint tensor, whole, to every worker."""
    import torch

    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs.values())


def measure(name: str, tp: int, ep: bool, ranks: List[int]) -> Dict[str, Any]:
    hf_config = MODELS[name]()
    specs = vllm_ranks.checkpoint_specs(hf_config)
    folder = vllm_ranks.config_folder(hf_config)
    config = vllm_ranks.engine_config(folder, tp, ep)
    per_rank = []
    for rank in ranks:
        with vllm_ranks.as_rank(config, rank):
            model = vllm_ranks.build(config, "meta")
            refit_bytes = param_bytes(model)
            flat = m2n_bytes(model, specs, tp, (tp, 1))
            best = m2n_bytes(model, specs, tp, (1, tp))
        del model
        gc.collect()
        nccl = broadcast_bytes(specs)
        per_rank.append(
            {
                "rank": rank,
                "refit": refit_bytes,
                "nccl_m2n_default_mesh": flat,
                "nccl_m2n_mesh_1xtp": best,
                "nccl": nccl,
                "factor_vs_refit": {
                    "refit": 1.0,
                    "nccl_m2n_default_mesh": flat["bytes"] / refit_bytes,
                    "nccl_m2n_mesh_1xtp": best["bytes"] / refit_bytes,
                    "nccl": nccl / refit_bytes,
                },
            }
        )
    return {"model": name, "tp": tp, "ep": ep, "checkpoint_tensors": len(specs), "checkpoint_bytes": broadcast_bytes(specs), "ranks": per_rank}


def versions() -> Dict[str, str]:
    import importlib.metadata as metadata

    return {pkg: metadata.version(pkg) for pkg in ("vllm", "torch", "transformers")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "transfer_bytes.json"))
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ranks", default="all", help="'all' or comma-separated TP ranks")
    args = parser.parse_args()
    ranks = list(range(args.tp)) if args.ranks == "all" else [int(r) for r in args.ranks.split(",")]
    started = time.time()
    cases = []
    for name in args.models:
        for ep in (False, True):
            case = measure(name, args.tp, ep, ranks)
            cases.append(case)
            r0 = case["ranks"][0]
            gib = 1 << 30
            print(
                f"{name} TP{args.tp} EP {'on ' if ep else 'off'} rank 0: refit {r0['refit'] / gib:.2f} GiB, "
                f"nccl_m2n {r0['nccl_m2n_mesh_1xtp']['bytes'] / gib:.2f} GiB (mesh 1x{args.tp}; "
                f"{r0['factor_vs_refit']['nccl_m2n_mesh_1xtp']:.2f}x) / "
                f"{r0['nccl_m2n_default_mesh']['bytes'] / gib:.2f} GiB (default mesh; "
                f"{r0['factor_vs_refit']['nccl_m2n_default_mesh']:.2f}x), "
                f"nccl {r0['nccl'] / gib:.2f} GiB ({r0['factor_vs_refit']['nccl']:.2f}x)",
                flush=True,
            )
    result = {
        "bench": "transfer_bytes",
        "what": "bytes each receiving rank takes per update; refit = its parameters' bytes, vLLM nccl_m2n from "
        "m2n_layout.resolve_parameter_destinations (direct: slice, fallback: whole tensor), vLLM nccl = every "
        "checkpoint tensor to every rank",
        "machine": {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": versions(),
        "seconds": round(time.time() - started, 1),
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
