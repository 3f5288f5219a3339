//! The refit workload generators: parameter counts, TP shares, tiling, disjoint destinations, buffer
//! bounds, rebasing, bad specs, and an element-level check of both framework layouts against
//! independent memory-to-tensor formulas.

mod common;

use common::{check_elements, for_each_element, layer_of, Locate};
use refit::plan::{Endpoint, Region};
use refit::Status;
use refit_workloads::{Megatron, Model, Moe, Packing, Placed, Role, Spec, Vllm, Workload};
use std::collections::{BTreeMap, HashMap};

/// Parameter count straight from a model's config (not from the generator's tensor list).
fn parameter_count(m: &Model) -> u64 {
    let (h, q, kv) = (m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim);
    let attention = h * q + 2 * h * kv + q * h + if m.qk_norm { 2 * m.head_dim } else { 0 };
    let mlp = match m.moe {
        Some(moe) => moe.experts * h + moe.experts * 3 * moe.ffn * h,
        None => 3 * m.ffn * h,
    };
    let per_layer = attention + mlp + 2 * h;
    2 * m.vocab * h + m.layers * per_layer + h
}

/// Elements every TP rank holds whole: norms, q/k norms, the router.
fn replicated_elements(m: &Model) -> u64 {
    let per_layer =
        2 * m.hidden + if m.qk_norm { 2 * m.head_dim } else { 0 } + m.moe.map_or(0, |e| e.experts * m.hidden);
    m.layers * per_layer + m.hidden
}

fn volume(r: &Region) -> u64 {
    r.extent.iter().product()
}

fn boxes_overlap(a: &Region, b: &Region) -> bool {
    a.offset
        .iter()
        .zip(&a.extent)
        .zip(b.offset.iter().zip(&b.extent))
        .all(|((ao, ae), (bo, be))| ao < &(bo + be) && bo < &(ao + ae))
}

fn qwen_small(layers: u64) -> Spec {
    Spec::qwen3_ep8_to_tp2(Packing::Separate).with_model(Model::qwen3_30b_a3b().with_layers(layers))
}

#[test]
fn published_parameter_counts() {
    let qwen = Model::qwen3_30b_a3b();
    let llama = Model::llama3_70b();
    assert_eq!(parameter_count(&qwen), 30_532_122_624);
    assert_eq!(parameter_count(&llama), 70_553_706_496);
    for spec in [Spec::qwen3_ep8_to_tp2(Packing::Separate), Spec::llama3_70b_tp8_to_tp2(Packing::Separate, 1)]
    {
        let w = Workload::generate(&spec).unwrap();
        let generated: u64 = (0..w.catalog.tensors.len() as u32).map(|t| w.catalog.elements(t)).sum();
        assert_eq!(generated, parameter_count(&spec.model), "{}", spec.model.name);
        assert!(w.catalog.tensors.iter().all(|t| t.elem_size == 2));
    }
    let qwen = Workload::generate(&Spec::qwen3_ep8_to_tp2(Packing::Separate)).unwrap();
    let names: HashMap<&str, &Vec<u64>> =
        qwen.catalog.tensors.iter().map(|t| (t.name.as_str(), &t.shape)).collect();
    assert_eq!(names.len(), qwen.catalog.tensors.len(), "tensor names are unique");
    assert_eq!(names["model.layers.47.mlp.experts.127.gate_proj.weight"], &vec![768, 2048]);
    assert_eq!(names["model.layers.0.mlp.experts.0.down_proj.weight"], &vec![2048, 768]);
    assert_eq!(names["model.layers.3.self_attn.q_proj.weight"], &vec![4096, 2048]);
    assert_eq!(names["model.layers.3.self_attn.k_proj.weight"], &vec![512, 2048]);
    assert_eq!(names["model.layers.3.self_attn.o_proj.weight"], &vec![2048, 4096]);
    assert_eq!(names["model.layers.3.self_attn.q_norm.weight"], &vec![128]);
    assert_eq!(names["model.layers.3.mlp.gate.weight"], &vec![128, 2048]);
    assert_eq!(names["lm_head.weight"], &vec![151_936, 2048]);
}

fn all_specs() -> Vec<Spec> {
    let mut specs = Vec::new();
    for layout in [Packing::Separate, Packing::Packed] {
        specs.push(Spec::qwen3_ep8_to_tp2(layout));
        specs.push(Spec::qwen3_ep8_to_tp2(layout).with_expert_weights());
        specs.push(Spec::llama3_70b_tp8_to_tp2(layout, 2).with_model(Model::llama3_70b().with_layers(4)));
        let mut colocated = Spec::qwen3_colocated_ep2_tp2(layout);
        colocated.receiver_layout = layout;
        specs.push(colocated);
    }
    specs
}

#[test]
fn each_receiver_needs_exactly_its_tp_share() {
    for spec in all_specs() {
        let w = Workload::generate(&spec).unwrap();
        let m = &spec.model;
        let tp = spec.receivers.endpoints.len() as u64;
        let replicated = replicated_elements(m);
        let split = parameter_count(m) - replicated;
        let expected = (split / tp + replicated) * m.elem_size as u64;
        let by_receiver = w.need_bytes();
        assert_eq!(by_receiver.len() as u64, tp);
        for (receiver, bytes) in by_receiver {
            assert_eq!(bytes, expected, "{} receiver {receiver:?}", m.name);
        }
    }
}

/// CEILINGS.md's colocated baseline counts 18,626 needed slices and 28.42 GiB per receiver: the split
/// tensors, without the replicated norms and router (those are 241 slices and 24.4 MiB more).
#[test]
fn qwen_receiver_needs_match_the_measured_baseline() {
    let w = Workload::generate(&Spec::qwen3_colocated_ep2_tp2(Packing::Separate)).unwrap();
    for receiver in &w.spec.receivers.endpoints {
        let split: Vec<&Placed> = w
            .needs
            .iter()
            .filter(|n| n.endpoint == *receiver && volume(&n.region) != w.catalog.elements(n.tensor))
            .collect();
        assert_eq!(split.len(), 18_626);
        let bytes: u64 = split.iter().map(|n| w.bytes(n)).sum();
        assert_eq!(bytes, 30_519_328_768);
        let all: u64 = w.needs.iter().filter(|n| n.endpoint == *receiver).map(|n| w.bytes(n)).sum();
        assert_eq!(all - bytes, 25_587_712);
        assert_eq!(format!("{:.2}", bytes as f64 / (1u64 << 30) as f64), "28.42");
    }
}

/// Per tensor: the distinct offered boxes tile it exactly, and the number of replicas of each box.
fn offers_tile(w: &Workload) -> BTreeMap<u32, BTreeMap<Region, usize>> {
    let mut boxes: BTreeMap<u32, BTreeMap<Region, usize>> = BTreeMap::new();
    for o in &w.offers {
        *boxes.entry(o.tensor).or_default().entry(o.region.clone()).or_default() += 1;
    }
    assert_eq!(boxes.len(), w.catalog.tensors.len(), "every tensor is offered");
    for (&t, regions) in &boxes {
        let shape = &w.catalog.tensors[t as usize].shape;
        let distinct: Vec<&Region> = regions.keys().collect();
        for r in &distinct {
            assert!(r.offset.iter().zip(&r.extent).zip(shape).all(|((o, e), s)| o + e <= *s && *e > 0));
        }
        assert_eq!(distinct.iter().map(|r| volume(r)).sum::<u64>(), w.catalog.elements(t));
        for (i, a) in distinct.iter().enumerate() {
            for b in &distinct[i + 1..] {
                assert!(!boxes_overlap(a, b), "tensor {t}: {a:?} overlaps {b:?}");
            }
        }
    }
    boxes
}

#[test]
fn offers_tile_every_tensor_with_the_expected_replicas() {
    for spec in all_specs() {
        let w = Workload::generate(&spec).unwrap();
        let boxes = offers_tile(&w);
        let dp = (spec.publishers.endpoints.len() as u64 / spec.publishers.tp) as usize;
        let ranks = spec.publishers.endpoints.len();
        for (t, regions) in boxes {
            let name = &w.catalog.tensors[t as usize].name;
            for copies in regions.values() {
                let expected = if name.contains(".experts.") {
                    ranks / spec.publishers.ep as usize
                } else if regions.len() == 1 {
                    ranks // held whole by every rank
                } else {
                    dp
                };
                assert_eq!(*copies, expected, "{name}");
            }
        }
    }
}

#[test]
fn qwen_ep8_offer_counts() {
    let w = Workload::generate(&Spec::qwen3_ep8_to_tp2(Packing::Separate)).unwrap();
    // Per rank and layer: 2 norms, q/k/v of 4 groups, 2 q/k norms, o, router, 16 experts x 3; plus
    // embed, final norm, lm_head.
    let per_rank = 48 * (2 + 12 + 2 + 1 + 1 + 16 * 3) + 3;
    assert_eq!(w.offers.len(), 8 * per_rank);
    let per_receiver = 48 * (2 + 3 + 2 + 1 + 1 + 128 * 3) + 3;
    assert_eq!(w.needs.len(), 2 * per_receiver);
}

/// The byte interval of a placed box inside its buffer (every generated box is row-major contiguous).
fn interval(w: &Workload, p: &Placed) -> (u64, u64) {
    (p.offset, p.offset + w.bytes(p))
}

#[test]
fn boxes_lie_inside_their_buffers_without_overlapping() {
    for spec in all_specs() {
        let w = Workload::generate(&spec).unwrap();
        for (list, role) in [(&w.offers, Role::Publisher), (&w.needs, Role::Receiver)] {
            let mut by_buffer: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
            for p in list.iter() {
                let buffer = &w.buffers[p.buffer as usize];
                assert_eq!(buffer.role, role);
                assert_eq!(buffer.endpoint, p.endpoint);
                by_buffer.entry(p.buffer).or_default().push(interval(&w, p));
            }
            for (b, mut spans) in by_buffer {
                spans.sort();
                let buffer = &w.buffers[b as usize];
                assert!(spans.last().unwrap().1 <= buffer.bytes, "{} too small", buffer.name);
                for pair in spans.windows(2) {
                    assert!(pair[0].1 <= pair[1].0, "{}: {:?} overlaps {:?}", buffer.name, pair[0], pair[1]);
                }
                // Nothing is allocated that no box uses, beyond vocabulary padding and pack alignment.
                let used: u64 = spans.iter().map(|(a, b)| b - a).sum();
                let slack = buffer.bytes - used;
                assert!(
                    slack < 4096
                        || buffer.name.contains("emb")
                        || buffer.name.contains("output")
                        || buffer.name.contains("lm_head")
                        || spec.publisher_layout == Packing::Packed,
                    "{} slack {slack}",
                    buffer.name
                );
            }
        }
    }
}

#[test]
fn each_receivers_needs_are_disjoint_boxes_of_each_tensor() {
    let w = Workload::generate(
        &Spec::qwen3_ep8_to_tp2(Packing::Separate).with_model(Model::qwen3_30b_a3b().with_layers(2)),
    )
    .unwrap();
    let mut by_key: BTreeMap<(Endpoint, u32), Vec<&Region>> = BTreeMap::new();
    for n in &w.needs {
        by_key.entry((n.endpoint, n.tensor)).or_default().push(&n.region);
    }
    for ((receiver, t), regions) in by_key {
        for (i, a) in regions.iter().enumerate() {
            for b in &regions[i + 1..] {
                assert!(!boxes_overlap(a, b), "{receiver:?} tensor {t}");
            }
        }
    }
}

#[test]
fn packed_publishers_use_one_buffer_per_rank_in_reverse_parameter_order() {
    let w = Workload::generate(&qwen_small(2).clone()).unwrap();
    let mut packed_spec = qwen_small(2);
    packed_spec.publisher_layout = Packing::Packed;
    let packed = Workload::generate(&packed_spec).unwrap();
    let publisher_buffers: Vec<_> = packed.buffers.iter().filter(|b| b.role == Role::Publisher).collect();
    assert_eq!(publisher_buffers.len(), 8);
    let separate_bytes: u64 = w
        .buffers
        .iter()
        .filter(|b| b.role == Role::Publisher && b.endpoint.process == 0)
        .map(|b| b.bytes)
        .sum();
    assert_eq!(publisher_buffers[0].bytes, separate_bytes, "BF16 parameters here are all 256-byte multiples");
    // The output layer (last parameter) sits at the start of the packed buffer.
    let lm_head = packed.catalog.lm_head;
    let first = packed.offers.iter().find(|o| o.tensor == lm_head && o.endpoint.process == 0).unwrap();
    assert_eq!(first.offset, 0);
    let embed =
        packed.offers.iter().find(|o| o.tensor == packed.catalog.embed && o.endpoint.process == 0).unwrap();
    assert_eq!(embed.offset + packed.bytes(embed), separate_bytes);
}

#[test]
fn tables_rebase_every_address_and_group_by_rank() {
    let spec = qwen_small(1);
    let w = Workload::generate(&spec).unwrap();
    let bases = w.fake_bases();
    // Fake bases: ascending, never adjacent, 4 KiB aligned.
    for (i, pair) in bases.windows(2).enumerate() {
        assert!(pair[0] + w.buffers[i].bytes < pair[1]);
    }
    assert!(bases.iter().all(|b| b % 4096 == 0));
    let tables = w.tables(&bases).unwrap();
    assert_eq!(tables.len(), 10, "8 publisher ranks, 2 receiver ranks");
    let offers: usize = tables.iter().map(|t| t.offers.len()).sum();
    let needs: usize = tables.iter().map(|t| t.needs.len()).sum();
    assert_eq!((offers, needs), (w.offers.len(), w.needs.len()));
    for (rank, table) in tables.iter().enumerate() {
        for o in &table.offers {
            assert_eq!(o.owner.process as usize, rank);
            assert!(o.strides.is_none() && o.digest.is_none());
        }
        for n in &table.needs {
            assert_eq!(n.receiver.process as usize, rank);
            let spec = &table.tensors[n.tensor as usize];
            assert_eq!(n.strides.len(), spec.shape.len());
            assert_eq!(*n.strides.last().unwrap(), 1);
        }
    }
    // Every address is the buffer's base plus the generated offset.
    let expected: Vec<u64> = w
        .offers
        .iter()
        .filter(|o| o.endpoint.process == 3)
        .map(|o| bases[o.buffer as usize] + o.offset)
        .collect();
    let got: Vec<u64> = tables[3].offers.iter().map(|o| o.addr).collect();
    assert_eq!(got, expected);
    let expected: Vec<u64> = w
        .needs
        .iter()
        .filter(|n| n.endpoint.process == 9)
        .map(|n| bases[n.buffer as usize] + n.offset)
        .collect();
    let got: Vec<u64> = tables[9].needs.iter().map(|n| n.addr).collect();
    assert_eq!(got, expected);
    // Tensors are named consistently in every table.
    for table in &tables {
        for o in &table.offers {
            let name = &table.tensors[o.tensor as usize].name;
            assert!(w.catalog.tensors.iter().any(|t| &t.name == name));
        }
    }
}

#[test]
fn digests_agree_between_replicas_and_differ_between_boxes() {
    let mut spec = qwen_small(1);
    spec.digests = true;
    let w = Workload::generate(&spec).unwrap();
    let tables = w.tables(&w.fake_bases()).unwrap();
    let mut seen: HashMap<(String, Region), u64> = HashMap::new();
    let mut distinct = std::collections::HashSet::new();
    for table in &tables {
        for o in &table.offers {
            let key = (table.tensors[o.tensor as usize].name.clone(), o.region.clone());
            let d = o.digest.expect("digests requested");
            assert_eq!(*seen.entry(key).or_insert(d), d);
            distinct.insert(d);
        }
    }
    assert_eq!(distinct.len(), seen.len());
}

#[test]
fn bad_bases_are_rejected() {
    let w = Workload::generate(&qwen_small(1)).unwrap();
    let err = w.tables(&[0; 3]).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("3 buffer bases"), "{}", err.message);
    let mut bases = w.fake_bases();
    bases[5] = u64::MAX - 10;
    let err = w.tables(&bases).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("overflows"), "{}", err.message);
}

#[test]
fn bad_specs_are_rejected_with_a_reason() {
    let ranks = |n: u32| (0..n).map(|rank| Endpoint { process: rank, device: 0 }).collect::<Vec<_>>();
    let qwen = Spec::qwen3_ep8_to_tp2(Packing::Separate);
    let llama = Spec::llama3_70b_tp8_to_tp2(Packing::Separate, 1);
    let mut cases: Vec<(Spec, &str)> = Vec::new();
    let mut push = |base: &Spec, edit: &dyn Fn(&mut Spec), why: &'static str| {
        let mut s = base.clone();
        edit(&mut s);
        cases.push((s, why));
    };
    push(&qwen, &|s| s.model.layers = 0, "layers is 0");
    push(&qwen, &|s| s.model.hidden = 0, "hidden is 0");
    push(&qwen, &|s| s.model.vocab = 0, "vocab is 0");
    push(&qwen, &|s| s.model.kv_heads = 0, "kv_heads is 0");
    push(&qwen, &|s| s.model.kv_heads = 5, "do not group evenly");
    push(&qwen, &|s| s.model.moe = Some(Moe { experts: 0, ffn: 768 }), "MoE with 0 experts");
    push(&llama, &|s| s.model.ffn = 0, "dense intermediate size is 0");
    push(&qwen, &|s| s.publishers.endpoints.clear(), "0 ranks");
    push(&qwen, &|s| s.publishers.tp = 0, "tp 0");
    push(&qwen, &|s| s.publishers.endpoints = ranks(6), "6 ranks do not divide");
    push(&qwen, &|s| s.model.moe = Some(Moe { experts: 12, ffn: 768 }), "12 experts do not split over ep 8");
    push(
        &llama,
        &|s| s.publishers = Megatron { endpoints: ranks(16), tp: 16, ep: 1, grouped_experts: true },
        "8 query groups do not split over tp 16",
    );
    push(&llama, &|s| s.model.ffn = 28_676, "intermediate 28676 does not split over tp 8");
    push(&llama, &|s| s.publishers.ep = 2, "ep 2 on a dense model");
    push(&qwen, &|s| s.receivers = Vllm { endpoints: vec![] }, "no receivers");
    push(&qwen, &|s| s.receivers = Vllm { endpoints: ranks(3) }, "32 query heads do not split over tp 3");
    push(
        &qwen,
        &|s| {
            s.model.heads = 48;
            s.model.kv_heads = 6;
            s.receivers = Vllm { endpoints: ranks(4) }
        },
        "6 key/value heads neither split nor replicate",
    );
    push(
        &qwen,
        &|s| s.model.moe = Some(Moe { experts: 128, ffn: 767 }),
        "intermediate 767 does not split over tp 2",
    );
    for (spec, why) in cases {
        let err = Workload::generate(&spec).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{why}");
        assert!(err.message.contains(why), "expected '{why}' in '{}'", err.message);
    }
}

// ---- Element-level check on tiny models: every box of every buffer, read back through independent
// ---- memory-to-tensor formulas of each framework's layout.

fn tiny_moe() -> Model {
    Model {
        name: "tiny-moe".into(),
        layers: 2,
        hidden: 8,
        heads: 8,
        kv_heads: 4,
        head_dim: 2,
        qk_norm: true,
        ffn: 0,
        moe: Some(Moe { experts: 4, ffn: 8 }),
        vocab: 11,
        elem_size: 2,
        dtype: 2,
    }
}

fn tiny_dense() -> Model {
    Model { name: "tiny-dense".into(), qk_norm: false, moe: None, ffn: 12, ..tiny_moe() }
}

/// Megatron: memory -> tensor element, for TP rank `t` of `tp` and EP rank `e` of `ep`.
fn megatron_locate(m: &Model, t: u64, tp: u64, e: u64, ep: u64) -> Box<Locate> {
    let m = m.clone();
    Box::new(move |name: &str, i: u64| {
        let h = m.hidden;
        let (layer, tail) = layer_of(name, "decoder.layers.");
        let hf = |s: &str| format!("model.layers.{}.{s}", layer.unwrap());
        // Megatron pads the vocabulary to a multiple of 128 * tp (make_vocab_size_divisible_by).
        let vocab_chunk = m.vocab.next_multiple_of(128 * tp) / tp;
        // A TEGroupedMLP expert weight `linear_fc1.weight{j}` is expert j's slice of the grouped one.
        let (tail, i) = match tail.rsplit_once(".weight") {
            Some((base, j)) if base.starts_with("mlp.experts.linear_fc") && !j.is_empty() => {
                let j: u64 = j.parse().unwrap();
                let per_expert = if base.ends_with("fc1") { 2 } else { 1 } * m.moe.unwrap().ffn * h;
                (format!("{base}.weight"), i + j * per_expert)
            }
            _ => (tail, i),
        };
        let (row, col) = (i / h, i % h);
        Some(match tail.as_str() {
            "embedding.word_embeddings.weight" | "output_layer.weight" => {
                let global = t * vocab_chunk + row;
                let hf_name =
                    if tail.starts_with("emb") { "model.embed_tokens.weight" } else { "lm_head.weight" };
                return (global < m.vocab).then(|| (hf_name.to_string(), global * h + col));
            }
            "decoder.final_layernorm.weight" => ("model.norm.weight".into(), i),
            "self_attention.linear_qkv.layer_norm_weight" => (hf("input_layernorm.weight"), i),
            "pre_mlp_layernorm.weight" | "mlp.linear_fc1.layer_norm_weight" => {
                (hf("post_attention_layernorm.weight"), i)
            }
            "self_attention.q_layernorm.weight" => (hf("self_attn.q_norm.weight"), i),
            "self_attention.k_layernorm.weight" => (hf("self_attn.k_norm.weight"), i),
            "self_attention.linear_qkv.weight" => {
                let q_per_group = m.heads / m.kv_heads;
                let group_rows = (q_per_group + 2) * m.head_dim;
                let group = t * (m.kv_heads / tp) + row / group_rows;
                let within = row % group_rows;
                let head = within / m.head_dim;
                let d = within % m.head_dim;
                let (which, r) = if head < q_per_group {
                    ("q", (group * q_per_group + head) * m.head_dim + d)
                } else if head == q_per_group {
                    ("k", group * m.head_dim + d)
                } else {
                    ("v", group * m.head_dim + d)
                };
                (hf(&format!("self_attn.{which}_proj.weight")), r * h + col)
            }
            "self_attention.linear_proj.weight" => {
                let local = m.heads * m.head_dim / tp;
                let (r, c) = (i / local, i % local);
                (hf("self_attn.o_proj.weight"), r * m.heads * m.head_dim + t * local + c)
            }
            "mlp.router.weight" => (hf("mlp.gate.weight"), i),
            "mlp.experts.linear_fc1.weight" => {
                let f = m.moe.unwrap().ffn;
                let per_expert = 2 * f * h;
                let expert = e * (m.moe.unwrap().experts / ep) + i / per_expert;
                let r = (i % per_expert) / h;
                let which = if r < f { "gate" } else { "up" };
                (hf(&format!("mlp.experts.{expert}.{which}_proj.weight")), (r % f) * h + col)
            }
            "mlp.experts.linear_fc2.weight" => {
                let f = m.moe.unwrap().ffn;
                let expert = e * (m.moe.unwrap().experts / ep) + i / (h * f);
                (hf(&format!("mlp.experts.{expert}.down_proj.weight")), i % (h * f))
            }
            "mlp.linear_fc1.weight" => {
                let f = m.ffn / tp;
                let which = if row < f { "gate" } else { "up" };
                (hf(&format!("mlp.{which}_proj.weight")), (t * f + row % f) * h + col)
            }
            "mlp.linear_fc2.weight" => {
                let f = m.ffn / tp;
                (hf("mlp.down_proj.weight"), (i / f) * m.ffn + t * f + i % f)
            }
            other => panic!("unknown Megatron parameter {other}"),
        })
    })
}

/// vLLM: memory -> tensor element, for TP rank `t` of `tp`.
fn vllm_locate(m: &Model, t: u64, tp: u64) -> Box<Locate> {
    let m = m.clone();
    Box::new(move |name: &str, i: u64| {
        let h = m.hidden;
        let (layer, tail) = layer_of(name, "model.layers.");
        let hf = |s: &str| format!("model.layers.{}.{s}", layer.unwrap());
        let (row, col) = (i / h, i % h);
        Some(match tail.as_str() {
            "model.embed_tokens.weight" | "lm_head.weight" => {
                // vLLM pads the vocabulary to a multiple of 64, then splits it evenly.
                let global = t * (m.vocab.next_multiple_of(64) / tp) + row;
                return (global < m.vocab).then(|| (tail.clone(), global * h + col));
            }
            "model.norm.weight" => (tail.clone(), i),
            "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_norm.weight"
            | "self_attn.k_norm.weight"
            | "mlp.gate.weight" => (hf(&tail), i),
            "self_attn.qkv_proj.weight" => {
                let q_rows = m.heads * m.head_dim / tp;
                // kv heads per rank, and the first one: replicated when there are fewer heads than ranks.
                let kv_heads = (m.kv_heads / tp).max(1);
                let first = if m.kv_heads >= tp { t * kv_heads } else { t * m.kv_heads / tp };
                let kv_rows = kv_heads * m.head_dim;
                if row < q_rows {
                    (hf("self_attn.q_proj.weight"), (t * q_rows + row) * h + col)
                } else if row < q_rows + kv_rows {
                    (hf("self_attn.k_proj.weight"), (first * m.head_dim + row - q_rows) * h + col)
                } else {
                    (hf("self_attn.v_proj.weight"), (first * m.head_dim + row - q_rows - kv_rows) * h + col)
                }
            }
            "self_attn.o_proj.weight" => {
                let local = m.heads * m.head_dim / tp;
                (hf("self_attn.o_proj.weight"), (i / local) * m.heads * m.head_dim + t * local + i % local)
            }
            "mlp.experts.routed_experts.w13_weight" => {
                let f = m.moe.unwrap().ffn / tp;
                let expert = i / (2 * f * h);
                let r = (i % (2 * f * h)) / h;
                let which = if r < f { "gate" } else { "up" };
                (hf(&format!("mlp.experts.{expert}.{which}_proj.weight")), (t * f + r % f) * h + col)
            }
            "mlp.experts.routed_experts.w2_weight" => {
                let full = m.moe.unwrap().ffn;
                let f = full / tp;
                let expert = i / (h * f);
                let within = i % (h * f);
                (
                    hf(&format!("mlp.experts.{expert}.down_proj.weight")),
                    (within / f) * full + t * f + within % f,
                )
            }
            "mlp.gate_up_proj.weight" => {
                let f = m.ffn / tp;
                let which = if row < f { "gate" } else { "up" };
                (hf(&format!("mlp.{which}_proj.weight")), (t * f + row % f) * h + col)
            }
            "mlp.down_proj.weight" => {
                let f = m.ffn / tp;
                (hf("mlp.down_proj.weight"), (i / f) * m.ffn + t * f + i % f)
            }
            other => panic!("unknown vLLM parameter {other}"),
        })
    })
}

fn check_tiny(spec: &Spec) {
    let w = Workload::generate(spec).unwrap();
    let m = &spec.model;
    let publishers = &spec.publishers;
    let position = |list: &[Endpoint], e: Endpoint| list.iter().position(|x| *x == e).unwrap() as u64;
    check_elements(
        &w,
        &|p: &Placed| {
            let i = position(&publishers.endpoints, p.endpoint);
            megatron_locate(m, i % publishers.tp, publishers.tp, i % publishers.ep, publishers.ep)
        },
        &w.offers,
    );
    let tp = spec.receivers.endpoints.len() as u64;
    check_elements(
        &w,
        &|p: &Placed| vllm_locate(m, position(&spec.receivers.endpoints, p.endpoint), tp),
        &w.needs,
    );
}

fn tiny_spec(model: Model, publishers: u32, tp: u64, ep: u64, receivers: u32) -> Spec {
    Spec {
        model,
        publishers: Megatron {
            endpoints: (0..publishers).map(|rank| Endpoint { process: rank, device: 0 }).collect(),
            tp,
            ep,
            grouped_experts: true,
        },
        publisher_layout: Packing::Separate,
        receivers: Vllm {
            endpoints: (0..receivers)
                .map(|rank| Endpoint { process: publishers + rank, device: 0 })
                .collect(),
        },
        receiver_layout: Packing::Separate,
        digests: false,
    }
}

#[test]
fn megatron_and_vllm_layouts_hold_the_right_elements() {
    // MoE: EP over 4 ranks with TP2 dense weights; receivers TP2 (kv heads split) and TP8 (kv replicated).
    check_tiny(&tiny_spec(tiny_moe(), 4, 2, 4, 2));
    check_tiny(&tiny_spec(tiny_moe(), 4, 1, 2, 8));
    check_tiny(&tiny_spec(tiny_moe(), 2, 2, 1, 4));
    check_tiny(&tiny_spec(tiny_moe(), 4, 2, 4, 2).with_expert_weights());
    check_tiny(&tiny_spec(tiny_moe(), 4, 1, 2, 2).with_expert_weights());
    // Dense: TP2 x DP2 publishers; TP4 receivers (the vocabulary of 11 rows is padded to 64 and split
    // into 16 rows each: TP rank 0 holds all of it, the others only padding).
    check_tiny(&tiny_spec(tiny_dense(), 4, 2, 1, 4));
    check_tiny(&tiny_spec(tiny_dense(), 4, 4, 1, 2));
}

// ---- With the planner: plans build on reduced real shapes, and a refit executed on host memory
// ---- installs every receiver element byte-exact.

#[test]
fn plans_build_on_reduced_real_models() {
    let mut specs = vec![
        qwen_small(2),
        Spec::llama3_70b_tp8_to_tp2(Packing::Packed, 2).with_model(Model::llama3_70b().with_layers(2)),
        Spec::qwen3_colocated_ep2_tp2(Packing::Packed).with_model(Model::qwen3_30b_a3b().with_layers(2)),
    ];
    let mut packed = qwen_small(2);
    packed.publisher_layout = Packing::Packed;
    packed.digests = true;
    specs.push(packed);
    for spec in specs {
        let w = Workload::generate(&spec).unwrap();
        let tables = w.tables(&w.fake_bases()).unwrap();
        let plan = refit::plan::build(&tables, &refit::plan::PlanOptions::default()).unwrap();
        for (receiver, bytes) in w.need_bytes() {
            let stats = plan.receiver_stats(receiver);
            assert_eq!(stats.needed_bytes, bytes);
            let moved: u64 = plan
                .routes()
                .iter()
                .filter(|r| r.dst == receiver)
                .flat_map(|r| &r.segments)
                .map(|s| s.bytes().unwrap())
                .sum();
            assert_eq!(moved, bytes, "{} {receiver:?}", spec.model.name);
            assert!(stats.ranges_coalesced <= stats.segments_deduped);
            assert!(stats.bytes_all_replicas >= bytes);
        }
    }
}

/// Publishers' boxes filled with known values, receivers poisoned, the plan's runs copied on the host,
/// then every needed element compared with the value of the tensor element it stands for.
fn refit_on_host(spec: &Spec, options: &refit::plan::PlanOptions) -> Vec<Vec<u8>> {
    let w = Workload::generate(spec).unwrap();
    let mut memory: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![0xa5; b.bytes as usize]).collect();
    w.fill_offers(&mut memory.iter_mut().map(|m| m.as_mut_slice()).collect::<Vec<_>>());
    let bases: Vec<u64> = memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
    let plan = refit::plan::build(&w.tables(&bases).unwrap(), options).unwrap();
    for route in plan.routes() {
        for segment in &route.segments {
            segment.for_each_run(|src, dst, len| {
                // SAFETY: the plan's runs lie inside the buffers above (checked by the generator's
                // bounds test and the planner), and sources and destinations are disjoint buffers.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) }
            });
        }
    }
    // Checked here with this file's own element walk, and with the library's check.
    let mut installed = 0;
    for n in &w.needs {
        let buffer = &memory[n.buffer as usize];
        for_each_element(&w, n, |i, g| {
            let expected = (refit_workloads::element_value(n.tensor, g) as u16).to_le_bytes();
            assert_eq!(buffer[i..i + 2], expected, "{} element {i}", w.buffers[n.buffer as usize].name);
            installed += 1;
        });
    }
    assert_eq!(installed * 2, w.need_bytes().values().sum::<u64>());
    let views: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
    assert_eq!(w.check_needs(&views), Ok(installed));
    memory.into_iter().zip(&w.buffers).filter(|(_, b)| b.role == Role::Receiver).map(|(m, _)| m).collect()
}

/// Every buffer zeroed, then every needed element written from its expected value (BF16), with this
/// file's own element walk.
fn installed_from_expectation(w: &Workload) -> Vec<Vec<u8>> {
    let mut memory: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![0; b.bytes as usize]).collect();
    for n in &w.needs {
        let buffer = &mut memory[n.buffer as usize];
        for_each_element(w, n, |i, g| {
            buffer[i..i + 2]
                .copy_from_slice(&(refit_workloads::element_value(n.tensor, g) as u16).to_le_bytes())
        });
    }
    memory
}

#[test]
fn check_needs_names_the_first_wrong_element() {
    let spec = tiny_spec(tiny_moe(), 4, 2, 4, 2);
    let w = Workload::generate(&spec).unwrap();
    // Install the receivers' bytes directly from the expectation, then corrupt one element.
    let mut memory = installed_from_expectation(&w);
    let views: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
    let total: u64 = w.needs.iter().map(|n| volume(&n.region)).sum();
    assert_eq!(w.check_needs(&views), Ok(total));
    let victim = w
        .needs
        .iter()
        .find(|n| w.catalog.tensors[n.tensor as usize].name.ends_with("experts.3.up_proj.weight"))
        .unwrap();
    let at = (victim.offset + 6) as usize;
    memory[victim.buffer as usize][at] ^= 0x40;
    let views: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
    let err = w.check_needs(&views).unwrap_err();
    let buffer = &w.buffers[victim.buffer as usize].name;
    assert!(err.starts_with(&format!("{buffer} byte {at}: element ")), "{err}");
    assert!(err.contains("experts.3.up_proj.weight"), "{err}");
}

#[test]
fn boxes_larger_than_a_piece_of_work_fill_and_check_on_every_core() {
    // A vocabulary of 70,000 rows of 48 elements: the embedding and output boxes (3.4M elements,
    // TP-split in two) are cut into several pieces of work, each filled and checked on its own thread;
    // the walk in this file checks the result element by element.
    let model = Model { vocab: 70_000, hidden: 48, heads: 8, head_dim: 6, ..tiny_dense() };
    let spec = tiny_spec(model, 2, 2, 1, 1);
    refit_on_host(&spec, &refit::plan::PlanOptions::default());
    // A wrong element in the last piece of the largest box is the one named.
    let w = Workload::generate(&spec).unwrap();
    let mut memory = installed_from_expectation(&w);
    let largest = w.needs.iter().max_by_key(|n| volume(&n.region)).unwrap();
    assert!(volume(&largest.region) > 3 << 20, "the largest box spans several pieces");
    let at = (largest.offset + 2 * volume(&largest.region) - 2) as usize;
    memory[largest.buffer as usize][at] ^= 1;
    let views: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
    let err = w.check_needs(&views).unwrap_err();
    let buffer = &w.buffers[largest.buffer as usize].name;
    assert!(err.starts_with(&format!("{buffer} byte {at}: element ")), "{err}");
}

#[test]
fn refits_on_host_install_every_element() {
    use refit::plan::{OwnerPolicy, PlanOptions};
    let colocated = |model: Model, layout: Packing| {
        let mut s = Spec::qwen3_colocated_ep2_tp2(layout).with_model(model);
        s.receiver_layout = layout;
        s
    };
    let mut specs = vec![
        tiny_spec(tiny_moe(), 4, 2, 4, 2),
        tiny_spec(tiny_moe(), 4, 1, 2, 8),
        tiny_spec(tiny_dense(), 4, 2, 1, 4),
        colocated(tiny_moe(), Packing::Packed),
        colocated(tiny_moe(), Packing::Separate),
    ];
    for spec in specs.iter_mut().take(3) {
        spec.publisher_layout = Packing::Packed;
        spec.digests = true;
    }
    specs.push(tiny_spec(tiny_moe(), 4, 1, 2, 2).with_expert_weights());
    // Expert-data-parallel replicas too: 8 ranks, EP4.
    specs.push(tiny_spec(tiny_moe(), 8, 1, 4, 2));
    for spec in &specs {
        let reference = refit_on_host(spec, &PlanOptions::default());
        for policy in [OwnerPolicy::First, OwnerPolicy::Local, OwnerPolicy::Balanced] {
            for coalesce in [true, false] {
                // A/B: every arm installs the same receiver bytes, padding included.
                assert_eq!(
                    refit_on_host(spec, &PlanOptions { policy, coalesce }),
                    reference,
                    "{policy:?} {coalesce}"
                );
            }
        }
    }
}
