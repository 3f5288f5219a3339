//! The CUDA backend: cudarc's driver layer (`sys`), primary contexts, non-blocking streams, events
//! without timing, copy-engine copies, and the batched copy kernel (`kernels`) for batched copies.
//!
//! Why the raw layer: cudarc's safe layer owns the memory it copies, and its `memcpy_dtod` between two
//! contexts runs far below the copy engine, which `cuMemcpyAsync` with unified addressing on a
//! non-blocking stream reaches (benches/gpu_allgather.rs, copy-engine probe).
//!
//! Contexts: each device's primary context (the one the CUDA runtime, torch and NCCL use) is retained
//! on first use and kept for the life of the process. Every method makes the context it needs current
//! and restores the caller's current context before returning, so a caller's `cudaSetDevice` state is
//! never disturbed; only [`Backend::bind`] leaves a context current (for our own rank threads).

use super::driver::{self, check, error_name, CurrentContext};
use super::engine_copy::EngineCopies;
use super::ByteRange;
use super::{
    device_index, Backend, BackendKind, Event, PreparedCheck, PreparedCopy, PreparedDigestCheck,
    PreparedQuantize, PreparedRecord, Stream,
};
use crate::error::{Error, Result, Status};
use crate::kernels::digest::{check_range, check_ranges, DigestKernel};
use crate::kernels::verify::{DigestCheck, DigestRecord, VerifyBatch};
use crate::kernels::{self, PreparedBatch};
use crate::segment::Segment;
use cudarc::driver::sys::{self, CUcontext, CUresult};
use std::ffi::{c_char, CStr};
use std::sync::{Arc, OnceLock};

/// The process-wide CUDA backend, initialized once. `CudaUnavailable` when libcuda cannot be loaded
/// or has no device.
pub fn cuda_backend() -> Result<Arc<CudaBackend>> {
    static BACKEND: OnceLock<std::result::Result<Arc<CudaBackend>, Error>> = OnceLock::new();
    BACKEND.get_or_init(|| CudaBackend::init().map(Arc::new)).clone()
}

/// Devices of the machine, each with its primary context (retained on first use).
pub struct CudaBackend {
    devices: Vec<sys::CUdevice>,
    contexts: Vec<OnceLock<std::result::Result<ContextHandle, Error>>>,
}

#[derive(Clone, Copy)]
struct ContextHandle(CUcontext);
// SAFETY: a CUcontext is a driver handle usable from any thread.
unsafe impl Send for ContextHandle {}
unsafe impl Sync for ContextHandle {}

impl CudaBackend {
    fn init() -> Result<CudaBackend> {
        driver::init()?;
        // SAFETY: plain driver calls with valid out-pointers, after cuInit.
        unsafe {
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if count <= 0 {
                return Err(Error::new(Status::CudaUnavailable, "no CUDA device is present"));
            }
            let mut devices = Vec::with_capacity(count as usize);
            for ordinal in 0..count {
                let mut device = 0;
                check("cuDeviceGet", sys::cuDeviceGet(&mut device, ordinal))?;
                devices.push(device);
            }
            let contexts = (0..devices.len()).map(|_| OnceLock::new()).collect();
            Ok(CudaBackend { devices, contexts })
        }
    }

    /// The index of `device` in this backend's tables, or `InvalidDevice`.
    fn index(&self, device: i32) -> Result<usize> {
        device_index(device, self.devices.len(), "CUDA devices")
    }

    /// The device's primary context, retained on first use.
    pub fn context(&self, device: i32) -> Result<CUcontext> {
        let index = self.index(device)?;
        self.contexts[index]
            .get_or_init(|| {
                let mut ctx: CUcontext = std::ptr::null_mut();
                // SAFETY: valid device handle and out-pointer.
                check("cuDevicePrimaryCtxRetain", unsafe {
                    sys::cuDevicePrimaryCtxRetain(&mut ctx, self.devices[index])
                })
                .map(|()| ContextHandle(ctx))
            })
            .clone()
            .map(|handle| handle.0)
    }

    /// Makes the device's context current until the guard drops.
    fn enter(&self, device: i32) -> Result<CurrentContext> {
        let ctx = self.context(device)?;
        // SAFETY: a retained primary context.
        unsafe { CurrentContext::enter(ctx) }
    }

    fn raw_stream(stream: Stream) -> sys::CUstream {
        stream.0 as usize as sys::CUstream
    }

    fn raw_event(event: Event) -> sys::CUevent {
        event.0 as usize as sys::CUevent
    }
}

/// What the driver says of the memory at one address, and the allocation holding it.
#[derive(Clone, Copy, Debug)]
struct Allocation {
    start: u64,
    end: u64,
    memory: Memory,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    /// Device memory of this ordinal (cuMemAlloc, a cuMemCreate mapping, memory opened through IPC).
    Device(i32),
    /// Managed memory: every device may use it.
    Managed,
    /// Page-locked host memory.
    PinnedHost,
    /// Nothing the driver knows: host memory from malloc, or no memory at all.
    Unknown,
}

impl CudaBackend {
    /// The allocation holding `ptr`: what it is from its pointer attributes, and where it starts and
    /// ends from cuMemGetAddressRange (two driver calls). The range attributes are not used: for
    /// cuMemCreate memory they give the whole reserved range, mapped or not, where
    /// cuMemGetAddressRange gives the mapping holding `ptr` and fails where nothing is mapped.
    fn allocation_at(ptr: u64) -> Allocation {
        use sys::CUpointer_attribute as A;
        let mut attributes = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        ];
        let (mut kind, mut ordinal, mut managed) = (0u32, -1i32, 0u32);
        let mut data: [*mut std::ffi::c_void; 3] = [
            (&mut kind as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut managed as *mut u32).cast(),
        ];
        // SAFETY: three attributes, each with an out-slot of the type the driver writes (a boolean
        // is one byte written into a zeroed u32). For a pointer the driver does not know it writes
        // default values instead of failing.
        let code = unsafe {
            sys::cuPointerGetAttributes(
                3,
                attributes.as_mut_ptr(),
                data.as_mut_ptr(),
                ptr as sys::CUdeviceptr,
            )
        };
        let unknown = Allocation { start: ptr, end: ptr.saturating_add(1), memory: Memory::Unknown };
        if code != CUresult::CUDA_SUCCESS {
            return unknown;
        }
        let memory = match kind {
            _ if managed != 0 => Memory::Managed,
            k if k == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 && ordinal >= 0 => {
                Memory::Device(ordinal)
            }
            k if k == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => Memory::PinnedHost,
            _ => return unknown,
        };
        let (mut start, mut size) = (0, 0);
        // SAFETY: valid out-pointers; the driver only inspects the address.
        let found = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, ptr) };
        match start.checked_add(size as u64) {
            Some(end) if found == CUresult::CUDA_SUCCESS && start <= ptr && ptr < end => {
                Allocation { start, end, memory }
            }
            // Page-locked host memory has no device range: refused whatever its extent.
            _ if memory == Memory::PinnedHost => Allocation { memory, ..unknown },
            _ => unknown,
        }
    }

    /// Why `memory` cannot serve a range of `range.device` (None: it can). `reach` caches
    /// whether a device accesses another directly.
    fn refuse(
        &self,
        memory: Memory,
        range: &super::MemoryRange,
        reach: &mut Vec<((i32, i32), bool)>,
    ) -> Result<Option<String>> {
        let device = range.device;
        Ok(match memory {
            Memory::Device(owner) if owner == device => None,
            Memory::Managed => None,
            Memory::Device(owner) if range.peers => {
                let can = match reach.iter().find(|(pair, _)| *pair == (device, owner)) {
                    Some(&(_, can)) => can,
                    None => {
                        let can = self.can_access_peer(device, owner).unwrap_or(false);
                        reach.push(((device, owner), can));
                        can
                    }
                };
                (!can).then(|| format!("is memory of device {owner}, which device {device} cannot access"))
            }
            Memory::Device(owner) => Some(format!("is memory of device {owner}, not of device {device}")),
            Memory::PinnedHost => Some(format!("is page-locked host memory, not memory of device {device}")),
            Memory::Unknown => Some(
                "is no memory CUDA knows (host memory from malloc, freed memory, or no memory at all)".into(),
            ),
        })
    }
}

impl Backend for CudaBackend {
    fn inaccessible(&self, ranges: &[super::MemoryRange]) -> Result<Vec<super::Refusal>> {
        let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].len > 0).collect();
        let Some(&first) = order.first() else { return Ok(Vec::new()) };
        // Pointer attributes need a context current; any of ours answers for every device.
        let _current = self.enter(ranges[first].device)?;
        order.sort_unstable_by_key(|&i| ranges[i].addr);
        let (mut refused, mut reach) = (Vec::new(), Vec::new());
        // The allocation last asked about: ranges in address order meet each allocation in a row.
        let mut known: Option<Allocation> = None;
        for index in order {
            let range = &ranges[index];
            self.index(range.device)?;
            let Some(end) = range.addr.checked_add(range.len) else {
                let why = "runs past the end of the 64-bit address space".into();
                refused.push(super::Refusal { index, at: range.addr, why });
                continue;
            };
            // Walk the allocations the range covers: it may run from one into the next where they
            // meet, but every byte must lie in one.
            let mut at = range.addr;
            while at < end {
                let allocation = match known {
                    Some(a) if a.start <= at && at < a.end => a,
                    _ => {
                        let a = Self::allocation_at(at);
                        known = Some(a);
                        a
                    }
                };
                if let Some(why) = self.refuse(allocation.memory, range, &mut reach)? {
                    let why = if at == range.addr {
                        why
                    } else {
                        format!("runs past the end of its allocation at {at:#x}, which {why}")
                    };
                    refused.push(super::Refusal { index, at, why });
                    break;
                }
                at = allocation.end;
            }
        }
        refused.sort_unstable_by_key(|r| r.index);
        Ok(refused)
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn device_name(&self, device: i32) -> String {
        let Ok(index) = self.index(device) else { return format!("no device {device}") };
        let handle = self.devices[index];
        let mut name = [0 as c_char; 128];
        // SAFETY: buffer of the length we pass.
        let result = unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, handle) };
        if result != CUresult::CUDA_SUCCESS {
            return format!("CUDA device {device}");
        }
        // SAFETY: the driver NUL-terminates within the buffer.
        unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned()
    }

    fn bind(&self, device: i32) -> Result<()> {
        let ctx = self.context(device)?;
        // SAFETY: a retained primary context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
    }

    fn null_stream(&self, _device: i32) -> Stream {
        Stream::NULL
    }

    fn create_stream(&self, device: i32) -> Result<Stream> {
        let _current = self.enter(device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer, context current.
        check("cuStreamCreate(CU_STREAM_NON_BLOCKING)", unsafe {
            sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(stream as usize as u64))
    }

    fn destroy_stream(&self, device: i32, stream: Stream) {
        if stream == Stream::NULL {
            return;
        }
        if let Ok(_current) = self.enter(device) {
            // SAFETY: a stream we created; queued work still completes.
            let result = unsafe { sys::cuStreamDestroy_v2(Self::raw_stream(stream)) };
            if result != CUresult::CUDA_SUCCESS {
                log::warn!("cuStreamDestroy on device {device}: {}", error_name(result));
            }
        }
    }

    fn create_event(&self, device: i32) -> Result<Event> {
        let _current = self.enter(device)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer, context current.
        check("cuEventCreate(CU_EVENT_DISABLE_TIMING)", unsafe {
            sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Event(event as usize as u64))
    }

    fn destroy_event(&self, device: i32, event: Event) {
        if let Ok(_current) = self.enter(device) {
            // SAFETY: an event we created.
            let result = unsafe { sys::cuEventDestroy_v2(Self::raw_event(event)) };
            if result != CUresult::CUDA_SUCCESS {
                log::warn!("cuEventDestroy on device {device}: {}", error_name(result));
            }
        }
    }

    fn record(&self, device: i32, event: Event, stream: Stream) -> Result<()> {
        // The NULL stream means the legacy stream of the *current* context: make it the device's.
        let _current = self.enter(device)?;
        // SAFETY: handles from this backend (or the caller's stream on this device).
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(Self::raw_event(event), Self::raw_stream(stream))
        })
    }

    fn wait(&self, device: i32, stream: Stream, event: Event) -> Result<()> {
        let _current = self.enter(device)?;
        // SAFETY: as for record.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(Self::raw_stream(stream), Self::raw_event(event), 0)
        })
    }

    fn sync_event(&self, device: i32, event: Event) -> Result<()> {
        let _current = self.enter(device)?;
        // SAFETY: an event from this backend.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(Self::raw_event(event)) })
    }

    fn sync_stream(&self, device: i32, stream: Stream) -> Result<()> {
        let _current = self.enter(device)?;
        // SAFETY: a stream on this device.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(Self::raw_stream(stream)) })
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> Result<bool> {
        let (index, peer_index) = (self.index(device)?, self.index(peer)?);
        if device == peer {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: valid device handles and out-pointer.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.devices[index], self.devices[peer_index])
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(&self, device: i32, peer: i32) -> Result<()> {
        if device == peer {
            return self.index(device).map(drop);
        }
        let peer_ctx = self.context(peer)?;
        let _current = self.enter(device)?;
        // SAFETY: current context is the device's; the peer's is retained.
        let result = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) };
        if result == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(&format!("cuCtxEnablePeerAccess({device} -> {peer})"), result)
    }

    unsafe fn copy_segments(&self, device: i32, stream: Stream, segments: &[Segment]) -> Result<()> {
        let _current = self.enter(device)?;
        let mut copies = EngineCopies::new(device, Self::raw_stream(stream));
        for segment in segments {
            let mut result = Ok(());
            segment.for_each_run(|src, dst, len| {
                if result.is_ok() {
                    result = copies.push(src, dst, len);
                }
            });
            result?;
        }
        copies.flush()
    }

    unsafe fn copy_batch(
        &self,
        device: i32,
        stream: Stream,
        segments: &[Segment],
        checked: bool,
    ) -> Result<()> {
        self.index(device)?;
        kernels::copy_segments(device, Self::raw_stream(stream), segments, checked)
    }

    fn prepare_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
    ) -> Result<Box<dyn PreparedCopy>> {
        self.index(device)?;
        Ok(Box::new(PreparedBatch::new(device, segments, checked)?))
    }

    unsafe fn digest(&self, device: i32, stream: Stream, addr: u64, len: u64) -> Result<u64> {
        self.index(device)?;
        check_range(addr, len)?;
        DigestKernel::for_device(device)?.digest(Self::raw_stream(stream), addr, len)
    }

    unsafe fn digest_many(&self, device: i32, stream: Stream, ranges: &[ByteRange]) -> Result<Vec<u64>> {
        self.index(device)?;
        check_ranges(ranges)?;
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        DigestKernel::for_device(device)?.digest_many(Self::raw_stream(stream), ranges)
    }

    unsafe fn quantize_batch(
        &self,
        device: i32,
        stream: Stream,
        jobs: &[crate::quant::QuantJob],
    ) -> Result<()> {
        self.index(device)?;
        let layout = crate::kernels::quantize::layout(jobs)?;
        if layout.tiles == 0 {
            return Ok(());
        }
        crate::kernels::quantize::QuantizeKernel::for_device(device)?
            .enqueue(Self::raw_stream(stream), &layout)
    }

    fn prepare_quantize(
        &self,
        device: i32,
        jobs: &[crate::quant::QuantJob],
    ) -> Result<Box<dyn PreparedQuantize>> {
        self.index(device)?;
        Ok(Box::new(crate::kernels::quantize::PreparedQuantize::new(device, jobs)?))
    }

    fn prepare_recording_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
    ) -> Result<Box<dyn PreparedCopy>> {
        self.index(device)?;
        Ok(Box::new(PreparedBatch::recording_digests(device, segments, checked)?))
    }

    fn prepare_compare(&self, device: i32, segments: &[Segment]) -> Result<Box<dyn PreparedCheck>> {
        self.index(device)?;
        Ok(Box::new(VerifyBatch::compare(device, segments)?))
    }

    fn prepare_digest_record(&self, device: i32, segments: &[Segment]) -> Result<Box<dyn PreparedRecord>> {
        self.index(device)?;
        Ok(Box::new(DigestRecord::new(device, segments)?))
    }

    fn prepare_digest_check(
        &self,
        device: i32,
        segments: &[Segment],
    ) -> Result<Box<dyn PreparedDigestCheck>> {
        self.index(device)?;
        Ok(Box::new(DigestCheck::new(device, segments)?))
    }

    fn alloc(&self, device: i32, bytes: usize) -> Result<u64> {
        let _current = self.enter(device)?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer, context current.
        let result = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) };
        if result == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::new(
                Status::OutOfMemory,
                format!("cuMemAlloc of {bytes} bytes on device {device}"),
            ));
        }
        check("cuMemAlloc", result)?;
        Ok(ptr)
    }

    unsafe fn free(&self, device: i32, ptr: u64) -> Result<()> {
        let _current = self.enter(device)?;
        check("cuMemFree", sys::cuMemFree_v2(ptr))
    }

    unsafe fn write(&self, device: i32, dst: u64, data: &[u8]) -> Result<()> {
        let _current = self.enter(device)?;
        check("cuCtxSynchronize", sys::cuCtxSynchronize())?;
        check("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len()))
    }

    unsafe fn read(&self, device: i32, src: u64, out: &mut [u8]) -> Result<()> {
        let _current = self.enter(device)?;
        check("cuCtxSynchronize", sys::cuCtxSynchronize())?;
        check("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len()))
    }
}

impl PreparedCopy for PreparedBatch {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        PreparedBatch::launch(self, CudaBackend::raw_stream(stream))
    }

    fn verify_destinations(&self) -> Result<Box<dyn PreparedCheck>> {
        Ok(Box::new(VerifyBatch::check(self)?))
    }
}

impl PreparedRecord for DigestRecord {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        DigestRecord::launch(self, CudaBackend::raw_stream(stream))
    }

    fn digests(&self) -> Result<Vec<u64>> {
        DigestRecord::digests(self)
    }
}

impl PreparedCheck for DigestCheck {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        DigestCheck::launch(self, CudaBackend::raw_stream(stream))
    }

    fn outcome(&self) -> Result<Option<usize>> {
        DigestCheck::outcome(self)
    }
}

impl PreparedDigestCheck for DigestCheck {
    fn expect(&self, digests: &[u64]) -> Result<()> {
        DigestCheck::expect(self, digests)
    }
}

impl PreparedCheck for VerifyBatch {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        VerifyBatch::launch(self, CudaBackend::raw_stream(stream))
    }

    fn outcome(&self) -> Result<Option<usize>> {
        VerifyBatch::outcome(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_libcuda_the_backend_is_a_status_listing_what_was_searched() {
        // SAFETY: only tries to open the library.
        if unsafe { sys::is_culib_present() } {
            // With a driver: a backend with devices, or a clear status (e.g. no device), never a panic.
            match cuda_backend() {
                Ok(backend) => assert!(backend.device_count() > 0),
                Err(err) => {
                    assert!(matches!(err.status, Status::CudaUnavailable | Status::CudaError), "{err}")
                }
            }
            return;
        }
        let err = cuda_backend().err().expect("no libcuda, no backend");
        assert_eq!(err.status, Status::CudaUnavailable);
        assert!(err.message.contains("libcuda.so"), "{}", err.message);
    }
}
