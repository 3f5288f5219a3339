"""Multi-Latent Attention and shared experts from the real megatron-core into vLLM's own DeepSeek-V2:
a megatron-core GPTModel (MLATransformerConfig, the local layer spec: no Transformer Engine) with
the tiny DeepSeek shapes of families.deepseek_v2_lite() (kv_lora_rank 16, qk_nope 8, qk_rope 4,
v 8, 4 heads, hidden 32, a dense first layer, then MoE with 8 routed and 2 shared experts), built on
CPU for every rank of a Megatron TP x EP world in one process. Each Megatron rank's parameters are
filled from an index-encoded Hugging Face checkpoint by megatron-core's own semantics: which
checkpoint row each attention row holds is read from its own
MLASelfAttention.get_query_key_value_tensors on row-numbered weights (at position 0, where rotary
only reorders), fc1 halves from its own MLP.forward, ranges from the modules' own partition sizes
and local_expert_indices. MegatronModulePublisher then offers them from the model's
sharded_state_dict(), and for every rank of a vLLM layout the DeepseekV2ForCausalLM that vLLM
builds on CPU receives them through refit (needs recorded from its own load_weights), compared
element by element with the same class loaded by its own load_weights from that checkpoint.

What megatron-core 0.19.2's local spec cannot build, and what stands in:
- V2-Lite's attention as it is (no q LoRA, a kv norm): with qk_layernorm, the only way the local
  spec builds kv_layernorm, megatron-core refuses the spec's q_layernorm as unused
  (test_local_spec_refuses_kv_norm_without_q_lora). So the main matrix uses the same shapes with a
  q LoRA of 12 (DeepSeek-V2's and V3's attention: q_a_proj, q_a_layernorm, q_b_proj), and V2-Lite
  itself runs without Megatron's kv norm, DeepSeek's kv_a_layernorm offered beside it.
- The local core attention does not take the k_channels / v_channels MLA passes it; a subclass
  that drops them stands in (LocalCoreAttention: no parameters, never run).
- MLA's rotary embedding asks torch.cuda for its device (on_cpu), and linear_q_proj is built
  without a TP group (default_group in build).

Matrix (Megatron -> vLLM): TP1 -> TP1, TP2 -> TP2, TP2 EP2 -> TP2 with expert parallelism, TP2 EP2
with expert TP 2 -> the same, TP1 EP2 -> TP2, TP2 over two pipeline stages -> TP2, and V2-Lite TP2
EP2 -> TP2 with expert parallelism. Self-tests: a swapped pair of rows in
one Megatron parameter, and a wrong rule for linear_kv_down_proj's row order, each reported as
exactly the mismatching elements it makes."""

from __future__ import annotations

import contextlib
import functools
import sys
import unittest
from typing import Any, Dict, List, Tuple

try:
    import torch
    from megatron.core import package_info
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import layers as tensor_parallel_layers
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    import compare
    import vllm_harness as harness
    from families import deepseek_v2_lite
    from test_megatron_publisher import StandIn, claim, fill_ends, fill_mlp, fill_rows, patched

    MISSING = None
except ImportError as error:  # the plain `cargo test` run has neither
    MISSING = f"torch, vLLM or megatron-core is not installed ({error})"

from refit.integrations import megatron as refit_megatron
from refit.integrations.megatron import MegatronModulePublisher, RowBlock


def setUpModule() -> None:
    if MISSING:
        return
    harness._world()  # vLLM's one-process gloo world; Megatron's groups are made in it too
    parallel_state.initialize_model_parallel(1, 1)
    print(f"\n{compare.versions()}, megatron-core {package_info.__version__}", file=sys.stderr)


def tearDownModule() -> None:
    if not MISSING and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


Q_LORA = 12


def deepseek_v2_q_lora() -> Any:
    """families.deepseek_v2_lite() with a q LoRA (DeepSeek-V2's and V3's attention, rather than
    V2-Lite's): the form of MLA the local spec can build with a kv norm (see
    test_local_spec_refuses_kv_norm_without_q_lora)."""
    hf = deepseek_v2_lite()
    hf.q_lora_rank = Q_LORA
    return hf


@functools.lru_cache(maxsize=None)
def checkpoint(q_lora: bool = True) -> Tuple[Any, str, Dict, Dict[str, "torch.Tensor"]]:
    hf = deepseek_v2_q_lora() if q_lora else deepseek_v2_lite()
    folder = harness.hf_folder("deepseek_v2_q_lora-megatron" if q_lora else "deepseek_v2_lite-megatron", hf)
    specs = harness.checkpoint_specs(folder)
    return hf, folder, specs, harness.index_encoded(specs)


if not MISSING:

    class LocalCoreAttention(DotProductAttention):
        """The local spec's own core attention, taking the head sizes MLA passes it.
        MultiLatentAttention builds its core attention with k_channels and v_channels
        (multi_latent_attention.py), which only Transformer Engine's TEDotProductAttention accepts:
        the local spec as megatron-core 0.19.2 gives it fails with "TypeError:
        DotProductAttention.__init__() got an unexpected keyword argument 'k_channels' when
        instantiating DotProductAttention when instantiating MLASelfAttention when instantiating
        TransformerLayer". Core attention holds no parameter and takes no part in the q / k / v
        projections or the sharded state dict, so dropping the two sizes changes nothing this test
        reads; it is never run (its forward would assume kv_channels-sized heads). The base Attention
        builds one first without the two sizes, MultiLatentAttention then its own with them."""

        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)


def rank_groups(
    tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0, etp: int = 1, pp: int = 1, pp_rank: int = 0
) -> "ProcessGroupCollection":
    """One rank's process groups: stand-ins of the sizes and ranks a real run's would have."""
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.tp, groups.pp = StandIn(tp, tp_rank), StandIn(pp, pp_rank)
    groups.ep, groups.expt_tp = StandIn(ep, ep_rank), StandIn(etp, tp_rank % etp)
    return groups


def mla_config(hf: Any, **parallel_and_spec: Any) -> "MLATransformerConfig":
    """Megatron's MLATransformerConfig of the tiny DeepSeek `hf` on CPU in fp32 (DeepSeek's
    qk_nope_head_dim is Megatron's qk_head_dim), with the caller's parallel sizes and spec options."""
    dense = hf.first_k_dense_replace
    return MLATransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        bias_activation_fusion=False, apply_rope_fusion=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        rope_type="rope", rotary_scaling_factor=1.0,
        num_moe_experts=hf.n_routed_experts, moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
        moe_layer_freq=[0] * dense + [1] * (hf.num_hidden_layers - dense), moe_router_topk=hf.num_experts_per_tok,
        **parallel_and_spec,
    )


def build(
    hf: Any, tp: int, tp_rank: int, ep: int, ep_rank: int, kv_norm: bool = True, etp: int = 1, pp: int = 1,
    pp_rank: int = 0,
) -> "GPTModel":
    """One Megatron rank of the tiny DeepSeek `hf`: attention and shared experts split over TP,
    routed experts over EP and expert TP `etp` (1, DeepSeek's usual setting, keeps each expert whole
    on its EP rank), layers over `pp` pipeline stages. `kv_norm`: qk_layernorm, which makes the
    local spec build kv_layernorm (DeepSeek's kv_a_layernorm) and, with a q LoRA, q_layernorm
    (q_a_layernorm); without it both are IdentityOp."""
    groups = rank_groups(tp, tp_rank, ep, ep_rank, etp, pp, pp_rank)
    config = mla_config(
        hf, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        pipeline_model_parallel_size=pp, qk_layernorm=kv_norm,
    )
    # The stage's own layers: without pp_rank the spec would take parallel_state's (the one-process
    # world's stage 0) for every stage.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=pp_rank)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = LocalCoreAttention
    with on_cpu():
        return gpt_model(hf, tp, config, spec, groups, tensor_parallel_layers,
                         pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)


def gpt_model(hf: Any, tp: int, config: Any, spec: Any, groups: Any, linears: Any, **stage: bool) -> "GPTModel":
    """The rank's GPTModel of `hf` (vocabulary padded as Megatron pads it for `tp`) from `config` and
    `spec`, its projections given the rank's stand-in groups. MLASelfAttention builds linear_q_proj
    without a tp_group (multi_latent_attention.py, unlike every other projection), so the linear
    module `linears` (the local or the Transformer Engine one) falls back to parallel_state's TP
    group: in a real run the TP group, here the one-process world's, of size 1. The stand-in groups
    are what parallel_state would give in that real run."""
    padded = -(-hf.vocab_size // (8 * tp)) * 8 * tp

    def default_group(tp_group, is_expert=False, check_initialized=True):
        return tp_group if tp_group is not None else (groups.expt_tp if is_expert else groups.tp)

    with patched(linears, "get_tensor_model_parallel_group_if_none", default_group):
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=padded, max_sequence_length=32,
            share_embeddings_and_output_weights=False, position_embedding_type="rope", pg_collection=groups,
            **stage,
        )


def on_cpu():
    """MultiLatentAttention builds its RotaryEmbedding without passing use_cpu_initialization
    (multi_latent_attention.py, megatron-core 0.19.2), and RotaryEmbedding.__init__ and get_emb
    then ask torch.cuda.current_device() for the device of the inverse frequencies, which fails
    without a GPU: the device they are given here is the CPU, where everything else lives."""
    return patched(torch.cuda, "current_device", lambda: "cpu")


def rope_row(slot: int, rope: int) -> int:
    """The checkpoint row (within a head's rope rows) that DeepSeek's modeling code rotates as
    output slot `slot` of a rotate-half rotary: DeepSeek rotates interleaved pairs (2k, 2k+1) by
    frequency k (transformers' DeepseekV2 apply_rotary_emb, complex pairs), a rotate-half rotary
    pairs slots (k, k + rope/2) by frequency k."""
    half = rope // 2
    return 2 * (slot % half) + (slot >= half)


def projections(hf: Any) -> Tuple[str, ...]:
    """MLASelfAttention's projections (multi_latent_attention.py): linear_q_proj without q LoRA,
    linear_q_down_proj and linear_q_up_proj with it."""
    q = ("linear_q_proj",) if hf.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return (*q, "linear_kv_down_proj", "linear_kv_up_proj")


def mark_rows(attentions: List, names: Tuple[str, ...], hf: Any):
    """Marks row R of projection `names[P]` of attention m with m * 10000 + P * 1000 + R in column 0
    (zeros elsewhere); returns the input that reads those marks out (unit vector e0 at position 0)
    and the decoder of a mark: (m, projection, R)."""
    x = torch.zeros(1, 1, hf.hidden_size)
    x[0, 0, 0] = 1.0
    for m, attention in enumerate(attentions):
        for p, name in enumerate(names):
            weight = getattr(attention, name).weight
            weight.data.zero_()
            weight.data[:, 0] = torch.arange(weight.shape[0], dtype=torch.float32) + m * 10000 + p * 1000

    def decode(number: float) -> Tuple[int, str, int]:
        m, rest = divmod(int(number), 10000)
        p, row = divmod(rest, 1000)
        return m, names[p], row

    return x, decode


def claim_heads(found: dict, decode, qkv: Tuple, tp_rank: int, hf: Any) -> None:
    """Claims, for every head of one TP rank's query, key and value (from megatron-core's
    get_query_key_value_tensors over mark_rows' input), the checkpoint row each element came from,
    as DeepSeek's modeling code orders them (heads of q_head_dim = nope + rope rows; kv_b_proj heads
    of nope + v rows; kv_a_proj_with_mqa's rope rows after its kv_lora_rank latent rows; interleaved
    rope pairs, see rope_row)."""
    query, key, value = qkv
    nope, rope, v, latent = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim, hf.kv_lora_rank
    q_name = "q_proj" if hf.q_lora_rank is None else "q_b_proj"
    q_head = nope + rope
    heads = query.shape[2]
    for i in range(heads):
        h = tp_rank * heads + i
        for d in range(q_head):
            row = h * q_head + (d if d < nope else nope + rope_row(d - nope, rope))
            claim(found, decode(query[0, 0, i, d]), (q_name, row))
        for d in range(nope):
            claim(found, decode(key[0, 0, i, d]), ("kv_b_proj", h * (nope + v) + d))
        for d in range(rope):
            claim(found, decode(key[0, 0, i, nope + d]), ("kv_a_proj_with_mqa", latent + rope_row(d, rope)))
        for d in range(v):
            claim(found, decode(value[0, 0, i, d]), ("kv_b_proj", h * (nope + v) + nope + d))


def mla_rows(attentions: List, tp_rank_of: List[int], hf: Any) -> Dict[Tuple[int, str, int], Tuple[str, int]]:
    """{(model index, Megatron projection, local row): (checkpoint tensor suffix, row)} for the TP
    ranks of one layer, read from megatron-core's own get_query_key_value_tensors: row R of
    projection P of model m holds the number m * 10000 + P * 1000 + R in column 0 (zeros
    elsewhere) and the input is unit vector e0 at position 0, so each query / key / value element
    names the row it came from. The latents the q and kv norms see are captured and replaced by e0,
    so the up projections' rows come out one per element too; the tensor-parallel gather of a down
    projection is the concatenation of the ranks' own outputs, as its all-gather is. Which
    checkpoint row each element is follows DeepSeek's modeling code (heads of q_head_dim =
    nope + rope rows; kv_b_proj heads of nope + v rows; kv_a_proj_with_mqa = kv_lora_rank latent
    rows, then the rope rows; interleaved rope pairs, see rope_row)."""
    names = projections(hf)
    latent = hf.kv_lora_rank
    x, decode = mark_rows(attentions, names, hf)

    def gather(local, group=None):
        # Called for the q down projection (with q LoRA) and the kv one; told apart by width.
        which = [n for n in ("linear_q_down_proj", "linear_kv_down_proj") if n in names]
        width = {n: getattr(attentions[0], n).weight.shape[0] for n in which}
        (name,) = [n for n in which if width[n] == local.shape[-1]]
        return torch.cat([getattr(a, name)(x)[0] for a in attentions], dim=-1)

    found: Dict[Tuple[int, str, int], Tuple[str, int]] = {}
    with patched(multi_latent_attention, "gather_from_tensor_model_parallel_region", gather), on_cpu(), torch.no_grad():
        for m, attention in enumerate(attentions):
            seen = {}

            def capture(what):
                def norm(compressed):
                    seen[what] = compressed.clone()
                    unit = torch.zeros_like(compressed)
                    unit[..., 0] = 1.0
                    return unit

                return norm

            with contextlib.ExitStack() as stack:
                stack.enter_context(patched(attention.kv_layernorm, "forward", capture("kv")))
                if hf.q_lora_rank is not None:
                    stack.enter_context(patched(attention.q_layernorm, "forward", capture("q")))
                query, key, value = attention.get_query_key_value_tensors(x)[:3]
            claim_heads(found, decode, (query, key, value), tp_rank_of[m], hf)
            for d in range(latent):
                claim(found, decode(seen["kv"][0, 0, d]), ("kv_a_proj_with_mqa", d))
            if hf.q_lora_rank is not None:
                for d in range(hf.q_lora_rank):
                    claim(found, decode(seen["q"][0, 0, d]), ("q_a_proj", d))
    return found


def assert_equal_loads(test: unittest.TestCase, where: str, result, parts: Tuple[str, ...]) -> None:
    """One vLLM rank's comparison (compare.run_rank): every element refit installed equal to vLLM's
    own load, the same parameters written by both, and a checkpoint tensor of each of `parts` among
    those moved (placed in a parameter, or staged for the engine's loader), not left out."""
    print(f"\n  {where}: {result.params} parameters, {result.elements} elements equal; {result.notes}", file=sys.stderr)
    test.assertEqual(result.mismatches, [], f"{where}; {result.notes}")
    test.assertEqual(result.only_loader, [], f"{where}: parameters only vLLM's loader writes")
    test.assertEqual(result.only_refit, [], f"{where}: parameters only refit writes")
    test.assertGreater(result.elements, 0, where)
    recording = result.recording
    moved = {piece.tensor for layout in recording.layouts for piece in layout.pieces} | set(recording.staged)
    for part in parts:
        test.assertTrue(any(f".{part}." in name for name in moved), f"{where}: no {part} tensor moved")


def megatron_world(
    hf: Any, ckpt: Dict[str, "torch.Tensor"], tp: int, ep: int, testcase, kv_norm: bool = True, etp: int = 1,
    pp: int = 1,
) -> List["GPTModel"]:
    """Every rank (TP fastest, then EP, then pipeline stage) of a Megatron world holding the
    checkpoint."""
    ranks = [(t, e, st) for st in range(pp) for e in range(ep) for t in range(tp)]
    models = [build(hf, tp, t, ep, e, kv_norm, etp, pp, st) for t, e, st in ranks]
    vocab = hf.vocab_size
    for e, stage in ((e, st) for st in range(pp) for e in range(ep)):
        members = [i for i, (_, re, rs) in enumerate(ranks) if (re, rs) == (e, stage)]
        for n in range(len(models[members[0]].decoder.layers)):
            layers = [models[i].decoder.layers[n] for i in members]
            prefix = f"model.layers.{layers[0].layer_number - 1}.self_attn"
            rows = mla_rows([layer.self_attention for layer in layers], [ranks[i][0] for i in members], hf)
            for m, layer in enumerate(layers):
                for name in projections(hf):
                    local = {row: (f"{prefix}.{t}.weight", r) for (mm, p, row), (t, r) in rows.items() if (mm, p) == (m, name)}
                    fill_rows(getattr(layer.self_attention, name).weight, local, ckpt, testcase)
    with torch.no_grad():
        for (tp_rank, _, _), model in zip(ranks, models):
            fill_ends(model, tp_rank, vocab, ckpt)
            for layer in model.decoder.layers:
                hf_layer = f"model.layers.{layer.layer_number - 1}"
                layer.input_layernorm.weight.copy_(ckpt[f"{hf_layer}.input_layernorm.weight"])
                layer.pre_mlp_layernorm.weight.copy_(ckpt[f"{hf_layer}.post_attention_layernorm.weight"])
                attention = layer.self_attention
                if kv_norm:
                    attention.kv_layernorm.weight.copy_(ckpt[f"{hf_layer}.self_attn.kv_a_layernorm.weight"])
                if kv_norm and hf.q_lora_rank is not None:
                    attention.q_layernorm.weight.copy_(ckpt[f"{hf_layer}.self_attn.q_a_layernorm.weight"])
                cols = attention.linear_proj.input_size_per_partition
                attention.linear_proj.weight.copy_(ckpt[f"{hf_layer}.self_attn.o_proj.weight"][:, tp_rank * cols : (tp_rank + 1) * cols])
                mlp = layer.mlp
                if hasattr(mlp, "router"):
                    mlp.router.weight.copy_(ckpt[f"{hf_layer}.mlp.gate.weight"])
                    for j, expert in enumerate(mlp.local_expert_indices):
                        fill_mlp(mlp.experts.local_experts[j], tp_rank % etp, f"{hf_layer}.mlp.experts.{expert}", ckpt, testcase)
                    fill_mlp(mlp.shared_experts, tp_rank, f"{hf_layer}.mlp.shared_experts", ckpt, testcase)
                else:
                    fill_mlp(mlp, tp_rank, f"{hf_layer}.mlp", ckpt, testcase)
    return models


@unittest.skipIf(MISSING, MISSING or "")
class MegatronMlaTest(unittest.TestCase):
    def refit(
        self, tp: int, ep: int, parallel: "harness.Parallel", models=None, q_lora: bool = True, etp: int = 1, pp: int = 1
    ) -> List[compare.RankResult]:
        """Every rank of vLLM layout `parallel` loaded from the Megatron world (tp, ep). Without a
        q LoRA the Megatron model has no kv norm (see build), and DeepSeek's kv_a_layernorm comes
        from one more publisher offering those checkpoint tensors whole."""
        hf, folder, specs, ckpt = checkpoint(q_lora)
        if models is None:
            models = megatron_world(hf, ckpt, tp, ep, self, kv_norm=q_lora, etp=etp, pp=pp)
        publishers = [MegatronModulePublisher(model, vocab=hf.vocab_size) for model in models]
        makers = [functools.partial(lambda p, device: p.table(0, device=device), p) for p in publishers]
        if not q_lora:
            norms = {name: t for name, t in ckpt.items() if name.endswith("self_attn.kv_a_layernorm.weight")}
            makers.append(lambda device: compare._whole_tensors(norms, device))
        config = harness.engine_config(folder, parallel)
        results = []
        for tp_rank, pp_rank in parallel.ranks():
            results.append(compare.run_rank(config, parallel, tp_rank, pp_rank, specs, ckpt, publishers=makers))
        return results

    def check(self, tp: int, ep: int, parallel: "harness.Parallel", q_lora: bool = True, etp: int = 1, pp: int = 1) -> None:
        parts = ("q_a_proj", "q_a_layernorm", "q_b_proj") if q_lora else ("q_proj",)
        parts += ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "shared_experts.gate_proj", "shared_experts.down_proj")
        for result in self.refit(tp, ep, parallel, q_lora=q_lora, etp=etp, pp=pp):
            where = f"Megatron tp {tp} ep {ep} etp {etp} pp {pp} -> vLLM {parallel.label()} rank tp{result.tp_rank}"
            assert_equal_loads(self, where, result, parts)

    def test_megatron_tp1_to_vllm_tp1(self):
        self.check(1, 1, harness.Parallel(1))

    def test_megatron_tp2_to_vllm_tp2(self):
        self.check(2, 1, harness.Parallel(2))

    def test_megatron_tp2_ep2_to_vllm_tp2_ep(self):
        self.check(2, 2, harness.Parallel(2, ep=True))

    def test_megatron_tp1_ep2_to_vllm_tp2(self):
        self.check(1, 2, harness.Parallel(2))

    def test_megatron_tp2_ep2_expert_tp2_to_vllm_tp2_ep(self):
        """Routed experts split over expert TP 2 as well as EP 2 (each expert's fc1 rows and fc2
        columns halved between the TP ranks)."""
        self.check(2, 2, harness.Parallel(2, ep=True), etp=2)

    def test_megatron_tp2_pp2_to_vllm_tp2(self):
        """Two pipeline stages (the dense layer and the embedding on the first, the MoE layer, the
        final norm and the output layer on the second)."""
        self.check(2, 1, harness.Parallel(2), pp=2)

    def test_v2_lite_without_kv_norm_tp2_to_vllm_tp2_ep(self):
        """V2-Lite's attention (no q LoRA: linear_q_proj) at TP 2 and EP 2, kv_a_layernorm offered
        beside Megatron (the local spec cannot build it here)."""
        self.check(2, 2, harness.Parallel(2, ep=True), q_lora=False)

    def test_local_spec_refuses_kv_norm_without_q_lora(self):
        """Why the tests above use a q LoRA: with qk_layernorm (the only way to get kv_layernorm)
        and no q LoRA, megatron-core's QKNormConfigResolver (mla_qk_norm_config.py) wants a Q norm
        fused into linear_q_proj, which only Transformer Engine provides; the local spec's explicit
        q_layernorm is refused as unused. When this starts passing, V2-Lite itself can be tested."""
        hf = deepseek_v2_lite()
        with self.assertRaisesRegex(ValueError, "is non-trivial, but `q_lora_rank is None`, meaning it will not be used"):
            build(hf, 1, 0, 1, 0, kv_norm=True)

    def test_swapped_rows_are_caught(self):
        """Two rows of one Megatron parameter exchanged (k_nope row 0 and v row 0 of head 0 of
        linear_kv_up_proj, layer 0): vLLM's kv_b_proj must differ in exactly those elements."""
        hf, _, _, ckpt = checkpoint()
        models = megatron_world(hf, ckpt, 1, 1, self)
        weight = models[0].decoder.layers[0].self_attention.linear_kv_up_proj.weight
        with torch.no_grad():
            weight[[0, hf.qk_nope_head_dim]] = weight[[hf.qk_nope_head_dim, 0]].clone()
        (result,) = self.refit(1, 1, harness.Parallel(1), models)
        self.assertEqual(len(result.mismatches), 1, result.mismatches)
        self.assertIn("layers.0.self_attn.kv_b_proj.weight", result.mismatches[0])
        self.assertIn(f"{2 * hf.kv_lora_rank} of", result.mismatches[0])

    def test_wrong_kv_down_rule_is_caught(self):
        """A plausible wrong rule (linear_kv_down_proj as [rope k; latent] instead of [latent;
        rope k]) must fail: the kv_a_proj_with_mqa rows of vLLM's fused_qkv_a_proj (q_a_proj's
        rows, then kv_a_proj_with_mqa's) differ in every layer, and only those."""
        hf, _, _, _ = checkpoint()
        right = refit_megatron.megatron_to_hf
        latent, rope = hf.kv_lora_rank, hf.qk_rope_head_dim

        def wrong(key, shape, attention, vocab=None):
            if key.endswith("self_attention.linear_kv_down_proj.weight"):
                (block,) = right(key, shape, attention, vocab)
                return [RowBlock(block.name, block.shape, 0, rope, latent), RowBlock(block.name, block.shape, rope, latent, 0)]
            return right(key, shape, attention, vocab)

        with patched(refit_megatron, "megatron_to_hf", wrong):
            (result,) = self.refit(1, 1, harness.Parallel(1))
        wrong_params = sorted(m.split(":")[0] for m in result.mismatches)
        self.assertEqual(wrong_params, [f"model.layers.{i}.self_attn.fused_qkv_a_proj.weight" for i in range(hf.num_hidden_layers)])
        kv, fused = (latent + rope) * hf.hidden_size, (Q_LORA + latent + rope) * hf.hidden_size
        for mismatch in result.mismatches:
            self.assertIn(f"{kv} of {fused} elements differ; first at {Q_LORA * hf.hidden_size}:", mismatch)


if __name__ == "__main__":
    unittest.main()
