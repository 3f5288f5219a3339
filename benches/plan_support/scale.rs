//! Planning across processes at the scale of a Kimi-K2-shaped refit (61 layers, 384 experts, about
//! 1T parameters): Megatron publishers (TP8, expert parallel over up to 128 ranks, data-parallel
//! replicas of the dense weights) in 16 to 256 processes, to 128 vLLM receiver processes (TP8 for
//! attention, expert parallel over all 128: three whole experts each per layer). One process per
//! GPU. Each process receives every table encoded, decodes them and builds its own share of the
//! plan; this measures that on one core, with the heap it takes, for the busiest processes.

use refit::plan::Region;
use refit::plan::{self, wire, Endpoint, Limits, OwnerPolicy, PlanOptions, Table};
use refit_workloads::{
    Buffer, CheckpointTensors, Megatron, MlpTensors, Model, Moe, Packing, Param, Piece, Placed, Role,
};
use refit_workloads::{Spec, Vllm, Workload};
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

/// The system allocator, counting the bytes live and the most live since the last reset while
/// counting is on (off, it adds one relaxed load per call: the other sections' timings stay
/// comparable with runs without it).
pub struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() && COUNTING.load(Ordering::Relaxed) {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: AllocLayout) {
        System.dealloc(p, layout);
        if COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
    }
    unsafe fn realloc(&self, p: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        let q = System.realloc(p, layout, new_size);
        if !q.is_null() && COUNTING.load(Ordering::Relaxed) {
            if new_size >= layout.size() {
                let live =
                    LIVE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size - layout.size();
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        q
    }
}

/// Runs `f` and returns its result and the most heap it held at once. Everything `f` allocates
/// must be freed when it returns (frees of older blocks are not counted; they would make the
/// count go below zero).
fn peak_heap<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LIVE.store(0, Ordering::Relaxed);
    PEAK.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let out = f();
    COUNTING.store(false, Ordering::Relaxed);
    (out, PEAK.load(Ordering::Relaxed))
}

/// Kimi-K2's shape as far as this refit goes: 61 layers of hidden 7168, 384 experts of
/// intermediate 2048 (about 1.03T expert parameters), vocabulary 163,840, BF16. Attention is
/// modelled as grouped-query attention of 64 heads and 8 key/value heads (the generator has no
/// latent attention; its weights are a few per cent of the bytes and a handful of tensors per layer).
fn kimi_k2() -> Model {
    Model {
        name: "Kimi-K2-shaped".into(),
        layers: 61,
        hidden: 7168,
        heads: 64,
        kv_heads: 8,
        head_dim: 128,
        qk_norm: false,
        ffn: 0,
        moe: Some(Moe { experts: 384, ffn: 2048 }),
        vocab: 163_840,
        elem_size: 2,
        dtype: 2,
    }
}

const TP: u64 = 8;
const RECEIVERS: u32 = 128;

/// A parameter of one receiver holding the given (tensor, byte offset, offset, extent) boxes.
fn param(endpoint: Endpoint, name: String, elems: u64, boxes: &[(u32, u64, [u64; 2], [u64; 2])]) -> Param {
    let pieces = boxes
        .iter()
        .map(|&(tensor, offset, lo, ext)| {
            let (lo, ext) =
                if lo[1] == u64::MAX { (vec![lo[0]], vec![ext[0]]) } else { (lo.to_vec(), ext.to_vec()) };
            Piece { tensor, offset, region: Region { offset: lo, extent: ext } }
        })
        .collect();
    Param { endpoint, name, bytes: elems * 2, pieces }
}

/// vLLM receivers with expert parallelism over all of them: receiver `i` is TP rank `i % 8` of its
/// attention group (vocabulary, q/k/v, o split as vLLM's TP layout does; norms and router
/// replicated) and holds experts `3i..3i + 3` of every layer whole in `w13 = [3][gate | up][ffn][h]`
/// and `w2 = [3][h][ffn]`.
fn receivers(model: &Model, catalog: &CheckpointTensors, first: u32) -> Vec<Param> {
    let (h, hd) = (model.hidden, model.head_dim);
    let moe = model.moe.expect("a MoE model");
    let local = moe.experts / u64::from(RECEIVERS);
    let q_local = model.heads * hd / TP;
    let kv_local = model.kv_heads * hd / TP;
    let vocab_rows = model.vocab.div_ceil(TP);
    let mut out = Vec::new();
    for i in 0..RECEIVERS {
        let e = Endpoint { process: first + i, device: 0 };
        let tp = u64::from(i) % TP;
        let whole_vector =
            |t: u32, len: u64, name: String| param(e, name, len, &[(t, 0, [0, u64::MAX], [len, 0])]);
        let rows = (tp * vocab_rows).min(model.vocab);
        let rows_len = ((tp + 1) * vocab_rows).min(model.vocab) - rows;
        out.push(param(e, "embed".into(), vocab_rows * h, &[(catalog.embed, 0, [rows, 0], [rows_len, h])]));
        for (l, t) in catalog.layers.iter().enumerate() {
            out.push(whole_vector(t.input_norm, h, format!("{l}.input_norm")));
            let kv_bytes = kv_local * h * 2;
            out.push(param(
                e,
                format!("{l}.qkv"),
                (q_local + 2 * kv_local) * h,
                &[
                    (t.q, 0, [tp * q_local, 0], [q_local, h]),
                    (t.k, q_local * h * 2, [tp * kv_local, 0], [kv_local, h]),
                    (t.v, q_local * h * 2 + kv_bytes, [tp * kv_local, 0], [kv_local, h]),
                ],
            ));
            out.push(param(e, format!("{l}.o"), h * q_local, &[(t.o, 0, [0, tp * q_local], [h, q_local])]));
            out.push(whole_vector(t.post_norm, h, format!("{l}.post_norm")));
            let MlpTensors::Moe { router, experts } = &t.mlp else { unreachable!("a MoE model") };
            out.push(param(
                e,
                format!("{l}.router"),
                moe.experts * h,
                &[(*router, 0, [0, 0], [moe.experts, h])],
            ));
            let (mut w13, mut w2) = (Vec::new(), Vec::new());
            for j in 0..local {
                let [gate, up, down] = experts[(u64::from(i) * local + j) as usize];
                let base = j * 2 * moe.ffn * h * 2;
                w13.push((gate, base, [0, 0], [moe.ffn, h]));
                w13.push((up, base + moe.ffn * h * 2, [0, 0], [moe.ffn, h]));
                w2.push((down, j * h * moe.ffn * 2, [0, 0], [h, moe.ffn]));
            }
            out.push(param(e, format!("{l}.w13"), local * 2 * moe.ffn * h, &w13));
            out.push(param(e, format!("{l}.w2"), local * h * moe.ffn, &w2));
        }
        out.push(whole_vector(catalog.final_norm, h, "norm".into()));
        out.push(param(
            e,
            "lm_head".into(),
            vocab_rows * h,
            &[(catalog.lm_head, 0, [rows, 0], [rows_len, h])],
        ));
    }
    out
}

/// Each parameter its own buffer.
fn place(params: Vec<Param>, role: Role, buffers: &mut Vec<Buffer>) -> Vec<Placed> {
    let mut placed = Vec::new();
    for p in params {
        buffers.push(Buffer { endpoint: p.endpoint, role, bytes: p.bytes, name: p.name.clone() });
        for piece in p.pieces {
            placed.push(Placed {
                tensor: piece.tensor,
                endpoint: p.endpoint,
                buffer: buffers.len() as u32 - 1,
                offset: piece.offset,
                region: piece.region,
            });
        }
    }
    placed
}

/// The refit from `publishers` Megatron processes (TP8, EP `min(publishers, 128)`) to the 128
/// receivers: one table per process.
fn tables(publishers: u32) -> Vec<Table> {
    let model = kimi_k2();
    let catalog = CheckpointTensors::new(&model);
    let megatron = Megatron {
        endpoints: (0..publishers).map(|process| Endpoint { process, device: 0 }).collect(),
        tp: TP,
        ep: u64::from(publishers.min(128)),
        grouped_experts: true,
    };
    let mut buffers = Vec::new();
    let offers =
        place(megatron.params(&model, &catalog).expect("the layout divides"), Role::Publisher, &mut buffers);
    let needs = place(receivers(&model, &catalog, publishers), Role::Receiver, &mut buffers);
    let spec = Spec {
        model: model.clone(),
        publishers: megatron,
        publisher_layout: Packing::Separate,
        receivers: Vllm { endpoints: Vec::new() },
        receiver_layout: Packing::Separate,
        digests: false,
    };
    let workload = Workload { spec, catalog, buffers, offers, needs };
    workload.tables(&workload.fake_bases()).expect("bases fit")
}

/// What one process's pipeline took.
#[derive(Clone, Copy)]
struct Share {
    decode_ms: f64,
    merge_ms: f64,
    /// Every stage after the merge: the work of this process's share.
    share_ms: f64,
    /// Most heap held at once beyond the encoded tables the process was given.
    peak: usize,
    routes: usize,
    segments: u64,
}

impl Share {
    fn total_ms(&self) -> f64 {
        self.decode_ms + self.merge_ms + self.share_ms
    }
}

/// One process's pipeline: decode every table, build its share.
fn process_share(encoded: &[Vec<u8>], process: u32, policy: OwnerPolicy) -> Share {
    let (mut share, peak) = peak_heap(|| {
        let started = Instant::now();
        let decoded: Vec<Table> = encoded.iter().map(|b| wire::decode(b).expect("decodes")).collect();
        let decode_ms = started.elapsed().as_secs_f64() * 1e3;
        let refs: Vec<&Table> = decoded.iter().collect();
        let options = PlanOptions { policy, coalesce: true };
        let plan = plan::build_share(&refs, process, &options, &Limits::default()).expect("plans");
        let ms = |ns: u64| ns as f64 / 1e6;
        let merge_ms = ms(plan.stage_ns().iter().filter(|(s, _)| *s == "merge").map(|(_, ns)| ns).sum());
        let share_ms = ms(plan.stats().build_ns) - merge_ms;
        let segments = plan.routes().iter().map(|r| r.segments.len() as u64).sum();
        Share { decode_ms, merge_ms, share_ms, peak: 0, routes: plan.routes().len(), segments }
    });
    share.peak = peak;
    share
}

/// The scale table and its JSON: for each publisher count, the processes that plan longest.
pub fn run(samples: usize, out: &mut String) -> String {
    let _ = writeln!(
        out,
        "\n### Planning across processes: Kimi-K2-shaped refit, N Megatron publishers -> 128 vLLM receivers \
         (each process decodes every table and builds its own share, one core)\n"
    );
    let _ = writeln!(
        out,
        "| publishers | entries in all tables | encoded MiB | process | decode ms | merge ms | own share ms | total ms \
         | peak heap MiB | routes | segments | whole plan ms (one process planning everything) |"
    );
    let _ =
        writeln!(out, "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    for publishers in [16u32, 32, 64, 128, 256] {
        let tables = tables(publishers);
        let encoded: Vec<Vec<u8>> = tables.iter().map(wire::encode).collect();
        let entries: usize = tables.iter().map(|t| t.tensors.len() + t.offers.len() + t.needs.len()).sum();
        let encoded_bytes: usize = encoded.iter().map(Vec::len).sum();
        let refs: Vec<&Table> = tables.iter().collect();
        let started = Instant::now();
        let whole = plan::build_from(&refs, &PlanOptions::default(), &Limits::default()).expect("plans");
        let whole_ms = started.elapsed().as_secs_f64() * 1e3;
        drop(whole);
        drop(tables);
        // Under LOCAL (the default) publisher 0 serves every dense byte it holds a shard of (the
        // lowest replica), the last publisher only its experts, and every receiver plans alike;
        // BALANCED weighs every receiver's demand, so each share intersects every need.
        let processes = [
            ("publisher 0", 0, OwnerPolicy::Local),
            ("last publisher", publishers - 1, OwnerPolicy::Local),
            ("receiver 0", publishers, OwnerPolicy::Local),
            ("publisher 0, BALANCED", 0, OwnerPolicy::Balanced),
        ];
        for (label, process, policy) in processes {
            let mut best: Option<Share> = None;
            for _ in 0..samples {
                let run = process_share(&encoded, process, policy);
                if best.is_none_or(|b| run.total_ms() < b.total_ms()) {
                    best = Some(run);
                }
            }
            let b = best.expect("at least one sample");
            let mib = |bytes: usize| bytes as f64 / (1u64 << 20) as f64;
            let _ = writeln!(
                out,
                "| {publishers} | {entries} | {:.1} | {label} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {whole_ms:.0} |",
                mib(encoded_bytes),
                b.decode_ms,
                b.merge_ms,
                b.share_ms,
                b.total_ms(),
                mib(b.peak + encoded_bytes),
                b.routes,
                b.segments
            );
            rows.push(format!(
                "{{\"publishers\": {publishers}, \"receivers\": {RECEIVERS}, \"entries\": {entries}, \
                 \"encoded_bytes\": {encoded_bytes}, \"process\": \"{label}\", \"decode_ms\": {:.3}, \
                 \"merge_ms\": {:.3}, \"own_share_ms\": {:.3}, \"total_ms\": {:.3}, \
                 \"peak_heap_bytes_with_encoded_tables\": {}, \"routes\": {}, \"segments\": {}, \
                 \"whole_plan_ms\": {whole_ms:.3}}}",
                b.decode_ms,
                b.merge_ms,
                b.share_ms,
                b.total_ms(),
                b.peak + encoded_bytes,
                b.routes,
                b.segments
            ));
        }
    }
    let _ = writeln!(
        out,
                "\nBest of {samples} per process (the minimum is the least disturbed by other work). Decode and merge read \
         every table (they grow with all processes' entries); the own share is every later stage. Peak heap counts \
         the encoded tables the process was given, the decoded tables, the planner's temporaries and the share. \
         Targets: total <= 1000 ms and <= 1024 MiB per process at 256 publishers."
    );
    format!("[{}]", rows.join(", "))
}
