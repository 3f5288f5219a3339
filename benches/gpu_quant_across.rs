//! A quantized refit between two processes on one GPU through CUDA IPC (issue 29: where a need's
//! blocks lie whole in the sender's offers, the sender quantizes and FP8 crosses, not BF16).
//!
//! Process 0 offers a 1 GiB bf16 matrix (65536 x 8192, REFIT_BENCH_ROWS rows); process 1 receives it
//! three ways, each through `Executor::new_across` (a host-backend communicator: NCCL puts no two
//! ranks on one GPU, so every byte between the processes goes through CUDA IPC):
//! - sender: as e4m3 in 128 x 128 blocks, the offer whole: process 0's quantizing kernel writes
//!   the codes and scales into process 1's memory (`QuantPath::Sender`, straight through IPC);
//! - staged: the same need, but the offer cut at row 64 into two, so a block spans them: the bf16
//!   crosses into process 1's staging and process 1 quantizes it (`QuantPath::Staged`), what a user
//!   re-quantizing in the engine after a BF16 transfer does;
//! - bf16: the matrix itself as a plain need, what the transfer of BF16 alone costs;
//! - tensor: as e4m3 with one scale (vLLM's online per-tensor arithmetic), the offer whole: the
//!   sender reads the matrix twice (its amax, then the codes) and writes the codes;
//! - tensor split: the same need, each process offering half the rows (a tensor-parallel trainer):
//!   each quantizes its half (process 1 in place), the two exchanging the amax at every step (each
//!   reads its half for it, one meeting), so that the one scale is the whole matrix's.
//!
//! Peer in the same run: one copy-engine copy of the 1 GiB in process 0 (`Backend::copy_segments`:
//! one `cuMemcpyAsync`), the copy
//! rate the bound is taken at: 3 bytes per element (read 2, write 1) as for a quantization in one
//! process, 5 per tensor (the amax's read too). Each way: a warm-up step, then REFIT_BENCH_STEPS timed steps (default 10), wall time,
//! median; then process 1 compares every code and scale with the same matrix quantized by the GPU in
//! its own process (`Backend::quantize_batch`, whose kernel tests/gpu_quant.rs checks against the
//! reference). Prints a markdown table; writes `$REFIT_BENCH_RESULTS/gpu_quant_across.json`.

#[path = "processes_support/mod.rs"]
mod processes_support;

use refit::across::build_plan;
use refit::exec::{ExecOptions, Executor, RunStats};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{Endpoint, Need, Offer, PlanOptions, QuantNeed, QuantPath, Region, Table, TensorSpec};
use refit::quant::{Arithmetic, Fp8, Granularity, QuantJob, Quantization, SourceType};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::cuda::cuda_backend;
use refit::transport::{Backend, Stream};
use refit::Segment;
use std::sync::Arc;
use std::time::{Duration, Instant};

const COLS: u64 = 8192;
const BLOCK: Quantization = Quantization::new(Fp8::E4m3fn, Granularity::Block { rows: 128, cols: 128 });

fn per_tensor() -> Quantization {
    Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::VllmTensor)
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The matrix's bf16 bytes: finite values over a few binades and, when `specials`, a NaN and an
/// infinity now and then. The per-tensor ways take it without: one NaN would make the whole
/// matrix's scale NaN, every code 0x7f, and the kernel's division path (taken only for such
/// scales) what is timed.
fn matrix(rows: u64, specials: bool) -> Vec<u8> {
    (0..rows * COLS)
        .flat_map(|i| {
            let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            let bits = match i % 1_000_003 {
                7 if specials => 0x7f80,
                11 if specials => 0x7fc0,
                _ => ((h & 0x8000) | ((110 + (h >> 16) % 24) << 7) | (h & 0x7f)) as u16,
            };
            bits.to_le_bytes()
        })
        .collect()
}

/// The ways process 1 receives the matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    Sender,
    Staged,
    Bf16,
    Tensor,
    TensorSplit,
}

impl Way {
    fn quantization(self) -> Quantization {
        match self {
            Way::Tensor | Way::TensorSplit => per_tensor(),
            _ => BLOCK,
        }
    }

    /// The rows of the matrix process `rank` offers: (first, count) each.
    fn offered(self, rank: usize, rows: u64) -> Vec<(u64, u64)> {
        match (rank, self) {
            (0, Way::Staged) => vec![(0, 64), (64, rows - 64)],
            (0, Way::TensorSplit) => vec![(0, rows / 2)],
            (0, _) => vec![(0, rows)],
            (_, Way::TensorSplit) => vec![(rows / 2, rows - rows / 2)],
            _ => vec![],
        }
    }
}

struct Device {
    backend: Arc<dyn Backend>,
    buffers: Vec<u64>,
}

impl Device {
    fn alloc(&mut self, bytes: u64) -> u64 {
        let ptr = self.backend.alloc(0, bytes as usize).expect("device memory");
        self.buffers.push(ptr);
        ptr
    }

    fn download(&self, ptr: u64, bytes: u64) -> Vec<u8> {
        let mut out = vec![0u8; bytes as usize];
        // SAFETY: a buffer of ours of at least this many bytes.
        unsafe { self.backend.read(0, ptr, &mut out) }.expect("download");
        out
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        for &ptr in &self.buffers {
            // SAFETY: ours, idle.
            let _ = unsafe { self.backend.free(0, ptr) };
        }
    }
}

/// One process's part of one way: milliseconds per step (median), the last step's stats, the
/// bytes of codes and scales its quantizing kernel wrote straight into the other process, and
/// where the need's codes and scales (or its bf16) are.
fn refit_one_way(
    comm: &Arc<Communicator>,
    group: &Group,
    device: &mut Device,
    src: u64,
    way: Way,
    rows: u64,
    steps: usize,
) -> (f64, RunStats, u64, u64, u64) {
    let rank = comm.rank();
    let here = Endpoint { process: rank as u32, device: 0 };
    let spec = TensorSpec { name: "w".into(), dtype: 1, elem_size: 2, shape: vec![rows, COLS] };
    let mut table = Table {
        tensors: vec![spec],
        offers: vec![],
        needs: vec![],
        quant_needs: vec![],
        shared_amax: vec![],
    };
    let (mut codes, mut scales) = (0, 0);
    for (lo, n) in way.offered(rank, rows) {
        table.offers.push(Offer {
            tensor: 0,
            owner: here,
            addr: src + lo * COLS * 2,
            region: Region { offset: vec![lo, 0], extent: vec![n, COLS] },
            strides: None,
            digest: None,
        });
    }
    if rank == 0 {
        // Only offers.
    } else if way == Way::Bf16 {
        let addr = device.alloc(rows * COLS * 2);
        codes = addr;
        table.needs.push(Need {
            tensor: 0,
            receiver: here,
            addr,
            region: Region { offset: vec![0, 0], extent: vec![rows, COLS] },
            perm: None,
            strides: vec![COLS, 1],
        });
    } else {
        let quantization = way.quantization();
        let (grid_rows, grid_cols) = quantization.scale_grid(rows, COLS);
        codes = device.alloc(rows * COLS);
        scales = device.alloc(grid_rows * grid_cols * 4);
        let staging = if way == Way::Staged { device.alloc(rows * COLS * 2) } else { 0 };
        table.quant_needs.push(QuantNeed {
            tensor: 0,
            receiver: here,
            addr: codes,
            region: Region { offset: vec![0, 0], extent: vec![rows, COLS] },
            strides: vec![COLS, 1],
            quantization,
            source: SourceType::Bf16,
            scales,
            scale_row_stride: grid_cols,
            scale_matrix_stride: grid_rows * grid_cols,
            staging,
        });
    }
    let share = build_plan(comm, &table, &PlanOptions::default()).expect("a share");
    let path = |runner: u32| match way {
        Way::Sender | Way::Tensor => Some(QuantPath::Sender),
        Way::Staged => Some(QuantPath::Staged),
        Way::Bf16 => None,
        Way::TensorSplit if runner == 0 => Some(QuantPath::Sender),
        Way::TensorSplit => Some(QuantPath::Direct),
    };
    let routes = share.quant_routes();
    assert!(routes.iter().all(|r| Some(r.path) == path(r.runner.process)), "{way:?}: {routes:?}");
    assert_eq!(share.amax_exchange().is_empty(), way != Way::TensorSplit, "{way:?}");
    let mut executor =
        Executor::new_across(group, &share, Arc::clone(comm), ExecOptions::default()).expect("an executor");
    let mut times = Vec::new();
    let mut last = None;
    for step in 0..=steps {
        let start = Instant::now();
        // SAFETY: every address of the share is a buffer of this process, or opened from the peer.
        last = Some(unsafe { executor.run(group) }.expect("a step"));
        if step > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let straight = executor.remote_totals().map_or(0, |t| t.quantized_straight_bytes);
    (median(times), last.expect("a step"), straight, codes, scales)
}

fn child(rank: usize, id: &CommId, rows: u64, steps: usize) {
    let options = CommOptions { timeout: Duration::from_secs(300), ..CommOptions::default() };
    let comm = Arc::new(Communicator::create(id, 2, rank, 0, options).expect("a communicator"));
    let group = Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 })
        .expect("a group of GPU 0");
    let mut device = Device { backend: Arc::clone(group.backend()), buffers: Vec::new() };
    let bytes = rows * COLS * 2;
    let data = matrix(rows, true);
    let src = device.alloc(bytes);
    // SAFETY: allocated with this many bytes.
    unsafe { device.backend.write(0, src, &data) }.expect("upload");
    let finite = device.alloc(bytes);
    // SAFETY: as above.
    unsafe { device.backend.write(0, finite, &matrix(rows, false)) }.expect("upload");
    let mut line = String::new();
    if rank == 0 {
        // The copy engine's rate over the same bytes, in this process.
        let dst = device.alloc(bytes);
        let mut times = Vec::new();
        for step in 0..=steps {
            let start = Instant::now();
            // SAFETY: both ours, `bytes` long.
            unsafe { device.backend.copy_segments(0, Stream::NULL, &[Segment::contiguous(src, dst, bytes)]) }
                .expect("a copy");
            device.backend.sync_stream(0, Stream::NULL).expect("the copy ends");
            if step > 0 {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        line += &format!("copy_ms={} ", median(times));
    }
    // Process 1's references: the matrix quantized on this GPU in this process.
    let reference = |quantization: Quantization, src: u64, device: &mut Device| {
        let (grid_rows, grid_cols) = quantization.scale_grid(rows, COLS);
        let (codes, scales) = (device.alloc(rows * COLS), device.alloc(grid_rows * grid_cols * 4));
        let job = QuantJob {
            quantization,
            source: SourceType::Bf16,
            src,
            rows,
            cols: COLS,
            src_stride: COLS,
            dst: codes,
            dst_stride: COLS,
            scales,
            scale_stride: grid_cols,
            amax_key: 0,
        };
        // SAFETY: our buffers, sized for the job.
        unsafe { device.backend.quantize_batch(0, Stream::NULL, &[job]) }
            .expect("the reference quantization");
        device.backend.sync_stream(0, Stream::NULL).expect("the reference ends");
        (device.download(codes, rows * COLS), device.download(scales, grid_rows * grid_cols * 4))
    };
    let references = (rank == 1)
        .then(|| [reference(BLOCK, src, &mut device), reference(per_tensor(), finite, &mut device)]);
    for way in [Way::Sender, Way::Staged, Way::Bf16, Way::Tensor, Way::TensorSplit] {
        let source = if way.quantization() == BLOCK { src } else { finite };
        let (ms, stats, straight, codes, scales) =
            refit_one_way(&comm, &group, &mut device, source, way, rows, steps);
        let name = format!("{way:?}").to_lowercase();
        // Where the sender's step went, on the host: queueing, and waiting (the meetings included).
        line += &format!(
            "{name}_ms_{rank}={ms} {name}_enqueue_ms_{rank}={} {name}_wait_ms_{rank}={} ",
            stats.enqueue_ns as f64 / 1e6,
            stats.wait_ns as f64 / 1e6
        );
        if rank == 0 {
            line +=
                &format!("{name}_ms={ms} {name}_sent={} {name}_straight={straight} ", stats.remote_ipc_bytes);
        } else {
            let matches = match (&references, way) {
                (_, Way::Bf16) => device.download(codes, bytes) == data,
                (Some(references), _) => {
                    let (want_codes, want_scales) = &references[usize::from(way.quantization() != BLOCK)];
                    device.download(codes, rows * COLS) == *want_codes
                        && device.download(scales, want_scales.len() as u64) == *want_scales
                }
                (None, _) => false,
            };
            line += &format!("{name}_exact={} ", u8::from(matches));
        }
        comm.allgather_bytes(b"next way").expect("a meeting");
    }
    println!("{line}");
}

/// A child's report `name=value`, which it must have made.
fn reported(text: &str, name: &str) -> f64 {
    processes_support::field(text, name).unwrap_or_else(|| panic!("a child reports {name}: {text}"))
}

fn main() {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let rows = env_number("REFIT_BENCH_ROWS", 65536);
    let steps = env_number("REFIT_BENCH_STEPS", 10).max(1) as usize;
    if let Some((rank, id)) = processes_support::child_role() {
        child(rank, &id, rows, steps);
        return;
    }
    let device = cuda_backend().map(|b| b.device_name(0)).unwrap_or_else(|e| panic!("needs a GPU: {e}"));
    let outputs = processes_support::run_two();
    let elements = rows * COLS;
    let copy_ms = reported(&outputs[0], "copy_ms");
    // The copy engine moved 2 bytes per element each way: its rate in bytes of traffic.
    let rate = 2.0 * 2.0 * elements as f64 / copy_ms;
    let bound_ms = 3.0 * elements as f64 / rate;
    println!("\n| {elements} bf16 from process 0 to process 1 on {device} | bytes crossing | of them written by the quantizing kernel | median ms | of the 3-byte bound ({bound_ms:.3} ms) | every byte equal |");
    println!("|---|---|---|---|---|---|");
    println!("| peer: one copy-engine copy of the bf16, in process 0 | | | {copy_ms:.3} | | |");
    let gpus = cuda_backend().map(|b| b.device_count()).unwrap_or(0);
    let mut json = format!(
        "{{\"bench\":\"gpu_quant_across\",\"device\":\"{device}\",\"gpus\":{gpus},\"rows\":{rows},\"cols\":{COLS},\"steps\":{steps},\
         \"copy_ms\":{copy_ms:.4},\"bound_ms\":{bound_ms:.4}"
    );
    for (name, what, bytes_per_element) in [
        ("sender", "e4m3 128 x 128, quantized by the sender (FP8 crosses)", 3.0),
        ("staged", "e4m3 128 x 128, quantized by the receiver (BF16 crosses)", 3.0),
        ("bf16", "bf16 itself (a plain need)", 3.0),
        ("tensor", "e4m3 per tensor, offered whole: quantized by the sender (bound: 5 bytes per element)", 5.0),
        (
            "tensorsplit",
            "e4m3 per tensor, half offered in each process: each quantizes its half, the amax exchanged (5 bytes)",
            5.0,
        ),
    ] {
        let bound_ms = bound_ms * bytes_per_element / 3.0;
        let (ms, sent) =
            (reported(&outputs[0], &format!("{name}_ms")), reported(&outputs[0], &format!("{name}_sent")));
        let straight = reported(&outputs[0], &format!("{name}_straight"));
        let exact = reported(&outputs[1], &format!("{name}_exact")) == 1.0;
        println!(
            "| {what} | {sent} | {straight} | {ms:.3} | {:.2} | {} |",
            bound_ms / ms,
            if exact { "yes" } else { "NO" }
        );
        json += &format!(
            ",\"{name}_ms\":{ms:.4},\"{name}_bytes_crossing\":{sent},\"{name}_bytes_straight\":{straight},\"{name}_exact\":{exact}"
        );
        assert!(exact, "{name}: process 1's bytes differ from the reference");
    }
    println!("\n| way | process | median ms | host enqueue ms | host wait ms (last step) |");
    println!("|---|---|---|---|---|");
    for name in ["sender", "staged", "bf16", "tensor", "tensorsplit"] {
        for (rank, output) in outputs.iter().enumerate() {
            let field = |what: &str| reported(output, &format!("{name}_{what}_{rank}"));
            println!(
                "| {name} | {rank} | {:.3} | {:.3} | {:.3} |",
                field("ms"),
                field("enqueue_ms"),
                field("wait_ms")
            );
        }
    }
    json += "}\n";
    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let path = std::path::Path::new(&dir).join("gpu_quant_across.json");
    std::fs::write(&path, json).unwrap();
    println!("wrote {}", path.display());
}
