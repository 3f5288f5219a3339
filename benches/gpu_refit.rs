//! The executor through the C ABI (issue 15) on one GPU: the demo's Qwen3-30B-A3B tables (Megatron
//! EP1 publishers -> vLLM TP1 receivers, colocated on device 0, all 48 layers, BF16), with in the
//! same run:
//! - the refit step (REFIT_ARM_AUTO, direct) against one large device copy of the same number of
//!   bytes (the ceiling);
//! - host time of a repeated run (inside a scope: queued, not waited for) of synthetic plans of 10^2
//!   and 10^6 segments;
//! - the step with verify (its overhead), and the commit of a staged step against the ceiling.
//!
//! Publisher and receiver buffers are carved out of two arenas (one allocation each). The bench also
//! writes the tables with arena-relative addresses and their layout to the temporary directory
//! (`refit_bench_tables.bin`, `refit_bench_layout.json`) for benches/refit_peer.py, which runs torch's
//! per-slice `copy_` and `_foreach_copy_` on the same slices and the GEMM overlap curve.
//!
//! Device times are the executor's own stamps (RunStats), medians after warm-up; the ceiling
//! is CUDA-event timed. Prints markdown tables; writes $REFIT_BENCH_RESULTS/gpu_refit.json.
//! REFIT_BENCH_LAYERS (default 48) and REFIT_BENCH_HOST=1 (the host backend, for a smoke run without
//! a GPU) shrink or move it.

#[path = "../tests/common/cuda.rs"]
mod cuda;
#[path = "machine_support/mod.rs"]
mod machine_support;

use machine_support::{median, ok, Machine};

use refit::exec::RunStats;
use refit::ffi::exec::*;
use refit::ffi::group::*;
use refit::ffi::plan::*;
use refit::ffi::status::refit_last_error_message;
use refit::plan::builder::TableBuilder;
use refit::plan::{wire, Endpoint, Need, Offer, Region, Table, TensorSpec};
use refit::transport::Stream;
use refit::{Segment, Status};
use refit_workloads::{Megatron, Model, Packing, Role, Spec, Vllm, Workload};
use std::ffi::{c_void, CStr};
use std::time::Instant;

const ALIGN: u64 = 256;
const POISON: u8 = 0xAB;

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn gbps(bytes: u64, ns: f64) -> f64 {
    bytes as f64 / ns
}

fn stats() -> RunStats {
    RunStats::default()
}

impl Machine {
    /// Sets `len` bytes at `ptr` to `byte` (synchronously).
    fn memset(&self, ptr: u64, byte: u8, len: u64) {
        if self.on_gpu {
            cuda::on(0, || {
                // SAFETY: device memory of this bench.
                refit::transport::driver::check("cuMemsetD8", unsafe {
                    cudarc::driver::sys::cuMemsetD8_v2(ptr, byte, len as usize)
                })
                .expect("cuMemsetD8");
                cuda::sync_device(0);
            });
        } else {
            // SAFETY: host memory of this bench.
            unsafe { std::ptr::write_bytes(ptr as usize as *mut u8, byte, len as usize) };
        }
    }

    /// Fills `len` bytes at `ptr` with the 4-byte word `word` (synchronously).
    fn fill_words(&self, ptr: u64, word: u32, len: u64) {
        if self.on_gpu {
            cuda::on(0, || {
                // SAFETY: device memory of this bench; `len` is a multiple of 4 (buffers are).
                refit::transport::driver::check("cuMemsetD32", unsafe {
                    cudarc::driver::sys::cuMemsetD32_v2(ptr, word, len as usize / 4)
                })
                .expect("cuMemsetD32");
            });
        } else {
            // SAFETY: host memory of this bench.
            let words = unsafe { std::slice::from_raw_parts_mut(ptr as usize as *mut u32, len as usize / 4) };
            words.fill(word);
        }
    }

    fn read(&self, ptr: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: memory of this bench.
        unsafe { self.backend.read(0, ptr, &mut out) }.expect("read");
        out
    }

    /// Milliseconds of one copy of `len` bytes (CUDA events on GPU), median of `reps` after a warm-up.
    fn copy_ms(&self, src: u64, dst: u64, len: u64, reps: usize) -> f64 {
        let segment = [Segment::contiguous(src, dst, len)];
        if self.on_gpu {
            let stream = cuda::Stream::new(0);
            let timer = cuda::Timer::new(0);
            let copy = || {
                unsafe { self.backend.copy_segments(0, Stream(stream.raw as usize as u64), &segment) }
                    .expect("copy")
            };
            copy();
            stream.sync();
            median(
                (0..reps)
                    .map(|_| {
                        timer.start(&stream);
                        copy();
                        timer.stop(&stream)
                    })
                    .collect(),
            )
        } else {
            median(
                (0..reps)
                    .map(|_| {
                        let t = Instant::now();
                        // SAFETY: host memory of this bench.
                        unsafe { self.backend.copy_segments(0, Stream::NULL, &segment) }.expect("copy");
                        self.backend.sync_stream(0, Stream::NULL).expect("sync");
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect(),
            )
        }
    }
}

/// Tables through the C API: encoded, decoded, planned.
fn plan_of(tables: &[Table], coalesce: bool) -> *mut refit_plan {
    let mut decoded = Vec::new();
    for table in tables {
        let bytes = wire::encode(table);
        let mut handle = std::ptr::null_mut();
        // SAFETY: readable bytes, writable slot.
        ok(unsafe { refit_table_decode(bytes.as_ptr(), bytes.len(), &mut handle) }, "refit_table_decode");
        decoded.push(handle as *const refit_table);
    }
    // SAFETY: all-zero then init.
    let mut options: refit_plan_options = unsafe { std::mem::zeroed() };
    ok(refit_plan_options_init(&mut options), "refit_plan_options_init");
    options.coalesce = coalesce.into();
    let mut plan = std::ptr::null_mut();
    // SAFETY: live tables.
    ok(unsafe { refit_plan_build(decoded.as_ptr(), decoded.len(), &options, &mut plan) }, "refit_plan_build");
    for table in decoded {
        refit_table_destroy(table as *mut refit_table);
    }
    plan
}

fn executor(
    machine: &Machine,
    plan: *mut refit_plan,
    set: impl FnOnce(&mut refit_executor_options),
) -> Result<*mut refit_executor, String> {
    // SAFETY: all-zero then init.
    let mut options: refit_executor_options = unsafe { std::mem::zeroed() };
    ok(refit_executor_options_init(&mut options), "refit_executor_options_init");
    set(&mut options);
    let mut executor = std::ptr::null_mut();
    let status = refit_executor_create(plan, machine.group, 0, &options, &mut executor);
    if status != Status::Success {
        // SAFETY: the library's message.
        let message = unsafe { CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned();
        return Err(format!("{}: {message}", status.name().to_string_lossy()));
    }
    Ok(executor)
}

/// Host milliseconds `executor`'s creation spent checking the plan's addresses against the
/// device's allocations (refit_executor_get_info).
fn address_check_ms(executor: *mut refit_executor) -> f64 {
    // SAFETY: all-zero, then the size set.
    let mut info: refit_executor_info = unsafe { std::mem::zeroed() };
    info.size = std::mem::size_of::<refit_executor_info>();
    ok(refit_executor_get_info(executor, &mut info), "refit_executor_get_info");
    info.address_check_ns as f64 / 1e6
}

/// Runs `executor` `warm` + `reps` times outside a scope; the stats of the timed runs.
fn runs(
    machine: &Machine,
    executor: *mut refit_executor,
    commit: bool,
    warm: usize,
    reps: usize,
) -> Vec<(RunStats, RunStats)> {
    (0..warm + reps)
        .map(|_| {
            let (mut ran, mut committed) = (stats(), stats());
            ok(refit_executor_run(executor, machine.group, &mut ran), "refit_executor_run");
            if commit {
                ok(refit_executor_commit(executor, machine.group, &mut committed), "refit_executor_commit");
            }
            (ran, committed)
        })
        .skip(warm)
        .collect()
}

/// The demo's workload on one device, its buffers carved from two arenas (publishers, receivers).
struct Arenas {
    workload: Workload,
    /// Offset of each buffer in its role's arena.
    offsets: Vec<u64>,
    publisher_bytes: u64,
    receiver_bytes: u64,
}

impl Arenas {
    fn new(layers: u64) -> Arenas {
        let endpoints = vec![Endpoint { process: 0, device: 0 }];
        let spec = Spec {
            model: Model::qwen3_30b_a3b().with_layers(layers),
            publishers: Megatron { endpoints: endpoints.clone(), tp: 1, ep: 1, grouped_experts: true },
            publisher_layout: Packing::Separate,
            receivers: Vllm { endpoints },
            receiver_layout: Packing::Separate,
            digests: true,
        };
        let workload = Workload::generate(&spec).expect("workload");
        let (mut publisher_bytes, mut receiver_bytes) = (0u64, 0u64);
        let offsets = workload
            .buffers
            .iter()
            .map(|b| {
                let cursor =
                    if b.role == Role::Publisher { &mut publisher_bytes } else { &mut receiver_bytes };
                let at = *cursor;
                *cursor = (at + b.bytes).next_multiple_of(ALIGN);
                at
            })
            .collect();
        Arenas { workload, offsets, publisher_bytes, receiver_bytes }
    }

    fn bases(&self, publishers: u64, receivers: u64) -> Vec<u64> {
        self.workload
            .buffers
            .iter()
            .zip(&self.offsets)
            .map(|(b, &o)| o + if b.role == Role::Publisher { publishers } else { receivers })
            .collect()
    }
}

/// A plan of `n` segments of 128 bytes: row i of a [n, 64] BF16 tensor to every other 128-byte slot
/// of a destination, uncoalesced (`src`, `dst`: 128n and 256n bytes).
fn synthetic_tables(n: u64, src: u64, dst: u64) -> Vec<Table> {
    let mut table = TableBuilder::new();
    let t = table
        .add_tensor(TensorSpec { name: "rows".into(), dtype: 2, elem_size: 2, shape: vec![n, 64] })
        .expect("tensor");
    let owner = Endpoint { process: 0, device: 0 };
    let region = Region { offset: vec![0, 0], extent: vec![n, 64] };
    table
        .add_offer(Offer { tensor: t, owner, addr: src, region, strides: None, digest: None })
        .expect("offer");
    for i in 0..n {
        let region = Region { offset: vec![i, 0], extent: vec![1, 64] };
        let need = Need {
            tensor: t,
            receiver: owner,
            addr: dst + 256 * i,
            region,
            perm: None,
            strides: vec![64, 1],
        };
        table.add_need(need).expect("need");
    }
    vec![table.into_table()]
}

/// Host time of repeated runs of an `n`-segment plan queued in a scope: (median enqueue us, p90
/// enqueue us, median call us, segments).
fn host_time(machine: &Machine, n: u64) -> (f64, f64, f64, u64, (f64, f64)) {
    let (src, dst) = (machine.alloc(128 * n), machine.alloc(256 * n));
    let plan = plan_of(&synthetic_tables(n, src, dst), false);
    let creating = Instant::now();
    let executor = executor(machine, plan, |o| o.arm = REFIT_ARM_KERNEL).expect("executor");
    let create = (creating.elapsed().as_secs_f64() * 1e3, address_check_ms(executor));
    let caller: *mut c_void = if machine.on_gpu {
        machine.backend.create_stream(0).expect("stream").as_ptr()
    } else {
        let mut s = std::ptr::null_mut();
        ok(refit_host_stream_create(&mut s), "refit_host_stream_create");
        s
    };
    let (mut enqueue, mut call) = (Vec::new(), Vec::new());
    let mut segments = 0;
    for i in 0..230 {
        ok(refit_group_enter(machine.group, [caller].as_ptr()), "refit_group_enter");
        let mut s = stats();
        let t = Instant::now();
        ok(refit_executor_run(executor, machine.group, &mut s), "refit_executor_run");
        let us = t.elapsed().as_secs_f64() * 1e6;
        ok(refit_group_exit(machine.group, REFIT_EXIT_ASYNC), "refit_group_exit");
        if i % 10 == 9 {
            machine.backend.sync_stream(0, Stream::from_ptr(caller)).expect("sync");
        }
        if i >= 30 {
            enqueue.push(s.enqueue_ns as f64 / 1e3);
            call.push(us);
        }
        segments = s.segments[0];
    }
    machine.backend.sync_stream(0, Stream::from_ptr(caller)).expect("sync");
    refit_executor_destroy(executor);
    refit_plan_destroy(plan);
    if machine.on_gpu {
        machine.backend.destroy_stream(0, Stream::from_ptr(caller));
    } else {
        ok(refit_host_stream_destroy(caller), "refit_host_stream_destroy");
    }
    machine.free(src);
    machine.free(dst);
    (median(enqueue.clone()), percentile(enqueue, 0.9), median(call), segments, create)
}

/// Spot-checks that the first run of sampled segments of the plan landed (destination = source).
fn spot_check(machine: &Machine, plan: *mut refit_plan) {
    let mut count = 0usize;
    // SAFETY: a live plan.
    ok(unsafe { refit_plan_route_count(plan, &mut count) }, "refit_plan_route_count");
    let mut checked = 0;
    for r in 0..count {
        // SAFETY: all-zero then size set.
        let mut route: refit_route_info = unsafe { std::mem::zeroed() };
        route.size = std::mem::size_of::<refit_route_info>();
        // SAFETY: a live plan.
        ok(unsafe { refit_plan_route(plan, r, &mut route) }, "refit_plan_route");
        // SAFETY: valid until the plan is destroyed.
        let segments = unsafe { std::slice::from_raw_parts(route.segments, route.segment_count) };
        for s in segments.iter().take(8) {
            println!(
                "  route {r}: {} bytes in runs of {} x {:?}, strides {:?} / {:?}",
                s.bytes().unwrap_or(0),
                s.len,
                s.count,
                s.src_stride,
                s.dst_stride
            );
        }
        for s in segments.iter().step_by((segments.len() / 40).max(1)) {
            let len = s.len.min(1 << 20) as usize;
            assert!(machine.read(s.src, len) == machine.read(s.dst, len), "segment {s:?} did not land");
            checked += 1;
        }
    }
    println!("spot check: {checked} sampled segments landed byte-exact");
}

fn main() {
    let machine = Machine::new("gpu_refit");
    let layers: u64 = std::env::var("REFIT_BENCH_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(48);
    let arenas = Arenas::new(layers);
    println!(
        "gpu_refit: Qwen3-30B-A3B, {layers} of 48 layers, EP1 -> TP1 colocated on one device ({}); arenas {:.2} + {:.2} GiB",
        machine.backend.device_name(0),
        arenas.publisher_bytes as f64 / (1u64 << 30) as f64,
        arenas.receiver_bytes as f64 / (1u64 << 30) as f64
    );
    let publishers = machine.alloc(arenas.publisher_bytes);
    let receivers = machine.alloc(arenas.receiver_bytes);
    let bases = arenas.bases(publishers, receivers);
    for (b, buffer) in arenas.workload.buffers.iter().enumerate() {
        if buffer.role == Role::Publisher {
            machine.fill_words(bases[b], 0x0100_0193u32.wrapping_mul(b as u32 + 1), buffer.bytes / 4 * 4);
        }
    }
    let tables = arenas.workload.tables(&bases).expect("tables");
    let plan = plan_of(&tables, true);

    // For benches/refit_peer.py: the same tables at arena-relative addresses (fake arena bases).
    let (fake_publishers, fake_receivers) = (1u64 << 44, 1u64 << 45);
    let relative = arenas.workload.tables(&arenas.bases(fake_publishers, fake_receivers)).expect("tables");
    let mut blob = Vec::new();
    for table in &relative {
        let bytes = wire::encode(table);
        blob.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        blob.extend_from_slice(&bytes);
    }
    let temp = std::env::temp_dir();
    std::fs::write(temp.join("refit_bench_tables.bin"), &blob).expect("writing tables");
    let publisher_buffers: Vec<String> = arenas
        .workload
        .buffers
        .iter()
        .zip(&arenas.offsets)
        .filter(|(b, _)| b.role == Role::Publisher)
        .map(|(b, o)| format!("[{o}, {}]", b.bytes))
        .collect();
    let layout = format!(
        "{{\"layers\": {layers}, \"publisher_arena\": {}, \"receiver_arena\": {}, \"fake_publisher_base\": {fake_publishers}, \
         \"fake_receiver_base\": {fake_receivers}, \"publisher_buffers\": [{}]}}\n",
        arenas.publisher_bytes,
        arenas.receiver_bytes,
        publisher_buffers.join(", ")
    );
    std::fs::write(temp.join("refit_bench_layout.json"), layout).expect("writing layout");

    // The refit step, direct, AUTO.
    let creating = Instant::now();
    let direct = executor(&machine, plan, |_| {}).expect("executor");
    let create_ms = creating.elapsed().as_secs_f64() * 1e3;
    let check_ms = address_check_ms(direct);
    machine.memset(receivers, POISON, arenas.receiver_bytes);
    let steps = runs(&machine, direct, false, 2, 10);
    spot_check(&machine, plan);
    let payload: u64 = steps[0].0.bytes.iter().sum();
    let step_ns = median(steps.iter().map(|(s, _)| s.device_ns as f64).collect());
    let step_wall_ns = median(steps.iter().map(|(s, _)| s.wall_ns as f64).collect());
    let segments: u64 = steps[0].0.segments.iter().sum();
    let auto_arm = steps[0].0.arm[0];
    refit_executor_destroy(direct);

    // The same step by each fixed arm, beside AUTO's choice (which may split the runs between them).
    let by_arm: Vec<(&str, f64)> =
        [("REFIT_ARM_KERNEL", REFIT_ARM_KERNEL), ("REFIT_ARM_COPY_ENGINE", REFIT_ARM_COPY_ENGINE)]
            .into_iter()
            .map(|(name, arm)| {
                let fixed = executor(&machine, plan, |o| o.arm = arm).expect("executor");
                let steps = runs(&machine, fixed, false, 1, 5);
                refit_executor_destroy(fixed);
                (name, median(steps.iter().map(|(s, _)| s.device_ns as f64).collect()))
            })
            .collect();

    // The ceiling: one copy of the same number of bytes, publisher arena to receiver arena.
    let ceiling_ms = machine.copy_ms(publishers, receivers, payload, 5);
    let ceiling = gbps(payload, ceiling_ms * 1e6);

    // Verify (needs the device verify primitive).
    let verify = executor(&machine, plan, |o| o.verify = true).map(|verifying| {
        let steps = runs(&machine, verifying, false, 1, 5);
        refit_executor_destroy(verifying);
        (
            median(steps.iter().map(|(s, _)| s.device_ns as f64).collect()),
            median(steps.iter().map(|(s, _)| s.verify_ns as f64).collect()),
        )
    });

    // A staged step: run into staging (bounded), commit the last slice.
    let staging: u64 =
        std::env::var("REFIT_BENCH_STAGING_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(8192) << 20;
    let staged = executor(&machine, plan, |o| {
        o.commit = REFIT_COMMIT_STAGED;
        o.staging_limit = staging;
    })
    .expect("staged executor");
    let staged_steps = runs(&machine, staged, true, 1, 3);
    refit_executor_destroy(staged);
    let slices = staged_steps[0].0.slices;
    let commit_bytes = staged_steps[0].1.installed_bytes;
    let commit_ns = median(staged_steps.iter().map(|(_, c)| c.commit_ns as f64).collect());
    let commit_wall_ns = median(staged_steps.iter().map(|(_, c)| c.wall_ns as f64).collect());
    let staged_run_ns = median(staged_steps.iter().map(|(r, _)| r.device_ns as f64).collect());
    // The ceiling at the commit's size.
    let commit_ceiling = gbps(commit_bytes, machine.copy_ms(publishers, receivers, commit_bytes, 5) * 1e6);
    refit_plan_destroy(plan);
    machine.free(publishers);
    machine.free(receivers);

    let small = host_time(&machine, 100);
    let large = host_time(&machine, 1_000_000);

    let ours = gbps(payload, step_ns);
    println!("\n| what | bytes | segments | device ms | GB/s of payload | vs one large copy |");
    println!("|---|---|---|---|---|---|");
    println!("| one large copy (ceiling) | {payload} | 1 | {ceiling_ms:.2} | {ceiling:.0} | 1.00 |");
    println!(
        "| refit step through the C ABI (AUTO: {}, direct; wall {:.2} ms) | {payload} | {segments} | {:.2} | {ours:.0} | {:.3} |",
        ["-", "kernel", "copy engine", "-", "split"].get(auto_arm as usize).unwrap_or(&"?"),
        step_wall_ns / 1e6,
        step_ns / 1e6,
        ours / ceiling
    );
    for (name, ns) in &by_arm {
        println!(
            "| refit step, {name} | {payload} | {segments} | {:.2} | {:.0} | {:.3} |",
            ns / 1e6,
            gbps(payload, *ns),
            gbps(payload, *ns) / ceiling
        );
    }
    match &verify {
        Ok((total, stage)) => println!(
            "| refit step with verify (verify stage {:.2} ms) | {payload} | {segments} | {:.2} | {:.0} | {:.3} (+{:.0}% over the step) |",
            stage / 1e6,
            total / 1e6,
            gbps(payload, *total),
            gbps(payload, *total) / ceiling,
            100.0 * (total / step_ns - 1.0)
        ),
        Err(why) => println!("| refit step with verify | - | - | - | - | not available: {why} |"),
    }
    println!(
        "| staged step: run into {} MiB of staging ({slices} slices, the run installs all but the last) | {payload} | {segments} | {:.2} | {:.0} | - |",
        staging >> 20,
        staged_run_ns / 1e6,
        gbps(payload, staged_run_ns)
    );
    println!(
        "| commit of the staged last slice (wall {:.2} ms) | {commit_bytes} | - | {:.2} | {:.0} | {:.3} (ceiling at this size {commit_ceiling:.0}) |",
        commit_wall_ns / 1e6,
        commit_ns / 1e6,
        gbps(commit_bytes, commit_ns),
        gbps(commit_bytes, commit_ns) / commit_ceiling
    );
    println!("\n| repeated run, queued in a scope | segments | host enqueue us (median) | p90 | whole call us (median) |");
    println!("|---|---|---|---|---|");
    for (enqueue, p90, call, n, _) in [small, large] {
        println!("| 128-byte rows, uncoalesced | {n} | {enqueue:.2} | {p90:.2} | {call:.2} |");
    }
    println!("\n| executor creation (paid once) | segments | create ms | of which address check ms |");
    println!("|---|---|---|---|");
    println!("| the demo's plan, direct AUTO | {segments} | {create_ms:.3} | {check_ms:.3} |");
    for (_, _, _, n, (create, check)) in [small, large] {
        println!("| 128-byte rows, uncoalesced, kernel | {n} | {create:.3} | {check:.3} |");
    }

    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).expect("results directory");
    let verify_json = match &verify {
        Ok((total, stage)) => format!(
            "{{\"device_ms\": {:.4}, \"verify_stage_ms\": {:.4}, \"overhead\": {:.4}}}",
            total / 1e6,
            stage / 1e6,
            total / step_ns - 1.0
        ),
        Err(why) => format!("{{\"unavailable\": \"{}\"}}", why.replace('"', "'")),
    };
    let (rows_create_ms, rows_check_ms) = large.4;
    let json = format!(
        "{{\n  \"bench\": \"gpu_refit\",\n  \"device\": \"{}\",\n  \"layers\": {layers},\n  \"payload_bytes\": {payload},\n  \
         \"segments\": {segments},\n  \"ceiling\": {{\"device_ms\": {ceiling_ms:.4}, \"gbps\": {ceiling:.2}}},\n  \
         \"step\": {{\"device_ms\": {:.4}, \"wall_ms\": {:.4}, \"gbps\": {ours:.2}, \"vs_ceiling\": {:.4}, \"arm\": {auto_arm}}},\n  \
         \"step_by_arm\": {{\"kernel_ms\": {:.4}, \"copy_engine_ms\": {:.4}}},\n  \
         \"verify\": {verify_json},\n  \
         \"create\": {{\"create_ms\": {create_ms:.4}, \"address_check_ms\": {check_ms:.4}, \
         \"rows_1e6_create_ms\": {rows_create_ms:.4}, \"rows_1e6_address_check_ms\": {rows_check_ms:.4}}},\n  \
         \"staged\": {{\"staging_bytes\": {staging}, \"slices\": {slices}, \"run_device_ms\": {:.4}, \"commit_bytes\": {commit_bytes}, \
         \"commit_device_ms\": {:.4}, \"commit_wall_ms\": {:.4}, \"commit_gbps\": {:.2}, \"ceiling_gbps_at_commit_size\": {commit_ceiling:.2}}},\n  \
         \"host_enqueue_us\": [\n    {{\"segments\": {}, \"median\": {:.3}, \"p90\": {:.3}, \"call_median\": {:.3}}},\n    \
         {{\"segments\": {}, \"median\": {:.3}, \"p90\": {:.3}, \"call_median\": {:.3}}}\n  ]\n}}\n",
        machine.backend.device_name(0),
        step_ns / 1e6,
        step_wall_ns / 1e6,
        ours / ceiling,
        by_arm[0].1 / 1e6,
        by_arm[1].1 / 1e6,
        staged_run_ns / 1e6,
        commit_ns / 1e6,
        commit_wall_ns / 1e6,
        gbps(commit_bytes, commit_ns),
        small.3,
        small.0,
        small.1,
        small.2,
        large.3,
        large.0,
        large.1,
        large.2,
    );
    let path = format!("{dir}/gpu_refit.json");
    std::fs::write(&path, json).expect("writing results");
    println!("\nwrote {path}");
    refit_group_destroy(machine.group);
}
