//! The whole-group `Peer` allgather: GPUs copy their blocks into each other's buffers directly (kernels
//! writing peer memory, or copy-engine copies) on the group's streams.
//!
//! Two methods, picked by the mean block size ([`method_for`]), each the faster at its sizes
//! (benches/gpu_allgather.rs measures both at every size):
//! - [`PeerMethod::KernelPushes`]: each rank writes its block into every rank's buffer with one launch
//!   of the batched copy kernel on its own stream. On CUDA the launches meet on the GPUs through
//!   flags in device memory (`kernels::rendezvous`): a launch starts copying once every rank's launch
//!   has started (so every receiver is ready) and ends once every rank has finished writing, with no
//!   stream events at all. A cross-GPU event wait costs GPU time on both GPUs and a driver call on
//!   the host (benches/probes/cross_gpu_sync_probe.py prices the round trip); for small blocks that
//!   latency is the whole cost. Pushing (remote writes, posted) beats pulling (remote reads) with
//!   the same rendezvous at every size this method serves (the bench keeps pulls as an ablation).
//!   Used below [`COPY_ENGINE_FROM`]: with tiles sized by [`peer_tile_shift`] the kernel beats the
//!   copy engine up to 16 MiB per rank and loses from 32 MiB, where SM writes into a peer fall
//!   behind the copy engine (benches/probes/sm_push_probe.py).
//! - [`PeerMethod::CopyEnginePushes`]: each rank pushes its block to every peer with copy-engine
//!   copies, one lane stream per destination, ordered by events, while a kernel on a few blocks
//!   copies its own block ([`own_block_batches`]). Pushing beats pulling here too, and splitting one
//!   block over several lanes only lowers the rate (benches/probes/ce_lanes_probe.py). Also the
//!   method of groups without direct peer access, where the driver stages the copies.
//!
//! Each rank's part is issued from that rank's thread where it is awake (`Group::fan_out`), so the
//! call's host time is about one rank's, not the sum over ranks.
//!
//! Either way the call leaves every stream joined: once the work queued on rank r's stream is done,
//! r's receive buffer holds every block and no rank reads r's send buffer any more.
//!
//! Kernel descriptors are prepared once per (method, buffers, counts) and kept for the next call
//! (collectives in a loop). On the host backend, kernel pushes are queued copies ordered by events.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

use super::call::Gather;
use crate::error::{Error, Result};
use crate::group::barrier::Entered;
use crate::group::Group;
use crate::kernels::rendezvous::Rendezvous;
use crate::kernels::{BatchedCopy, PreparedBatch};
use crate::segment::Segment;
use crate::sync::lock;
use crate::transport::{Backend, BackendKind, Event, Stream};
use cudarc::driver::sys::CUstream;
use std::sync::{Arc, Mutex, OnceLock};

/// How a whole-group peer allgather moves its blocks (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerMethod {
    KernelPushes,
    CopyEnginePushes,
}

impl PeerMethod {
    pub const ALL: [PeerMethod; 2] = [PeerMethod::KernelPushes, PeerMethod::CopyEnginePushes];
}

/// Blocks for a rank's own-block copy beside its copy-engine pushes (see [`OwnBlockCopies`]): enough
/// that the copy ends well before the pushes, few enough not to crowd them. With far fewer blocks the
/// own copy outlasts the pushes; the full grid, or the copy engine, slows them (the sweep over block
/// counts: docs/decisions.md; benches/gpu_allgather.rs measures the call against its in-place
/// variant, which copies no own block).
const OWN_COPY_BLOCKS: u32 = 48;

/// From this mean block size, [`PeerMethod::CopyEnginePushes`]; below it, kernel pushes.
pub const COPY_ENGINE_FROM: u64 = 32 << 20;

/// What the peer methods keep per group, call after call (no per-call creation), in the group's
/// extension slot (`Group::extension`): created at the first peer allgather on a group, dropped with
/// the group after its streams have drained.
pub(super) struct PeerState {
    backend: Arc<dyn Backend>,
    devices: Vec<i32>,
    /// Recorded on rank r's stream before an allgather touches its buffers: its earlier work is done,
    /// so peers may read its send buffer and write its receive buffer.
    ready: Vec<Event>,
    /// Recorded on rank r's stream after its copies into or out of its peers' buffers.
    done: Vec<Event>,
    /// The prepared per-rank kernel batches of the last call, reused while its method, buffers and
    /// counts stay the same.
    prepared: Mutex<Option<PreparedCall>>,
    /// The device flags of group-synchronized kernel launches (CUDA), created on first use.
    rendezvous: OnceLock<std::result::Result<Rendezvous, Error>>,
    /// Per-rank copy-engine streams for pushing to several ranks at once (created on first use).
    lanes: OnceLock<std::result::Result<Lanes, Error>>,
    /// Whether refit's copy kernel runs on every rank's device, decided at the first call
    /// ([`kernels_run`]).
    kernels_run: OnceLock<bool>,
    /// The method to use at every size, or None for the size rule ([`set_method`]).
    method: Mutex<Option<PeerMethod>>,
}

/// The group's peer state, created at the first call on the group.
pub(super) fn state(group: &Group) -> Result<Arc<PeerState>> {
    group.extension(PeerState::new)
}

impl PeerState {
    fn new(group: &Group) -> Result<PeerState> {
        let n = group.size();
        let mut state = PeerState {
            backend: Arc::clone(group.backend()),
            devices: group.devices().to_vec(),
            ready: Vec::with_capacity(n),
            done: Vec::with_capacity(n),
            prepared: Mutex::new(None),
            rendezvous: OnceLock::new(),
            lanes: OnceLock::new(),
            kernels_run: OnceLock::new(),
            method: Mutex::new(None),
        };
        // Pushed one by one so that Drop releases exactly what was created if a step fails.
        for r in 0..n {
            state.ready.push(state.backend.create_event(state.devices[r])?);
            state.done.push(state.backend.create_event(state.devices[r])?);
        }
        Ok(state)
    }

    /// The rendezvous flags, created on first use (CUDA backend only).
    pub(super) fn rendezvous(&self) -> Result<&Rendezvous> {
        self.rendezvous.get_or_init(|| Rendezvous::new(&self.devices)).as_ref().map_err(Clone::clone)
    }

    /// The lanes, created on first use: `size - 1` extra streams per rank (none for a single rank) and
    /// their events. Rank threads issuing a call's pushes at once share them without a lock; a failed
    /// creation is kept and returned by every later call, as for the rendezvous.
    fn lanes(&self) -> Result<&Lanes> {
        self.lanes
            .get_or_init(|| Lanes::create(self.backend.as_ref(), &self.devices))
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl Drop for PeerState {
    fn drop(&mut self) {
        if let Some(Ok(lanes)) = self.lanes.take() {
            lanes.destroy(self.backend.as_ref(), &self.devices);
        }
        for list in [&self.ready, &self.done] {
            for (r, &event) in list.iter().enumerate() {
                self.backend.destroy_event(self.devices[r], event);
            }
        }
    }
}

/// `streams[rank][lane]` on the rank's device and `joined[rank][lane]`, recorded on the lane when its
/// copy is queued and waited by the streams that depend on it.
struct Lanes {
    streams: Vec<Vec<Stream>>,
    joined: Vec<Vec<Event>>,
}

impl Lanes {
    /// `size - 1` lanes per device, each with its event; on failure, what was made is destroyed.
    fn create(backend: &dyn Backend, devices: &[i32]) -> Result<Lanes> {
        let mut made = Lanes { streams: Vec::new(), joined: Vec::new() };
        let created = (|| -> Result<()> {
            for &device in devices {
                made.streams.push(Vec::new());
                made.joined.push(Vec::new());
                for _ in 1..devices.len() {
                    made.streams.last_mut().expect("pushed").push(backend.create_stream(device)?);
                    made.joined.last_mut().expect("pushed").push(backend.create_event(device)?);
                }
            }
            Ok(())
        })();
        match created {
            Ok(()) => Ok(made),
            Err(err) => {
                made.destroy(backend, devices);
                Err(err)
            }
        }
    }

    fn destroy(&self, backend: &dyn Backend, devices: &[i32]) {
        for (r, streams) in self.streams.iter().enumerate() {
            for &stream in streams {
                backend.destroy_stream(devices[r], stream);
            }
        }
        for (r, events) in self.joined.iter().enumerate() {
            for &event in events {
                backend.destroy_event(devices[r], event);
            }
        }
    }
}

/// Makes every peer allgather on `group` use `method` (`None`: pick by block size, see
/// [`method_for`]). A knob for benchmarks and tests; a method this group cannot run (kernels without
/// direct peer access or without libnvrtc, or one rank) still falls back to the copy engine.
/// Errors: those of creating the group's allgather state (its events).
pub fn set_method(group: &Group, method: Option<PeerMethod>) -> Result<()> {
    *lock(&state(group)?.method) = method;
    Ok(())
}

/// The method for a call with this mean block size on `group`: the override ([`set_method`]) when
/// set, else the size rule (see the module docs). Errors: those of creating the peer state.
pub fn method_for(group: &Group, mean_block: u64) -> Result<PeerMethod> {
    let state = state(group)?;
    Ok(method_for_state(group, &state, mean_block))
}

/// The method for a call with this mean block size: the override ([`set_method`]) when set, else the
/// size rule. A single rank only copies its own block (copy engine); a CUDA group with a pair lacking
/// direct peer access cannot run kernels on peer memory, and one whose devices cannot run the kernel
/// has none (copy engine).
pub(super) fn method_for_state(group: &Group, state: &PeerState, mean_block: u64) -> PeerMethod {
    let kernels_possible = group.size() > 1
        && (group.backend_kind() == BackendKind::Host
            || (group.all_peers_direct() && kernels_run_state(group, state)));
    if !kernels_possible {
        return PeerMethod::CopyEnginePushes;
    }
    if let Some(method) = *lock(&state.method) {
        return method;
    }
    if mean_block < COPY_ENGINE_FROM {
        PeerMethod::KernelPushes
    } else {
        PeerMethod::CopyEnginePushes
    }
}

/// Whether refit's copy kernel runs on every device of the group: always on the host backend (whose
/// "kernels" are host copies); on CUDA when the kernel builds and loads on every device, which needs
/// libnvrtc. Decided at the first call and kept: without the kernel, every block moves with the copy
/// engine, and the reason is logged once. Errors: those of creating the group's allgather state.
pub fn kernels_run(group: &Group) -> Result<bool> {
    let state = state(group)?;
    Ok(kernels_run_state(group, &state))
}

fn kernels_run_state(group: &Group, state: &PeerState) -> bool {
    *state.kernels_run.get_or_init(|| {
        if group.backend_kind() != BackendKind::Cuda {
            return true;
        }
        let loaded = group.devices().iter().try_for_each(|&d| BatchedCopy::for_device(d).map(drop));
        if let Err(err) = &loaded {
            log::warn!("peer allgather: copy engine only, refit's kernel is unavailable: {err}");
        }
        loaded.is_ok()
    })
}

/// The whole-group peer allgather inside the open scope; returns the method that ran.
///
/// # Safety
/// As for [`super::allgather`].
pub(super) unsafe fn allgather(group: &Group, state: &PeerState, call: &Gather) -> Result<PeerMethod> {
    let method = method_for_state(group, state, call.layout.total / group.size() as u64);
    // A reshard execution may have left cross-rank reads unjoined (Group::join_if_pending).
    group.join_if_pending()?;
    if meets_on_gpu(group, method) {
        synced_kernel_pushes(group, state, call)?;
        return Ok(method);
    }
    // The per-rank call's steps, each issued for every rank at once (`Group::fan_out`): every
    // event a step waits on was recorded by an earlier step, which has returned on every rank.
    for rank in 0..group.size() {
        before_meeting(group, state, rank, method)?;
    }
    // SAFETY (closures): as for this function, on every rank's stream.
    match method {
        PeerMethod::KernelPushes => {
            group.fan_out(&|p, _| unsafe { event_ordered_push(group, state, call, p) })?;
            group.fan_out(&|r, _| unsafe { wait_for_event_ordered_pushers(group, state, r) })?;
        }
        PeerMethod::CopyEnginePushes => {
            let own = own_block_batches(group, state, call)?;
            group.fan_out(&|p, _| unsafe { lane_pushes(group, state, call, p, own.as_deref()) })?;
            group.fan_out(&|r, _| unsafe { wait_for_lane_pushers(group, state, call, r) })?;
        }
    }
    Ok(method)
}

/// Whether `method`'s pushes meet on the GPUs through the rendezvous (kernel pushes on CUDA) rather
/// than through stream events (everything else).
pub(super) fn meets_on_gpu(group: &Group, method: PeerMethod) -> bool {
    method == PeerMethod::KernelPushes && group.backend_kind() == BackendKind::Cuda
}

/// A per-rank peer allgather's first step, before the ranks meet on the host: when the pushes are
/// ordered by events, rank `rank` records `ready` (its earlier work done) for its pushers to wait on.
///
/// # Safety
/// The group's streams and events are live (always, for a live group).
pub(super) unsafe fn before_meeting(
    group: &Group,
    state: &PeerState,
    rank: usize,
    method: PeerMethod,
) -> Result<()> {
    if meets_on_gpu(group, method) || group.size() == 1 {
        return Ok(());
    }
    group.backend().record(group.devices()[rank], state.ready[rank], group.streams()[rank])
}

/// Rank `rank`'s share of a per-rank peer allgather, once every rank has published its buffers
/// (`call`) and recorded what [`before_meeting`] records. `epoch`: the call's rendezvous epoch when
/// [`meets_on_gpu`], agreed on by every rank; if this rank cannot launch for it, it releases the
/// others on its stream. The event-ordered methods meet the other ranks of the call (`entered`) once
/// more on the host (their events must be recorded before anyone waits on them).
///
/// # Safety
/// As for [`super::allgather_rank`].
pub(super) unsafe fn rank_share(
    group: &Group,
    state: &PeerState,
    call: &Gather,
    rank: usize,
    method: PeerMethod,
    entered: &mut Entered,
    epoch: u64,
) -> Result<()> {
    match method {
        PeerMethod::KernelPushes if meets_on_gpu(group, method) => {
            launch_synced_pushes(group, state, call, rank, epoch)
        }
        PeerMethod::KernelPushes => {
            event_ordered_push(group, state, call, rank)?;
            group.barrier().meet(entered)?;
            wait_for_event_ordered_pushers(group, state, rank)
        }
        PeerMethod::CopyEnginePushes => {
            let own = own_block_batches(group, state, call)?;
            lane_pushes(group, state, call, rank, own.as_deref())?;
            group.barrier().meet(entered)?;
            wait_for_lane_pushers(group, state, call, rank)
        }
    }
}

/// Every rank's pushes as one group-synchronized launch on its stream (CUDA, direct peer access),
/// issued at once: the call costs the host about one launch, not one per rank (benches/gpu_allgather.rs,
/// host time per call; benches/probes/launch_cost_probe.cu prices launches from one and two threads).
unsafe fn synced_kernel_pushes(group: &Group, state: &PeerState, call: &Gather) -> Result<()> {
    let rendezvous = state.rendezvous()?;
    let batches = prepared(group, state, call, PeerMethod::KernelPushes, |p| push_batch(group, call, p))?;
    let epoch = rendezvous.next_epoch();
    // SAFETY: as for this function, on every rank's stream.
    group.fan_out(&|rank, stream| unsafe {
        launch_or_release(rendezvous, &batches[rank], rank, stream.as_ptr().cast(), epoch)
    })
}

/// Rank `rank`'s pushes as its part of the group-synchronized launch of `epoch`. Any failure releases
/// the other ranks' launches on this rank's stream, so that none waits for this one forever.
unsafe fn launch_synced_pushes(
    group: &Group,
    state: &PeerState,
    call: &Gather,
    rank: usize,
    epoch: u64,
) -> Result<()> {
    let stream = group.streams()[rank].as_ptr().cast();
    let rendezvous = state.rendezvous()?;
    match prepared(group, state, call, PeerMethod::KernelPushes, |p| push_batch(group, call, p)) {
        Ok(batches) => launch_or_release(rendezvous, &batches[rank], rank, stream, epoch),
        Err(err) => {
            rendezvous.release(epoch, &[(rank, stream)]);
            Err(err)
        }
    }
}

/// Launches rank `rank`'s `batch` for `epoch`, or, when that fails, releases the other ranks'
/// launches of `epoch` on `stream` (see `Rendezvous::release`).
unsafe fn launch_or_release(
    rendezvous: &Rendezvous,
    batch: &PreparedBatch,
    rank: usize,
    stream: CUstream,
    epoch: u64,
) -> Result<()> {
    let launched = batch.launch_synced(stream, rendezvous.rank(rank), epoch);
    if launched.is_err() {
        rendezvous.release(epoch, &[(rank, stream)]);
    }
    launched
}

/// Rank `p`'s pushes for the batched kernel, tiled for a copy between GPUs.
fn push_batch(group: &Group, call: &Gather, p: usize) -> Result<PreparedBatch> {
    let segments = rank_pushes(call, p);
    let bytes = segments.iter().map(|s| s.len).sum();
    PreparedBatch::tuned(group.devices()[p], &segments, false, peer_tile_shift(bytes), 0)
}

/// Rank `p`'s kernel pushes ordered by events (the host backend, whose "kernels" are queued copies):
/// on its stream, it waits for every other rank's `ready` (its receivers), pushes, and records `done`.
unsafe fn event_ordered_push(group: &Group, state: &PeerState, call: &Gather, p: usize) -> Result<()> {
    let (backend, device, stream) = (group.backend(), group.devices()[p], group.streams()[p]);
    for r in (0..group.size()).filter(|&r| r != p) {
        backend.wait(device, stream, state.ready[r])?;
    }
    backend.copy_segments(device, stream, &rank_pushes(call, p))?;
    backend.record(device, state.done[p], stream)
}

/// Rank `r`'s stream waits for every other rank's `done` (its pushers, see [`event_ordered_push`]).
unsafe fn wait_for_event_ordered_pushers(group: &Group, state: &PeerState, r: usize) -> Result<()> {
    for p in (0..group.size()).filter(|&p| p != r) {
        group.backend().wait(group.devices()[r], group.streams()[r], state.done[p])?;
    }
    Ok(())
}

/// Rank `p`'s copy-engine pushes, once every rank has recorded `ready`: its lane k waits for p's and
/// its destination's `ready`, copies p's block into rank (p + k + 1) mod G, and records
/// `joined[p][k]`. p's stream copies its own block meanwhile (`own`: see [`own_block_batches`]), then
/// waits for its lanes (they read its send buffer). A single rank only copies its own block.
unsafe fn lane_pushes(
    group: &Group,
    state: &PeerState,
    call: &Gather,
    p: usize,
    own: Option<&[Arc<PreparedBatch>]>,
) -> Result<()> {
    let (backend, device, stream) = (group.backend(), group.devices()[p], group.streams()[p]);
    if call.counts[p] == 0 {
        return Ok(());
    }
    let lanes = state.lanes()?;
    for (lane, r) in push_order(p, group.size()).enumerate() {
        let lane_stream = lanes.streams[p][lane];
        backend.wait(device, lane_stream, state.ready[p])?;
        backend.wait(device, lane_stream, state.ready[r])?;
        let block = call.block_into(p, r).expect("a non-empty block into another rank's buffer");
        backend.copy_segments(device, lane_stream, &[block])?;
        backend.record(device, lanes.joined[p][lane], lane_stream)?;
    }
    match own {
        Some(batches) => batches[p].launch(stream.as_ptr().cast())?,
        None => call.block_into(p, p).map_or(Ok(()), |b| backend.copy_segments(device, stream, &[b]))?,
    }
    for &joined in &lanes.joined[p] {
        backend.wait(device, stream, joined)?;
    }
    Ok(())
}

/// Rank `r`'s stream waits for the lanes that wrote into its buffer (see [`lane_pushes`]).
unsafe fn wait_for_lane_pushers(group: &Group, state: &PeerState, call: &Gather, r: usize) -> Result<()> {
    let n = group.size();
    let lanes = state.lanes()?;
    for p in (0..n).filter(|&p| p != r && call.counts[p] > 0) {
        group.backend().wait(group.devices()[r], group.streams()[r], lanes.joined[p][push_lane(p, r, n)])?;
    }
    Ok(())
}

/// Every rank's copy of its own block into its own buffer beside its copy-engine pushes, as kernels
/// on a few blocks; None where the copy engine copies it (the host backend, or no kernel, or a single
/// rank, which has no pushes to stay out of the way of).
///
/// At full speed a local copy finishes long before the pushes over NVLink and saturates the GPU's
/// memory while it runs, which slows the pushes' reads and the peers' writes; throttled to
/// [`OWN_COPY_BLOCKS`] blocks it runs alongside the pushes for most of their time instead.
fn own_block_batches(
    group: &Group,
    state: &PeerState,
    call: &Gather,
) -> Result<Option<Vec<Arc<PreparedBatch>>>> {
    if group.size() == 1 || group.backend_kind() != BackendKind::Cuda || !kernels_run_state(group, state) {
        return Ok(None);
    }
    prepared(group, state, call, PeerMethod::CopyEnginePushes, |p| {
        let own: Vec<Segment> = call.block_into(p, p).into_iter().collect();
        let mut batch = PreparedBatch::new(group.devices()[p], &own, false)?;
        batch.limit_blocks(OWN_COPY_BLOCKS);
        Ok(batch)
    })
    .map(Some)
}

/// Every rank's prepared kernel batch for the last peer call of one method (kernel pushes: its
/// pushes; copy-engine pushes: its own-block copy), reused while the buffers and counts stay the
/// same (collectives in a loop).
struct PreparedCall {
    method: PeerMethod,
    send: Vec<u64>,
    recv: Vec<u64>,
    counts: Vec<usize>,
    per_rank: Vec<Arc<PreparedBatch>>,
}

impl PreparedCall {
    fn matches(&self, method: PeerMethod, call: &Gather) -> bool {
        self.method == method
            && self.send == call.send
            && self.recv == call.recv
            && self.counts == call.counts
    }
}

/// The group's prepared batches for `call` under `method`, one per rank: the last call's when they
/// match, else `build(rank)` for every rank. Shared, so that a rank thread may launch its batch after
/// another has replaced the cache (a batch frees its descriptors when its last holder drops it).
fn prepared(
    group: &Group,
    state: &PeerState,
    call: &Gather,
    method: PeerMethod,
    build: impl Fn(usize) -> Result<PreparedBatch>,
) -> Result<Vec<Arc<PreparedBatch>>> {
    let mut cached = lock(&state.prepared);
    if let Some(hit) = cached.as_ref().filter(|c| c.matches(method, call)) {
        return Ok(hit.per_rank.clone());
    }
    *cached = None; // free the old descriptors first
    let per_rank = (0..group.size()).map(|p| build(p).map(Arc::new)).collect::<Result<Vec<_>>>()?;
    *cached = Some(PreparedCall {
        method,
        send: call.send.to_vec(),
        recv: call.recv.to_vec(),
        counts: call.counts.to_vec(),
        per_rank: per_rank.clone(),
    });
    Ok(per_rank)
}

/// Tile size (log2 bytes) for a batch of `bytes` pushed between GPUs: about 128 tiles, from 1 KiB to
/// 32 KiB. Writes into a peer's memory are posted, so a warp with a larger tile keeps more of them
/// in flight, until the batch has too few tiles to spread over the SMs. A sweep of tile sizes put
/// the best tile near a fixed count of tiles per batch at every block size (docs/decisions.md;
/// benches/gpu_allgather.rs measures the kernel pushes at every size).
pub fn peer_tile_shift(bytes: u64) -> u32 {
    let per_tile = (bytes / 128).max(1);
    (63 - per_tile.leading_zeros()).clamp(10, 15)
}

/// What rank `p` pushes: its block into every rank's slot, in [`push_order`] with its own slot last,
/// unless the block is empty or already in place.
fn rank_pushes(call: &Gather, p: usize) -> Vec<Segment> {
    push_order(p, call.ranks()).chain([p]).filter_map(|r| call.block_into(p, r)).collect()
}

/// The ranks `rank` pushes its block to, lane by lane: rank+1, rank+2, ... (wrapping), itself left
/// out. At each lane index every GPU receives from exactly one other.
pub(super) fn push_order(rank: usize, n: usize) -> impl Iterator<Item = usize> {
    (1..n).map(move |k| (rank + k) % n)
}

/// The lane on which `pusher` writes into `receiver` (the inverse of [`push_order`]).
fn push_lane(pusher: usize, receiver: usize, n: usize) -> usize {
    (receiver + n - pusher) % n - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_lanes_are_permutations_and_push_lane_inverts_push_order() {
        assert_eq!(push_order(1, 3).collect::<Vec<_>>(), vec![2, 0]);
        assert_eq!(push_order(0, 1).count(), 0);
        for n in 2..9 {
            for lane in 0..n - 1 {
                let mut receivers: Vec<usize> = (0..n).map(|p| push_order(p, n).nth(lane).unwrap()).collect();
                receivers.sort_unstable();
                assert_eq!(receivers, (0..n).collect::<Vec<_>>(), "n={n} lane {lane}");
            }
            for p in 0..n {
                for (lane, r) in push_order(p, n).enumerate() {
                    assert_ne!(r, p);
                    assert_eq!(push_lane(p, r, n), lane, "n={n} p={p} r={r}");
                }
            }
        }
    }

    #[test]
    fn pushes_cover_every_block_once_per_receiver_own_slot_last() {
        // 3 ranks, rank 1 empty, rank 2 in place: every (receiver, owner) pair with bytes, once.
        let counts = [10usize, 0, 5];
        let layout = super::super::call::layout(&counts).unwrap();
        let call =
            Gather { send: &[100, 200, 3000 + 10], recv: &[1000, 2000, 3000], counts: &counts, layout };
        let got: Vec<Vec<(u64, u64, u64)>> =
            (0..3).map(|p| rank_pushes(&call, p).iter().map(|s| (s.src, s.dst, s.len)).collect()).collect();
        let want = vec![
            vec![(100, 2000, 10), (100, 3000, 10), (100, 1000, 10)],
            vec![],
            vec![(3010, 1010, 5), (3010, 2010, 5)],
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn peer_batches_get_about_128_tiles_of_1_to_32_kib() {
        assert_eq!(peer_tile_shift(0), 10);
        assert_eq!(peer_tile_shift(128 << 10), 10);
        assert_eq!(peer_tile_shift(512 << 10), 12);
        assert_eq!(peer_tile_shift(2 << 20), 14);
        assert_eq!(peer_tile_shift(4 << 20), 15);
        assert_eq!(peer_tile_shift(1 << 40), 15);
    }

    #[test]
    fn method_by_block_size_unless_overridden_and_copy_engine_for_one_rank() {
        use crate::group::{BackendChoice, GroupOptions};
        let host = |n: i32| {
            let devices: Vec<i32> = (0..n).collect();
            Group::new(&devices, GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
        };
        let (one, two) = (host(1), host(2));
        let method = |group: &Group, mean_block: u64| method_for(group, mean_block).unwrap();
        assert_eq!(method(&two, 0), PeerMethod::KernelPushes);
        assert_eq!(method(&two, COPY_ENGINE_FROM - 1), PeerMethod::KernelPushes);
        assert_eq!(method(&two, COPY_ENGINE_FROM), PeerMethod::CopyEnginePushes);
        set_method(&two, Some(PeerMethod::KernelPushes)).unwrap();
        assert_eq!(method(&two, 1 << 40), PeerMethod::KernelPushes);
        set_method(&two, None).unwrap();
        assert_eq!(method(&two, 1 << 40), PeerMethod::CopyEnginePushes);
        for forced in PeerMethod::ALL {
            set_method(&one, Some(forced)).unwrap();
            assert_eq!(method(&one, 0), PeerMethod::CopyEnginePushes, "one rank has no peer");
        }
    }
}
