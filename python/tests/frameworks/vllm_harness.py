"""vLLM 0.33's own model classes, built on CPU (or the meta device) for one rank at a time in one
process: a tiny Hugging Face config saved with save_pretrained, the real VllmConfig that
EngineArgs.create_engine_config makes from it, a gloo world of one process, and vLLM's TP / PP / EP
group coordinators standing in for the rank being built (world_size, rank_in_group, ranks)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import socket
import struct
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Tuple

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_cpu  # noqa: E402,F401  (vLLM's CPU platform as the suite runs it: see the module)


@dataclasses.dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    ep: bool = False
    placement: str = "linear"
    # A multimodal model's encoder under TP: "weights" (sharded like the language model) or "data"
    # (replicated on every TP rank, each encoding its own images: vLLM's mm_encoder_tp_mode).
    encoder: str = "weights"

    def ranks(self) -> List[Tuple[int, int]]:
        """(tp_rank, pp_rank) of every worker, TP fastest."""
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]

    def label(self) -> str:
        ep = f"_ep_{self.placement}" if self.ep else ""
        encoder = f"_encoder_{self.encoder}" if self.encoder != "weights" else ""
        return f"tp{self.tp}_pp{self.pp}{ep}{encoder}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def _world() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):  # no model config: the EP group is made too
        ps.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", local_rank=0, backend="gloo"
        )
        ps.ensure_model_parallel_initialized(1, 1)


@dataclasses.dataclass(frozen=True)
class HandWritten:
    """A family transformers cannot write, its modeling code on the Hub (trust_remote_code) or its
    format its own: its config as written, and its checkpoint's tensor names and shapes as that
    code saves them, in `files` (Mistral's format: params.json, consolidated.safetensors)."""

    config: Dict[str, Any]
    tensors: Dict[str, Tuple[int, ...]]
    files: Tuple[str, str] = ("config.json", "model.safetensors")


@dataclasses.dataclass(frozen=True)
class ModuleNames:
    """A vision-language family saved under the names its transformers module holds its tensors
    by (model.language_model.*, model.visual.*: its state dict, what a trainer on transformers 5
    publishes), not the Hub's older ones."""

    config: Any


def hf_folder(family: str, hf_config: Any, dtype: torch.dtype = torch.float32) -> str:
    """A folder with the tiny config and the checkpoint transformers itself writes for it
    (save_pretrained of the Hugging Face model: the names and shapes vLLM's loader reads; of its
    image-text class for a vision-language config, as on the Hub, or ModuleNames), its tensors of
    `dtype`; for a HandWritten family, its config and tensors (zeros) as given. No processor or
    tokenizer files: vLLM builds a multimodal model without them (skip_tokenizer_init)."""
    import transformers

    folder = tempfile.mkdtemp(prefix=f"refit-{family}-")
    if isinstance(hf_config, HandWritten):
        from safetensors.torch import save_file

        config_file, weights_file = hf_config.files
        with open(os.path.join(folder, config_file), "w") as handle:
            json.dump(hf_config.config, handle)
        save_file({name: torch.zeros(shape, dtype=dtype) for name, shape in hf_config.tensors.items()}, os.path.join(folder, weights_file))
        return folder
    torch.manual_seed(0)
    if isinstance(hf_config, ModuleNames):
        model = transformers.AutoModelForImageTextToText.from_config(hf_config.config, dtype=dtype)
        model._weight_conversions = []  # nothing to revert: the module's own names
    elif hasattr(hf_config, "vision_config"):  # vision-language: its image-text class, saved as the Hub's
        model = transformers.AutoModelForImageTextToText.from_config(hf_config, dtype=dtype)
        model._weight_conversions = _hub_conversions(model)
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    model.save_pretrained(folder)
    return folder


def _hub_conversions(model: Any) -> List[Any]:
    """The weight conversions transformers applies when it loads this model from a Hub checkpoint,
    which save_pretrained reverts: the checkpoint it writes then has the Hub's names and layouts,
    as vLLM reads them. A model built from a config saves without two of them: the prefixes its
    loading drops (CLIP's and SigLIP's `vision_model.`, PrefixChange) and the transposes its
    loading decides by shape (Qwen3-VL-MoE's fused experts, stored [experts, in, out] on the Hub:
    Transpose with check_dims, which sees no difference on a model's own tensors)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Transpose

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    for conversion in conversions:
        for op in getattr(conversion, "operations", []):
            if isinstance(op, Transpose):
                op.check_dims = False
    return conversions


def config_folder(name: str, hf_config: Any) -> str:
    """A folder with only the config: enough for EngineArgs (load_format "dummy")."""
    import transformers

    folder = tempfile.mkdtemp(prefix=f"refit-{name}-")
    # The causal-LM class, as a saved model names it: without it vLLM builds the base model as a
    # pooling model (no lm_head).
    hf_config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(hf_config)].__name__]
    hf_config.save_pretrained(folder)
    return folder


def meta_checkpoint_specs(hf_config: Any, dtype: torch.dtype = torch.bfloat16) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """The names, shapes and dtypes transformers would write for `hf_config` (its model built on
    the meta device, its state dict converted to the on-disk format as save_pretrained does), for
    models too large to write."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = revert_weight_conversion(model, model.state_dict())
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}


def checkpoint_specs(folder: str) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes from the safetensors headers of `folder`, in file order."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    out: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with open(os.path.join(folder, file), "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, info in sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]):
            out[name] = (tuple(info["shape"]), dtypes[info["dtype"]])
    return out


def index_encoded(specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> Dict[str, torch.Tensor]:
    """Every checkpoint element holds 1 + its index in the concatenation of all tensors (exact in
    float32 below 2^24), so any element found anywhere says where it came from."""
    out, start = {}, 1
    for name, (shape, _) in specs.items():
        n = 1
        for e in shape:
            n *= e
        out[name] = torch.arange(start, start + n, dtype=torch.float64).to(torch.float32).reshape(shape)
        start += n
    if start >= 1 << 24:
        raise ValueError(f"checkpoint of {start} elements is too large to index-encode in float32")
    return out


def engine_config(folder: str, parallel: Parallel, dtype: str = "float32", quantization: Optional[str] = None) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    kwargs: Dict[str, Any] = {}
    if parallel.ep:
        kwargs.update(enable_expert_parallel=True, expert_placement_strategy=parallel.placement)
    if parallel.encoder != "weights":
        kwargs.update(mm_encoder_tp_mode=parallel.encoder)
    args = EngineArgs(
        model=folder,
        tensor_parallel_size=parallel.tp,
        pipeline_parallel_size=parallel.pp,
        dtype=dtype,
        load_format="dummy",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        quantization=quantization,
        **kwargs,
    )
    return args.create_engine_config()


@contextlib.contextmanager
def as_rank(config: Any, parallel: Parallel, tp_rank: int, pp_rank: int) -> Iterator[None]:
    """vLLM's current config and parallel groups as rank (tp_rank, pp_rank) of `parallel` sees
    them. EP (when on) spans the TP ranks of a stage, as vLLM makes it without data parallelism."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    _world()
    groups = [(ps.get_tp_group(), parallel.tp, tp_rank), (ps.get_pp_group(), parallel.pp, pp_rank)]
    if ps._EP is not None:
        groups.append((ps._EP, parallel.tp, tp_rank))
    if getattr(ps, "_ETP", None) is not None and ps._ETP is not ps._TP:
        groups.append((ps._ETP, 1, 0))
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
    """The model vLLM builds for the current rank, on `device` ("cpu" or "meta": then refit's own
    build_meta_model makes it, every parameter on meta)."""
    from refit.integrations.vllm import build_meta_model, forget_pp_layers
    from vllm.model_executor.model_loader.utils import initialize_model

    if device == "meta":
        return build_meta_model(config)
    config.compilation_config.static_forward_context.clear()
    # vLLM's loader builds under the model's dtype as torch's default (set_default_torch_dtype).
    default = torch.get_default_dtype()
    torch.set_default_dtype(config.model_config.dtype)
    try:
        with torch.device(device):
            model = initialize_model(vllm_config=config)
    finally:
        torch.set_default_dtype(default)
    forget_pp_layers(model)  # vLLM caches by id(model); many models come and go here
    return model
