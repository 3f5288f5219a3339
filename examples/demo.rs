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
                        as much memory again as the receivers' buffers)
  --processes P         run publishers and receivers as P separate processes (examples/across/)
  --serve S             what receivers get: bf16 (default) or fp8 (2-D weights as e4m3fn codes with
                        fp32 scales per 128 x 128 block, quantized from finite bf16 publishers on the
                        way; norms stay bf16); every code and scale is checked against the reference
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
/// similar size: `(box, first row, rows)`.
fn row_work(workload: &Workload, boxes: &[Placed]) -> Vec<(usize, u64, u64)> {
    let total: u64 = boxes.iter().map(|p| workload.bytes(p)).sum();
    let chunk = (total / (threads() as u64 * 8)).max(1 << 20);
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
    let next = AtomicU64::new(0);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads())
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(&(b, first, rows)) = work.get(i) else { return Ok(()) };
                    f(b, first, rows)?;
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().expect("worker thread"))
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

/// Receiver buffers are poisoned and read back in pieces of this many bytes (a progress line can
/// come between two pieces, and no copy of a whole buffer is held).
const PIECE: u64 = 64 << 20;

/// Every receiver buffer's pieces, then every arena's: (device, address, length).
fn receiver_pieces(w: &Workload, memory: &Memory) -> Vec<(i32, u64, u64)> {
    let buffers = w.buffers.iter().enumerate().filter(|(_, x)| x.role == Role::Receiver);
    let regions = buffers.map(|(b, x)| (x.endpoint.device, memory.bases[b], x.bytes));
    let mut pieces = Vec::new();
    for (device, base, bytes) in regions.chain(memory.arenas.iter().copied()) {
        let mut at = 0;
        while at < bytes {
            pieces.push((device as i32, base + at, PIECE.min(bytes - at)));
            at += PIECE;
        }
    }
    pieces
}

/// Overwrites every receiver buffer (and arena) with POISON.
fn poison_receivers(w: &Workload, memory: &Memory) -> Result<(), String> {
    let pieces = receiver_pieces(w, memory);
    let total = pieces.iter().map(|p| p.2).sum();
    let poison = vec![POISON; PIECE as usize];
    with_progress("poisoning receiver buffers", total, |done| {
        for (device, at, len) in pieces {
            // SAFETY: each piece lies inside a buffer or arena allocated on this device.
            unsafe { memory.backend.write(device, at, &poison[..len as usize]) }
                .map_err(|e| e.to_string())?;
            done.fetch_add(len, Ordering::Relaxed);
        }
        Ok(())
    })
}

/// Whether every receiver byte (arenas too) still holds POISON.
fn receivers_poisoned(w: &Workload, memory: &Memory) -> Result<bool, String> {
    let pieces = receiver_pieces(w, memory);
    let total = pieces.iter().map(|p| p.2).sum();
    let mut bytes = vec![0u8; PIECE as usize];
    with_progress("checking the live buffers are untouched", total, |done| {
        for (device, at, len) in pieces {
            let piece = &mut bytes[..len as usize];
            // SAFETY: as in poison_receivers.
            unsafe { memory.backend.read(device, at, piece) }.map_err(|e| e.to_string())?;
            if piece.iter().any(|&x| x != POISON) {
                return Ok(false);
            }
            done.fetch_add(len, Ordering::Relaxed);
        }
        Ok(true)
    })
}

/// The memory the demo will use, printed before it allocates: every buffer, the staged phase's
/// staging on each receiving device (its received bytes, at most `staging_limit`), and on GPUs the
/// host image of the largest buffer (filled or checked on the host, one buffer at a time), and the
/// FP8 arenas of `--serve fp8` (`arenas`: device, bytes).
fn print_memory_need(
    w: &Workload,
    on_gpu: bool,
    staging_limit: u64,
    arenas: &[(u32, u64)],
) -> Result<(), String> {
    let mut per_device: std::collections::BTreeMap<u32, u64> = Default::default();
    for buffer in &w.buffers {
        *per_device.entry(buffer.endpoint.device).or_default() += buffer.bytes;
    }
    for &(device, bytes) in arenas {
        *per_device.entry(device).or_default() += bytes;
    }
    let fp8: u64 = arenas.iter().map(|a| a.1).sum();
    let mut staging = 0;
    for (endpoint, bytes) in w.need_bytes() {
        let staged = if staging_limit == 0 { bytes } else { bytes.min(staging_limit) };
        *per_device.entry(endpoint.device).or_default() += staged;
        staging += staged;
    }
    let buffers: u64 = w.buffers.iter().map(|b| b.bytes).sum();
    if on_gpu {
        let largest = w.buffers.iter().map(|b| b.bytes).max().unwrap_or(0);
        let each: Vec<String> =
            per_device.iter().map(|(d, bytes)| format!("GPU {d} {:.2} GiB", gib(*bytes))).collect();
        println!(
            "  needs device memory: {} (buffers, then staging in phase 2); host memory: {:.2} GiB (the largest buffer's image)",
            each.join(", "),
            gib(largest)
        );
        return Ok(());
    }
    let need = buffers + fp8 + staging + PIECE;
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib << 10)
    });
    println!(
        "  needs about {:.1} GB of host memory: buffers {:.2} GiB{}, staging {:.2} GiB (phase 2), checks {:.2} GiB{}",
        need as f64 / 1e9,
        gib(buffers),
        if fp8 > 0 { format!(", FP8 codes and scales {:.2} GiB", gib(fp8)) } else { String::new() },
        gib(staging),
        gib(PIECE),
        available.map_or(String::new(), |a| format!("; {:.1} GB available", a as f64 / 1e9))
    );
    if available.is_some_and(|a| a < need) {
        return Err(format!(
            "not enough host memory for this run: {:.1} GB needed; a smaller --staging-limit lowers it",
            need as f64 / 1e9
        ));
    }
    Ok(())
}

/// Checks every received element of the needs that are not `quantized` (by need index; empty:
/// none is) against its known value; returns the elements checked.
fn check_receivers(w: &Workload, memory: &Memory, values: Values, quantized: &[bool]) -> Result<u64, String> {
    let plain = |i: usize| !quantized.get(i).copied().unwrap_or(false);
    let total = w.needs.iter().enumerate().filter(|(i, _)| plain(*i)).map(|(_, p)| w.bytes(p)).sum();
    let checked = AtomicU64::new(0);
    with_progress("checking every received element", total, |done| {
        for (b, buffer) in w.buffers.iter().enumerate().filter(|(_, x)| x.role == Role::Receiver) {
            let needs: Vec<Placed> = (w.needs.iter().enumerate())
                .filter(|&(i, n)| n.buffer as usize == b && plain(i))
                .map(|(_, n)| n.clone())
                .collect();
            if needs.is_empty() {
                // Every need of the buffer is quantized: it receives nothing.
                continue;
            }
            let mut image = memory.image(w, b, true)?;
            let ptr = memory.pointer(&mut image, b);
            parallel(&row_work(w, &needs), |i, first, rows| {
                let n = &needs[i];
                let es = w.catalog.tensors[n.tensor as usize].elem_size as usize;
                let inner = *n.region.extent.last().expect("a box has dimensions");
                for r in first..first + rows {
                    let (at, global) = row(w, n, r);
                    let base = ptr.at(at as usize);
                    let mask = if es >= 8 { u64::MAX } else { (1u64 << (8 * es)) - 1 };
                    for c in 0..inner {
                        // SAFETY: the need lies inside its buffer.
                        let got = unsafe { read_element(base.add(c as usize * es), es) };
                        if got != values.get(n.tensor, global + c, es) & mask {
                            let tensor = &w.catalog.tensors[n.tensor as usize].name;
                            return Err(format!(
                                "{}: element {} of {tensor} is wrong",
                                buffer.name,
                                global + c
                            ));
                        }
                    }
                    checked.fetch_add(inner, Ordering::Relaxed);
                    done.fetch_add(inner * es as u64, Ordering::Relaxed);
                }
                Ok(())
            })?;
        }
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
            l.quantize_tables(w, &mut tables)?;
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

fn empty_stats() -> RunStats {
    RunStats::default()
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
    let available = cuda.as_ref().map_or(2, |b| b.device_count());
    let devices = args.devices.unwrap_or(available.min(2));
    let backend: Arc<dyn Backend> = match cuda {
        Some(cuda) => cuda,
        None => Arc::new(HostBackend::new(devices).map_err(|e| e.to_string())?),
    };
    // The host backend keeps every simulated device in this machine's memory: one layer by default.
    let layers = args.layers.unwrap_or(if on_gpu { 48 } else { 1 });

    let mut options = unsafe { std::mem::zeroed::<refit_group_options>() };
    ok(refit_group_options_init(&mut options), "refit_group_options_init")?;
    options.backend = if on_gpu { REFIT_BACKEND_CUDA } else { REFIT_BACKEND_HOST };
    let ordinals: Vec<i32> = (0..devices as i32).collect();
    let mut group = std::ptr::null_mut();
    ok(refit_group_create(ordinals.as_ptr(), ordinals.len(), &options, &mut group), "refit_group_create")?;

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
    println!(
        "refit demo: Qwen3-30B-A3B ({layers} of 48 layers, BF16), Megatron EP{devices} publishers -> vLLM TP{devices} \
         receivers, colocated on {devices} {} ({}), publisher layout {:?}",
        if on_gpu { "CUDA device(s)" } else { "simulated device(s) of the host backend: threads and host memory" },
        backend.device_name(0),
        args.layout,
    );

    let workload = Workload::generate(&spec).map_err(|e| e.to_string())?;
    let total: u64 = workload.buffers.iter().map(|b| b.bytes).sum();
    let mut layout = match args.serve {
        Serve::Bf16 => None,
        Serve::Fp8 => Some(fp8::Layout::new(&workload)?),
    };
    let live_kinds = [fp8::Kind::Codes, fp8::Kind::Scales];
    let arena_sizes: Vec<(u32, u64)> = layout.as_ref().map_or(Vec::new(), |l| {
        l.arenas(&live_kinds).into_iter().map(|(device, _, bytes)| (device, bytes)).collect()
    });
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
    print_memory_need(&workload, on_gpu, args.staging_limit_mib << 20, &arena_sizes)?;
    println!("[1/5] allocating {} buffers, {:.2} GiB", workload.buffers.len(), gib(total));
    let mut bases = Vec::with_capacity(workload.buffers.len());
    for buffer in &workload.buffers {
        bases.push(
            backend.alloc(buffer.endpoint.device as i32, buffer.bytes as usize).map_err(|e| e.to_string())?,
        );
    }
    let mut arenas = Vec::new();
    if let Some(l) = &mut layout {
        let fp8_total: u64 = arena_sizes.iter().map(|a| a.1).sum();
        println!("  and {} FP8 arenas (codes, scales), {:.2} GiB", arena_sizes.len(), gib(fp8_total));
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
    let mut s = unsafe { std::mem::zeroed::<refit::plan::PlanStats>() };
    s.size = std::mem::size_of::<refit::plan::PlanStats>();
    // SAFETY: a live plan; `s` has its size set.
    ok(unsafe { refit_plan_get_stats(plan, &mut s) }, "refit_plan_get_stats")?;
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

    let make = |commit: u32, verify: bool, staging_mib: u64| -> Result<*mut refit_executor, String> {
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
        println!(
            "  executor created in {:.1} ms (descriptors built and uploaded, staging allocated)",
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(executor)
    };

    println!("[4/5] phase 1: {} direct steps (each run writes the live buffers)", args.steps);
    poison_receivers(&workload, &memory)?;
    let direct = make(REFIT_COMMIT_DIRECT, false, 0)?;
    let mut rows = Vec::new();
    // Under --serve fp8 a step also reads the sources it quantizes in place (staged ones are needed
    // bytes already: the routes carry them into staging).
    let step_bytes = s.needed_bytes + s.quantized_direct_bytes;
    let mut last_rate = None;
    for step in 0..args.steps {
        let mut stats = empty_stats();
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
    let staged = make(REFIT_COMMIT_STAGED, true, args.staging_limit_mib)?;
    let mut staged_rate = None;
    for step in 1..=2 {
        poison_receivers(&workload, &memory)?;
        let mut ran = empty_stats();
        let what = format!("staged, verified run {step}");
        let status = with_step_progress(&what, step_bytes, staged_rate, || {
            refit_executor_run(staged, group, &mut ran)
        });
        ok(status, "refit_executor_run")?;
        staged_rate = Some(gib(step_bytes) / (ran.wall_ns.max(1) as f64 / 1e9));
        if ran.slices > 1 {
            println!(
                "  step {step}: {} slices; the run installed all but the last (the guarantee is per slice)",
                ran.slices
            );
        } else if receivers_poisoned(&workload, &memory)? {
            println!("  step {step}: after the run every live byte is unchanged (still the poison)");
        } else {
            return Err("a staged run changed live bytes before its commit".into());
        }
        let mut committed = empty_stats();
        let what = format!("commit {step}");
        let status = with_step_progress(&what, step_bytes, last_rate, || {
            refit_executor_commit(staged, group, &mut committed)
        });
        ok(status, "refit_executor_commit")?;
        rows.push((format!("staged run {step}"), ran));
        rows.push((format!("commit {step}"), committed));
    }
    refit_executor_destroy(staged);
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
    for (b, buffer) in workload.buffers.iter().enumerate() {
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
