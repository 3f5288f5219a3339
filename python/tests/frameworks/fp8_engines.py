"""Shared by the FP8 refit tests: a vLLM 0.33 engine that quantizes BF16 weights online
(`quantization="fp8_per_block"`), built on CPU for one rank with vLLM's own loader and
post-processing, a trainer's BF16 checkpoints, and the element-by-element comparison of what refit
installed with what vLLM's own fresh load serves.

The GEMM kernel is a stand-in (this CPU lacks the AMX that vLLM's CPU FP8 kernels need): with
`use_kernel(cutlass_kernel())` kernel selection returns CutlassFp8BlockScaledMMKernel, whose weight post-processing
is vLLM's own; `use_kernel(cls)` selects another class for the engines built after it (the tests
of layouts a kernel re-lays)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

import refit
import vllm_cpu  # noqa: F401  (vLLM's CPU platform as the suite runs it: see the module)
import vllm_harness as harness
from compare import offers
from refit.integrations import RefitWorkerExtension


def qwen3_config() -> Any:
    """A Qwen3 whose FP8 layers' shards hold whole 128 x 128 blocks: head_dim 128 and 2 kv heads, so
    q, k and v shards of 256 / 128 rows at TP 1 / 2, as in real models."""
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=160, head_dim=128,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False)


def use_kernel(kernel: Any) -> Any:
    """Kernel selection for FP8 layers returns `kernel` from now on; returns the selection it
    replaced (pass it back to restore)."""
    from vllm.model_executor.kernels import linear as kernels

    before = kernels.choose_scaled_mm_linear_kernel
    kernels.choose_scaled_mm_linear_kernel = kernel if not isinstance(kernel, type) else (lambda **_: kernel)
    return before


def use_scaled_fp8_quant(quantize: Any) -> Any:
    """vLLM's `ops.scaled_fp8_quant` is `quantize` from now on; returns the function it replaced
    (pass it back to restore)."""
    from vllm import _custom_ops as ops

    before = ops.scaled_fp8_quant
    ops.scaled_fp8_quant = quantize
    return before


def static_scaled_fp8_quant(input: torch.Tensor, scale: Any = None, *args: Any, **kwargs: Any) -> Any:
    """A stand-in for `ops.scaled_fp8_quant` with a given per-tensor scale, which vLLM's per-tensor
    online FP8 (`quantization="fp8_per_tensor"`, Fp8PerTensorOnlineLinearMethod) calls and whose
    CUDA op (torch.ops._C.static_scaled_fp8_quant) vLLM's CPU wheel lacks: each element times the
    f32 reciprocal of the scale, clamped to +-448 as its kernel's fmaxf(-448, fminf(q, 448)) does (a
    NaN product becomes +448), cast to e4m3. The fresh loads the tests compare with use it too, and
    test_vllm_quantizers compares refit's REFIT_ARITHMETIC_VLLM_TENSOR with it."""
    if scale is None or scale.numel() != 1:
        raise NotImplementedError("the stand-in quantizes with a given per-tensor scale only")
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    product = input.float() * (1.0 / scale.float())
    clamped = torch.where(product.isnan(), fp8_max, product).clamp(-fp8_max, fp8_max)
    return clamped.to(torch.float8_e4m3fn), scale


def use_triton_moe_backend() -> Any:
    """vLLM's online FP8 MoE methods take the Triton backend from now on (they find no FP8 MoE
    backend on CPU and raise "Unsupported FP8 MoE backend: NONE"): the backend whose weights keep
    the layout the quantizer gave them (no load-time shuffle), as on an H100 or H200 without
    DeepGEMM. Its kernel is not built (it needs Triton; nothing here runs it). Returns a function
    that puts both back."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle
    from vllm.model_executor.layers.quantization.online import fp8 as online

    select, make = online.select_fp8_moe_backend, oracle.make_fp8_moe_kernel

    def triton(**_: Any) -> Any:
        return oracle.Fp8MoeBackend.TRITON, object  # experts class: only checked to be set

    def no_kernel(**_: Any) -> Any:
        return None

    online.select_fp8_moe_backend, oracle.make_fp8_moe_kernel = triton, no_kernel

    def restore() -> None:
        online.select_fp8_moe_backend, oracle.make_fp8_moe_kernel = select, make

    return restore


def qwen3_moe_config() -> Any:
    """A Qwen3-MoE whose FP8 layers' shards hold whole 128 x 128 blocks (8 experts of 256 x 256)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=8,
                          num_experts_per_tok=2, vocab_size=160, max_position_embeddings=256, tie_word_embeddings=False)


def cutlass_kernel() -> Any:
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel

    return CutlassFp8BlockScaledMMKernel


def bf16_checkpoints(folder: str, count: int, seed: int = 5) -> List[Dict[str, torch.Tensor]]:
    """`count` different BF16 checkpoints with the folder's names and shapes, each drawn anew (a
    trainer's step). Rows span 2^-24 to 2^4, so that blocks' scales differ widely and the first
    blocks' amax lies below DeepGEMM's 1e-4 floor (an arithmetic without it scales them otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ckpt = {}
        for name, (shape, _) in harness.checkpoint_specs(folder).items():
            t = torch.randn(shape, generator=generator)
            if len(shape) == 2:
                t = t * torch.logspace(-24, 4, shape[0], base=2)[:, None]
            ckpt[name] = t.to(torch.bfloat16)
        out.append(ckpt)
    return out


def served(config: Any, ckpt: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """What vLLM serves from `ckpt` on the current rank: its model class, load_weights (which
    quantizes the FP8 layers online), then process_weights_after_loading."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = harness.build(config, "cpu")
    model.load_weights(iter(ckpt.items()))
    process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model


def publisher_table(ckpt: Dict[str, torch.Tensor]) -> bytes:
    """The trainer's offers of whole checkpoint tensors from host memory (one publishing rank,
    device 0), encoded."""
    with refit.Table() as table:
        offers(table, ckpt, 0)
        return table.encode()


class Worker(RefitWorkerExtension):
    """What vLLM's worker gives the extension: vllm_config and model_runner.model."""

    def __init__(self, config: Any, model: Any) -> None:
        self.vllm_config = config
        self.model_runner = type("Runner", (), {"model": model})()


@dataclasses.dataclass
class Compared:
    codes: int = 0  # FP8 codes compared (bytes)
    scales: int = 0  # float32 scales compared (bit patterns)
    other: int = 0  # elements of the other parameters
    mismatches: List[str] = dataclasses.field(default_factory=list)


def compare(expected: torch.nn.Module, got: torch.nn.Module) -> Compared:
    """Every parameter of `got` against `expected`, bit for bit: FP8 codes as bytes, float32 scales
    as their bit patterns, the rest by value (BF16 embeddings, norms, lm_head)."""
    out = Compared()
    want, have = dict(expected.named_parameters()), dict(got.named_parameters())
    if set(want) != set(have):
        out.mismatches.append(f"parameter names differ: {sorted(set(want) ^ set(have))}")
    for name in sorted(set(want) & set(have)):
        w, h = want[name].detach(), have[name].detach()
        if (w.shape, w.dtype, w.stride()) != (h.shape, h.dtype, h.stride()):
            out.mismatches.append(f"{name}: {tuple(h.shape)}/{h.dtype}/{h.stride()}, vLLM {tuple(w.shape)}/{w.dtype}/{w.stride()}")
            continue
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            bad, out.codes = int((w.view(torch.uint8) != h.view(torch.uint8)).sum()), out.codes + w.numel()
        elif name.endswith(("weight_scale_inv", "weight_scale")):
            bad, out.scales = int((w.view(torch.int32) != h.view(torch.int32)).sum()), out.scales + w.numel()
        else:
            bad, out.other = int((w != h).sum()), out.other + w.numel()
        if bad:
            out.mismatches.append(f"{name}: {bad} of {w.numel()} differ")
    return out


# vLLM's online FP8 linear methods: `quantization="fp8_per_block"` and `"fp8_per_channel"`.
ONLINE_METHODS = ("Fp8PerBlockOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod")


def fp8_layers(model: torch.nn.Module) -> List[str]:
    """The layers vLLM quantizes online."""
    return [name for name, m in model.named_modules() if type(getattr(m, "quant_method", None)).__name__ in ONLINE_METHODS]


def addresses(model: torch.nn.Module) -> Dict[str, Tuple[int, int]]:
    return {name: (p.data_ptr(), p.untyped_storage().nbytes()) for name, p in model.named_parameters()}
