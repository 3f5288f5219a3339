//! Allgather over a group: every rank receives every rank's block, in rank order, in its own buffer.
//!
//! Layout: `recv[r]` holds `sum(counts)` bytes; rank p's block lands at `offset[p] = sum(counts[..p])`.
//! Counts may differ (allgatherv) and may be 0. A rank is *in place* when `send[r] == recv[r] +
//! offset[r]`; its own block is then not copied.
//!
//! Algorithms:
//! - `Peer`: every rank pulls every other block at once on its own stream. Ordering: each rank records
//!   `ready` after its inputs and readers wait on it. That owners' streams also wait for their readers
//!   is deferred to the next group call, run() or exit (one join per scope instead of one per call, for
//!   host time); the per-rank variant joins at once with a second barrier. Blocks are pulled in
//!   rotated order (rank r reads r+1, r+2, ...), so that at each step every GPU is read by one other.
//!   From `PEER_LANES_MIN_BYTES` (16 MiB) per block the pulls are copy-engine copies (one `cuMemcpyAsync` per
//!   block; unified addressing routes it over NVLink), each peer block on an extra "lane" stream forked
//!   from and joined back into the rank's stream, beside the own-block copy: CEILINGS.md measured CE
//!   peer copies at 396 GB/s one way and 782 both ways, an SM pull kernel at 374 / 673. Below it, where
//!   issuing copies costs more than moving them, each rank's pulls are one prepared batched-kernel
//!   launch (`PreparedPulls`, kept while the buffers stay the same). On the host backend the same code
//!   runs on simulated streams.
//! - `Nccl`: equal counts use `ncclAllGather` (byte type), uneven counts use `ncclSend`/`ncclRecv`
//!   pairs inside one `ncclGroupStart/End` (no padding, so no extra bytes moved) plus a local copy of the
//!   own block. Communicators are created on first use with `ncclCommInitAll` and kept on the group.
//! - `Host`: synchronous staging through host memory (drain, read every block, write it to every rank).
//!   A reference path and a last resort; it blocks the host.
//!
//! `Auto` rule: the host backend, a single rank, or a group whose every pair has direct peer access
//! picks `Peer`: on 2 x H200 (run of 2026-11-30, benches/results/gpu_allgather.json) it moved 1.3x
//! NCCL's bytes at 1 MiB per rank, 1.35-1.46x from 16 MiB, and spent 9.3 against 12.5 us of host time
//! per call on tiny blocks. Otherwise `Nccl` when it loads (it routes around missing peer access better
//! than driver-staged copies), else `Peer`. benches/gpu_allgather.rs re-measures the comparison.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

use crate::backend::driver::CurrentContext;
use crate::backend::nccl::{nccl, Communicators};
use crate::backend::BackendKind;
use crate::bail;
use crate::copy::PreparedCopy;
use crate::error::{Error, Result, Status};
use crate::group::{Group, Published};
use crate::segment::Segment;
use std::sync::atomic::Ordering;

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

/// Block offsets and total size, after checking every argument against the group.
struct Layout {
    offsets: Vec<u64>,
    total: u64,
}

fn layout(counts: &[usize]) -> Result<Layout> {
    let mut offsets = Vec::with_capacity(counts.len());
    let mut total: u64 = 0;
    for (p, &count) in counts.iter().enumerate() {
        offsets.push(total);
        total = total
            .checked_add(count as u64)
            .ok_or_else(|| Error::invalid_argument(format!("counts overflow at counts[{p}]")))?;
    }
    Ok(Layout { offsets, total })
}

fn ranges_overlap(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

fn end_fits(start: u64, len: u64, what: &str) -> Result<()> {
    start
        .checked_add(len)
        .map(|_| ())
        .ok_or_else(|| Error::invalid_argument(format!("{what} + its size overflows")))
}

fn check_rank_buffers(rank: usize, send: u64, recv: u64, count: u64, layout: &Layout) -> Result<()> {
    if count > 0 && send == 0 {
        bail!(Status::NullArgument, "send[{rank}] is NULL but counts[{rank}] is {count}");
    }
    if layout.total > 0 && recv == 0 {
        bail!(Status::NullArgument, "recv[{rank}] is NULL but the gathered size is {}", layout.total);
    }
    end_fits(send, count, &format!("send[{rank}]"))?;
    end_fits(recv, layout.total, &format!("recv[{rank}]"))?;
    let own_slot = recv + layout.offsets[rank];
    if send != own_slot && ranges_overlap(send, count, recv, layout.total) {
        bail!(
            Status::Overlap,
            "send[{rank}] overlaps recv[{rank}] but is not rank {rank}'s slot (recv[{rank}] + {}): \
             in place means exactly that address",
            layout.offsets[rank]
        );
    }
    Ok(())
}

fn check_counts(group: &Group, counts: &[usize]) -> Result<Layout> {
    if counts.len() != group.size() {
        bail!(Status::InvalidArgument, "{} counts for a group of {}", counts.len(), group.size());
    }
    layout(counts)
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
    if crate::group::workers::inside_any_run() {
        bail!(Status::InvalidState, "whole-group allgather called from a rank callback: use allgather_rank");
    }
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
    let algorithm = choose(group, requested)?;
    if layout.total == 0 {
        return Ok(algorithm);
    }
    group.in_implicit_scope(|| match algorithm {
        Algorithm::Peer => peer_all(group, send, recv, counts, &layout),
        Algorithm::Nccl => nccl_all(group, send, recv, counts, &layout),
        Algorithm::Host => host_all(group, send, recv, counts, &layout),
        Algorithm::Auto => unreachable!("choose resolves Auto"),
    })?;
    Ok(algorithm)
}

unsafe fn peer_all(
    group: &Group,
    send: &[u64],
    recv: &[u64],
    counts: &[usize],
    layout: &Layout,
) -> Result<()> {
    // After an earlier peer collective, every stream must also wait for every other (its readers):
    // the all-to-all ready waits below do that join.
    let join_all = group.take_pending_join();
    let issued = peer_issue(group, send, recv, counts, layout, join_all);
    // Rank p's stream does not wait here for the ranks reading its block: the next group call, run()
    // or exit joins them (Group::join_if_pending), and a SYNC exit drains every stream anyway. Marked
    // on failure too, so that a partly issued call is still joined.
    group.mark_pending_join();
    issued
}

unsafe fn peer_issue(
    group: &Group,
    send: &[u64],
    recv: &[u64],
    counts: &[usize],
    layout: &Layout,
    join_all: bool,
) -> Result<()> {
    let backend = group.backend();
    let devices = group.devices();
    let streams = group.streams();
    let state = &group.collective;
    let n = group.size();
    let orders = |p: usize| counts[p] > 0 || join_all;
    if n > 1 {
        for r in (0..n).filter(|&r| orders(r)) {
            backend.record(devices[r], state.ready[r], streams[r])?;
        }
    }
    let use_lanes = group.peer_lanes_for(layout.total / n as u64);
    let lanes = if use_lanes { Some(group.lanes()?) } else { None };
    let kernel_pulls = n > 1 && !use_lanes && backend.kind() == BackendKind::Cuda && group.all_peers_direct();
    let pulls = if kernel_pulls { Some(prepared_pulls(group, send, recv, counts, layout)?) } else { None };
    let mut segments = Vec::with_capacity(n);
    for r in 0..n {
        for p in (0..n).filter(|&p| p != r && orders(p)) {
            backend.wait(devices[r], streams[r], state.ready[p])?;
        }
        if let Some(pulls) = pulls.as_ref().and_then(|guard| guard.as_ref()) {
            if let Some(batch) = &pulls.per_rank[r] {
                batch.launch(streams[r])?;
            }
            continue;
        }
        segments.clear();
        let mut lane = 0;
        for p in pull_order(r, n).filter(|&p| counts[p] > 0) {
            let dst = recv[r] + layout.offsets[p];
            if send[p] == dst {
                continue;
            }
            let segment = Segment::contiguous(send[p], dst, counts[p] as u64);
            match lanes.as_deref().and_then(Option::as_ref) {
                // Each peer block on its own lane, forked from and joined back into the rank's stream.
                Some(lanes) if p != r => {
                    if lane == 0 {
                        backend.record(devices[r], lanes.fork[r], streams[r])?;
                    }
                    let lane_stream = lanes.streams[r][lane];
                    backend.wait(devices[r], lane_stream, lanes.fork[r])?;
                    backend.copy_segments(devices[r], lane_stream, &[segment])?;
                    backend.record(devices[r], lanes.joined[r][lane], lane_stream)?;
                    lane += 1;
                }
                _ => segments.push(segment),
            }
        }
        backend.copy_segments(devices[r], streams[r], &segments)?;
        if let Some(lanes) = lanes.as_deref().and_then(Option::as_ref) {
            for joined in &lanes.joined[r][..lane] {
                backend.wait(devices[r], streams[r], *joined)?;
            }
        }
    }
    Ok(())
}

/// Every rank's pulls of a small whole-group peer allgather as one prepared batched-kernel launch
/// each, kept for the next call with the same buffers and counts (collectives in a loop). For small
/// blocks the host time of issuing copies is the cost: one launch per rank replaces one copy-engine
/// call per block (on 2 x H200 at 256 B per rank: 18.7 us per call with copy-engine calls).
pub(crate) struct PreparedPulls {
    key: (Vec<u64>, Vec<u64>, Vec<usize>),
    pub per_rank: Vec<Option<PreparedCopy>>,
}

fn prepared_pulls<'g>(
    group: &'g Group,
    send: &[u64],
    recv: &[u64],
    counts: &[usize],
    layout: &Layout,
) -> Result<std::sync::MutexGuard<'g, Option<PreparedPulls>>> {
    let mut cached = group.collective.pulls.lock().unwrap_or_else(|p| p.into_inner());
    let fresh = cached.as_ref().is_some_and(|c| c.key.0 == send && c.key.1 == recv && c.key.2 == counts);
    if !fresh {
        *cached = None; // free the old descriptors first
        let n = group.size();
        let mut per_rank = Vec::with_capacity(n);
        for r in 0..n {
            let segments: Vec<Segment> = pull_order(r, n)
                .filter(|&p| counts[p] > 0 && send[p] != recv[r] + layout.offsets[p])
                .map(|p| Segment::contiguous(send[p], recv[r] + layout.offsets[p], counts[p] as u64))
                .collect();
            per_rank.push(if segments.is_empty() {
                None
            } else {
                Some(PreparedCopy::new(group, r, &segments, false)?)
            });
        }
        *cached = Some(PreparedPulls { key: (send.to_vec(), recv.to_vec(), counts.to_vec()), per_rank });
    }
    Ok(cached)
}

/// The order in which `rank` pulls blocks: rank+1, rank+2, ... (wrapping), its own block last. Every
/// step is then a permutation (each GPU is read by exactly one other GPU at a time) instead of every
/// rank reading rank 0 first, then rank 1, ..., which would load one GPU's links at a time.
fn pull_order(rank: usize, n: usize) -> impl Iterator<Item = usize> {
    (1..=n).map(move |k| (rank + k) % n)
}

fn communicators(group: &Group) -> Result<&Communicators> {
    group
        .collective
        .nccl
        .get_or_init(|| {
            let devices: Vec<i32> = group.devices().iter().map(|&d| d as i32).collect();
            let _current = CurrentContext::preserve()?;
            Communicators::create(&devices)
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn equal_counts(counts: &[usize]) -> bool {
    counts.windows(2).all(|w| w[0] == w[1])
}

unsafe fn nccl_all(
    group: &Group,
    send: &[u64],
    recv: &[u64],
    counts: &[usize],
    layout: &Layout,
) -> Result<()> {
    group.join_if_pending()?;
    let lib = nccl()?;
    let comms = communicators(group)?;
    let streams = group.streams();
    let n = group.size();
    let _current = CurrentContext::preserve()?;
    lib.group_start()?;
    let mut issued = Ok(());
    for r in 0..n {
        issued = nccl_rank_calls(lib, comms, r, send[r], recv[r], counts, layout, streams[r].0);
        if issued.is_err() {
            break;
        }
    }
    // Always close the NCCL group, even after a failed call, so NCCL's thread state stays balanced.
    let ended = lib.group_end();
    issued?;
    ended?;
    if !equal_counts(counts) {
        for r in 0..n {
            own_block_copy(group, r, send[r], recv[r], counts, layout)?;
        }
    }
    Ok(())
}

/// The NCCL calls of one rank (inside an NCCL group when the caller drives several ranks).
#[allow(clippy::too_many_arguments)]
unsafe fn nccl_rank_calls(
    lib: &crate::backend::nccl::Nccl,
    comms: &Communicators,
    rank: usize,
    send: u64,
    recv: u64,
    counts: &[usize],
    layout: &Layout,
    stream: u64,
) -> Result<()> {
    let comm = comms.comms[rank];
    if equal_counts(counts) {
        return lib.all_gather(send, recv, counts[rank], comm, stream);
    }
    for p in (0..counts.len()).filter(|&p| p != rank) {
        if counts[rank] > 0 {
            lib.send(send, counts[rank], p, comm, stream)?;
        }
        if counts[p] > 0 {
            lib.recv(recv + layout.offsets[p], counts[p], p, comm, stream)?;
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
    layout: &Layout,
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

unsafe fn host_all(
    group: &Group,
    send: &[u64],
    recv: &[u64],
    counts: &[usize],
    layout: &Layout,
) -> Result<()> {
    let backend = group.backend();
    let devices = group.devices();
    group.synchronize()?;
    let mut staging = Vec::new();
    for p in 0..group.size() {
        if counts[p] == 0 {
            continue;
        }
        staging.resize(counts[p], 0u8);
        backend.read(devices[p], send[p], &mut staging)?;
        for r in 0..group.size() {
            let dst = recv[r] + layout.offsets[p];
            if !(p == r && send[p] == dst) {
                backend.write(devices[r], dst, &staging)?;
            }
        }
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
    let algorithm = choose(group, requested)?;
    if algorithm == Algorithm::Nccl {
        // Created before anyone publishes, so that a failure here is this rank's own error.
        communicators(group)?;
    }
    let state = &group.collective;
    let call = state.calls[rank].fetch_add(1, Ordering::Relaxed);
    let slots = &state.slots[(call % 2) as usize];
    {
        let mut mine = slots[rank].lock().unwrap_or_else(|p| p.into_inner());
        mine.send = send;
        mine.recv = recv;
        mine.counts.clear();
        mine.counts.extend_from_slice(counts);
        mine.algorithm = requested.code();
    }
    let backend = group.backend();
    let device = group.devices()[rank];
    let stream = group.streams()[rank];
    match algorithm {
        Algorithm::Peer => backend.record(device, state.ready[rank], stream)?,
        Algorithm::Host => backend.sync_stream(device, stream)?,
        _ => {}
    }
    group.barrier().wait()?;
    let peers = published(group, slots, rank, counts, requested)?;
    if layout.total == 0 {
        return Ok(algorithm);
    }
    match algorithm {
        Algorithm::Peer => {
            let mut segments = Vec::with_capacity(peers.len());
            for p in (0..peers.len()).filter(|&p| p != rank && counts[p] > 0) {
                backend.wait(device, stream, state.ready[p])?;
            }
            for p in pull_order(rank, peers.len()).filter(|&p| counts[p] > 0) {
                let dst = recv + layout.offsets[p];
                if peers[p].send != dst {
                    segments.push(Segment::contiguous(peers[p].send, dst, counts[p] as u64));
                }
            }
            backend.copy_segments(device, stream, &segments)?;
            backend.record(device, state.done[rank], stream)?;
            group.barrier().wait()?;
            if counts[rank] > 0 {
                for p in (0..peers.len()).filter(|&p| p != rank) {
                    backend.wait(device, stream, state.done[p])?;
                }
            }
        }
        Algorithm::Nccl => {
            let lib = nccl()?;
            let comms = communicators(group)?;
            let _current = CurrentContext::preserve()?;
            let grouped = !equal_counts(counts);
            if grouped {
                lib.group_start()?;
            }
            let issued = nccl_rank_calls(lib, comms, rank, send, recv, counts, &layout, stream.0);
            let ended = if grouped { lib.group_end() } else { Ok(()) };
            issued?;
            ended?;
            if grouped {
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
                staging.resize(counts[p], 0u8);
                backend.read(group.devices()[p], peer.send, &mut staging)?;
                backend.write(device, dst, &staging)?;
            }
            // Owners must not change their blocks until every rank has read them.
            group.barrier().wait()?;
        }
        Algorithm::Auto => unreachable!("choose resolves Auto"),
    }
    Ok(algorithm)
}

/// Every rank's published arguments, checked to agree with ours (all ranks run the same check on the
/// same data, so they all fail or all go on).
fn published(
    group: &Group,
    slots: &[std::sync::Mutex<Published>],
    rank: usize,
    counts: &[usize],
    requested: Algorithm,
) -> Result<Vec<Published>> {
    let peers: Vec<Published> =
        slots.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).clone()).collect();
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
        if p != rank && group.size() > 1 {
            let total: usize = counts.iter().sum();
            if ranges_overlap(peer.recv, total as u64, peers[rank].recv, total as u64) {
                bail!(Status::Overlap, "recv buffers of ranks {p} and {rank} overlap");
            }
        }
    }
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_order_is_a_rotation_ending_with_the_own_block() {
        assert_eq!(pull_order(1, 3).collect::<Vec<_>>(), vec![2, 0, 1]);
        assert_eq!(pull_order(0, 1).collect::<Vec<_>>(), vec![0]);
        // At every step k, the ranks read distinct owners (a permutation).
        for n in 2..9 {
            for k in 0..n {
                let mut owners: Vec<usize> = (0..n).map(|r| pull_order(r, n).nth(k).unwrap()).collect();
                owners.sort_unstable();
                assert_eq!(owners, (0..n).collect::<Vec<_>>(), "n={n} step {k}");
            }
        }
    }

    #[test]
    fn algorithm_codes_round_trip_and_reject_unknown_values() {
        for a in [Algorithm::Auto, Algorithm::Nccl, Algorithm::Peer, Algorithm::Host] {
            assert_eq!(Algorithm::from_code(a.code()).unwrap(), a);
        }
        assert_eq!(Algorithm::from_code(u32::MAX).unwrap_err().status, Status::InvalidArgument);
    }

    #[test]
    fn layout_offsets_and_overflow() {
        let l = layout(&[3, 0, 5]).unwrap();
        assert_eq!((l.offsets, l.total), (vec![0, 3, 3], 8));
        assert_eq!(layout(&[usize::MAX, 2]).err().unwrap().status, Status::InvalidArgument);
    }
}
