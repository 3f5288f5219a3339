//! A refit between two processes on one GPU through CUDA IPC, against the single-process executor on
//! the same GPU in the same run (issue 16's target: at most 1.05x its time).
//!
//! The demo's tables: Qwen3-30B-A3B (REFIT_BENCH_LAYERS layers, default 24), Megatron publishers and
//! vLLM receivers, one endpoint each on GPU 0, BF16. Twice, through the executor C callers get:
//! - one process: publishers and receivers in it; `Executor::new` on a group of GPU 0 moves every
//!   byte (same-device routes, the batched kernel);
//! - two processes (this binary run again): publishers in process 0, receivers in process 1; the plan
//!   is built across them (each its share) and `Executor::new_across` moves the routes between them
//!   through CUDA IPC: process 0's batched kernel writes straight into process 1's buffers. The
//!   communicator is a host-backend one (NCCL puts no two ranks on one GPU), which coordinates the
//!   IPC handles and the two meetings per step.
//!
//! Each side: a warm-up step, then REFIT_BENCH_STEPS timed steps (default 10) outside a scope (each
//! complete on return), wall time, median; after the last step every received element is checked
//! against its known value. Prints a markdown table; writes `$REFIT_BENCH_RESULTS/gpu_comm.json`
//! (default `benches/results/`).

#[path = "processes_support/mod.rs"]
mod processes_support;

use processes_support::field;
use refit::across::build_plan;
use refit::exec::{ExecOptions, Executor};
use refit::group::{Group, GroupOptions};
use refit::plan::{self, Endpoint, PlanOptions};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::cuda::cuda_backend;
use refit::transport::Backend;
use refit_workloads::{Megatron, Model, Packing, Role, Spec, Vllm, Workload};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The demo's spec with publishers on `publisher` and receivers on `receiver` (GPU 0 both).
fn spec(layers: u64, publisher: u32, receiver: u32) -> Spec {
    let at = |process| vec![Endpoint { process, device: 0 }];
    Spec {
        model: Model::qwen3_30b_a3b().with_layers(layers),
        publishers: Megatron { endpoints: at(publisher), tp: 1, ep: 1, grouped_experts: true },
        publisher_layout: Packing::Separate,
        receivers: Vllm { endpoints: at(receiver) },
        receiver_layout: Packing::Separate,
        digests: false,
    }
}

/// Device buffers for the workload's buffers of `process` (0 elsewhere), publishers filled with
/// their known values, receivers poisoned.
fn allocate(workload: &Workload, backend: &Arc<dyn Backend>, process: u32) -> Vec<u64> {
    let mut host: Vec<Vec<u8>> = workload
        .buffers
        .iter()
        .map(|b| if b.endpoint.process == process { vec![0xa5; b.bytes as usize] } else { Vec::new() })
        .collect();
    {
        let mut views: Vec<&mut [u8]> = host.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mine: Vec<bool> = workload.buffers.iter().map(|b| b.endpoint.process == process).collect();
        if mine.iter().zip(&workload.buffers).any(|(m, b)| *m && b.role == Role::Publisher) {
            workload.fill_offers(&mut views);
        }
    }
    workload
        .buffers
        .iter()
        .zip(&host)
        .map(|(b, bytes)| {
            if b.endpoint.process != process {
                return 0;
            }
            let ptr = backend.alloc(0, b.bytes as usize).expect("device memory");
            // SAFETY: just allocated with this many bytes.
            unsafe { backend.write(0, ptr, bytes) }.expect("upload");
            ptr
        })
        .collect()
}

/// Every needed element of `process`'s receivers, checked; the elements checked.
fn check(workload: &Workload, backend: &Arc<dyn Backend>, bases: &[u64], process: u32) -> u64 {
    let host: Vec<Vec<u8>> = workload
        .buffers
        .iter()
        .zip(bases)
        .map(|(b, &ptr)| {
            if b.endpoint.process != process || b.role != Role::Receiver {
                return vec![0; b.bytes as usize];
            }
            let mut bytes = vec![0u8; b.bytes as usize];
            // SAFETY: allocated with this many bytes.
            unsafe { backend.read(0, ptr, &mut bytes) }.expect("download");
            bytes
        })
        .collect();
    let views: Vec<&[u8]> = host.iter().map(|v| v.as_slice()).collect();
    workload.check_needs(&views).unwrap_or_else(|e| panic!("process {process}: {e}"))
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The single-process executor: milliseconds per step (median) and the bytes moved.
fn one_process(layers: u64, steps: usize) -> (f64, u64) {
    let workload = Workload::generate(&spec(layers, 0, 0)).expect("workload");
    let group = Group::new(&[0], GroupOptions::default()).expect("a group of GPU 0");
    let backend = Arc::clone(group.backend());
    let bases = allocate(&workload, &backend, 0);
    let plan = plan::build(&workload.tables(&bases).unwrap(), &PlanOptions::default()).unwrap();
    let mut executor = Executor::new(&group, &plan, 0, ExecOptions::default()).unwrap();
    let mut times = Vec::new();
    for step in 0..=steps {
        let start = Instant::now();
        // SAFETY: every address in the plan is a buffer allocated above.
        unsafe { executor.run(&group) }.unwrap();
        if step > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    check(&workload, &backend, &bases, 0);
    drop(executor);
    for &ptr in &bases {
        // SAFETY: ours, idle.
        unsafe { backend.free(0, ptr) }.unwrap();
    }
    (median(times), plan.stats().needed_bytes)
}

/// One of the two processes: 0 publishes, 1 receives and checks; both run the executor across.
fn child(rank: usize, id: &CommId, layers: u64, steps: usize) {
    let options = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    let comm = Arc::new(Communicator::create(id, 2, rank, 0, options).unwrap());
    let workload = Workload::generate(&spec(layers, 0, 1)).expect("workload");
    let group = Group::new(&[0], GroupOptions::default()).expect("a group of GPU 0");
    let backend = Arc::clone(group.backend());
    let bases = allocate(&workload, &backend, rank as u32);
    let tables = workload.tables(&bases).unwrap();
    let share = build_plan(&comm, &tables[rank], &PlanOptions::default()).unwrap();
    let mut executor =
        Executor::new_across(&group, &share, Arc::clone(&comm), ExecOptions::default()).unwrap();
    let mut times = Vec::new();
    let mut last = None;
    for step in 0..=steps {
        let start = Instant::now();
        // SAFETY: every address of the share is a buffer of this process, or opened from the peer.
        last = Some(unsafe { executor.run(&group) }.unwrap());
        if step > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let stats = last.expect("a run");
    if rank == 0 {
        println!(
            "ipc_ms={} ipc_bytes={} wire_bytes={} segments={}",
            median(times),
            stats.remote_ipc_bytes,
            stats.remote_wire_bytes,
            stats.segments[2]
        );
    } else {
        println!("checked_elements={}", check(&workload, &backend, &bases, 1));
    }
    comm.allgather_bytes(b"done").unwrap();
    drop(executor);
    for &ptr in bases.iter().filter(|&&p| p != 0) {
        // SAFETY: ours; every peer is done with it.
        unsafe { backend.free(0, ptr) }.unwrap();
    }
}

fn main() {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let layers = env_number("REFIT_BENCH_LAYERS", 24);
    let steps = env_number("REFIT_BENCH_STEPS", 10).max(1) as usize;
    if let Some((rank, id)) = processes_support::child_role() {
        child(rank, &id, layers, steps);
        return;
    }
    let device = cuda_backend().map(|b| b.device_name(0)).unwrap_or_else(|e| panic!("needs a GPU: {e}"));
    let (single_ms, bytes) = one_process(layers, steps);
    // Both processes run at once: they meet on the communicator.
    let outputs = processes_support::run_two();
    let ipc_ms = field(&outputs[0], "ipc_ms").expect("process 0 reports its time");
    let ipc_bytes = field(&outputs[0], "ipc_bytes").expect("process 0 reports its IPC bytes");
    let wire_bytes = field(&outputs[0], "wire_bytes").expect("process 0 reports its wire bytes");
    assert_eq!((ipc_bytes as u64, wire_bytes as u64), (bytes, 0), "every byte went through IPC");
    let checked = field(&outputs[1], "checked_elements").expect("process 1 checked its elements");
    let gbps = |ms: f64| bytes as f64 / ms / 1e6;
    println!("\n| refit of {layers} layers on {device} | bytes | median ms | GB/s |");
    println!("|---|---|---|---|");
    println!(
        "| one process, executor (batched kernel) | {bytes} | {single_ms:.3} | {:.1} |",
        gbps(single_ms)
    );
    println!(
        "| two processes, executor across: CUDA IPC writes (batched kernel) | {bytes} | {ipc_ms:.3} | {:.1} |",
        gbps(ipc_ms)
    );
    println!("| ratio two processes / one process | | {:.3} | |", ipc_ms / single_ms);
    println!("({checked} elements checked in process 1)");
    let gpus = cuda_backend().map(|b| b.device_count()).unwrap_or(0);
    let json = format!(
        "{{\"bench\":\"gpu_comm\",\"device\":\"{device}\",\"gpus\":{gpus},\"layers\":{layers},\"steps\":{steps},\
         \"bytes\":{bytes},\"one_process_ms\":{single_ms:.4},\"two_processes_ipc_ms\":{ipc_ms:.4},\
         \"ratio\":{:.4},\"elements_checked\":{checked}}}\n",
        ipc_ms / single_ms
    );
    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let path = std::path::Path::new(&dir).join("gpu_comm.json");
    std::fs::write(&path, json).unwrap();
    println!("wrote {}", path.display());
}
