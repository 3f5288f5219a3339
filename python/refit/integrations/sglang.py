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

The rank's needs come from `receiver_table` (SGLang's Llama / Qwen layers fuse q/k/v and gate/up
as vLLM's do; the hand-written vLLM layouts serve until recorded layouts replace them). Nothing
here imports SGLang at import time: its TP rank is read lazily. python/tests/frameworks/
test_sglang_real.py drives the loader through SGLang 0.5.23's own updater and Qwen3 model on CPU.
"""

from __future__ import annotations

import json
import logging
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


class SglangReceiver:
    """One SGLang TP rank's part (see the module docstring). `tp` is (size, rank), read from SGLang
    when not given; `table_of(model, tp, tp_rank, process, device)` describes the needs."""

    def __init__(self, model: Any, tp: Optional[Tuple[int, int]] = None, table_of: Callable[..., Table] = receiver_table) -> None:
        self.model = model
        self.tp = tp
        self.table_of = table_of
        self.link: Optional[Link] = None
        self._table: Optional[Table] = None
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
            self._table = self.table_of(self.model, tp, tp_rank, link.rank, 0 if host else None)
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

    def _need_link(self) -> Link:
        if self.link is None:
            raise RuntimeError("refit: no refit link on this rank (the trainer sends 'init' first)")
        return self.link

    def shutdown(self) -> None:
        self.update.abort(self.link)
        if self._table is not None:
            self._table.close()
            self._table = None
        if self.link is not None:
            self.link.close()
            self.link = None


def _current_stream() -> Any:
    import torch

    return torch.cuda.current_stream()


_receivers: Dict[int, SglangReceiver] = {}


def attach(model: Any, tp: Optional[Tuple[int, int]] = None, table_of: Callable[..., Table] = receiver_table) -> SglangReceiver:
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
