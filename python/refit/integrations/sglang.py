"""refit under SGLang: the same lifecycle as the vLLM backend (vllm_backend.py), driven through
SGLang's `update_weights_from_tensor` with a custom loader.

SGLang (0.5.x, sglang/srt/model_executor/model_runner_components/weight_updater.py) hands the
named tensors of `update_weights_from_tensor(named_tensors, load_format=F)` to `F(model,
named_tensors)` on every TP rank's scheduler, between batches, when F was listed at launch in
`custom_weight_loader`. refit sends no weights that way: each call carries one small control tensor
(`CONTROL_NAME`, a JSON message as uint8) and the loader `refit_loader` acts on it, on the rank's
`SglangReceiver`:

- "init": joins refit's communicator, describes the rank's parameters as needs, plans with the
  trainer (collective; the trainer makes the call on a thread while it does its part);
- "receive": agrees on the tables, then receives into staging on a background thread and returns:
  SGLang keeps scheduling batches meanwhile (staging does not fit the limit: the bytes are received
  in the call, the scheduler paused);
- "commit": waits for the receive and installs it between two batches; a dead trainer or a
  verify mismatch refuses it and leaves the weights as they were (the error reaches the trainer as
  the call's failure);
- "shutdown".

Launch: `sglang.Engine(model_path=..., custom_weight_loader=[LOADER])` (or
`--custom-weight-loader refit.integrations.sglang.refit_loader`); trainer: `SglangTrainer(engine_call(engine),
source, num_workers=tp)`. `engine_call(engine)` calls the engine's `update_weights_from_tensor`
inside a `begin_weight_update()` / `end_weight_update()` session when the engine has them: SGLang
0.5.23 answers (False, "... must run between begin_weight_update() and end_weight_update()")
otherwise. Any callable `(named_tensors, load_format)` that reaches every rank's updater will do.

A refusal (a dead trainer, a verify mismatch) is not raised out of the loader: SGLang 0.5.23 does
not catch a custom loader's error (it leaves the scheduler's update_weights_from_tensor, and a real
scheduler's event loop ends on it: run_scheduler_process logs it and signals the launcher, taking the
server down). The loader logs it at ERROR, keeps it in the rank's `SglangReceiver.refusals`, and
returns; the weights are as they were, the engine keeps serving them, and the trainer hears of the
refusal through refit itself: every process of a round agrees on its outcome before anything is
committed, so `SglangTrainer.update` raises on the trainer.

The rank's needs are recorded from SGLang's own loader (`recorded_table`, the default): the rank's
model class is built again on the meta device as SGLang's loader builds it (same config, the live
model's quant config, this process's TP / EP groups), its `load_weights` runs over meta stand-ins
of the checkpoint (the model folder's safetensors headers) under refit's recorder, and every
element it copies becomes a box of a need at the live parameter's address (DeepSeek-V3's q_a_proj
and kv_a_proj_with_mqa, which the loader concatenates into one fused parameter, too: part by part).
Checkpoint tensors the loader transforms (arithmetic, a dtype conversion) are staged whole; after
the commit SGLang's own `load_weights` takes them, then SGLang's post-load fix-up runs
(`model.post_load_weights()`: DeepSeek's MLA w_kc / w_vc, derived from kv_b_proj.weight, which
SGLang's end_weight_update skips after an update_weights_from_tensor).
Layers SGLang packed for Intel AMX after loading are refused (see `_amx_packed`).
`receiver_table` (the hand-written vLLM rules: Llama / Qwen2 without q/k/v biases / Qwen3 /
Qwen3-MoE only) remains for `attach(model, table_of=receiver_table)`. Nothing here imports SGLang
at import time: its TP rank is read lazily. python/tests/frameworks/test_sglang_real.py drives the
loader through SGLang 0.5.23's own updater and Qwen3 model on CPU.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._lib import Backend, invalid_argument
from ..comm import unique_id
from ..plan import Table
from .engine_link import InFlight, Link, LinkOptions, concurrently, publisher_table, resolved_backend, round_signature, source_tensors

_log = logging.getLogger("refit")

LOADER = "refit.integrations.sglang.refit_loader"
CONTROL_NAME = "__refit_control__"


def control(message: Dict[str, Any]) -> Any:
    """A control message as the uint8 tensor SGLang carries."""
    import torch

    return torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8).clone()


def read_control(tensor: Any) -> Dict[str, Any]:
    return json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())


def sglang_tp() -> Tuple[int, int]:
    """(tp size, tp rank) of this SGLang scheduler process."""
    # From parallel_state itself: 0.5.23's sglang.srt.distributed no longer re-exports these.
    from sglang.srt.distributed.parallel_state import (  # type: ignore[import-not-found]
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def receiver_table(model: Any, tp: int, tp_rank: int, process: int, device: Optional[int]) -> Table:
    """The needs of this SGLang rank's parameters (see the module docstring)."""
    from .layout import ModelShape
    from .vllm import VllmRanks, VllmReceiver

    dtype = str(next(iter(model.parameters())).dtype).rsplit(".", 1)[-1]
    shape = ModelShape.from_hf_config(model.config, dtype=dtype)
    # SGLang's FusedMoE names the experts `mlp.experts.w13_weight` / `w2_weight`; the rules use
    # vLLM 0.33's names for the same layout (`mlp.experts.routed_experts.*`).
    params = [(_rule_name(name), p) for name, p in model.named_parameters()]
    return VllmReceiver(shape, VllmRanks(tp=tp, tp_rank=tp_rank)).table(params, process, device)


def _rule_name(name: str) -> str:
    for weight in (".experts.w13_weight", ".experts.w2_weight"):
        if name.endswith(weight):
            return name[: -len(weight)] + ".experts.routed_experts." + weight[len(".experts.") :]
    return name


class RecordedNeeds:
    """What `recorded_table` gives the receiver: the Table of needs, the staging buffers of the
    checkpoint tensors the recording staged, and the RecordedReceiver that hands them to the live
    model's own `load_weights` after the commit (`install`)."""

    def __init__(self, table: Table, receiver: Any, staging: Dict[str, Any]) -> None:
        self.table = table
        self.receiver = receiver
        self.staging = staging

    def close(self) -> None:
        self.table.close()

    def install(self, model: Any) -> int:
        """After the commit wrote the boxes and the staging buffers: SGLang's own loader on the staged
        tensors (the transforms the recording could not describe as boxes)."""
        import torch

        with torch.no_grad():
            return self.receiver.load_staged(model.load_weights, self.staging)


def sglang_ranks() -> Tuple[Any, ...]:
    """This process's place in SGLang's parallel groups (part of the recording's cache key)."""
    from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found]

    parallel = get_parallel()
    return tuple((name, getattr(parallel, name, None)) for name in ("tp_size", "tp_rank", "moe_ep_size", "moe_ep_rank", "moe_tp_size", "moe_tp_rank", "attn_tp_size", "attn_tp_rank", "pp_size", "pp_rank"))


def recording_key(model_config: Any) -> Tuple[Any, ...]:
    """What this rank's recording depends on besides its parameters' shapes and the checkpoint (the
    recorder's cache key): its place in SGLang's groups, the model's Hugging Face config and the
    server's arguments (expert placement, MoE backend, quantization), so that two models alike in
    every shape but loaded apart never share a recording."""
    from sglang.srt.runtime_context import get_server_args  # type: ignore[import-not-found]

    return sglang_ranks(), model_config.hf_config.to_json_string(use_diff=False), repr(get_server_args())


def build_meta_model(model: Any) -> Tuple[Any, Any]:
    """The live model's class built again on the meta device, as SGLang's loader builds it
    (`_initialize_model` under the model's dtype: the same config, the live model's quant config,
    the parallel state current in this process). Returns (meta model, SGLang ModelConfig)."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig  # type: ignore[import-not-found]
    from sglang.srt.configs.model_config import ModelConfig  # type: ignore[import-not-found]
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model  # type: ignore[import-not-found]
    from sglang.srt.model_loader.utils import set_default_torch_dtype  # type: ignore[import-not-found]
    from sglang.srt.runtime_context import get_server_args  # type: ignore[import-not-found]

    from .vllm import meta_only

    server_args = get_server_args()
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig(load_format=server_args.load_format, download_dir=server_args.download_dir)
    missing = object()
    quant_config = getattr(model, "quant_config", missing)
    if quant_config is missing:
        quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
        meta = _initialize_model(model_config, load_config, quant_config)
    if type(meta) is not type(model):
        raise invalid_argument(f"SGLang builds {type(meta).__name__} for the model path, the engine serves {type(model).__name__}")
    meta_only(meta)
    return meta, model_config


def checkpoint_specs(model_config: Any) -> Dict[str, Tuple[Tuple[int, ...], Any]]:
    """The checkpoint's names, shapes and dtypes (the model folder's safetensors headers, else
    what transformers writes for the config): refit.integrations.vllm.checkpoint_of."""
    from types import SimpleNamespace

    from .vllm import checkpoint_of

    folder = model_config.model_path
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download  # type: ignore[import-not-found]

            folder = snapshot_download(folder, revision=getattr(model_config, "revision", None), allow_patterns=["*.safetensors"], local_files_only=True)
        except Exception:  # noqa: BLE001 - fall back on the config's own tensors
            pass
    shim = SimpleNamespace(model_config=SimpleNamespace(model=folder, hf_config=model_config.hf_config, dtype=model_config.dtype))
    return checkpoint_of(shim)


def _amx_packed(model: Any) -> List[str]:
    """Modules SGLang's CPU post-processing packed for AMX (their weights are no longer the loader's
    layout, and SGLang 0.5.23 cannot restore them)."""
    return [name for name, module in model.named_modules() if getattr(module, "use_intel_amx_backend", False)]


def recorded_table(model: Any, tp: int, tp_rank: int, process: int, device: Optional[int]) -> RecordedNeeds:
    """The needs of this SGLang rank, recorded from its own loader: `model.load_weights` run on a
    meta-device copy of the rank's model (build_meta_model) over meta stand-ins of the checkpoint
    (checkpoint_specs). Tensors the loader transforms are staged whole; `RecordedNeeds.install`
    hands them to the live model's loader after the commit."""
    import torch
    from sglang.srt.model_loader.utils import set_default_torch_dtype  # type: ignore[import-not-found]

    from .receiver import RecordedReceiver
    from .recorder import record

    del tp, tp_rank  # read from SGLang's parallel state (sglang_ranks), with EP and attention TP
    packed = _amx_packed(model)
    if packed:
        raise invalid_argument(
            f"{len(packed)} layers are packed for Intel AMX (e.g. {packed[:2]}): refit writes the loader's layout, and SGLang "
            "0.5.23 packs them again after every weight-update session without unpacking first"
        )
    meta, model_config = build_meta_model(model)
    specs = checkpoint_specs(model_config)
    with set_default_torch_dtype(model_config.dtype):
        recording = record(meta.load_weights, list(meta.named_parameters()), specs, key=recording_key(model_config))
    receiver = RecordedReceiver(recording)
    first = next(iter(model.parameters()))
    staging = receiver.staging_buffers(lambda shape, dtype: torch.empty(shape, dtype=dtype, device=first.device))
    if recording.staged:
        _log.info("refit: SGLang's loader takes %d staged tensors after each commit (%s)", len(recording.staged), "; ".join(sorted(set(recording.staged.values()))))
    table = receiver.table(model.named_parameters(), process, device, staging)
    return RecordedNeeds(table, receiver, staging)


def post_load(model: Any) -> None:
    """SGLang's own post-load fix-up (`model.post_load_weights()`: DeepSeek's MLA derives w_kc / w_vc
    from kv_b_proj.weight). SGLang's end_weight_update skips it after a successful
    update_weights_from_tensor (it assumes load_weights ran it), and refit's commit writes the
    parameters without load_weights."""
    if hasattr(model, "post_load_weights"):
        from sglang.srt.model_loader.loader import post_load_weights  # type: ignore[import-not-found]

        import torch

        with torch.no_grad():
            post_load_weights(model)


class SglangReceiver:
    """One SGLang TP rank's part (see the module docstring). `tp` is (size, rank), read from SGLang
    when not given; `table_of(model, tp, tp_rank, process, device)` describes the needs."""

    def __init__(self, model: Any, tp: Optional[Tuple[int, int]] = None, table_of: Callable[..., Any] = recorded_table) -> None:
        self.model = model
        self.tp = tp
        self.table_of = table_of
        self.link: Optional[Link] = None
        self._table: Optional[Table] = None
        self._needs: Optional[RecordedNeeds] = None
        self._addresses: Optional[List[Tuple[str, int]]] = None
        self.update = InFlight()
        # Each control message this rank could not carry out, newest last (see the module docstring).
        self.refusals: List[str] = []

    def handle(self, message: Dict[str, Any]) -> None:
        op = message.get("op")
        if op == "init":
            self._init(message)
        elif op == "receive":
            self._receive(message)
        elif op == "commit":
            self._commit()
        elif op == "shutdown":
            self.shutdown()
        else:
            raise invalid_argument(f"refit control op {op!r}: init, receive, commit or shutdown")

    def _current_table(self) -> Table:
        addresses = [(name, int(p.data_ptr())) for name, p in self.model.named_parameters()]
        if self._table is None or addresses != self._addresses:
            if self._table is not None:
                self._table.close()
            link = self.link
            assert link is not None
            tp, tp_rank = self.tp or sglang_tp()
            host = link.backend == Backend.HOST
            made = self.table_of(self.model, tp, tp_rank, link.rank, 0 if host else None)
            self._needs = made if isinstance(made, RecordedNeeds) else None
            self._table = made.table if isinstance(made, RecordedNeeds) else made
            self._addresses = addresses
        return self._table

    def _init(self, message: Dict[str, Any]) -> None:
        if self.link is not None:
            self.shutdown()
        backend = resolved_backend(message.get("device_backend", "auto"))
        options = LinkOptions(**message.get("options", {}))
        tp, tp_rank = self.tp or sglang_tp()
        del tp
        device = 0
        if backend != Backend.HOST:
            device = int(next(iter(self.model.parameters())).device.index or 0)
        self.link = Link(bytes.fromhex(message["comm_id"]), message["nranks"], message["rank_offset"] + tp_rank, device, backend, options)
        self.link.prepare(self._current_table())

    def _receive(self, message: Dict[str, Any]) -> None:
        self.update.start(self._need_link(), self._current_table())

    def _commit(self) -> None:
        link = self._need_link()
        self.update.finish(link, None if link.backend == Backend.HOST else _current_stream())
        # Installed: the staged tensors through SGLang's loader, then its post-load fix-up.
        if self._needs is not None:
            self._needs.install(self.model)
        post_load(self.model)

    def _need_link(self) -> Link:
        if self.link is None:
            raise RuntimeError("refit: no refit link on this rank (the trainer sends 'init' first)")
        return self.link

    def shutdown(self) -> None:
        self.update.abort(self.link)
        if self._table is not None:
            self._table.close()
            self._table = None
            self._needs = None
        if self.link is not None:
            self.link.close()
            self.link = None


def _current_stream() -> Any:
    import torch

    return torch.cuda.current_stream()


_receivers: Dict[int, SglangReceiver] = {}


def attach(model: Any, tp: Optional[Tuple[int, int]] = None, table_of: Callable[..., Any] = recorded_table) -> SglangReceiver:
    """The receiver refit_loader uses for `model` (made on the first control message otherwise):
    for a rank whose TP place or layout the caller knows better than SGLang's globals."""
    receiver = _receivers[id(model)] = SglangReceiver(model, tp, table_of)
    return receiver


def refit_loader(model: Any, named_tensors: Sequence[Tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (`custom_weight_loader=[LOADER]`): acts on refit's control
    message; refuses any other tensor (refit moves the weights itself)."""
    for name, tensor in named_tensors:
        if name != CONTROL_NAME:
            raise invalid_argument(f"the refit loader takes only {CONTROL_NAME!r}, not {name!r}")
        receiver = _receivers.get(id(model))
        if receiver is None or receiver.model is not model:
            receiver = _receivers[id(model)] = SglangReceiver(model)
        message = read_control(tensor)
        try:
            receiver.handle(message)
        except Exception as error:  # noqa: BLE001 - raised, it would end SGLang's scheduler
            receiver.refusals.append(f"{message.get('op')}: {error}")
            _log.error("refit: %s on this rank: %s", message.get("op"), error)


def engine_call(engine: Any, flush_cache: bool = False) -> Callable[[List[Tuple[str, Any]], str], Any]:
    """The trainer's engine call for an `sglang.Engine` (or anything with its methods): each control
    message goes through `update_weights_from_tensor`, inside a begin/end weight-update session
    where the engine has one (SGLang 0.5.23 refuses the update outside it), and the session is
    closed whatever the update answered. `flush_cache` is off: refit's calls carry no weights."""

    def call(named_tensors: List[Tuple[str, Any]], load_format: str) -> Any:
        begin = getattr(engine, "begin_weight_update", None)
        if begin is None:
            return engine.update_weights_from_tensor(named_tensors, load_format=load_format, flush_cache=flush_cache)
        opened = begin()
        if isinstance(opened, tuple) and opened and opened[0] is False:
            return opened
        try:
            return engine.update_weights_from_tensor(named_tensors, load_format=load_format, flush_cache=flush_cache)
        finally:
            engine.end_weight_update()

    return call


class SglangTrainer:
    """The trainer's side (every trainer rank; rank 0 sends the control calls). `engine_call(named
    tensors, load_format)` is the engine's update_weights_from_tensor; it must raise (or return a
    falsy success) when a rank refused."""

    def __init__(
        self,
        engine_call: Callable[[List[Tuple[str, Any]], str], Any],
        source: Any,
        num_workers: int,
        rank: int = 0,
        num_trainer_ranks: int = 1,
        device_backend: str = "auto",
        device: Optional[int] = None,
        options: Optional[LinkOptions] = None,
        comm_id: Optional[str] = None,
    ) -> None:
        self.engine_call = engine_call
        self.source = source
        self.is_sender = rank == 0
        self.rounds = 0
        backend = resolved_backend(device_backend)
        options = options or LinkOptions()
        if comm_id is None:
            if num_trainer_ranks > 1:
                raise invalid_argument("trainers of several ranks pass the same comm_id (hex of refit.unique_id) to each")
            comm_id = unique_id(backend).hex()
        if backend == Backend.HOST:
            device = 0
        elif device is None:
            import torch

            device = torch.cuda.current_device()
        nranks = num_trainer_ranks + num_workers
        self._held: List[Tuple[str, Any]] = []
        self._signature: Any = None
        self._table: Optional[Table] = None
        join = None
        if self.is_sender:
            message = {
                "op": "init",
                "comm_id": comm_id,
                "nranks": nranks,
                "rank_offset": num_trainer_ranks,
                "device_backend": {Backend.HOST: "host", Backend.CUDA: "cuda"}[backend],
                "options": {k: getattr(options, k) for k in ("verify", "sm_budget", "arm", "staging_memory_limit", "timeout_ms")},
            }
            join = concurrently(lambda: self._send(message))
        try:
            self.link = Link(bytes.fromhex(comm_id), nranks, rank, device, backend, options)
            self.link.prepare(self._current_table())
        finally:
            if join is not None:
                join()

    def _send(self, message: Dict[str, Any]) -> None:
        outcome = self.engine_call([(CONTROL_NAME, control(message))], LOADER)
        if isinstance(outcome, tuple) and outcome and outcome[0] is False:
            raise RuntimeError(f"refit: the engine refused {message['op']}: {outcome[1] if len(outcome) > 1 else ''}")

    def _current_table(self) -> Table:
        tensors = source_tensors(self.source)
        signature = round_signature(tensors)
        self._held = tensors
        if self._table is None or signature != self._signature:
            if self._table is not None:
                self._table.close()
            host = self.link.backend == Backend.HOST
            self._table = publisher_table(self.source, tensors, self.link.rank, 0 if host else None)
            self._signature = signature
        return self._table

    def update(self) -> None:
        """One update: the engine receives beside its batches, then commits between two."""
        self.rounds += 1
        join = concurrently(lambda: self._send({"op": "receive", "round": self.rounds})) if self.is_sender else None
        try:
            self.link.prepare(self._current_table())
            self.link.run()
        except BaseException as error:
            reasons = []
            if join is not None:
                # The ranks' receive calls return, and the commit ends their update (each refuses).
                for step in (join, lambda: self._send({"op": "commit"})):
                    try:
                        step()
                    except Exception as answer:
                        reasons.append(str(answer))
            raise RuntimeError(f"refit: update refused ({error}); engine: {'; '.join(reasons) or 'no answer'}") from error
        if join is not None:
            join()
        if self.link.staged:
            self.link.commit()
        if self.is_sender:
            self._send({"op": "commit"})

    def shutdown(self) -> None:
        if self.is_sender:
            try:
                self._send({"op": "shutdown"})
            except Exception:
                pass
        if self._table is not None:
            self._table.close()
            self._table = None
        self.link.close()


__all__ = ["CONTROL_NAME", "LOADER", "SglangReceiver", "attach", "SglangTrainer", "control", "engine_call", "read_control", "receiver_table", "refit_loader"]
