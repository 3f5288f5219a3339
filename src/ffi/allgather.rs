//! Allgather's C API.
//!
//! Exports take raw pointers from C and are not `unsafe fn` (C cannot tell the difference); each
//! pointer is checked by the argument helpers before use, inside the boundary.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::handles::live;
use super::{boundary, slice};
use crate::allgather::{allgather, allgather_rank, Algorithm};
use crate::error::Status;
use crate::ffi::group::refit_group;

/// Choose by topology and size (see refit_allgather) and report the pick.
pub const REFIT_ALLGATHER_AUTO: u32 = 0;
/// NCCL (ncclAllGather for equal counts, grouped ncclSend/ncclRecv for uneven ones). CUDA backend only.
pub const REFIT_ALLGATHER_NCCL: u32 = 1;
/// Peer copies between the GPUs: each rank writes its block into every rank's buffer, below 32 MiB
/// per rank with one launch of refit's copy kernel (the ranks' launches meeting through flags in device
/// memory), from 32 MiB with copy-engine copies on parallel streams. Groups without direct peer access
/// always use copy-engine copies (staged by the driver), and so does every group when the kernel cannot
/// be built (no libnvrtc; logged once per group as a warning).
pub const REFIT_ALLGATHER_PEER: u32 = 2;
/// Staged through host memory (in parts of at most 8 MiB, whatever the counts), synchronous: a
/// reference path and last resort.
pub const REFIT_ALLGATHER_HOST: u32 = 3;

fn write_pick(picked: *mut u32, algorithm: Algorithm) {
    // SAFETY: NULL or a writable u32 (the caller's promise).
    if let Some(slot) = unsafe { picked.as_mut() } {
        *slot = algorithm.code();
    }
}

/// Gathers every rank's block into every rank's receive buffer, in rank order.
///
/// `send`, `recv` and `counts` have refit_group_size() entries. Rank r contributes `counts[r]` bytes at
/// device address `send[r]` (on its device); `recv[r]` is a buffer of sum(counts) bytes on rank r's
/// device that receives rank p's block at offset counts[0] + ... + counts[p-1]. Counts may differ and may
/// be 0. In place: `send[r] == recv[r] + offset of r`. `algo` is a REFIT_ALLGATHER_*; `picked`, if not
/// NULL, receives the algorithm that ran. Every call first checks that each buffer is memory its
/// rank's device can use (on CUDA one driver query per allocation; on the host backend one read of
/// the process's mappings), so that a bad address is a status rather than a fault in a copy.
///
/// AUTO picks PEER on the host backend, for one rank, and when every pair of ranks has direct peer
/// access (there PEER moves more than NCCL's allgather from 1 MiB per rank and takes less host time
/// per call; below 1 MiB NCCL's GPU time is shorter, but a call in a loop costs the larger of its
/// host and GPU times: benches/gpu_allgather.rs, figures in docs/measurements.md); otherwise NCCL
/// when it loads, else PEER.
///
/// PEER issues every rank's launches and copies at once: the calling thread issues rank 0's, and each
/// other rank's are issued by that rank's thread when it is awake (within 50 us of the group's
/// previous call), else by the calling thread too. The calling thread's current CUDA context is left
/// as it was.
///
/// Ordering: inside a scope (refit_group_enter) the work is queued on the group's streams and this
/// returns without waiting; outside a scope it runs in an implicit scope on the legacy default streams
/// and is complete when this returns (HOST is always complete on return). Once the work queued on rank
/// r's stream has run, recv[r] holds every block and no rank reads send[r] any more: work queued
/// after the call on rank r's stream may read recv[r] and overwrite send[r]. PEER with kernels waits on
/// the GPU for every rank's launch, like NCCL: a rank's stream must not depend on work that another
/// rank's stream only reaches after this call. If one rank's launch fails, the call returns its error
/// and the ranks that launched are released once the failed rank's stream reaches the call; recv is
/// then undefined. Not for CUDA graph capture (each call's launches carry a fresh rendezvous epoch).
///
/// Thread-safety: as the group's; not from a rank callback (use refit_group_allgather_rank there).
///
/// Errors: NULL_ARGUMENT (group, arrays, a NULL buffer with a non-zero size), INVALID_ARGUMENT (algo,
/// overflowing sizes, a buffer that is not memory its rank's device can use, checked as
/// refit_copy_batch checks segments, send buffers read and receive buffers written: the message
/// names send[r] or recv[r]), OVERLAP (a send buffer overlapping its receive buffer other than in place, or two
/// receive buffers overlapping), UNSUPPORTED (NCCL on the host backend), NCCL_UNAVAILABLE, NCCL_ERROR,
/// CUDA_ERROR, INVALID_STATE (called from a rank callback), OUT_OF_MEMORY.
#[no_mangle]
pub extern "C" fn refit_allgather(
    group: *mut refit_group,
    send: *const u64,
    recv: *const u64,
    counts: *const usize,
    algo: u32,
    picked: *mut u32,
) -> Status {
    boundary("refit_allgather", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        let n = group.size();
        // SAFETY: arrays of refit_group_size() entries (the caller's promise).
        let (send, recv, counts) =
            unsafe { (slice(send, n, "send")?, slice(recv, n, "recv")?, slice(counts, n, "counts")?) };
        let algorithm = Algorithm::from_code(algo)?;
        // SAFETY: the caller promises valid device memory of the sizes given.
        let ran = unsafe { allgather(group, send, recv, counts, algorithm) }?;
        write_pick(picked, ran);
        Ok(())
    })
}

/// The per-rank allgather, for refit_group_run callbacks: every rank's callback calls it with its own
/// `rank`, `send` (counts[rank] bytes) and `recv` (sum(counts) bytes) and the same `counts` (all
/// refit_group_size() of them) and `algo`. Queued on the rank's stream (HOST completes on return);
/// once that work has run, `recv` holds every block and `send` is no longer read. PEER is this rank's
/// share of refit_allgather's PEER, with the same methods, and costs what a whole-group call costs
/// (benches/gpu_allgather.rs, loop of calls, against NCCL called per rank).
/// Ranks meet at an abortable barrier (spinning briefly, then blocking), and each call is a call of
/// its own: a rank meets only the other ranks' same call, never the next one. Instead of waiting
/// forever, or returning with blocks missing, it returns ABORTED when another rank's callback failed
/// first; when another rank's callback returned without making this call; or when another rank left
/// this call after failing in it (its own error) and made a new call. Calls that fail for their
/// arguments fail on every rank alike (different counts or algorithms, overlapping receive buffers),
/// so a retry on every rank works; after ABORTED, recv is undefined and calling again on every rank
/// works too.
///
/// Errors: as refit_allgather, plus INVALID_STATE (not called from this group's rank callback),
/// INVALID_ARGUMENT (rank is not the calling callback's rank, or ranks passed different counts or
/// algorithms: every rank then fails), OVERLAP (also when two ranks' receive buffers overlap: every
/// rank then fails), ABORTED.
#[no_mangle]
pub extern "C" fn refit_group_allgather_rank(
    group: *mut refit_group,
    rank: u32,
    send: u64,
    recv: u64,
    counts: *const usize,
    algo: u32,
    picked: *mut u32,
) -> Status {
    boundary("refit_group_allgather_rank", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        // SAFETY: refit_group_size() counts.
        let counts = unsafe { slice(counts, group.size(), "counts") }?;
        let algorithm = Algorithm::from_code(algo)?;
        // SAFETY: the caller promises valid device memory of the sizes given.
        let ran = unsafe { allgather_rank(group, rank as usize, send, recv, counts, algorithm) }?;
        write_pick(picked, ran);
        Ok(())
    })
}
