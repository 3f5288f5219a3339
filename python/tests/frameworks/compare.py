"""Refit against vLLM's own loader: for every rank of a parallel layout, the model vLLM builds is
loaded twice from one index-encoded checkpoint: once by its own `load_weights` (the truth), once by
refit (needs recorded from that same loader on a meta-device copy of the model, offers of whole
checkpoint tensors from host memory as a plain Hugging Face publisher makes them, a plan, the host
backend's copies, then the engine's loader on whatever the recording staged). Every element of every
parameter is compared."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import refit
import vllm_harness as harness
from refit.integrations.receiver import RecordedReceiver
from refit.integrations.recorder import Recording, record
from refit.integrations.vllm import recording_key
from refit.tensor import dtype_code, dtype_name

POISON = -7.0  # no checkpoint element (all are >= 1) and not 0, which loaders write into padding


@dataclasses.dataclass
class RankResult:
    tp_rank: int
    pp_rank: int
    params: int = 0
    elements: int = 0
    mismatches: List[str] = dataclasses.field(default_factory=list)
    only_loader: List[str] = dataclasses.field(default_factory=list)  # parameters only vLLM's loader writes
    only_refit: List[str] = dataclasses.field(default_factory=list)
    padding: int = 0  # elements vLLM's loader zero-fills (no checkpoint element) and refit leaves
    staged: Dict[str, str] = dataclasses.field(default_factory=dict)
    recording: Optional[Recording] = None
    notes: str = ""


def poisoned(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.fill_(POISON)
    return model


def offers(table: refit.Table, ckpt: Dict[str, torch.Tensor], device: int) -> None:
    """Whole checkpoint tensors offered from host memory, as a plain HF publisher on one rank."""
    for name, tensor in ckpt.items():
        index = table.add_tensor(name, tuple(tensor.shape), tensor.element_size(), dtype_code(dtype_name(tensor)))
        table.add_offer(index, 0, device, tensor.data_ptr(), (0,) * tensor.dim(), tuple(tensor.shape))


def _whole_tensors(ckpt: Dict[str, torch.Tensor], device: int) -> refit.Table:
    table = refit.Table()
    offers(table, ckpt, device)
    return table


def compare_model(expected: torch.nn.Module, got: torch.nn.Module, result: RankResult, written: set) -> None:
    want = dict(expected.named_parameters())
    have = dict(got.named_parameters())
    result.params = len(want)
    for name in sorted(set(want) | set(have)):
        if name not in want or name not in have:
            result.mismatches.append(f"{name}: only one model has it")
            continue
        w, g = want[name].detach().flatten(), have[name].detach().flatten()
        result.elements += w.numel()
        loaded_by_vllm = bool((w != POISON).any())
        if loaded_by_vllm and name not in written:
            result.only_loader.append(name)
        if not loaded_by_vllm and name in written:
            result.only_refit.append(name)
        differ = w != g
        # Padding: the loader zero-fills rows no checkpoint element reaches; refit leaves them.
        padding = differ & (w == 0) & (g == POISON)
        result.padding += int(padding.sum())
        wrong = (differ & ~padding).nonzero().flatten()
        if len(wrong):
            i = int(wrong[0])
            result.mismatches.append(
                f"{name}: {len(wrong)} of {w.numel()} elements differ; first at {i}: refit {g[i].item()}, vLLM {w[i].item()}"
            )


def run_rank(
    config: Any,
    parallel: harness.Parallel,
    tp_rank: int,
    pp_rank: int,
    specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
    ckpt: Dict[str, torch.Tensor],
    tamper: Optional[Callable[[Recording], Recording]] = None,
    publishers: Optional[List[Callable[[int], refit.Table]]] = None,
) -> RankResult:
    """`publishers`: the training side, one function per publishing rank giving that rank's Table
    of offers on the device it is passed (devices 0, 1, ...; the engine's is the next one); by
    default one rank offering the whole checkpoint tensors."""
    result = RankResult(tp_rank, pp_rank)
    with harness.as_rank(config, parallel, tp_rank, pp_rank):
        truth = poisoned(harness.build(config, "cpu"))
        # Copies: a loader that changes a checkpoint tensor in place (GPT-OSS zeroes a bias on
        # some ranks) must not change what the publisher offers after it.
        truth.load_weights((name, tensor.clone()) for name, tensor in ckpt.items())
        meta = harness.build(config, "meta")
        # The engine's own key (its ranks and configuration): families alike in every shape but
        # placing experts apart (DeepSeek-V3.2 and GLM-5 at TP 4 round-robin) share no recording.
        recording = record(meta.load_weights, list(meta.named_parameters()), specs, key=recording_key(config))
        if tamper is not None:
            recording = tamper(recording)
        result.recording, result.staged = recording, dict(recording.staged)
        engine = poisoned(harness.build(config, "cpu"))
        receiver = RecordedReceiver(recording)
        staging = receiver.staging_buffers(lambda shape, dtype: torch.full(shape, POISON, dtype=dtype))
        if publishers is None:
            publishers = [lambda device: _whole_tensors(ckpt, device)]
        sources = [make(device) for device, make in enumerate(publishers)]
        engine_device = len(sources)
        try:
            with receiver.table(engine.named_parameters(), 0, device=engine_device, staging=staging) as needs:
                with refit.Plan.build([*sources, needs]) as plan, refit.Group(range(engine_device + 1), refit.Backend.HOST) as group:
                    routes = plan.routes()
                    for route in routes:
                        group.copy_batch(route.dst_device, route.segments)
                    result.notes = f"{len(routes)} routes, {sum(len(r.segments) for r in routes)} segments"
        finally:
            for table in sources:
                table.close()
        before = {name: bool((param == POISON).all()) for name, param in engine.named_parameters()}
        receiver.load_staged(engine.load_weights, staging)
        written = {layout.name for layout in recording.layouts} | {p for ps in recording.staged_params.values() for p in ps}
        if any(why.startswith("the loader raised") for why in recording.staged.values()):
            # Where the loader raised on a stand-in (it read values: Llama 4's expert map under EP),
            # the recording may not know every parameter that tensor reaches (the recorder's probe
            # with zeros learns them only where the loader runs on zeros); the engine's loader,
            # run on it from staging, writes them (and may create one: the Transformers backend's
            # lm_head bias).
            written |= {name for name, param in engine.named_parameters() if before.get(name, True) and not bool((param == POISON).all())}
        compare_model(truth, engine, result, written)
    return result


def versions() -> str:
    import importlib.metadata as metadata

    return ", ".join(f"{name} {metadata.version(name)}" for name in ("vllm", "torch", "transformers"))
