"""Receivers for vLLM: a worker's needs recorded from its own model's `load_weights` (recorder.py),
and a worker extension that receives a refit.

Nothing here describes a model family. `VllmReceiver.from_engine(vllm_config, checkpoint)` builds a
second copy of the worker's model on the meta device (the same class, config and parallel state, so
the same ranks and expert placement the engine itself uses, never assumed), runs its
`load_weights` over meta stand-ins of the checkpoint, and turns what landed where into needs.
Checkpoint tensors the loader transforms (arithmetic, dtype conversion, concatenation with anything
but other checkpoint views) are staged whole and handed to the worker's own `load_weights` after
the refit.

Engines that transform weights after loading (`process_weights_after_loading` of a layer's quant
method or MoE backend: FlashInfer's CUTLASS path swaps w13's halves, its TRT-LLM path re-blocks and
pads, the CPU backend pads and prepacks) would have their live parameters corrupted by
checkpoint-layout bytes. `post_processed` runs the engine's own post-processing on the meta copy and
names every parameter it changes (or could not run on, which counts as changed). Every parameter of
such a layer takes the reload path: the checkpoint tensors that land in them arrive in staging
(whole-shaped buffers holding what the loader reads of them: only the rank's boxes, a tensor-parallel
share, where the recording shows it reads nothing else; RecordedReceiver.reload_boxes), and after the refit `install_staged` hands them to vLLM's own layerwise reload
(vllm/model_executor/model_loader/reload: `initialize_layerwise_reload` puts the layers back in
checkpoint format on meta, the model's `load_weights` fills fresh checkpoint-format parameters,
the layer's post-processing runs, and the result is copied into the live parameters' storage,
which keeps their addresses). `paths` (parameter -> "boxes" / "loader" / "reload" / "quantized")
and one log line say which path each parameter took.

Engines that quantize BF16 checkpoints online (`quantization="fp8_per_block"`, `"fp8_per_channel"`
and `"fp8_per_tensor"`: vLLM's Fp8PerBlockOnlineLinearMethod, Fp8PtpcOnlineLinearMethod and
Fp8PerTensorOnlineLinearMethod) run that
post-processing inside `load_weights`, as soon as a layer has all of its elements, so the meta copy
is compared with the recording as well (parameters that changed or appeared while loading count as
post-processed). Such a layer is quantized by refit during the refit instead, when the meta run
shows that what it serves is exactly its quantizer's output (`online_quantized_layers`):
- blocks: vLLM's own call of `per_block_cast_to_fp8` is watched (its block size and `use_ue8m0`
  choose Arithmetic.DEEPGEMM, or DEEPGEMM_UE8M0 when vLLM asked for power-of-two scales); the live
  `weight` must be that call's codes ([N, K] row-major, the BF16 weight's shape) and
  `weight_scale_inv` its scale grid (float32, [ceil(N / 128), ceil(K / 128)] row-major);
- per channel: vLLM's own call of `_fp8_quant_per_channel` is watched (Arithmetic.VLLM_CHANNEL,
  Granularity.ROW); the live `weight` must be the transpose of its [N, K] row-major codes and
  `weight_scale` the [N, 1] float32 scales it was given;
- per tensor: vLLM's own call of `scaled_fp8_quant` with the layer's scale is watched
  (Arithmetic.VLLM_TENSOR, Granularity.TENSOR); the live `weight` must be the transpose of its
  [N, K] codes and `weight_scale` the one scale it was given; the layer's boxes then share that
  one scale (each box's need names it, and the plan takes the amax over all of them);
where vLLM reduces the amax across the tensor-parallel ranks (at TP > 1: per tensor, every sharded
layer; per channel, the row-parallel layers, a row's scale then depending on other ranks'
columns), each rank's scales also take amax keys (QuantizedParam.shared_amax: one per layer, per
row of a box for per-channel scales; receiver.amax_key, Table.share_amax), so the plan takes the
amax over every rank's boxes: quantized in one batch where one device holds all of them (a trainer
process offering whole tensors), else by the devices holding them, which exchange the amax at every
run (a tensor-parallel trainer), else planning fails
(the weight-transfer backend then plans again with such layers on the reload path: from_engine's
`share_amax`);
and neither may be rewritten afterwards (a GEMM kernel that re-lays or re-scales them, as vLLM's
DeepGEMM path does, keeps the reload path), and every recorded box must fill whole blocks or rows
(receiver.unfit_boxes; per tensor, the boxes must cover the weight). Each box then becomes a quantized need writing FP8 codes into the live
weight at its rows and its scales into the scale parameter (`paths` "quantized" for both), in
place: the parameters keep their addresses.

One adjustment to vLLM's reload: its unquantized MoE method runs the expert backend's own
post-processing (the CPU backend's padding and prepacking) only on the first load (`moe_kernel` not
yet built); a reload through it leaves the experts unprepacked and unpadded, and copying them into
the padded live parameters fails. While the reload runs, those layers' `moe_kernel` is set aside,
so the post-processing is the first load's, then put back (the live storage it points at is
unchanged).

`VllmReceiver(model_shape, ranks)` keeps the hand-written rules of vllm_rules.py for processes where
no loader can run (no torch or vLLM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import struct
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from .._lib import RefitError, Status, invalid_argument
from ..plan import Plan, Table
from ..tensor import TensorLike
from .layout import ModelShape, ParamLayout, add_params, new_table
from ..quant import Arithmetic, Fp8, Granularity, Quantization
from .receiver import QuantizedParam, RecordedReceiver, unfit_boxes
from .recorder import Recording, _storage_key, record
from .vllm_rules import VllmRanks, local_experts, stage_layers, vllm_layouts

log = logging.getLogger("refit.integrations.vllm")

__all__ = [
    "RefitWorkerExtension",
    "VllmRanks",
    "VllmReceiver",
    "build_meta_model",
    "layerwise_reload",
    "checkpoint_of",
    "local_experts",
    "meta_only",
    "online_quantized_layers",
    "post_processed",
    "reload_params",
    "stage_layers",
    "vllm_layouts",
]

Checkpoint = Dict[str, Tuple[Tuple[int, ...], Any]]


def engine_ranks() -> Tuple[Tuple[str, int, int], ...]:
    """This process's (group, size, rank) in each of vLLM's parallel groups, read from the engine;
    part of the recording's cache key (`recording_key`)."""
    from vllm.distributed import parallel_state as ps  # type: ignore[import-not-found]

    out = []
    for name in ("_TP", "_PP", "_DP", "_EP", "_PCP", "_DCP"):
        group = getattr(ps, name, None)
        if group is not None:
            out.append((name, int(group.world_size), int(group.rank_in_group)))
    return tuple(out)


def recording_key(vllm_config: Any) -> Tuple[Any, ...]:
    """What this worker's recording depends on besides its parameters' shapes and the checkpoint
    (the recorder's cache key): its place in vLLM's groups, and the engine's configuration: vLLM's
    own hash of it, and what that hash leaves out but the loader reads (the Hugging Face config, which
    hf_overrides may change; the encoder's TP mode). Two models alike in every shape but placing
    experts apart (DeepSeek-V3.2 with expert groups, GLM-5 without: round-robin against linear) must
    not share a recording."""
    model_config = vllm_config.model_config
    multimodal = getattr(model_config, "multimodal_config", None)
    return (
        engine_ranks(),
        vllm_config.compute_hash(),
        model_config.hf_config.to_json_string(use_diff=False),
        getattr(multimodal, "mm_encoder_tp_mode", None),
    )


@contextlib.contextmanager
def _building(vllm_config: Any) -> Iterator[None]:
    """vLLM's state while a second model is built: the config current, its dtype torch's default
    (as vLLM's loader sets it), and the attention layers' registry kept as the live model left it."""
    import torch
    from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]

    registry = vllm_config.compilation_config.static_forward_context
    saved = dict(registry)
    registry.clear()
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(vllm_config.model_config.dtype)
        with set_current_vllm_config(vllm_config):
            yield
    finally:
        torch.set_default_dtype(default)
        registry.clear()
        registry.update(saved)


def build_meta_model(vllm_config: Any) -> Any:
    """The worker's model class built again on the meta device (no memory), for recording: every
    parameter on meta, those vLLM builds on a real device regardless included (meta_only).

    A class whose constructor reads values it computes (Bloom's ALiBi slopes, `.tolist()`;
    Apertus's xIELU, `.item()`) cannot be built under the meta device: it is built again with the
    tensors it makes from values on the host (_values_on_host), everything else on meta."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model  # type: ignore[import-not-found]

    try:
        with _building(vllm_config), torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config)
    except Exception as error:
        log.info("refit: %s cannot be built on the meta device (%s: %s); built with the values it computes on the host",
                 vllm_config.model_config.architectures, type(error).__name__, error)
        with _building(vllm_config), _values_on_host():
            model = initialize_model(vllm_config=vllm_config)
    forget_pp_layers(model)
    meta_only(model)
    return model


@contextlib.contextmanager
def _values_on_host() -> Iterator[None]:
    """The meta device for every tensor made without a device, but those made from values (tensor,
    arange, linspace, ...): what a constructor computes from them (ALiBi slopes, a scalar it reads
    with item()) stays on the host and readable. A parameter made so is moved by meta_only."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    from_values = {torch.tensor, torch.as_tensor, torch.asarray, torch.arange, torch.range, torch.linspace, torch.logspace, torch.scalar_tensor}
    on_meta = {f for f in _device_constructors() if f not in from_values}

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            if func in on_meta and kwargs.get("device") is None:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    with Mode():
        yield


def meta_only(model: Any) -> List[str]:
    """Puts on the meta device every parameter that building `model` under the meta device left on
    a real one: layers built with an explicit device (Qwen3-Next's gated delta net builds its
    RMSNormGated on current_platform.current_device()) and vLLM's Transformers modeling backend
    (TransformersBase.init_parameters makes every module it did not replace, norms say, on
    vllm_config.device_config.device). Each becomes a meta Parameter of the same shape, strides,
    dtype and attributes (weight_loader, ...); one that several modules share (tied) stays shared.
    Returns the names moved."""
    import torch

    moved: Dict[int, Any] = {}
    names: List[str] = []
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type == "meta":
                continue
            if id(param) not in moved:
                data = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta")
                replacement = torch.nn.Parameter(data, requires_grad=param.requires_grad)
                replacement.__dict__.update(param.__dict__)
                moved[id(param)] = replacement
            module._parameters[name] = moved[id(param)]
            names.append(f"{prefix}.{name}" if prefix else name)
    return names


def forget_pp_layers(model: Any) -> None:
    """vLLM caches each model's (and inner model's) pipeline-missing layers by id(module): a model
    built where a freed one lived would inherit its answer (another stage's layers) and its loader would then fail on its
    own stage's tensors. Dropped right after building, so it is worked out for this model."""
    from vllm.model_executor.models import utils  # type: ignore[import-not-found]

    cache = getattr(utils, "_model_to_pp_missing_layer_names", {})
    for module in model.modules():  # the inner model's loader asks about itself
        cache.pop(id(module), None)


def _same_view(a: Any, b: Any) -> bool:
    """Whether `b` is a tensor viewing the same elements of the same storage as `a`, as the same
    dtype."""
    import torch

    return isinstance(b, torch.Tensor) and _storage_key(a) == _storage_key(b) and (
        a.storage_offset(), tuple(a.stride()), tuple(a.shape), a.dtype
    ) == (b.storage_offset(), tuple(b.stride()), tuple(b.shape), b.dtype)


def _write_watch(on_write: Callable[[int], None]) -> Any:
    """A torch dispatch mode that calls `on_write(storage key)` for every tensor an op writes in
    place. A copy of a view onto itself is no write: replace_parameter makes one of an unchanged
    tensor, and the unquantized MoE method copies back a padding that did not pad."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class WriteWatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            onto_itself = func is torch.ops.aten.copy_.default and len(args) > 1 and _same_view(args[0], args[1])
            for argument, value in zip(func._schema.arguments, args):
                written = argument.alias_info is not None and argument.alias_info.is_write
                if written and isinstance(value, torch.Tensor) and not onto_itself:
                    on_write(_storage_key(value))
            return func(*args, **(kwargs or {}))

    return WriteWatch()


def post_processed(model: Any, vllm_config: Any) -> Dict[str, str]:
    """Parameters (full names) that the engine's own post-processing changes: each layer's
    `quant_method.process_weights_after_loading` run on the meta copy `model`; a parameter it
    replaces, reshapes, re-strides or writes in place counts, and so does every parameter of a
    layer whose post-processing cannot run on the meta device."""

    def snapshot(module: Any) -> Dict[str, Tuple[int, Tuple[int, ...], Tuple[int, ...]]]:
        return {n: (_storage_key(p), tuple(p.shape), tuple(p.stride())) for n, p in module.named_parameters(recurse=False)}

    changed: Dict[str, str] = {}
    with _building(vllm_config):
        for prefix, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            process = getattr(method, "process_weights_after_loading", None)
            if process is None:
                continue
            before = snapshot(module)
            what = f"{type(method).__name__}.process_weights_after_loading"
            written: set = set()  # storage keys written in place
            try:
                with _write_watch(written.add):
                    process(module)
            except Exception as error:  # cannot run on meta: treated as changing every parameter
                for name in before:
                    changed[f"{prefix}.{name}"] = f"{what} (could not run on the meta device: {type(error).__name__})"
                continue
            after = snapshot(module)
            for name in set(before) | set(after):
                if before.get(name) != after.get(name) or (name in before and before[name][0] in written):
                    changed[f"{prefix}.{name}"] = what
    return changed


def changed_since_recorded(recording: Recording, model: Any) -> Dict[str, str]:
    """Parameters of `model` (the meta copy, after the recorded load) that differ from the
    recording's (shape, strides, dtype) or that the recording did not have: vLLM's online
    quantization post-processes a layer inside `load_weights`."""
    why = "post-processed while loading (vLLM's online processing)"
    now = {name: (tuple(p.shape), tuple(p.stride()), p.dtype) for name, p in model.named_parameters()}
    before = {name: (info.shape, info.strides, info.dtype) for name, info in recording.params.items()}
    return {name: why for name in set(now) | set(before) if now.get(name) != before.get(name)}


@dataclasses.dataclass
class OnlineQuantizerCall:
    """What one of vLLM's online FP8 linear methods did to one layer: its quantizer's non-tensor
    arguments (defaults filled in), the codes and scales it served from, whether anything wrote
    into those afterwards, and whether the layer's amax was reduced across the tensor-parallel
    ranks (amax_for_tp_weight_quant with is_sharded; then no rank's boxes hold its scales)."""

    method: str  # "block" (per_block_cast_to_fp8), "channel" (_fp8_quant_per_channel) or "tensor" (scaled_fp8_quant)
    arguments: Dict[str, Any]
    outputs: Tuple[Any, Any]
    rewritten: bool = False
    reduced: bool = False


@contextlib.contextmanager
def _online_quantizer_calls() -> Iterator[Dict[int, OnlineQuantizerCall]]:
    """While open, vLLM's online FP8 linear methods (Fp8PerBlockOnlineLinearMethod,
    Fp8PtpcOnlineLinearMethod, Fp8PerTensorOnlineLinearMethod) post-process layers as usual, but
    their quantizer calls are seen (per layer, keyed by id(layer)): `per_block_cast_to_fp8`'s codes
    and scales, `_fp8_quant_per_channel`'s codes and the scales it was given, or the codes of
    `scaled_fp8_quant` with the per-tensor scale it was given; so is any later write into those,
    and whether the layer's amax went through amax_for_tp_weight_quant sharded. vLLM's own
    functions do the work; they are only wrapped, and put back on exit (vLLM runs the methods
    inside the meta copy's `load_weights`, or in post_processed when the recording came from the
    cache). On meta tensors the amax is not all-reduced: it holds no values, and the other ranks'
    meta copies do not take part; and `scaled_fp8_quant` returns an empty meta tensor of its codes
    without calling its CUDA op."""
    import inspect

    import torch

    calls: Dict[int, OnlineQuantizerCall] = {}
    try:
        from vllm import _custom_ops as ops  # type: ignore[import-not-found]
        from vllm.model_executor.layers.quantization.online import fp8 as online  # type: ignore[import-not-found]
        from vllm.utils import deep_gemm  # type: ignore[import-not-found]
    except ImportError:  # a vLLM without the online methods: no layer is quantized by refit
        yield calls
        return

    layers: List[Any] = []
    per_tensor: List[bool] = []  # beside layers: whether its method is the per-tensor one
    reduced: set = set()  # id(layer) of layers whose amax was reduced across TP ranks
    names = ("Fp8PerBlockOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod", "Fp8PerTensorOnlineLinearMethod")
    methods = [getattr(online, name) for name in names if hasattr(online, name)]
    processes = [(method, method.process_weights_after_loading) for method in methods]
    # The block method calls the name its module imported; DeepGEMM's module holds the function
    # itself. The per-tensor method calls scaled_fp8_quant through the custom ops module.
    wrapped = [(module, "per_block_cast_to_fp8") for module in (online, deep_gemm)] + [
        (online, name) for name in ("_fp8_quant_per_channel", "amax_for_tp_weight_quant") if hasattr(online, name)
    ] + [(ops, "scaled_fp8_quant")]
    originals = [(module, name, getattr(module, name)) for module, name in wrapped]

    def rewrite(key: int) -> None:
        """A write into the current layer's codes or scales after its quantizer returned them."""
        call = calls.get(id(layers[-1])) if layers else None
        if call is not None and key in {_storage_key(t) for t in call.outputs}:
            call.rewritten = True

    def seen_block(quantize: Any) -> Any:
        signature = inspect.signature(quantize)

        def seen_quantize(*args: Any, **kwargs: Any) -> Any:
            codes, scales = result = quantize(*args, **kwargs)
            if layers and id(layers[-1]) not in calls:
                # The innermost call is recorded (it returns first): what DeepGEMM's quantizer was
                # asked for, even where another function stands between it and the method.
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                arguments = {name: value for name, value in bound.arguments.items() if not isinstance(value, torch.Tensor)}
                calls[id(layers[-1])] = OnlineQuantizerCall("block", arguments, (codes, scales))
            return result

        return seen_quantize

    def arguments_of(function: Any) -> Callable[..., Optional[Dict[str, Any]]]:
        """A call's arguments by name, or None where they do not bind (another vLLM's signature:
        then nothing is recorded and the layer keeps the reload path)."""
        try:
            signature: Optional[inspect.Signature] = inspect.signature(function)
        except (TypeError, ValueError):
            signature = None

        def bind(*args: Any, **kwargs: Any) -> Optional[Dict[str, Any]]:
            try:
                return dict(signature.bind(*args, **kwargs).arguments) if signature is not None else None
            except TypeError:
                return None

        return bind

    def seen_channel(quantize: Any) -> Any:
        bind = arguments_of(quantize)

        def seen_quantize(*args: Any, **kwargs: Any) -> Any:
            codes = quantize(*args, **kwargs)
            scale = (bind(*args, **kwargs) or {}).get("scale")
            if layers and id(layers[-1]) not in calls and isinstance(scale, torch.Tensor):
                calls[id(layers[-1])] = OnlineQuantizerCall("channel", {}, (codes, scale))
            return codes

        return seen_quantize

    def seen_tensor(quantize: Any) -> Any:
        bind = arguments_of(quantize)

        def seen_quantize(*args: Any, **kwargs: Any) -> Any:
            bound = bind(*args, **kwargs) or {}
            weight, scale = bound.get("input"), bound.get("scale")
            given = isinstance(scale, torch.Tensor) and scale.numel() == 1 and isinstance(weight, torch.Tensor)
            if given and weight.is_meta and set(bound) <= {"input", "scale"}:
                from vllm.platforms import current_platform  # type: ignore[import-not-found]

                result = (torch.empty(weight.shape, dtype=current_platform.fp8_dtype(), device="meta"), scale)
            else:
                result = quantize(*args, **kwargs)
            if given and layers and per_tensor[-1] and id(layers[-1]) not in calls:
                calls[id(layers[-1])] = OnlineQuantizerCall("tensor", {}, (result[0], scale))
            return result

        return seen_quantize

    def seen_reduction(reduce: Any) -> Any:
        bind = arguments_of(reduce)

        def seen_reduce(*args: Any, **kwargs: Any) -> Any:
            bound = bind(*args, **kwargs) or {}
            amax = bound.get("amax")
            if layers and bound.get("is_sharded", True):
                reduced.add(id(layers[-1]))  # unknown arguments count as reduced: the reload path
            if isinstance(amax, torch.Tensor) and amax.is_meta:
                return amax
            return reduce(*args, **kwargs)

        return seen_reduce

    def seen_process(method: Any, process: Any) -> Any:
        def seen(self: Any, layer: Any) -> Any:
            layers.append(layer)
            per_tensor.append(method.__name__ == "Fp8PerTensorOnlineLinearMethod")
            try:
                with _write_watch(rewrite):
                    return process(self, layer)
            finally:
                layers.pop()
                per_tensor.pop()
                call = calls.get(id(layer))
                if call is not None and id(layer) in reduced:
                    call.reduced = True

        return seen

    wrappers = {"per_block_cast_to_fp8": seen_block, "_fp8_quant_per_channel": seen_channel,
                "amax_for_tp_weight_quant": seen_reduction, "scaled_fp8_quant": seen_tensor}
    for method, process in processes:
        method.process_weights_after_loading = seen_process(method, process)
    for module, name, function in originals:
        setattr(module, name, wrappers[name](function))
    try:
        yield calls
    finally:
        for method, process in processes:
            method.process_weights_after_loading = process
        for module, name, function in originals:
            setattr(module, name, function)


_FP8_TARGETS = {"float8_e4m3fn": Fp8.E4M3FN, "float8_e5m2": Fp8.E5M2}
# The scale parameter each online method serves beside the codes.
_SCALE_PARAMS = {"block": "weight_scale_inv", "channel": "weight_scale", "tensor": "weight_scale"}


def online_quantized_layers(
    model: Any,
    recording: Recording,
    post: Mapping[str, str],
    calls: Mapping[int, OnlineQuantizerCall],
    share_amax: bool = True,
) -> Tuple[Dict[str, QuantizedParam], Dict[str, str]]:
    """Of the meta copy's layers quantized online (calls: _online_quantizer_calls), those refit
    quantizes during the refit (see the module): weight -> QuantizedParam, and layer -> why not for
    the others, which keep the reload path (with `share_amax` False, also the per-tensor layers whose
    amax vLLM reduces across the tensor-parallel ranks)."""
    quantized: Dict[str, QuantizedParam] = {}
    refused: Dict[str, str] = {}
    layouts = {layout.name: layout for layout in recording.layouts}
    staged_params = {param for params in recording.staged_params.values() for param in params}
    for prefix, module in model.named_modules():
        call = calls.get(id(module))
        if call is None:
            continue
        weight, scales = f"{prefix}.weight", f"{prefix}.{_SCALE_PARAMS[call.method]}"
        spec, why = _online_quantized_param(module, call, layouts.get(weight), recording, share_amax)
        others = sorted(n for n in post if n.rsplit(".", 1)[0] == prefix and n not in (weight, scales))
        if why is None and others:
            why = f"its post-processing also changes {others}"
        if why is None and weight in staged_params:
            why = f"{weight} also takes checkpoint tensors the loader transforms"
        if why is None:
            assert spec is not None
            quantized[weight] = spec
        else:
            refused[prefix] = why
    return quantized, refused


def _online_quantized_param(
    module: Any, call: OnlineQuantizerCall, layout: Optional[ParamLayout], recording: Recording, share_amax: bool = True
) -> Tuple[Optional[QuantizedParam], Optional[str]]:
    """The QuantizedParam of one layer vLLM quantizes online, or why it cannot be one. Block
    layers serve the quantizer's [N, K] codes and its [ceil(N / B), ceil(K / B)] scale grid;
    per-channel layers serve the transpose of its [N, K] codes and its [N, 1] scales; per-tensor
    layers the transpose of its [N, K] codes and its one scale, which all of the layer's boxes share
    (their needs name one scale: the plan takes the amax of all of them)."""
    scale_param = _SCALE_PARAMS[call.method]
    weight, scales = getattr(module, "weight", None), getattr(module, scale_param, None)
    if layout is None or weight is None or scales is None:
        return None, f"no recorded boxes land in its weight, or it has no {scale_param}"
    if call.rewritten:
        return None, "its codes or scales are rewritten after quantizing (the GEMM kernel's post-processing)"
    if call.reduced and not share_amax:
        return None, "its scales are amaxes across the tensor-parallel ranks, which this receiver does not share"
    codes, grid = call.outputs
    transposed = call.method in ("channel", "tensor")
    if not (_same_view(weight, codes.t() if transposed else codes) and _same_view(scales, grid)):
        return None, "it serves other tensors than the quantizer's codes and scales (re-laid by the GEMM kernel)"
    target = _FP8_TARGETS.get(str(weight.dtype).rsplit(".", 1)[-1])
    if call.method == "block":
        block = tuple(int(n) for n in call.arguments.get("block_size") or ())
        if target is None or len(block) != 2:
            return None, f"codes of {weight.dtype} or block {list(block)} are not one refit quantizes"
        arithmetic = Arithmetic.DEEPGEMM_UE8M0 if call.arguments.get("use_ue8m0") else Arithmetic.DEEPGEMM
        quantization = Quantization(target, Granularity.BLOCK, block, arithmetic)
    elif target is None:
        return None, f"codes of {weight.dtype} are not one refit quantizes"
    elif call.method == "channel":
        quantization = Quantization(target, Granularity.ROW, arithmetic=Arithmetic.VLLM_CHANNEL)
    else:
        quantization = Quantization(target, Granularity.TENSOR, arithmetic=Arithmetic.VLLM_TENSOR)
    # Scales whose amax vLLM reduces across the tensor-parallel ranks (a sharded per-tensor layer's
    # one scale, a row-parallel per-channel layer's rows) are the whole weight's: every rank's copy
    # shares one amax key.
    spec = QuantizedParam(f"{layout.name.rsplit('.', 1)[0]}.{scale_param}", quantization, transposed, call.reduced)
    why = spec.unfit_live(layout, weight, scales)
    if why is None:
        one_scale = quantization.granularity == Granularity.TENSOR
        why = unfit_boxes(layout, spec.block(layout.shape), recording.checkpoint, one_scale=one_scale)
    return (spec, None) if why is None else (None, why)


def checkpoint_of(vllm_config: Any) -> Checkpoint:
    """The checkpoint's names, shapes and dtypes: the safetensors headers of the model folder when
    it is on disk, else what transformers writes for the Hugging Face config (its model built on the
    meta device, converted to the on-disk names as save_pretrained does)."""
    import torch

    folder = str(vllm_config.model_config.model)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if files:
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}
        out: Checkpoint = {}
        for file in files:
            with open(os.path.join(folder, file), "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    out[name] = (tuple(info["shape"]), dtypes.get(info["dtype"], info["dtype"]))
        return out
    import transformers  # type: ignore[import-not-found]
    from transformers.core_model_loading import revert_weight_conversion  # type: ignore[import-not-found]

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(vllm_config.model_config.hf_config, dtype=vllm_config.model_config.dtype)
    return {name: (tuple(t.shape), t.dtype) for name, t in revert_weight_conversion(hf, hf.state_dict()).items()}


def _checkpoint_specs(checkpoint: Optional[Sequence[Tuple[str, Sequence[int], str]]]) -> Optional[Checkpoint]:
    if checkpoint is None:
        return None
    import torch

    return {name: (tuple(int(n) for n in shape), getattr(torch, dtype)) for name, shape, dtype in checkpoint}


def reload_params(post: Mapping[str, str], params: Iterable[str]) -> Dict[str, str]:
    """Every parameter of a layer the engine post-processes (vLLM's reload runs a layer's
    post-processing once all of its parameters are loaded, so all of them take that path)."""
    layers = {name.rsplit(".", 1)[0]: why for name, why in post.items()}
    return {name: layers[name.rsplit(".", 1)[0]] for name in params if name.rsplit(".", 1)[0] in layers}


def layerwise_reload(model: Any, model_config: Any, layers: Sequence[Any], tensors: Sequence[Tuple[str, Any]]) -> None:
    """vLLM's own reload of `layers` (each post-processed after loading) from checkpoint tensors:
    back to checkpoint format, `model.load_weights`, the layer's post-processing, then copied into
    the live storage. Only these layers take part: the others keep their parameters as they are."""
    import torch
    from vllm.model_executor.model_loader.reload import (  # type: ignore[import-not-found]
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    scope = torch.nn.ModuleList(layers)
    # The first load's post-processing (see the module): the MoE kernel set aside while it runs.
    methods = [getattr(layer, "quant_method", None) for layer in layers]
    kernels = [(method, method.moe_kernel) for method in methods if getattr(method, "moe_kernel", None) is not None]
    for method, _ in kernels:
        method.moe_kernel = None
    try:
        with torch.no_grad():
            initialize_layerwise_reload(scope)
            model.load_weights(iter(tensors))
            finalize_layerwise_reload(scope, model_config)
    finally:
        for method, kernel in kernels:
            method.moe_kernel = kernel


class VllmReceiver:
    """Needs of one vLLM worker's parameters: `receiver.table(model.named_parameters(), process)`
    is that worker's Table of needs, for Plan.build beside the publishers' tables.

    `VllmReceiver.from_engine(vllm_config)` records them from the worker's own loader (inside a
    worker: its config and parallel state current); `VllmReceiver(recording)` wraps a recording
    made elsewhere; `VllmReceiver(model_shape, ranks)` uses the hand-written rules, for processes
    without torch or vLLM (vllm_rules.py)."""

    def __init__(
        self,
        model: Union[ModelShape, Recording],
        ranks: Optional[VllmRanks] = None,
        post: Optional[Mapping[str, str]] = None,
        quantized: Optional[Mapping[str, QuantizedParam]] = None,
        added: Sequence[str] = (),
    ) -> None:
        """`post`: parameters the engine post-processes (post_processed); `quantized`: weights refit
        quantizes, whose layers leave the reload path (online_quantized_layers); `added`: parameters
        the post-processing creates (the live model holds them, the recording does not)."""
        self.post_processed: Dict[str, str] = dict(post or {})
        self.quantized: Dict[str, QuantizedParam] = dict(quantized or {})
        self.paths: Dict[str, str] = {}
        self.reload_layers: List[str] = []
        if isinstance(model, Recording):
            self.recording: Optional[Recording] = model
            layers = {name.rsplit(".", 1)[0] for name in self.quantized}
            to_reload = {name: why for name, why in self.post_processed.items() if name.rsplit(".", 1)[0] not in layers}
            reloaded = reload_params(to_reload, [*model.params, *added])
            self.reload_layers = sorted({name.rsplit(".", 1)[0] for name in reloaded})
            self.recorded: Optional[RecordedReceiver] = RecordedReceiver(model, reloaded, self.quantized, added)
            self.layouts: List[ParamLayout] = self.recorded.layouts
            self.staged: Dict[str, str] = dict(self.recorded.staged)
            self.reload: Dict[str, str] = dict(self.recorded.reload)
            self.paths = dict(self.recorded.paths)
            self.model: Optional[ModelShape] = None
            log.info("refit: %s", self.summary())
        else:
            if ranks is None:
                raise invalid_argument("VllmReceiver(model_shape, ranks) needs the ranks")
            self.recording, self.recorded, self.staged, self.reload = None, None, {}, {}
            self.model, self.ranks = model, ranks
            self.layouts = vllm_layouts(model, ranks)

    @classmethod
    def from_engine(
        cls, vllm_config: Any, checkpoint: Optional[Checkpoint] = None, quantize: bool = True, share_amax: bool = True
    ) -> VllmReceiver:
        """Records this worker's needs from its own model class and loader (see the module).
        `quantize`: layers vLLM quantizes online (in blocks, per channel, per tensor) are quantized by refit during
        the refit where they can be (else, and with False, they take vLLM's reload path). `share_amax` False keeps
        the per-tensor layers whose amax vLLM reduces across the tensor-parallel ranks on the reload path too
        (their quantized needs share an amax key, which a plan refuses when no one device of the trainer holds
        every rank's shards of a layer)."""
        meta = build_meta_model(vllm_config)
        specs = checkpoint if checkpoint is not None else checkpoint_of(vllm_config)
        with _online_quantizer_calls() as calls:
            with _building(vllm_config):
                recording = record(meta.load_weights, list(meta.named_parameters()), specs, key=recording_key(vllm_config))
            post = post_processed(meta, vllm_config)
        for name, why in changed_since_recorded(recording, meta).items():
            post.setdefault(name, why)
        added = sorted(name for name, _ in meta.named_parameters() if name not in recording.params)
        quantized: Dict[str, QuantizedParam] = {}
        if quantize:
            quantized, refused = online_quantized_layers(meta, recording, post, calls, share_amax)
            for layer, why in sorted(refused.items()):
                log.info("refit: %s keeps vLLM's reload path: %s", layer, why)
        return cls(recording, post=post, quantized=quantized, added=added)

    def summary(self) -> str:
        """Which path the parameters take: boxes, the loader from staging, or the engine's reload."""
        counts = {path: sum(1 for p in self.paths.values() if p == path) for path in ("boxes", "loader", "reload", "quantized")}
        text = f"{counts['boxes']} parameters receive boxes, {counts['loader']} go through the loader from staging"
        if self.quantized:
            arithmetic = sorted({spec.quantization.arithmetic.name for spec in self.quantized.values()})
            text += (
                f", {counts['quantized']} in {len(self.quantized)} layers are quantized by refit during the refit "
                f"(FP8 codes and scales, {'/'.join(arithmetic)})"
            )
        if self.reload:
            reasons = sorted(set(self.reload.values()))
            assert self.recorded is not None
            parts = len(self.recorded.reload_boxes)
            staged = f"{parts} of them only the boxes the loader reads" if parts else "whole"
            text += (
                f", {counts['reload']} in {len(self.reload_layers)} layers go through vLLM's layerwise reload "
                f"({len(self.reload)} checkpoint tensors staged, {staged}; {'; '.join(reasons)})"
            )
        else:
            text += ", 0 through vLLM's layerwise reload"
        return text

    def staging_buffers(self, allocate: Any) -> Dict[str, Any]:
        """Buffers for the staged checkpoint tensors (RecordedReceiver.staging_buffers)."""
        return self.recorded.staging_buffers(allocate) if self.recorded is not None else {}

    def load_staged(self, loader: Any, staging: Mapping[str, Any]) -> int:
        """The engine's loader on the staged tensors, after the refit wrote them (not those of the
        reload path: install_staged runs both)."""
        return self.recorded.load_staged(loader, staging) if self.recorded is not None else 0

    def install_staged(self, model: Any, staging: Mapping[str, Any], model_config: Any) -> Dict[str, int]:
        """After the refit wrote the staging buffers: the loader's tensors through `model.load_weights`,
        then the post-processed layers' through vLLM's layerwise reload (see the module). Returns
        how many checkpoint tensors took each path."""
        loaded = self.load_staged(model.load_weights, staging)
        reloaded = 0
        if self.recorded is not None and self.reload:
            tensors = self.recorded.reloaded_tensors(staging)
            layerwise_reload(model, model_config, [model.get_submodule(name) for name in self.reload_layers], tensors)
            reloaded = len(tensors)
        return {"loader": loaded, "reload": reloaded}

    def add_to(
        self,
        table: Table,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        strict: bool = True,
        staging: Optional[Mapping[str, TensorLike]] = None,
    ) -> int:
        """Adds this worker's needs to `table`; returns how many. Recorded: every parameter must be
        the recorded one (RecordedReceiver.add_to). Rules: see layout.add_params (`strict`)."""
        if self.recorded is not None:
            return self.recorded.add_to(table, named_parameters, process, device, staging)
        assert self.model is not None
        return add_params(table, self.model, self.layouts, named_parameters, process, False, device, strict)

    def table(
        self,
        named_parameters: Mapping[str, TensorLike] | Iterable[Tuple[str, TensorLike]],
        process: int,
        device: Optional[int] = None,
        strict: bool = True,
        staging: Optional[Mapping[str, TensorLike]] = None,
    ) -> Table:
        """A new Table holding this worker's needs."""
        return new_table(lambda table: self.add_to(table, named_parameters, process, device, strict, staging))


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
        checkpoint: Optional[Sequence[Tuple[str, Sequence[int], str]]] = None,
        quantize: bool = True,
        share_amax: bool = True,
    ) -> bytes:
        """This worker's needs as an encoded Table (see the class docstring), recorded from its own
        model's loader (VllmReceiver.from_engine) with the ranks and expert placement the engine
        uses. `checkpoint`: the trainer's (name, shape, dtype name) of every checkpoint tensor
        (default: the model folder's safetensors headers, else the Hugging Face config's).
        `model` and `ranks` (ModelShape / VllmRanks fields) select the hand-written rules instead,
        for workers without torch (tests). `device` and `backend` (a refit.Backend) are for
        parameters in host memory standing in for a GPU (tests); by default the worker's CUDA device.
        `quantize`: layers vLLM quantizes online (in blocks, per channel, per tensor) are quantized by refit
        during the refit (False: they take vLLM's reload path; see VllmReceiver.from_engine). Their quantized
        needs have no staging: a trainer whose offers split a 128 x 128 block, or at TP > 1 per tensor one
        whose shards of a layer no one device holds all of, is refused at planning (UNSUPPORTED, naming the
        tensor); pass False for such a trainer, or for the second case `share_amax` False (per-tensor
        layers whose amax vLLM reduces across the ranks then take the reload path alone; the
        weight-transfer backend does so by itself)."""
        state = self._refit()
        if model is not None or ranks is not None:
            if model is None:
                raise invalid_argument("ranks= selects the hand-written rules, which need model= too")
            shape = ModelShape.from_hf_config(model) if "num_hidden_layers" in model else ModelShape(**model)
            receiver = VllmReceiver(shape, VllmRanks(**(ranks or {})))
        else:
            receiver = VllmReceiver.from_engine(self._refit_config(), _checkpoint_specs(checkpoint), quantize, share_amax)
        staging: Dict[str, Any] = {}
        if receiver.staged or receiver.reload:
            import torch

            params = list(self._refit_model().parameters())
            where = params[0].device if params else torch.device("cpu")
            staging = receiver.staging_buffers(lambda shape, dtype: torch.empty(shape, dtype=dtype, device=where))
        state.update(receiver=receiver, process=process, device=device, backend=backend, staging=staging)
        return self._refit_encode_needs()

    def _refit_config(self) -> Any:
        config = getattr(self, "vllm_config", None)
        return config if config is not None else self.model_runner.vllm_config  # type: ignore[attr-defined]

    def _refit_encode_needs(self) -> bytes:
        """Encodes this worker's needs at its parameters' current addresses (kept in the state)."""
        state = self._refit()
        params = dict(self._refit_model().named_parameters())
        receiver = state["receiver"]
        with receiver.table(params, state["process"], state["device"], staging=state.get("staging") or None) as table:
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
        arguments (arm, sm_budget, verify, commit, staging_limit). Where the executor finds a rebound
        parameter inside its copies (PLAN_STALE), this worker's needs are encoded again at the
        current addresses and the plan is built again (needs returned before are ignored in
        `tables`)."""
        state = self._refit()
        if "needs" not in state:
            raise invalid_argument("call refit_needs before refit_receive")
        process = state["process"] if process is None else process
        try:
            stats = self._refit_executor(tables, process, options).run()
        except RefitError as error:
            if error.status != Status.PLAN_STALE:
                raise
            # A rebound parameter now lies where the plan's coalesced copies write (the executor
            # found it before copying): plan again at the current addresses.
            self.refit_close(keep_needs=True)
            state.setdefault("old_needs", set()).add(state["needs"])
            self._refit_encode_needs()
            stats = self._refit_executor(tables, process, options).run()
        if state.get("staging"):
            # The staged tensors arrived in checkpoint layout: the engine's own loader places them,
            # and its reload path rebuilds the post-processed layers (after the copies).
            state["receiver"].install_staged(self._refit_model(), state["staging"], self._refit_config().model_config)
        is_dataclass = dataclasses.is_dataclass(stats) and not isinstance(stats, type)
        result = dataclasses.asdict(stats) if is_dataclass else dict(vars(stats))
        result["fingerprint"] = state["plan"].fingerprint
        return result

    def _refit_executor(self, tables: Sequence[bytes], process: int, options: Optional[Mapping[str, Any]]) -> Any:
        """The executor for these tables (built once per set of tables and options)."""
        from ..group import Group

        state = self._refit()
        old = state.get("old_needs", set())
        encoded = [data for data in tables if data not in old]
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
        return state["executor"]

    def refit_rebind(self) -> int:
        """Tells the executor about every parameter whose storage moved since refit_needs (vLLM's
        sleep mode frees and reallocates the weights); returns how many moved. Where the executor
        cannot follow a move (RefitError PLAN_STALE: the plan joined that parameter's bytes with a
        neighbour's into one strided segment; UNSUPPORTED: quantized needs write it), the plan is
        dropped and this worker's needs are encoded again at the new addresses: the next
        refit_receive plans again."""
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
                        # UNSUPPORTED: quantized needs read or write the range (refit_table_add_quantized_need).
                        if error.status not in (Status.PLAN_STALE, Status.UNSUPPORTED):
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
            for key in ("needs", "receiver", "addresses", "sizes", "process", "device", "backend", "staging", "old_needs"):
                state.pop(key, None)
