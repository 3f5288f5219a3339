//! Where bytes move. Backends know devices, streams, events and copies; they know nothing of plans.
//!
//! [`Backend`] is the one interface the group, allgather and the executors use. Two implementations:
//! [`cuda::CudaBackend`] (cudarc's driver layer: primary contexts, non-blocking streams, copy-engine
//! copies) and [`host::HostBackend`] (N simulated devices: host memory, one worker thread per stream
//! so that stream order and event waits are real and testable in CI).
//!
//! Streams and events cross this interface as opaque [`Stream`] / [`Event`] handles: a `CUstream` /
//! `CUevent` value on CUDA, a registry id on the host backend. `Stream::NULL` always means "the
//! device's legacy default stream" (on the host backend: that simulated device's default stream).

pub mod cuda;
pub mod driver;
pub mod dynlib;
pub mod host;
pub mod host_copy;
pub mod nccl;

use crate::error::Result;
use crate::segment::Segment;

/// Which implementation a backend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cuda,
    Host,
}

/// An opaque stream handle. 0 is the device's legacy default stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Stream(pub u64);

impl Stream {
    pub const NULL: Stream = Stream(0);

    /// The handle as C sees it (`void*`).
    pub fn as_ptr(self) -> *mut std::ffi::c_void {
        self.0 as usize as *mut std::ffi::c_void
    }

    pub fn from_ptr(ptr: *mut std::ffi::c_void) -> Stream {
        Stream(ptr as usize as u64)
    }
}

/// An opaque event handle, used only for ordering (no timing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// Devices, streams, events, peer access and copies. `device` arguments are the backend's device
/// ordinals (not group ranks). Every method may be called from any thread; methods that need a device
/// context make it current for the duration of the call and restore the caller's afterwards, except
/// [`Backend::bind`], whose purpose is to leave it current.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// Number of devices this backend can use.
    fn device_count(&self) -> usize;

    /// A human-readable name of the device (GPU model, or "host device N").
    fn device_name(&self, device: usize) -> String;

    /// Makes `device` current on the calling thread and leaves it so (for threads that work for one
    /// device only, such as the group's rank threads).
    fn bind(&self, device: usize) -> Result<()>;

    /// The stream a NULL caller stream stands for on `device`.
    fn null_stream(&self, device: usize) -> Stream;

    /// A new stream on `device` that does not synchronize with the legacy default stream.
    fn create_stream(&self, device: usize) -> Result<Stream>;

    /// Destroys a stream made by [`Backend::create_stream`]; work already queued still completes.
    fn destroy_stream(&self, device: usize, stream: Stream);

    /// A new event on `device`, for ordering only.
    fn create_event(&self, device: usize) -> Result<Event>;

    fn destroy_event(&self, device: usize, event: Event);

    /// Captures the work queued on `stream` so far into `event`.
    fn record(&self, device: usize, event: Event, stream: Stream) -> Result<()>;

    /// Makes work queued later on `stream` wait until the work captured by `event`'s latest record
    /// has completed. Does not block the host.
    fn wait(&self, device: usize, stream: Stream, event: Event) -> Result<()>;

    /// Blocks the host until the work captured by `event` has completed.
    fn sync_event(&self, device: usize, event: Event) -> Result<()>;

    /// Blocks the host until everything queued on `stream` has completed.
    fn sync_stream(&self, device: usize, stream: Stream) -> Result<()>;

    /// Whether `device` can read and write `peer`'s memory directly.
    fn can_access_peer(&self, device: usize, peer: usize) -> Result<bool>;

    /// Lets `device` access `peer`'s memory. Already enabled counts as success.
    fn enable_peer_access(&self, device: usize, peer: usize) -> Result<()>;

    /// Queues the copy of every segment on `stream` (which belongs to `device`), in order.
    ///
    /// # Safety
    /// Every source and destination byte must be valid memory for the duration of the queued work.
    unsafe fn copy_segments(&self, device: usize, stream: Stream, segments: &[Segment]) -> Result<()>;

    /// Allocates `bytes` of device memory (tests and benches; the library never owns caller memory).
    fn alloc(&self, device: usize, bytes: usize) -> Result<u64>;

    /// Frees memory from [`Backend::alloc`].
    ///
    /// # Safety
    /// `ptr` must come from `alloc` on this backend and device, with no work using it still queued.
    unsafe fn free(&self, device: usize, ptr: u64) -> Result<()>;

    /// Copies host bytes to device memory, synchronously (after all work on the device has finished).
    ///
    /// # Safety
    /// `dst .. dst + data.len()` must be valid device memory.
    unsafe fn write(&self, device: usize, dst: u64, data: &[u8]) -> Result<()>;

    /// Copies device memory to host bytes, synchronously.
    ///
    /// # Safety
    /// `src .. src + out.len()` must be valid device memory.
    unsafe fn read(&self, device: usize, src: u64, out: &mut [u8]) -> Result<()>;
}
