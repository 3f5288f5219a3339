//! Allgather over a group: every rank receives every rank's block, in rank order, in its own buffer.
//!
//! BlockLayout: `recv[r]` holds `sum(counts)` bytes; rank p's block lands at `offset[p] = sum(counts[..p])`.
//! Counts may differ (allgatherv) and may be 0. A rank is *in place* when `send[r] == recv[r] +
//! offset[r]`; its own block is then not copied.
//!
//! Algorithms:
//! - `Peer`: each GPU copies its block into every rank's buffer directly. The whole-group call picks
//!   one of two methods by block size (`peer`): kernel pushes whose launches meet through flags in
//!   device memory, or copy-engine pushes on lanes ordered by events. The per-rank call is each
//!   rank's share of the same: the ranks meet once on the host to learn each other's buffers (and,
//!   for kernel pushes, to agree on the call's rendezvous epoch), then each launches its own kernel
//!   or queues its own lanes; the event-ordered methods meet once more so that every event waited
//!   on has been recorded.
//! - `Nccl`: equal counts use `ncclAllGather` (byte type), uneven counts use `ncclSend`/`ncclRecv`
//!   pairs inside one `ncclGroupStart/End` (no padding, so no extra bytes moved) plus a local copy of the
//!   own block. Communicators are created on first use with `ncclCommInitAll` and kept with the
//!   group (`state`).
//! - `Host`: synchronous staging through host memory (drain, read every block, write it to every rank).
//!   A reference path and a last resort; it blocks the host.
//!
//! `Auto` rule: the host backend, a single rank, or a group whose every pair has direct peer access
//! picks `Peer`; otherwise `Nccl` when it loads (it routes around missing peer access better than
//! driver-staged copies), else `Peer`. benches/gpu_allgather.rs measures peer against NCCL at every
//! size; docs/measurements.md has the figures.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

use crate::bail;
use crate::error::{try_reserve, try_vec, Error, Result, Status};
use crate::group::Group;
use crate::segment::Segment;
use crate::sync::lock;
use crate::transport::access::check_buffers;
use crate::transport::driver::CurrentContext;
use crate::transport::nccl::{nccl, Communicators};
use crate::transport::{Backend, BackendKind, MemoryRange, Stream};

mod call;
pub mod comm;
pub mod peer;
mod state;

use call::{buffer_name, check_counts, check_rank_buffers, ranges_overlap, rank_memory, BlockLayout, Gather};

use state::{AllgatherState, Published};

/// Which algorithm moves the bytes. Values are part of the C ABI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Algorithm {
    #[default]
    Auto = 0,
    Nccl = 1,
    Peer = 2,
    Host = 3,
}

impl Algorithm {
    pub fn from_code(code: u32) -> Result<Algorithm> {
        Ok(match code {
            0 => Algorithm::Auto,
            1 => Algorithm::Nccl,
            2 => Algorithm::Peer,
            3 => Algorithm::Host,
            _ => bail!(Status::InvalidArgument, "algorithm {code} is not one of REFIT_ALLGATHER_* (0..=3)"),
        })
    }

    pub fn code(self) -> u32 {
        self as u32
    }
}

/// The algorithm `requested` resolves to on this group (see the module docs for the `Auto` rule).
/// `Unsupported` for NCCL on the host backend, `NcclUnavailable` when NCCL cannot be loaded.
pub fn choose(group: &Group, requested: Algorithm) -> Result<Algorithm> {
    let host_backend = group.backend_kind() == BackendKind::Host;
    match requested {
        Algorithm::Auto => Ok(if host_backend || group.size() == 1 || group.all_peers_direct() {
            Algorithm::Peer
        } else if nccl().is_ok() {
            Algorithm::Nccl
        } else {
            Algorithm::Peer
        }),
        Algorithm::Nccl if host_backend => Err(Error::unsupported(
            "the NCCL algorithm needs the CUDA backend (this group uses the host backend)",
        )),
        Algorithm::Nccl => nccl().map(|_| Algorithm::Nccl),
        other => Ok(other),
    }
}

/// Whole-group allgather: `send[r]`, `recv[r]` and `counts[r]` for every rank r. Queued on the group's
/// streams inside the open scope, or complete on return when no scope is open. Returns the algorithm
/// that ran.
///
/// # Safety
/// Every address must be valid device memory of its rank (host memory on the host backend) for the
/// sizes given, until the queued work has completed.
pub unsafe fn allgather(
    group: &Group,
    send: &[u64],
    recv: &[u64],
    counts: &[usize],
    requested: Algorithm,
) -> Result<Algorithm> {
    let _driving = group.drive()?;
    let n = group.size();
    if send.len() != n || recv.len() != n {
        bail!(
            Status::InvalidArgument,
            "{} send and {} recv buffers for a group of {n}",
            send.len(),
            recv.len()
        );
    }
    let layout = check_counts(group, counts)?;
    for r in 0..n {
        check_rank_buffers(r, send[r], recv[r], counts[r] as u64, &layout)?;
        for q in 0..r {
            if ranges_overlap(recv[r], layout.total, recv[q], layout.total) {
                bail!(Status::Overlap, "recv[{q}] and recv[{r}] overlap");
            }
        }
    }
    let devices = group.devices();
    let memory: Vec<MemoryRange> = (0..n)
        .flat_map(|r| rank_memory(devices[r], send[r], recv[r], counts[r] as u64, layout.total))
        .collect();
    check_buffers(group.backend().as_ref(), &memory, |i| buffer_name(i, 0))?;
    let algorithm = choose(group, requested)?;
    if layout.total == 0 {
        return Ok(algorithm);
    }
    let call = Gather { send, recv, counts, layout };
    group.in_implicit_scope(|| match algorithm {
        Algorithm::Peer => peer::allgather(group, &*peer::state(group)?, &call).map(|_| ()),
        Algorithm::Nccl => nccl_all(group, &*state::state(group)?, &call),
        Algorithm::Host => host_all(group, &call),
        Algorithm::Auto => unreachable!("choose resolves Auto"),
    })?;
    Ok(algorithm)
}

fn equal_counts(counts: &[usize]) -> bool {
    counts.windows(2).all(|w| w[0] == w[1])
}

unsafe fn nccl_all(group: &Group, state: &AllgatherState, call: &Gather) -> Result<()> {
    let (send, recv, counts, layout) = (call.send, call.recv, call.counts, &call.layout);
    group.join_if_pending()?;
    let comms = state.communicators()?;
    let streams = group.streams();
    // One thread drives every rank: all their calls go in one NCCL group.
    comms.grouped(|| {
        (0..group.size())
            .try_for_each(|r| nccl_rank_calls(comms, r, send[r], recv[r], counts, layout, streams[r]))
    })?;
    if !equal_counts(counts) {
        for r in 0..group.size() {
            own_block_copy(group, r, send[r], recv[r], counts, layout)?;
        }
    }
    Ok(())
}

/// The NCCL calls of one rank: `ncclAllGather` for equal counts, else a send of its block to and a
/// receive of their block from every other rank (inside an NCCL group, which the caller opens).
unsafe fn nccl_rank_calls(
    comms: &Communicators,
    rank: usize,
    send: u64,
    recv: u64,
    counts: &[usize],
    layout: &BlockLayout,
    stream: Stream,
) -> Result<()> {
    if equal_counts(counts) {
        return comms.all_gather(rank, send, recv, counts[rank], stream);
    }
    for p in (0..counts.len()).filter(|&p| p != rank) {
        if counts[rank] > 0 {
            comms.send(rank, p, send, counts[rank], stream)?;
        }
        if counts[p] > 0 {
            comms.recv(rank, p, recv + layout.offsets[p], counts[p], stream)?;
        }
    }
    Ok(())
}

unsafe fn own_block_copy(
    group: &Group,
    rank: usize,
    send: u64,
    recv: u64,
    counts: &[usize],
    layout: &BlockLayout,
) -> Result<()> {
    let dst = recv + layout.offsets[rank];
    if counts[rank] == 0 || send == dst {
        return Ok(());
    }
    group.backend().copy_segments(
        group.devices()[rank],
        group.streams()[rank],
        &[Segment::contiguous(send, dst, counts[rank] as u64)],
    )
}

/// The `Host` algorithm moves a block through host memory this many bytes at a time, so that its
/// buffer does not grow with the caller's counts.
const HOST_STAGING_BYTES: usize = 8 << 20;

/// Copies `len` bytes from `src` on device `from` to every `(device, dst)` of `to`, through `staging`
/// (grown to at most HOST_STAGING_BYTES), one chunk at a time.
///
/// # Safety
/// The source and every destination range must be valid for `len` bytes on their devices.
unsafe fn stage_block(
    backend: &dyn Backend,
    staging: &mut Vec<u8>,
    (from, src): (i32, u64),
    to: &[(i32, u64)],
    len: usize,
) -> Result<()> {
    let chunk = len.min(HOST_STAGING_BYTES);
    if staging.len() < chunk {
        try_reserve(staging, chunk - staging.len(), "the host staging buffer")?;
        staging.resize(chunk, 0);
    }
    for offset in (0..len).step_by(HOST_STAGING_BYTES) {
        let part = &mut staging[..chunk.min(len - offset)];
        backend.read(from, src + offset as u64, part)?;
        for &(device, dst) in to {
            backend.write(device, dst + offset as u64, part)?;
        }
    }
    Ok(())
}

unsafe fn host_all(group: &Group, call: &Gather) -> Result<()> {
    let (backend, devices) = (group.backend(), group.devices());
    group.synchronize()?;
    let mut staging = Vec::new();
    let mut receivers = try_vec(call.ranks(), "the allgather's receivers")?;
    for p in (0..call.ranks()).filter(|&p| call.counts[p] > 0) {
        receivers.clear();
        receivers
            .extend((0..call.ranks()).filter_map(|r| call.block_into(p, r).map(|b| (devices[r], b.dst))));
        stage_block(backend.as_ref(), &mut staging, (devices[p], call.send[p]), &receivers, call.counts[p])?;
    }
    Ok(())
}

/// Per-rank allgather, called by every rank's callback inside `Group::run` with the same `counts` and
/// `requested`. Queued on the rank's stream (the `Host` algorithm completes before returning).
/// Ranks meet at an abortable barrier: if another rank fails first, this returns `Aborted`.
///
/// # Safety
/// As for [`allgather`], for this rank's buffers.
pub unsafe fn allgather_rank(
    group: &Group,
    rank: usize,
    send: u64,
    recv: u64,
    counts: &[usize],
    requested: Algorithm,
) -> Result<Algorithm> {
    group.check_rank_thread(rank)?;
    let layout = check_counts(group, counts)?;
    check_rank_buffers(rank, send, recv, counts[rank] as u64, &layout)?;
    let memory = rank_memory(group.devices()[rank], send, recv, counts[rank] as u64, layout.total);
    check_buffers(group.backend().as_ref(), &memory, |i| buffer_name(i, rank))?;
    let algorithm = choose(group, requested)?;
    let state = state::state(group)?;
    if algorithm == Algorithm::Nccl {
        // Created before anyone publishes, so that a failure here is this rank's own error.
        state.communicators()?;
    }
    // Slots alternate by barrier crossing: every rank reads the same count here, since the next
    // crossing needs every rank, and a rank one call ahead writes the other parity.
    let slots = &state.slots[(group.barrier().crossings() % 2) as usize];
    {
        let mut mine = lock(&slots[rank]);
        mine.send = send;
        mine.recv = recv;
        mine.counts.clear();
        mine.counts.extend_from_slice(counts);
        mine.algorithm = requested.code();
    }
    let backend = group.backend();
    let device = group.devices()[rank];
    let stream = group.streams()[rank];
    let n = group.size();
    let peer_state = peer::state(group)?;
    let peer_method = (algorithm == Algorithm::Peer)
        .then(|| peer::method_for_state(group, &peer_state, layout.total / n as u64));
    match (algorithm, peer_method) {
        (Algorithm::Peer, Some(method)) => peer::before_meeting(group, &peer_state, rank, method)?,
        (Algorithm::Host, _) => backend.sync_stream(device, stream)?,
        _ => {}
    }
    // Kernel pushes on the GPUs need one rendezvous epoch for the call, the same on every rank; every
    // rank then launches for it or releases it (peer::rank_share), so no epoch is skipped.
    let meets_on_gpu = layout.total > 0 && peer_method.is_some_and(|m| peer::meets_on_gpu(group, m));
    let (mut entered, epoch) = group.barrier().enter(|| match (meets_on_gpu, peer_state.rendezvous()) {
        (true, Ok(rendezvous)) => rendezvous.next_epoch(),
        _ => 0,
    })?;
    // An epoch was taken whenever the last rank to arrive saw kernel pushes, even if this rank's own
    // arguments (which then disagree, and fail below) gave another method: release it all the same.
    let release_epoch = || {
        if let (true, Ok(rendezvous)) = (epoch > 0, peer_state.rendezvous()) {
            rendezvous.release(epoch, &[(rank, stream.as_ptr().cast())]);
        }
    };
    let peers = published(slots, rank, counts, requested).inspect_err(|_| release_epoch())?;
    if layout.total == 0 {
        return Ok(algorithm);
    }
    match algorithm {
        Algorithm::Peer => {
            let send: Vec<u64> = peers.iter().map(|p| p.send).collect();
            let recv: Vec<u64> = peers.iter().map(|p| p.recv).collect();
            let call = Gather { send: &send, recv: &recv, counts, layout };
            let method = peer_method.expect("decided for Peer");
            peer::rank_share(group, &peer_state, &call, rank, method, &mut entered, epoch)?;
        }
        Algorithm::Nccl => {
            let comms = state.communicators()?;
            let calls = || nccl_rank_calls(comms, rank, send, recv, counts, &layout, stream);
            if equal_counts(counts) {
                let _current = CurrentContext::preserve()?;
                calls()?;
            } else {
                // A rank's sends and receives go in one NCCL group, or the first send could wait forever.
                comms.grouped(calls)?;
                own_block_copy(group, rank, send, recv, counts, &layout)?;
            }
        }
        Algorithm::Host => {
            let mut staging = Vec::new();
            for (p, peer) in peers.iter().enumerate() {
                let dst = recv + layout.offsets[p];
                if counts[p] == 0 || peer.send == dst {
                    continue;
                }
                let from = (group.devices()[p], peer.send);
                stage_block(backend.as_ref(), &mut staging, from, &[(device, dst)], counts[p])?;
            }
            // Owners must not change their blocks until every rank has read them.
            group.barrier().meet(&mut entered)?;
        }
        Algorithm::Auto => unreachable!("choose resolves Auto"),
    }
    Ok(algorithm)
}

/// Every rank's published arguments, checked to agree with ours. All ranks run the same checks on
/// the same data (every pair of receive buffers, not only their own), so they all fail or all go on.
fn published(
    slots: &[std::sync::Mutex<Published>],
    rank: usize,
    counts: &[usize],
    requested: Algorithm,
) -> Result<Vec<Published>> {
    let peers: Vec<Published> = slots.iter().map(|s| lock(s).clone()).collect();
    for (p, peer) in peers.iter().enumerate() {
        if peer.counts != counts || peer.algorithm != requested.code() {
            bail!(
                Status::InvalidArgument,
                "rank {p} called allgather_rank with counts {:?} / algorithm {}, rank {rank} with {:?} / {} \
                 (every rank must pass the same)",
                peer.counts,
                peer.algorithm,
                counts,
                requested.code()
            );
        }
    }
    let total: u64 = counts.iter().map(|&c| c as u64).sum();
    for q in 0..peers.len() {
        for p in 0..q {
            if ranges_overlap(peers[p].recv, total, peers[q].recv, total) {
                bail!(Status::Overlap, "recv buffers of ranks {p} and {q} overlap");
            }
        }
    }
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_codes_round_trip_and_reject_unknown_values() {
        for a in [Algorithm::Auto, Algorithm::Nccl, Algorithm::Peer, Algorithm::Host] {
            assert_eq!(Algorithm::from_code(a.code()).unwrap(), a);
        }
        assert_eq!(Algorithm::from_code(u32::MAX).unwrap_err().status, Status::InvalidArgument);
    }
}
