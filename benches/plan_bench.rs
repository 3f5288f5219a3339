//! The reshard planner on realistic refits (CPU, one thread): Qwen3-30B-A3B from Megatron EP8 to vLLM
//! TP2 with both publisher memory layouts (plus packed receivers, and one Megatron weight per expert),
//! a dense Llama-3-70B TP8 -> TP2, the colocated 2-GPU layout the GPU runs use, the latent-attention
//! MoE models at full size (DeepSeek-V3 from TP2 x EP8 to TP8, Kimi-K2 from 64 pipelined ranks to
//! TP8 with expert parallelism), and a size sweep of build time against the number of offers.
//!
//! Beside our figures: the seed's (modelexpress PR #635, same model and topology) and the targets of
//! issue 3. Every case also checks that each receiver gets exactly the bytes it needs. Writes
//! `plan_bench.json` under `$REFIT_BENCH_RESULTS` (default `benches/results/`; a debug build writes
//! only where that variable points). Arguments that are not flags select cases by name ("hostile"
//! for the sizes of issue 14 item 10, "scale" for planning across processes at Kimi-K2 scale).

use refit::plan::{self, Endpoint, Plan, PlanOptions, PlanStats, Region, Table};
use refit_workloads::{ArchSpec, Model, Packing, Spec, Workload};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Instant;

#[path = "plan_support/hostile.rs"]
mod hostile;
#[path = "plan_support/scale.rs"]
mod scale;

/// Counts heap bytes, so that the scale section can report what one process holds.
#[global_allocator]
static HEAP: scale::Counting = scale::Counting;

const GIB: f64 = (1u64 << 30) as f64;
/// The seed's per-rank figures: every replica read, and after one owner per replica (whole shards).
const SEED_BEFORE_RANGES: u64 = 809_112;
const SEED_BEFORE_GIB: f64 = 47.58;
const SEED_AFTER_RANGES: u64 = 19_011;
const SEED_AFTER_GIB: f64 = 37.82;
const TARGET_RANGES_SEPARATE: u64 = 13_000;
const TARGET_RANGES_PACKED: u64 = 1_500;
const TARGET_BUILD_MS: f64 = 50.0;

/// The 1-minute load average, so that timings from a busy machine are read as such.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// The machine the figures come from, as benches/report.py names it beside each table.
fn machine_json() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{{\"cpu\": \"{}\", \"cpus\": {cpus}}}", model.replace(['"', '\\'], ""))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Builds the plan `samples` times (after one warm-up) and returns the last plan and the median and
/// minimum wall time of `plan::build` in milliseconds (the minimum is the least disturbed by other
/// work on a shared machine).
fn timed_build(tables: &[Table], samples: usize) -> (Plan, f64, f64) {
    let options = PlanOptions::default();
    let mut plan = plan::build(tables, &options).expect("the workload plans");
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        plan = plan::build(tables, &options).expect("the workload plans");
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let min = times.iter().copied().fold(f64::INFINITY, f64::min);
    (plan, median(times), min)
}

fn json_stats(s: &PlanStats) -> String {
    format!(
        "{{\"needs\": {}, \"needed_bytes\": {}, \"ranges_all_replicas\": {}, \"bytes_all_replicas\": {}, \
         \"ranges_deduped\": {}, \"segments_deduped\": {}, \"segments_coalesced\": {}, \
         \"flat_runs_coalesced\": {}, \"offers_kept\": {}, \"bytes_local\": {}, \"bytes_peer\": {}, \
         \"bytes_remote\": {}, \"routes\": {}}}",
        s.needs,
        s.needed_bytes,
        s.ranges_all_replicas,
        s.bytes_all_replicas,
        s.ranges_deduped,
        s.segments_deduped,
        s.ranges_coalesced,
        s.flat_runs_coalesced,
        s.offers_kept,
        s.bytes_local,
        s.bytes_peer,
        s.bytes_remote,
        s.routes
    )
}

/// Payload bytes of the plan's segments landing on `receiver`, summed independently of the stats.
fn moved_into(plan: &Plan, receiver: Endpoint) -> u64 {
    plan.routes()
        .iter()
        .filter(|r| r.dst == receiver)
        .flat_map(|r| &r.segments)
        .map(|s| s.bytes().unwrap())
        .sum()
}

/// The largest segment-size buckets of one receiver, as "count x size" text: what dominates its ranges.
fn dominant_sizes(s: &PlanStats) -> String {
    let mut buckets: Vec<(usize, u64)> =
        s.size_histogram.iter().copied().enumerate().filter(|(_, n)| *n > 0).collect();
    buckets.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    let size = |b: usize| match b {
        0..=9 => format!("{} B", 1u64 << b),
        10..=19 => format!("{} KiB", 1u64 << (b - 10)),
        _ => format!("{} MiB", 1u64 << (b - 20)),
    };
    buckets.iter().take(3).map(|(b, n)| format!("{n} x >={}", size(*b))).collect::<Vec<_>>().join(", ")
}

struct Case {
    name: &'static str,
    spec: ArchSpec,
    /// Most segments per receiver the issue allows for this case, if it sets one.
    target_ranges: Option<u64>,
    /// Longest build the issue allows for this case, if it sets one.
    target_build_ms: Option<f64>,
    /// Whether the seed's figures describe this case.
    seed: bool,
}

/// One line of the closing summary: the worst receiver of a case against the targets.
struct Summary {
    name: &'static str,
    segments: u64,
    flat_runs: u64,
    target_ranges: Option<u64>,
    target_build_ms: Option<f64>,
    exact: bool,
    build_ms: f64,
    min_ms: f64,
    /// Median and minimum build time again once the allocator keeps freed memory (see
    /// [`keep_freed_memory`]).
    retained_ms: Option<(f64, f64)>,
}

/// Per receiver: (need, offer) pairs whose boxes intersect when every replica is read, i.e. the
/// strided ranges before choosing owners (each such pair is at least one range). Counted from the
/// workload, independently of the planner.
fn replica_pairs(w: &Workload<ArchSpec>) -> BTreeMap<Endpoint, u64> {
    let mut offers: HashMap<u32, Vec<&Region>> = HashMap::new();
    for o in &w.offers {
        offers.entry(o.tensor).or_default().push(&o.region);
    }
    let overlap = |a: &Region, b: &Region| {
        (0..a.offset.len())
            .all(|d| a.offset[d] < b.offset[d] + b.extent[d] && b.offset[d] < a.offset[d] + a.extent[d])
    };
    let mut pairs = BTreeMap::new();
    for n in &w.needs {
        let count = offers[&n.tensor].iter().filter(|o| overlap(o, &n.region)).count() as u64;
        *pairs.entry(n.endpoint).or_insert(0) += count;
    }
    pairs
}

fn run_case(case: &Case, samples: usize, out: &mut String, json: &mut Vec<String>) -> Summary {
    let workload = Workload::generate(&case.spec).expect("spec is valid");
    let pairs = replica_pairs(&workload);
    let tables = workload.tables(&workload.fake_bases()).expect("bases fit");
    let (plan, build_ms, min_ms) = timed_build(&tables, samples);
    let whole = plan.stats();
    let need_bytes = workload.need_bytes();
    let target = case.target_build_ms.map_or(String::from("no target"), |t| format!("target <= {t} ms"));
    let _ = writeln!(
        out,
        "\n### {}: {} offers in, {} replica sets, {} offers kept, build {:.1} ms (median of {samples}, min {:.1}; {target})\n",
        case.name, whole.offers_in, whole.replica_sets, whole.offers_kept, build_ms, min_ms
    );
    let _ = writeln!(
        out,
        "| receiver | stage | ranges (strided) | flat runs | GiB read | seed ranges | seed GiB | target |"
    );
    let _ = writeln!(out, "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |");
    let mut receivers_json = Vec::new();
    let mut summary = Summary {
        name: case.name,
        segments: 0,
        flat_runs: 0,
        target_ranges: case.target_ranges,
        target_build_ms: case.target_build_ms,
        exact: true,
        build_ms,
        min_ms,
        retained_ms: None,
    };
    for receiver in plan.receivers() {
        let s = plan.receiver_stats(receiver);
        let exact = need_bytes[&receiver];
        let moved = moved_into(&plan, receiver);
        assert_eq!(s.needed_bytes, exact, "planner and generator agree on what {receiver:?} needs");
        assert_eq!(moved, exact, "the plan moves exactly what {receiver:?} needs");
        let gib = |b: u64| format!("{:.2}", b as f64 / GIB);
        let seed = |r: u64, g: f64| {
            if case.seed {
                (r.to_string(), format!("{g:.2}"))
            } else {
                ("-".into(), "-".into())
            }
        };
        let name = format!("{}:{}", receiver.process, receiver.device);
        let (sr, sg) = seed(SEED_BEFORE_RANGES, SEED_BEFORE_GIB);
        let _ = writeln!(
            out,
            "| {name} | every replica read | {} | {} | {} | {sr} | {sg} | |",
            pairs[&receiver],
            s.ranges_all_replicas,
            gib(s.bytes_all_replicas)
        );
        let (sr, sg) = seed(SEED_AFTER_RANGES, SEED_AFTER_GIB);
        let _ = writeln!(
            out,
            "| {name} | one owner per replica | {} | {} | {} | {sr} | {sg} | bytes = {} GiB needed |",
            s.segments_deduped,
            s.ranges_deduped,
            gib(s.needed_bytes),
            gib(exact)
        );
        let target = case.target_ranges.map_or(String::from("-"), |t| {
            let verdict = if s.ranges_coalesced <= t { "met" } else { "MISSED" };
            format!("<= {t} ranges: {verdict}")
        });
        let _ = writeln!(
            out,
            "| {name} | coalesced | {} | {} | {} | | | {target} |",
            s.ranges_coalesced,
            s.flat_runs_coalesced,
            gib(moved)
        );
        let _ = writeln!(
            out,
            "| {name} | bytes by route | local {} | peer {} | remote {} | | | |",
            gib(s.bytes_local),
            gib(s.bytes_peer),
            gib(s.bytes_remote)
        );
        summary.segments = summary.segments.max(s.ranges_coalesced);
        summary.flat_runs = summary.flat_runs.max(s.flat_runs_coalesced);
        summary.exact &= moved == exact && s.bytes_all_replicas >= exact;
        let _ = writeln!(out, "| {name} | largest size buckets | {} | | | | | |", dominant_sizes(&s));
        receivers_json.push(format!(
            "{{\"rank\": {}, \"device\": {}, \"exact_bytes\": {exact}, \"moved_bytes\": {moved}, \
             \"segments_all_replicas\": {}, \"stats\": {}}}",
            receiver.process,
            receiver.device,
            pairs[&receiver],
            json_stats(&s)
        ));
    }
    json.push(format!(
        "{{\"name\": \"{}\", \"model\": \"{}\", \"layers\": {}, \"offers_in\": {}, \"replica_sets\": {}, \
         \"build_ms_median\": {build_ms:.3}, \"build_ms_min\": {min_ms:.3}, \"samples\": {samples}, \"target_ranges_per_receiver\": {}, \
         \"target_build_ms\": {}, \"whole\": {}, \"receivers\": [{}]}}",
        case.name,
        case.spec.model.name,
        case.spec.model.layers,
        whole.offers_in,
        whole.replica_sets,
        case.target_ranges.map_or("null".into(), |t| t.to_string()),
        case.target_build_ms.map_or("null".into(), |t| t.to_string()),
        json_stats(whole),
        receivers_json.join(", ")
    ));
    summary
}

fn print_summary(rows: &[Summary]) {
    println!("\n### Against the targets (worst receiver of each case)\n");
    println!(
        "| case | segments per receiver | target | flat runs | bytes read = bytes needed | build ms (median / min) \
         | target | build ms, allocator keeps memory (median / min) |"
    );
    println!("| --- | ---: | --- | ---: | --- | ---: | --- | ---: |");
    for r in rows {
        let ranges = r.target_ranges.map_or("-".to_string(), |t| {
            format!("<= {t}: {}", if r.segments <= t { "met" } else { "MISSED" })
        });
        let build = r.target_build_ms.map_or("-".to_string(), |t| {
            format!("<= {t}: {}", if r.build_ms <= t { "met" } else { "MISSED" })
        });
        let retained = r.retained_ms.map_or("-".to_string(), |(m, n)| format!("{m:.1} / {n:.1}"));
        println!(
            "| {} | {} | {ranges} | {} | {} | {:.1} / {:.1} | {build} | {retained} |",
            r.name,
            r.segments,
            r.flat_runs,
            if r.exact { "yes" } else { "NO" },
            r.build_ms,
            r.min_ms
        );
    }
}

/// glibc returns large freed blocks to the kernel (blocks above the mmap threshold are unmapped, the
/// heap top is trimmed), so each build of a large plan page-faults its temporaries in again. This
/// raises both thresholds so freed memory is kept: timing the same builds again afterwards separates
/// the planner's own work from that cost. Returns whether the allocator accepted the settings.
fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator tuning; it is called before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Least-squares line through (x, y): (slope, intercept, r^2).
fn fit(points: &[(f64, f64)]) -> (f64, f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let syy: f64 = points.iter().map(|(_, y)| (y - my) * (y - my)).sum();
    let slope = sxy / sxx;
    (slope, my - slope * mx, sxy * sxy / (sxx * syy))
}

fn sweep(samples: usize, out: &mut String, label: &str) -> String {
    let _ =
        writeln!(out, "\n### Size sweep: Qwen3-30B-A3B shapes, EP8 -> TP2, separate allocations{label}\n");
    let _ = writeln!(
        out,
        "| layers | experts | offers in | needs | segments | build ms | min ms | min us per 1k offers |"
    );
    let _ = writeln!(out, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut points = Vec::new();
    let mut inputs_points = Vec::new();
    let mut rows = Vec::new();
    // Layers first (6 .. 96 at 128 experts, the first and last points), then experts at 48 layers.
    let shapes = [(6, 128), (12, 128), (24, 128), (48, 16), (48, 32), (48, 64), (48, 128), (96, 128)];
    for (layers, experts) in shapes {
        let model = Model::qwen3_30b_a3b().with_layers(layers).with_experts(experts);
        let workload =
            Workload::generate(&Spec::qwen3_ep8_to_tp2(Packing::Separate).with_model(model)).unwrap();
        let tables = workload.tables(&workload.fake_bases()).unwrap();
        let (plan, ms, min_ms) = timed_build(&tables, samples);
        let s = plan.stats();
        let per_k = min_ms * 1e3 / (s.offers_in as f64 / 1e3);
        let _ = writeln!(
            out,
            "| {layers} | {experts} | {} | {} | {} | {ms:.2} | {min_ms:.2} | {per_k:.1} |",
            s.offers_in, s.needs, s.ranges_coalesced
        );
        // Fit the minimum: on a shared machine it is the least disturbed estimate of the work.
        points.push((s.offers_in as f64, min_ms));
        inputs_points.push(((s.offers_in + s.needs) as f64, min_ms));
        rows.push(format!(
            "{{\"layers\": {layers}, \"experts\": {experts}, \"offers_in\": {}, \"needs\": {}, \"segments\": {}, \"build_ms_median\": {ms:.3}, \"build_ms_min\": {min_ms:.3}}}",
            s.offers_in, s.needs, s.ranges_coalesced
        ));
    }
    let (slope, intercept, r2) = fit(&points);
    let (slope_in, intercept_in, r2_in) = fit(&inputs_points);
    // Layers only (6 -> 96 at 128 experts): the mix of tensors stays the same, only the count grows.
    let (first, last) = (points[0], points[points.len() - 1]);
    let growth = (last.1 / first.1) / (last.0 / first.0);
    let nlogn = last.0.ln() / first.0.ln();
    let _ = writeln!(
        out,
        "\nLinear fit of the minimum over offers: build ms = {intercept:.3} + {:.3} us x offers, r^2 = {r2:.4}\n\
         Linear fit of the minimum over offers + needs: build ms = {intercept_in:.3} + {:.3} us x inputs, r^2 = {r2_in:.4}\n\
         Layers 6 -> 96: time ratio / offer ratio = {growth:.2} (1.00 is linear; n log n predicts {nlogn:.2})",
        slope * 1e3,
        slope_in * 1e3
    );
    format!(
        "{{\"points\": [{}], \"fit_offers\": {{\"ms_per_offer\": {slope:.9}, \"intercept_ms\": {intercept:.4}, \"r2\": {r2:.5}}}, \
         \"fit_inputs\": {{\"ms_per_input\": {slope_in:.9}, \"intercept_ms\": {intercept_in:.4}, \"r2\": {r2_in:.5}}}, \
         \"layers_time_ratio_over_offer_ratio\": {growth:.3}, \"nlogn_prediction\": {nlogn:.3}}}",
        rows.join(", ")
    )
}

fn main() {
    // `cargo bench` passes --bench; a quick mode for smoke runs in debug builds.
    let quick = std::env::args().any(|a| a == "--quick") || cfg!(debug_assertions);
    let samples = if quick { 1 } else { 15 };
    let mut out = String::new();
    let load_before = load_average();
    let _ = writeln!(
        out,
        "## plan_bench: reshard planner on realistic refits (single thread; load average {load_before} on {} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // The cases issue 3 set its targets on (every one builds within TARGET_BUILD_MS).
    let issue3 = |name, spec: Spec, target_ranges, seed| Case {
        name,
        spec: ArchSpec::from(&spec),
        target_ranges,
        target_build_ms: Some(TARGET_BUILD_MS),
        seed,
    };
    // Models of other families at full size, without targets: what planning them costs.
    let family = |name, spec| Case { name, spec, target_ranges: None, target_build_ms: None, seed: false };
    let llama = |layout| Spec::llama3_70b_tp8_to_tp2(layout, 1);
    let cases = [
        issue3(
            "Qwen3-30B-A3B EP8 -> TP2, separate allocations",
            Spec::qwen3_ep8_to_tp2(Packing::Separate),
            Some(TARGET_RANGES_SEPARATE),
            true,
        ),
        issue3(
            "Qwen3-30B-A3B EP8 -> TP2, packed publisher buffers",
            Spec::qwen3_ep8_to_tp2(Packing::Packed),
            Some(TARGET_RANGES_PACKED),
            true,
        ),
        issue3(
            "Qwen3-30B-A3B EP8 -> TP2, packed publishers and packed receivers",
            Spec { receiver_layout: Packing::Packed, ..Spec::qwen3_ep8_to_tp2(Packing::Packed) },
            Some(TARGET_RANGES_PACKED),
            true,
        ),
        issue3(
            "Qwen3-30B-A3B EP8 -> TP2, separate allocations, one weight per expert (TEGroupedMLP)",
            Spec::qwen3_ep8_to_tp2(Packing::Separate).with_expert_weights(),
            Some(TARGET_RANGES_SEPARATE),
            true,
        ),
        issue3("Llama-3-70B TP8 -> TP2, separate allocations", llama(Packing::Separate), None, false),
        issue3(
            "Llama-3-70B TP8 x DP2 -> TP2, packed publisher buffers",
            Spec::llama3_70b_tp8_to_tp2(Packing::Packed, 2),
            None,
            false,
        ),
        issue3(
            "Qwen3-30B-A3B colocated EP2 + TP2 on 2 GPUs, separate allocations",
            Spec::qwen3_colocated_ep2_tp2(Packing::Separate),
            None,
            false,
        ),
        family(
            "DeepSeek-V3 TP2 x EP8 -> TP8, packed publisher buffers",
            ArchSpec::deepseek_v3_tp2_ep8_to_tp8(Packing::Packed),
        ),
        family(
            "Kimi-K2 TP8 x EP16 x PP4 -> TP8 with expert parallelism, packed publisher buffers",
            ArchSpec::kimi_k2_pp4_to_tp8_ep(Packing::Packed),
        ),
    ];
    // Arguments that are not flags select cases by name ("sweep" for the sweep); none runs all.
    let filters: Vec<String> =
        std::env::args().skip(1).filter(|a| !a.starts_with('-')).map(|a| a.to_lowercase()).collect();
    let selected =
        |name: &str| filters.is_empty() || filters.iter().any(|f| name.to_lowercase().contains(f.as_str()));
    let mut json = Vec::new();
    let mut summary = Vec::new();
    for case in cases.iter().filter(|c| selected(c.name)) {
        summary.push(run_case(case, samples, &mut out, &mut json));
        print!("{out}");
        out.clear();
    }
    let sweep_json = if selected("size sweep") { sweep(samples, &mut out, "") } else { "null".into() };
    print!("{out}");
    out.clear();
    let hostile_json =
        if selected("hostile") { hostile::run(samples.min(5), &mut out) } else { "null".into() };
    print!("{out}");
    out.clear();
    let scale_json = if selected("scale") { scale::run(samples.min(3), &mut out) } else { "null".into() };
    print!("{out}");
    out.clear();

    // A/B: the same builds with the allocator keeping freed memory.
    let mut retained_sweep_json = String::from("null");
    let mut retained_json = Vec::new();
    if keep_freed_memory() {
        for (case, row) in cases.iter().filter(|c| selected(c.name)).zip(&mut summary) {
            let workload = Workload::generate(&case.spec).expect("spec is valid");
            let tables = workload.tables(&workload.fake_bases()).expect("bases fit");
            let (_, median_ms, min_ms) = timed_build(&tables, samples);
            row.retained_ms = Some((median_ms, min_ms));
            retained_json.push(format!(
                "{{\"name\": \"{}\", \"build_ms_median\": {median_ms:.3}, \"build_ms_min\": {min_ms:.3}}}",
                case.name
            ));
        }
        if selected("size sweep") {
            retained_sweep_json = sweep(samples, &mut out, ", allocator keeps freed memory");
            print!("{out}");
        }
    }
    print_summary(&summary);
    if !filters.is_empty() {
        println!("\n(a selection: results not written)");
        return;
    }

    let dir = match std::env::var("REFIT_BENCH_RESULTS") {
        Ok(dir) => dir,
        // A debug build's timings would overwrite the release figures kept in the repository.
        Err(_) if cfg!(debug_assertions) => {
            println!("\n(debug build: results not written unless REFIT_BENCH_RESULTS is set)");
            return;
        }
        Err(_) => "benches/results".into(),
    };
    let path = std::path::Path::new(&dir).join("plan_bench.json");
    let body = format!(
        "{{\"bench\": \"plan_bench\", \"machine\": {}, \"profile\": \"{}\", \"samples\": {samples}, \
         \"load_average_before\": \"{load_before}\", \"load_average_after\": \"{}\", \
                  \"cases\": [\n  {}\n], \"sweep\": {sweep_json}, \"hostile\": {hostile_json}, \"scale\": {scale_json}, \
         \"allocator_keeps_freed_memory\": {{\"cases\": [{}], \"sweep\": {retained_sweep_json}}}}}\n",
        machine_json(),
        if cfg!(debug_assertions) { "debug" } else { "release" },
        load_average(),
        json.join(",\n  "),
        retained_json.join(", ")
    );
    std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&path, body)).expect("write results");
    println!("\nwrote {}", path.display());
}
