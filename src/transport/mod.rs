//! The transport: every way bytes cross devices and processes. It knows devices, streams, events,
//! copies and communicators; it knows nothing of groups, collectives or plans.
//!
//! - [`Backend`] is the one interface the group, allgather and the executors use for devices, streams,
//!   events and copies, the batched copy included ([`Backend::copy_batch`], [`Backend::prepare_batch`]),
//!   and for the digest of device memory ([`Backend::digest`], and of many ranges in one pass:
//!   [`Backend::digest_many`]).
//!   Two implementations: [`cuda::CudaBackend`] (cudarc's driver layer: primary contexts, non-blocking
//!   streams, copy-engine copies, refit's batched copy kernel from `kernels`) and [`host::HostBackend`]
//!   (N simulated devices: host memory, one worker thread per stream so that stream order and event
//!   waits are real and testable in CI; [`host_copy`] is its batched copy, [`host_verify`] its verify).
//! - Integrity for a group's rank: [`digest`] (the digest of device memory) and [`verify`] (checking
//!   copied bytes on the device), both on every backend.
//! - [`nccl`]: NCCL communicators and the calls issued on them (collectives, grouped send/recv).
//! - [`comm`]: communicators between processes (NCCL, or the host backend's simulation of it over
//!   [`mesh`], Unix sockets between the processes of one machine).
//! - The run-time loaders, side by side: [`driver`] (libcuda, through cudarc, and the driver calls
//!   shared with the kernels), [`nccl`] (libnccl), [`nvrtc`] (libnvrtc), over [`dynlib`] (dlopen).
//!
//! Imports point one way: the backends use `kernels` (the batched copy's launch), and `kernels` uses
//! only the driver and loader files here, which import nothing else of the crate but `error`.
//!
//! Streams and events cross this interface as opaque [`Stream`] / [`Event`] handles: a `CUstream` /
//! `CUevent` value on CUDA, a registry id on the host backend. `Stream::NULL` always means "the
//! device's legacy default stream" (on the host backend: that simulated device's default stream).

pub mod access;
pub mod comm;
pub mod cuda;
pub mod driver;
pub mod dynlib;
pub mod engine_copy;
pub mod host;
pub mod host_copy;
pub mod host_verify;
pub mod ipc;
pub mod mappings;
pub mod mesh;
pub mod nccl;
pub mod nvrtc;
pub mod staged;
pub mod verify;

use crate::error::{Error, Result, Status};
pub use crate::kernels::digest::ByteRange;
use crate::segment::Segment;

/// `len` bytes at `addr` that a call will read (and, when `written`, write), which must be memory of
/// `device` (or, with `peers`, of a device `device` can access directly): what
/// [`Backend::inaccessible`] checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRange {
    pub device: i32,
    pub addr: u64,
    pub len: u64,
    pub peers: bool,
    pub written: bool,
}

/// A range [`Backend::inaccessible`] refused: its index, the first address found wanting, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub index: usize,
    pub at: u64,
    pub why: String,
}

/// The index of ordinal `device` among the `count` devices of a backend (`what` names them in the
/// message), or `InvalidDevice`.
pub(crate) fn device_index(device: i32, count: usize, what: &str) -> Result<usize> {
    usize::try_from(device).ok().filter(|&index| index < count).ok_or_else(|| {
        Error::new(Status::InvalidDevice, format!("device {device} is not one of the {count} {what}"))
    })
}

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
/// ordinals (`i32`, as CUDA's), never group ranks; one out of range is `InvalidDevice`. Every method may be called from any thread; methods that need a device
/// context make it current for the duration of the call and restore the caller's afterwards, except
/// [`Backend::bind`], whose purpose is to leave it current.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// Number of devices this backend can use.
    fn device_count(&self) -> usize;

    /// A human-readable name of the device (GPU model, or "host device N").
    fn device_name(&self, device: i32) -> String;

    /// Makes `device` current on the calling thread and leaves it so (for threads that work for one
    /// device only, such as the group's rank threads).
    fn bind(&self, device: i32) -> Result<()>;

    /// The stream a NULL caller stream stands for on `device`.
    fn null_stream(&self, device: i32) -> Stream;

    /// A new stream on `device` that does not synchronize with the legacy default stream.
    fn create_stream(&self, device: i32) -> Result<Stream>;

    /// Destroys a stream made by [`Backend::create_stream`]; work already queued still completes.
    fn destroy_stream(&self, device: i32, stream: Stream);

    /// A new event on `device`, for ordering only.
    fn create_event(&self, device: i32) -> Result<Event>;

    fn destroy_event(&self, device: i32, event: Event);

    /// Captures the work queued on `stream` so far into `event`.
    fn record(&self, device: i32, event: Event, stream: Stream) -> Result<()>;

    /// Makes work queued later on `stream` wait until the work captured by `event`'s latest record
    /// has completed. Does not block the host.
    fn wait(&self, device: i32, stream: Stream, event: Event) -> Result<()>;

    /// Blocks the host until the work captured by `event` has completed.
    fn sync_event(&self, device: i32, event: Event) -> Result<()>;

    /// Blocks the host until everything queued on `stream` has completed.
    fn sync_stream(&self, device: i32, stream: Stream) -> Result<()>;

    /// Whether `device` can read and write `peer`'s memory directly.
    fn can_access_peer(&self, device: i32, peer: i32) -> Result<bool>;

    /// Lets `device` access `peer`'s memory. Already enabled counts as success.
    fn enable_peer_access(&self, device: i32, peer: i32) -> Result<()>;

    /// Queues the copy of every segment on `stream` (which belongs to `device`), one copy per
    /// contiguous run (the copy engine on CUDA, runs handed to the driver in batches; see
    /// `engine_copy`). The reference for [`Backend::copy_batch`]. The runs start after what `stream`
    /// held before and run in no particular order among themselves, as the kernel's do.
    ///
    /// # Safety
    /// Every source and destination byte must be valid memory for the duration of the queued work,
    /// and no run may read bytes another run of the call writes.
    unsafe fn copy_segments(&self, device: i32, stream: Stream, segments: &[Segment]) -> Result<()>;

    /// The batched copy: every segment copied on `stream` (a stream of `device`; `Stream::NULL` for
    /// its legacy default stream) in one launch of refit's copy kernel on CUDA, queued and not waited
    /// for; on the host backend, complete on return. Segments are checked first
    /// (`segment::check::validate`); `checked` also fails the batch with `Overlap`, copying nothing,
    /// when two destination runs share a byte (unchecked, which write lands is undefined).
    ///
    /// # Safety
    /// Every run must name memory that stays valid until the copy has run (device memory reachable
    /// from `device` on CUDA, host memory on the host backend), and `stream` must be a live stream of
    /// `device`.
    unsafe fn copy_batch(
        &self,
        device: i32,
        stream: Stream,
        segments: &[Segment],
        checked: bool,
    ) -> Result<()>;

    /// Checks `segments` as [`Backend::copy_batch`] does and prepares them for repeated batched copies
    /// on `device`: descriptors uploaded once on CUDA, a kept copy of the list on the host backend.
    fn prepare_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
    ) -> Result<Box<dyn PreparedCopy>>;

    /// The refit digest (`kernels::gf64`) of the `len` bytes at `addr`, computed on `stream` (a stream
    /// of `device`; `Stream::NULL` for its legacy default stream) after the work queued on it before,
    /// and returned once the stream has reached it: the call waits for the stream. On CUDA, the digest
    /// kernel; on the host backend, the same digest computed by the stream's worker.
    /// InvalidArgument for a zero address with a nonzero length or a range past the end of the
    /// address space.
    ///
    /// # Safety
    /// `addr .. addr + len` is memory of `device` (host memory on the host backend) that stays
    /// readable until the call returns, and `stream` a live stream of that device.
    unsafe fn digest(&self, device: i32, stream: Stream, addr: u64, len: u64) -> Result<u64>;

    /// The refit digest of each of `ranges`, in order, computed on `stream` as [`Backend::digest`]
    /// computes one (each equals `digest` of that range), in one pass over all of them: on CUDA one
    /// launch of the digest kernel's many-range entry, its work split evenly across the ranges'
    /// bytes; on the host backend, one task of the stream's worker. Waits for the stream. No ranges:
    /// nothing is queued and the result is empty. InvalidArgument as for `digest`, naming the first
    /// bad range by its index.
    ///
    /// # Safety
    /// As for [`Backend::digest`], for every range.
    unsafe fn digest_many(&self, device: i32, stream: Stream, ranges: &[ByteRange]) -> Result<Vec<u64>>;

    /// As [`Backend::prepare_batch`], and every launch also records digests of the source bytes it
    /// reads, against which [`PreparedCopy::verify_destinations`] checks the destinations without
    /// reading the sources again (on CUDA: one per tile of the copy kernel, computed from the elements
    /// it holds in registers, so no extra memory traffic).
    fn prepare_recording_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
    ) -> Result<Box<dyn PreparedCopy>>;

    /// A verify comparing the destination of every segment with its source on `device` (addresses as
    /// for [`Backend::copy_batch`]); segments are checked as `copy_batch` does.
    fn prepare_compare(&self, device: i32, segments: &[Segment]) -> Result<Box<dyn PreparedCheck>>;

    /// Digests of the source bytes of `segments` on `device`, taken at each launch, for a
    /// [`Backend::prepare_digest_check`] of the same segments where the destinations are (another
    /// process): the verify of bytes that travel by other means than this backend's copies. The
    /// destinations are not touched, and may be another process's addresses.
    fn prepare_digest_record(&self, device: i32, segments: &[Segment]) -> Result<Box<dyn PreparedRecord>>;

    /// A verify of the destinations of `segments` on `device` against digests a
    /// [`Backend::prepare_digest_record`] of the same segments took elsewhere (the same backend kind).
    /// The sources are not read, and may be another process's addresses.
    fn prepare_digest_check(&self, device: i32, segments: &[Segment])
        -> Result<Box<dyn PreparedDigestCheck>>;

    /// The ranges of `ranges` a copy on this backend cannot use, by ascending index; empty when all
    /// can be used. Empty ranges are never refused. CUDA: every byte must lie in a live allocation
    /// the driver knows (cuMemAlloc, cuMemCreate mappings, memory opened through IPC, managed
    /// memory) of the range's device (or, with `peers`, of a device it can access directly); a range
    /// may run from one allocation into the next where they meet. Host memory CUDA does not know
    /// (malloc), page-locked host memory, another device's memory and unmapped addresses are refused.
    /// The ranges are visited in address order and each allocation is asked about once: host work
    /// O(n log n) in the ranges plus one driver query per allocation they touch. Host backend: a range
    /// past the end of the address space, in the first page (below 4096), or not within the process's
    /// mappings (`/proc/self/maps`, read once per call) that allow reading it, and writing it where
    /// `written`: unmapped and freed memory, guard pages, read-only memory written.
    /// Errors are the driver's (a context that cannot be made current), never a refusal.
    fn inaccessible(&self, ranges: &[MemoryRange]) -> Result<Vec<Refusal>>;

    /// The quantizing copy (`crate::quant`): every job's source matrix quantized to FP8 into its
    /// destination and its scales, on `stream` (a stream of `device`; `Stream::NULL` for its legacy
    /// default stream) after the work queued on it before. Jobs are checked first
    /// (`quant::check_jobs`: InvalidArgument, Overlap). On CUDA, the quantize kernel (one launch per
    /// entry point the jobs need, and a first phase for per-tensor jobs), queued and not waited for; on the host backend, the reference
    /// quantizer run by the stream's worker, complete on return.
    ///
    /// # Safety
    /// Every job's source (rounded up to whole 16-byte vectors per row), destination and scales are
    /// memory of `device` (host memory on the host backend) valid until the work has run, and
    /// `stream` a live stream of that device; no source overlaps a destination or scales.
    unsafe fn quantize_batch(
        &self,
        device: i32,
        stream: Stream,
        jobs: &[crate::quant::QuantJob],
    ) -> Result<()>;

    /// `jobs` checked as [`Backend::quantize_batch`] checks them and prepared for repeated runs on
    /// `device`: on CUDA laid out and uploaded once, so that each launch only queues the kernel; on
    /// the host backend a kept copy of the jobs.
    fn prepare_quantize(
        &self,
        device: i32,
        jobs: &[crate::quant::QuantJob],
    ) -> Result<Box<dyn PreparedQuantize>>;

    /// Allocates `bytes` of device memory (tests and benches; the library never owns caller memory).
    fn alloc(&self, device: i32, bytes: usize) -> Result<u64>;

    /// Frees memory from [`Backend::alloc`].
    ///
    /// # Safety
    /// `ptr` must come from `alloc` on this backend and device, with no work using it still queued.
    unsafe fn free(&self, device: i32, ptr: u64) -> Result<()>;

    /// Copies host bytes to device memory, synchronously (after all work on the device has finished).
    ///
    /// # Safety
    /// `dst .. dst + data.len()` must be valid device memory.
    unsafe fn write(&self, device: i32, dst: u64, data: &[u8]) -> Result<()>;

    /// Copies device memory to host bytes, synchronously.
    ///
    /// # Safety
    /// `src .. src + out.len()` must be valid device memory.
    unsafe fn read(&self, device: i32, src: u64, out: &mut [u8]) -> Result<()>;
}

/// A batch made by [`Backend::prepare_batch`], launched any number of times. It holds no reference to
/// a group; on the host backend, launching after the backend is gone is an error, not a crash.
pub trait PreparedCopy: Send + Sync {
    /// Queues the batch on `stream` (a stream of the prepared device). On CUDA: one kernel launch and
    /// nothing else, so it may be captured into a graph. On the host backend: complete on return.
    ///
    /// # Safety
    /// As for [`Backend::copy_batch`], at every launch.
    unsafe fn launch(&self, stream: Stream) -> Result<()>;

    /// A verify of this batch's destinations against the digests of the sources its launches read:
    /// launch it after each launch of the batch. InvalidArgument unless the batch was prepared by
    /// [`Backend::prepare_recording_batch`].
    fn verify_destinations(&self) -> Result<Box<dyn PreparedCheck>>;
}

/// Quantization jobs prepared by [`Backend::prepare_quantize`].
pub trait PreparedQuantize: Send + Sync {
    /// The jobs as the CUDA backend prepared them, which a copy stage's launch can carry
    /// ([`crate::kernels::quantize::PreparedQuantize::launch_with_copy`]); None on other backends.
    fn on_cuda(&self) -> Option<&crate::kernels::quantize::PreparedQuantize> {
        None
    }

    /// Queues the jobs on `stream` (a stream of the prepared device), as [`Backend::quantize_batch`]
    /// queues them, with no host work per job: on CUDA the kernel's launches (and, for per-tensor
    /// jobs, the zeroing of their amax words) and nothing else; on the host backend complete on
    /// return.
    ///
    /// # Safety
    /// As for [`Backend::quantize_batch`], at every launch.
    unsafe fn launch(&self, stream: Stream) -> Result<()>;

    /// The amaxes of the jobs whose key `keys` (sorted) lists, over their own elements only (a
    /// launch's first phase alone, writing no code or scale): queued on `stream` and waited for.
    /// Empty without such jobs. What the devices quantizing one set of needs exchange
    /// ([`crate::plan::AmaxExchange`]).
    ///
    /// # Safety
    /// The jobs' sources are readable until the call returns.
    unsafe fn partial_amaxes(&self, stream: Stream, keys: &[u64]) -> Result<crate::quant::job::Amaxes>;

    /// Sets the amaxes that later launches start keyed jobs from, replacing the last ones: a job
    /// whose key `amaxes` holds takes the maximum of that and its own elements' amax (per row, row by
    /// row). Launches already queued are unaffected.
    fn seed_amaxes(&self, amaxes: &crate::quant::job::Amaxes) -> Result<()>;
}

/// Source digests prepared by [`Backend::prepare_digest_record`].
pub trait PreparedRecord: Send + Sync {
    /// Queues the record on `stream` (a stream of the prepared device): it digests the sources as
    /// they are when the stream reaches it.
    ///
    /// # Safety
    /// Every segment's source is readable until the record has run.
    unsafe fn launch(&self, stream: Stream) -> Result<()>;

    /// The digests of the last launch, once its stream has been synchronized: what the check of the
    /// same segments expects.
    fn digests(&self) -> Result<Vec<u64>>;
}

/// A check prepared by [`Backend::prepare_digest_check`].
pub trait PreparedDigestCheck: PreparedCheck {
    /// Sets the digests the next launches compare with. InvalidArgument when they were not recorded
    /// from the same segments (another count). Synchronous; no launch may be queued or running.
    fn expect(&self, digests: &[u64]) -> Result<()>;
}

/// A verify prepared for one device (see `verify::PreparedVerify`, which wraps it with its interface):
/// launched on a stream after the copies it checks, its outcome read once that stream has been
/// synchronized. Launches of one verify must not overlap in time (they share the outcome).
pub trait PreparedCheck: Send + Sync {
    /// Queues the verify on `stream` (a stream of the prepared device; NULL: its legacy default
    /// stream); returns without waiting, with host work that does not depend on the segment count.
    ///
    /// # Safety
    /// Every segment's source (for a compare) and destination is readable until the verify has run.
    unsafe fn launch(&self, stream: Stream) -> Result<()>;

    /// The index of the first segment found different by the last launch, None when all matched;
    /// resets for the next launch. InvalidState when no launch has completed since the last outcome.
    fn outcome(&self) -> Result<Option<usize>>;
}
