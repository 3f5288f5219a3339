//! Copy-engine copies of runs: what the CUDA backend's `copy_segments` queues.
//!
//! Runs are handed to the driver in batches, up to [`RUNS_PER_CALL`] in one `cuMemcpyBatchAsync` (the
//! `_v2` entry point of CUDA 13 drivers), instead of one `cuMemcpyAsync` each: one driver call per
//! batch instead of per run. Small runs stay slow either way: the engine's own time per copy, not
//! the driver call, bounds them (benches/gpu_sweep.rs measures the arm beside a per-run loop at
//! every run size), which is why AUTO gives them to the kernel. A single run, a driver without that
//! entry point, and a batch the driver refuses with CUDA_ERROR_INVALID_VALUE are queued run by run
//! instead. The last is how a run that spans two adjacent allocations arrives: the planner coalesces
//! by address and separate allocations can meet, which a kernel does not mind but cuMemcpy does, so
//! such a run is split where an allocation ends.
//!
//! A batch's copies run in no particular order among themselves (the driver's rule), as the batched
//! copy kernel's runs do: no run of one call may read bytes another writes. That is also why queuing
//! a refused batch run by run is safe even if the driver had queued part of it: a run copied twice
//! writes the same bytes twice.

use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys::{self, CUresult};
use std::sync::OnceLock;

/// Runs per `cuMemcpyBatchAsync` call: enough that the call's fixed cost vanishes per run, few
/// enough that the three host arrays stay small (192 KiB).
pub const RUNS_PER_CALL: usize = 8192;

/// Runs gathered for one batch call, on one stream of one device.
pub struct EngineCopies {
    stream: sys::CUstream,
    attributes: sys::CUmemcpyAttributes,
    srcs: Vec<u64>,
    dsts: Vec<u64>,
    sizes: Vec<usize>,
}

impl EngineCopies {
    /// Copies to be queued on `stream`, a stream of `device` whose context is current.
    pub fn new(device: i32, stream: sys::CUstream) -> EngineCopies {
        // The location hints only matter for managed memory; ours is device memory.
        let location =
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device };
        EngineCopies {
            stream,
            attributes: sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: location,
                dstLocHint: location,
                flags: 0,
            },
            srcs: Vec::new(),
            dsts: Vec::new(),
            sizes: Vec::new(),
        }
    }

    /// Adds the run of `len` bytes from `src` to `dst`; queues the batch when it is full. Empty runs
    /// and runs onto themselves copy nothing.
    ///
    /// # Safety
    /// The run must be valid memory until the copy has run; the stream's context must be current.
    pub unsafe fn push(&mut self, src: u64, dst: u64, len: u64) -> Result<()> {
        if len == 0 || src == dst {
            return Ok(());
        }
        self.srcs.push(src);
        self.dsts.push(dst);
        self.sizes.push(len as usize);
        if self.sizes.len() == RUNS_PER_CALL {
            return self.flush();
        }
        Ok(())
    }

    /// Queues every run added since the last flush.
    ///
    /// # Safety
    /// As for [`EngineCopies::push`].
    pub unsafe fn flush(&mut self) -> Result<()> {
        let result = match self.sizes.len() {
            0 => Ok(()),
            1 => self.queue_each(),
            _ if !batch_entry_point() => self.queue_each(),
            n => {
                // The one attribute applies from the batch's first copy on.
                let mut attribute_starts = [0usize];
                let code = sys::cuMemcpyBatchAsync_v2(
                    self.dsts.as_mut_ptr(),
                    self.srcs.as_mut_ptr(),
                    self.sizes.as_mut_ptr(),
                    n,
                    &mut self.attributes,
                    attribute_starts.as_mut_ptr(),
                    1,
                    self.stream,
                );
                match code {
                    CUresult::CUDA_ERROR_INVALID_VALUE => self.queue_each(),
                    code => check(&format!("cuMemcpyBatchAsync of {n} runs"), code),
                }
            }
        };
        self.srcs.clear();
        self.dsts.clear();
        self.sizes.clear();
        result
    }

    /// One `cuMemcpyAsync` per gathered run.
    ///
    /// # Safety
    /// As for [`EngineCopies::push`].
    unsafe fn queue_each(&self) -> Result<()> {
        for ((&src, &dst), &len) in self.srcs.iter().zip(&self.dsts).zip(&self.sizes) {
            copy_run(src, dst, len as u64, self.stream)
                .map_err(|e| e.context(format!("run of {len} bytes from {src:#x} to {dst:#x}")))?;
        }
        Ok(())
    }
}

/// Whether the driver exports `cuMemcpyBatchAsync_v2` (CUDA 13 drivers and later). Asked once:
/// cudarc's dynamic loader panics on a missing symbol, so it is never called without this.
fn batch_entry_point() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only looks the symbol up in the already loaded libcuda.
    *PRESENT.get_or_init(|| unsafe {
        sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2").is_ok()
    })
}

/// Queues one copy-engine copy of a run: with unified addressing the driver routes a peer run over
/// NVLink when peer access is on, or stages it when it is not. A run across two allocations that
/// meet is CUDA_ERROR_INVALID_VALUE to cuMemcpy: it is split where an allocation ends.
///
/// # Safety
/// The run must be valid memory; the caller's context must be current.
pub unsafe fn copy_run(src: u64, dst: u64, len: u64, stream: sys::CUstream) -> Result<()> {
    let whole = sys::cuMemcpyAsync(dst, src, len as usize, stream);
    if whole != CUresult::CUDA_ERROR_INVALID_VALUE {
        return check("cuMemcpyAsync", whole);
    }
    let mut done = 0;
    while done < len {
        let piece = (len - done).min(allocation_left(src + done)?).min(allocation_left(dst + done)?);
        check("cuMemcpyAsync", sys::cuMemcpyAsync(dst + done, src + done, piece as usize, stream))?;
        done += piece;
    }
    Ok(())
}

/// Bytes from `ptr` to the end of the device allocation holding it.
fn allocation_left(ptr: u64) -> Result<u64> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid out-pointers; the driver only inspects the address.
    check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
    Ok(base + size as u64 - ptr)
}
