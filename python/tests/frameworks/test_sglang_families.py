"""refit's SGLang adapter on other model families than test_sglang_real's Qwen3, against SGLang
0.5.23's own code on CPU: SGLang's own model class per TP rank (two gloo processes, SGLang's
parallel state, expert parallelism where asked), its own weight updater calling refit's loader, and
the rank's needs recorded from that model's own `load_weights` (refit.integrations.sglang
recorded_table). The trainer offers the checkpoint's own tensors whole. After each of two updates
(the second with every weight bumped by 1) every parameter, and every tensor a module derives from
them and holds as a plain attribute (DeepSeek's MLA w_kc / w_vc, derived by SGLang's
post_load_weights) or as a buffer (Gemma 2's GemmaRMSNorm.gemma_weight), equals SGLang's own disk
load (DefaultModelLoader.load_weights_and_postprocess) of the same checkpoint. One difference is allowed, and counted: the padded vocabulary rows, which
SGLang's loader zero-fills and refit leaves (the recording reports them; logits are cut to the
vocabulary and those rows are never looked up), and likewise a rank's shard of a padded
VocabParallelEmbedding that holds padding only (the recording lists it as unwritten: Qwen3-VL's and
SigLIP's 16 vision position embeddings, padded to 64 rows, leave rank 1 none).

The families are those the hand-written layout rules got wrong: Qwen3-MoE with expert parallelism
(the rules laid experts out by TP, and the update wrote wrong expert weights without an error),
DeepSeek-V3 with expert parallelism (MLA with q LoRA; q_a_proj and kv_a_proj_with_mqa are
concatenated by SGLang's loader into one fused parameter, recorded part by part), Phi-3 (a
checkpoint with fused qkv_proj / gate_up_proj), Gemma 3 (norms the rules did not know), Qwen2 (q/k/v biases); and those
most likely to differ from SGLang's load: plain Llama, Qwen2-MoE with expert parallelism (a shared
expert and its shared_expert_gate beside the routed experts), Gemma 2 (four norms a layer, whose
weight loader also refreshes a derived buffer: staged), DeepSeek-V2-Lite with expert parallelism
(MLA without q LoRA: q_proj whole, nothing staged) and GLM-4-MoE with expert parallelism (a dense
first layer, a shared expert, e_score_correction_bias).

More families, each for what its loader does differently: Mixtral with expert parallelism
(block_sparse_moe's per-expert w1 / w2 / w3), InternLM2 (a checkpoint wqkv interleaving q, k and v
per kv group, which the loader views per group, splits and reshapes, a copy, before cutting each
rank's q / k / v from it), GraniteMoE with expert parallelism (experts fused in the checkpoint:
input_linear [E, 2 x inter, hidden], chunked into gate and up), Cohere (per-head q / k norm weights
of shape [heads, head_dim], sharded by head; LayerNorms without bias; tied embeddings), StableLM
(LayerNorms with biases, q / k / v biases, partial rotary), GPT-2 (Conv1D weights stored transposed,
a fused c_attn split into q / k / v, learned positions, biases everywhere), ChatGLM (GLM-4's fused
query_key_value with bias and fused dense_h_to_4h, multi-query groups), OLMo 2 (q / k norms over
all heads, replicated while q / k are sharded), Llama 4 (Llama4ForConditionalGeneration as
published, with expert parallelism and multimodal on: experts fused in the checkpoint
[E, hidden, 2 x inter], a shared expert; the vision tower's q / k / v stacked with biases, its
adapter and projector),
GPT-OSS (unquantized: q / k / v / o biases, attention sinks, experts fused with biases; its sinks
are kept in bf16 by SGLang, a dtype conversion staged, and its loader zeroes the row-parallel
expert down bias in place on every TP rank but the first, staged there), PhiMoE with expert
parallelism (the Hub's PhiMoEForCausalLM; LayerNorms with biases, a vocab-parallel lm_head bias),
Apertus (xIELU's one-element parameters and buffers, which SGLang's loader fills with
`loaded_weight.item()`: staged, and known as reached because the recorder gives the loader that
tensor once more with values), GPT-BigCode (multi-query: one kv head replicated inside each rank's
fused c_attn) and ERNIE 4.5 MoE with expert parallelism (a dense first layer, shared experts,
e_score_correction_bias), GLM-4.7-Flash with expert parallelism (MLA with q LoRA under GLM's
names), MiniMax-M2 with expert parallelism (q / k norms over all heads, sharded with them; a routing
bias) and Ministral 3. Qwen3 is test_sglang_real's model. Every test asserts exactly what is
staged and what no checkpoint element reaches (unwritten: nothing, but the vision position
embeddings below).

Vision-language families, as SGLang serves them (its image-text class, the vision tower sharded by
TP like the language model), from the checkpoint transformers 5 writes: Qwen2.5-VL (a fused
checkpoint qkv in the vision blocks, split into q / k / v per rank; gate/up stacked with biases; a
Conv3d patch embedding, replicated; the merger MLP), Qwen3-VL (the same fused qkv; learned position
embeddings in a VocabParallelEmbedding; a deepstack merger; q/k norms in the text model), Qwen2-VL
(tied embeddings; LayerNorms, fc1 / fc2 in the vision blocks) and Gemma 3 (SigLIP's q / k / v stacked
with biases, its position embeddings vocab-parallel, the projector's bare mm_input_projection_weight).
Nothing is staged. SGLang 0.5.23 builds no LLaVA with a CLIP tower (llava-hf's layout):
LlavaForConditionalGeneration resolves CLIPVisionModel, which SGLang does not register, to its
Transformers backend, which raises "AttributeError: 'Conv2d' object has no attribute 'num_embeddings'".

Not covered, with what SGLang 0.5.23 does on CPU:
- MiniCPM3: its load_weights derives w_kc / w_vc from kv_b_proj and then deletes kv_b_proj, so no
  second load can run (SGLang's own update_weights_from_tensor included): "KeyError:
  'model.layers.0.self_attn.kv_b_proj.weight'".
- EXAONE 4 (sliding window): ServerArgs refuses the CPU's attention backend: "AssertionError: One of
  the attention backends in ['fa3', 'triton', 'trtllm_mha'] is required for Exaone4ForCausalLM,
  but got intel_amx".
- OLMoE with grouped kv heads (families.py's config; OLMoE as released has as many kv heads as
  query heads): SGLang sizes k_norm for all heads: "AssertionError: Attempted to load weight
  (torch.Size([16])) into parameter (torch.Size([32]))".
- GPT-OSS with expert parallelism: the unquantized fused-expert loader copies the checkpoint's
  tensor of all 4 experts into a rank's 2: "RuntimeError: The size of tensor a (2) must match the size of tensor b (4) at
  non-singleton dimension 0" (FusedMoE._load_w2); covered at TP 2 above.
- Qwen3-Next: ServerArgs refuses its Mamba radix cache on CPU ("AssertionError: extra_buffer
  requires platform support for Mamba cache state snapshots"); with the radix cache disabled (and
  full_attention_interval, which transformers 5 no longer writes, set), its gated delta-net layer
  calls torch.cuda.current_device() when built: "RuntimeError: Found no NVIDIA driver on your
  system".
- EXAONE-MoE: as EXAONE 4 ("... is required for ExaoneMoeForCausalLM, but got intel_amx").
- Qwen3.5 and Qwen3.5-MoE: as Qwen3-Next ("AssertionError: extra_buffer requires platform support
  for Mamba cache state snapshots").
- DeepSeek-V3.2: its sparse attention (NSA) backend calls CUDA when built: "RuntimeError: Found no
  NVIDIA driver on your system".
- Gemma 4: SGLang reads a global head_dim that transformers 5.20 keeps per layer:
  "AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute and may vary across layers".
- Llama 4 text-only (Llama4ForCausalLM): its load_weights (LlamaForCausalLM's) has no mapping for
  the fused experts ("Parameter model.layers.0.feed_forward.experts.gate_up_proj not found in
  params_dict", the experts left as built); covered as Llama4ForConditionalGeneration above.
"""

from __future__ import annotations

import json
import math
import os
import unittest
from typing import Any, Dict, List, Optional

import families
import sglang_driver
import test_vllm_backend as shared
import vllm_harness

HERE = os.path.dirname(os.path.abspath(__file__))
TP = 2


def save(family: str) -> str:
    """The family's tiny checkpoint (families.py), with what SGLang reads from a real config that
    transformers 5 no longer writes. A vision-language family's is its image-text class's, saved as
    the Hub has it (vllm_harness.hf_folder: Qwen2-VL / Qwen2.5-VL model.layers.*, visual.*, lm_head;
    Qwen3-VL model.language_model.*, model.visual.*; Gemma 3 language_model.model.*,
    vision_tower.vision_model.*, multi_modal_projector.*; Llama 4 with the index of a sharded
    checkpoint). The architecture as the Hub's config names it (families.ARCHITECTURES: PhiMoE);
    a family written by hand (families.HandWritten: InternLM2, ChatGLM) with random values."""
    config = families.FAMILIES[family]()
    if hasattr(config, "vision_config"):
        if family == "qwen2_vl":
            # Real Qwen2-VL configs carry it; SGLang's Qwen2VisionTransformer reads it (transformers 5: in_channels).
            config.vision_config.in_chans = config.vision_config.in_channels
        folder = vllm_harness.hf_folder(family, config)
        if family == "llama4_mm":
            # The Hub's Llama 4 is sharded, with an index: SGLang builds its vision tower only when the
            # index names vision tensors (Llama4ForConditionalGeneration._has_vision_weights).
            from safetensors import safe_open

            with safe_open(os.path.join(folder, "model.safetensors"), "pt") as handle:
                names = list(handle.keys())
            with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
                json.dump({"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}, handle)
        return folder
    if isinstance(config, vllm_harness.HandWritten):
        return hand_written(family, config)
    if family == "phimoe":
        # SGLang's PhiMoE builds lm_head with a bias whatever the config says: the checkpoint
        # carries one, so that it is checked (a vocab-parallel bias, padded).
        config.lm_head_bias = True
    if family == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    if family == "gemma2":
        # Real Gemma 2 configs carry both names; SGLang's Gemma2DecoderLayer reads hidden_act.
        config.hidden_act = config.hidden_activation
    if family.startswith("deepseek"):
        config.moe_layer_freq = 1
        config.scoring_func = "sigmoid"
        # SGLang's CPU rope (get_rope_cpu) takes DeepSeek's YaRN only, as the real V3 has.
        config.rope_parameters = {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
        }
    folder = shared.save_checkpoint(config)
    if family in families.ARCHITECTURES:  # as the Hub's config names it (save_pretrained writes its class's)
        path = os.path.join(folder, "config.json")
        with open(path) as handle:
            written = json.load(handle)
        written["architectures"] = [families.ARCHITECTURES[family]]
        with open(path, "w") as handle:
            json.dump(written, handle)
    return folder


def hand_written(family: str, config: Any) -> str:
    """A family whose modeling code is on the Hub: its config and tensors as that code saves them
    (families.py), with random values (vllm_harness writes zeros, which would hide a misplaced row)."""
    import torch
    from safetensors.torch import save_file

    folder = vllm_harness.hf_folder(family, config)
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in config.tensors.items()}
    save_file(tensors, os.path.join(folder, config.files[1]))
    return folder


def rank_main(rank: int, ep: bool, server_args: Dict[str, Any], folder: str, port: int, conn: Any) -> None:
    import sys

    sys.path.insert(0, HERE)
    sglang_rank = sglang_driver.sglang_rank(rank, TP, folder, port, ep, **server_args)  # first: it sets SGLang's environment
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from refit.integrations import sglang as adapter

    model = sglang_rank.model
    ckpt = shared.checkpoint(folder)

    def served(m: Any) -> Dict[str, Any]:
        """Parameters, buffers (Gemma 2's GemmaRMSNorm.gemma_weight, weight + 1, refreshed by its
        weight loader), and tensors modules hold as plain attributes (derived from parameters)."""
        out = {n: p.detach() for n, p in m.named_parameters()}
        out.update(m.named_buffers())
        for prefix, module in m.named_modules():
            out.update((f"{prefix}.{k}", v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("_"))
        return out

    def compared(bumps: int) -> Dict[str, Any]:
        """Against SGLang's own load of the checkpoint after `bumps` bumps: the tensors that differ
        outside the vocabulary padding, the padding elements that differ, the tensors compared."""
        weights = dict(ckpt)
        for _ in range(bumps):
            weights = {n: t + 1.0 for n, t in weights.items()}
        reference = sglang_rank.build("dummy")
        DefaultModelLoader.load_weights_and_postprocess(reference, iter(list(weights.items())), torch.device("cpu"))
        want, got = served(reference), served(model)
        recording = adapter._receivers[id(model)]._needs.receiver.recording
        padding = dict(recording.padding)
        # A rank whose shard of a padded VocabParallelEmbedding is padding only (Qwen3-VL's 16
        # vision position embeddings, 64 rows padded, 32 a rank): no box reaches it, the recording
        # lists it as unwritten, SGLang's loader zero-fills all of it.
        padding.update((name, math.prod(recording.params[name].shape)) for name in recording.unwritten)
        differing, padded = [], 0
        for name in sorted(set(want) | set(got)):
            if name not in want or name not in got or want[name].shape != got[name].shape:
                differing.append(f"{name}: only one side has it, or shapes differ")
                continue
            wrong = got[name] != want[name]
            # Padding: rows SGLang zero-fills that no checkpoint element lands in.
            in_padding = int((wrong & (want[name] == 0)).sum()) if name in padding else 0
            if int(wrong.sum()) > in_padding or in_padding > padding.get(name, 0):
                differing.append(f"{name}: {int(wrong.sum())} of {wrong.numel()} differ")
            padded += in_padding
        return {"differing": differing, "padding": padded, "compared": len(want)}

    while True:
        try:
            kind, arg = conn.recv()
        except EOFError:
            return
        try:
            if kind in sglang_driver.WEIGHT_UPDATE_KINDS:
                value: Any = sglang_driver.weight_update(sglang_rank.manager, kind, arg)
            elif kind == "compared":
                value = compared(arg)
            elif kind == "staged":
                value = sorted(adapter._receivers[id(model)]._needs.receiver.recording.staged)
            elif kind == "unwritten":
                value = list(adapter._receivers[id(model)]._needs.receiver.recording.unwritten)
            elif kind == "refusals":
                value = list(adapter._receivers[id(model)].refusals)
            elif kind == "exit":
                return
            else:
                raise ValueError(kind)
            conn.send(("ok", value))
        except BaseException as error:
            conn.send(("error", f"{type(error).__name__}: {error}"))


def trainer_main(folder: str, conns: List[Any], results: Any) -> None:
    try:
        import torch

        from refit.integrations.engine_link import LinkOptions
        from refit.integrations.sglang import SglangTrainer, engine_call

        call = sglang_driver.fan_out(conns)
        engine = sglang_driver.Engine(call, TP)
        # The checkpoint's own tensors, offered whole: transformers' in-memory MoE models fuse the
        # experts under other names than their checkpoint's.
        weights = shared.checkpoint(folder)
        trainer = SglangTrainer(engine_call(engine), weights, num_workers=TP, device_backend="host", options=LinkOptions(timeout_ms=shared.TIMEOUT_MS))
        out: Dict[str, Any] = {"dummy": call("compared", 0)}
        trainer.update()
        out["first"] = call("compared", 0)
        with torch.no_grad():
            for tensor in weights.values():
                tensor.add_(1.0)
        trainer.update()
        out["second"] = call("compared", 1)
        out["staged"] = call("staged")
        out["unwritten"] = call("unwritten")
        out["refusals"] = call("refusals")
        results.put(out)
        trainer.shutdown()
        for conn in conns:
            conn.send(("exit", None))
    except BaseException:
        import traceback

        results.put({"error": traceback.format_exc()})


class SglangFamiliesTest(unittest.TestCase):
    def run_family(self, family: str, ep: bool = False, unwritten: Optional[List[List[str]]] = None, **server_args: Any) -> Dict[str, Any]:
        """SGLang's model of `family` at TP 2 (EP 2 with `ep`; `server_args` as launched) updated
        twice; every tensor equal to SGLang's own load, nothing refused, exactly `unwritten` (per
        rank; none by default) reached by no checkpoint element. Returns what the ranks reported."""
        folder = save(family)
        out = sglang_driver.run_processes(TP, rank_main, (ep, server_args, folder, sglang_driver.free_port()), trainer_main, (folder,), 480)
        self.assertNotIn("error", out, out.get("error"))
        # The dummy weights differ from the checkpoint in every parameter, so passing is no accident.
        for rank in range(TP):
            self.assertGreater(len(out["dummy"][rank]["differing"]), out["dummy"][rank]["compared"] // 2, out["dummy"][rank])
            for update in ("first", "second"):
                self.assertEqual(out[update][rank]["differing"], [], f"{family} rank {rank} after the {update} update")
        self.assertEqual(out["refusals"], [[]] * TP)
        self.assertEqual(out["unwritten"], unwritten if unwritten is not None else [[]] * TP)
        return out

    def test_qwen3_moe_with_expert_parallelism(self):
        self.assertEqual(self.run_family("qwen3_moe", ep=True)["staged"], [[]] * TP)

    def test_deepseek_v3_with_expert_parallelism(self):
        # SGLang's loader concatenates q_a_proj and kv_a_proj_with_mqa into one fused parameter: a
        # concatenation of checkpoint views, recorded part by part as boxes.
        self.assertEqual(self.run_family("deepseek_v3", ep=True)["staged"], [[]] * TP)

    def test_phi3_fused_checkpoint_tensors(self):
        self.assertEqual(self.run_family("phi3")["staged"], [[]] * TP)

    def test_gemma3(self):
        self.assertEqual(self.run_family("gemma3")["staged"], [[]] * TP)

    def test_qwen2_biases(self):
        self.assertEqual(self.run_family("qwen2")["staged"], [[]] * TP)

    def test_llama(self):
        self.assertEqual(self.run_family("llama")["staged"], [[]] * TP)

    def test_qwen2_moe_shared_expert_with_expert_parallelism(self):
        self.assertEqual(self.run_family("qwen2_moe", ep=True)["staged"], [[]] * TP)

    def test_gemma2_norms_staged_for_their_derived_buffer(self):
        # GemmaRMSNorm's weight loader also refreshes a buffer from the weight (gemma_weight =
        # weight + 1), which boxes would leave stale: the norms are staged and SGLang's loader takes them.
        norms = [f"model.layers.{i}.{n}.weight" for i in range(2) for n in
                 ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        self.assertEqual(self.run_family("gemma2")["staged"], [sorted(norms + ["model.norm.weight"])] * TP)

    def test_deepseek_v2_lite_with_expert_parallelism(self):
        self.assertEqual(self.run_family("deepseek_v2_lite", ep=True)["staged"], [[]] * TP)

    def test_glm4_moe_with_expert_parallelism(self):
        self.assertEqual(self.run_family("glm4_moe", ep=True)["staged"], [[]] * TP)

    def test_mixtral_with_expert_parallelism(self):
        self.assertEqual(self.run_family("mixtral", ep=True)["staged"], [[]] * TP)

    def test_internlm2_interleaved_wqkv(self):
        # wqkv viewed per kv group, split, and each part reshaped (a copy: not a view of the
        # checkpoint tensor) before the q / k / v shards are cut from it: recorded through the copy.
        self.assertEqual(self.run_family("internlm2")["staged"], [[]] * TP)

    def test_granitemoe_fused_experts_with_expert_parallelism(self):
        self.assertEqual(self.run_family("granitemoe", ep=True)["staged"], [[]] * TP)

    def test_cohere_per_head_norms(self):
        self.assertEqual(self.run_family("cohere")["staged"], [[]] * TP)

    def test_stablelm_layernorm_biases(self):
        self.assertEqual(self.run_family("stablelm")["staged"], [[]] * TP)

    def test_gpt2_conv1d(self):
        self.assertEqual(self.run_family("gpt2")["staged"], [[]] * TP)

    def test_chatglm_fused_query_key_value(self):
        self.assertEqual(self.run_family("chatglm")["staged"], [[]] * TP)

    def test_olmo2_full_width_qk_norms(self):
        self.assertEqual(self.run_family("olmo2")["staged"], [[]] * TP)

    def test_llama4_multimodal_with_expert_parallelism(self):
        self.assertEqual(self.run_family("llama4_mm", ep=True, enable_multimodal=True)["staged"], [[]] * TP)

    def test_phimoe_with_expert_parallelism(self):
        self.assertEqual(self.run_family("phimoe", ep=True)["staged"], [[]] * TP)

    def test_apertus_xielu_scalars_staged(self):
        # xIELU's one-element alpha_p / alpha_n (parameters) and beta / eps (buffers SGLang's loader
        # adds to its params_dict): SGLang's default_weight_loader fills each with
        # loaded_weight.item(), a value the recording cannot read: staged, and reached (not unwritten).
        scalars = [f"model.layers.{i}.mlp.act_fn.{n}" for i in range(2) for n in ("alpha_p", "alpha_n", "beta", "eps")]
        self.assertEqual(self.run_family("apertus")["staged"], [sorted(scalars)] * TP)

    def test_gpt_bigcode_multi_query(self):
        self.assertEqual(self.run_family("gpt_bigcode")["staged"], [[]] * TP)

    def test_ernie45_moe_with_expert_parallelism(self):
        self.assertEqual(self.run_family("ernie45_moe", ep=True)["staged"], [[]] * TP)

    def test_gpt_oss_sinks_and_expert_biases(self):
        # SGLang keeps the attention sinks in bf16 whatever the model's dtype (a float32 checkpoint
        # here: a dtype conversion, staged); its loader zeroes the row-parallel expert down bias on
        # every TP rank but the first, in place (rank 1's down_proj_bias: staged).
        sinks = [f"model.layers.{i}.self_attn.sinks" for i in range(2)]
        biases = [f"model.layers.{i}.mlp.experts.down_proj_bias" for i in range(2)]
        self.assertEqual(self.run_family("gpt_oss")["staged"], [sorted(sinks), sorted(sinks + biases)])

    def test_glm4_moe_lite_mla_with_expert_parallelism(self):
        # GLM-4.7-Flash: MLA with q LoRA under GLM's names, fused like DeepSeek-V3's, nothing staged.
        self.assertEqual(self.run_family("glm4_moe_lite", ep=True)["staged"], [[]] * TP)

    def test_minimax_m2_full_width_qk_norms_with_expert_parallelism(self):
        self.assertEqual(self.run_family("minimax_m2", ep=True)["staged"], [[]] * TP)

    def test_ministral3(self):
        self.assertEqual(self.run_family("ministral3")["staged"], [[]] * TP)

    def run_vl_family(self, family: str, unwritten_on_rank_1: List[str]) -> None:
        out = self.run_family(family, unwritten=[[], unwritten_on_rank_1])
        self.assertEqual(out["staged"], [[]] * TP)

    def test_qwen2_5_vl(self):
        self.run_vl_family("qwen2_5_vl", [])

    def test_qwen3_vl(self):
        # 16 position embeddings in 64 padded rows: rank 1's 32 rows are padding only.
        self.run_vl_family("qwen3_vl", ["visual.pos_embed.weight"])

    def test_qwen2_vl_tied_embeddings(self):
        self.run_vl_family("qwen2_vl", [])

    def test_gemma3_multimodal(self):
        self.run_vl_family("gemma3_mm", ["vision_tower.vision_model.embeddings.position_embedding.weight"])


if __name__ == "__main__":
    unittest.main()
