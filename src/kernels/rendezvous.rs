//! The flags through which a device group's group-synchronized batched-copy launches meet (see
//! `refit_batched_copy_synced` in batched_copy.cu): one flag block per rank in that rank's memory,
//! written by its peers over NVLink, and an epoch that grows by one per synchronized call.
//!
//! Rank r's block is `2n` u64 words: arrived[p] (word p), the epoch of p's latest arrival, and
//! departed[p] (word n + p), which each of p's launches raises by [`DEPARTURE_UNITS`]. Each rank's
//! device also holds the table of every rank's block address, which its kernel reads.
//!
//! The batched copy kernel (`batched_copy`) takes part in a rendezvous; this file knows only the
//! driver, not the kernel.

use crate::error::Result;
use crate::transport::driver::{self, check, CurrentContext};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where one rank's kernel finds the rendezvous: its rank, the group size and the device address of
/// the table of flag blocks (on its own device).
#[derive(Clone, Copy, Debug)]
pub struct RankRendezvous {
    pub table: u64,
    pub rank: u32,
    pub ranks: u32,
}

struct RankFlags {
    /// The rank's device's primary context (retained for the life of the process).
    context: sys::CUcontext,
    /// This rank's flag block.
    block: u64,
    /// The table of every rank's block address, on this rank's device.
    table: u64,
}

/// The rendezvous state of one group. Every rank's device must have peer access to every other's
/// memory (the kernels write into their peers' flag blocks).
pub struct Rendezvous {
    ranks: Vec<RankFlags>,
    last_epoch: AtomicU64,
}

// SAFETY: device addresses and process-wide driver handles only.
unsafe impl Send for Rendezvous {}
unsafe impl Sync for Rendezvous {}

fn words(ranks: usize) -> usize {
    2 * ranks
}

/// What one launch adds to its departure count in every peer's block, split over its blocks; more
/// than any grid has blocks. Must match `DEPARTURE_UNITS` in batched_copy.cu.
pub const DEPARTURE_UNITS: u64 = 1 << 16;

impl Rendezvous {
    /// Allocates and zeroes a flag block and a table on every device (`devices[r]` for rank r).
    /// Synchronous. Errors: the driver's (InvalidDevice, OutOfMemory, CudaError).
    pub fn new(devices: &[i32]) -> Result<Rendezvous> {
        let n = devices.len();
        let mut rendezvous = Rendezvous { ranks: Vec::with_capacity(n), last_epoch: AtomicU64::new(0) };
        for &device in devices {
            let context = driver::primary_context(device)?;
            // SAFETY: a retained primary context.
            let _current = unsafe { CurrentContext::enter(context) }?;
            let mut block = 0;
            // SAFETY: valid output slot in the current context.
            check("cuMemAlloc(rendezvous flags)", unsafe { sys::cuMemAlloc_v2(&mut block, 8 * words(n)) })?;
            let mut table = 0;
            // SAFETY: as above.
            let allocated =
                check("cuMemAlloc(rendezvous table)", unsafe { sys::cuMemAlloc_v2(&mut table, 8 * n) });
            if let Err(err) = allocated {
                // SAFETY: allocated just above, in this context.
                unsafe { sys::cuMemFree_v2(block) };
                return Err(err);
            }
            // From here on Drop frees both.
            rendezvous.ranks.push(RankFlags { context, block, table });
            // SAFETY: the block holds words(n) u64.
            check("cuMemsetD8(rendezvous flags)", unsafe { sys::cuMemsetD8_v2(block, 0, 8 * words(n)) })?;
        }
        let blocks: Vec<u64> = rendezvous.ranks.iter().map(|r| r.block).collect();
        for rank in &rendezvous.ranks {
            // SAFETY: a retained primary context.
            let _current = unsafe { CurrentContext::enter(rank.context) }?;
            // SAFETY: the table holds n u64; `blocks` is n u64 on the host.
            check("cuMemcpyHtoD(rendezvous table)", unsafe {
                sys::cuMemcpyHtoD_v2(rank.table, blocks.as_ptr().cast(), 8 * n)
            })?;
            // The zeroing and the upload must have landed before any kernel reads them.
            check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        }
        Ok(rendezvous)
    }

    /// The epoch of the next synchronized call. Every rank's launch of one call must use the same
    /// epoch, and the calls must be launched in epoch order: the caller serializes its calls.
    pub fn next_epoch(&self) -> u64 {
        self.last_epoch.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn rank(&self, rank: usize) -> RankRendezvous {
        RankRendezvous { table: self.ranks[rank].table, rank: rank as u32, ranks: self.ranks.len() as u32 }
    }

    /// After a call of `epoch` failed to launch on the ranks in `missing` (each with its stream), lets
    /// the ranks that did launch finish instead of waiting for them forever: each missing rank's stream
    /// writes, in every other rank's block, the arrival and the departure count its launch would have
    /// left. Stream-ordered, so the missing rank is released where its launch would have run, after
    /// its earlier launches have added their own counts; where the stream takes no memory operation
    /// (a broken context), the words are written from the host instead, at once. What the other
    /// launches copied from the missing ranks is undefined; the call reports its error.
    pub fn release(&self, epoch: u64, missing: &[(usize, sys::CUstream)]) {
        let n = self.ranks.len();
        for &(p, stream) in missing {
            // (owner of the block, address, value)
            let words: Vec<(usize, u64, u64)> = (0..n)
                .filter(|&q| q != p)
                .flat_map(|q| {
                    let block = self.ranks[q].block;
                    [
                        (q, block + 8 * p as u64, epoch),
                        (q, block + 8 * (n + p) as u64, epoch * DEPARTURE_UNITS),
                    ]
                })
                .collect();
            // SAFETY: a retained primary context; every address is a word of a live flag block.
            let queued = unsafe { CurrentContext::enter(self.ranks[p].context) }
                .and_then(|_current| unsafe { write_on_stream(stream, &words) });
            if let Err(err) = queued {
                log::warn!(
                    "releasing rank {p} on its stream failed ({err}); writing its flags from the host"
                );
                self.write_from_host(&words);
            }
        }
    }

    fn write_from_host(&self, words: &[(usize, u64, u64)]) {
        for &(owner, address, value) in words {
            // SAFETY: a retained primary context.
            let Ok(_current) = (unsafe { CurrentContext::enter(self.ranks[owner].context) }) else {
                continue;
            };
            // SAFETY: a word of the owner's live flag block; `value` lives across the synchronous copy.
            let result = unsafe { sys::cuMemcpyHtoD_v2(address, (&value as *const u64).cast(), 8) };
            if result != sys::CUresult::CUDA_SUCCESS {
                log::warn!("releasing a rendezvous flag failed: {result:?}");
            }
        }
    }
}

/// Queues one write of `value` at each `address` on `stream`, in one batch of stream memory operations
/// (each with the default memory barrier: the stream's earlier writes are visible first).
///
/// # Safety
/// `stream` belongs to the current context; every address is device memory it may write.
unsafe fn write_on_stream(stream: sys::CUstream, words: &[(usize, u64, u64)]) -> Result<()> {
    let mut ops: Vec<sys::CUstreamBatchMemOpParams> = words
        .iter()
        .map(|&(_, address, value)| {
            // SAFETY: a plain C union of plain data; zero is a valid value of every member.
            let mut op: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            op.writeValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
            op.writeValue.address = address;
            op.writeValue.__bindgen_anon_1.value64 = value;
            op
        })
        .collect();
    // SAFETY: the caller's promise; `ops` lives across the call, which copies it.
    check("cuStreamBatchMemOp(rendezvous release)", unsafe {
        sys::cuStreamBatchMemOp_v2(stream, ops.len() as u32, ops.as_mut_ptr(), 0)
    })
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        for rank in &self.ranks {
            // SAFETY: a retained primary context.
            let freed = unsafe { CurrentContext::enter(rank.context) }.and_then(|_current| {
                // SAFETY: allocated by cuMemAlloc in this context; no launch uses them any more (the
                // group drains its streams before dropping its collective state).
                check("cuMemFree", unsafe { sys::cuMemFree_v2(rank.block) })?;
                check("cuMemFree", unsafe { sys::cuMemFree_v2(rank.table) })
            });
            if let Err(err) = freed {
                log::warn!("freeing rendezvous flags: {err}");
            }
        }
    }
}
