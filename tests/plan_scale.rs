//! The planner on a Qwen3-30B-A3B-shaped refit (Megatron EP8 publishers with data-parallel replicas of
//! the dense weights -> vLLM TP2 receivers with fused qkv / gate_up and stacked experts): exact bytes,
//! replica deduplication and coalescing reach the range-count targets. Counts only: build time is
//! printed for information and measured properly by the planner benchmark.

use refit::plan::{build, Endpoint, Need, Offer, OwnerPolicy, PlanOptions, Region, Table, TensorSpec};
use std::collections::HashMap;

const LAYERS: u64 = 48;
const HIDDEN: u64 = 2048;
const HEAD: u64 = 128;
const Q_HEADS: u64 = 32;
const KV_HEADS: u64 = 4;
const EXPERTS: u64 = 128;
const FFN: u64 = 768;
const VOCAB: u64 = 151_936;
const EP: u64 = 8;
const TP: u64 = 2;
const BF16: u64 = 2;

/// Hands out addresses like a caching allocator (sequential, 512-byte aligned) or packs every
/// parameter into one buffer.
struct Arena {
    next: u64,
    align: u64,
}

impl Arena {
    fn take(&mut self, bytes: u64) -> u64 {
        let at = self.next;
        self.next = (self.next + bytes).div_ceil(self.align) * self.align;
        at
    }
}

struct Builder {
    tables: Vec<Table>,
    index: Vec<HashMap<String, u32>>,
    arenas: Vec<Arena>,
}

impl Builder {
    fn tensor(&mut self, table: usize, name: &str, shape: &[u64]) -> u32 {
        let t = &mut self.tables[table];
        *self.index[table].entry(name.to_string()).or_insert_with(|| {
            t.tensors.push(TensorSpec {
                name: name.into(),
                dtype: 15,
                elem_size: BF16 as u32,
                shape: shape.to_vec(),
            });
            t.tensors.len() as u32 - 1
        })
    }

    /// Publisher `rank` offers the whole tensor from its own memory.
    fn offer(&mut self, rank: u64, name: &str, shape: &[u64]) {
        let bytes = shape.iter().product::<u64>() * BF16;
        let addr = self.arenas[rank as usize].take(bytes);
        let tensor = self.tensor(rank as usize, name, shape);
        let region = Region { offset: vec![0; shape.len()], extent: shape.to_vec() };
        let owner = Endpoint { rank: rank as u32, device: 0 };
        self.tables[rank as usize].offers.push(Offer {
            tensor,
            owner,
            addr,
            region,
            strides: None,
            digest: Some(7),
        });
    }

    /// Receiver `r` wants `extent` of tensor `name` at `offset`, written row-major at `addr` with
    /// destination row length `row` elements (a wider buffer for fused parameters): `dst = (addr, row)`.
    fn need(
        &mut self,
        r: u64,
        name: &str,
        shape: &[u64],
        offset: &[u64],
        extent: &[u64],
        (addr, row): (u64, u64),
    ) {
        let table = (EP + r) as usize;
        let tensor = self.tensor(table, name, shape);
        let strides = if shape.len() == 2 { vec![row, 1] } else { vec![1] };
        let region = Region { offset: offset.to_vec(), extent: extent.to_vec() };
        let receiver = Endpoint { rank: (EP + r) as u32, device: 0 };
        self.tables[table].needs.push(Need { tensor, receiver, addr, region, perm: None, strides });
    }
}

fn qwen3(contiguous_publishers: bool) -> Vec<Table> {
    let align = if contiguous_publishers { 1 } else { 512 };
    let mut b = Builder {
        tables: vec![Table::default(); (EP + TP) as usize],
        index: vec![HashMap::new(); (EP + TP) as usize],
        arenas: (0..EP + TP).map(|_| Arena { next: 1 << 30, align }).collect(),
    };
    let dense = |l: u64| {
        let p = format!("layers.{l}.");
        vec![
            (p.clone() + "input_layernorm", vec![HIDDEN]),
            (p.clone() + "post_attention_layernorm", vec![HIDDEN]),
            (p.clone() + "q_proj", vec![Q_HEADS * HEAD, HIDDEN]),
            (p.clone() + "k_proj", vec![KV_HEADS * HEAD, HIDDEN]),
            (p.clone() + "v_proj", vec![KV_HEADS * HEAD, HIDDEN]),
            (p.clone() + "o_proj", vec![HIDDEN, Q_HEADS * HEAD]),
            (p.clone() + "q_norm", vec![HEAD]),
            (p.clone() + "k_norm", vec![HEAD]),
            (p + "router", vec![EXPERTS, HIDDEN]),
        ]
    };
    let expert = |l: u64, e: u64| {
        let p = format!("layers.{l}.experts.{e}.");
        vec![
            (p.clone() + "gate_proj", vec![FFN, HIDDEN]),
            (p.clone() + "up_proj", vec![FFN, HIDDEN]),
            (p + "down_proj", vec![HIDDEN, FFN]),
        ]
    };
    // Publishers: dense weights replicated on every rank, experts e on rank e / (EXPERTS / EP).
    for rank in 0..EP {
        b.offer(rank, "embed", &[VOCAB, HIDDEN]);
        for l in 0..LAYERS {
            for (name, shape) in dense(l) {
                b.offer(rank, &name, &shape);
            }
            for e in rank * (EXPERTS / EP)..(rank + 1) * (EXPERTS / EP) {
                for (name, shape) in expert(l, e) {
                    b.offer(rank, &name, &shape);
                }
            }
        }
        b.offer(rank, "norm", &[HIDDEN]);
        b.offer(rank, "lm_head", &[VOCAB, HIDDEN]);
    }
    // Receivers: vLLM TP2 buffers.
    for r in 0..TP {
        let vocab = VOCAB / TP;
        for name in ["embed", "lm_head"] {
            let at = b.arenas[(EP + r) as usize].take(vocab * HIDDEN * BF16);
            b.need(r, name, &[VOCAB, HIDDEN], &[r * vocab, 0], &[vocab, HIDDEN], (at, HIDDEN));
        }
        let at = b.arenas[(EP + r) as usize].take(HIDDEN * BF16);
        b.need(r, "norm", &[HIDDEN], &[0], &[HIDDEN], (at, 1));
        for l in 0..LAYERS {
            let p = format!("layers.{l}.");
            let arena = (EP + r) as usize;
            for (name, n) in [
                ("input_layernorm", HIDDEN),
                ("post_attention_layernorm", HIDDEN),
                ("q_norm", HEAD),
                ("k_norm", HEAD),
            ] {
                let at = b.arenas[arena].take(n * BF16);
                b.need(r, &(p.clone() + name), &[n], &[0], &[n], (at, 1));
            }
            let at = b.arenas[arena].take(EXPERTS * HIDDEN * BF16);
            b.need(r, &(p.clone() + "router"), &[EXPERTS, HIDDEN], &[0, 0], &[EXPERTS, HIDDEN], (at, HIDDEN));
            // Fused qkv: this rank's q heads, then its k heads, then its v heads.
            let (q, kv) = (Q_HEADS * HEAD / TP, KV_HEADS * HEAD / TP);
            let qkv = b.arenas[arena].take((q + 2 * kv) * HIDDEN * BF16);
            b.need(r, &(p.clone() + "q_proj"), &[2 * q, HIDDEN], &[r * q, 0], &[q, HIDDEN], (qkv, HIDDEN));
            let k_at = qkv + q * HIDDEN * BF16;
            b.need(
                r,
                &(p.clone() + "k_proj"),
                &[2 * kv, HIDDEN],
                &[r * kv, 0],
                &[kv, HIDDEN],
                (k_at, HIDDEN),
            );
            let v_at = k_at + kv * HIDDEN * BF16;
            b.need(
                r,
                &(p.clone() + "v_proj"),
                &[2 * kv, HIDDEN],
                &[r * kv, 0],
                &[kv, HIDDEN],
                (v_at, HIDDEN),
            );
            // Row-parallel o_proj: a column slice.
            let o = b.arenas[arena].take(HIDDEN * q * BF16);
            b.need(r, &(p.clone() + "o_proj"), &[HIDDEN, 2 * q], &[0, r * q], &[HIDDEN, q], (o, q));
            // Stacked experts: w13 [E, 2 * FFN / TP, HIDDEN] (gate half then up half), w2 [E, HIDDEN, FFN / TP].
            let f = FFN / TP;
            let w13 = b.arenas[arena].take(EXPERTS * 2 * f * HIDDEN * BF16);
            let w2 = b.arenas[arena].take(EXPERTS * HIDDEN * f * BF16);
            for e in 0..EXPERTS {
                let ep = format!("layers.{l}.experts.{e}.");
                let slot = w13 + e * 2 * f * HIDDEN * BF16;
                b.need(
                    r,
                    &(ep.clone() + "gate_proj"),
                    &[FFN, HIDDEN],
                    &[r * f, 0],
                    &[f, HIDDEN],
                    (slot, HIDDEN),
                );
                let up = slot + f * HIDDEN * BF16;
                b.need(r, &(ep.clone() + "up_proj"), &[FFN, HIDDEN], &[r * f, 0], &[f, HIDDEN], (up, HIDDEN));
                let down = w2 + e * HIDDEN * f * BF16;
                b.need(r, &(ep + "down_proj"), &[HIDDEN, FFN], &[0, r * f], &[HIDDEN, f], (down, f));
            }
        }
    }
    b.tables
}

fn needed_bytes_per_receiver() -> u64 {
    let dense = 2 * HIDDEN
        + 2 * HEAD
        + EXPERTS * HIDDEN
        + (Q_HEADS * HEAD + 2 * KV_HEADS * HEAD) * HIDDEN / TP
        + HIDDEN * Q_HEADS * HEAD / TP;
    let experts = EXPERTS * 3 * FFN * HIDDEN / TP;
    (2 * VOCAB * HIDDEN / TP + HIDDEN + LAYERS * (dense + experts)) * BF16
}

fn check(contiguous: bool, ranges_target: u64) {
    let tables = qwen3(contiguous);
    // PLAN_SCALE_REPEAT=n builds n more times and prints the fastest (for profiling by hand).
    let repeat: usize = std::env::var("PLAN_SCALE_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    if repeat > 0 {
        refit::logging::init();
        let cpu = || {
            let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: clock_gettime writes the timespec it is given.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
            t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6
        };
        let (mut wall, mut on_cpu) = (f64::MAX, f64::MAX);
        for _ in 0..repeat {
            let start = cpu();
            let plan = build(&tables, &PlanOptions::default()).unwrap();
            on_cpu = on_cpu.min(cpu() - start);
            wall = wall.min(plan.stats().build_ns as f64 / 1e6);
        }
        println!(
            "contiguous={contiguous}: fastest of {repeat} builds {wall:.1} ms wall, {on_cpu:.1} ms on CPU"
        );
    }
    for policy in [OwnerPolicy::First, OwnerPolicy::Balanced] {
        let plan = build(&tables, &PlanOptions { policy, coalesce: true }).unwrap();
        let s = plan.stats();
        println!(
            "contiguous={contiguous} {policy:?}: {} offers, {} tensors' worth of ranges: all replicas {} ranges / {} bytes, \
             deduped {} ranges, coalesced {} segments ({} runs); build {:.1} ms",
            s.offers_in,
            s.needs,
            s.ranges_all_replicas,
            s.bytes_all_replicas,
            s.ranges_deduped,
            s.ranges_coalesced,
            s.flat_runs_coalesced,
            s.build_ns as f64 / 1e6
        );
        for r in 0..TP {
            let rs = plan.receiver_stats(Endpoint { rank: (EP + r) as u32, device: 0 });
            assert_eq!(rs.needed_bytes, needed_bytes_per_receiver());
            assert_eq!(rs.bytes_remote, rs.needed_bytes, "exactly the needed bytes move");
            assert!(rs.bytes_all_replicas > rs.needed_bytes);
            assert!(
                rs.ranges_coalesced <= ranges_target,
                "receiver {r}: {} segments > {ranges_target}",
                rs.ranges_coalesced
            );
        }
    }
}

#[test]
fn qwen3_separate_allocations_meet_the_range_target() {
    check(false, 13_000);
}

#[test]
fn qwen3_contiguous_publisher_buffers_meet_the_range_target() {
    check(true, 1_500);
}
