//! The flags through which a device group's group-synchronized batched-copy launches meet (see
//! `refit_batched_copy_synced` in batched_copy.cu): one flag block per rank in that rank's memory,
//! written by its peers over NVLink, and an epoch that grows by one per synchronized call.
//!
//! Rank r's block is `2n + 1` u64 words: arrived[p] (word p), done[p] (word n + p), and the counter of
//! the launch's finished blocks (word 2n). Each rank's device also holds the table of every rank's
//! block address, which its kernel reads.

use super::batched_copy::BatchedCopy;
use crate::backend::driver::{check, CurrentContext};
use crate::error::Result;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where one rank's kernel finds the rendezvous: its rank, the group size and the device address of
/// the table of flag blocks (on its own device).
#[derive(Clone, Copy, Debug)]
pub struct RankRendezvous {
    pub table: u64,
    pub rank: u32,
    pub ranks: u32,
}

struct RankFlags {
    kernel: Arc<BatchedCopy>,
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
    2 * ranks + 1
}

impl Rendezvous {
    /// Allocates and zeroes a flag block and a table on every device (`devices[r]` for rank r).
    /// Synchronous. Errors: those of loading the kernel, and the driver's (OutOfMemory, CudaError).
    pub fn new(devices: &[i32]) -> Result<Rendezvous> {
        let n = devices.len();
        let mut rendezvous = Rendezvous { ranks: Vec::with_capacity(n), last_epoch: AtomicU64::new(0) };
        for &device in devices {
            let kernel = BatchedCopy::for_device(device)?;
            // SAFETY: a retained primary context.
            let _current = unsafe { CurrentContext::enter(kernel.context()) }?;
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
            rendezvous.ranks.push(RankFlags { kernel, block, table });
            // SAFETY: the block holds words(n) u64.
            check("cuMemsetD8(rendezvous flags)", unsafe { sys::cuMemsetD8_v2(block, 0, 8 * words(n)) })?;
        }
        let blocks: Vec<u64> = rendezvous.ranks.iter().map(|r| r.block).collect();
        for rank in &rendezvous.ranks {
            // SAFETY: a retained primary context.
            let _current = unsafe { CurrentContext::enter(rank.kernel.context()) }?;
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

    /// After a call of `epoch` failed to launch on the ranks in `missing`, lets the ranks that did
    /// launch finish instead of waiting for them forever: writes `epoch` into the missing ranks'
    /// arrived and done flags in every rank's block (synchronous copies, on no stream of the group).
    /// What those launches copied from the missing ranks is undefined; the call reports its error.
    pub fn release(&self, epoch: u64, missing: &[usize]) {
        let n = self.ranks.len();
        for rank in &self.ranks {
            // SAFETY: a retained primary context.
            let Ok(_current) = (unsafe { CurrentContext::enter(rank.kernel.context()) }) else { continue };
            for &p in missing {
                for word in [p, n + p] {
                    let address = rank.block + 8 * word as u64;
                    // SAFETY: a word of the block; `epoch` lives across the synchronous call.
                    let result = unsafe { sys::cuMemcpyHtoD_v2(address, (&epoch as *const u64).cast(), 8) };
                    if result != sys::CUresult::CUDA_SUCCESS {
                        log::warn!("releasing a rendezvous flag failed: {result:?}");
                    }
                }
            }
        }
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        for rank in &self.ranks {
            // SAFETY: a retained primary context.
            let freed = unsafe { CurrentContext::enter(rank.kernel.context()) }.and_then(|_current| {
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
