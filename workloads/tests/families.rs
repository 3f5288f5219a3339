//! The model families beyond Qwen3 and Llama: DeepSeek-V3-style latent attention with leading dense
//! layers, shared experts and an FP32 router bias; tied embeddings; vocabularies that do not divide
//! by TP; Megatron pipeline stages; vLLM expert parallelism. Parameter counts against the published
//! ones, every element of every box against memory-to-tensor formulas of each framework written
//! here independently of the generator, and refits planned and copied on host memory that must
//! install every receiver element.

mod common;

use common::{check_elements, for_each_element, layer_of, Locate};
use refit::plan::{Endpoint, OwnerPolicy, PlanOptions, Region};
use refit::Status;
use refit_workloads::{
    element_value, endpoints, Arch, ArchSpec, Attention, ExpertPlacement, Experts, MegatronRanks, Mla, Model,
    Packing, Placed, Role, VllmRanks, Workload,
};
use std::collections::HashMap;

/// Parameter count straight from a model's config (not from the generator's tensor list).
fn parameter_count(a: &Arch) -> u64 {
    let h = a.hidden;
    let attention = match a.attention {
        Attention::Mla(m) => {
            let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let q = match m.q_lora_rank {
                Some(r) => r * h + r + m.heads * qk * r,
                None => m.heads * qk * h,
            };
            q + (m.kv_lora_rank + m.qk_rope_head_dim) * h
                + m.kv_lora_rank
                + m.heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
                + h * m.heads * m.v_head_dim
        }
        Attention::Gqa { heads, kv_heads, head_dim, qk_norm } => {
            2 * heads * head_dim * h + 2 * kv_heads * head_dim * h + if qk_norm { 2 * head_dim } else { 0 }
        }
    };
    let moe = a.moe.unwrap_or(Experts {
        experts: 0,
        ffn: 0,
        shared: 0,
        dense_layers: a.layers,
        router_bias: false,
    });
    let dense_mlp = 3 * a.ffn * h;
    let moe_mlp = moe.experts * h
        + if moe.router_bias { moe.experts } else { 0 }
        + moe.experts * 3 * moe.ffn * h
        + 3 * moe.shared * moe.ffn * h;
    let layers = a.layers * (attention + 2 * h)
        + moe.dense_layers * dense_mlp
        + (a.layers - moe.dense_layers) * moe_mlp;
    let vocab = if a.tied_embeddings { 1 } else { 2 } * a.vocab * h;
    vocab + layers + h
}

#[test]
fn published_parameter_counts() {
    // DeepSeek-V3 "671B" (685B on the hub with its 14B multi-token-prediction layer), Kimi-K2 "1T",
    // DeepSeek-V2-Lite "15.7B".
    let cases = [
        (Arch::deepseek_v3(), 671_026_419_200),
        (Arch::kimi_k2(), 1_026_408_232_448),
        (Arch::deepseek_v2_lite(), 15_706_484_224),
    ];
    for (arch, published) in cases {
        assert_eq!(parameter_count(&arch), published, "{}", arch.name);
        let catalog = refit_workloads::CheckpointTensors::of(&arch);
        let generated: u64 = (0..catalog.tensors.len() as u32).map(|t| catalog.elements(t)).sum();
        assert_eq!(generated, published, "{}", arch.name);
        let names: HashMap<&str, &refit::plan::TensorSpec> =
            catalog.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        assert_eq!(names.len(), catalog.tensors.len(), "tensor names are unique");
    }
    let catalog = refit_workloads::CheckpointTensors::of(&Arch::deepseek_v3());
    let shape =
        |name: &str| catalog.tensors.iter().find(|t| t.name == name).map(|t| (t.shape.clone(), t.elem_size));
    assert_eq!(shape("model.layers.0.self_attn.q_a_proj.weight"), Some((vec![1536, 7168], 2)));
    assert_eq!(shape("model.layers.0.self_attn.q_b_proj.weight"), Some((vec![128 * 192, 1536], 2)));
    assert_eq!(shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), Some((vec![576, 7168], 2)));
    assert_eq!(shape("model.layers.0.self_attn.kv_b_proj.weight"), Some((vec![128 * 256, 512], 2)));
    assert_eq!(shape("model.layers.0.self_attn.o_proj.weight"), Some((vec![7168, 128 * 128], 2)));
    assert_eq!(shape("model.layers.2.mlp.gate_proj.weight"), Some((vec![18_432, 7168], 2)));
    assert_eq!(shape("model.layers.3.mlp.gate_proj.weight"), None, "layer 3 is the first MoE layer");
    assert_eq!(shape("model.layers.3.mlp.experts.255.down_proj.weight"), Some((vec![7168, 2048], 2)));
    assert_eq!(shape("model.layers.60.mlp.shared_experts.up_proj.weight"), Some((vec![2048, 7168], 2)));
    assert_eq!(shape("model.layers.3.mlp.gate.e_score_correction_bias"), Some((vec![256], 4)));
    assert_eq!(shape("model.layers.2.mlp.gate.e_score_correction_bias"), None);
    let lite = refit_workloads::CheckpointTensors::of(&Arch::deepseek_v2_lite());
    assert!(lite.tensors.iter().any(|t| t.name == "model.layers.0.self_attn.q_proj.weight"));
    assert!(!lite.tensors.iter().any(|t| t.name.contains("q_a_proj") || t.name.contains("e_score")));
    let tied =
        refit_workloads::CheckpointTensors::of(&Arch::deepseek_v3().with_layers(1).with_tied_embeddings());
    assert_eq!(tied.lm_head, tied.embed);
    assert!(!tied.tensors.iter().any(|t| t.name == "lm_head.weight"));
}

// ---- Tiny models and their specs.

/// A DeepSeek-shaped model small enough to check element by element: 4 layers (the first dense),
/// 4 heads, 8 routed experts and 2 shared ones, a router bias, a vocabulary of 300 (padded by vLLM
/// to 320 and by Megatron to a multiple of 128 * tp).
fn tiny_mla() -> Arch {
    Arch {
        name: "tiny-mla".into(),
        layers: 4,
        hidden: 16,
        attention: Attention::Mla(Mla {
            heads: 4,
            q_lora_rank: Some(12),
            kv_lora_rank: 8,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 2,
            v_head_dim: 3,
        }),
        ffn: 20,
        moe: Some(Experts { experts: 8, ffn: 8, shared: 2, dense_layers: 1, router_bias: true }),
        vocab: 300,
        tied_embeddings: false,
        elem_size: 2,
        dtype: Arch::DTYPE_BF16,
    }
}

/// 6 heads and sizes that split over 2 and 3 ranks, with GPT-2's vocabulary of 50,257 rows (vLLM
/// pads it to 50,304, Megatron TP2 to 50,432).
fn tiny_mla_tp3() -> Arch {
    let mut a = tiny_mla();
    a.name = "tiny-mla-6-heads".into();
    if let Attention::Mla(m) = &mut a.attention {
        m.heads = 6;
    }
    a.ffn = 24;
    a.moe = Some(Experts { experts: 6, ffn: 6, shared: 2, dense_layers: 1, router_bias: true });
    a.vocab = 50_257;
    a
}

fn mla_mut(a: &mut Arch) -> &mut Mla {
    match &mut a.attention {
        Attention::Mla(m) => m,
        Attention::Gqa { .. } => unreachable!("a latent-attention model"),
    }
}

/// A grouped-query dense model (Llama-3.2-1B style) with tied embeddings.
fn tiny_tied_gqa() -> Arch {
    let model = Model {
        name: "tiny-tied".into(),
        layers: 4,
        hidden: 16,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        qk_norm: false,
        ffn: 24,
        moe: None,
        vocab: 300,
        elem_size: 2,
        dtype: 2,
    };
    Arch::from(&model).with_tied_embeddings()
}

/// `publishers` Megatron ranks (processes 0..) to `receivers` vLLM ranks (the next processes).
fn spec(model: Arch, publishers: MegatronRanks, receivers: VllmRanks) -> ArchSpec {
    ArchSpec::new(model, publishers, receivers)
}

fn megatron(ranks: u32, tp: u64, ep: u64, pp: u64) -> MegatronRanks {
    MegatronRanks::new(endpoints(0, ranks), tp, ep).with_pp(pp)
}

fn vllm(first: u32, ranks: u32, tp: u64) -> VllmRanks {
    VllmRanks { tp, ..VllmRanks::tp(endpoints(first, ranks)) }
}

/// Every spec below, with what it exercises.
fn tiny_specs() -> Vec<(&'static str, ArchSpec)> {
    let mut out = vec![
        ("TP2 x DP2 -> TP4", spec(tiny_mla(), megatron(4, 2, 1, 1), vllm(4, 4, 4))),
        ("EP4 -> TP2", spec(tiny_mla(), megatron(4, 1, 4, 1), vllm(4, 2, 2))),
        ("PP2 x TP2 x EP2 -> TP2", spec(tiny_mla(), megatron(8, 2, 2, 2), vllm(8, 2, 2))),
        (
            "PP2 (1 + 3 layers) x TP2 -> TP2",
            spec(
                tiny_mla(),
                MegatronRanks { first_stage_layers: Some(1), ..megatron(4, 2, 1, 2) },
                vllm(4, 2, 2),
            ),
        ),
        (
            "TP2 x EP2 -> TP2 x DP2 with EP",
            spec(tiny_mla(), megatron(4, 2, 2, 1), vllm(4, 4, 2).with_expert_parallel()),
        ),
        ("TP3 -> TP2, vocabulary 50,257", spec(tiny_mla_tp3(), megatron(3, 3, 1, 1), vllm(3, 2, 2))),
        ("TP2 -> TP3, vocabulary 50,257", spec(tiny_mla_tp3(), megatron(2, 2, 2, 1), vllm(2, 3, 3))),
        (
            "tied, PP2 x TP2 -> TP2",
            spec(tiny_mla().with_tied_embeddings(), megatron(4, 2, 1, 2), vllm(4, 2, 2)),
        ),
        ("tied, TP2 -> TP4", spec(tiny_mla().with_tied_embeddings(), megatron(2, 2, 1, 1), vllm(2, 4, 4))),
    ];
    // Uneven linear expert placement (3, 3, 2, 2) and round robin.
    let mut ten = tiny_mla().with_experts(10);
    ten.name = "tiny-mla-10-experts".into();
    out.push((
        "EP2 -> TP4 with EP, 10 experts",
        spec(ten.clone(), megatron(2, 1, 2, 1), vllm(2, 4, 4).with_expert_parallel()),
    ));
    let mut round_robin = vllm(2, 4, 2);
    round_robin.expert_parallel = Some(ExpertPlacement::RoundRobin);
    out.push(("EP2 -> TP2 x DP2 round-robin EP, 10 experts", spec(ten, megatron(2, 1, 2, 1), round_robin)));
    // Queries straight from the hidden state (DeepSeek-V2-Lite), no router bias, one shared expert.
    let mut lite = tiny_mla();
    lite.name = "tiny-mla-no-q-lora".into();
    mla_mut(&mut lite).q_lora_rank = None;
    lite.moe = Some(Experts { experts: 8, ffn: 8, shared: 1, dense_layers: 2, router_bias: false });
    out.push(("no q_lora_rank, TP2 -> TP2", spec(lite, megatron(2, 2, 2, 1), vllm(2, 2, 2))));
    let mut per_expert = spec(tiny_mla(), megatron(4, 2, 4, 1), vllm(4, 2, 2));
    per_expert.publishers.grouped_experts = false;
    out.push(("TP2 x EP4, one weight per expert -> TP2", per_expert));
    out
}

// ---- Element-level check: every box of every buffer, read back through memory-to-tensor formulas.

fn mla_of(a: &Arch) -> Mla {
    match a.attention {
        Attention::Mla(m) => m,
        Attention::Gqa { .. } => panic!("{} has no latent attention", a.name),
    }
}

/// A Megatron publisher's place: TP rank `t` of `tp`, EP rank `e` of `ep`, and the global index of
/// its stage's first layer.
#[derive(Clone, Copy)]
struct MegatronRank {
    t: u64,
    tp: u64,
    e: u64,
    ep: u64,
    first_layer: u64,
}

/// Element `i` of a row-split (column-parallel) block: rank `t` of blocks of `rows` rows of `cols`.
fn row_block(t: u64, rows: u64, cols: u64, i: u64) -> u64 {
    t * rows * cols + i
}

/// Element `i` of a column-split (row-parallel) block: rank `t`'s `cols` of each `full`-wide row.
fn col_block(t: u64, cols: u64, full: u64, i: u64) -> u64 {
    (i / cols) * full + t * cols + i % cols
}

/// A `[gate rows | up rows]` block of rank `t` (rows `f` each, of `h` columns) of an MLP `mlp`.
fn gate_up(mlp: &str, t: u64, f: u64, h: u64, i: u64) -> (String, u64) {
    let (row, col) = (i / h, i % h);
    let which = if row < f { "gate" } else { "up" };
    (format!("{mlp}.{which}_proj.weight"), (t * f + row % f) * h + col)
}

fn megatron_locate(a: &Arch, r: MegatronRank) -> Box<Locate> {
    let a = a.clone();
    Box::new(move |name: &str, i: u64| {
        let h = a.hidden;
        let m = mla_of(&a);
        let moe = a.moe.unwrap();
        let (local, tail) = layer_of(name, "decoder.layers.");
        let hf = |s: &str| format!("model.layers.{}.{s}", r.first_layer + local.unwrap());
        // TEGroupedMLP's `linear_fc1.weight{j}` is expert j's slice of the grouped weight.
        let (tail, i) = match tail.rsplit_once(".weight") {
            Some((base, j)) if base.starts_with("mlp.experts.linear_fc") && !j.is_empty() => {
                let per_expert = if base.ends_with("fc1") { 2 } else { 1 } * moe.ffn * h;
                (format!("{base}.weight"), i + j.parse::<u64>().unwrap() * per_expert)
            }
            _ => (tail, i),
        };
        let heads = m.heads / r.tp;
        let (row, col) = (i / h, i % h);
        Some(match tail.as_str() {
            "embedding.word_embeddings.weight" | "output_layer.weight" => {
                let rows = a.vocab.next_multiple_of(128 * r.tp) / r.tp;
                let global = r.t * rows + row;
                let tensor = if tail.starts_with("emb") || a.tied_embeddings {
                    "model.embed_tokens.weight"
                } else {
                    "lm_head.weight"
                };
                return (global < a.vocab).then(|| (tensor.to_string(), global * h + col));
            }
            "decoder.final_layernorm.weight" => ("model.norm.weight".into(), i),
            "input_layernorm.weight" => (hf("input_layernorm.weight"), i),
            "pre_mlp_layernorm.weight" | "mlp.linear_fc1.layer_norm_weight" => {
                (hf("post_attention_layernorm.weight"), i)
            }
            "self_attention.linear_q_down_proj.weight" => (hf("self_attn.q_a_proj.weight"), i),
            "self_attention.linear_q_up_proj.layer_norm_weight" => (hf("self_attn.q_a_layernorm.weight"), i),
            "self_attention.linear_q_up_proj.weight" => {
                let rows = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
                (hf("self_attn.q_b_proj.weight"), row_block(r.t, rows, m.q_lora_rank.unwrap(), i))
            }
            "self_attention.linear_q_proj.weight" => {
                let rows = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
                (hf("self_attn.q_proj.weight"), row_block(r.t, rows, h, i))
            }
            "self_attention.linear_kv_down_proj.weight" => (hf("self_attn.kv_a_proj_with_mqa.weight"), i),
            "self_attention.linear_kv_up_proj.layer_norm_weight" => {
                (hf("self_attn.kv_a_layernorm.weight"), i)
            }
            "self_attention.linear_kv_up_proj.weight" => {
                let rows = heads * (m.qk_nope_head_dim + m.v_head_dim);
                (hf("self_attn.kv_b_proj.weight"), row_block(r.t, rows, m.kv_lora_rank, i))
            }
            "self_attention.linear_proj.weight" => {
                let cols = heads * m.v_head_dim;
                (hf("self_attn.o_proj.weight"), col_block(r.t, cols, m.heads * m.v_head_dim, i))
            }
            "mlp.linear_fc1.weight" => {
                let (tensor, g) = gate_up("mlp", r.t, a.ffn / r.tp, h, i);
                (hf(&tensor), g)
            }
            "mlp.linear_fc2.weight" => (hf("mlp.down_proj.weight"), col_block(r.t, a.ffn / r.tp, a.ffn, i)),
            "mlp.router.weight" => (hf("mlp.gate.weight"), i),
            "mlp.router.expert_bias" => (hf("mlp.gate.e_score_correction_bias"), i),
            "mlp.experts.linear_fc1.weight" => {
                let per_expert = 2 * moe.ffn * h;
                let expert = r.e * (moe.experts / r.ep) + i / per_expert;
                let (tensor, g) = gate_up(&format!("mlp.experts.{expert}"), 0, moe.ffn, h, i % per_expert);
                (hf(&tensor), g)
            }
            "mlp.experts.linear_fc2.weight" => {
                let per_expert = h * moe.ffn;
                let expert = r.e * (moe.experts / r.ep) + i / per_expert;
                (hf(&format!("mlp.experts.{expert}.down_proj.weight")), i % per_expert)
            }
            "mlp.shared_experts.linear_fc1.weight" => {
                let (tensor, g) = gate_up("mlp.shared_experts", r.t, moe.shared * moe.ffn / r.tp, h, i);
                (hf(&tensor), g)
            }
            "mlp.shared_experts.linear_fc2.weight" => {
                let full = moe.shared * moe.ffn;
                (hf("mlp.shared_experts.down_proj.weight"), col_block(r.t, full / r.tp, full, i))
            }
            other => panic!("unknown Megatron parameter {other}"),
        })
    })
}

/// vLLM rank `t` of `tp`; with expert parallelism, `experts` lists its experts in local order.
fn vllm_locate(a: &Arch, t: u64, tp: u64, experts: Option<Vec<u64>>) -> Box<Locate> {
    let a = a.clone();
    Box::new(move |name: &str, i: u64| {
        let h = a.hidden;
        let m = mla_of(&a);
        let moe = a.moe.unwrap();
        let (layer, tail) = layer_of(name, "model.layers.");
        let hf = |s: &str| format!("model.layers.{}.{s}", layer.unwrap());
        let heads = m.heads / tp;
        let (row, col) = (i / h, i % h);
        Some(match tail.as_str() {
            "model.embed_tokens.weight" | "lm_head.weight" => {
                let rows = a.vocab.next_multiple_of(64) / tp;
                let global = t * rows + row;
                return (global < a.vocab).then(|| (tail.clone(), global * h + col));
            }
            "model.norm.weight" => (tail.clone(), i),
            "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_a_layernorm.weight"
            | "self_attn.kv_a_layernorm.weight"
            | "self_attn.kv_a_proj_with_mqa.weight"
            | "mlp.gate.weight"
            | "mlp.gate.e_score_correction_bias" => (hf(&tail), i),
            "self_attn.fused_qkv_a_proj.weight" => {
                let q_lora = m.q_lora_rank.unwrap();
                if row < q_lora {
                    (hf("self_attn.q_a_proj.weight"), i)
                } else {
                    (hf("self_attn.kv_a_proj_with_mqa.weight"), i - q_lora * h)
                }
            }
            "self_attn.q_b_proj.weight" => {
                let rows = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
                (hf(&tail), row_block(t, rows, m.q_lora_rank.unwrap(), i))
            }
            "self_attn.q_proj.weight" => {
                let rows = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
                (hf(&tail), row_block(t, rows, h, i))
            }
            "self_attn.kv_b_proj.weight" => {
                let rows = heads * (m.qk_nope_head_dim + m.v_head_dim);
                (hf(&tail), row_block(t, rows, m.kv_lora_rank, i))
            }
            "self_attn.o_proj.weight" => {
                (hf(&tail), col_block(t, heads * m.v_head_dim, m.heads * m.v_head_dim, i))
            }
            "mlp.gate_up_proj.weight" => {
                let (tensor, g) = gate_up("mlp", t, a.ffn / tp, h, i);
                (hf(&tensor), g)
            }
            "mlp.down_proj.weight" => (hf(&tail), col_block(t, a.ffn / tp, a.ffn, i)),
            "mlp.shared_experts.gate_up_proj.weight" => {
                let (tensor, g) = gate_up("mlp.shared_experts", t, moe.shared * moe.ffn / tp, h, i);
                (hf(&tensor), g)
            }
            "mlp.shared_experts.down_proj.weight" => {
                let full = moe.shared * moe.ffn;
                (hf(&tail), col_block(t, full / tp, full, i))
            }
            "mlp.experts.routed_experts.w13_weight" => {
                // Whole experts with expert parallelism, else every expert's TP rows.
                let (f, part) = if experts.is_some() { (moe.ffn, 0) } else { (moe.ffn / tp, t) };
                let per_expert = 2 * f * h;
                let j = i / per_expert;
                let expert = experts.as_ref().map_or(j, |list| list[j as usize]);
                let (tensor, g) = gate_up(&format!("mlp.experts.{expert}"), part, f, h, i % per_expert);
                (hf(&tensor), g)
            }
            "mlp.experts.routed_experts.w2_weight" => {
                let (f, part) = if experts.is_some() { (moe.ffn, 0) } else { (moe.ffn / tp, t) };
                let per_expert = h * f;
                let j = i / per_expert;
                let expert = experts.as_ref().map_or(j, |list| list[j as usize]);
                let tensor = hf(&format!("mlp.experts.{expert}.down_proj.weight"));
                (tensor, col_block(part, f, moe.ffn, i % per_expert))
            }
            other => panic!("unknown vLLM parameter {other}"),
        })
    })
}

/// The experts EP rank `r` of `ep` holds, found by asking of each expert which rank owns it.
fn owned_experts(placement: ExpertPlacement, experts: u64, r: u64, ep: u64) -> Vec<u64> {
    let owner = |e: u64| match placement {
        ExpertPlacement::RoundRobin => e % ep,
        ExpertPlacement::Linear => {
            // The first `experts % ep` ranks hold one more.
            let (small, big) = (experts / ep, experts / ep + 1);
            let big_ranks = experts % ep;
            if e < big_ranks * big {
                e / big
            } else {
                big_ranks + (e - big_ranks * big) / small
            }
        }
    };
    (0..experts).filter(|&e| owner(e) == r).collect()
}

fn check_layouts(spec: &ArchSpec) {
    let w = Workload::generate(spec).unwrap();
    let pubs = &spec.publishers;
    let position = |list: &[Endpoint], e: Endpoint| list.iter().position(|x| *x == e).unwrap() as u64;
    let stages = pubs.stage_layers(&spec.model).unwrap();
    let stage_size = pubs.endpoints.len() as u64 / pubs.pp;
    check_elements(
        &w,
        &|p: &Placed| {
            let i = position(&pubs.endpoints, p.endpoint);
            let (stage, j) = (i / stage_size, i % stage_size);
            let rank = MegatronRank {
                t: j % pubs.tp,
                tp: pubs.tp,
                e: j % pubs.ep,
                ep: pubs.ep,
                first_layer: stages[stage as usize].start,
            };
            megatron_locate(&spec.model, rank)
        },
        &w.offers,
    );
    let recv = &spec.receivers;
    let n = recv.endpoints.len() as u64;
    check_elements(
        &w,
        &|p: &Placed| {
            let i = position(&recv.endpoints, p.endpoint);
            let experts = recv
                .expert_parallel
                .map(|placement| owned_experts(placement, spec.model.moe.unwrap().experts, i, n));
            vllm_locate(&spec.model, i % recv.tp, recv.tp, experts)
        },
        &w.needs,
    );
}

#[test]
fn megatron_and_vllm_layouts_hold_the_right_elements() {
    for (what, spec) in tiny_specs() {
        if matches!(spec.model.attention, Attention::Mla(_)) {
            println!("{what}");
            check_layouts(&spec);
        }
    }
}

/// What each side holds beyond single boxes: vLLM's fused `q_a_proj | kv_a_proj_with_mqa`, no
/// `lm_head` when tied, Megatron's replica of the embedding on a last stage, the router bias as an
/// FP32 buffer of its own, and which ranks hold only vocabulary padding.
#[test]
fn replicas_padding_and_buffers_are_where_the_frameworks_put_them() {
    let tied = spec(tiny_mla().with_tied_embeddings(), megatron(8, 4, 1, 2), vllm(8, 2, 2));
    let w = Workload::generate(&tied).unwrap();
    let embed = w.catalog.embed;
    let holders = |role: Role, name: &str| -> Vec<(Endpoint, Region)> {
        let list = if role == Role::Publisher { &w.offers } else { &w.needs };
        list.iter()
            .filter(|p| w.buffers[p.buffer as usize].name == name && p.tensor == embed)
            .map(|p| (p.endpoint, p.region.clone()))
            .collect()
    };
    // Megatron TP4 pads 300 rows to 512: 128, 128, 44 and none; on the first stage as the embedding,
    // on the last as the output layer's copy of it.
    let rows = |lo: u64, n: u64| Region { offset: vec![lo, 0], extent: vec![n, 16] };
    let ep = |p: u32| Endpoint { process: p, device: 0 };
    let shards = |first: u32| {
        vec![(ep(first), rows(0, 128)), (ep(first + 1), rows(128, 128)), (ep(first + 2), rows(256, 44))]
    };
    assert_eq!(holders(Role::Publisher, "embedding.word_embeddings.weight"), shards(0));
    assert_eq!(holders(Role::Publisher, "output_layer.weight"), shards(4));
    // vLLM TP2 pads 300 rows to 320: 160 and 140.
    assert_eq!(
        holders(Role::Receiver, "model.embed_tokens.weight"),
        vec![(ep(8), rows(0, 160)), (ep(9), rows(160, 140))]
    );
    assert!(!w.buffers.iter().any(|b| b.name == "lm_head.weight"));
    let shard = |name: &str, endpoint: Endpoint| {
        w.buffers.iter().find(|b| b.name == name && b.endpoint == endpoint).map(|b| b.bytes)
    };
    assert_eq!(shard("output_layer.weight", ep(7)), Some(128 * 16 * 2), "padding only, still allocated");
    assert_eq!(shard("embedding.word_embeddings.weight", ep(4)), None, "not on the last stage");
    // Packed publishers: the bias buffers stay allocations of their own, FP32.
    let mut packed = spec(tiny_mla(), megatron(2, 2, 1, 1), vllm(2, 2, 2));
    packed.publisher_layout = Packing::Packed;
    let w = Workload::generate(&packed).unwrap();
    let biases: Vec<_> = w.buffers.iter().filter(|b| b.name.ends_with("mlp.router.expert_bias")).collect();
    assert_eq!(biases.len(), 2 * 3, "three MoE layers on each of two ranks");
    assert!(biases.iter().all(|b| b.bytes == 8 * 4 && b.role == Role::Publisher));
    assert_eq!(w.buffers.iter().filter(|b| b.role == Role::Publisher).count(), 2 + 2 * 3);
    let fused: Vec<&Placed> = w
        .needs
        .iter()
        .filter(|n| w.buffers[n.buffer as usize].name.ends_with("0.self_attn.fused_qkv_a_proj.weight"))
        .collect();
    assert_eq!(fused.len(), 4, "q_a_proj then kv_a_proj_with_mqa on each of two ranks");
    assert_eq!(fused[1].offset, 12 * 16 * 2);
}

#[test]
fn bad_specs_are_rejected_with_a_reason() {
    let mut cases: Vec<(ArchSpec, &str)> = Vec::new();
    let base = spec(tiny_mla(), megatron(4, 2, 2, 1), vllm(4, 2, 2));
    let mut push = |edit: &dyn Fn(&mut ArchSpec), why: &'static str| {
        let mut s = base.clone();
        edit(&mut s);
        cases.push((s, why));
    };
    push(&|s| mla_mut(&mut s.model).kv_lora_rank = 0, "kv_lora_rank is 0");
    push(&|s| mla_mut(&mut s.model).q_lora_rank = Some(0), "q_lora_rank is 0");
    push(&|s| s.model.moe.as_mut().unwrap().dense_layers = 5, "5 leading dense layers of 4 layers");
    push(&|s| s.model.moe.as_mut().unwrap().experts = 0, "MoE with 0 experts");
    push(&|s| s.publishers.tp = 3, "do not divide into tp 3");
    push(&|s| s.publishers = megatron(8, 8, 1, 1), "4 heads do not split over tp 8");
    push(&|s| s.publishers.pp = 3, "4 ranks do not divide into 3 pipeline stages");
    push(&|s| s.publishers = megatron(6, 1, 1, 3), "4 layers do not split over 3 pipeline stages");
    push(&|s| s.publishers.first_stage_layers = Some(1), "without pipeline stages");
    push(&|s| s.publishers = megatron(3, 1, 3, 1), "8 experts do not split over ep 3");
    push(
        &|s| {
            s.model.moe = Some(Experts { experts: 8, ffn: 7, shared: 1, dense_layers: 1, router_bias: true })
        },
        "shared expert intermediate 7 does not split over tp 2",
    );
    push(&|s| s.receivers = vllm(4, 8, 8), "4 heads do not split over tp 8");
    push(&|s| s.receivers = vllm(4, 3, 2), "3 ranks in groups of tp 2");
    push(&|s| s.model.ffn = 21, "intermediate 21 does not split over tp 2");
    push(&|s| s.receivers = vllm(4, 16, 1).with_expert_parallel(), "8 experts for 16 expert-parallel ranks");
    push(
        &|s| {
            // vLLM asserts that the padded vocabulary divides (`divide` in VocabParallelEmbedding).
            s.model = tiny_mla_tp3().with_vocab(1000);
            s.publishers = megatron(3, 3, 1, 1);
            s.receivers = vllm(3, 3, 3);
        },
        "padded vocabulary 1024 does not split over tp 3",
    );
    for (spec, why) in cases {
        let err = Workload::generate(&spec).err().unwrap_or_else(|| panic!("accepted: {why}"));
        assert_eq!(err.status, Status::InvalidArgument, "{why}");
        assert!(err.message.contains(why), "expected '{why}' in '{}'", err.message);
    }
}

// ---- With the planner: refits planned and copied on host memory install every receiver element.

/// The value element `global` of `tensor` has, as its `elem_size` low bytes.
fn expected(tensor: u32, global: u64, elem_size: usize) -> Vec<u8> {
    element_value(tensor, global).to_le_bytes()[..elem_size].to_vec()
}

/// The workload in host memory: publishers filled, receivers poisoned.
fn host_memory(w: &Workload<ArchSpec>) -> Vec<Vec<u8>> {
    let mut memory: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![0xa5; b.bytes as usize]).collect();
    w.fill_offers(&mut memory.iter_mut().map(|m| m.as_mut_slice()).collect::<Vec<_>>());
    memory
}

/// Plans the refit of `w` over `memory` and copies every run of the plan.
fn plan_and_copy(w: &Workload<ArchSpec>, memory: &mut [Vec<u8>], options: &PlanOptions) -> refit::plan::Plan {
    let bases: Vec<u64> = memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
    let plan = refit::plan::build(&w.tables(&bases).unwrap(), options).unwrap();
    for route in plan.routes() {
        for segment in &route.segments {
            segment.for_each_run(|src, dst, len| {
                // SAFETY: the plan's runs lie inside `memory` (the planner checked every box against
                // its buffer's extent through the tables), and publishers' and receivers' buffers are
                // distinct allocations.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) }
            });
        }
    }
    plan
}

/// Every needed element compared with the value of the tensor element it stands for; returns the
/// receivers' memory.
fn refit_on_host(spec: &ArchSpec, options: &PlanOptions) -> Vec<Vec<u8>> {
    let w = Workload::generate(spec).unwrap();
    let mut memory = host_memory(&w);
    let plan = plan_and_copy(&w, &mut memory, options);
    for (receiver, bytes) in w.need_bytes() {
        assert_eq!(plan.receiver_stats(receiver).needed_bytes, bytes);
        let moved: u64 = plan
            .routes()
            .iter()
            .filter(|r| r.dst == receiver)
            .flat_map(|r| &r.segments)
            .map(|s| s.bytes().unwrap())
            .sum();
        assert_eq!(moved, bytes, "exactly the needed bytes move to {receiver:?}");
    }
    let mut installed = 0;
    for n in &w.needs {
        let buffer = &memory[n.buffer as usize];
        let es = w.catalog.tensors[n.tensor as usize].elem_size as usize;
        for_each_element(&w, n, |at, g| {
            assert_eq!(
                buffer[at..at + es],
                expected(n.tensor, g, es),
                "{} byte {at} ({} element {g})",
                w.buffers[n.buffer as usize].name,
                w.catalog.tensors[n.tensor as usize].name
            );
            installed += 1;
        });
    }
    let views: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
    assert_eq!(w.check_needs(&views), Ok(installed));
    memory.into_iter().zip(&w.buffers).filter(|(_, b)| b.role == Role::Receiver).map(|(m, _)| m).collect()
}

#[test]
fn refits_on_host_install_every_element() {
    let mut specs = tiny_specs();
    specs.push(("tied GQA, PP2 x TP2 -> TP2", spec(tiny_tied_gqa(), megatron(4, 2, 1, 2), vllm(4, 2, 2))));
    specs.push(("tied GQA, TP1 -> TP4", spec(tiny_tied_gqa(), megatron(1, 1, 1, 1), vllm(1, 4, 4))));
    for (_, spec) in specs.iter_mut().step_by(3) {
        spec.publisher_layout = Packing::Packed;
        spec.receiver_layout = Packing::Packed;
        spec.digests = true;
    }
    for (what, spec) in &specs {
        let reference = refit_on_host(spec, &PlanOptions::default());
        for policy in [OwnerPolicy::First, OwnerPolicy::Balanced] {
            for coalesce in [true, false] {
                // A/B: every arm installs the same receiver bytes, padding included.
                assert!(
                    refit_on_host(spec, &PlanOptions { policy, coalesce }) == reference,
                    "{what}: {policy:?} {coalesce} installed other bytes"
                );
            }
        }
    }
}

/// The check reads the bytes: a publisher byte changed after the fill reaches the receiver, and the
/// check names that element.
#[test]
fn a_wrong_source_byte_is_named_by_the_check() {
    // EP4 publishers: each expert on one rank only, so the planner has no other replica to read.
    let spec = spec(tiny_mla(), megatron(4, 1, 4, 1), vllm(4, 2, 2));
    let w = Workload::generate(&spec).unwrap();
    let mut memory = host_memory(&w);
    let victim = w
        .offers
        .iter()
        .find(|o| {
            w.catalog.tensors[o.tensor as usize].name == "model.layers.2.mlp.experts.5.down_proj.weight"
        })
        .unwrap();
    memory[victim.buffer as usize][victim.offset as usize + 7] ^= 0x10;
    plan_and_copy(&w, &mut memory, &PlanOptions::default());
    let views: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
    let err = w.check_needs(&views).unwrap_err();
    assert!(
        err.contains("model.layers.2.mlp.experts.5.down_proj.weight") && err.contains("element 3 "),
        "{err}"
    );
}

// ---- Reduced real shapes: plans at DeepSeek-V3's and Kimi-K2's hidden sizes, exact bytes.

/// What one vLLM TP receiver without expert parallelism needs, from the model's dimensions alone.
fn tp_receiver_bytes(a: &Arch, tp: u64) -> u64 {
    let m = mla_of(a);
    let moe = a.moe.unwrap();
    let h = a.hidden;
    let q_lora = m.q_lora_rank.unwrap();
    let replicated = (q_lora + m.kv_lora_rank + m.qk_rope_head_dim) * h + q_lora + m.kv_lora_rank + 2 * h;
    let split = m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * q_lora
        + m.heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        + h * m.heads * m.v_head_dim;
    let attention = replicated + split / tp;
    let dense = 3 * a.ffn * h / tp;
    let moe_layer = moe.experts * h + 3 * (moe.experts + moe.shared) * moe.ffn * h / tp;
    let bf16 = 2
        * (a.layers * attention
            + moe.dense_layers * dense
            + (a.layers - moe.dense_layers) * moe_layer
            + 2 * a.vocab * h / tp
            + h);
    let bias = 4 * (a.layers - moe.dense_layers) * moe.experts;
    bf16 + bias
}

#[test]
fn plans_move_exactly_the_needed_bytes_at_real_hidden_sizes() {
    let v3 = Arch::deepseek_v3().with_layers(6).with_experts(16);
    let kimi = Arch::kimi_k2().with_layers(4).with_experts(32);
    let cases = [
        ArchSpec::deepseek_v3_tp2_ep8_to_tp8(Packing::Packed).with_model(v3.clone()),
        spec(v3.clone(), megatron(16, 2, 8, 2), vllm(16, 8, 8)),
        spec(kimi.clone(), megatron(8, 8, 4, 1), vllm(8, 8, 8)),
        spec(kimi, megatron(32, 8, 8, 4), vllm(32, 8, 8).with_expert_parallel()),
    ];
    for (k, spec) in cases.iter().enumerate() {
        let w = Workload::generate(spec).unwrap();
        let tables = w.tables(&w.fake_bases()).unwrap();
        let plan = refit::plan::build(&tables, &PlanOptions::default()).unwrap();
        let needs = w.need_bytes();
        assert_eq!(needs.len(), spec.receivers.endpoints.len());
        for (receiver, bytes) in needs {
            if spec.receivers.expert_parallel.is_none() {
                assert_eq!(bytes, tp_receiver_bytes(&spec.model, spec.receivers.tp), "case {k}");
            }
            let stats = plan.receiver_stats(receiver);
            assert_eq!(stats.needed_bytes, bytes);
            assert_eq!(stats.bytes_remote, bytes, "case {k}: exactly the needed bytes move");
            assert!(stats.ranges_coalesced <= stats.segments_deduped);
        }
    }
}

#[test]
fn named_specs_generate() {
    // The full-size specs' tables (no plan: that is the planner benchmark's job).
    for spec in [
        ArchSpec::deepseek_v3_tp2_ep8_to_tp8(Packing::Separate)
            .with_model(Arch::deepseek_v3().with_layers(4)),
        ArchSpec::kimi_k2_pp4_to_tp8_ep(Packing::Packed),
    ] {
        let w = Workload::generate(&spec).unwrap();
        let total: u64 = w.need_bytes().values().sum();
        assert!(total > 0);
    }
    let kimi = ArchSpec::kimi_k2_pp4_to_tp8_ep(Packing::Separate);
    let stages = kimi.publishers.stage_layers(&kimi.model).unwrap();
    assert_eq!(stages, vec![0..16, 16..31, 31..46, 46..61]);
}
