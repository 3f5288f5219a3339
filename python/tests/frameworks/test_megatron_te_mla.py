"""Multi-Latent Attention from megatron-core's Transformer Engine layer spec into vLLM's own
DeepSeek-V2: what test_megatron_mla.py does with the local spec, for the spellings only the
Transformer Engine (TE) spec has. Its MLA fuses the latent norms into the up projections
(TELayerNormColumnParallelLinear): `self_attention.linear_q_up_proj.layer_norm_weight` and
`self_attention.linear_kv_up_proj.layer_norm_weight`, keeps the down projections whole on every TP
rank (TELinear, parallel_mode "duplicated"), and is the only spec that builds V2-Lite's attention
as it is: no q LoRA and a kv norm (the local spec refuses it, see test_megatron_mla.py
test_local_spec_refuses_kv_norm_without_q_lora). With no q LoRA it also fuses a Q norm into
linear_q_proj (`linear_q_proj.layer_norm_weight`, over the layer's normalized input) that
DeepSeek's checkpoint has no tensor for: refit leaves it unnamed, so a strict publisher refuses it
and the V2-Lite cases publish with strict=False (test_v2_lite_q_norm_is_refused_by_a_strict_publisher).

How Transformer Engine runs here, on CPU and without building anything:
- .ci/frameworks installs the pure-Python `transformer-engine` wheel (pinned in requirements.txt,
  with the onnx / onnxscript / onnx-ir its torch modules import) into a folder of the venv that no
  other module has on its path ($REFIT_FRAMEWORKS_TE): with TE importable, `import megatron.core`
  itself imports transformer_engine.pytorch (tensor_parallel/random.py catches only
  ModuleNotFoundError), which fails without TE's compiled torch extension, and every other module
  of the suite would fail with it.
- NVTE_PROJECT_BUILDING=1, the switch TE's own setup.py sets while it builds its extension, makes
  transformer_engine.common skip loading the CUDA libraries and libtransformer_engine.so; the
  transformer-engine-cu13 wheel (276 MB, the compiled core) is not installed at all.
- TE's compiled torch extension (transformer_engine_torch, an sdist that takes 18-35 minutes to
  build on two cores) is a stand-in (TorchExtensionStandIn): pybind11 enums become int enums whose
  members are made as TE's Python mirrors read them, every function a MagicMock. No kernel is
  needed to build the modules and read their parameters: their names, shapes, initialization and
  sharding (sharded_state_dict) are TE's and Megatron's real Python code. Where this test runs
  Megatron's own get_query_key_value_tensors and MLP.forward to learn which checkpoint row each
  Megatron row holds, the TE linears' forward (a GEMM kernel) is stood in by torch's own linear,
  their fused norm by the same capture the local-spec test puts at q_layernorm / kv_layernorm
  (torch_forwards): which latent reaches which fused norm is read from Megatron's wiring, not
  assumed.
- Building asks torch.cuda.is_available() (TE's module base refuses to build without CUDA) and
  torch.cuda.current_device() (rotary embedding, TE's parameter init): both are patched while the
  GPTModel is built (on_cuda_less_cpu), everything lives on the CPU (use_cpu_initialization).

Each Megatron rank's parameters are filled from an index-encoded Hugging Face checkpoint by
megatron-core's own semantics (test_megatron_mla.py's mla_rows logic, with the fused norms
traced: the norm fused into the projection whose rows are q_b_proj's normalizes the latent that
q_a_proj's rows produce, so it is q_a_layernorm; likewise kv_b_proj / kv_a_proj_with_mqa's latent
/ kv_a_layernorm, DeepSeek's modeling code), published by MegatronModulePublisher from the model's
sharded_state_dict(), and for every rank of a vLLM layout the DeepseekV2ForCausalLM that vLLM builds
on CPU receives them through refit, compared element by element with the same class loaded by its
own load_weights. Matrix: DeepSeek-V2-like (q LoRA 12) TP1 -> TP1, TP2 -> TP2; V2-Lite-like (no q
LoRA, kv norm) TP1 -> TP1, TP2 -> TP2. Self-tests: swapped elements of the fused norms (exactly
those elements differ), a rule that names the two fused norms the wrong way round, and one that
names V2-Lite's Megatron-only Q norm input_layernorm, each caught."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
import unittest
import warnings
from typing import Any, Dict, List, Tuple
from unittest import mock


class _PybindEnum(type):
    """A pybind11 enum of the stand-in extension: each member is made, with the next int, the
    first time TE's Python reads it (constants.py and cpp_extensions/fused_attn.py build their
    IntEnum mirrors member by member and then check `__members__` against the extension's)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        member = int.__new__(cls, len(cls.__members__))
        member.name = name
        cls.__members__[name] = member
        setattr(cls, name, member)
        return member


class TorchExtensionStandIn(types.ModuleType):
    """transformer_engine_torch (TE's compiled torch extension) for building modules only: a
    capitalized name (a pybind11 enum or class) is a _PybindEnum, anything else a MagicMock. Never
    used to compute: the test runs no TE kernel (see torch_forwards)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[0].isupper():
            value: Any = _PybindEnum(name, (int,), {"__members__": {}, "__module__": self.__name__})
        else:
            value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def install_transformer_engine() -> None:
    """Makes the pinned TE importable in this process only, with the stand-in extension (see the
    module docstring). Fails (rather than skipping) when .ci/frameworks did not provide it."""
    where = os.environ.get("REFIT_FRAMEWORKS_TE")
    if not where or not os.path.isdir(os.path.join(where, "transformer_engine")):
        raise ImportError(
            f"REFIT_FRAMEWORKS_TE={where!r} holds no transformer_engine; run this module through .ci/frameworks"
        )
    sys.path.insert(0, where)
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    with warnings.catch_warnings():
        # transformer_engine/__init__.py tries transformer_engine.pytorch once before the stand-in
        # is in place and warns that the extension is missing; imported again below.
        warnings.simplefilter("ignore", RuntimeWarning)
        import transformer_engine.common as common

    def load_framework_extension(framework: str) -> None:
        name = f"transformer_engine_{framework}"
        sys.modules[name] = TorchExtensionStandIn(name)

    common.load_framework_extension = load_framework_extension
    import transformer_engine.pytorch  # noqa: F401  (TE's real Python modules, on the stand-in)


install_transformer_engine()

import torch  # noqa: E402
from megatron.core import package_info, parallel_state  # noqa: E402
from megatron.core.extensions import transformer_engine as megatron_te  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402

import compare  # noqa: E402
import vllm_harness as harness  # noqa: E402
from test_megatron_mla import (  # noqa: E402
    Q_LORA,
    assert_equal_loads,
    checkpoint,
    claim_heads,
    gpt_model,
    mark_rows,
    mla_config,
    on_cpu,
    projections,
    rank_groups,
)
from test_megatron_publisher import claim, fill_ends, fill_mlp, fill_rows, patched  # noqa: E402

from refit.integrations import megatron as refit_megatron  # noqa: E402
from refit.integrations.megatron import MegatronModulePublisher  # noqa: E402

# DeepSeek's modeling code: the norm applied to the input of each up projection, and the
# projection whose rows make that input (q_b_proj(q_a_layernorm(q_a_proj(h))),
# kv_b_proj(kv_a_layernorm(compressed_kv)), compressed_kv the first kv_lora_rank rows of
# kv_a_proj_with_mqa(h)). q_proj reads the layer's normalized input directly: no norm of its own.
NORM_BEFORE = {"q_b_proj": ("q_a_proj", "q_a_layernorm"), "kv_b_proj": ("kv_a_proj_with_mqa", "kv_a_layernorm")}


def setUpModule() -> None:
    if not megatron_te.HAVE_TE:
        raise RuntimeError("megatron-core did not take Transformer Engine (HAVE_TE is False)")
    harness._world()  # vLLM's one-process gloo world; Megatron's groups are made in it too
    parallel_state.initialize_model_parallel(1, 1)
    import transformer_engine

    print(
        f"\n{compare.versions()}, megatron-core {package_info.__version__}, transformer-engine "
        f"{transformer_engine.__version__} (Python modules; extension stood in)",
        file=sys.stderr,
    )


def tearDownModule() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def on_cuda_less_cpu():
    """TE's module base (transformer_engine/pytorch/module/base.py) raises "TransformerEngine needs
    CUDA." unless torch.cuda.is_available(); the modules are built on the CPU all the same
    (use_cpu_initialization), and the rotary embedding's and TE's device queries get the CPU."""
    with patched(torch.cuda, "is_available", lambda: True), on_cpu():
        yield


def build(hf: Any, tp: int, tp_rank: int) -> "GPTModel":
    """One Megatron TP rank of the tiny DeepSeek `hf` with the TE layer spec and qk_layernorm (the
    latent norms, fused into the up projections; with no q LoRA, the kv norm and the Q norm fused
    into linear_q_proj). Routed experts stay whole (EP 1)."""
    groups = rank_groups(tp, tp_rank)
    config = mla_config(hf, tensor_model_parallel_size=tp, transformer_impl="transformer_engine", qk_layernorm=True)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    with on_cuda_less_cpu():
        return gpt_model(hf, tp, config, spec, groups, megatron_te)


def unit_like(x: "torch.Tensor") -> "torch.Tensor":
    unit = torch.zeros_like(x)
    unit[..., 0] = 1.0
    return unit


@contextlib.contextmanager
def torch_forwards(models: List["GPTModel"], seen: Dict[Any, "torch.Tensor"]):
    """Every TE linear of `models` computes with torch while the rows are traced (the stand-in
    extension has no kernels): TELinear and its column / row parallel forms as x @ W^T, and
    TELayerNormColumnParallelLinear (TE's LayerNormLinear: norm, then linear) with its norm
    replaced by the capture that test_megatron_mla.mla_rows puts at q_layernorm / kv_layernorm: the
    input it would normalize is recorded in `seen[module]` and the unit vector e0 goes on, so each
    output element is the row number its weight holds in column 0. Returns (output, None), as
    Megatron's TE wrappers do without te_return_bias."""
    changed = []
    for model in models:
        for module in model.modules():
            if isinstance(module, megatron_te.TELayerNormColumnParallelLinear):

                def forward(x, module=module):
                    seen[module] = x.clone()
                    return torch.nn.functional.linear(unit_like(x), module.weight), None

            elif isinstance(module, megatron_te.TELinear):

                def forward(x, module=module):
                    return torch.nn.functional.linear(x, module.weight), None

            else:
                continue
            module.forward = forward
            changed.append(module)
    try:
        yield
    finally:
        for module in changed:
            del module.forward


def mla_rows(
    attentions: List, models: List["GPTModel"], tp_rank_of: List[int], hf: Any
) -> Tuple[Dict[Tuple[int, str, int], Tuple[str, int]], Dict[Tuple[int, str], Any]]:
    """test_megatron_mla.mla_rows for the TE spec: ({(model index, Megatron projection, local
    row): (checkpoint tensor suffix, row)}, {(model index, projection with a fused norm): DeepSeek
    norm suffix, or None for the Q norm fused into linear_q_proj}). The down projections are whole
    on every rank (no gather: TE's duplicated TELinear gives the full latent width, so megatron-core
    calls none), and the latents are read where the fused norms see them. Which DeepSeek norm a
    fused norm is follows from what reaches it: the latent of q_a_proj's rows before the
    projection holding q_b_proj's rows is q_a_layernorm, that of kv_a_proj_with_mqa's before
    kv_b_proj's is kv_a_layernorm (NORM_BEFORE); the layer's input itself, before q_proj's rows,
    is a norm DeepSeek does not have."""
    names = projections(hf)
    x, decode = mark_rows(attentions, names, hf)

    found: Dict[Tuple[int, str, int], Tuple[str, int]] = {}
    norms: Dict[Tuple[int, str], Any] = {}
    seen: Dict[Any, torch.Tensor] = {}
    with torch_forwards(models, seen), on_cpu(), torch.no_grad():
        for m, attention in enumerate(attentions):
            seen.clear()
            qkv = attention.get_query_key_value_tensors(x)[:3]
            claim_heads(found, decode, qkv, tp_rank_of[m], hf)
            fused = {name: getattr(attention, name) for name in names if getattr(attention, name) in seen}
            if set(fused) != {n for n in names if n.endswith("up_proj") or n == "linear_q_proj"}:
                raise AssertionError(f"the TE spec's fused norms are in {sorted(fused)}")
            for name, module in fused.items():
                ups = {t for (mm, p, _), (t, _) in found.items() if (mm, p) == (m, name)}
                if len(ups) != 1:
                    raise AssertionError(f"{name} holds rows of {ups}")
                (up,) = ups
                compressed = seen[module]
                if up not in NORM_BEFORE:
                    if not torch.equal(compressed, x):
                        raise AssertionError(f"the norm fused into {name} ({up}) does not see the layer's input")
                    norms[(m, name)] = None
                    continue
                down, norm = NORM_BEFORE[up]
                for d in range(compressed.shape[-1]):
                    claim(found, decode(compressed[0, 0, d]), (down, d))
                norms[(m, name)] = norm
    return found, norms


def te_world(hf: Any, ckpt: Dict[str, "torch.Tensor"], tp: int, testcase) -> List["GPTModel"]:
    """Every TP rank of a TE-spec Megatron world holding the checkpoint. The Megatron-only Q norm
    fused into linear_q_proj (no q LoRA) holds ones."""
    models = [build(hf, tp, t) for t in range(tp)]
    for n in range(len(models[0].decoder.layers)):
        layers = [model.decoder.layers[n] for model in models]
        prefix = f"model.layers.{layers[0].layer_number - 1}.self_attn"
        rows, norms = mla_rows([layer.self_attention for layer in layers], models, list(range(tp)), hf)
        for m, layer in enumerate(layers):
            for name in projections(hf):
                local = {row: (f"{prefix}.{t}.weight", r) for (mm, p, row), (t, r) in rows.items() if (mm, p) == (m, name)}
                fill_rows(getattr(layer.self_attention, name).weight, local, ckpt, testcase)
            with torch.no_grad():
                for (mm, name), norm in norms.items():
                    if mm == m:
                        weight = getattr(layer.self_attention, name).layer_norm_weight
                        weight.copy_(torch.ones_like(weight) if norm is None else ckpt[f"{prefix}.{norm}.weight"])
    seen: Dict[Any, torch.Tensor] = {}
    with torch_forwards(models, seen), torch.no_grad():
        for tp_rank, model in enumerate(models):
            fill_ends(model, tp_rank, hf.vocab_size, ckpt)
            for layer in model.decoder.layers:
                hf_layer = f"model.layers.{layer.layer_number - 1}"
                layer.input_layernorm.weight.copy_(ckpt[f"{hf_layer}.input_layernorm.weight"])
                # The dense layer's pre-MLP norm is fused into linear_fc1; the MoE layer's stands alone.
                if isinstance(layer.pre_mlp_layernorm, IdentityOp):
                    layer.mlp.linear_fc1.layer_norm_weight.copy_(ckpt[f"{hf_layer}.post_attention_layernorm.weight"])
                else:
                    layer.pre_mlp_layernorm.weight.copy_(ckpt[f"{hf_layer}.post_attention_layernorm.weight"])
                attention = layer.self_attention
                cols = attention.linear_proj.weight.shape[1]
                attention.linear_proj.weight.copy_(ckpt[f"{hf_layer}.self_attn.o_proj.weight"][:, tp_rank * cols : (tp_rank + 1) * cols])
                mlp = layer.mlp
                if hasattr(mlp, "router"):
                    mlp.router.weight.copy_(ckpt[f"{hf_layer}.mlp.gate.weight"])
                    for j, expert in enumerate(mlp.local_expert_indices):
                        fill_mlp(mlp.experts.local_experts[j], 0, f"{hf_layer}.mlp.experts.{expert}", ckpt, testcase)
                    fill_mlp(mlp.shared_experts, tp_rank, f"{hf_layer}.mlp.shared_experts", ckpt, testcase)
                else:
                    fill_mlp(mlp, tp_rank, f"{hf_layer}.mlp", ckpt, testcase)
    return models


class MegatronTeMlaTest(unittest.TestCase):
    def refit(self, tp: int, parallel: "harness.Parallel", q_lora: bool = True, models=None) -> List[compare.RankResult]:
        hf, folder, specs, ckpt = checkpoint(q_lora)
        if models is None:
            models = te_world(hf, ckpt, tp, self)
        # Without a q LoRA the Megatron-only Q norm is left out (strict=False); everything else,
        # the kv norm included, comes from the Megatron model.
        publishers = [MegatronModulePublisher(model, vocab=hf.vocab_size, strict=q_lora) for model in models]
        makers = [functools.partial(lambda p, device: p.table(0, device=device), p) for p in publishers]
        config = harness.engine_config(folder, parallel)
        return [
            compare.run_rank(config, parallel, tp_rank, pp_rank, specs, ckpt, publishers=makers)
            for tp_rank, pp_rank in parallel.ranks()
        ]

    def check(self, tp: int, parallel: "harness.Parallel", q_lora: bool = True) -> None:
        parts = ("q_a_proj", "q_a_layernorm", "q_b_proj") if q_lora else ("q_proj",)
        parts += ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
        for result in self.refit(tp, parallel, q_lora=q_lora):
            where = f"Megatron TE spec tp {tp}{'' if q_lora else ' (V2-Lite)'} -> vLLM {parallel.label()} rank tp{result.tp_rank}"
            assert_equal_loads(self, where, result, parts)

    def test_te_tp1_to_vllm_tp1(self):
        self.check(1, harness.Parallel(1))

    def test_te_tp2_to_vllm_tp2(self):
        self.check(2, harness.Parallel(2))

    def test_v2_lite_te_tp1_to_vllm_tp1(self):
        """V2-Lite's attention as it is: no q LoRA, kv_a_layernorm from
        linear_kv_up_proj.layer_norm_weight."""
        self.check(1, harness.Parallel(1), q_lora=False)

    def test_v2_lite_te_tp2_to_vllm_tp2(self):
        self.check(2, harness.Parallel(2), q_lora=False)

    def test_te_spec_offers_the_fused_norm_names(self):
        """The TE spec's own sharded state dict spells the latent norms as the up projections'
        layer_norm_weight (what _MLA_NAMES maps), replicated whole on every TP rank."""
        hf, _, _, _ = checkpoint()
        for tp_rank in range(2):
            state = build(hf, 2, tp_rank).sharded_state_dict()
            for layer in range(hf.num_hidden_layers):
                for name, size in (("linear_q_up_proj", Q_LORA), ("linear_kv_up_proj", hf.kv_lora_rank)):
                    tensor = state[f"decoder.layers.{layer}.self_attention.{name}.layer_norm_weight"]
                    self.assertEqual((tuple(tensor.global_shape), tuple(tensor.local_shape)), ((size,), (size,)))
                self.assertNotIn(f"decoder.layers.{layer}.self_attention.q_layernorm.weight", state)
                self.assertNotIn(f"decoder.layers.{layer}.self_attention.kv_layernorm.weight", state)

    def test_v2_lite_q_norm_is_refused_by_a_strict_publisher(self):
        """The Q norm the TE spec fuses into linear_q_proj without a q LoRA has no DeepSeek tensor:
        a strict publisher names it and refuses the model rather than inventing a name."""
        hf, _, _, _ = checkpoint(q_lora=False)
        model = build(hf, 1, 0)
        with self.assertRaisesRegex(ValueError, r"no Hugging Face name.*linear_q_proj\.layer_norm_weight"):
            MegatronModulePublisher(model, vocab=hf.vocab_size)

    def test_swapped_fused_norm_elements_are_caught(self):
        """Two elements of each fused latent norm of layer 0 exchanged: vLLM's q_a_layernorm and
        kv_a_layernorm of layer 0 must differ in exactly those two elements each, and nothing else."""
        hf, _, _, ckpt = checkpoint()
        models = te_world(hf, ckpt, 1, self)
        attention = models[0].decoder.layers[0].self_attention
        with torch.no_grad():
            for name in ("linear_q_up_proj", "linear_kv_up_proj"):
                weight = getattr(attention, name).layer_norm_weight
                weight[[0, 1]] = weight[[1, 0]].clone()
        (result,) = self.refit(1, harness.Parallel(1), models=models)
        wrong = sorted(m.split(":")[0] for m in result.mismatches)
        self.assertEqual(wrong, ["model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.0.self_attn.q_a_layernorm.weight"], result.mismatches)
        for mismatch in result.mismatches:
            self.assertIn("2 of", mismatch)

    def test_misnamed_fused_norms_are_caught(self):
        """A rule that reads the TE spellings the wrong way round (linear_q_up_proj's norm as
        kv_a_layernorm and linear_kv_up_proj's as q_a_layernorm) is refused when the plan is built:
        the norms' lengths (q LoRA 12, kv LoRA 16) disagree with the checkpoint's."""
        hf, _, _, ckpt = checkpoint()
        models = te_world(hf, ckpt, 1, self)
        names = dict(refit_megatron._MLA_NAMES)
        names["self_attention.linear_q_up_proj.layer_norm_"] = "self_attn.kv_a_layernorm."
        names["self_attention.linear_kv_up_proj.layer_norm_"] = "self_attn.q_a_layernorm."
        with patched(refit_megatron, "_MLA_NAMES", names):
            with self.assertRaisesRegex(Exception, r"TENSOR_MISMATCH.*_a_layernorm\.weight' has shape \[1[26]\] in one table and \[1[26]\]"):
                self.refit(1, harness.Parallel(1), models=models)

    def test_v2_lite_q_norm_named_input_layernorm_is_caught(self):
        """The plausible misreading of V2-Lite's fused Q norm: linear_q_proj.layer_norm_weight read
        as input_layernorm, as linear_qkv.layer_norm_weight is in standard attention (same length,
        hidden). The Megatron-only norm holds ones, so it must not reach vLLM's input_layernorm."""
        hf, _, _, ckpt = checkpoint(q_lora=False)
        models = te_world(hf, ckpt, 1, self)
        names = dict(refit_megatron._MLA_NAMES)
        names["self_attention.linear_q_proj.layer_norm_"] = "input_layernorm."
        with patched(refit_megatron, "_MLA_NAMES", names):
            with self.assertRaisesRegex(
                Exception, r"two local tensors offer overlapping boxes of model\.layers\.0\.input_layernorm\.weight"
            ):
                self.refit(1, harness.Parallel(1), q_lora=False, models=models)


if __name__ == "__main__":
    unittest.main()
