//! Allgather on every GPU count the machine has (G = 1..=devices; code for any G): bytes received per
//! GPU per second for our PEER and NCCL algorithms and for `ncclAllGather` called directly in the same
//! process and run, per-rank sizes 1 MiB .. 1 GiB; the copy-engine probe both ways at once on
//! non-blocking streams versus the legacy null streams; the all-pull copy-engine ceiling of the
//! topology for each G; host time per call for tiny buffers. Markdown tables on stdout, JSON in
//! `$REFIT_BENCH_RESULTS/gpu_allgather.json` (default `benches/results/`).
//!
//! Timing: every measured stream first runs a short spin kernel (a gate), so that the host has queued
//! a whole batch before the GPU starts; CUDA events around the batch on every stream; the slowest
//! stream's time per call; median of several batches after warm-up batches.
//! "Received per GPU" is (G-1) x size / time (NCCL's bus bandwidth for allgather); for G = 1 it is the
//! own block's copy, size / time.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

#[path = "../tests/gpu_common/mod.rs"]
mod gpu_common;

use cudarc::driver::sys;
use gpu_common::{ck, cuda, DeviceBuffer, SpinKernel};
use refit::allgather::{allgather, Algorithm};
use refit::backend::nccl::{nccl, Communicators};
use refit::backend::{Backend, Stream};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::segment::Segment;
use std::fmt::Write as _;
use std::time::Instant;

const MIB: usize = 1 << 20;
const SIZES: [usize; 6] = [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB];
const PROBE_SIZES: [usize; 3] = [64 * MIB, 256 * MIB, 1024 * MIB];
const GATE_MS: u64 = 10;
const WARMUP: usize = 2;
const REPS: usize = 5;
const TINY: usize = 256;
const HOST_CALLS: usize = 2000;

/// A timing event pair on one stream.
struct Timer {
    device: usize,
    stream: Stream,
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    fn new(device: usize, stream: Stream) -> Timer {
        cuda().bind(device).unwrap();
        let mut start = std::ptr::null_mut();
        let mut end = std::ptr::null_mut();
        ck("cuEventCreate", unsafe { sys::cuEventCreate(&mut start, 0) });
        ck("cuEventCreate", unsafe { sys::cuEventCreate(&mut end, 0) });
        Timer { device, stream, start, end }
    }

    fn raw(&self) -> sys::CUstream {
        self.stream.0 as usize as sys::CUstream
    }

    fn record_start(&self) {
        cuda().bind(self.device).unwrap();
        ck("cuEventRecord(start)", unsafe { sys::cuEventRecord(self.start, self.raw()) });
    }

    fn record_end(&self) {
        cuda().bind(self.device).unwrap();
        ck("cuEventRecord(end)", unsafe { sys::cuEventRecord(self.end, self.raw()) });
    }

    fn seconds(&self) -> f64 {
        cuda().bind(self.device).unwrap();
        ck("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.end) });
        let mut ms = 0f32;
        ck("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.start, self.end) });
        ms as f64 / 1e3
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        unsafe {
            sys::cuEventDestroy_v2(self.start);
            sys::cuEventDestroy_v2(self.end);
        }
    }
}

/// Gate kernels (one per device) and their scratch words.
struct Gates {
    kernels: Vec<SpinKernel>,
    scratch: Vec<DeviceBuffer>,
}

impl Gates {
    fn new(devices: usize) -> Gates {
        Gates {
            kernels: (0..devices).map(SpinKernel::load).collect(),
            scratch: (0..devices).map(|d| DeviceBuffer::new(d, 4)).collect(),
        }
    }

    fn close(&self, device: usize, stream: Stream, ms: u64) {
        self.kernels[device].launch(stream, ms, self.scratch[device].ptr, 0);
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

/// Median seconds per call of `issue` (which queues one operation on `streams`), timed on the GPU.
fn time_per_call(gates: &Gates, streams: &[(usize, Stream)], iters: usize, issue: &mut dyn FnMut()) -> f64 {
    let timers: Vec<Timer> = streams.iter().map(|&(d, s)| Timer::new(d, s)).collect();
    let mut samples = Vec::new();
    for rep in 0..WARMUP + REPS {
        for t in &timers {
            gates.close(t.device, t.stream, GATE_MS);
            t.record_start();
        }
        for _ in 0..iters {
            issue();
        }
        for t in &timers {
            t.record_end();
        }
        let slowest = timers.iter().map(Timer::seconds).fold(0.0, f64::max);
        if rep >= WARMUP {
            samples.push(slowest / iters as f64);
        }
    }
    median(samples)
}

fn iterations(g: usize, size: usize) -> usize {
    (4 * 1024 * MIB / (g * size)).clamp(5, 50)
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// `ncclAllGather` called directly: own communicators and own non-blocking streams.
struct DirectNccl {
    comms: Communicators,
    streams: Vec<Stream>,
}

impl DirectNccl {
    fn new(g: usize) -> DirectNccl {
        let devices: Vec<i32> = (0..g as i32).collect();
        let comms = Communicators::create(&devices).unwrap_or_else(|e| panic!("direct NCCL init: {e}"));
        let streams = (0..g).map(|d| cuda().create_stream(d).unwrap()).collect();
        DirectNccl { comms, streams }
    }

    fn issue(&self, sends: &[u64], recvs: &[u64], bytes: usize) {
        let lib = nccl().unwrap();
        lib.group_start().unwrap();
        for r in 0..self.streams.len() {
            unsafe { lib.all_gather(sends[r], recvs[r], bytes, self.comms.comms[r], self.streams[r].0) }
                .unwrap();
        }
        lib.group_end().unwrap();
    }
}

struct Row {
    g: usize,
    size: usize,
    peer: f64,
    kernel_pulls: f64,
    lanes: f64,
    ours_nccl: f64,
    direct_nccl: f64,
    ceiling: Option<f64>,
}

struct HostRow {
    g: usize,
    path: &'static str,
    median_us: f64,
    p90_us: f64,
}

struct ProbeRow {
    size: usize,
    one_way: f64,
    both_nonblocking: f64,
    both_null: f64,
}

/// Per-GPU received rate when every GPU pulls every peer's block at once, each pair on its own
/// non-blocking stream: the copy-engine ceiling for this topology.
fn all_pull_ceiling(
    gates: &Gates,
    g: usize,
    size: usize,
    sends: &[DeviceBuffer],
    recvs: &[DeviceBuffer],
) -> f64 {
    let backend = cuda();
    let mut streams = Vec::new();
    for r in 0..g {
        for p in (0..g).filter(|&p| p != r) {
            streams.push((r, p, backend.create_stream(r).unwrap()));
        }
    }
    let timed: Vec<(usize, Stream)> = streams.iter().map(|&(r, _, s)| (r, s)).collect();
    let seconds = time_per_call(gates, &timed, 5, &mut || {
        for &(r, p, s) in &streams {
            let seg = Segment::contiguous(sends[p].ptr, recvs[r].ptr + (p * size) as u64, size as u64);
            unsafe { backend.copy_segments(r, s, &[seg]) }.unwrap();
        }
    });
    for (r, _, s) in streams {
        backend.destroy_stream(r, s);
    }
    gbps((g - 1) * size, seconds)
}

/// GPU0 <-> GPU1 copy-engine probe: one way, both ways on non-blocking streams, both ways on the
/// legacy null streams. Rates are totals over the directions.
fn probe(gates: &Gates, size: usize, sends: &[DeviceBuffer], recvs: &[DeviceBuffer]) -> ProbeRow {
    let backend = cuda();
    let pull = |to: usize, from: usize, s: Stream| {
        let seg = Segment::contiguous(sends[from].ptr, recvs[to].ptr + (from * size) as u64, size as u64);
        unsafe { backend.copy_segments(to, s, &[seg]) }.unwrap();
    };
    let s0 = backend.create_stream(0).unwrap();
    let s1 = backend.create_stream(1).unwrap();
    let iters = 5;
    let one = time_per_call(gates, &[(1, s1)], iters, &mut || pull(1, 0, s1));
    let both = time_per_call(gates, &[(0, s0), (1, s1)], iters, &mut || {
        pull(0, 1, s0);
        pull(1, 0, s1);
    });
    let null = time_per_call(gates, &[(0, Stream::NULL), (1, Stream::NULL)], iters, &mut || {
        pull(0, 1, Stream::NULL);
        pull(1, 0, Stream::NULL);
    });
    backend.destroy_stream(0, s0);
    backend.destroy_stream(1, s1);
    ProbeRow {
        size,
        one_way: gbps(size, one),
        both_nonblocking: gbps(2 * size, both),
        both_null: gbps(2 * size, null),
    }
}

/// Host time of each call (not of the GPU work), tiny buffers, inside one scope; synchronized every
/// 100 calls outside the timed region.
fn host_time(group: &Group, drain: &dyn Fn(), issue: &mut dyn FnMut()) -> (f64, f64) {
    let mut samples = Vec::with_capacity(HOST_CALLS);
    group.enter(None).unwrap();
    for call in 0..HOST_CALLS + 100 {
        let started = Instant::now();
        issue();
        let took = started.elapsed().as_secs_f64() * 1e6;
        if call >= 100 {
            samples.push(took);
        }
        if call % 100 == 99 {
            drain();
        }
    }
    group.exit(ExitMode::Sync).unwrap();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

fn nvidia_smi_topology() -> String {
    std::process::Command::new("nvidia-smi")
        .args(["topo", "-m"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|| "nvidia-smi topo -m unavailable".to_string())
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn main() {
    let backend = cuda();
    let count = backend.device_count();
    let gpu_name = backend.device_name(0);
    let nccl_version = nccl().map(|n| n.version()).unwrap_or_else(|e| panic!("NCCL is needed: {e}"));
    println!("# gpu_allgather: {count} x {gpu_name}, NCCL {nccl_version}");
    let gates = Gates::new(count);
    let mut rows = Vec::new();
    let mut host_rows = Vec::new();
    let mut probes = Vec::new();
    let mut peer_matrix = String::new();

    for g in 1..=count {
        let devices: Vec<i64> = (0..g as i64).collect();
        let group = Group::new(&devices, GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 })
            .unwrap_or_else(|e| panic!("group of {g}: {e}"));
        if g == count {
            for a in 0..g {
                let row: Vec<&str> =
                    (0..g).map(|b| if group.peer_access(a, b).unwrap() { "1" } else { "0" }).collect();
                let _ = write!(peer_matrix, "{}[{}]", if a > 0 { "," } else { "" }, row.join(","));
            }
        }
        let max = *SIZES.last().unwrap();
        let sends: Vec<DeviceBuffer> = (0..g).map(|r| DeviceBuffer::new(r, max)).collect();
        let recvs: Vec<DeviceBuffer> = (0..g).map(|r| DeviceBuffer::new(r, max * g)).collect();
        let send_ptrs: Vec<u64> = sends.iter().map(|b| b.ptr).collect();
        let recv_ptrs: Vec<u64> = recvs.iter().map(|b| b.ptr).collect();
        let direct = DirectNccl::new(g);
        let group_streams: Vec<(usize, Stream)> = (0..g).map(|r| (r, group.stream(r).unwrap())).collect();
        let direct_streams: Vec<(usize, Stream)> = (0..g).map(|r| (r, direct.streams[r])).collect();

        for &size in &SIZES {
            let counts = vec![size; g];
            let iters = iterations(g, size);
            let ours = |algorithm: Algorithm| {
                group.enter(None).unwrap();
                let t = time_per_call(&gates, &group_streams, iters, &mut || {
                    let ran =
                        unsafe { allgather(&group, &send_ptrs, &recv_ptrs, &counts, algorithm) }.unwrap();
                    assert_eq!(ran, algorithm);
                });
                group.exit(ExitMode::Sync).unwrap();
                t
            };
            // Peer pulls as one batched-kernel launch per rank (G >= 2), and as copy-engine copies on
            // parallel lanes;
            // "refit peer" is what the default rule picks for this G and size.
            group.set_peer_lanes_min_bytes(Some(u64::MAX));
            let kernel_pulls = ours(Algorithm::Peer);
            group.set_peer_lanes_min_bytes(Some(0));
            let lanes = if g >= 2 { ours(Algorithm::Peer) } else { kernel_pulls };
            group.set_peer_lanes_min_bytes(None);
            let peer = if group.peer_lanes_for(size as u64) { lanes } else { kernel_pulls };
            let ours_nccl = ours(Algorithm::Nccl);
            let direct_nccl = time_per_call(&gates, &direct_streams, iters, &mut || {
                direct.issue(&send_ptrs, &recv_ptrs, size)
            });
            let received = if g == 1 { size } else { (g - 1) * size };
            let ceiling =
                (g > 1 && size >= 64 * MIB).then(|| all_pull_ceiling(&gates, g, size, &sends, &recvs));
            rows.push(Row {
                g,
                size,
                peer: gbps(received, peer),
                kernel_pulls: gbps(received, kernel_pulls),
                lanes: gbps(received, lanes),
                ours_nccl: gbps(received, ours_nccl),
                direct_nccl: gbps(received, direct_nccl),
                ceiling,
            });
        }
        if g == 2 {
            for &size in &PROBE_SIZES {
                probes.push(probe(&gates, size, &sends, &recvs));
            }
        }

        let tiny = vec![TINY; g];
        let tiny_recv: Vec<u64> = recv_ptrs.clone();
        // In place: each rank's block already sits in its slot (no local copy to queue).
        let in_place: Vec<u64> = (0..g).map(|r| recv_ptrs[r] + (r * TINY) as u64).collect();
        let paths = [
            ("refit peer", Algorithm::Peer, &send_ptrs),
            ("refit peer, in place", Algorithm::Peer, &in_place),
            ("refit nccl", Algorithm::Nccl, &send_ptrs),
        ];
        for (path, algorithm, sends_for_path) in paths {
            let drain = || group.synchronize().unwrap();
            let (median_us, p90_us) = host_time(&group, &drain, &mut || {
                unsafe { allgather(&group, sends_for_path, &tiny_recv, &tiny, algorithm) }.unwrap();
            });
            host_rows.push(HostRow { g, path, median_us, p90_us });
        }
        let drain_direct = || {
            for (r, s) in direct.streams.iter().enumerate() {
                backend.sync_stream(r, *s).unwrap();
            }
        };
        let (median_us, p90_us) =
            host_time(&group, &drain_direct, &mut || direct.issue(&send_ptrs, &tiny_recv, TINY));
        host_rows.push(HostRow { g, path: "direct ncclAllGather", median_us, p90_us });
    }

    println!("\n## Allgather: GB/s received per GPU ((G-1) x size / time; G=1: own block copy)\n");
    println!("| G | per-rank size | refit peer | (kernel pulls | CE lanes) | refit NCCL | direct ncclAllGather | peer / NCCL | refit NCCL / direct | all-pull CE ceiling | best / ceiling |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let best = r.peer.max(r.ours_nccl);
        println!(
            "| {} | {} MiB | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.3} | {} | {} |",
            r.g,
            r.size / MIB,
            r.peer,
            r.kernel_pulls,
            r.lanes,
            r.ours_nccl,
            r.direct_nccl,
            r.peer / r.direct_nccl,
            r.ours_nccl / r.direct_nccl,
            r.ceiling.map_or("-".to_string(), |c| format!("{c:.1}")),
            r.ceiling.map_or("-".to_string(), |c| format!("{:.2}", best / c)),
        );
    }
    if !probes.is_empty() {
        println!("\n## Copy-engine probe GPU0 <-> GPU1 (GB/s, totals over directions)\n");
        println!("| size | one way (non-blocking) | both ways, non-blocking streams | both ways, legacy null streams | non-blocking / null |");
        println!("|---|---|---|---|---|");
        for p in &probes {
            println!(
                "| {} MiB | {:.1} | {:.1} | {:.1} | {:.2}x |",
                p.size / MIB,
                p.one_way,
                p.both_nonblocking,
                p.both_null,
                p.both_nonblocking / p.both_null
            );
        }
    }
    println!("\n## Host time per call, {TINY} B per rank, inside a scope (us)\n");
    println!("| G | path | median | p90 |");
    println!("|---|---|---|---|");
    for h in &host_rows {
        println!("| {} | {} | {:.2} | {:.2} |", h.g, h.path, h.median_us, h.p90_us);
    }

    let mut json = String::new();
    let _ = write!(
        json,
        "{{\"bench\":\"gpu_allgather\",\"machine\":{{\"gpu\":{},\"count\":{count},\"peer_access\":[{peer_matrix}],\"nccl_version\":{nccl_version},\"topology\":{}}},",
        json_string(&gpu_name),
        json_string(&nvidia_smi_topology())
    );
    json.push_str("\"unit\":\"GB/s received per GPU\",\"allgather\":[");
    for (i, r) in rows.iter().enumerate() {
        let _ = write!(
            json,
            "{}{{\"g\":{},\"bytes_per_rank\":{},\"refit_peer\":{:.3},\"peer_kernel_pulls\":{:.3},\"peer_lanes\":{:.3},\"refit_nccl\":{:.3},\"direct_nccl\":{:.3},\"ce_ceiling\":{}}}",
            if i > 0 { "," } else { "" },
            r.g,
            r.size,
            r.peer,
            r.kernel_pulls,
            r.lanes,
            r.ours_nccl,
            r.direct_nccl,
            r.ceiling.map_or("null".to_string(), |c| format!("{c:.3}"))
        );
    }
    json.push_str("],\"copy_engine_probe\":[");
    for (i, p) in probes.iter().enumerate() {
        let _ = write!(
            json,
            "{}{{\"bytes\":{},\"one_way\":{:.3},\"both_nonblocking\":{:.3},\"both_null\":{:.3}}}",
            if i > 0 { "," } else { "" },
            p.size,
            p.one_way,
            p.both_nonblocking,
            p.both_null
        );
    }
    json.push_str("],\"host_time_us\":[");
    for (i, h) in host_rows.iter().enumerate() {
        let _ = write!(
            json,
            "{}{{\"g\":{},\"path\":{},\"bytes_per_rank\":{TINY},\"median\":{:.3},\"p90\":{:.3}}}",
            if i > 0 { "," } else { "" },
            h.g,
            json_string(h.path),
            h.median_us,
            h.p90_us
        );
    }
    json.push_str("]}\n");
    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let path = std::path::Path::new(&dir).join("gpu_allgather.json");
    std::fs::write(&path, json).unwrap();
    println!("\nwrote {}", path.display());
}
