//! The digest kernel (`digest.cu`) on a CUDA device: the digest of [`super::gf64`] over a byte range of
//! device memory, computed on the GPU in one pass.

use super::gf64;
use super::module;
use crate::bail;
use crate::error::{Error, Result, Status};
use crate::sync::lock;
use crate::transport::driver::{check, CurrentContext};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The CUDA C source of the kernel, compiled by NVRTC at first use on each device.
pub const SOURCE: &str = include_str!("digest.cu");
const KERNEL_NAME: &std::ffi::CStr = c"refit_digest";
const MANY_KERNEL_NAME: &std::ffi::CStr = c"refit_digest_many";
const CONSTANTS_NAME: &std::ffi::CStr = c"refit_digest_constants";
/// Threads per block; must match DIGEST_THREADS in the source.
pub const THREADS: u32 = 256;
const WARPS_PER_BLOCK: u64 = THREADS as u64 / 32;
/// Bytes per chunk: one 16-byte vector per lane of a warp.
const CHUNK_BYTES: u64 = 512;
/// Fewest chunks a warp takes (log2): each warp ends with a few multiplications in GF(2^64), which a
/// warp with less than 2 KiB to read would spend more time on than on reading.
const MIN_SPAN_SHIFT: u32 = 2;
/// The kernel takes the warp index's bits from 15 lanes.
const MAX_WARPS: u64 = 1 << 15;

/// How one digest is launched: each warp takes `2^span_shift` chunks of 512 bytes; `blocks` blocks of
/// [`THREADS`] threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub span_shift: u32,
    pub blocks: u32,
}

/// The launch for `len` bytes at `addr` when at most `max_warps` warps should run (the device's
/// resident warps): the fewest chunks per warp, a power of two, that keeps within `max_warps`.
pub fn geometry(addr: u64, len: u64, max_warps: u64) -> Geometry {
    let chunks = chunks(addr, len);
    let max_warps = max_warps.clamp(1, MAX_WARPS);
    let mut span_shift = MIN_SPAN_SHIFT;
    while chunks.div_ceil(1 << span_shift) > max_warps {
        span_shift += 1;
    }
    let warps = chunks.div_ceil(1 << span_shift);
    Geometry { span_shift, blocks: warps.div_ceil(WARPS_PER_BLOCK) as u32 }
}

/// The longest range a digest reads: more than any device holds, and what keeps a range's chunks
/// below 2^52, where the many-range kernel builds its factors from (`MANY_CHUNK_BITS` in digest.cu).
pub const MAX_RANGE_BYTES: u64 = 1 << 60;

/// Checks a digest's range. Zero bytes are read nowhere, so every address is accepted with length 0
/// (the digest is 1). Otherwise InvalidArgument for a zero address, a range longer than
/// [`MAX_RANGE_BYTES`], or one that wraps past the end of the 64-bit address space (or ends within
/// its last 16 bytes, where the kernel's aligned 16-byte reads would).
pub fn check_range(addr: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if addr == 0 {
        return Err(Error::invalid_argument(format!("address is 0 with length {len}")));
    }
    if addr.checked_add(len).is_none_or(|end| end > u64::MAX - 16) {
        return Err(Error::invalid_argument(format!(
            "range of {len} bytes at {addr:#x} runs past the end of the address space"
        )));
    }
    if len > MAX_RANGE_BYTES {
        return Err(Error::invalid_argument(format!(
            "range of {len} bytes at {addr:#x} is longer than 2^60 bytes, more than any device holds"
        )));
    }
    Ok(())
}

/// A byte range to digest: `len` bytes at `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ByteRange {
    pub addr: u64,
    pub len: u64,
}

/// Checks every range as [`check_range`] does; the error names the first bad range by its index.
/// More than 2^32 - 1 ranges in one call are InvalidArgument too (the kernel counts them in 32 bits).
pub fn check_ranges(ranges: &[ByteRange]) -> Result<()> {
    if u32::try_from(ranges.len()).is_err() {
        return Err(Error::invalid_argument(format!(
            "{} ranges in one call; at most {} are taken",
            ranges.len(),
            u32::MAX
        )));
    }
    for (index, range) in ranges.iter().enumerate() {
        check_range(range.addr, range.len).map_err(|e| e.context(format!("range {index}")))?;
    }
    Ok(())
}

/// One range as the many-range kernel reads it (`DigestRange` in digest.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeDescriptor {
    pub addr: u64,
    pub len: u64,
    /// The number of its first chunk in the launch: the chunks of the ranges before it.
    pub first_chunk: u64,
}

/// The chunks (512 bytes of the aligned view, the marker's included) the kernels read for `len` bytes
/// at `addr`: at least one.
fn chunks(addr: u64, len: u64) -> u64 {
    (((addr & 15) + len) / 16 + 1).div_ceil(CHUNK_BYTES / 16)
}

/// How a many-range digest is launched: the descriptors, the chunks of all ranges, each warp's span of
/// them, and `blocks` blocks of [`THREADS`] threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManyLayout {
    pub descriptors: Vec<RangeDescriptor>,
    pub total_chunks: u64,
    pub span: u64,
    pub blocks: u32,
}

/// Lays out `ranges` (checked first, as [`check_ranges`]) for one launch of at most `max_warps`
/// warps: every warp takes an equal span of the ranges' chunks, so the work is split evenly whatever
/// the ranges' sizes, with at least 4 chunks per warp (as for one range). InvalidArgument as for
/// [`check_ranges`].
pub fn many_layout(ranges: &[ByteRange], max_warps: u64) -> Result<ManyLayout> {
    check_ranges(ranges)?;
    let mut total_chunks = 0u64;
    let mut descriptors = Vec::with_capacity(ranges.len());
    for range in ranges {
        descriptors.push(RangeDescriptor { addr: range.addr, len: range.len, first_chunk: total_chunks });
        total_chunks = total_chunks.checked_add(chunks(range.addr, range.len)).ok_or_else(|| {
            Error::invalid_argument(format!(
                "{} ranges hold more than 2^64 chunks of 512 bytes",
                ranges.len()
            ))
        })?;
    }
    let span = total_chunks.div_ceil(max_warps.max(1)).max(1 << MIN_SPAN_SHIFT);
    let warps = total_chunks.div_ceil(span);
    let blocks = u32::try_from(warps.div_ceil(WARPS_PER_BLOCK)).map_err(|_| {
        Error::invalid_argument(format!("{total_chunks} chunks of 512 bytes do not fit one launch"))
    })?;
    Ok(ManyLayout { descriptors, total_chunks, span, blocks })
}

/// The kernel loaded into one device's primary context, with its constant tables in device memory.
/// Loaded once per device and kept for the life of the process.
pub struct DigestKernel {
    context: sys::CUcontext,
    function: sys::CUfunction,
    /// [`gf64::kernel_constants`] in the module's own device memory (`refit_digest_constants`).
    constants: sys::CUdeviceptr,
    max_warps: u64,
    /// `refit_digest_many`, and the warps of it that are resident on the device at once.
    many_function: sys::CUfunction,
    many_max_warps: u64,
    /// How the kernel was built, for logs and bench output.
    pub build: String,
}

// SAFETY: process-wide driver handles and device memory owned for the life of the process.
unsafe impl Send for DigestKernel {}
unsafe impl Sync for DigestKernel {}

impl DigestKernel {
    /// The kernel on `device`, compiled and loaded at the first call for that device (errors as for
    /// [`super::BatchedCopy::for_device`]; a failure is not cached).
    pub fn for_device(device: i32) -> Result<Arc<DigestKernel>> {
        static CACHE: Mutex<Option<HashMap<i32, Arc<DigestKernel>>>> = Mutex::new(None);
        let mut cache = lock(&CACHE);
        let map = cache.get_or_insert_with(HashMap::new);
        if let Some(kernel) = map.get(&device) {
            return Ok(kernel.clone());
        }
        let kernel = Arc::new(DigestKernel::load(device)?);
        map.insert(device, kernel.clone());
        Ok(kernel)
    }

    fn load(device: i32) -> Result<DigestKernel> {
        let loaded = module::load(device, SOURCE, "digest.cu")?;
        let function = module::function(loaded.module, KERNEL_NAME)?;
        let per_sm = loaded.blocks_per_sm(function, THREADS)?;
        let many_function = module::function(loaded.module, MANY_KERNEL_NAME)?;
        let many_per_sm = loaded.blocks_per_sm(many_function, THREADS)?;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(loaded.context) }?;
        let words = gf64::kernel_constants();
        let bytes = std::mem::size_of_val(words.as_slice());
        let (mut constants, mut size) = (0, 0);
        // SAFETY: valid output slots; a live module of the current context.
        check("cuModuleGetGlobal", unsafe {
            sys::cuModuleGetGlobal_v2(&mut constants, &mut size, loaded.module, CONSTANTS_NAME.as_ptr())
        })?;
        if size != bytes {
            bail!(
                Status::KernelLoadFailed,
                "digest.cu's constant table holds {size} bytes, the host's {bytes} (C_WORDS is out of date)"
            );
        }
        // SAFETY: `constants` holds `bytes` bytes; the upload is synchronous.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(constants, words.as_ptr().cast(), bytes) })?;
        let max_warps = u64::from(loaded.sms * per_sm) * WARPS_PER_BLOCK;
        let many_max_warps = u64::from(loaded.sms * many_per_sm) * WARPS_PER_BLOCK;
        let build = format!("{} x {per_sm} blocks of {THREADS} (many ranges: {many_per_sm})", loaded.build);
        log::info!("digest kernel on device {device}: {build}");
        Ok(DigestKernel {
            context: loaded.context,
            function,
            constants,
            max_warps,
            many_function,
            many_max_warps,
            build,
        })
    }

    /// The launch this kernel uses for `len` bytes at `addr`.
    pub fn geometry(&self, addr: u64, len: u64) -> Geometry {
        geometry(addr, len, self.max_warps)
    }

    /// Queues, on `stream`, the digest of `len` bytes at `addr` into the device word `out`: a memset
    /// of `out` then one kernel launch. Asynchronous; `out` holds the digest once the stream gets
    /// there. Errors: InvalidArgument (see [`check_range`]), CudaError.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream of this kernel's device; `addr .. addr + len` is device memory
    /// readable from it and `out` an 8-byte device word writable by it, both until the work has run.
    pub unsafe fn enqueue(
        &self,
        stream: sys::CUstream,
        addr: u64,
        len: u64,
        out: sys::CUdeviceptr,
    ) -> Result<()> {
        check_range(addr, len)?;
        let Geometry { mut span_shift, blocks } = self.geometry(addr, len);
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(out, 0, 2, stream) })?;
        let (mut addr, mut len, mut constants, mut out) = (addr, len, self.constants, out);
        let mut params: [*mut c_void; 5] = [
            (&mut addr as *mut u64).cast(),
            (&mut len as *mut u64).cast(),
            (&mut span_shift as *mut u32).cast(),
            (&mut constants as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
        ];
        // SAFETY: the parameter list matches refit_digest's signature; the caller's promises cover the
        // memory read and written.
        unsafe { module::launch(self.function, blocks, THREADS, stream, &mut params) }
    }

    /// The digest of `len` bytes at `addr`, computed on `stream`: queues the kernel, waits for the
    /// stream, and returns the value. Errors as for [`DigestKernel::enqueue`].
    ///
    /// # Safety
    /// As for [`DigestKernel::enqueue`] (without `out`).
    pub unsafe fn digest(&self, stream: sys::CUstream, addr: u64, len: u64) -> Result<u64> {
        check_range(addr, len)?;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        let mut out: sys::CUdeviceptr = 0;
        // SAFETY: valid output slot; the stream belongs to the current context (the caller's promise).
        check("cuMemAllocAsync", unsafe { sys::cuMemAllocAsync(&mut out, 8, stream) })?;
        let mut value = 0u64;
        let mut result = self.enqueue(stream, addr, len, out);
        if result.is_ok() {
            // SAFETY: 8 bytes from the device word into `value`, which outlives the synchronization below.
            result = check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2((&mut value as *mut u64).cast(), out, 8, stream)
            });
        }
        // SAFETY: allocated above on this stream, freed after its last use in stream order.
        let freed = check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(out, stream) });
        let synced = check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) });
        result.and(freed).and(synced)?;
        Ok(value)
    }

    /// The launch this kernel uses for `ranges` (checked as [`many_layout`] does).
    pub fn many_layout(&self, ranges: &[ByteRange]) -> Result<ManyLayout> {
        many_layout(ranges, self.many_max_warps)
    }

    /// Queues, on `stream`, the digests of the ranges `layout` describes into the `count` device
    /// words at `out` (count = the layout's descriptors): a memset of `out` then one kernel launch
    /// reading the descriptors at `descriptors` (a device copy of `layout.descriptors`). Asynchronous.
    /// Nothing is queued for a layout of no ranges. Errors: CudaError.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream of this kernel's device; every range is device memory
    /// readable from it, `descriptors` holds the layout's descriptors and `out` one writable word per
    /// range, all until the work has run.
    pub unsafe fn enqueue_many(
        &self,
        stream: sys::CUstream,
        layout: &ManyLayout,
        descriptors: sys::CUdeviceptr,
        out: sys::CUdeviceptr,
    ) -> Result<()> {
        let count = layout.descriptors.len();
        if count == 0 {
            return Ok(());
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(out, 0, 2 * count, stream) })?;
        let (mut ranges, mut count, mut total, mut span, mut constants, mut out) =
            (descriptors, count as u32, layout.total_chunks, layout.span, self.constants, out);
        let mut params: [*mut c_void; 6] = [
            (&mut ranges as *mut u64).cast(),
            (&mut count as *mut u32).cast(),
            (&mut total as *mut u64).cast(),
            (&mut span as *mut u64).cast(),
            (&mut constants as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
        ];
        // SAFETY: the parameter list matches refit_digest_many's signature; the caller's promises cover
        // the memory read and written.
        unsafe { module::launch(self.many_function, layout.blocks, THREADS, stream, &mut params) }
    }

    /// The digests of `ranges`, in order, computed on `stream` in one launch: uploads the ranges'
    /// descriptors, queues the kernel, copies the digests back, waits for the stream. Each equals
    /// [`DigestKernel::digest`] of its range. No ranges: nothing is queued. Errors: InvalidArgument
    /// (see [`many_layout`]), CudaError.
    ///
    /// # Safety
    /// As for [`DigestKernel::enqueue`], for every range.
    pub unsafe fn digest_many(&self, stream: sys::CUstream, ranges: &[ByteRange]) -> Result<Vec<u64>> {
        let layout = self.many_layout(ranges)?;
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let descriptor_bytes = std::mem::size_of_val(layout.descriptors.as_slice());
        let out_bytes = 8 * ranges.len();
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        let mut memory: sys::CUdeviceptr = 0;
        // SAFETY: valid output slot; the stream belongs to the current context (the caller's promise).
        check("cuMemAllocAsync", unsafe {
            sys::cuMemAllocAsync(&mut memory, descriptor_bytes + out_bytes, stream)
        })?;
        let out = memory + descriptor_bytes as u64;
        let mut values = vec![0u64; ranges.len()];
        // SAFETY: the allocation holds the descriptors and then the outputs; `layout` and `values`
        // outlive the synchronization below.
        let mut result = check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(memory, layout.descriptors.as_ptr().cast(), descriptor_bytes, stream)
        });
        if result.is_ok() {
            result = self.enqueue_many(stream, &layout, memory, out);
        }
        if result.is_ok() {
            result = check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(values.as_mut_ptr().cast(), out, out_bytes, stream)
            });
        }
        // SAFETY: allocated above on this stream, freed after its last use in stream order.
        let freed = check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(memory, stream) });
        let synced = check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) });
        result.and(freed).and(synced)?;
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_sizes_its_constant_table_and_blocks_as_the_host_does() {
        for define in [
            format!("#define C_WORDS {}u", gf64::KERNEL_CONSTANT_WORDS),
            format!("#define DIGEST_THREADS {THREADS}u"),
        ] {
            assert!(SOURCE.contains(&define), "digest.cu lacks `{define}`");
        }
    }

    #[test]
    fn geometry_keeps_warps_within_the_limit_and_spans_a_power_of_two() {
        // 1 MiB, 16-byte aligned: 65537 vectors with the marker's, 2049 chunks, 4 per warp: 513 warps.
        assert_eq!(geometry(1 << 20, 1 << 20, 1000), Geometry { span_shift: 2, blocks: 65 });
        // 1 GiB on 1000 warps: 2^21 + 1 chunks need 4096 per warp (2^12): 513 warps.
        assert_eq!(geometry(1 << 20, 1 << 30, 1000), Geometry { span_shift: 12, blocks: 65 });
        assert_eq!(geometry(16, 0, 1000), Geometry { span_shift: 2, blocks: 1 });
        for (addr, len) in [(1u64, 12345u64), (4096, 1 << 33), (7, 1 << 40)] {
            let g = geometry(addr, len, 2000);
            let chunks = (((addr & 15) + len) / 16 + 1).div_ceil(32);
            let warps = chunks.div_ceil(1 << g.span_shift);
            assert!(warps <= 2000 && u64::from(g.blocks) * 8 >= warps, "{addr} {len} {g:?}");
            assert!(g.span_shift == MIN_SPAN_SHIFT || chunks.div_ceil(1 << (g.span_shift - 1)) > 2000);
        }
    }

    #[test]
    fn ranges_that_cannot_be_read_are_refused() {
        assert!(check_range(0, 0).is_ok());
        // Zero bytes are read nowhere: every address is accepted, the last one included.
        for addr in [1, 15, u64::MAX - 16, u64::MAX - 15, u64::MAX] {
            assert!(check_range(addr, 0).is_ok(), "{addr:#x}");
        }
        assert!(check_range(u64::MAX, 1).unwrap_err().message.contains("past the end"));
        assert!(check_range(4096, MAX_RANGE_BYTES).is_ok());
        assert!(check_range(4096, MAX_RANGE_BYTES + 1).unwrap_err().message.contains("longer than 2^60"));
        assert!(check_range(0, 1).unwrap_err().message.contains("address is 0"));
        assert!(check_range(u64::MAX - 100, 200).unwrap_err().message.contains("past the end"));
        assert!(check_range(8, u64::MAX - 8).is_err());
    }

    #[test]
    fn a_bad_range_of_many_is_named_by_its_index() {
        let ranges = [
            ByteRange { addr: 64, len: 8 },
            ByteRange { addr: u64::MAX, len: 0 },
            ByteRange { addr: 0, len: 3 },
        ];
        let err = check_ranges(&ranges).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument);
        assert_eq!(err.message, "range 2: address is 0 with length 3");
        let wrapping = [ByteRange { addr: u64::MAX - 7, len: 100 }];
        let err = many_layout(&wrapping, 100).unwrap_err();
        assert!(
            err.message.starts_with("range 0: ") && err.message.contains("past the end"),
            "{}",
            err.message
        );
    }

    #[test]
    fn many_layout_numbers_every_ranges_chunks_and_splits_them_evenly() {
        let ranges: Vec<ByteRange> =
            [(16u64, 0u64), (3, 0), (1 << 20, 1 << 20), (5, 1), (4096 + 7, 100_000), (u64::MAX, 0)]
                .iter()
                .map(|&(addr, len)| ByteRange { addr, len })
                .collect();
        for max_warps in [1u64, 7, 64, 10_000] {
            let layout = many_layout(&ranges, max_warps).unwrap();
            let mut next = 0;
            for (range, descriptor) in ranges.iter().zip(&layout.descriptors) {
                assert_eq!(
                    (descriptor.addr, descriptor.len, descriptor.first_chunk),
                    (range.addr, range.len, next)
                );
                let own = (((range.addr & 15) + range.len) / 16 + 1).div_ceil(32);
                assert!(own >= 1);
                next += own;
            }
            assert_eq!(layout.total_chunks, next);
            let warps = layout.total_chunks.div_ceil(layout.span);
            assert!(warps <= max_warps || layout.span == 1 << MIN_SPAN_SHIFT, "{max_warps}: {layout:?}");
            assert!(layout.span >= 1 << MIN_SPAN_SHIFT);
            assert!(u64::from(layout.blocks) * WARPS_PER_BLOCK >= warps);
            assert!(u64::from(layout.blocks - 1) * WARPS_PER_BLOCK < warps);
        }
        // 1 MiB at 16 bytes: 65537 vectors with the marker's, 2049 chunks.
        assert_eq!(many_layout(&ranges[2..3], 1).unwrap().total_chunks, 2049);
        let none = many_layout(&[], 100).unwrap();
        assert_eq!((none.descriptors.len(), none.total_chunks, none.blocks), (0, 0, 0));
    }
}
