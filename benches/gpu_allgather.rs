//! Allgather on every GPU count the machine has (G = 1..=devices; code for any G): bytes received per
//! GPU per second for our PEER algorithm (each of its two methods forced, the one the size rule
//! picks, and that one again with every block in place, so with no own-block copy), our NCCL
//! algorithm and `ncclAllGather` called directly in the same process and run, per-rank sizes
//! 64 KiB .. 1 GiB; the copy-engine ceiling of the topology for each G (every GPU pulling, and every
//! GPU pushing, every peer block at once) and the bound it sets on an in-place call made of those
//! copies (the ceiling's copies plus one cross-GPU event round trip, measured here too); the
//! copy-engine probe both ways at once on non-blocking streams versus the legacy null streams; host
//! time per call for tiny buffers (back to back, and isolated calls after the group's rank threads
//! have gone to sleep) and the host cost of each driver call that time is made of; and a loop of
//! calls timed by the wall clock (host issue and GPU time together) for the whole-group PEER call,
//! the per-rank call inside `Group::run` (PEER and NCCL) and direct NCCL. Markdown tables on stdout,
//! JSON in `$REFIT_BENCH_RESULTS/gpu_allgather.json` (default `benches/results/`).
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
use refit::allgather::peer::{method_for, peer_tile_shift, set_method, PeerMethod};
use refit::allgather::{allgather, allgather_rank, Algorithm};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::kernels::rendezvous::Rendezvous;
use refit::kernels::PreparedBatch;
use refit::segment::Segment;
use refit::transport::nccl::{nccl, Communicators};
use refit::transport::{Backend, Event, Stream};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const SIZES: [usize; 9] =
    [MIB / 16, MIB / 4, MIB, 4 * MIB, 16 * MIB, 32 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB];
const PROBE_SIZES: [usize; 3] = [64 * MIB, 256 * MIB, 1024 * MIB];
const GATE_MS: u64 = 10;
const WARMUP: usize = 2;
const REPS: usize = 5;
const TINY: usize = 256;
const HOST_CALLS: usize = 2000;
/// Idle time before each "isolated" call: longer than the rank threads spin (50 us) after a call.
const ISOLATED_REST_US: u64 = 300;
/// Round trips GPU0 -> GPU1 -> GPU0 in one timed chain (the host queues them behind the gate).
const ROUND_TRIPS: usize = 1000;
/// Per-rank sizes at which the per-rank collective (inside `Group::run`) is timed against the rest.
const PER_RANK_SIZES: [usize; 5] = [TINY, MIB / 16, MIB, 16 * MIB, 64 * MIB];

/// The CUDA ordinal of device index `index` (the bench uses devices 0..g, indexing its tables by them).
fn ordinal(index: usize) -> i32 {
    i32::try_from(index).expect("a device index of this machine")
}

/// A timing event pair on one stream.
struct Timer {
    device: usize,
    stream: Stream,
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    fn new(device: usize, stream: Stream) -> Timer {
        cuda().bind(ordinal(device)).unwrap();
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
        cuda().bind(ordinal(self.device)).unwrap();
        ck("cuEventRecord(start)", unsafe { sys::cuEventRecord(self.start, self.raw()) });
    }

    fn record_end(&self) {
        cuda().bind(ordinal(self.device)).unwrap();
        ck("cuEventRecord(end)", unsafe { sys::cuEventRecord(self.end, self.raw()) });
    }

    fn seconds(&self) -> f64 {
        cuda().bind(ordinal(self.device)).unwrap();
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
            kernels: (0..devices).map(|d| SpinKernel::load(ordinal(d))).collect(),
            scratch: (0..devices).map(|d| DeviceBuffer::new(ordinal(d), 4)).collect(),
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
        let streams = (0..g).map(|d| cuda().create_stream(ordinal(d)).unwrap()).collect();
        DirectNccl { comms, streams }
    }

    fn issue(&self, sends: &[u64], recvs: &[u64], bytes: usize) {
        self.comms
            .grouped(|| {
                (0..self.streams.len()).try_for_each(|r| unsafe {
                    self.comms.all_gather(r, sends[r], recvs[r], bytes, self.streams[r])
                })
            })
            .unwrap();
    }
}

struct Row {
    g: usize,
    size: usize,
    peer: f64,
    /// The method the size rule picks, and every method's rate (PeerMethod::ALL order).
    picked: PeerMethod,
    methods: [f64; 2],
    /// The picked method with every block already in place (no own-block copy; G > 1).
    peer_in_place: Option<f64>,
    ours_nccl: f64,
    direct_nccl: f64,
    /// The kernel pushes ordered by events instead of the rendezvous (an ablation).
    event_pushes: f64,
    /// Synchronized kernel launches pulling instead of pushing (an ablation).
    synced_pulls: f64,
    /// Copy-engine ceilings, all pulling and all pushing.
    ceiling: Option<(f64, f64)>,
    /// What no copy-engine call writing the caller's buffers in place can beat (in_place_bound).
    bound: Option<f64>,
}

/// Wall-clock us per call, G ranks, one size: what a host-driven loop of calls costs (host issue and
/// GPU time together).
struct LoopRow {
    g: usize,
    size: usize,
    whole_group_peer: f64,
    per_rank_peer: f64,
    per_rank_nccl: f64,
    direct_nccl: f64,
}

/// Median over REPS of the wall-clock us per call of `calls` calls, each rep after a warm-up call:
/// `issue(calls)` queues them and `drain` waits for the GPUs.
fn loop_us(calls: usize, drain: &dyn Fn(), issue: &mut dyn FnMut(usize)) -> f64 {
    let mut samples = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        issue(1);
        drain();
        let started = Instant::now();
        issue(calls);
        drain();
        samples.push(started.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    median(samples)
}

/// The per-rank collective in a loop: one `Group::run` whose every rank's callback makes `calls`
/// calls of `allgather_rank`, as a rank-threaded framework would (the seed's
/// `DeviceGroup.allgather(rank, local)`).
fn per_rank_loop(
    group: &Group,
    sends: &[u64],
    recvs: &[u64],
    counts: &[usize],
    algorithm: Algorithm,
    calls: usize,
) {
    group
        .run(&|rank, _stream| {
            for _ in 0..calls {
                let ran =
                    unsafe { allgather_rank(group, rank, sends[rank], recvs[rank], counts, algorithm) }?;
                assert_eq!(ran, algorithm);
            }
            Ok(())
        })
        .unwrap();
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

/// Per-GPU received rate when every GPU pulls (or pushes) every peer's block at once, each pair on
/// its own non-blocking stream of the issuing GPU: the copy-engine ceiling for this topology.
fn copy_engine_ceiling(
    gates: &Gates,
    g: usize,
    size: usize,
    sends: &[DeviceBuffer],
    recvs: &[DeviceBuffer],
    push: bool,
) -> f64 {
    let backend = cuda();
    // (issuing device, receiver, owner, stream)
    let mut streams = Vec::new();
    for r in 0..g {
        for p in (0..g).filter(|&p| p != r) {
            let issuer = if push { p } else { r };
            streams.push((issuer, r, p, backend.create_stream(ordinal(issuer)).unwrap()));
        }
    }
    let timed: Vec<(usize, Stream)> = streams.iter().map(|&(i, _, _, s)| (i, s)).collect();
    let seconds = time_per_call(gates, &timed, 5, &mut || {
        for &(issuer, r, p, s) in &streams {
            let seg = Segment::contiguous(sends[p].ptr, recvs[r].ptr + (p * size) as u64, size as u64);
            unsafe { backend.copy_segments(ordinal(issuer), s, &[seg]) }.unwrap();
        }
    });
    for (issuer, _, _, s) in streams {
        backend.destroy_stream(ordinal(issuer), s);
    }
    gbps((g - 1) * size, seconds)
}

/// GPU time of one cross-GPU event round trip: GPU0's stream records, GPU1's waits and records,
/// GPU0's waits (fresh non-blocking streams).
fn event_round_trip(gates: &Gates) -> f64 {
    let backend = cuda();
    let events = RankEvents::new(2);
    let streams = RankStreams::new(2); // dropped (drained) first
    let (e, s) = (&events.0, &streams.0);
    let chain = time_per_call(gates, &streams.timed(), 1, &mut || {
        for _ in 0..ROUND_TRIPS {
            backend.record(0, e[0], s[0]).unwrap();
            backend.wait(1, s[1], e[0]).unwrap();
            backend.record(1, e[1], s[1]).unwrap();
            backend.wait(0, s[0], e[1]).unwrap();
        }
    });
    chain / ROUND_TRIPS as f64
}

/// GB/s per GPU that no correct call writing the caller's buffers in place with copy-engine copies
/// can beat. Rank r's work after a call reads bytes copied into recv[r], and the next call's copies
/// into recv[r] must wait for that work: between the last byte of one call landing and the first
/// byte of the next leaving, r's stream must hear from the copying GPU and the copying GPU from r.
/// A copy can only wait on a stream dependency, and events are the fastest, so that is one event
/// round trip (any G: every pair's trip runs at once), and a call takes at least the ceiling's
/// copies plus a trip. (Kernels can wait on flags instead, which are cheaper; they move less.)
fn in_place_bound(received: usize, ceiling_gbps: f64, round_trip_s: f64) -> f64 {
    gbps(received, received as f64 / (ceiling_gbps * 1e9) + round_trip_s)
}

/// One fresh non-blocking stream per device 0..g for an ablation, drained and destroyed on drop.
struct RankStreams(Vec<Stream>);

impl RankStreams {
    fn new(g: usize) -> RankStreams {
        RankStreams((0..g).map(|r| cuda().create_stream(ordinal(r)).unwrap()).collect())
    }

    fn timed(&self) -> Vec<(usize, Stream)> {
        self.0.iter().copied().enumerate().collect()
    }

    fn raw(&self, rank: usize) -> cudarc::driver::sys::CUstream {
        self.0[rank].as_ptr().cast()
    }
}

impl Drop for RankStreams {
    fn drop(&mut self) {
        for (r, &s) in self.0.iter().enumerate() {
            cuda().sync_stream(ordinal(r), s).unwrap();
            cuda().destroy_stream(ordinal(r), s);
        }
    }
}

/// One event per device 0..g for an ablation, destroyed on drop (after the streams that use it:
/// declare it before them).
struct RankEvents(Vec<Event>);

impl RankEvents {
    fn new(g: usize) -> RankEvents {
        RankEvents((0..g).map(|r| cuda().create_event(ordinal(r)).unwrap()).collect())
    }
}

impl Drop for RankEvents {
    fn drop(&mut self) {
        for (r, &event) in self.0.iter().enumerate() {
            cuda().destroy_event(ordinal(r), event);
        }
    }
}

/// Each rank's kernel copies for an ablation: pushes (its block into every rank's slot) or pulls
/// (every block into its own buffer), own slot last, tiles as the library picks them.
fn kernel_batches(
    g: usize,
    size: usize,
    sends: &[DeviceBuffer],
    recvs: &[DeviceBuffer],
    push: bool,
) -> Vec<PreparedBatch> {
    (0..g)
        .map(|me| {
            let copies: Vec<Segment> = (1..=g)
                .map(|k| (me + k) % g)
                .map(|other| {
                    let (from, to) = if push { (me, other) } else { (other, me) };
                    Segment::contiguous(sends[from].ptr, recvs[to].ptr + (from * size) as u64, size as u64)
                })
                .collect();
            PreparedBatch::tuned(me as i32, &copies, false, peer_tile_shift((g * size) as u64), 0).unwrap()
        })
        .collect()
}

/// Ablation of the kernel pushes' ordering: the same launches ordered by cross-GPU stream events
/// instead of the on-GPU rendezvous, each rank waiting for every other's `ready` and the final join
/// left out (one event hop per call: a lower bound for any event-ordered version).
fn event_ordered_pushes(
    gates: &Gates,
    g: usize,
    size: usize,
    sends: &[DeviceBuffer],
    recvs: &[DeviceBuffer],
) -> f64 {
    let backend = cuda();
    let ready = RankEvents::new(g);
    let streams = RankStreams::new(g);
    let batches = kernel_batches(g, size, sends, recvs, true);
    let seconds = time_per_call(gates, &streams.timed(), iterations(g, size), &mut || {
        for r in 0..g {
            backend.record(ordinal(r), ready.0[r], streams.0[r]).unwrap();
        }
        for r in 0..g {
            for p in (0..g).filter(|&p| p != r) {
                backend.wait(ordinal(r), streams.0[r], ready.0[p]).unwrap();
            }
            unsafe { batches[r].launch(streams.raw(r)) }.unwrap();
        }
    });
    drop(streams); // drained before the descriptors and events are freed
    gbps((g - 1) * size, seconds)
}

/// Ablation of the kernel pushes' direction: the same rendezvous around pulls (remote reads).
fn synced_kernel_pulls(
    gates: &Gates,
    g: usize,
    size: usize,
    sends: &[DeviceBuffer],
    recvs: &[DeviceBuffer],
) -> f64 {
    let streams = RankStreams::new(g);
    let devices: Vec<i32> = (0..g as i32).collect();
    let rendezvous = Rendezvous::new(&devices).unwrap();
    let batches = kernel_batches(g, size, sends, recvs, false);
    let seconds = time_per_call(gates, &streams.timed(), iterations(g, size), &mut || {
        let epoch = rendezvous.next_epoch();
        for r in 0..g {
            unsafe { batches[r].launch_synced(streams.raw(r), rendezvous.rank(r), epoch) }.unwrap();
        }
    });
    drop(streams); // drained before the flags and descriptors are freed
    gbps((g - 1) * size, seconds)
}

/// GPU0 <-> GPU1 copy-engine probe: one way, both ways on non-blocking streams, both ways on the
/// legacy null streams. Rates are totals over the directions.
fn probe(gates: &Gates, size: usize, sends: &[DeviceBuffer], recvs: &[DeviceBuffer]) -> ProbeRow {
    let backend = cuda();
    let pull = |to: usize, from: usize, s: Stream| {
        let seg = Segment::contiguous(sends[from].ptr, recvs[to].ptr + (from * size) as u64, size as u64);
        unsafe { backend.copy_segments(ordinal(to), s, &[seg]) }.unwrap();
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

/// Host time of each call (not of the GPU work), tiny buffers, inside one scope: (median, p90) us.
/// `rest`: idle time before each call, outside the timed region (an isolated call: the group's rank
/// threads have stopped spinning and sleep), or zero (calls back to back).
fn host_time(group: &Group, drain: &dyn Fn(), rest: Duration, issue: &mut dyn FnMut()) -> (f64, f64) {
    group.enter(None).unwrap();
    let samples = host_samples(drain, rest, issue);
    group.exit(ExitMode::Sync).unwrap();
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

/// HOST_CALLS timings of `issue` in us, ascending, after 100 untimed calls; `drain` runs every 100
/// calls outside the timed region so that queues never fill, and `rest` is slept before each call.
fn host_samples(drain: &dyn Fn(), rest: Duration, issue: &mut dyn FnMut()) -> Vec<f64> {
    let mut samples = Vec::with_capacity(HOST_CALLS);
    for call in 0..HOST_CALLS + 100 {
        if !rest.is_zero() {
            std::thread::sleep(rest);
        }
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
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples
}

/// Host cost of each driver call the peer path issues, G = 2 (median us over HOST_CALLS calls):
/// the budget a call's host time is spent from.
fn driver_call_costs(group: &Group, sends: &[u64], recvs: &[u64]) -> Vec<(&'static str, f64)> {
    let backend = cuda();
    let streams = group.streams();
    let events: Vec<sys::CUevent> = (0..2)
        .map(|d| {
            backend.bind(d).unwrap();
            let mut e = std::ptr::null_mut();
            ck("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, 2) }); // CU_EVENT_DISABLE_TIMING
            e
        })
        .collect();
    let raw = |s: Stream| s.0 as usize as sys::CUstream;
    let ctx: Vec<sys::CUcontext> = (0..2)
        .map(|d| {
            backend.bind(d).unwrap();
            let mut c = std::ptr::null_mut();
            ck("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut c) });
            c
        })
        .collect();
    let tiny = Segment::contiguous(sends[1], recvs[0] + TINY as u64, TINY as u64);
    let prepared = backend.prepare_batch(group.device(0).unwrap(), &[tiny], false).unwrap();
    let drain = || group.synchronize().unwrap();
    let median_of = |f: &mut dyn FnMut()| median(host_samples(&drain, Duration::ZERO, f));
    let mut rows = Vec::new();
    backend.bind(0).unwrap();
    rows.push((
        "cuCtxGetCurrent",
        median_of(&mut || {
            let mut c = std::ptr::null_mut();
            ck("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut c) });
        }),
    ));
    rows.push((
        "cuCtxSetCurrent, switching 0 -> 1 -> 0 (two calls)",
        median_of(&mut || {
            ck("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx[1]) });
            ck("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx[0]) });
        }),
    ));
    rows.push((
        "cuEventRecord",
        median_of(&mut || {
            ck("cuEventRecord", unsafe { sys::cuEventRecord(events[0], raw(streams[0])) });
        }),
    ));
    rows.push((
        "cuStreamWaitEvent, same device",
        median_of(&mut || {
            ck("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(raw(streams[0]), events[0], 0) });
        }),
    ));
    backend.bind(1).unwrap();
    ck("cuEventRecord", unsafe { sys::cuEventRecord(events[1], raw(streams[1])) });
    backend.bind(0).unwrap();
    rows.push((
        "cuStreamWaitEvent, other device's event",
        median_of(&mut || {
            ck("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(raw(streams[0]), events[1], 0) });
        }),
    ));
    rows.push((
        "prepared batched-kernel launch (1 segment)",
        median_of(&mut || {
            unsafe { prepared.launch(streams[0]) }.unwrap();
        }),
    ));
    group.synchronize().unwrap();
    for (d, e) in events.into_iter().enumerate() {
        backend.bind(ordinal(d)).unwrap();
        unsafe { sys::cuEventDestroy_v2(e) };
    }
    rows
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

/// The JSON objects `object` makes of `items`, comma-separated (the inside of an array).
fn json_list<T>(items: &[T], object: impl Fn(&T) -> String) -> String {
    items.iter().map(object).collect::<Vec<_>>().join(",")
}

/// A number with three decimals, or null.
fn json_number(value: Option<f64>) -> String {
    value.map_or("null".to_string(), |v| format!("{v:.3}"))
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
    let round_trip = (count > 1).then(|| event_round_trip(&gates));
    let mut rows = Vec::new();
    let mut host_rows = Vec::new();
    let mut loop_rows = Vec::new();
    let mut probes = Vec::new();
    let mut peer_matrix = String::new();
    let mut call_costs = Vec::new();

    for g in 1..=count {
        let devices: Vec<i32> = (0..g as i32).collect();
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
        let sends: Vec<DeviceBuffer> = (0..g).map(|r| DeviceBuffer::new(ordinal(r), max)).collect();
        let recvs: Vec<DeviceBuffer> = (0..g).map(|r| DeviceBuffer::new(ordinal(r), max * g)).collect();
        let send_ptrs: Vec<u64> = sends.iter().map(|b| b.ptr).collect();
        let recv_ptrs: Vec<u64> = recvs.iter().map(|b| b.ptr).collect();
        let direct = DirectNccl::new(g);
        let group_streams: Vec<(usize, Stream)> = (0..g).map(|r| (r, group.stream(r).unwrap())).collect();
        let direct_streams: Vec<(usize, Stream)> = (0..g).map(|r| (r, direct.streams[r])).collect();

        for &size in &SIZES {
            let counts = vec![size; g];
            let iters = iterations(g, size);
            // In place: each rank's block already sits in its slot of its receive buffer.
            let in_place: Vec<u64> = (0..g).map(|r| recv_ptrs[r] + (r * size) as u64).collect();
            let ours_from = |sends: &[u64], algorithm: Algorithm| {
                group.enter(None).unwrap();
                let t = time_per_call(&gates, &group_streams, iters, &mut || {
                    let ran = unsafe { allgather(&group, sends, &recv_ptrs, &counts, algorithm) }.unwrap();
                    assert_eq!(ran, algorithm);
                });
                group.exit(ExitMode::Sync).unwrap();
                t
            };
            let ours = |algorithm: Algorithm| ours_from(&send_ptrs, algorithm);
            // Every peer method forced, then "refit peer" is the one the size rule picks.
            let mut methods = [0.0; 2];
            for (k, method) in PeerMethod::ALL.into_iter().enumerate() {
                set_method(&group, Some(method)).unwrap();
                methods[k] = ours(Algorithm::Peer);
            }
            set_method(&group, None).unwrap();
            let picked = method_for(&group, size as u64).unwrap();
            let peer = methods[PeerMethod::ALL.iter().position(|&m| m == picked).expect("one of ALL")];
            let received = if g == 1 { size } else { (g - 1) * size };
            let peer_in_place = (g > 1).then(|| gbps(received, ours_from(&in_place, Algorithm::Peer)));
            // Ablations of the kernel method, up to the sizes it is used at.
            let kernel_sizes = g > 1 && size <= 32 * MIB;
            let event_pushes =
                if kernel_sizes { event_ordered_pushes(&gates, g, size, &sends, &recvs) } else { 0.0 };
            let synced_pulls =
                if kernel_sizes { synced_kernel_pulls(&gates, g, size, &sends, &recvs) } else { 0.0 };
            let ours_nccl = ours(Algorithm::Nccl);
            let direct_nccl = time_per_call(&gates, &direct_streams, iters, &mut || {
                direct.issue(&send_ptrs, &recv_ptrs, size)
            });
            let ceiling = (g > 1 && size >= 16 * MIB).then(|| {
                let pull = copy_engine_ceiling(&gates, g, size, &sends, &recvs, false);
                (pull, copy_engine_ceiling(&gates, g, size, &sends, &recvs, true))
            });
            let bound = ceiling
                .zip(round_trip)
                .map(|((pull, push), trip)| in_place_bound(received, pull.max(push), trip));
            rows.push(Row {
                g,
                size,
                peer: gbps(received, peer),
                picked,
                methods: methods.map(|t| gbps(received, t)),
                peer_in_place,
                event_pushes,
                synced_pulls,
                ours_nccl: gbps(received, ours_nccl),
                direct_nccl: gbps(received, direct_nccl),
                ceiling,
                bound,
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
        let isolated = Duration::from_micros(ISOLATED_REST_US);
        let paths = [
            ("refit peer", Algorithm::Peer, &send_ptrs, Duration::ZERO),
            ("refit peer, in place", Algorithm::Peer, &in_place, Duration::ZERO),
            ("refit peer, isolated calls", Algorithm::Peer, &send_ptrs, isolated),
            ("refit nccl", Algorithm::Nccl, &send_ptrs, Duration::ZERO),
        ];
        for (path, algorithm, sends_for_path, rest) in paths {
            let drain = || group.synchronize().unwrap();
            let (median_us, p90_us) = host_time(&group, &drain, rest, &mut || {
                unsafe { allgather(&group, sends_for_path, &tiny_recv, &tiny, algorithm) }.unwrap();
            });
            host_rows.push(HostRow { g, path, median_us, p90_us });
        }
        let drain_direct = || {
            for (r, s) in direct.streams.iter().enumerate() {
                backend.sync_stream(ordinal(r), *s).unwrap();
            }
        };
        for (path, rest) in
            [("direct ncclAllGather", Duration::ZERO), ("direct ncclAllGather, isolated calls", isolated)]
        {
            let (median_us, p90_us) =
                host_time(&group, &drain_direct, rest, &mut || direct.issue(&send_ptrs, &tiny_recv, TINY));
            host_rows.push(HostRow { g, path, median_us, p90_us });
        }
        if g == 2 {
            call_costs = driver_call_costs(&group, &send_ptrs, &recv_ptrs);
        }
        for &size in &PER_RANK_SIZES {
            let counts = vec![size; g];
            let calls = (256 * MIB / (g * size)).clamp(10, 1000);
            let drain = || group.synchronize().unwrap();
            let whole_group_peer = loop_us(calls, &drain, &mut |k| {
                group.enter(None).unwrap();
                for _ in 0..k {
                    unsafe { allgather(&group, &send_ptrs, &recv_ptrs, &counts, Algorithm::Peer) }.unwrap();
                }
                group.exit(ExitMode::Async).unwrap();
            });
            let per_rank = |algorithm| {
                loop_us(calls, &drain, &mut |k| {
                    per_rank_loop(&group, &send_ptrs, &recv_ptrs, &counts, algorithm, k)
                })
            };
            let (per_rank_peer, per_rank_nccl) = (per_rank(Algorithm::Peer), per_rank(Algorithm::Nccl));
            let drain_direct = || {
                for (r, s) in direct.streams.iter().enumerate() {
                    backend.sync_stream(ordinal(r), *s).unwrap();
                }
            };
            let direct_nccl = loop_us(calls, &drain_direct, &mut |k| {
                for _ in 0..k {
                    direct.issue(&send_ptrs, &recv_ptrs, size);
                }
            });
            loop_rows.push(LoopRow { g, size, whole_group_peer, per_rank_peer, per_rank_nccl, direct_nccl });
        }
    }

    println!("\n## Allgather: GB/s received per GPU ((G-1) x size / time; G=1: own block copy)\n");
    println!("| G | per-rank size | refit peer | (kernel pushes | CE push) | refit peer, in place | ablation: kernel pushes, event-ordered | ablation: kernel pulls, synced | refit NCCL | direct ncclAllGather | peer / NCCL | refit NCCL / direct | CE ceiling (all pull / all push) | best / ceiling | in-place bound | peer / bound |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let best = r.peer.max(r.ours_nccl);
        println!(
            "| {} | {} KiB | {:.1} ({:?}) | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3}x | {:.3} | {} | {} | {} | {} |",
            r.g,
            r.size >> 10,
            r.peer,
            r.picked,
            r.methods[0],
            r.methods[1],
            r.peer_in_place.map_or("-".to_string(), |v| format!("{v:.1}")),
            r.event_pushes,
            r.synced_pulls,
            r.ours_nccl,
            r.direct_nccl,
            r.peer / r.direct_nccl,
            r.ours_nccl / r.direct_nccl,
            r.ceiling.map_or("-".to_string(), |(pull, push)| format!("{pull:.1} / {push:.1}")),
            r.ceiling.map_or("-".to_string(), |(pull, push)| format!("{:.2}", best / pull.max(push))),
            r.bound.map_or("-".to_string(), |b| format!("{b:.1}")),
            r.bound.map_or("-".to_string(), |b| format!("{:.3}", r.peer / b)),
        );
    }
    if let Some(trip) = round_trip {
        println!("\nEvent round trip GPU0 -> GPU1 -> GPU0 (GPU time): {:.2} us", trip * 1e6);
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

    println!("\n## A loop of calls, wall clock (us per call: host issue and GPU time together)\n");
    println!("| G | per-rank size | refit peer, whole group | refit peer, per rank (group_run) | refit NCCL, per rank (group_run) | direct ncclAllGather |");
    println!("|---|---|---|---|---|---|");
    for l in &loop_rows {
        println!(
            "| {} | {} B | {:.2} | {:.2} | {:.2} | {:.2} |",
            l.g, l.size, l.whole_group_peer, l.per_rank_peer, l.per_rank_nccl, l.direct_nccl
        );
    }

    if !call_costs.is_empty() {
        println!("\n## Host cost of one driver call, G = 2 (median us)\n");
        println!("| call | us |");
        println!("|---|---|");
        for (call, us) in &call_costs {
            println!("| {call} | {us:.3} |");
        }
    }

    let machine = format!(
        "{{\"gpu\":{},\"count\":{count},\"peer_access\":[{peer_matrix}],\"nccl_version\":{nccl_version},\"topology\":{}}}",
        json_string(&gpu_name),
        json_string(&nvidia_smi_topology())
    );
    let allgather = json_list(&rows, |r| {
        format!(
            "{{\"g\":{},\"bytes_per_rank\":{},\"refit_peer\":{:.3},\"peer_method\":\"{:?}\",\"peer_kernel_pushes\":{:.3},\"peer_copy_engine_push\":{:.3},\"refit_peer_in_place\":{},\"ablation_event_ordered_kernel_pushes\":{:.3},\"ablation_synced_kernel_pulls\":{:.3},\"refit_nccl\":{:.3},\"direct_nccl\":{:.3},\"ce_ceiling_pull\":{},\"ce_ceiling_push\":{},\"in_place_bound\":{}}}",
            r.g,
            r.size,
            r.peer,
            r.picked,
            r.methods[0],
            r.methods[1],
            json_number(r.peer_in_place),
            r.event_pushes,
            r.synced_pulls,
            r.ours_nccl,
            r.direct_nccl,
            json_number(r.ceiling.map(|c| c.0)),
            json_number(r.ceiling.map(|c| c.1)),
            json_number(r.bound)
        )
    });
    let copy_engine_probe = json_list(&probes, |p| {
        format!(
            "{{\"bytes\":{},\"one_way\":{:.3},\"both_nonblocking\":{:.3},\"both_null\":{:.3}}}",
            p.size, p.one_way, p.both_nonblocking, p.both_null
        )
    });
    let host_time = json_list(&host_rows, |h| {
        format!(
            "{{\"g\":{},\"path\":{},\"bytes_per_rank\":{TINY},\"median\":{:.3},\"p90\":{:.3}}}",
            h.g,
            json_string(h.path),
            h.median_us,
            h.p90_us
        )
    });
    let loops = json_list(&loop_rows, |l| {
        format!(
            "{{\"g\":{},\"bytes_per_rank\":{},\"refit_peer_whole_group\":{:.3},\"refit_peer_per_rank\":{:.3},\"refit_nccl_per_rank\":{:.3},\"direct_nccl\":{:.3}}}",
            l.g, l.size, l.whole_group_peer, l.per_rank_peer, l.per_rank_nccl, l.direct_nccl
        )
    });
    let driver_calls =
        json_list(&call_costs, |(call, us)| format!("{{\"call\":{},\"median\":{us:.3}}}", json_string(call)));
    let json = format!(
        "{{\"bench\":\"gpu_allgather\",\"machine\":{machine},\"unit\":\"GB/s received per GPU\",\"event_round_trip_us\":{},\"allgather\":[{allgather}],\"copy_engine_probe\":[{copy_engine_probe}],\"host_time_us\":[{host_time}],\"loop_us_per_call\":[{loops}],\"driver_call_us\":[{driver_calls}]}}\n",
        json_number(round_trip.map(|t| t * 1e6))
    );
    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let path = std::path::Path::new(&dir).join("gpu_allgather.json");
    std::fs::write(&path, json).unwrap();
    println!("\nwrote {}", path.display());
}
