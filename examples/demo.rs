//! The main job: plan and execute a colocated Qwen3-30B-A3B weight refit through the C ABI, as a
//! C++ or Python caller would.
//!
//! Megatron-style publishers (expert parallel over the devices, every device holding a replica of the
//! non-expert weights) refit vLLM-style tensor-parallel receivers on the same devices, one process.
//! On GPUs when CUDA is present, else on the host backend (simulated devices: threads and host
//! memory). Every call below into refit is a `refit_*` function of include/refit.h: the group, the
//! tables (crossing the ABI in their wire encoding, as processes exchange them), the plan, and the
//! executor with its options (arm, SM budget, verify, staged commit) and its per-step stats. Every
//! publisher element is a known function of (tensor, element), so after each phase every received
//! element is checked. With `--serve fp8` the receivers take their 2-D weights as FP8 codes and
//! scales quantized on the way (examples/serve/fp8.rs), each checked against the reference quantizer.
//!
//! Usage: see `USAGE` below (`cargo run --release --example demo -- --help` prints it). Before it
//! allocates anything the demo prints the memory it needs (host memory on the host backend).

use refit::exec::RunStats;
use refit::ffi::exec::*;
use refit::ffi::group::*;
use refit::ffi::plan::*;
use refit::ffi::status::refit_last_error_message;
use refit::plan::{wire, Endpoint};
use refit::transport::cuda::cuda_backend;
use refit::transport::host::HostBackend;
use refit::transport::Backend;
use refit::Status;
use refit_workloads::{element_value, Megatron, Model, Packing, Placed, Role, Spec, Vllm, Workload};
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "serve/fp8.rs"]
mod fp8;
#[path = "across/processes.rs"]
mod processes;

const USAGE: &str = "\
Plans and executes a colocated Qwen3-30B-A3B weight refit through refit's C API, then checks every
received element. On GPUs when CUDA is present, else on the host backend (threads and host memory
standing in for the devices: one layer by default, about 9 GB of host memory; the demo prints what
it needs before it allocates).

Usage: cargo run --release --example demo [-- OPTIONS]

  --layers N            layers of the model's 48 (default: 48 on GPUs, 1 on the host backend)
  --layout L            publisher layout: separate (one buffer per parameter, default) or packed
  --steps K             direct steps in phase 1 (default 5)
  --devices G           devices (default: 2, or 1 where only one GPU is present)
  --arm A               auto (default), kernel or copy-engine
  --sm-budget B         the executor's SM budget (default 0: none)
  --staging-limit MIB   staged phase: staging per receiving device (default 8192; 0: the whole step,
                        as much memory again as the receivers' buffers); with --serve fp8 the staged
                        phase runs in parts whose codes and scales (staged and verified: twice) fit
                        in it too
  --processes P         run publishers and receivers as P separate processes (examples/across/)
  --serve S             what receivers get: bf16 (default) or fp8 (2-D weights as e4m3fn codes with
                        fp32 scales per 128 x 128 block, quantized from finite bf16 publishers on the
                        way; norms stay bf16); every code and scale is checked against the reference
  --dry-run             print the memory a run on GPUs would need (where CUDA is absent too: 48
                        layers unless --layers, --devices GPUs) and exit without allocating
  -h, --help            print this and exit

Phase 1 runs K direct steps (the executor writes the live buffers). Phase 2 runs two staged,
verified steps: the run lands everything in staging and checks it, the live buffers stay untouched
until the commit installs it (with several slices, the run installs all but the last).
";

/// What the receivers are served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Serve {
    /// The publishers' bf16, as it is.
    Bf16,
    /// 2-D weights quantized to FP8 on the way (examples/serve/fp8.rs).
    Fp8,
}

struct Args {
    help: bool,
    dry_run: bool,
    processes: Option<usize>,
    layers: Option<u64>,
    layout: Packing,
    steps: usize,
    devices: Option<usize>,
    arm: u32,
    sm_budget: u32,
    staging_limit_mib: u64,
    serve: Serve,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        help: false,
        dry_run: false,
        processes: None,
        layers: None,
        layout: Packing::Separate,
        steps: 5,
        devices: None,
        arm: REFIT_ARM_AUTO,
        sm_budget: 0,
        staging_limit_mib: 8192,
        serve: Serve::Bf16,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "-h" | "--help" => args.help = true,
            "--dry-run" => args.dry_run = true,
            "--layers" => args.layers = Some(number(value()?)?),
            "--processes" => args.processes = Some(number(value()?)? as usize),
            "--steps" => args.steps = number(value()?)?.max(1) as usize,
            "--devices" => args.devices = Some(number(value()?)? as usize),
            "--sm-budget" => args.sm_budget = number(value()?)? as u32,
            "--staging-limit" => args.staging_limit_mib = number(value()?)?,
            "--arm" => {
                args.arm = match value()?.as_str() {
                    "auto" => REFIT_ARM_AUTO,
                    "kernel" => REFIT_ARM_KERNEL,
                    "copy-engine" => REFIT_ARM_COPY_ENGINE,
                    other => return Err(format!("--arm: {other} is not auto, kernel or copy-engine")),
                }
            }
            "--layout" => {
                args.layout = match value()?.as_str() {
                    "separate" => Packing::Separate,
                    "packed" => Packing::Packed,
                    other => return Err(format!("--layout: {other} is not separate or packed")),
                }
            }
            "--serve" => {
                args.serve = match value()?.as_str() {
                    "bf16" => Serve::Bf16,
                    "fp8" => Serve::Fp8,
                    other => return Err(format!("--serve: {other} is not bf16 or fp8")),
                }
            }
            other => return Err(format!("unknown argument {other} (--help lists the options)")),
        }
    }
    Ok(args)
}

/// A refit status as a Result, with the library's message.
fn ok(status: Status, call: &str) -> Result<(), String> {
    status_ok(status, call).map_err(|(_, message)| message)
}

/// As `ok`, keeping the status for callers that act on it.
fn status_ok(status: Status, call: &str) -> Result<(), (Status, String)> {
    if status == Status::Success {
        return Ok(());
    }
    // SAFETY: the library returns a NUL-terminated string valid until the next failing call.
    let message = unsafe { CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned();
    Err((status, format!("{call}: {} ({message})", status.name().to_string_lossy())))
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(32)
}

/// A raw pointer that worker threads may share: each writes a disjoint part.
#[derive(Clone, Copy)]
struct SharedPtr(*mut u8);
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

impl SharedPtr {
    /// The address `offset` bytes in (a method, so that closures capture the whole wrapper).
    fn at(&self, offset: usize) -> *mut u8 {
        self.0.wrapping_add(offset)
    }
}

/// Writes the low `es` bytes of `value`, little-endian (BF16 takes the fast path).
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

/// The element of `es` (at most 8) bytes at `src`, little-endian.
///
/// # Safety
/// `src .. src + es` must be readable.
#[inline(always)]
unsafe fn read_element(src: *const u8, es: usize) -> u64 {
    match es {
        2 => u64::from(src.cast::<u16>().read_unaligned()),
        4 => u64::from(src.cast::<u32>().read_unaligned()),
        _ => {
            let mut value = [0u8; 8];
            std::ptr::copy_nonoverlapping(src, value.as_mut_ptr(), es.min(8));
            u64::from_le_bytes(value)
        }
    }
}

/// How often a long phase says where it is.
const PROGRESS_EVERY: Duration = Duration::from_millis(1500);

/// Runs `work` on this thread while another prints `line(elapsed)` every PROGRESS_EVERY (nothing
/// when `work` ends sooner).
fn with_ticker<T>(line: impl Fn(Duration) -> String + Sync, work: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let finished = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut next = PROGRESS_EVERY;
            while !finished.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
                if started.elapsed() >= next && !finished.load(Ordering::Relaxed) {
                    println!("{}", line(started.elapsed()));
                    next += PROGRESS_EVERY;
                }
            }
        });
        let result = work();
        finished.store(true, Ordering::Relaxed);
        result
    })
}

/// Seconds as the progress lines print them.
fn seconds(s: f64) -> String {
    if s.is_finite() {
        format!("{s:.0} s")
    } else {
        "unknown".into()
    }
}

/// Runs `work` (which counts the bytes it has done in `done`) with a progress line every
/// PROGRESS_EVERY: bytes done of `total`, the rate so far and the time left at that rate.
fn with_progress<T: Send>(what: &str, total: u64, work: impl FnOnce(&AtomicU64) -> T + Send) -> T {
    let done = AtomicU64::new(0);
    let started = Instant::now();
    let result = with_ticker(
        |elapsed| {
            let bytes = done.load(Ordering::Relaxed);
            let rate = gib(bytes) / elapsed.as_secs_f64();
            format!(
                "  {what}: {:.2} of {:.2} GiB ({:.0}%), {rate:.2} GiB/s, {} left",
                gib(bytes),
                gib(total),
                100.0 * bytes as f64 / total.max(1) as f64,
                seconds(gib(total.saturating_sub(bytes)) / rate)
            )
        },
        || work(&done),
    );
    println!("  {what}: {:.2} GiB in {:.1} s", gib(total), started.elapsed().as_secs_f64());
    result
}

/// Runs one executor call (`what`, moving about `bytes`), printing while it runs how long it has
/// taken and, from the previous call's rate (`last_rate`, GiB/s), the time left.
fn with_step_progress<T>(what: &str, bytes: u64, last_rate: Option<f64>, call: impl FnOnce() -> T) -> T {
    with_ticker(
        |elapsed| match last_rate {
            Some(rate) => format!(
                "  {what}: {:.0} s so far, {:.2} GiB at the previous step's {rate:.2} GiB/s: about {} left",
                elapsed.as_secs_f64(),
                gib(bytes),
                seconds((gib(bytes) / rate - elapsed.as_secs_f64()).max(0.0))
            ),
            None => format!(
                "  {what}: {:.0} s so far, {:.2} GiB (the first step: time left known from the next step on)",
                elapsed.as_secs_f64(),
                gib(bytes)
            ),
        },
        call,
    )
}

/// The rows of a placed box (its last dimension is contiguous): `(byte offset in its buffer, global
/// index of the row's first element)` for row `r`, rows in memory order.
fn row(workload: &Workload, p: &Placed, r: u64) -> (u64, u64) {
    let shape = &workload.catalog.tensors[p.tensor as usize].shape;
    let (extent, n) = (&p.region.extent, p.region.extent.len());
    let es = u64::from(workload.catalog.tensors[p.tensor as usize].elem_size);
    let mut rest = r;
    let mut coord = vec![0u64; n];
    for d in (0..n - 1).rev() {
        coord[d] = rest % extent[d];
        rest /= extent[d];
    }
    let first = (0..n).fold(0, |acc, d| acc * shape[d] + p.region.offset[d] + coord[d]);
    (p.offset + r * extent[n - 1] * es, first)
}

/// Every row of every box of `role` in buffer order, cut into about `threads() * 8` pieces of
/// similar size (at most 64 MiB): `(box, first row, rows)`.
fn row_work(workload: &Workload, boxes: &[Placed]) -> Vec<(usize, u64, u64)> {
    let total: u64 = boxes.iter().map(|p| workload.bytes(p)).sum();
    // At most 64 MiB: a worker checking on a GPU holds one piece's image.
    let chunk = (total / (threads() as u64 * 8)).clamp(1 << 20, 64 << 20);
    let mut work = Vec::new();
    for (i, p) in boxes.iter().enumerate() {
        let n = p.region.extent.len();
        if n == 0 || p.region.extent.contains(&0) {
            continue;
        }
        let rows: u64 = p.region.extent[..n - 1].iter().product();
        let row_bytes = workload.bytes(p) / rows;
        let per = (chunk / row_bytes.max(1)).max(1);
        let mut first = 0;
        while first < rows {
            work.push((i, first, per.min(rows - first)));
            first += per;
        }
    }
    work
}

/// Runs `f(box, first row, rows)` over `work` on every core.
fn parallel(
    work: &[(usize, u64, u64)],
    f: impl Fn(usize, u64, u64) -> Result<(), String> + Sync,
) -> Result<(), String> {
    parallel_with(
        work.len(),
        || (),
        |_, i| {
            let (b, first, rows) = work[i];
            f(b, first, rows)
        },
    )
}

/// Runs `f(scratch, item)` for every item of `0..items` on every core, each worker with its own
/// `scratch()` (buffers it reuses); the first error stops the others at their next item.
fn parallel_with<T>(
    items: usize,
    scratch: impl Fn() -> T + Sync,
    f: impl Fn(&mut T, usize) -> Result<(), String> + Sync,
) -> Result<(), String> {
    let next = AtomicU64::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads().min(items.max(1)))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = scratch();
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                        if i >= items {
                            break;
                        }
                        if let Err(e) = f(&mut mine, i) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        let joined: Vec<Result<(), String>> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a worker thread panicked".into())))
            .collect();
        joined.into_iter().collect()
    })
}

/// Where the demo's buffers live: device memory, written and read through a host image.
struct Memory {
    backend: Arc<dyn Backend>,
    bases: Vec<u64>,
    on_gpu: bool,
    /// Live receiver memory besides the workload's buffers, `(device, address, bytes)`: the FP8
    /// arenas of `--serve fp8`, poisoned and checked untouched with the buffers.
    arenas: Vec<(u32, u64, u64)>,
}

impl Memory {
    /// Host bytes of buffer `b` to fill or check: the buffer itself on the host backend, a copy
    /// otherwise (`read` first copies the device's bytes in).
    fn image(&self, w: &Workload, b: usize, read: bool) -> Result<Vec<u8>, String> {
        let len = w.buffers[b].bytes as usize;
        if !self.on_gpu {
            return Ok(Vec::new());
        }
        let mut bytes = vec![0u8; len];
        if read {
            // SAFETY: bases[b] was allocated with this many bytes on this device.
            unsafe { self.backend.read(w.buffers[b].endpoint.device as i32, self.bases[b], &mut bytes) }
                .map_err(|e| e.to_string())?;
        }
        Ok(bytes)
    }

    fn pointer(&self, image: &mut [u8], b: usize) -> SharedPtr {
        SharedPtr(if self.on_gpu { image.as_mut_ptr() } else { self.bases[b] as usize as *mut u8 })
    }
}

/// What every publisher element holds: a known function of (tensor, element).
#[derive(Clone, Copy)]
struct Values {
    /// `--serve fp8`: bf16 elements are finite (fp8::finite_bf16), so that quantization blocks hold
    /// no NaN.
    finite: bool,
}

impl Values {
    /// Element `global` of `tensor` (`es` bytes): element_value's low bytes, or a finite bf16.
    #[inline(always)]
    fn get(self, tensor: u32, global: u64, es: usize) -> u64 {
        if self.finite && es == 2 {
            u64::from(fp8::finite_bf16(tensor, global))
        } else {
            element_value(tensor, global)
        }
    }
}

/// Writes every publisher element's known value.
fn fill_publishers(w: &Workload, memory: &Memory, values: Values) -> Result<(), String> {
    let total = w.offers.iter().map(|p| w.bytes(p)).sum();
    with_progress("filling publisher buffers", total, |done| {
        for (b, buffer) in w.buffers.iter().enumerate().filter(|(_, x)| x.role == Role::Publisher) {
            let offers: Vec<Placed> = w.offers.iter().filter(|o| o.buffer as usize == b).cloned().collect();
            let mut image = memory.image(w, b, false)?;
            let ptr = memory.pointer(&mut image, b);
            parallel(&row_work(w, &offers), |i, first, rows| {
                let p = &offers[i];
                let es = w.catalog.tensors[p.tensor as usize].elem_size as usize;
                let inner = *p.region.extent.last().expect("a box has dimensions");
                for r in first..first + rows {
                    let (at, global) = row(w, p, r);
                    let base = ptr.at(at as usize);
                    for c in 0..inner {
                        let value = values.get(p.tensor, global + c, es);
                        // SAFETY: offers in one buffer are disjoint boxes inside it.
                        unsafe { write_element(base.add(c as usize * es), value, es) };
                    }
                    done.fetch_add(inner * es as u64, Ordering::Relaxed);
                }
                Ok(())
            })?;
            if memory.on_gpu {
                // SAFETY: bases[b] was allocated with buffer.bytes on this device.
                unsafe { memory.backend.write(buffer.endpoint.device as i32, memory.bases[b], &image) }
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    })
}

/// The poison byte of receiver buffers, so that a byte the refit misses is seen.
const POISON: u8 = 0xa5;

/// Receiver buffers are poisoned and read back in pieces of this many bytes, a piece per worker at a
/// time (a progress line can come between two pieces, and no copy of a whole buffer is held).
const PIECE: u64 = 32 << 20;

/// Every receiver buffer the demo allocated: (device, address, bytes). Receiver buffers whose needs
/// are all quantized are not allocated (base 0): nothing lands in them.
fn receiver_buffers(w: &Workload, memory: &Memory) -> Vec<(u32, u64, u64)> {
    let buffers =
        w.buffers.iter().enumerate().filter(|&(b, x)| x.role == Role::Receiver && memory.bases[b] != 0);
    buffers.map(|(b, x)| (x.endpoint.device, memory.bases[b], x.bytes)).collect()
}

/// Every receiver buffer the demo allocated, then every arena.
fn receiver_regions(w: &Workload, memory: &Memory) -> Vec<(u32, u64, u64)> {
    let mut regions = receiver_buffers(w, memory);
    regions.extend(memory.arenas.iter().copied());
    regions
}

/// `regions` cut into pieces of at most PIECE bytes: (device, address, length).
fn pieces(regions: &[(u32, u64, u64)]) -> Vec<(i32, u64, u64)> {
    let mut pieces = Vec::new();
    for &(device, base, bytes) in regions {
        let mut at = 0;
        while at < bytes {
            pieces.push((device as i32, base + at, PIECE.min(bytes - at)));
            at += PIECE;
        }
    }
    pieces
}

/// Overwrites `regions` (receiver buffers and arenas) with POISON, on every core.
fn poison_receivers(memory: &Memory, regions: &[(u32, u64, u64)]) -> Result<(), String> {
    let pieces = pieces(regions);
    let total = pieces.iter().map(|p| p.2).sum();
    let poison = vec![POISON; PIECE as usize];
    with_progress("poisoning receiver buffers", total, |done| {
        parallel_with(
            pieces.len(),
            || (),
            |_, i| {
                let (device, at, len) = pieces[i];
                // SAFETY: each piece lies inside a buffer or arena allocated on this device.
                unsafe { memory.backend.write(device, at, &poison[..len as usize]) }
                    .map_err(|e| e.to_string())?;
                done.fetch_add(len, Ordering::Relaxed);
                Ok(())
            },
        )
    })
}

/// Whether every byte of `regions` still holds POISON, read on every core (`what` names the check
/// in its progress lines).
fn receivers_poisoned(what: &str, memory: &Memory, regions: &[(u32, u64, u64)]) -> Result<bool, String> {
    let pieces = pieces(regions);
    let total = pieces.iter().map(|p| p.2).sum();
    let changed = std::sync::atomic::AtomicBool::new(false);
    with_progress(what, total, |done| {
        parallel_with(pieces.len(), Vec::new, |bytes: &mut Vec<u8>, i| {
            let (device, at, len) = pieces[i];
            if changed.load(Ordering::Relaxed) {
                return Ok(());
            }
            bytes.resize(len as usize, 0);
            // SAFETY: as in poison_receivers.
            unsafe { memory.backend.read(device, at, bytes) }.map_err(|e| e.to_string())?;
            if bytes.iter().any(|&x| x != POISON) {
                changed.store(true, Ordering::Relaxed);
            }
            done.fetch_add(len, Ordering::Relaxed);
            Ok(())
        })
    })?;
    Ok(!changed.load(Ordering::Relaxed))
}

/// Host memory a worker holds for a check at most (a piece of rows read from a GPU; fp8's units need
/// about 4 bytes per element).
const WORKER_BYTES: u64 = 64 << 20;

/// What the demo allocates, known before it allocates.
struct Need {
    /// By buffer: receiver buffers whose needs are all quantized (`--serve fp8`): not allocated.
    unneeded: Vec<bool>,
    /// Phase 2's parts (one without `--serve fp8`).
    parts: Vec<fp8::Part>,
    /// By device: allocated buffers, FP8 arenas, phase 2's staging at its peak (the largest part's).
    buffers: BTreeMap<u32, u64>,
    arenas: BTreeMap<u32, u64>,
    staging: BTreeMap<u32, u64>,
    /// Phase 2's staging over all devices were it one part.
    whole_step_staging: u64,
}

impl Need {
    /// The buffers, arenas and staging of a run: phase 2's staged executor allocates staging for the
    /// plain needs (their bytes, at most `staging_limit` per device: src/exec/mod.rs) and, for its
    /// quantized needs, packed codes and scales twice (staging and the verify's scratch) beside the
    /// limit; the parts keep the latter within the limit too.
    fn new(w: &Workload, layout: Option<&fp8::Layout>, staging_limit: u64) -> Need {
        let quantized = |i: usize| layout.is_some_and(|l| l.quantized[i]);
        let (mut has_need, mut has_plain) = (vec![false; w.buffers.len()], vec![false; w.buffers.len()]);
        let mut plain: BTreeMap<u32, u64> = BTreeMap::new();
        for (i, n) in w.needs.iter().enumerate() {
            has_need[n.buffer as usize] = true;
            if !quantized(i) {
                has_plain[n.buffer as usize] = true;
                *plain.entry(n.endpoint.device).or_default() += w.bytes(n);
            }
        }
        for bytes in plain.values_mut() {
            if staging_limit != 0 {
                *bytes = (*bytes).min(staging_limit);
            }
        }
        let unneeded: Vec<bool> = (0..w.buffers.len())
            .map(|b| w.buffers[b].role == Role::Receiver && has_need[b] && !has_plain[b])
            .collect();
        let mut buffers: BTreeMap<u32, u64> = BTreeMap::new();
        for (_, buffer) in w.buffers.iter().enumerate().filter(|&(b, _)| !unneeded[b]) {
            *buffers.entry(buffer.endpoint.device).or_default() += buffer.bytes;
        }
        let mut arenas: BTreeMap<u32, u64> = BTreeMap::new();
        let mut whole_step_staging: u64 = plain.values().sum();
        let parts = match layout {
            None => vec![fp8::Part { placements: 0..0, plain: true }],
            Some(l) => {
                for (device, _, bytes) in l.arenas(&[fp8::Kind::Codes, fp8::Kind::Scales]) {
                    *arenas.entry(device).or_default() += bytes;
                }
                whole_step_staging += l.placements.iter().map(|p| 2 * p.packed_bytes()).sum::<u64>();
                l.parts(staging_limit, &plain)
            }
        };
        let mut staging: BTreeMap<u32, u64> = BTreeMap::new();
        for part in &parts {
            let mut of_part = layout.map_or(BTreeMap::new(), |l| l.part_staging(part));
            if part.plain {
                for (&device, &bytes) in &plain {
                    *of_part.entry(device).or_default() += bytes;
                }
            }
            for (device, bytes) in of_part {
                let peak = staging.entry(device).or_default();
                *peak = (*peak).max(bytes);
            }
        }
        Need { unneeded, parts, buffers, arenas, staging, whole_step_staging }
    }

    fn total(map: &BTreeMap<u32, u64>) -> u64 {
        map.values().sum()
    }
}

/// Prints the memory the demo will use before it allocates: on each device the buffers it allocates,
/// the FP8 arenas of `--serve fp8`, and phase 2's staging at its peak; on GPUs the host memory of the
/// largest publisher buffer's image (filled on the host) or the workers' check buffers. On the host
/// backend, fails when this machine lacks it.
fn print_memory_need(w: &Workload, on_gpu: bool, need: &Need) -> Result<(), String> {
    let mut per_device = need.buffers.clone();
    for map in [&need.arenas, &need.staging] {
        for (&device, &bytes) in map {
            *per_device.entry(device).or_default() += bytes;
        }
    }
    let (buffers, fp8, staging) =
        (Need::total(&need.buffers), Need::total(&need.arenas), Need::total(&need.staging));
    let fp8_part =
        if fp8 > 0 { format!(", FP8 codes and scales {:.2} GiB", gib(fp8)) } else { String::new() };
    let workers = threads() as u64 * WORKER_BYTES;
    if on_gpu {
        let largest =
            (w.buffers.iter().filter(|b| b.role == Role::Publisher)).map(|b| b.bytes).max().unwrap_or(0);
        let each: Vec<String> =
            per_device.iter().map(|(d, bytes)| format!("GPU {d} {:.2} GiB", gib(*bytes))).collect();
        println!(
            "  needs device memory: {} (buffers {:.2} GiB{fp8_part}, then staging in phase 2, at most {:.2} GiB); host \
             memory: {:.2} GiB (the largest publisher buffer's image, or {} workers' check buffers)",
            each.join(", "),
            gib(buffers),
            gib(staging),
            gib(largest.max(workers)),
            threads()
        );
    } else {
        let total = buffers + fp8 + staging + workers;
        let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kib| kib << 10)
        });
        println!(
            "  needs about {:.1} GB of host memory: buffers {:.2} GiB{fp8_part}, staging {:.2} GiB (phase 2), checks \
             {:.2} GiB{}",
            total as f64 / 1e9,
            gib(buffers),
            gib(staging),
            gib(workers),
            available.map_or(String::new(), |a| format!("; {:.1} GB available", a as f64 / 1e9))
        );
        if available.is_some_and(|a| a < total) {
            return Err(format!(
                "not enough host memory for this run: {:.1} GB needed; a smaller --staging-limit lowers it",
                total as f64 / 1e9
            ));
        }
    }
    if need.parts.len() > 1 {
        println!(
            "  phase 2 runs each step in {} parts of the quantized needs: a staged, verified executor holds its \
             quantized needs' codes and scales twice (staging, and the verify's scratch) beside --staging-limit, \
             {:.2} GiB for the whole step; each part's fits in the limit",
            need.parts.len(),
            gib(need.whole_step_staging)
        );
    }
    Ok(())
}

/// Checks every received element of the needs that are not `quantized` (by need index; empty:
/// none is) against its known value, on every core (on a GPU each piece of rows is read by the worker
/// that checks it); returns the elements checked.
fn check_receivers(w: &Workload, memory: &Memory, values: Values, quantized: &[bool]) -> Result<u64, String> {
    let plain = |i: usize| !quantized.get(i).copied().unwrap_or(false);
    let needs: Vec<Placed> =
        w.needs.iter().enumerate().filter(|&(i, _)| plain(i)).map(|(_, n)| n.clone()).collect();
    let total = needs.iter().map(|n| w.bytes(n)).sum();
    let work = row_work(w, &needs);
    let checked = AtomicU64::new(0);
    with_progress("checking every received element", total, |done| {
        parallel_with(work.len(), Vec::new, |image: &mut Vec<u8>, k| {
            let (i, first, rows) = work[k];
            let n = &needs[i];
            let (b, buffer) = (n.buffer as usize, &w.buffers[n.buffer as usize]);
            let es = w.catalog.tensors[n.tensor as usize].elem_size as usize;
            let inner = *n.region.extent.last().expect("a box has dimensions");
            // The box is row-major in its buffer: its rows `first..first + rows` are contiguous.
            let start = row(w, n, first).0;
            let base = if memory.on_gpu {
                image.resize((rows * inner) as usize * es, 0);
                // SAFETY: the rows lie inside the buffer, allocated on this device.
                unsafe { memory.backend.read(buffer.endpoint.device as i32, memory.bases[b] + start, image) }
                    .map_err(|e| e.to_string())?;
                image.as_ptr()
            } else {
                (memory.bases[b] + start) as usize as *const u8
            };
            let mask = if es >= 8 { u64::MAX } else { (1u64 << (8 * es)) - 1 };
            for r in first..first + rows {
                let (at, global) = row(w, n, r);
                let row_base = base.wrapping_add((at - start) as usize);
                for c in 0..inner {
                    // SAFETY: the row lies inside the image (or, on the host backend, the buffer).
                    let got = unsafe { read_element(row_base.add(c as usize * es), es) };
                    if got != values.get(n.tensor, global + c, es) & mask {
                        let tensor = &w.catalog.tensors[n.tensor as usize].name;
                        return Err(format!("{}: element {} of {tensor} is wrong", buffer.name, global + c));
                    }
                }
                checked.fetch_add(inner, Ordering::Relaxed);
                done.fetch_add(inner * es as u64, Ordering::Relaxed);
            }
            Ok(())
        })?;
        Ok(checked.load(Ordering::Relaxed))
    })
}

/// The plan through the C API: each process rank's table (`w.tables`, with `--serve fp8` its
/// quantized needs) encoded, decoded by `refit_table_decode`, and planned by `refit_plan_build`.
fn plan_through_c(tables: &[refit::plan::Table]) -> Result<*mut refit_plan, (Status, String)> {
    let mut decoded: Vec<*mut refit_table> = Vec::new();
    for table in tables {
        let bytes = wire::encode(table);
        let mut handle = std::ptr::null_mut();
        // SAFETY: `bytes` is readable for its length; `handle` is a writable slot.
        let status = unsafe { refit_table_decode(bytes.as_ptr(), bytes.len(), &mut handle) };
        if let Err(e) = status_ok(status, "refit_table_decode") {
            decoded.into_iter().for_each(|t| refit_table_destroy(t));
            return Err(e);
        }
        decoded.push(handle);
    }
    let mut plan = std::ptr::null_mut();
    let readers: Vec<*const refit_table> = decoded.iter().map(|&t| t as *const _).collect();
    // SAFETY: live tables, NULL options (defaults), a writable slot.
    let built = status_ok(
        unsafe { refit_plan_build(readers.as_ptr(), readers.len(), std::ptr::null(), &mut plan) },
        "refit_plan_build",
    );
    for table in decoded {
        refit_table_destroy(table);
    }
    built.map(|()| plan)
}

/// Allocates `layout`'s arenas of `kinds` on their devices and records their addresses in it;
/// returns them as `(device, address, bytes)`.
fn allocate_arenas(
    backend: &dyn Backend,
    layout: &mut fp8::Layout,
    kinds: &[fp8::Kind],
) -> Result<Vec<(u32, u64, u64)>, String> {
    let mut out = Vec::new();
    for (device, kind, bytes) in layout.arenas(kinds) {
        let base = backend.alloc(device as i32, bytes as usize).map_err(|e| e.to_string())?;
        layout.bases.insert((device, kind), base);
        out.push((device, base, bytes));
    }
    Ok(out)
}

/// Plans through the C API; under `--serve fp8` with the quantized needs. When planning finds a
/// quantized need with no direct path (UNSUPPORTED), every quantized need gets a staging buffer
/// (allocated here, added to `arenas` to be freed) and planning runs again: the planner quantizes
/// in place wherever it can whether or not a need has staging, so only the needs without a direct
/// path use theirs.
fn plan(
    w: &Workload,
    bases: &[u64],
    layout: Option<&mut fp8::Layout>,
    backend: &dyn Backend,
    arenas: &mut Vec<(u32, u64, u64)>,
) -> Result<*mut refit_plan, String> {
    let tables = |layout: Option<&fp8::Layout>| -> Result<Vec<refit::plan::Table>, String> {
        let mut tables = w.tables(bases).map_err(|e| e.to_string())?;
        if let Some(l) = layout {
            l.quantize_tables(w, &mut tables, None)?;
        }
        Ok(tables)
    };
    let Some(layout) = layout else {
        return plan_through_c(&tables(None)?).map_err(|(_, message)| message);
    };
    match plan_through_c(&tables(Some(layout))?) {
        Ok(plan) => Ok(plan),
        Err((Status::Unsupported, message)) => {
            layout.add_staging();
            let staging: u64 = layout.arenas(&[fp8::Kind::Staging]).iter().map(|a| a.2).sum();
            println!(
                "  {message}\n  giving every quantized need a bf16 staging buffer on its device ({:.2} GiB) and planning \
                 again (needs with a direct path keep it)",
                gib(staging)
            );
            arenas.extend(allocate_arenas(backend, layout, &[fp8::Kind::Staging])?);
            plan_through_c(&tables(Some(layout))?).map_err(|(_, message)| message)
        }
        Err((_, message)) => Err(message),
    }
}

/// Checks every received element: the plain needs' against their values, and under `--serve fp8`
/// every code and scale of the quantized needs against the reference quantizer.
fn check_all(
    w: &Workload,
    memory: &Memory,
    values: Values,
    layout: Option<&fp8::Layout>,
) -> Result<(), String> {
    let quantized = layout.map_or(&[][..], |l| &l.quantized[..]);
    let elements = check_receivers(w, memory, values, quantized)?;
    match layout {
        None => println!("  all {elements} received elements correct"),
        Some(l) => {
            let (codes, scales) = l.check(w, memory)?;
            println!(
                "  all {elements} received BF16 elements, {codes} FP8 codes and {scales} scales correct (the codes and \
                 scales as the reference quantizer gives them)"
            );
        }
    }
    Ok(())
}

/// Adds a part's stats into its step's: times, bytes and elements summed, each route kind's arm the
/// first part's that moved any.
fn accumulate(total: &mut RunStats, part: &RunStats) {
    let t = total;
    for (sum, x) in [
        (&mut t.wall_ns, part.wall_ns),
        (&mut t.prepare_ns, part.prepare_ns),
        (&mut t.enqueue_ns, part.enqueue_ns),
        (&mut t.wait_ns, part.wait_ns),
        (&mut t.local_ns, part.local_ns),
        (&mut t.peer_ns, part.peer_ns),
        (&mut t.verify_ns, part.verify_ns),
        (&mut t.commit_ns, part.commit_ns),
        (&mut t.device_ns, part.device_ns),
        (&mut t.installed_bytes, part.installed_bytes),
        (&mut t.verified_bytes, part.verified_bytes),
        (&mut t.quantized_elements, part.quantized_elements),
    ] {
        *sum += x;
    }
    for k in 0..3 {
        t.bytes[k] += part.bytes[k];
        t.segments[k] += part.segments[k];
        if arm_name(t.arm[k]) == "-" {
            t.arm[k] = part.arm[k];
        }
    }
    t.slices += part.slices;
}

/// A plan's stats (refit_plan_get_stats).
fn plan_stats(plan: *mut refit_plan) -> Result<refit::plan::PlanStats, String> {
    let mut s = unsafe { std::mem::zeroed::<refit::plan::PlanStats>() };
    s.size = std::mem::size_of::<refit::plan::PlanStats>();
    // SAFETY: a live plan; `s` has its size set.
    ok(unsafe { refit_plan_get_stats(plan, &mut s) }, "refit_plan_get_stats")?;
    Ok(s)
}

/// Bytes a step reads: what it copies, and under --serve fp8 the sources it quantizes in place
/// (staged ones are needed bytes already: the routes carry them into staging).
fn step_bytes(s: &refit::plan::PlanStats) -> u64 {
    s.needed_bytes + s.quantized_direct_bytes
}

fn step_bytes_of(plan: *mut refit_plan) -> Result<u64, String> {
    plan_stats(plan).map(|s| step_bytes(&s))
}

/// The plan of one part of phase 2's step: its quantized needs (and the plain ones, for the part that
/// takes them), through the C API as the whole plan was.
fn plan_part(
    w: &Workload,
    bases: &[u64],
    layout: &fp8::Layout,
    part: &fp8::Part,
) -> Result<*mut refit_plan, String> {
    let mut tables = w.tables(bases).map_err(|e| e.to_string())?;
    layout.quantize_tables(w, &mut tables, Some(part))?;
    plan_through_c(&tables).map_err(|(_, message)| message)
}

fn arm_name(code: u32) -> &'static str {
    match code {
        REFIT_ARM_KERNEL => "kernel",
        REFIT_ARM_COPY_ENGINE => "copy engine",
        REFIT_ARM_SPLIT => "copy engine + kernel",
        _ => "-",
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn main() {
    if let Err(message) = run() {
        eprintln!("demo failed: {message}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    if args.help {
        print!("{USAGE}");
        return Ok(());
    }
    if let Some(n) = args.processes {
        if args.serve == Serve::Fp8 {
            return Err("--serve fp8 runs in one process (without --processes)".into());
        }
        return processes::run(&args, n);
    }
    let started = Instant::now();
    let cuda = cuda_backend().ok().filter(|b| b.device_count() > 0);
    let on_gpu = cuda.is_some();
    // A dry run estimates a run on GPUs, here or not.
    let as_gpu = on_gpu || args.dry_run;
    let available = cuda.as_ref().map_or(2, |b| b.device_count());
    let devices = args.devices.unwrap_or(available.min(2));
    let backend: Arc<dyn Backend> = match cuda {
        Some(cuda) => cuda,
        None => Arc::new(HostBackend::new(devices).map_err(|e| e.to_string())?),
    };
    // The host backend keeps every simulated device in this machine's memory: one layer by default.
    let layers = args.layers.unwrap_or(if as_gpu { 48 } else { 1 });

    let endpoints: Vec<Endpoint> =
        (0..devices as u32).map(|device| Endpoint { process: 0, device }).collect();
    let spec = Spec {
        model: Model::qwen3_30b_a3b().with_layers(layers),
        publishers: Megatron {
            endpoints: endpoints.clone(),
            tp: 1,
            ep: devices as u64,
            grouped_experts: true,
        },
        publisher_layout: args.layout,
        receivers: Vllm { endpoints },
        receiver_layout: Packing::Separate,
        digests: true,
    };
    let between = if on_gpu {
        "GPU to GPU (NVLink where the GPUs have it)"
    } else {
        "between simulated devices (memcpy)"
    };
    let (kind, name) = match (on_gpu, as_gpu) {
        (true, _) => ("CUDA device(s)", backend.device_name(0)),
        (false, true) => ("GPU(s)", "dry run: no CUDA here, the memory a run on GPUs needs".to_string()),
        (false, false) => {
            ("simulated device(s) of the host backend: threads and host memory", backend.device_name(0))
        }
    };
    println!(
        "refit demo: Qwen3-30B-A3B ({layers} of 48 layers, BF16), Megatron EP{devices} publishers -> vLLM TP{devices} \
         receivers, colocated on {devices} {kind} ({name}), publisher layout {:?}",
        args.layout,
    );

    let workload = Workload::generate(&spec).map_err(|e| e.to_string())?;
    let mut layout = match args.serve {
        Serve::Bf16 => None,
        Serve::Fp8 => Some(fp8::Layout::new(&workload)?),
    };
    let live_kinds = [fp8::Kind::Codes, fp8::Kind::Scales];
    if let Some(l) = &layout {
        let quantized = l.placements.len();
        println!(
            "  serving FP8: {quantized} of the {} receiver needs (2-D weights, {} elements) become quantized needs: \
             e4m3fn codes with an fp32 scale per 128 x 128 block, quantized from the bf16 sources on the way, \
             into FP8 arenas on each receiving device; the other {} (norms) stay BF16",
            workload.needs.len(),
            l.elements(),
            workload.needs.len() - quantized
        );
    }
    let need = Need::new(&workload, layout.as_ref(), args.staging_limit_mib << 20);
    print_memory_need(&workload, as_gpu, &need)?;
    if args.dry_run {
        return Ok(());
    }

    let mut options = unsafe { std::mem::zeroed::<refit_group_options>() };
    ok(refit_group_options_init(&mut options), "refit_group_options_init")?;
    options.backend = if on_gpu { REFIT_BACKEND_CUDA } else { REFIT_BACKEND_HOST };
    let ordinals: Vec<i32> = (0..devices as i32).collect();
    let mut group = std::ptr::null_mut();
    ok(refit_group_create(ordinals.as_ptr(), ordinals.len(), &options, &mut group), "refit_group_create")?;

    let (mut count, mut total, mut skipped, mut skipped_bytes) = (0, 0, 0, 0);
    for (b, buffer) in workload.buffers.iter().enumerate() {
        match need.unneeded[b] {
            true => (skipped, skipped_bytes) = (skipped + 1, skipped_bytes + buffer.bytes),
            false => (count, total) = (count + 1, total + buffer.bytes),
        }
    }
    println!("[1/5] allocating {count} buffers, {:.2} GiB", gib(total));
    if skipped > 0 {
        println!(
            "  (not the {skipped} receiver buffers whose needs are all quantized, {:.2} GiB: their needs land in the \
             FP8 arenas)",
            gib(skipped_bytes)
        );
    }
    // Base 0: not allocated (nothing is received there).
    let mut bases = Vec::with_capacity(workload.buffers.len());
    for (b, buffer) in workload.buffers.iter().enumerate() {
        bases.push(match need.unneeded[b] {
            true => 0,
            false => backend
                .alloc(buffer.endpoint.device as i32, buffer.bytes as usize)
                .map_err(|e| e.to_string())?,
        });
    }
    let mut arenas = Vec::new();
    if let Some(l) = &mut layout {
        let live = l.arenas(&live_kinds);
        let fp8_total: u64 = live.iter().map(|a| a.2).sum();
        println!("  and {} FP8 arenas (codes, scales), {:.2} GiB", live.len(), gib(fp8_total));
        arenas = allocate_arenas(backend.as_ref(), l, &live_kinds)?;
    }
    let memory =
        Memory { backend: Arc::clone(&backend), bases: bases.clone(), on_gpu, arenas: arenas.clone() };
    let values = Values { finite: layout.is_some() };
    if layout.is_some() {
        println!(
            "[2/5] filling every publisher element with a known finite value (bf16, magnitudes 2^-9 .. 2^7)"
        );
    } else {
        println!("[2/5] filling every publisher element with a known value");
    }
    fill_publishers(&workload, &memory, values)?;

    println!("[3/5] planning through the C API (tables encoded, decoded, planned)");
    let plan = plan(&workload, &bases, layout.as_mut(), backend.as_ref(), &mut arenas)?;
    let s = plan_stats(plan)?;
    println!(
        "  {} offers in, {} kept; {:.2} GiB needed; every replica read: {} ranges; one owner per replica: {} ranges; \
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
        "  bytes by route: within a device {:.2} GiB, {between} {:.2} GiB, other processes {:.2} GiB",
        gib(s.bytes_local),
        gib(s.bytes_peer),
        gib(s.bytes_remote)
    );
    if layout.is_some() {
        println!(
            "  quantized needs: {} ({} elements to FP8); source bytes quantized in place (direct) {:.2} GiB, \
             through the needs' staging {:.2} GiB; plain needs: {}",
            s.quantized_needs,
            s.quantized_elements,
            gib(s.quantized_direct_bytes),
            gib(s.quantized_staged_bytes),
            s.needs
        );
    }

    let make = |plan: *mut refit_plan, commit: u32, verify: bool, staging_mib: u64| {
        let mut options = unsafe { std::mem::zeroed::<refit_executor_options>() };
        ok(refit_executor_options_init(&mut options), "refit_executor_options_init")?;
        options.arm = args.arm;
        options.sm_budget = args.sm_budget;
        options.verify = verify;
        options.commit = commit;
        options.staging_limit = staging_mib << 20;
        let mut executor = std::ptr::null_mut();
        let t = Instant::now();
        ok(refit_executor_create(plan, group, 0, &options, &mut executor), "refit_executor_create")?;
        Ok::<_, String>((executor, t.elapsed().as_secs_f64() * 1e3))
    };
    let created = |ms: f64| {
        println!("  executor created in {ms:.1} ms (descriptors built and uploaded, staging allocated)")
    };

    let all_receivers = receiver_regions(&workload, &memory);
    println!("[4/5] phase 1: {} direct steps (each run writes the live buffers)", args.steps);
    poison_receivers(&memory, &all_receivers)?;
    let (direct, create_ms) = make(plan, REFIT_COMMIT_DIRECT, false, 0)?;
    created(create_ms);
    let mut rows = Vec::new();
    let step_bytes = step_bytes(&s);
    let mut last_rate = None;
    for step in 0..args.steps {
        let mut stats = RunStats::default();
        let what = format!("direct step {}", step + 1);
        let status = with_step_progress(&what, step_bytes, last_rate, || {
            refit_executor_run(direct, group, &mut stats)
        });
        ok(status, "refit_executor_run")?;
        last_rate = Some(gib(step_bytes) / (stats.wall_ns.max(1) as f64 / 1e9));
        rows.push((format!("direct {}", step + 1), stats));
    }
    refit_executor_destroy(direct);
    check_all(&workload, &memory, values, layout.as_ref())?;

    println!(
        "[5/5] phase 2: two staged, verified steps (run receives into staging and verifies; commit installs)"
    );
    // One plan per part: each part's executor exists only while its part runs and commits.
    let parts = &need.parts;
    let mut part_plans = Vec::with_capacity(parts.len());
    if parts.len() == 1 {
        part_plans.push((plan, step_bytes));
    } else {
        let l = layout.as_ref().ok_or("phase 2 in parts without --serve fp8")?;
        for part in parts {
            let p = plan_part(&workload, &bases, l, part)?;
            part_plans.push((p, step_bytes_of(p)?));
        }
    }
    // One part: one executor for both steps, as a caller keeps it.
    let kept = match parts.len() {
        1 => {
            let (executor, create_ms) = make(plan, REFIT_COMMIT_STAGED, true, args.staging_limit_mib)?;
            created(create_ms);
            Some(executor)
        }
        _ => None,
    };
    let mut staged_rate = None;
    for step in 1..=2 {
        poison_receivers(&memory, &all_receivers)?;
        let (mut ran, mut committed) = (RunStats::default(), RunStats::default());
        let mut slices = 0;
        for (k, part) in parts.iter().enumerate() {
            let (part_plan, part_bytes) = part_plans[k];
            let (staged, create_ms) = match kept {
                Some(executor) => (executor, 0.0),
                None => make(part_plan, REFIT_COMMIT_STAGED, true, args.staging_limit_mib)?,
            };
            let of_part =
                if parts.len() > 1 { format!(", part {} of {}", k + 1, parts.len()) } else { String::new() };
            let mut part_ran = RunStats::default();
            let what = format!("staged, verified run {step}{of_part}");
            let status = with_step_progress(&what, part_bytes, staged_rate, || {
                refit_executor_run(staged, group, &mut part_ran)
            });
            ok(status, "refit_executor_run")?;
            staged_rate = Some(gib(part_bytes) / (part_ran.wall_ns.max(1) as f64 / 1e9));
            slices = slices.max(part_ran.slices);
            // What this part's commit will install: its codes and scales (and the plain receivers).
            let mut live = match &layout {
                Some(l) if parts.len() > 1 => l.part_regions(part)?,
                _ => all_receivers.clone(),
            };
            if parts.len() > 1 && part.plain {
                live.extend(receiver_buffers(&workload, &memory));
            }
            let untouched = part_ran.slices > 1 || {
                let what = match parts.len() {
                    1 => "checking the live buffers are untouched".to_string(),
                    n => format!("checking part {} of {n}'s live bytes are untouched", k + 1),
                };
                receivers_poisoned(&what, &memory, &live)?
            };
            if !untouched {
                return Err(format!("a staged run{of_part} changed live bytes before its commit"));
            }
            let mut part_committed = RunStats::default();
            let what = format!("commit {step}{of_part}");
            let status = with_step_progress(&what, part_bytes, last_rate, || {
                refit_executor_commit(staged, group, &mut part_committed)
            });
            ok(status, "refit_executor_commit")?;
            if kept.is_none() {
                refit_executor_destroy(staged);
            }
            if parts.len() > 1 {
                println!(
                    "  step {step}, part {} of {} ({} quantized needs{}, {:.2} GiB of codes and scales): executor \
                     created in {create_ms:.1} ms, run {:.1} ms, live bytes unchanged until the commit ({:.1} ms)",
                    k + 1,
                    parts.len(),
                    part.placements.len(),
                    if part.plain { " and the plain ones" } else { "" },
                    gib(layout.as_ref().map_or(0, |l| l.part_bytes(part))),
                    ms(part_ran.wall_ns),
                    ms(part_committed.wall_ns)
                );
            }
            accumulate(&mut ran, &part_ran);
            accumulate(&mut committed, &part_committed);
        }
        if slices > 1 {
            println!(
                "  step {step}: {slices} slices; the run installed all but the last (the guarantee is per slice)"
            );
        } else if parts.len() > 1 {
            println!(
                "  step {step}: in {} parts, each run left its live bytes unchanged (still the poison) until its commit",
                parts.len()
            );
        } else {
            println!("  step {step}: after the run every live byte is unchanged (still the poison)");
        }
        rows.push((format!("staged run {step}"), ran));
        rows.push((format!("commit {step}"), committed));
    }
    if let Some(executor) = kept {
        refit_executor_destroy(executor);
    }
    if parts.len() > 1 {
        for (p, _) in part_plans {
            refit_plan_destroy(p);
        }
    }
    check_all(&workload, &memory, values, layout.as_ref())?;

    println!();
    let (quantized_head, quantized_rule) =
        if layout.is_some() { (" quantized elements |", "---|") } else { ("", "") };
    println!("| step | wall ms | host enqueue ms | host wait ms | device ms | local ms | peer ms | verify ms | commit ms | arm local / peer | payload GB/s |{quantized_head}");
    println!("|---|---|---|---|---|---|---|---|---|---|---|{quantized_rule}");
    for (name, r) in &rows {
        let payload: u64 = r.bytes.iter().sum::<u64>().max(r.installed_bytes);
        let quantized = if layout.is_some() { format!(" {} |", r.quantized_elements) } else { String::new() };
        println!(
            "| {name} | {:.2} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} / {} | {:.0} |{quantized}",
            ms(r.wall_ns),
            ms(r.enqueue_ns),
            ms(r.wait_ns),
            ms(r.device_ns),
            ms(r.local_ns),
            ms(r.peer_ns),
            ms(r.verify_ns),
            ms(r.commit_ns),
            arm_name(r.arm[0]),
            arm_name(r.arm[1]),
            payload as f64 / r.wall_ns.max(1) as f64,
        );
    }
    println!(
        "\nColumns (refit_run_stats): wall: the whole call on the host; host enqueue: queueing the work (constant \
         whatever the segment count); host wait: blocked on the device (these calls run outside a scope, so they \
         return complete); device: the step's span on the device; local / peer: the copies within a device and \
         {between}, which run side by side; verify: checking every copied byte on the device (the kernel's \
         against digests of what it read, the copy engine's against the sources); commit: installing staging \
         into the live buffers; arm: how each route kind moved (kernel, copy engine, or both: long runs by the copy engine); \
         payload GB/s: bytes moved (installed, for the commit) per wall second{1}{0}.",
        if layout.is_some() {
            "; quantized elements: those the call quantized to FP8 (a direct run all of them; a staged run those \
             quantized in place, into staging that its commit installs; a commit those quantized from the needs' \
             staging)"
        } else {
            ""
        },
        if on_gpu {
            ""
        } else {
            " (on the host backend every copy is a memcpy on a simulated stream's thread, and the first staged run \
             also touches its freshly allocated staging for the first time)"
        }
    );

    refit_plan_destroy(plan);
    refit_group_destroy(group);
    for (b, buffer) in workload.buffers.iter().enumerate().filter(|&(b, _)| bases[b] != 0) {
        // SAFETY: allocated above; nothing queued uses it any more (the group is destroyed).
        unsafe { backend.free(buffer.endpoint.device as i32, bases[b]) }.map_err(|e| e.to_string())?;
    }
    for (device, base, _) in arenas {
        // SAFETY: allocated by allocate_arenas; nothing queued uses it any more.
        unsafe { backend.free(device as i32, base) }.map_err(|e| e.to_string())?;
    }
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
