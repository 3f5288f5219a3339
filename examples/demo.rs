//! The main job: plan and execute a colocated Qwen3-30B-A3B weight refit.
//!
//! Megatron-style publishers (expert parallel over the devices, every device holding a replica of the
//! non-expert weights) refit vLLM-style tensor-parallel receivers on the same devices, one process.
//! On GPUs when CUDA is present (two devices: the CEILINGS.md colocated case), else on the host
//! backend with simulated devices. Every publisher byte is a known function of (tensor, element), so
//! after each arm every received element is checked.
//!
//!     cargo run --release --example demo [-- --layers N --layout separate|packed --steps K --devices G --reference]
//!
//! `--reference` also runs the per-run arm (one copy call per contiguous run: the copy engine on CUDA),
//! which must install the same bytes.

use refit::exec::{Arm, Executor, StageTimes};
use refit::group::{Group, GroupOptions};
use refit::plan::{self, Endpoint, PlanOptions};
use refit::transport::Backend;
use refit_workloads::{element_value, Megatron, Model, Packing, Role, Spec, Vllm, Workload};
use std::sync::Arc;
use std::time::Instant;

struct Args {
    layers: Option<u64>,
    layout: Packing,
    steps: usize,
    devices: usize,
    /// Also run the per-run reference arm (one copy call per contiguous run).
    reference: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { layers: None, layout: Packing::Separate, steps: 5, devices: 2, reference: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--layers" => args.layers = Some(value()?.parse().map_err(|e| format!("--layers: {e}"))?),
            "--steps" => args.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--devices" => args.devices = value()?.parse().map_err(|e| format!("--devices: {e}"))?,
            "--reference" => args.reference = true,
            "--layout" => {
                args.layout = match value()?.as_str() {
                    "separate" => Packing::Separate,
                    "packed" => Packing::Packed,
                    other => return Err(format!("--layout: {other} is not separate or packed")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// A raw pointer that worker threads may share: each writes or reads a disjoint part.
#[derive(Clone, Copy)]
struct SharedPtr(*mut u8);
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(32)
}

/// Writes the low `es` bytes of `value`, little-endian (BF16 and friends take the fast path).
///
/// # Safety
/// `dst .. dst + es` must be writable.
#[inline(always)]
unsafe fn write_element(dst: *mut u8, value: u64, es: usize) {
    match es {
        2 => dst.cast::<u16>().write_unaligned(value as u16),
        4 => dst.cast::<u32>().write_unaligned(value as u32),
        _ => std::ptr::copy_nonoverlapping(value.to_le_bytes().as_ptr(), dst, es.min(8)),
    }
}

/// The element at `bytes` (at most 8 bytes), little-endian.
#[inline(always)]
/// The CUDA ordinal of a plan endpoint's device.
fn ordinal(device: u32) -> i32 {
    i32::try_from(device).expect("a plan device is a CUDA ordinal")
}

fn read_element(bytes: &[u8]) -> u64 {
    match bytes.len() {
        2 => u16::from_le_bytes([bytes[0], bytes[1]]) as u64,
        _ => {
            let mut value = [0u8; 8];
            value[..bytes.len().min(8)].copy_from_slice(&bytes[..bytes.len().min(8)]);
            u64::from_le_bytes(value)
        }
    }
}

/// For each buffer of `role`, the indices of the boxes (offers or needs) placed in it.
fn boxes_by_buffer(workload: &Workload, role: Role) -> Vec<Vec<usize>> {
    let mut by_buffer = vec![Vec::new(); workload.buffers.len()];
    let placed = if role == Role::Publisher { &workload.offers } else { &workload.needs };
    for (i, p) in placed.iter().enumerate() {
        by_buffer[p.buffer as usize].push(i);
    }
    by_buffer
}

/// Fills every publisher buffer with its boxes' known values.
fn fill_publishers(workload: &Workload, backend: &Arc<dyn Backend>, bases: &[u64]) -> Result<(), String> {
    let by_buffer = boxes_by_buffer(workload, Role::Publisher);
    for (b, buffer) in workload.buffers.iter().enumerate().filter(|(_, b)| b.role == Role::Publisher) {
        let mut bytes = vec![0u8; buffer.bytes as usize];
        let ptr = SharedPtr(bytes.as_mut_ptr());
        let offers = &by_buffer[b];
        std::thread::scope(|s| {
            for chunk in offers.chunks(offers.len().div_ceil(threads()).max(1)) {
                s.spawn(move || {
                    let ptr = ptr;
                    for &i in chunk {
                        let o = &workload.offers[i];
                        let es = workload.catalog.tensors[o.tensor as usize].elem_size as usize;
                        workload.for_each_element(o, |at, g| {
                            let value = element_value(o.tensor, g);
                            // SAFETY: offers in one buffer are disjoint boxes inside it.
                            unsafe { write_element(ptr.0.add(at as usize), value, es) };
                        });
                    }
                });
            }
        });
        // SAFETY: bases[b] was allocated with buffer.bytes on this device.
        unsafe { backend.write(ordinal(buffer.endpoint.device), bases[b], &bytes) }
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Overwrites every receiver buffer with a poison byte, so that a byte the refit misses is seen.
fn poison_receivers(workload: &Workload, backend: &Arc<dyn Backend>, bases: &[u64]) -> Result<(), String> {
    for (b, buffer) in workload.buffers.iter().enumerate().filter(|(_, b)| b.role == Role::Receiver) {
        let poison = vec![0xa5u8; buffer.bytes as usize];
        // SAFETY: bases[b] was allocated with buffer.bytes on this device.
        unsafe { backend.write(ordinal(buffer.endpoint.device), bases[b], &poison) }
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Reads every receiver buffer back and checks each needed element; returns the elements checked.
fn verify(workload: &Workload, backend: &Arc<dyn Backend>, bases: &[u64]) -> Result<u64, String> {
    let by_buffer = boxes_by_buffer(workload, Role::Receiver);
    let mut checked = 0u64;
    for (b, buffer) in workload.buffers.iter().enumerate().filter(|(_, b)| b.role == Role::Receiver) {
        let mut bytes = vec![0u8; buffer.bytes as usize];
        // SAFETY: as in fill.
        unsafe { backend.read(ordinal(buffer.endpoint.device), bases[b], &mut bytes) }
            .map_err(|e| e.to_string())?;
        let needs = &by_buffer[b];
        let bytes = &bytes;
        let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = needs
                .chunks(needs.len().div_ceil(threads()).max(1))
                .map(|chunk| {
                    s.spawn(move || {
                        let mut count = 0u64;
                        for &i in chunk {
                            let n = &workload.needs[i];
                            let es = workload.catalog.tensors[n.tensor as usize].elem_size as usize;
                            let mask = if es >= 8 { u64::MAX } else { (1u64 << (8 * es)) - 1 };
                            let mut wrong = None;
                            workload.for_each_element(n, |at, g| {
                                let at = at as usize;
                                if wrong.is_none()
                                    && read_element(&bytes[at..at + es]) != element_value(n.tensor, g) & mask
                                {
                                    wrong = Some(g);
                                }
                                count += 1;
                            });
                            if let Some(g) = wrong {
                                let name = &workload.catalog.tensors[n.tensor as usize].name;
                                return Err(format!("{}: element {g} of {name} is wrong", buffer.name));
                            }
                        }
                        Ok(count)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("verifier thread")).collect()
        });
        for r in results {
            checked += r?;
        }
    }
    Ok(checked)
}

/// The NVLink floor of the refit, measured: each rank pushes `bytes` into the next rank's device with
/// one copy-engine copy on its group stream, all ranks at once (median of 5, after a warm-up).
fn copy_engine_floor(group: &Group, bytes: u64) -> refit::Result<f64> {
    let backend = group.backend();
    let n = group.size();
    let mut buffers = Vec::with_capacity(n);
    for rank in 0..n {
        let device = group.device(rank)?;
        buffers.push((
            device,
            backend.alloc(device, bytes as usize)?,
            backend.alloc(device, bytes as usize)?,
        ));
    }
    let mut times = Vec::new();
    for _ in 0..6 {
        let start = Instant::now();
        group.in_implicit_scope(|| {
            for rank in 0..n {
                let (device, src, _) = buffers[rank];
                let (_, _, dst) = buffers[(rank + 1) % n];
                let copy = refit::Segment::contiguous(src, dst, bytes);
                // SAFETY: both buffers were allocated above with `bytes` bytes.
                unsafe { backend.copy_segments(device, group.stream(rank)?, &[copy]) }?;
            }
            Ok(())
        })?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    for (device, src, dst) in buffers {
        // SAFETY: allocated above; the implicit scope's exit synchronized.
        unsafe {
            backend.free(device, src)?;
            backend.free(device, dst)?;
        }
    }
    let mut warm = times.split_off(1);
    warm.sort_by(f64::total_cmp);
    Ok(warm[warm.len() / 2])
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn main() {
    if let Err(message) = run() {
        eprintln!("demo failed: {message}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let devices: Vec<i32> = (0..args.devices as i32).collect();
    let group = Group::new(&devices, GroupOptions::default()).map_err(|e| e.to_string())?;
    let backend = Arc::clone(group.backend());
    let on_gpu = group.backend_kind() == refit::transport::BackendKind::Cuda;
    // The host backend keeps every simulated device in this machine's memory: a few layers by default.
    let layers = args.layers.unwrap_or(if on_gpu { 48 } else { 1 });
    let endpoints: Vec<Endpoint> =
        (0..args.devices as u32).map(|device| Endpoint { process: 0, device }).collect();
    let spec = Spec {
        model: Model::qwen3_30b_a3b().with_layers(layers),
        publishers: Megatron {
            endpoints: endpoints.clone(),
            tp: 1,
            ep: args.devices as u64,
            grouped_experts: true,
        },
        publisher_layout: args.layout,
        receivers: Vllm { endpoints },
        receiver_layout: Packing::Separate,
        digests: true,
    };
    println!(
        "refit demo: Qwen3-30B-A3B ({layers} of 48 layers, BF16), Megatron EP{g} publishers -> vLLM TP{g} \
         receivers, colocated on {g} {} device(s) ({}), publisher layout {:?}",
        if on_gpu { "CUDA" } else { "host-simulated" },
        backend.device_name(0),
        args.layout,
        g = args.devices,
    );

    let workload = Workload::generate(&spec).map_err(|e| e.to_string())?;
    let mut bases = Vec::with_capacity(workload.buffers.len());
    for buffer in &workload.buffers {
        bases.push(
            backend
                .alloc(ordinal(buffer.endpoint.device), buffer.bytes as usize)
                .map_err(|e| e.to_string())?,
        );
    }
    let t = Instant::now();
    fill_publishers(&workload, &backend, &bases)?;
    println!("filled {} publisher buffers in {:.1} s", workload.offers.len(), t.elapsed().as_secs_f64());

    let tables = workload.tables(&bases).map_err(|e| e.to_string())?;
    let plan = plan::build(&tables, &PlanOptions::default()).map_err(|e| e.to_string())?;
    let s = plan.stats();
    println!(
        "plan: {} offers in, {} kept; {:.2} GiB needed; every replica read: {} ranges; one owner per replica: {} ranges; \
         coalesced: {} strided segments ({} flat runs); built in {:.1} ms",
        s.offers_in,
        s.offers_kept,
        gib(s.needed_bytes),
        s.ranges_all_replicas,
        s.ranges_deduped,
        s.ranges_coalesced,
        s.flat_runs_coalesced,
        s.build_ns as f64 / 1e6
    );
    println!(
        "bytes by route: same device {:.2} GiB, NVLink peer {:.2} GiB, other process {:.2} GiB",
        gib(s.bytes_local),
        gib(s.bytes_peer),
        gib(s.bytes_remote)
    );

    let mut executor = Executor::new();
    let mut rows = Vec::new();
    let arms: &[Arm] = if args.reference { &[Arm::Batched, Arm::PerRun] } else { &[Arm::Batched] };
    for &arm in arms {
        poison_receivers(&workload, &backend, &bases)?;
        let mut steps: Vec<StageTimes> = Vec::new();
        for _ in 0..args.steps.max(1) {
            // SAFETY: every address in the plan is one of the buffers allocated above.
            steps.push(unsafe { executor.execute(&group, &plan, 0, arm) }.map_err(|e| e.to_string())?);
        }
        let elements = verify(&workload, &backend, &bases)?;
        let cold = steps[0];
        let mut warm: Vec<f64> = steps.iter().skip(1).map(|t| t.total_s).collect();
        warm.sort_by(f64::total_cmp);
        let median = warm.get(warm.len() / 2).copied().unwrap_or(cold.total_s);
        let last = *steps.last().expect("at least one step");
        rows.push((arm, cold, median, last, elements));
    }

    println!();
    println!("| arm | first step ms (descriptors ms) | warm step median ms | enqueue ms | wait ms | attributed | GB/s | elements checked |");
    println!("|---|---|---|---|---|---|---|---|");
    for (arm, cold, median, last, elements) in &rows {
        println!(
            "| {arm:?} | {:.1} ({:.1}) | {:.1} | {:.2} | {:.1} | {:.1}% | {:.0} | {elements} (all correct) |",
            cold.total_s * 1e3,
            cold.descriptors_s * 1e3,
            median * 1e3,
            last.enqueue_s * 1e3,
            last.wait_s * 1e3,
            100.0 * last.attributed_s() / last.total_s,
            last.bytes as f64 / median / 1e9,
        );
    }
    if on_gpu && s.bytes_peer > 0 {
        let per_direction = s.bytes_peer / args.devices as u64;
        let floor_ms = copy_engine_floor(&group, per_direction).map_err(|e| e.to_string())?;
        println!(
            "floor, measured in this run: every device pushes {:.2} GiB into the next over NVLink with one \
             copy-engine copy each, all at once: {floor_ms:.1} ms (CEILINGS.md: {:.1} ms at 391 GB/s)",
            gib(per_direction),
            per_direction as f64 / 391e9 * 1e3
        );
    }
    for (b, buffer) in workload.buffers.iter().enumerate() {
        // SAFETY: allocated above, no work queued any more (execute returned after a synchronous exit).
        unsafe { backend.free(ordinal(buffer.endpoint.device), bases[b]) }.map_err(|e| e.to_string())?;
    }
    Ok(())
}
