//! The plain copy at every run size (issue 29): the executor through the C ABI on one GPU, sweeping
//! contiguous run sizes from 4 KiB to 1 GiB at the same total payload per point, with in the same run
//! and on the same buffers:
//! - each arm (REFIT_ARM_AUTO, _KERNEL, _COPY_ENGINE), direct commit: the executor's device time
//!   (RunStats), median after warm-up;
//! - one large device copy of the same total bytes (`cuMemcpyDtoDAsync`, CUDA events): the ceiling;
//! - one `cuMemcpyAsync` per run over the same runs (CUDA events): the plain peer.
//!
//! Shapes, each point planned from tables (encoded, decoded, planned with coalescing):
//! - `contiguous`: run i is one offer (row i of a [n, run] byte tensor) and one need, destinations in
//!   reverse order so that nothing coalesces;
//! - `strided`: one [rows, 2 run] row-major tensor offered whole, needed as its two column halves
//!   (the tensor-parallel split): every run is a row of `run` bytes read with a stride of 2 run;
//! - `receivers`: the payload split over RECEIVERS destination buffers (separate allocations, one
//!   tensor each, runs reversed within each). On one GPU every receiver is device 0: this shape
//!   differs from `contiguous` in the number of destination allocations, not in the route kind.
//!
//! Every arm and the per-run loop are checked before they are timed: the destinations are poisoned,
//! written once, and every run's destination compared with its source through refit_digest_many (one
//! digest per run on each side, covering every destination byte). Each 4 KiB block of the source
//! is distinct (random bytes, its first 8 bytes its index), so a run landing in the wrong place fails.
//!
//! REFIT_SWEEP_BYTES (default 4 GiB) is the payload of every point; REFIT_SWEEP_SIZES (comma-separated
//! bytes, default 4 KiB .. 1 GiB by powers of 4) the run sizes; REFIT_SWEEP_SHAPES (comma-separated
//! names) the shapes; REFIT_BENCH_HOST=1 runs a smoke on
//! the host backend (4 MiB, 4 KiB .. 1 MiB). Prints a markdown table last; writes
//! $REFIT_BENCH_RESULTS/gpu_sweep.json.

#[path = "../tests/common/cuda.rs"]
mod cuda;
#[path = "machine_support/mod.rs"]
mod machine_support;

use machine_support::{median, ok, Machine};

use cudarc::driver::sys;
use refit::exec::RunStats;
use refit::ffi::digest::refit_digest_many;
use refit::ffi::exec::*;
use refit::ffi::group::*;
use refit::ffi::plan::*;
use refit::plan::builder::TableBuilder;
use refit::plan::{wire, Endpoint, Need, Offer, Region, Table, TensorSpec};
use refit::transport::driver::check;
use refit::transport::Stream;
use refit::Segment;
use std::time::Instant;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const POISON: u8 = 0xAB;
/// Destination buffers of the `receivers` shape.
const RECEIVERS: u64 = 4;
/// Granularity at which the source is made distinct (the smallest run size).
const BLOCK: u64 = 4 * KIB;
/// Above this many runs a point is timed fewer times (a per-run copy of 4 KiB costs microseconds of
/// host time each: a million of them take seconds).
const MANY_RUNS: usize = 65_536;

fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e6)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.trim().parse().unwrap_or_else(|_| panic!("{name}={v}: not a number")))
}

/// One contiguous run: source, destination, bytes.
#[derive(Clone, Copy)]
struct Run {
    src: u64,
    dst: u64,
    len: u64,
}

impl Machine {
    /// Sets `len` bytes at `ptr` to `byte`, synchronously.
    fn poison(&self, ptr: u64, len: u64) {
        if self.on_gpu {
            cuda::on(0, || {
                // SAFETY: device memory of this bench.
                check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, POISON, len as usize) })
                    .expect("memset");
                cuda::sync_device(0);
            });
        } else {
            // SAFETY: host memory of this bench.
            unsafe { std::ptr::write_bytes(ptr as usize as *mut u8, POISON, len as usize) };
        }
    }

    /// Fills `len` bytes at `ptr` so that every BLOCK-byte block differs from every other: one random
    /// chunk, written over and over with the first 8 bytes of each block set to its index.
    fn fill_distinct(&self, ptr: u64, len: u64) {
        let chunk_len = len.min(64 * MIB) as usize;
        let mut chunk = vec![0u8; chunk_len];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for word in chunk.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes()[..word.len()]);
        }
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(chunk_len as u64) as usize;
            for (b, block) in chunk[..n].chunks_mut(BLOCK as usize).enumerate() {
                let index = (at / BLOCK + b as u64).to_le_bytes();
                let k = block.len().min(8);
                block[..k].copy_from_slice(&index[..k]);
            }
            // SAFETY: memory of this bench, `n` bytes from `ptr + at` inside it.
            unsafe { self.backend.write(0, ptr + at, &chunk[..n]) }.expect("write");
            at += n as u64;
        }
        if self.on_gpu {
            cuda::sync_device(0);
        }
    }

    /// Digests of the given ranges (one pass on the device), waited for.
    fn digests(&self, ranges: impl Iterator<Item = (u64, u64)>) -> Vec<u64> {
        let (addrs, lens): (Vec<u64>, Vec<u64>) = ranges.unzip();
        let mut out = vec![0u64; addrs.len()];
        let status = refit_digest_many(
            self.group,
            0,
            addrs.as_ptr(),
            lens.as_ptr(),
            addrs.len(),
            std::ptr::null_mut(),
            out.as_mut_ptr(),
        );
        ok(status, "refit_digest_many");
        out
    }

    /// The first run whose destination differs from its source.
    fn first_mismatch(&self, runs: &[Run]) -> Option<usize> {
        let sources = self.digests(runs.iter().map(|r| (r.src, r.len)));
        let destinations = self.digests(runs.iter().map(|r| (r.dst, r.len)));
        (0..runs.len()).find(|&i| sources[i] != destinations[i])
    }

    /// Panics unless every run's destination equals its source.
    fn check(&self, runs: &[Run], what: &str) {
        if let Some(i) = self.first_mismatch(runs) {
            let r = runs[i];
            panic!(
                "{what}: run {i} of {} ({} bytes, {:#x} -> {:#x}) did not land",
                runs.len(),
                r.len,
                r.src,
                r.dst
            );
        }
    }

    /// Shows that the check can fail: it must find poisoned destinations, and a run written to
    /// another run's place, before it is trusted with the sweep.
    fn check_the_check(&self, src: u64, dst: u64) {
        let runs: Vec<Run> =
            (0..8).map(|i| Run { src: src + i * BLOCK, dst: dst + (7 - i) * BLOCK, len: BLOCK }).collect();
        self.poison(dst, 8 * BLOCK);
        assert_eq!(self.first_mismatch(&runs), Some(0), "the check passed poisoned destinations");
        self.in_context(|| self.time_ms(0, 1, |stream| self.copy_runs(stream, &runs)));
        assert_eq!(self.first_mismatch(&runs), None, "the check failed a correct copy");
        let misplaced = [Run { src: runs[1].src, dst: runs[2].dst, len: BLOCK }];
        self.in_context(|| self.time_ms(0, 1, |stream| self.copy_runs(stream, &misplaced)));
        assert_eq!(self.first_mismatch(&runs), Some(2), "the check passed a run landed in another's place");
    }

    /// Milliseconds of `copy` (queued on a stream of device 0), CUDA-event timed on the GPU and
    /// wall-clock timed on the host backend, median of `reps` after `warm` untimed calls.
    fn time_ms(&self, warm: usize, reps: usize, copy: impl Fn(sys::CUstream)) -> f64 {
        if self.on_gpu {
            let stream = cuda::Stream::new(0);
            let timer = cuda::Timer::new(0);
            for _ in 0..warm {
                copy(stream.raw);
            }
            stream.sync();
            median(
                (0..reps)
                    .map(|_| {
                        timer.start(&stream);
                        copy(stream.raw);
                        timer.stop(&stream)
                    })
                    .collect(),
            )
        } else {
            for _ in 0..warm {
                copy(std::ptr::null_mut());
            }
            median(
                (0..reps)
                    .map(|_| {
                        let t = Instant::now();
                        copy(std::ptr::null_mut());
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect(),
            )
        }
    }

    /// One copy of `len` bytes from `src` to `dst` queued on `stream` (on the host: done on return).
    fn copy_one(&self, stream: sys::CUstream, src: u64, dst: u64, len: u64) {
        if self.on_gpu {
            // SAFETY: device memory of this bench; a live stream of device 0, its context current
            // (the caller runs this inside cuda::on).
            check("cuMemcpyDtoDAsync", unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, stream) })
                .expect("cuMemcpyDtoDAsync");
        } else {
            let segment = [Segment::contiguous(src, dst, len)];
            // SAFETY: host memory of this bench.
            unsafe { self.backend.copy_segments(0, Stream::NULL, &segment) }.expect("copy");
            self.backend.sync_stream(0, Stream::NULL).expect("sync");
        }
    }

    /// One `cuMemcpyAsync` per run, queued on `stream` (on the host: a copy each).
    fn copy_runs(&self, stream: sys::CUstream, runs: &[Run]) {
        if self.on_gpu {
            for r in runs {
                // SAFETY: as copy_one.
                check("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(r.dst, r.src, r.len as usize, stream) })
                    .expect("cuMemcpyAsync");
            }
        } else {
            for r in runs {
                let segment = [Segment::contiguous(r.src, r.dst, r.len)];
                // SAFETY: host memory of this bench.
                unsafe { self.backend.copy_segments(0, Stream::NULL, &segment) }.expect("copy");
            }
            self.backend.sync_stream(0, Stream::NULL).expect("sync");
        }
    }

    fn in_context<T>(&self, f: impl FnOnce() -> T) -> T {
        if self.on_gpu {
            cuda::on(0, f)
        } else {
            f()
        }
    }
}

/// How the runs of a point are laid out.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Contiguous,
    Strided,
    Receivers,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Contiguous => "contiguous",
            Shape::Strided => "strided",
            Shape::Receivers => "receivers",
        }
    }

    /// The smallest payload a point of this shape needs for runs of `run` bytes.
    fn min_total(self, run: u64) -> u64 {
        match self {
            Shape::Contiguous => run,
            Shape::Strided => 2 * run,
            Shape::Receivers => RECEIVERS * run,
        }
    }
}

fn byte_tensor(table: &mut TableBuilder, name: String, shape: Vec<u64>) -> u32 {
    table.add_tensor(TensorSpec { name, dtype: 1, elem_size: 1, shape }).expect("tensor")
}

/// `n` rows of `run` bytes from `src`, each a tensor of its own with one offer and one need, row i
/// landing at row n-1-i of `dst` (so that neighbours in the source are not neighbours in the
/// destination). A tensor per row keeps the planner's box tests at one per need: a million offers
/// and needs of one tensor would be tested against each other past the planner's limit.
fn reversed_rows(
    table: &mut TableBuilder,
    name: String,
    n: u64,
    run: u64,
    src: u64,
    dst: u64,
    out: &mut Vec<Run>,
) {
    let me = Endpoint { process: 0, device: 0 };
    for i in 0..n {
        let tensor = byte_tensor(table, format!("{name}.{i}"), vec![1, run]);
        let region = Region { offset: vec![0, 0], extent: vec![1, run] };
        let (from, to) = (src + i * run, dst + (n - 1 - i) * run);
        table
            .add_offer(Offer {
                tensor,
                owner: me,
                addr: from,
                region: region.clone(),
                strides: None,
                digest: None,
            })
            .expect("offer");
        table
            .add_need(Need { tensor, receiver: me, addr: to, region, perm: None, strides: vec![run, 1] })
            .expect("need");
        out.push(Run { src: from, dst: to, len: run });
    }
}

/// The tables of one point and every run they move.
fn point(shape: Shape, run: u64, total: u64, src: u64, dst: u64, receivers: &[u64]) -> (Table, Vec<Run>) {
    let mut table = TableBuilder::new();
    let mut runs = Vec::new();
    let me = Endpoint { process: 0, device: 0 };
    match shape {
        Shape::Contiguous => reversed_rows(&mut table, "runs".into(), total / run, run, src, dst, &mut runs),
        Shape::Receivers => {
            let part = total / RECEIVERS;
            for (k, &to) in receivers.iter().enumerate() {
                let from = src + k as u64 * part;
                reversed_rows(&mut table, format!("part{k}"), part / run, run, from, to, &mut runs);
            }
        }
        Shape::Strided => {
            let rows = total / (2 * run);
            let tensor = byte_tensor(&mut table, "matrix".into(), vec![rows, 2 * run]);
            let whole = Region { offset: vec![0, 0], extent: vec![rows, 2 * run] };
            table
                .add_offer(Offer { tensor, owner: me, addr: src, region: whole, strides: None, digest: None })
                .expect("offer");
            for half in 0..2 {
                let to = dst + half * rows * run;
                let region = Region { offset: vec![0, half * run], extent: vec![rows, run] };
                table
                    .add_need(Need {
                        tensor,
                        receiver: me,
                        addr: to,
                        region,
                        perm: None,
                        strides: vec![run, 1],
                    })
                    .expect("need");
                for r in 0..rows {
                    runs.push(Run { src: src + r * 2 * run + half * run, dst: to + r * run, len: run });
                }
            }
        }
    }
    (table.into_table(), runs)
}

/// The table through the C API: encoded, decoded, planned (coalescing on, as callers plan).
fn plan_of(table: &Table) -> *mut refit_plan {
    let bytes = wire::encode(table);
    let mut decoded = std::ptr::null_mut();
    // SAFETY: readable bytes, writable slot.
    ok(unsafe { refit_table_decode(bytes.as_ptr(), bytes.len(), &mut decoded) }, "refit_table_decode");
    // SAFETY: all-zero then init.
    let mut options: refit_plan_options = unsafe { std::mem::zeroed() };
    ok(refit_plan_options_init(&mut options), "refit_plan_options_init");
    options.coalesce = true.into();
    let mut plan = std::ptr::null_mut();
    let tables = [decoded as *const refit_table];
    // SAFETY: a live table.
    ok(unsafe { refit_plan_build(tables.as_ptr(), 1, &options, &mut plan) }, "refit_plan_build");
    refit_table_destroy(decoded);
    plan
}

/// One arm's figures at one point.
struct ArmResult {
    ms: f64,
    /// The method that moved the local copies (REFIT_ARM_* code).
    method: u32,
    segments: u64,
}

/// Creates an executor of `arm`, checks one run of it, then times it (device time from RunStats).
fn measure_arm(
    machine: &Machine,
    plan: *mut refit_plan,
    arm: u32,
    runs: &[Run],
    dst: &[(u64, u64)],
    timing: (usize, usize),
    what: &str,
) -> ArmResult {
    // SAFETY: all-zero then init.
    let mut options: refit_executor_options = unsafe { std::mem::zeroed() };
    ok(refit_executor_options_init(&mut options), "refit_executor_options_init");
    options.arm = arm;
    let mut executor = std::ptr::null_mut();
    ok(refit_executor_create(plan, machine.group, 0, &options, &mut executor), "refit_executor_create");
    let run_once = || {
        let mut stats = RunStats::default();
        ok(refit_executor_run(executor, machine.group, &mut stats), "refit_executor_run");
        stats
    };
    for &(ptr, len) in dst {
        machine.poison(ptr, len);
    }
    let first = run_once();
    machine.check(runs, what);
    let (warm, reps) = timing;
    for _ in 0..warm {
        run_once();
    }
    let ms = median((0..reps).map(|_| run_once().device_ns as f64 / 1e6).collect());
    refit_executor_destroy(executor);
    ArmResult { ms, method: first.arm[REFIT_ROUTE_LOCAL as usize], segments: first.segments.iter().sum() }
}

fn method_name(code: u32) -> &'static str {
    match code {
        REFIT_ARM_KERNEL => "kernel",
        REFIT_ARM_COPY_ENGINE => "copy engine",
        REFIT_ARM_SPLIT => "split",
        REFIT_ARM_NONE => "none",
        _ => "?",
    }
}

struct Point {
    shape: Shape,
    run: u64,
    runs: usize,
    auto: ArmResult,
    kernel: ArmResult,
    copy_engine: ArmResult,
    ceiling_ms: f64,
    loop_ms: f64,
}

/// The smallest run size from which the copy-engine arm is at least as fast as the kernel arm at
/// every larger size measured (`points` of one shape, by run size); None if it is not at the largest.
fn crossover(points: &[&Point]) -> Option<u64> {
    let mut from = None;
    for p in points.iter().rev() {
        if p.copy_engine.ms > p.kernel.ms {
            break;
        }
        from = Some(p.run);
    }
    from
}

/// Run sizes at which neither fixed arm reaches 0.95 of one large copy (where only a split of the
/// runs between the copy engine and the kernel, or a better kernel, can meet issue 29's target).
fn short_of_ceiling(points: &[&Point], total: u64) -> Vec<u64> {
    points
        .iter()
        .filter(|p| gbps(total, p.kernel.ms.min(p.copy_engine.ms)) < 0.95 * gbps(total, p.ceiling_ms))
        .map(|p| p.run)
        .collect()
}

fn main() {
    let machine = Machine::new("gpu_sweep");
    let host = !machine.on_gpu;
    let total = env_u64("REFIT_SWEEP_BYTES").unwrap_or(if host { 4 * MIB } else { 4 * GIB });
    let mut sizes: Vec<u64> = match std::env::var("REFIT_SWEEP_SIZES") {
        Ok(list) => list
            .split(',')
            .map(|s| s.trim().parse().unwrap_or_else(|_| panic!("REFIT_SWEEP_SIZES: {s}")))
            .collect(),
        Err(_) => {
            let top = if host { MIB } else { GIB };
            std::iter::successors(Some(4 * KIB), |s| Some(s * 4)).take_while(|&s| s <= top).collect()
        }
    };
    sizes.sort_unstable();
    sizes.dedup();
    assert!(
        total % (RECEIVERS * BLOCK) == 0 && sizes.iter().all(|&s| s >= BLOCK && s % BLOCK == 0 && total % s == 0),
        "REFIT_SWEEP_BYTES ({total}) must be a multiple of {} and of every run size; run sizes multiples of {BLOCK}",
        RECEIVERS * BLOCK
    );
    let gpus = if host { 0 } else { cuda::device_count() };
    let device = machine.backend.device_name(0);
    println!(
        "gpu_sweep: {device} ({gpus} GPUs), {:.3} GiB of payload per point, runs of {:?} bytes; receivers: {RECEIVERS} buffers, all on device 0",
        total as f64 / GIB as f64,
        sizes
    );

    let src = machine.alloc(total);
    let dst = machine.alloc(total);
    let receivers: Vec<u64> = (0..RECEIVERS).map(|_| machine.alloc(total / RECEIVERS)).collect();
    machine.fill_distinct(src, total);
    machine.check_the_check(src, dst);

    let mut points = Vec::new();
    let shapes: Vec<Shape> = [Shape::Contiguous, Shape::Strided, Shape::Receivers]
        .into_iter()
        .filter(|s| {
            std::env::var("REFIT_SWEEP_SHAPES")
                .map_or(true, |list| list.split(',').any(|n| n.trim() == s.name()))
        })
        .collect();
    for shape in shapes {
        for &run in &sizes {
            if total < shape.min_total(run) || (shape == Shape::Strided && total % (2 * run) != 0) {
                println!("{} {run}: skipped (payload {total} too small for this shape)", shape.name());
                continue;
            }
            let started = Instant::now();
            let (table, runs) = point(shape, run, total, src, dst, &receivers);
            let plan = plan_of(&table);
            drop(table);
            let planned_s = started.elapsed().as_secs_f64();
            let dst_buffers: Vec<(u64, u64)> = if shape == Shape::Receivers {
                receivers.iter().map(|&r| (r, total / RECEIVERS)).collect()
            } else {
                vec![(dst, total)]
            };
            let timing = if runs.len() > MANY_RUNS { (0, 3) } else { (2, 10) };
            let what = |arm: &str| format!("{} runs of {run} bytes, {arm}", shape.name());
            let auto =
                measure_arm(&machine, plan, REFIT_ARM_AUTO, &runs, &dst_buffers, timing, &what("AUTO"));
            let kernel =
                measure_arm(&machine, plan, REFIT_ARM_KERNEL, &runs, &dst_buffers, timing, &what("KERNEL"));
            let copy_engine = measure_arm(
                &machine,
                plan,
                REFIT_ARM_COPY_ENGINE,
                &runs,
                &dst_buffers,
                timing,
                &what("COPY_ENGINE"),
            );
            refit_plan_destroy(plan);

            // The plain peer: one cuMemcpyAsync per run, checked then timed.
            for &(ptr, len) in &dst_buffers {
                machine.poison(ptr, len);
            }
            machine.in_context(|| machine.time_ms(0, 1, |stream| machine.copy_runs(stream, &runs)));
            machine.check(&runs, &what("per-run cuMemcpyAsync loop"));
            let loop_ms = machine.in_context(|| {
                machine.time_ms(timing.0, timing.1, |stream| machine.copy_runs(stream, &runs))
            });
            // The ceiling: one copy of the same bytes.
            let ceiling_ms = machine
                .in_context(|| machine.time_ms(2, 10, |stream| machine.copy_one(stream, src, dst, total)));
            println!(
                "{} runs of {run} B x {}: checked; AUTO {} {:.3} ms, KERNEL {:.3}, COPY_ENGINE {:.3}, loop {:.3}, ceiling {:.3} ({:.1} s incl. planning {planned_s:.1} s)",
                shape.name(),
                runs.len(),
                method_name(auto.method),
                auto.ms,
                kernel.ms,
                copy_engine.ms,
                loop_ms,
                ceiling_ms,
                started.elapsed().as_secs_f64()
            );
            points.push(Point {
                shape,
                run,
                runs: runs.len(),
                auto,
                kernel,
                copy_engine,
                ceiling_ms,
                loop_ms,
            });
        }
    }
    for r in receivers {
        machine.free(r);
    }
    machine.free(src);
    machine.free(dst);

    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).expect("results directory");
    let arm_json = |a: &ArmResult| {
        format!(
            "{{\"device_ms\": {:.5}, \"gbps\": {:.2}, \"method\": \"{}\", \"segments\": {}}}",
            a.ms,
            gbps(total, a.ms),
            method_name(a.method),
            a.segments
        )
    };
    let rows: Vec<String> = points
        .iter()
        .map(|p| {
            let (auto, ceiling, peer) = (gbps(total, p.auto.ms), gbps(total, p.ceiling_ms), gbps(total, p.loop_ms));
            format!(
                "    {{\"shape\": \"{}\", \"run_bytes\": {}, \"runs\": {}, \"checked\": true, \"auto\": {}, \"kernel\": {}, \
                 \"copy_engine\": {}, \"ceiling\": {{\"device_ms\": {:.5}, \"gbps\": {ceiling:.2}}}, \
                 \"per_run_loop\": {{\"device_ms\": {:.5}, \"gbps\": {peer:.2}}}, \"auto_vs_ceiling\": {:.4}, \
                 \"auto_vs_per_run_loop\": {:.4}, \"copy_engine_vs_per_run_loop\": {:.4}}}",
                p.shape.name(),
                p.run,
                p.runs,
                arm_json(&p.auto),
                arm_json(&p.kernel),
                arm_json(&p.copy_engine),
                p.ceiling_ms,
                p.loop_ms,
                auto / ceiling,
                auto / peer,
                gbps(total, p.copy_engine.ms) / peer
            )
        })
        .collect();
    let derived: Vec<(Shape, Option<u64>, Vec<u64>)> = [Shape::Contiguous, Shape::Strided, Shape::Receivers]
        .into_iter()
        .filter(|&shape| points.iter().any(|p| p.shape == shape))
        .map(|shape| {
            let mine: Vec<&Point> = points.iter().filter(|p| p.shape == shape).collect();
            (shape, crossover(&mine), short_of_ceiling(&mine, total))
        })
        .collect();
    let derived_json: Vec<String> = derived
        .iter()
        .map(|(shape, cross, short)| {
            format!(
                "    \"{}\": {{\"copy_engine_from_run_bytes\": {}, \"neither_arm_reaches_0_95_at_run_bytes\": {:?}}}",
                shape.name(),
                cross.map_or("null".to_string(), |c| c.to_string()),
                short
            )
        })
        .collect();
    let json = format!(
        "{{\n  \"bench\": \"gpu_sweep\",\n  \"backend\": \"{}\",\n  \"device\": \"{}\",\n  \"gpus\": {gpus},\n  \
         \"payload_bytes\": {total},\n  \"receivers\": {RECEIVERS},\n  \"receivers_note\": \"all receivers are device 0 of one GPU: separate allocations, local routes\",\n  \
         \"timing\": \"executor: RunStats device_ns; ceiling and per-run loop: CUDA events; medians (3 timed runs above {MANY_RUNS} runs, else 10 after 2 warm-up)\",\n  \
         \"derived\": {{\n{}\n  }},\n  \"points\": [\n{}\n  ]\n}}\n",
        if host { "host" } else { "cuda" },
        device.replace('"', "'"),
        derived_json.join(",\n"),
        rows.join(",\n")
    );
    let path = format!("{dir}/gpu_sweep.json");
    std::fs::write(&path, json).expect("writing results");
    println!("\nwrote {path}");

    println!("\n| shape | COPY_ENGINE at least as fast as KERNEL from runs of | run sizes where neither arm reaches 0.95 of one large copy |");
    println!("|---|---|---|");
    for (shape, cross, short) in &derived {
        let cross = cross.map_or("never".to_string(), |c| format!("{c} B"));
        println!("| {} | {cross} | {short:?} |", shape.name());
    }
    println!(
        "\nGB/s of payload ({} MiB per point; every point checked byte-exact by a digest of every run)\n",
        total / MIB
    );
    println!("| shape | run | runs | AUTO (method) | KERNEL | COPY_ENGINE | per-run cuMemcpyAsync | one large copy | AUTO / ceiling | AUTO / per-run loop | CE / per-run loop |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &points {
        let (auto, ceiling, peer) =
            (gbps(total, p.auto.ms), gbps(total, p.ceiling_ms), gbps(total, p.loop_ms));
        let size = if p.run >= GIB {
            format!("{} GiB", p.run / GIB)
        } else if p.run >= MIB {
            format!("{} MiB", p.run / MIB)
        } else {
            format!("{} KiB", p.run / KIB)
        };
        println!(
            "| {} | {size} | {} | {auto:.0} ({}) | {:.0} | {:.0} | {peer:.0} | {ceiling:.0} | {:.3} | {:.3} | {:.3} |",
            p.shape.name(),
            p.runs,
            method_name(p.auto.method),
            gbps(total, p.kernel.ms),
            gbps(total, p.copy_engine.ms),
            auto / ceiling,
            auto / peer,
            gbps(total, p.copy_engine.ms) / peer
        );
    }
    refit_group_destroy(machine.group);
}
