"""Receivers: the parameters of a vLLM model (Llama, Qwen2/3, Qwen3-MoE families) on one worker,
turned into needs of the checkpoint tensors; and a worker extension that receives a refit.

Layout rules, each with the vLLM source file it follows (vllm-project/vllm, paths under vllm/), as
read on its main branch in 2026-12 (V1 engine); the rules below read the same in the older versions
of those files we compared (the weight loaders' narrow/copy logic has not changed in substance).
workloads/src/vllm.rs generates the same pieces for synthetic tables.

- Names are the model's `named_parameters()`: `model.embed_tokens.weight`, `model.layers.{i}.…` with
  `i` the global layer index on every pipeline stage, `model.norm.weight`, `lm_head.weight`
  (model_executor/models/llama.py, qwen3.py, qwen3_moe.py; their stacked_params_mapping).
- `self_attn.qkv_proj` (QKVParallelLinear, model_executor/layers/linear.py): this rank's q rows, then
  its k rows, then its v rows. With fewer kv heads than ranks, each kv head is replicated on
  tp / kv_heads consecutive ranks (num_kv_head_replicas; shard tp_rank // replicas).
- `mlp.gate_up_proj` (MergedColumnParallelLinear): this rank's gate rows, then its up rows;
  `o_proj`, `down_proj` (RowParallelLinear): this rank's block of columns.
- FusedMoE experts (model_executor/layers/fused_moe/layer.py): `w13_weight` [local experts,
  2 * ffn / tp, hidden] with each expert's gate rows (w1) then up rows (w3) (_load_w13),
  `w2_weight` [local experts, hidden, ffn / tp] (_load_w2). Without expert parallelism every rank
  holds every expert, split over TP; with it (enable_expert_parallel) experts are whole and each
  rank holds its own: "linear" placement gives rank r a contiguous block, the first
  experts % ep ranks one more; "round_robin" gives experts r, r + ep, ... (determine_expert_map).
  The router `mlp.gate.weight` is replicated (ReplicatedLinear).
- Vocabulary (VocabParallelEmbedding, ParallelLMHead in model_executor/layers/vocab_parallel_embedding.py):
  padded to a multiple of 64 (DEFAULT_VOCAB_PADDING_SIZE), rows split evenly; rows past the real
  vocabulary are padding no refit writes.
- Pipeline stages (distributed/utils.py get_pp_indices): layers split evenly, the remainder given
  one each to the stages before the last, from the second-to-last backwards
  (VLLM_PP_LAYER_PARTITION overrides: `pp_partition`). The first stage holds embed_tokens (the
  last too when embeddings are tied), the last the final norm and lm_head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .._lib import RefitError, Status, invalid_argument
from ..plan import Plan, Table
from ..tensor import TensorLike
from .layout import (
    ModelShape,
    ParamBuilder,
    ParamLayout,
    add_params,
    check_rank,
    new_table,
    pad_to,
    split,
    vocab_rows,
)


@dataclasses.dataclass(frozen=True)
class VllmRanks:
    """This worker's place in vLLM's parallel groups. `ep` > 1 means expert parallelism is enabled
    (its size is tp * dp in vLLM; `ep_rank` this worker's rank in it). `pp_partition`: per-stage
    layer counts (VLLM_PP_LAYER_PARTITION)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    expert_placement: str = "linear"
    pp_partition: Optional[Tuple[int, ...]] = None
    vocab_padding: int = 64

    def __post_init__(self) -> None:
        for what in ("tp", "pp", "ep"):
            check_rank(getattr(self, what + "_rank"), getattr(self, what), what)
        if self.expert_placement not in ("linear", "round_robin"):
            raise invalid_argument(f"expert placement {self.expert_placement!r}: linear or round_robin")

    @classmethod
    def from_vllm(cls) -> VllmRanks:
        """This process's ranks, read from vLLM's parallel state (inside a vLLM worker)."""
        from vllm.distributed import parallel_state as ps  # type: ignore[import-not-found]

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        pp_group = ps.get_pp_group()
        ep, ep_rank = 1, 0
        get_ep_group = getattr(ps, "get_ep_group", None)
        if get_ep_group is not None:
            try:
                ep_group = get_ep_group()
                ep, ep_rank = ep_group.world_size, ep_group.rank_in_group
            except (AssertionError, AttributeError):  # no expert-parallel group in this setup
                pass
        return cls(tp, tp_rank, pp_group.world_size, pp_group.rank_in_group, ep, ep_rank)


def stage_layers(layers: int, ranks: VllmRanks) -> range:
    """The global layer indices of this pipeline stage (get_pp_indices)."""
    if ranks.pp_partition is not None:
        counts = list(ranks.pp_partition)
        if len(counts) != ranks.pp or sum(counts) != layers:
            raise invalid_argument(f"pp_partition {counts} does not give {layers} layers to {ranks.pp} stages")
    else:
        counts = [layers // ranks.pp] * ranks.pp
        for i in range(2, layers % ranks.pp + 2):
            counts[-i] += 1
    start = sum(counts[: ranks.pp_rank])
    return range(start, start + counts[ranks.pp_rank])


def local_experts(experts: int, ranks: VllmRanks) -> List[int]:
    """The global indices of this worker's experts, in local order (determine_expert_map)."""
    if ranks.ep == 1:
        return list(range(experts))
    if ranks.expert_placement == "round_robin":
        return list(range(ranks.ep_rank, experts, ranks.ep))
    base, extra = divmod(experts, ranks.ep)
    count = base + (ranks.ep_rank < extra)
    start = ranks.ep_rank * base + min(ranks.ep_rank, extra)
    return list(range(start, start + count))


def vllm_layouts(model: ModelShape, ranks: VllmRanks) -> List[ParamLayout]:
    """Every parameter of this worker, in `named_parameters()` order."""
    tp, r = ranks.tp, ranks.tp_rank
    h, hd = model.hidden, model.head_dim
    if model.heads % tp:
        raise invalid_argument(f"{model.heads} query heads do not split over tp {tp}")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise invalid_argument(f"{model.kv_heads} key/value heads neither split nor replicate over tp {tp}")
    q_local = model.q_dim // tp
    if model.kv_heads >= tp:
        kv_n = model.kv_heads // tp
        kv_first = r * kv_n
    else:
        kv_n, kv_first = 1, r // (tp // model.kv_heads)
    kv_local = kv_n * hd
    first_stage, last_stage = ranks.pp_rank == 0, ranks.pp_rank == ranks.pp - 1
    padded = pad_to(model.vocab, ranks.vocab_padding)
    out: List[ParamLayout] = []

    def vocab_param(name: str, tensor: str) -> ParamLayout:
        first, rows, per = vocab_rows(model.vocab, padded, tp, r)
        return ParamBuilder(name, (per, h)).rows(tensor, first, rows, 0).build()

    def vector(name: str, length: int) -> ParamLayout:
        return ParamBuilder(name, (length,)).vector(name, length).build()

    if first_stage or (model.tie_embeddings and last_stage):
        out.append(vocab_param("model.embed_tokens.weight", "model.embed_tokens.weight"))
    for g in stage_layers(model.layers, ranks):
        p = f"model.layers.{g}"
        out.append(vector(f"{p}.input_layernorm.weight", h))
        qkv = ParamBuilder(f"{p}.self_attn.qkv_proj.weight", (q_local + 2 * kv_local, h))
        qkv.rows(f"{p}.self_attn.q_proj.weight", r * q_local, q_local, 0)
        qkv.rows(f"{p}.self_attn.k_proj.weight", kv_first * hd, kv_local, q_local)
        qkv.rows(f"{p}.self_attn.v_proj.weight", kv_first * hd, kv_local, q_local + kv_local)
        out.append(qkv.build())
        if model.qk_norm:
            out.append(vector(f"{p}.self_attn.q_norm.weight", hd))
            out.append(vector(f"{p}.self_attn.k_norm.weight", hd))
        o = ParamBuilder(f"{p}.self_attn.o_proj.weight", (h, q_local))
        out.append(o.rows(f"{p}.self_attn.o_proj.weight", 0, h, 0, (r * q_local, q_local)).build())
        out.append(vector(f"{p}.post_attention_layernorm.weight", h))
        if model.experts:
            gate = ParamBuilder(f"{p}.mlp.gate.weight", (model.experts, h))
            out.append(gate.rows(f"{p}.mlp.gate.weight", 0, model.experts, 0).build())
            out.extend(_fused_moe(model, ranks, p))
        else:
            f = split(model.ffn, tp, "intermediate size")
            gate_up = ParamBuilder(f"{p}.mlp.gate_up_proj.weight", (2 * f, h))
            gate_up.rows(f"{p}.mlp.gate_proj.weight", r * f, f, 0).rows(f"{p}.mlp.up_proj.weight", r * f, f, f)
            out.append(gate_up.build())
            down = ParamBuilder(f"{p}.mlp.down_proj.weight", (h, f))
            out.append(down.rows(f"{p}.mlp.down_proj.weight", 0, h, 0, (r * f, f)).build())
    if last_stage:
        out.append(vector("model.norm.weight", h))
        if not model.tie_embeddings:
            out.append(vocab_param("lm_head.weight", "lm_head.weight"))
    return out


def _fused_moe(model: ModelShape, ranks: VllmRanks, p: str) -> List[ParamLayout]:
    experts = local_experts(model.experts, ranks)
    # Expert parallelism keeps experts whole; otherwise every expert is split over TP.
    moe_tp, moe_rank = (1, 0) if ranks.ep > 1 else (ranks.tp, ranks.tp_rank)
    f = split(model.moe_ffn, moe_tp, "expert intermediate size")
    h = model.hidden
    w13 = ParamBuilder(f"{p}.mlp.experts.w13_weight", (len(experts), 2 * f, h))
    w2 = ParamBuilder(f"{p}.mlp.experts.w2_weight", (len(experts), h, f))
    for j, e in enumerate(experts):
        x = f"{p}.mlp.experts.{e}"
        w13.rows(f"{x}.gate_proj.weight", moe_rank * f, f, j * 2 * f)
        w13.rows(f"{x}.up_proj.weight", moe_rank * f, f, j * 2 * f + f)
        w2.rows(f"{x}.down_proj.weight", 0, h, j * h, (moe_rank * f, f))
    return [w13.build(), w2.build()]


class VllmReceiver:
    """Needs of one vLLM worker's parameters: `receiver.table(model.named_parameters(), process)` is
    that worker's Table of needs, for Plan.build beside the publishers' tables."""

    def __init__(self, model: ModelShape, ranks: VllmRanks) -> None:
        self.model = model
        self.ranks = ranks
        self.layouts = vllm_layouts(model, ranks)

    def add_to(
        self,
        table: Table,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        strict: bool = True,
    ) -> int:
        """Adds this worker's needs to `table` (see layout.add_params); returns how many."""
        return add_params(table, self.model, self.layouts, named_parameters, process, False, device, strict)

    def table(
        self,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        strict: bool = True,
    ) -> Table:
        """A new Table holding this worker's needs."""
        return new_table(lambda table: self.add_to(table, named_parameters, process, device, strict))


class RefitWorkerExtension:
    """Mixed into vLLM's GPU worker with `LLM(..., worker_extension_cls=
    "refit.integrations.vllm.RefitWorkerExtension")`; the trainer drives it with
    `llm.collective_rpc(method, args=...)` (every worker runs the method; results come back as a
    list, one per worker). The calls, in order:

    1. `refit_needs(process)` -> bytes: this worker's table of needs, encoded, with `process` its
       index among the processes taking part in the refit. The trainer gathers every process's
       encoded table (publishers' and receivers').
    2. `refit_receive(tables, process)` -> dict: builds the plan from every table (each worker
       builds the same plan; the fingerprint is returned so the caller can compare), prepares an
       executor for this process once per plan (Plan.executor), runs it on torch's current stream
       and returns its stats as a dict. Later calls with the same tables reuse the executor.
    3. After vLLM's sleep mode moved the weights (wake_up), `refit_rebind()` tells the executor each
       moved parameter's new address: the next refit_receive needs no new plan.
    4. `refit_close()` releases the executor, plan and group.

    The model's shape comes from vLLM's config and the ranks from its parallel state, unless given
    (`model` as ModelShape.from_hf_config's dict form, `ranks` as VllmRanks fields). Methods run on
    the worker, with `self` the worker (self.model_runner.model, self.device).
    """

    _refit_state: Dict[str, Any]

    def _refit(self) -> Dict[str, Any]:
        state = getattr(self, "_refit_state", None)
        if state is None:
            state = self._refit_state = {}
        return state

    def _refit_model(self) -> Any:
        return self.model_runner.model  # type: ignore[attr-defined]

    def refit_needs(
        self,
        process: int,
        model: Optional[Mapping[str, Any]] = None,
        ranks: Optional[Mapping[str, Any]] = None,
        device: Optional[int] = None,
        backend: int = 0,
    ) -> bytes:
        """This worker's needs as an encoded Table (see the class docstring). `device` and `backend`
        (a refit.Backend) are for parameters in host memory standing in for a GPU (tests); by
        default the worker's CUDA device is used."""
        state = self._refit()
        if model is not None:
            shape = ModelShape.from_hf_config(model) if "num_hidden_layers" in model else ModelShape(**model)
        else:
            shape = ModelShape.from_hf_config(self.model_runner.model_config.hf_config)  # type: ignore[attr-defined]
        receiver = VllmReceiver(shape, VllmRanks(**ranks) if ranks is not None else VllmRanks.from_vllm())
        state.update(receiver=receiver, process=process, device=device, backend=backend)
        return self._refit_encode_needs()

    def _refit_encode_needs(self) -> bytes:
        """Encodes this worker's needs at its parameters' current addresses (kept in the state)."""
        state = self._refit()
        params = dict(self._refit_model().named_parameters())
        with state["receiver"].table(params, state["process"], state["device"]) as table:
            encoded = table.encode()
        state.update(
            needs=encoded,
            addresses={name: int(tensor.data_ptr()) for name, tensor in params.items()},
            sizes={name: int(tensor.numel()) * int(tensor.element_size()) for name, tensor in params.items()},
        )
        return encoded

    def refit_receive(
        self, tables: Sequence[bytes], process: Optional[int] = None, options: Optional[Mapping[str, Any]] = None
    ) -> Dict[str, Any]:
        """Builds (once per set of tables) the plan and this process's executor, runs it, and returns
        its stats with the plan's fingerprint. `tables` holds every process's encoded table; this
        worker's own (from refit_needs) is added when absent. `options` are Plan.executor's keyword
        arguments (arm, sm_budget, verify, commit, staging_limit)."""
        from ..group import Group

        state = self._refit()
        if "needs" not in state:
            raise invalid_argument("call refit_needs before refit_receive")
        process = state["process"] if process is None else process
        encoded = list(tables)
        if state["needs"] not in encoded:
            encoded.append(state["needs"])
        key = (tuple(encoded), process, tuple(sorted((options or {}).items())))
        if state.get("key") != key:
            self.refit_close(keep_needs=True)
            decoded = [Table.decode(data) for data in encoded]
            try:
                plan = Plan.build(decoded)
            finally:
                for table in decoded:
                    table.close()
            state["plan"] = plan
            device = state["device"]
            if device is None:
                device = int(self.device.index or 0)  # type: ignore[attr-defined]
            state["group"] = Group([device], backend=state["backend"])
            state["executor"] = plan.executor(state["group"], process, **(options or {}))  # type: ignore[attr-defined]
            state["key"] = key
        stats = state["executor"].run()
        is_dataclass = dataclasses.is_dataclass(stats) and not isinstance(stats, type)
        result = dataclasses.asdict(stats) if is_dataclass else dict(vars(stats))
        result["fingerprint"] = state["plan"].fingerprint
        return result

    def refit_rebind(self) -> int:
        """Tells the executor about every parameter whose storage moved since refit_needs (vLLM's
        sleep mode frees and reallocates the weights); returns how many moved. Where the executor
        cannot follow a move (RefitError PLAN_STALE: the plan joined that parameter's bytes with a
        neighbour's into one strided segment), the plan is dropped and this worker's needs are
        encoded again at the new addresses: the next refit_receive plans again."""
        state = self._refit()
        if "executor" not in state:
            return 0
        device = state["group"].device(0)
        moved, stale = 0, False
        for name, tensor in self._refit_model().named_parameters():
            old = state["addresses"].get(name)
            new = int(tensor.data_ptr())
            if old is not None and old != new:
                if not stale:
                    try:
                        state["executor"].rebind(device, old, new, state["sizes"][name])
                    except RefitError as error:
                        if error.status != Status.PLAN_STALE:
                            raise
                        stale = True
                moved += 1
        if stale:
            self.refit_close(keep_needs=True)
            self._refit_encode_needs()
        else:
            state["addresses"].update(
                (name, int(tensor.data_ptr())) for name, tensor in self._refit_model().named_parameters()
            )
        return moved

    def refit_close(self, keep_needs: bool = False) -> None:
        """Releases the executor, plan and group (and, unless `keep_needs`, forgets the needs)."""
        state = self._refit()
        for key in ("executor", "plan", "group"):
            handle = state.pop(key, None)
            if handle is not None:
                handle.close()
        state.pop("key", None)
        if not keep_needs:
            for key in ("needs", "receiver", "addresses", "sizes", "process", "device", "backend"):
                state.pop(key, None)
