"""vLLM 0.33's own model classes built for one rank at a time in one process, on CPU or the meta
device: a Hugging Face config saved to a folder, the VllmConfig EngineArgs makes from it, a gloo
world of one process, and vLLM's TP / PP / EP group coordinators standing in for the rank being
built; or, for a rank that runs in its own process beside the others (join_tp_world), vLLM's real
TP group over gloo, so that what vLLM reduces across the ranks (an FP8 layer's amax) is reduced.
Used by the transfer-bytes bench and the backend tests (the layouts suite has its own harness of
the same kind; this one stays small and only serves these two)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
from typing import Any, Dict, Iterator, Tuple

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_cpu  # noqa: E402,F401  (vLLM's CPU platform as the suite runs it: see the module)

Specs = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Whether this process joined a world of several (join_tp_world): then world() makes none.
_joined = False


def _gloo_world(size: int, rank: int, port: int) -> None:
    """vLLM's world of `size` gloo processes, this one `rank`, and its groups: TP across all of them
    (the EP group too: made under a config without a model)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
        )
        # Made already by another module of the suite (vllm_harness): its groups serve here too (a
        # second call would ask torch about a world group another test may have destroyed since).
        if not ps.model_parallel_is_initialized():
            ps.ensure_model_parallel_initialized(size, 1)


@functools.lru_cache(maxsize=None)
def world() -> None:
    """A one-process gloo world with vLLM's groups, unless this process joined a world of several."""
    if not _joined:
        _gloo_world(1, 0, free_port())


def join_tp_world(rank: int, size: int, port: int) -> None:
    """This process is TP rank `rank` of `size` processes that each call this with the same `port`
    (a gloo world of them all, TP across all of them): vLLM's collectives over the TP group then
    reach the other processes. Call it before as_rank, which then finds the groups as they are."""
    global _joined
    _gloo_world(size, rank, port)
    _joined = True


def leave_tp_world() -> None:
    """Takes down what join_tp_world made (vLLM's groups, their shared-memory queues, the world)."""
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def config_folder(hf_config: Any) -> str:
    folder = tempfile.mkdtemp(prefix="refit-backend-")
    hf_config.save_pretrained(folder)
    return folder


def engine_config(folder: str, tp: int, ep: bool = False, dtype: str = "bfloat16", **extra: Any) -> Any:
    """vLLM's VllmConfig for the model in `folder` at TP `tp` (EP on or off)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=folder,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        dtype=dtype,
        load_format="dummy",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        **extra,
    )
    return args.create_engine_config()


@contextlib.contextmanager
def as_rank(config: Any, tp_rank: int) -> Iterator[None]:
    """vLLM's current config and groups as TP rank `tp_rank` sees them (EP, when vLLM makes it,
    spans the TP ranks: no data parallelism)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    world()
    tp = config.parallel_config.tensor_parallel_size
    groups = [(ps.get_tp_group(), tp, tp_rank)]
    if ps._EP is not None:
        groups.append((ps._EP, tp, tp_rank))
    saved = [(g, g.world_size, g.rank_in_group, g.ranks, g.rank) for g, _, _ in groups]
    try:
        for group, size, rank in groups:
            group.world_size, group.rank_in_group, group.ranks, group.rank = size, rank, list(range(size)), rank
        with set_current_vllm_config(config):
            yield
    finally:
        for group, size, rank, ranks, global_rank in saved:
            group.world_size, group.rank_in_group, group.ranks, group.rank = size, rank, ranks, global_rank


def build(config: Any, device: str) -> torch.nn.Module:
    """The model vLLM builds for the current rank on `device` ("cpu" or "meta")."""
    from vllm.model_executor.model_loader.utils import initialize_model

    config.compilation_config.static_forward_context.clear()
    default = torch.get_default_dtype()
    torch.set_default_dtype(config.model_config.dtype)
    try:
        with torch.device(device):
            return initialize_model(vllm_config=config)
    finally:
        torch.set_default_dtype(default)


def checkpoint_specs(hf_config: Any, dtype: torch.dtype = torch.bfloat16) -> Specs:
    """The checkpoint transformers writes for `hf_config` (names, shapes, dtypes in state-dict
    order): its model built on the meta device, converted to the on-disk format as save_pretrained
    does. No download, no bytes."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = revert_weight_conversion(model, model.state_dict())
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
