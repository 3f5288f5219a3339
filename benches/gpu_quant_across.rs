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
//! - bf16: the matrix itself as a plain need, what the transfer of BF16 alone costs.
//!
//! Peer in the same run: one copy-engine copy of the 1 GiB in process 0 (`Backend::copy_segments`:
//! one `cuMemcpyAsync`), the copy
//! rate the bound is taken at: 3 bytes per element (read 2, write 1) as for a quantization in one
//! process. Each way: a warm-up step, then REFIT_BENCH_STEPS timed steps (default 10), wall time,
//! median; then process 1 compares every code and scale with the same matrix quantized by the GPU in
//! its own process (`Backend::quantize_batch`, whose kernel tests/gpu_quant.rs checks against the
//! reference). Prints a markdown table; writes `$REFIT_BENCH_RESULTS/gpu_quant_across.json`.

#[path = "processes_support/mod.rs"]
mod processes_support;

use refit::across::build_plan;
use refit::exec::{ExecOptions, Executor, RunStats};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{Endpoint, Need, Offer, PlanOptions, QuantNeed, QuantPath, Region, Table, TensorSpec};
use refit::quant::{Fp8, Granularity, QuantJob, Quantization, SourceType};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::cuda::cuda_backend;
use refit::transport::{Backend, Stream};
use refit::Segment;
use std::sync::Arc;
use std::time::{Duration, Instant};

const COLS: u64 = 8192;
const BLOCK: Quantization = Quantization::new(Fp8::E4m3fn, Granularity::Block { rows: 128, cols: 128 });

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The matrix's bf16 bytes: finite values over a few binades, a NaN and an infinity now and then.
fn matrix(rows: u64) -> Vec<u8> {
    (0..rows * COLS)
        .flat_map(|i| {
            let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            let bits = match i % 1_000_003 {
                7 => 0x7f80,
                11 => 0x7fc0,
                _ => ((h & 0x8000) | ((110 + (h >> 16) % 24) << 7) | (h & 0x7f)) as u16,
            };
            bits.to_le_bytes()
        })
        .collect()
}

/// The three ways process 1 receives the matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    Sender,
    Staged,
    Bf16,
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
    source: Option<u64>,
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
    if let Some(src) = source {
        let cuts: &[(u64, u64)] = if way == Way::Staged { &[(0, 64), (64, rows - 64)] } else { &[(0, rows)] };
        for &(lo, n) in cuts {
            table.offers.push(Offer {
                tensor: 0,
                owner: here,
                addr: src + lo * COLS * 2,
                region: Region { offset: vec![lo, 0], extent: vec![n, COLS] },
                strides: None,
                digest: None,
            });
        }
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
        let (grid_rows, grid_cols) = BLOCK.scale_grid(rows, COLS);
        codes = device.alloc(rows * COLS);
        scales = device.alloc(grid_rows * grid_cols * 4);
        let staging = if way == Way::Staged { device.alloc(rows * COLS * 2) } else { 0 };
        table.quant_needs.push(QuantNeed {
            tensor: 0,
            receiver: here,
            addr: codes,
            region: Region { offset: vec![0, 0], extent: vec![rows, COLS] },
            strides: vec![COLS, 1],
            quantization: BLOCK,
            source: SourceType::Bf16,
            scales,
            scale_row_stride: grid_cols,
            scale_matrix_stride: grid_rows * grid_cols,
            staging,
        });
    }
    let share = build_plan(comm, &table, &PlanOptions::default()).expect("a share");
    let path = match way {
        Way::Sender => Some(QuantPath::Sender),
        Way::Staged => Some(QuantPath::Staged),
        Way::Bf16 => None,
    };
    assert!(share.quant_routes().iter().all(|r| Some(r.path) == path), "{way:?}: {:?}", share.quant_routes());
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
    let data = matrix(rows);
    let src = device.alloc(bytes);
    // SAFETY: allocated with this many bytes.
    unsafe { device.backend.write(0, src, &data) }.expect("upload");
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
    // Process 1's reference: the matrix quantized on this GPU in this process.
    let reference = (rank == 1).then(|| {
        let (grid_rows, grid_cols) = BLOCK.scale_grid(rows, COLS);
        let (codes, scales) = (device.alloc(rows * COLS), device.alloc(grid_rows * grid_cols * 4));
        let job = QuantJob {
            quantization: BLOCK,
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
    });
    for way in [Way::Sender, Way::Staged, Way::Bf16] {
        let source = (rank == 0).then_some(src);
        let (ms, stats, straight, codes, scales) =
            refit_one_way(&comm, &group, &mut device, source, way, rows, steps);
        let name = format!("{way:?}").to_lowercase();
        if rank == 0 {
            line +=
                &format!("{name}_ms={ms} {name}_sent={} {name}_straight={straight} ", stats.remote_ipc_bytes);
        } else {
            let matches = match (&reference, way) {
                (_, Way::Bf16) => device.download(codes, bytes) == data,
                (Some((want_codes, want_scales)), _) => {
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
    for (name, what) in [
        ("sender", "e4m3 128 x 128, quantized by the sender (FP8 crosses)"),
        ("staged", "e4m3 128 x 128, quantized by the receiver (BF16 crosses)"),
        ("bf16", "bf16 itself (a plain need)"),
    ] {
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
    json += "}\n";
    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let path = std::path::Path::new(&dir).join("gpu_quant_across.json");
    std::fs::write(&path, json).unwrap();
    println!("wrote {}", path.display());
}
