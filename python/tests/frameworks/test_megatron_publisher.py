"""The Megatron publisher against the real megatron-core: GPTModel (local layer spec, CPU
initialization) built for every rank of a TP x EP world in one process (a gloo world of one, with
the TP / EP / expert-TP groups stood in per rank), each rank's parameters filled from an
index-encoded Hugging Face checkpoint by Megatron-core's own semantics (which HF row each fused row
holds is read by running its own SelfAttention.get_query_key_value_tensors and MLP.forward on
row-numbered weights; vocabulary rows from VocabParallelEmbedding's own range; experts from the MoE
layer's local_expert_indices), published from the model's sharded_state_dict() by
MegatronModulePublisher, planned into whole HF tensors on the host backend and compared element by
element with the checkpoint. Matrix: TP 1/2/4 x 1/2/4/8 kv heads; PP 2 with q/k/v biases; MoE at EP 1/2 with expert TP 1
and expert TP = TP."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import unittest
from typing import Dict, List, Tuple

try:
    import torch
    import torch.distributed as dist
    from megatron.core import package_info
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import attention as megatron_attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    MISSING = None
except ImportError as error:  # the plain `cargo test` run has neither
    MISSING = f"torch or megatron-core is not installed ({error})"

import refit
from refit.integrations import ModelShape
from refit.integrations.megatron import MegatronModulePublisher
from refit.tensor import add_tensor_need

HIDDEN, HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 16, 8, 4, 24, 37, 2
EXPERTS, MOE_FFN = 4, 8


class StandIn:
    """A process group of `size` in which this process plays `rank` (sizes and ranks only: the
    models are built and read, never trained)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def setUpModule() -> None:
    if MISSING:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if not dist.is_initialized():  # the suite's vLLM tests may have made the one-process world already
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    print(f"\ntorch {torch.__version__}, megatron-core {package_info.__version__}", file=sys.stderr)


def tearDownModule() -> None:
    if not MISSING and dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def hf_shape(kv_heads: int, experts: int) -> "ModelShape":
    return ModelShape(
        layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=kv_heads, head_dim=HEAD_DIM, vocab=VOCAB,
        ffn=0 if experts else FFN, experts=experts, moe_ffn=MOE_FFN if experts else 0, dtype="float32",
    )


def checkpoint(model: "ModelShape") -> Dict[str, "torch.Tensor"]:
    """Every element its own value: tensor t's element i is t * 100000 + i + 1 (exact in float32)."""
    out = {}
    for t, (name, shape) in enumerate(model.checkpoint_tensors().items()):
        n = 1
        for e in shape:
            n *= e
        out[name] = (torch.arange(n, dtype=torch.float32) + t * 100000 + 1).view(shape)
    return out


def build(
    tp: int, tp_rank: int, kv_heads: int, ep: int, ep_rank: int, etp: int, experts: int, pp: int = 1, pp_rank: int = 0,
    qkv_bias: bool = False,
) -> "GPTModel":
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.tp = StandIn(tp, tp_rank)
    groups.pp = StandIn(pp, pp_rank)
    groups.ep = StandIn(ep, ep_rank)
    groups.expt_tp = StandIn(etp, tp_rank % etp)
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=MOE_FFN, expert_model_parallel_size=ep,
               expert_tensor_parallel_size=etp, moe_router_topk=2) if experts else {}
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=kv_heads,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        bias_activation_fusion=False, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, add_qkv_bias=qkv_bias, **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    padded = -(-VOCAB // (8 * tp)) * 8 * tp
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=padded, max_sequence_length=32,
        share_embeddings_and_output_weights=False, position_embedding_type="rope", pg_collection=groups,
        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
    )


class Stop(Exception):
    pass


def qkv_rows(attentions: List, tp_rank_of: List[int]) -> Dict[Tuple[int, int], Tuple[str, int]]:
    """{(model index, local row of linear_qkv): (q / k / v, HF row)} for the TP ranks of one layer,
    read from Megatron-core's own get_query_key_value_tensors on weights whose row R of model m is
    the number m * 1000 + R (its all-gather over TP, when kv heads are fewer than ranks, is the
    concatenation of the ranks' own outputs)."""
    x = torch.zeros(1, 1, HIDDEN)
    x[0, 0, 0] = 1.0
    for m, attention in enumerate(attentions):
        weight = attention.linear_qkv.weight
        weight.data.copy_((torch.arange(weight.shape[0], dtype=torch.float32) + m * 1000)[:, None].expand_as(weight))

    def gather(mixed, group=None):
        return torch.cat([a.linear_qkv(x)[0] for a in attentions], dim=-1)

    found: Dict[Tuple[int, int], Tuple[str, int]] = {}
    qpg = HEADS // attentions[0].config.num_query_groups
    with patched(megatron_attention, "all_gather_last_dim_from_tensor_parallel_region", gather), torch.no_grad():
        for m, attention in enumerate(attentions):
            query, key, value = attention.get_query_key_value_tensors(x)[:3]
            heads, groups = query.shape[2], key.shape[2]
            first_head = tp_rank_of[m] * heads
            for i in range(heads):
                for d in range(HEAD_DIM):
                    claim(found, divmod(int(query[0, 0, i, d]), 1000), ("q", (first_head + i) * HEAD_DIM + d))
            for g in range(groups):
                hf_group = (first_head + g * (heads // groups)) // qpg
                for d in range(HEAD_DIM):
                    claim(found, divmod(int(key[0, 0, g, d]), 1000), ("k", hf_group * HEAD_DIM + d))
                    claim(found, divmod(int(value[0, 0, g, d]), 1000), ("v", hf_group * HEAD_DIM + d))
    return found


def fc1_rows(mlp, tp_rank: int) -> Dict[int, Tuple[str, int]]:
    """{local row of linear_fc1: (gate / up, HF row)} from Megatron-core's own MLP.forward on a
    row-numbered fc1: its activation sees the gate rows, linear_fc2 receives the up rows."""
    weight = mlp.linear_fc1.weight
    weight.data.copy_(torch.arange(weight.shape[0], dtype=torch.float32)[:, None].expand_as(weight))
    x = torch.zeros(1, 1, mlp.config.hidden_size)
    x[0, 0, 0] = 1.0
    seen = {}

    def activation(gate):
        seen["gate"] = gate.clone()
        return torch.ones_like(gate)

    def before_fc2(module, inputs):
        seen["up"] = inputs[0].clone()
        raise Stop

    hook = mlp.linear_fc2.register_forward_pre_hook(before_fc2)
    try:
        with patched(mlp.config, "activation_func", activation), torch.no_grad(), contextlib.suppress(Stop):
            mlp(x)
    finally:
        hook.remove()
    local = mlp.linear_fc2.weight.shape[1]  # its input partition, whichever linear class it is
    found: Dict[int, Tuple[str, int]] = {}
    for part in ("gate", "up"):
        for i in range(local):
            claim(found, int(seen[part][0, 0, i]), (part, tp_rank * local + i))
    return found


def fill_mlp(mlp, rank: int, hf: str, ckpt, testcase) -> None:
    """A dense MLP, a routed expert or the shared experts of either layer spec: fc1 rows by
    megatron-core's own forward (fc1_rows), fc2 columns by its input partition."""
    rows = {row: (f"{hf}.{part}_proj.weight", r) for row, (part, r) in fc1_rows(mlp, rank).items()}
    fill_rows(mlp.linear_fc1.weight, rows, ckpt, testcase)
    cols = mlp.linear_fc2.weight.shape[1]
    with torch.no_grad():
        mlp.linear_fc2.weight.copy_(ckpt[f"{hf}.down_proj.weight"][:, rank * cols : (rank + 1) * cols])


def claim(found: dict, key, what) -> None:
    """Records that row `key` holds `what`; a row read as two things fails the test."""
    if found.setdefault(key, what) != what:
        raise AssertionError(f"row {key} holds both {found[key]} and {what}")


@contextlib.contextmanager
def patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def fill_rows(param, rows: Dict[int, Tuple[str, int]], tensors: Dict[str, "torch.Tensor"], testcase) -> None:
    testcase.assertEqual(sorted(rows), list(range(param.shape[0])), "every fused row is read by Megatron")
    with torch.no_grad():
        for row, (name, hf_row) in rows.items():
            param[row].copy_(tensors[name][hf_row])


def fill_ends(model, tp_rank: int, vocab: int, ckpt) -> None:
    """A Megatron rank's embedding (first stage) and output layer and final norm (last stage) from
    the checkpoint, by Megatron-core's own vocabulary ranges; padding rows past `vocab` hold -1."""
    with torch.no_grad():
        if model.pre_process:
            embedding = model.embedding.word_embeddings
            embedding.weight.fill_(-1.0)
            lo, hi = embedding.vocab_start_index, min(embedding.vocab_end_index, vocab)
            if lo < hi:
                embedding.weight[: hi - lo].copy_(ckpt["model.embed_tokens.weight"][lo:hi])
        if model.post_process:
            out = model.output_layer.weight
            out.fill_(-1.0)
            lo = tp_rank * out.shape[0]
            hi = min(lo + out.shape[0], vocab)
            if lo < hi:
                out[: hi - lo].copy_(ckpt["lm_head.weight"][lo:hi])
            model.decoder.final_layernorm.weight.copy_(ckpt["model.norm.weight"])


@unittest.skipIf(MISSING, MISSING or "")
class MegatronPublisherTest(unittest.TestCase):
    def refit(
        self, tp: int, kv_heads: int, ep: int = 1, etp: int = 1, experts: int = 0, pp: int = 1, qkv_bias: bool = False
    ) -> None:
        shape = hf_shape(kv_heads, experts)
        ckpt = checkpoint(shape)
        if qkv_bias:  # Qwen2's q/k/v biases, numbered after the weights
            for layer in range(LAYERS):
                for p, rows in (("q", HEADS), ("k", kv_heads), ("v", kv_heads)):
                    ckpt[f"model.layers.{layer}.self_attn.{p}_proj.bias"] = torch.arange(rows * HEAD_DIM, dtype=torch.float32) + (
                        900000 + layer * 1000 + "qkv".index(p) * 100 + 1
                    )
        ranks = [(t, e, s) for s in range(pp) for e in range(ep) for t in range(tp)]
        models = [build(tp, t, kv_heads, ep, e, etp, experts, pp, s, qkv_bias) for t, e, s in ranks]
        for e in range(ep):
            for stage in range(pp):
                members = [i for i, (_, re, rs) in enumerate(ranks) if (re, rs) == (e, stage)]
                for local_layer in range(len(models[members[0]].decoder.layers)):
                    attentions = [models[i].decoder.layers[local_layer].self_attention for i in members]
                    hf = f"model.layers.{models[members[0]].decoder.layers[local_layer].layer_number - 1}"
                    rows = qkv_rows(attentions, [ranks[i][0] for i in members])
                    for m in range(len(members)):
                        for kind in ("weight", "bias") if qkv_bias else ("weight",):
                            local = {row: (f"{hf}.self_attn.{p}_proj.{kind}", r) for (mm, row), (p, r) in rows.items() if mm == m}
                            fill_rows(getattr(attentions[m].linear_qkv, kind), local, ckpt, self)
        for (t, e, s), model in zip(ranks, models):
            self.fill_plain(model, t, tp, etp, experts, ckpt)
        tables = []
        for device, model in enumerate(models):
            tables.append(MegatronModulePublisher(model, vocab=VOCAB).table(0, device=device))
        received = {name: torch.full_like(t, -1.0) for name, t in ckpt.items()}
        receiver = refit.Table()
        for name, tensor in received.items():
            add_tensor_need(receiver, name, tensor, 0, device=len(models))
        tables.append(receiver)
        with refit.Plan.build(tables) as plan, refit.Group(range(len(models) + 1), refit.Backend.HOST) as group:
            for route in plan.routes():
                group.copy_batch(route.dst_device, route.segments)
        for table in tables:
            table.close()
        for name, tensor in ckpt.items():
            wrong = int((received[name] != tensor).sum())
            self.assertEqual(wrong, 0, f"tp {tp} kv {kv_heads} ep {ep} etp {etp}: {wrong} elements of {name} differ")

    def fill_plain(self, model, tp_rank: int, tp: int, etp: int, experts: int, ckpt) -> None:
        """Everything but linear_qkv, by Megatron-core's own ranges."""
        fill_ends(model, tp_rank, VOCAB, ckpt)
        with torch.no_grad():
            for layer in model.decoder.layers:
                hf = f"model.layers.{layer.layer_number - 1}"  # Megatron's own global layer number
                layer.input_layernorm.weight.copy_(ckpt[f"{hf}.input_layernorm.weight"])
                layer.pre_mlp_layernorm.weight.copy_(ckpt[f"{hf}.post_attention_layernorm.weight"])
                proj = layer.self_attention.linear_proj
                cols = proj.input_size_per_partition
                proj.weight.copy_(ckpt[f"{hf}.self_attn.o_proj.weight"][:, tp_rank * cols : (tp_rank + 1) * cols])
                if experts:
                    layer.mlp.router.weight.copy_(ckpt[f"{hf}.mlp.gate.weight"])
                    for j, e in enumerate(layer.mlp.local_expert_indices):
                        fill_mlp(layer.mlp.experts.local_experts[j], tp_rank % etp, f"{hf}.mlp.experts.{e}", ckpt, self)
                else:
                    fill_mlp(layer.mlp, tp_rank, f"{hf}.mlp", ckpt, self)


    def test_dense_tp_1_2_4_with_1_2_4_8_kv_heads(self):
        for tp in (1, 2, 4):
            for kv_heads in (1, 2, 4, 8):
                with self.subTest(tp=tp, kv_heads=kv_heads):
                    self.refit(tp, kv_heads)

    def test_pipeline_stages_and_qwen2_qkv_biases(self):
        for tp, pp, kv_heads in ((2, 2, 2), (4, 2, 1)):
            with self.subTest(tp=tp, pp=pp, kv_heads=kv_heads):
                self.refit(tp, kv_heads, pp=pp, qkv_bias=True)

    def test_experts_ep_1_2_with_expert_tp_1_and_tp(self):
        for ep, etp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            with self.subTest(ep=ep, etp=etp):
                self.refit(2, 2, ep=ep, etp=etp, experts=EXPERTS)


if __name__ == "__main__":
    unittest.main()
