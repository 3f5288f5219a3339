//! The host backend: N simulated devices made of threads and host memory, so that every API runs in CI.
//!
//! What is simulated for real:
//! - A **stream** is a FIFO queue served by its own worker thread: work queued on it runs later, in
//!   order, concurrently with the caller and with other streams. So a test that forgets an event wait
//!   sees wrong bytes, exactly as on a GPU.
//! - An **event** counts records: `record` queues a marker on the stream; `wait` queues, on the waiting
//!   stream, a step that blocks until the marker of the latest record (as of the `wait` call) has run;
//!   `sync_event` blocks the host for it.
//! - **Device memory** is host memory: device pointers are host addresses, any host pointer works.
//!
//! Caller streams on this backend: NULL means the simulated device's own default stream (one worker per
//! device, made with the backend). Other host streams come from [`create_host_stream`] (C:
//! `refit_host_stream_create`); streams live in a process-wide registry, so one made for a test can be
//! passed to any group that uses the host backend. The registry remembers who made each stream: the
//! caller destroys only the streams it created, a backend's own streams go with the backend.
//! Nothing here is needed on a machine with GPUs.

use super::host_copy::copy_runs;
use super::host_verify::{segment_digest, HostCheck, HostRecord, Reference};
use super::ByteRange;
use super::{
    device_index, Backend, BackendKind, Event, PreparedCheck, PreparedCopy, PreparedDigestCheck,
    PreparedQuantize, PreparedRecord, Stream,
};
use crate::error::{try_to_vec, Error, Result, Status};
use crate::kernels::digest::{check_range, check_ranges};
use crate::kernels::gf64;
use crate::quant::job::Amaxes;
use crate::segment::check::{check_destinations, validate};
use crate::segment::{Segment, Side};
use crate::sync::{lock, wait};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

type Work = Box<dyn FnOnce() + Send + 'static>;

/// One FIFO queue and the thread that serves it.
pub struct HostStream {
    queue: Mutex<Option<Sender<Work>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl HostStream {
    fn start(name: String) -> Result<Arc<HostStream>> {
        let (sender, receiver) = channel::<Work>();
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                while let Ok(work) = receiver.recv() {
                    work();
                }
            })
            .map_err(|e| {
                Error::new(Status::OutOfMemory, format!("cannot start a host stream thread: {e}"))
            })?;
        Ok(Arc::new(HostStream { queue: Mutex::new(Some(sender)), worker: Mutex::new(Some(worker)) }))
    }

    /// Queues `work` to run after everything queued before it.
    pub fn enqueue(&self, work: impl FnOnce() + Send + 'static) -> Result<()> {
        let queue = lock(&self.queue);
        match queue.as_ref() {
            Some(sender) => sender
                .send(Box::new(work))
                .map_err(|_| Error::invalid_state("host stream worker has stopped")),
            None => Err(Error::invalid_state("host stream was destroyed")),
        }
    }

    /// Blocks until everything queued so far has run.
    pub fn synchronize(&self) -> Result<()> {
        let marker = HostEvent::new();
        marker.record_on(self)?;
        marker.synchronize();
        Ok(())
    }

    /// Stops accepting work, lets queued work finish, and joins the worker.
    fn stop(&self) {
        lock(&self.queue).take();
        let worker = lock(&self.worker).take();
        if let Some(worker) = worker {
            if worker.thread().id() != std::thread::current().id() {
                let _ = worker.join();
            }
        }
    }
}

/// A marker that counts records and completions.
pub struct HostEvent {
    state: Mutex<EventState>,
    changed: Condvar,
}

#[derive(Default)]
struct EventState {
    recorded: u64,
    completed: u64,
}

impl HostEvent {
    fn new() -> Arc<HostEvent> {
        Arc::new(HostEvent { state: Mutex::new(EventState::default()), changed: Condvar::new() })
    }

    fn record_on(self: &Arc<Self>, stream: &HostStream) -> Result<()> {
        let ticket = {
            let mut state = lock(&self.state);
            state.recorded += 1;
            state.recorded
        };
        let event = Arc::clone(self);
        stream.enqueue(move || {
            let mut state = lock(&event.state);
            state.completed = state.completed.max(ticket);
            event.changed.notify_all();
        })
    }

    fn latest_record(&self) -> u64 {
        lock(&self.state).recorded
    }

    fn wait_for(&self, ticket: u64) {
        let mut state = lock(&self.state);
        while state.completed < ticket {
            state = wait(&self.changed, state);
        }
    }

    fn synchronize(&self) {
        self.wait_for(self.latest_record());
    }
}

/// Who may destroy a registered stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Owner {
    /// Made by [`create_host_stream`] (C: `refit_host_stream_create`): the caller destroys it.
    Caller,
    /// A simulated device's default stream or a group's stream on that device: only its backend
    /// destroys it, and it serves only work on that device (a CUDA stream serves only its context).
    Device(i32),
}

/// Process-wide registry of host streams and events, keyed by their opaque handle values (ids from
/// `crate::ids`: unique, and not guessable from one another, so a value the library never issued
/// names nothing).
struct Registry {
    streams: Mutex<HashMap<u64, (Arc<HostStream>, Owner)>>,
    events: Mutex<HashMap<u64, Arc<HostEvent>>>,
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY
        .get_or_init(|| Registry { streams: Mutex::new(HashMap::new()), events: Mutex::new(HashMap::new()) })
}

/// Inserts `value` under a new handle value.
fn insert_new<T>(map: &mut HashMap<u64, T>, value: T) -> u64 {
    let id = crate::ids::issue();
    map.insert(id, value);
    id
}

fn lock_streams() -> std::sync::MutexGuard<'static, HashMap<u64, (Arc<HostStream>, Owner)>> {
    lock(&registry().streams)
}

fn register_stream(name: String, owner: Owner) -> Result<Stream> {
    let stream = HostStream::start(name)?;
    Ok(Stream(insert_new(&mut lock_streams(), (stream, owner))))
}

/// Removes a stream registered by `owner` and stops it after its queued work has run.
fn unregister_stream(stream: Stream, owner: Owner) -> Result<()> {
    let removed = {
        let mut streams = lock_streams();
        match streams.get(&stream.0) {
            // Who may remove it, not which device: a backend's stream goes with the backend.
            Some((_, registered)) if std::mem::discriminant(registered) == std::mem::discriminant(&owner) => {
                streams.remove(&stream.0)
            }
            Some(_) => {
                let message = format!(
                    "stream {:#x} belongs to a group (or a simulated device) and is destroyed with it, not \
                     by refit_host_stream_destroy",
                    stream.0
                );
                return Err(Error::invalid_argument(message));
            }
            None => None,
        }
    };
    match removed {
        Some((stream, _)) => {
            stream.stop();
            Ok(())
        }
        None => Err(Error::invalid_argument(format!(
            "stream {:#x} was not made by refit_host_stream_create, or was destroyed already",
            stream.0
        ))),
    }
}

/// The host stream behind a handle.
pub fn host_stream(stream: Stream) -> Result<Arc<HostStream>> {
    lock_streams()
        .get(&stream.0)
        .map(|(stream, _)| Arc::clone(stream))
        .ok_or_else(|| Error::invalid_argument(format!("stream {:#x} is not a host stream", stream.0)))
}

/// The host stream that `stream` names for work on the simulated device whose default stream is
/// `default`: NULL is that default stream, a caller's stream serves any device, and a device's own
/// stream serves only that device.
pub(crate) fn stream_for(default: Stream, stream: Stream) -> Result<Arc<HostStream>> {
    let streams = lock_streams();
    let named = if stream == Stream::NULL { default } else { stream };
    let Some((found, owner)) = streams.get(&named.0) else {
        return Err(Error::invalid_argument(format!("stream {:#x} is not a host stream", named.0)));
    };
    if let (Owner::Device(theirs), Some((_, Owner::Device(ours)))) = (owner, streams.get(&default.0)) {
        if theirs != ours {
            return Err(Error::invalid_argument(format!(
                "stream {:#x} is a stream of simulated device {theirs}, and this work is on device {ours}: \
                 pass a stream of that device or a host stream from refit_host_stream_create",
                stream.0
            )));
        }
    }
    Ok(Arc::clone(found))
}

fn host_event(event: Event) -> Result<Arc<HostEvent>> {
    lock(&registry().events)
        .get(&event.0)
        .cloned()
        .ok_or_else(|| Error::invalid_argument(format!("event {:#x} is not a host event", event.0)))
}

/// A new caller-side host stream (for tests and C programs that exercise stream ordering on the host
/// backend). Release it with [`destroy_host_stream`].
pub fn create_host_stream() -> Result<Stream> {
    register_stream("refit-host-stream".to_string(), Owner::Caller)
}

/// Destroys a stream from [`create_host_stream`] after its queued work has run. Any other value,
/// including the stream of a group or of a simulated device, is InvalidArgument and changes nothing.
pub fn destroy_host_stream(stream: Stream) -> Result<()> {
    unregister_stream(stream, Owner::Caller)
}

/// N simulated devices.
pub struct HostBackend {
    default_streams: Vec<Stream>,
}

impl HostBackend {
    /// A backend simulating `devices` devices (at least 1).
    pub fn new(devices: usize) -> Result<HostBackend> {
        if devices == 0 {
            return Err(Error::invalid_argument("the host backend needs at least one simulated device"));
        }
        let default_streams = (0..devices)
            .map(|d| register_stream(format!("refit-host-dev{d}-default"), Owner::Device(d as i32)))
            .collect::<Result<Vec<_>>>()?;
        Ok(HostBackend { default_streams })
    }

    /// The index of `device` in this backend's tables, or `InvalidDevice`.
    fn index(&self, device: i32) -> Result<usize> {
        device_index(device, self.default_streams.len(), "simulated devices")
    }

    fn check_device(&self, device: i32) -> Result<()> {
        self.index(device).map(drop)
    }

    /// NULL resolves to the device's default stream; another device's stream is refused.
    fn resolve(&self, device: i32, stream: Stream) -> Result<Arc<HostStream>> {
        stream_for(self.default_streams[self.index(device)?], stream)
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        for (device, stream) in self.default_streams.iter().enumerate() {
            let _ = unregister_stream(*stream, Owner::Device(device as i32));
        }
    }
}

/// Jobs prepared by [`HostBackend::prepare_quantize`]: checked once, kept.
struct HostQuantize {
    default_stream: Stream,
    jobs: Arc<Vec<crate::quant::QuantJob>>,
    /// The amaxes launches start keyed jobs from ([`PreparedQuantize::seed_amaxes`]).
    seed: Mutex<Arc<Amaxes>>,
}

impl PreparedQuantize for HostQuantize {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let queue = stream_for(self.default_stream, stream)?;
        let seed = Arc::clone(&lock(&self.seed));
        // SAFETY: the caller's promise.
        unsafe { quantize_on(&queue, Arc::clone(&self.jobs), seed) }
    }

    unsafe fn partial_amaxes(&self, stream: Stream, keys: &[u64]) -> Result<Amaxes> {
        let queue = stream_for(self.default_stream, stream)?;
        let (jobs, keys) = (Arc::clone(&self.jobs), keys.to_vec());
        let result = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&result);
        // SAFETY: the caller keeps the sources valid until the work has run, which is waited for.
        queue.enqueue(move || {
            *lock(&slot) = Some(unsafe { crate::quant::reference::keyed_amaxes(&jobs, &keys) });
        })?;
        queue.synchronize()?;
        let amaxes = lock(&result).take();
        amaxes.ok_or_else(|| Error::invalid_state("the host stream stopped before it reduced the amaxes"))
    }

    fn seed_amaxes(&self, amaxes: &Amaxes) -> Result<()> {
        *lock(&self.seed) = Arc::new(amaxes.clone());
        Ok(())
    }
}

/// Runs checked `jobs` through the reference quantizer on `queue`'s worker and waits for it: bands of
/// block rows on every core, as the GPU spreads blocks over its SMs (no two bands write the same
/// byte).
///
/// # Safety
/// As for [`Backend::quantize_batch`].
unsafe fn quantize_on(
    queue: &HostStream,
    jobs: Arc<Vec<crate::quant::QuantJob>>,
    seed: Arc<Amaxes>,
) -> Result<()> {
    // SAFETY: the caller keeps the memory valid until the work has run, which this call waits for.
    queue.enqueue(move || {
        use crate::quant::reference::{quantize_host_job, row_bands, seeded_scales};
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: the caller keeps the memory valid until the work has run.
        let shared = unsafe { seeded_scales(&jobs, &seed) };
        let bands: Vec<_> = jobs
            .iter()
            .zip(shared)
            .flat_map(|(job, scale)| {
                row_bands(job, threads as u64).into_iter().map(move |band| (band, scale.clone()))
            })
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads.min(bands.len()))
                .map(|_| {
                    scope.spawn(|| loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((band, scale)) = bands.get(i) else { return };
                        // SAFETY: the caller keeps the memory valid until the work has run (waited
                        // for below); the bands of checked jobs write disjoint bytes (a shared
                        // scale only its owner writes).
                        unsafe { quantize_host_job(band, scale.as_ref()) };
                    })
                })
                .collect();
            // Joined one by one rather than by the scope, whose wait ends when each closure has
            // returned, before its thread has exited and freed its thread-locals: a leak checker
            // run just after this call (the fuzz targets') would report those.
            for worker in workers {
                if let Err(panic) = worker.join() {
                    std::panic::resume_unwind(panic);
                }
            }
        });
    })?;
    queue.synchronize()
}

impl Backend for HostBackend {
    fn inaccessible(&self, ranges: &[super::MemoryRange]) -> Result<Vec<super::Refusal>> {
        Ok(super::access::host_inaccessible(ranges))
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn device_count(&self) -> usize {
        self.default_streams.len()
    }

    fn device_name(&self, device: i32) -> String {
        format!("host device {device}")
    }

    fn bind(&self, device: i32) -> Result<()> {
        self.check_device(device)
    }

    fn null_stream(&self, device: i32) -> Stream {
        self.index(device).map_or(Stream::NULL, |index| self.default_streams[index])
    }

    fn create_stream(&self, device: i32) -> Result<Stream> {
        self.check_device(device)?;
        register_stream(format!("refit-host-dev{device}"), Owner::Device(device))
    }

    fn destroy_stream(&self, device: i32, stream: Stream) {
        let _ = unregister_stream(stream, Owner::Device(device));
    }

    fn create_event(&self, device: i32) -> Result<Event> {
        self.check_device(device)?;
        let mut events = lock(&registry().events);
        Ok(Event(insert_new(&mut events, HostEvent::new())))
    }

    fn destroy_event(&self, _device: i32, event: Event) {
        lock(&registry().events).remove(&event.0);
    }

    fn record(&self, device: i32, event: Event, stream: Stream) -> Result<()> {
        host_event(event)?.record_on(&*self.resolve(device, stream)?)
    }

    fn wait(&self, device: i32, stream: Stream, event: Event) -> Result<()> {
        let event = host_event(event)?;
        let ticket = event.latest_record();
        self.resolve(device, stream)?.enqueue(move || event.wait_for(ticket))
    }

    fn sync_event(&self, _device: i32, event: Event) -> Result<()> {
        host_event(event)?.synchronize();
        Ok(())
    }

    fn sync_stream(&self, device: i32, stream: Stream) -> Result<()> {
        self.resolve(device, stream)?.synchronize()
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> Result<bool> {
        self.check_device(device)?;
        self.check_device(peer)?;
        Ok(true)
    }

    fn enable_peer_access(&self, device: i32, peer: i32) -> Result<()> {
        self.check_device(device)?;
        self.check_device(peer)
    }

    unsafe fn copy_segments(&self, device: i32, stream: Stream, segments: &[Segment]) -> Result<()> {
        let stream = self.resolve(device, stream)?;
        validate(segments)?;
        let segments = try_to_vec(segments, "the queued batch's segments")?;
        // SAFETY: the caller promises the memory stays valid until the queued work has run.
        stream.enqueue(move || unsafe { copy_runs(&segments) })
    }

    unsafe fn copy_batch(
        &self,
        device: i32,
        stream: Stream,
        segments: &[Segment],
        checked: bool,
    ) -> Result<()> {
        let prepared = self.prepare_batch(device, segments, checked)?;
        prepared.launch(stream)
    }

    fn prepare_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
    ) -> Result<Box<dyn PreparedCopy>> {
        Ok(Box::new(self.host_batch(device, segments, checked, false)?))
    }

    fn prepare_recording_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
    ) -> Result<Box<dyn PreparedCopy>> {
        Ok(Box::new(self.host_batch(device, segments, checked, true)?))
    }

    fn prepare_compare(&self, device: i32, segments: &[Segment]) -> Result<Box<dyn PreparedCheck>> {
        Ok(Box::new(self.host_check(device, segments, Reference::Sources)?))
    }

    fn prepare_digest_record(&self, device: i32, segments: &[Segment]) -> Result<Box<dyn PreparedRecord>> {
        let (default_stream, segments) = self.prepared_segments(device, segments)?;
        Ok(Box::new(HostRecord { default_stream, segments, digests: Arc::new(Mutex::new(None)) }))
    }

    fn prepare_digest_check(
        &self,
        device: i32,
        segments: &[Segment],
    ) -> Result<Box<dyn PreparedDigestCheck>> {
        let recorded = Reference::Recorded(Arc::new(Mutex::new(Vec::new())));
        Ok(Box::new(self.host_check(device, segments, recorded)?))
    }

    unsafe fn digest(&self, device: i32, stream: Stream, addr: u64, len: u64) -> Result<u64> {
        let queue = self.resolve(device, stream)?;
        check_range(addr, len)?;
        if len > isize::MAX as u64 {
            return Err(Error::invalid_argument(format!("{len} bytes do not fit in host memory")));
        }
        let result = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&result);
        queue.enqueue(move || {
            // SAFETY: the caller keeps the range readable until the call returns, which waits for
            // this work below.
            let bytes = match len {
                0 => &[][..],
                _ => unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) },
            };
            *lock(&slot) = Some(gf64::digest(bytes));
        })?;
        queue.synchronize()?;
        let value = lock(&result).take();
        value.ok_or_else(|| Error::invalid_state("the host stream stopped before it ran the digest"))
    }

    unsafe fn digest_many(&self, device: i32, stream: Stream, ranges: &[ByteRange]) -> Result<Vec<u64>> {
        let queue = self.resolve(device, stream)?;
        check_ranges(ranges)?;
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let ranges = ranges.to_vec();
        let result = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&result);
        queue.enqueue(move || {
            let digests = ranges
                .iter()
                .map(|range| match range.len {
                    0 => gf64::digest(&[]),
                    // SAFETY: the caller keeps every range readable until the call returns, which
                    // waits for this work below; check_ranges bounds each length by 2^60 < isize::MAX.
                    len => gf64::digest(unsafe {
                        std::slice::from_raw_parts(range.addr as usize as *const u8, len as usize)
                    }),
                })
                .collect();
            *lock(&slot) = Some(digests);
        })?;
        queue.synchronize()?;
        let digests = lock(&result).take();
        digests.ok_or_else(|| Error::invalid_state("the host stream stopped before it ran the digests"))
    }

    unsafe fn quantize_batch(
        &self,
        device: i32,
        stream: Stream,
        jobs: &[crate::quant::QuantJob],
    ) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.prepare_quantize(device, jobs)?.launch(stream) }
    }

    fn prepare_quantize(
        &self,
        device: i32,
        jobs: &[crate::quant::QuantJob],
    ) -> Result<Box<dyn PreparedQuantize>> {
        let default_stream = self.default_streams[self.index(device)?];
        crate::quant::check_jobs(jobs)?;
        Ok(Box::new(HostQuantize { default_stream, jobs: Arc::new(jobs.to_vec()), seed: Mutex::default() }))
    }

    fn alloc(&self, device: i32, bytes: usize) -> Result<u64> {
        self.check_device(device)?;
        // SAFETY: plain allocation; at least one byte so that the pointer is unique and freeable.
        let ptr = unsafe { libc::calloc(bytes.max(1), 1) };
        if ptr.is_null() {
            return Err(Error::new(Status::OutOfMemory, format!("cannot allocate {bytes} host bytes")));
        }
        Ok(ptr as usize as u64)
    }

    unsafe fn free(&self, device: i32, ptr: u64) -> Result<()> {
        self.check_device(device)?;
        libc::free(ptr as usize as *mut libc::c_void);
        Ok(())
    }

    unsafe fn write(&self, device: i32, dst: u64, data: &[u8]) -> Result<()> {
        self.sync_stream(device, Stream::NULL)?;
        std::ptr::copy(data.as_ptr(), dst as usize as *mut u8, data.len());
        Ok(())
    }

    unsafe fn read(&self, device: i32, src: u64, out: &mut [u8]) -> Result<()> {
        self.sync_stream(device, Stream::NULL)?;
        std::ptr::copy(src as usize as *const u8, out.as_mut_ptr(), out.len());
        Ok(())
    }
}

impl HostBackend {
    /// What every prepared form keeps: the stream a NULL stream stands for on `device`, and its own
    /// copy of the validated `segments`, shared with the work it queues.
    fn prepared_segments(&self, device: i32, segments: &[Segment]) -> Result<(Stream, Arc<Vec<Segment>>)> {
        let index = self.index(device)?;
        validate(segments)?;
        Ok((self.default_streams[index], Arc::new(try_to_vec(segments, "the prepared segments")?)))
    }

    fn host_batch(
        &self,
        device: i32,
        segments: &[Segment],
        checked: bool,
        recording: bool,
    ) -> Result<HostBatch> {
        let (default_stream, segments) = self.prepared_segments(device, segments)?;
        if checked {
            check_destinations(&segments)?;
        }
        let source_digests = recording.then(|| Arc::new(Mutex::new(Vec::new())));
        Ok(HostBatch { default_stream, segments, source_digests })
    }

    fn host_check(&self, device: i32, segments: &[Segment], reference: Reference) -> Result<HostCheck> {
        let (default_stream, segments) = self.prepared_segments(device, segments)?;
        Ok(HostCheck { default_stream, segments, reference, result: Arc::new(Mutex::new(None)) })
    }
}

/// A host backend's prepared batch: the checked list, copied by the stream's worker at each launch.
struct HostBatch {
    /// What a NULL stream stands for: the prepared device's default stream.
    default_stream: Stream,
    segments: Arc<Vec<Segment>>,
    /// For a recording batch: one digest per segment of the source bytes the last launch read.
    source_digests: Option<Arc<Mutex<Vec<u64>>>>,
}

impl PreparedCopy for HostBatch {
    /// Queued on the stream like any other host-backend work, then waited for: complete on return, as
    /// every host-backend copy the C API offers.
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let stream = if stream == Stream::NULL {
            // A batch may outlive its group, but the simulated device's default stream does not.
            host_stream(self.default_stream).map_err(|_| {
                Error::invalid_argument(
                    "stream is NULL, and the default stream of the batch's simulated device was released \
                     with its group: pass a host stream",
                )
            })?
        } else {
            stream_for(self.default_stream, stream)?
        };
        let segments = Arc::clone(&self.segments);
        let record = self.source_digests.clone();
        // SAFETY: the caller promises the memory stays valid until the queued work has run.
        stream.enqueue(move || unsafe {
            if let Some(record) = record {
                // Digests of what this copy reads, taken just before it reads it.
                let digests = segments.iter().map(|s| segment_digest(s, Side::Source)).collect();
                *lock(&record) = digests;
            }
            copy_runs(&segments)
        })?;
        stream.synchronize()
    }

    fn verify_destinations(&self) -> Result<Box<dyn PreparedCheck>> {
        let recorded = self.source_digests.as_ref().ok_or_else(|| {
            Error::invalid_argument(
                "the batch does not record source digests (prepare it with prepare_recording_batch)",
            )
        })?;
        Ok(Box::new(HostCheck {
            default_stream: self.default_stream,
            segments: Arc::clone(&self.segments),
            reference: Reference::Recorded(Arc::clone(recorded)),
            result: Arc::new(Mutex::new(None)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    #[test]
    fn stream_runs_work_later_and_in_order() {
        let stream = create_host_stream().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..5 {
            let log = Arc::clone(&log);
            host_stream(stream)
                .unwrap()
                .enqueue(move || {
                    std::thread::sleep(Duration::from_millis(2));
                    log.lock().unwrap().push(i)
                })
                .unwrap();
        }
        // Queued work has not all run yet: the worker sleeps.
        assert!(log.lock().unwrap().len() < 5);
        host_stream(stream).unwrap().synchronize().unwrap();
        assert_eq!(*log.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        destroy_host_stream(stream).unwrap();
        assert_eq!(destroy_host_stream(stream).unwrap_err().status, Status::InvalidArgument);
    }

    #[test]
    fn event_wait_orders_one_stream_after_another() {
        let backend = HostBackend::new(2).unwrap();
        let slow = backend.create_stream(0).unwrap();
        let fast = backend.create_stream(1).unwrap();
        let event = backend.create_event(0).unwrap();
        let value = Arc::new(AtomicU64::new(0));
        let v = Arc::clone(&value);
        host_stream(slow)
            .unwrap()
            .enqueue(move || {
                std::thread::sleep(Duration::from_millis(30));
                v.store(7, Ordering::SeqCst)
            })
            .unwrap();
        backend.record(0, event, slow).unwrap();
        backend.wait(1, fast, event).unwrap();
        let seen = Arc::new(AtomicU64::new(99));
        let (v, s) = (Arc::clone(&value), Arc::clone(&seen));
        host_stream(fast)
            .unwrap()
            .enqueue(move || s.store(v.load(Ordering::SeqCst), Ordering::SeqCst))
            .unwrap();
        backend.sync_stream(1, fast).unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 7, "the wait let the fast stream run before the event");
        backend.destroy_event(0, event);
        backend.destroy_stream(0, slow);
        backend.destroy_stream(1, fast);
    }

    #[test]
    fn only_caller_streams_can_be_destroyed_by_the_caller() {
        let backend = HostBackend::new(2).unwrap();
        let internal = [backend.null_stream(0), backend.null_stream(1), backend.create_stream(1).unwrap()];
        let mine = create_host_stream().unwrap();
        for stream in internal {
            let err = destroy_host_stream(stream).unwrap_err();
            assert_eq!(err.status, Status::InvalidArgument);
            assert!(err.message.contains("belongs to a group"), "{}", err.message);
        }
        // Values near a real handle, and the small sequential values handles used to be, name nothing.
        let guesses =
            (0..4096u64).map(|i| 0x1000 + 16 * i).chain((1..=64).flat_map(|d| [mine.0 + d, mine.0 - d]));
        for guess in guesses {
            assert!(destroy_host_stream(Stream(guess)).is_err(), "{guess:#x} was destroyed");
        }
        // Every internal stream still runs work.
        for (device, stream) in [(0, internal[0]), (1, internal[1]), (1, internal[2])] {
            let ran = Arc::new(AtomicU64::new(0));
            let r = Arc::clone(&ran);
            host_stream(stream).unwrap().enqueue(move || r.store(1, Ordering::SeqCst)).unwrap();
            backend.sync_stream(device, stream).unwrap();
            assert_eq!(ran.load(Ordering::SeqCst), 1);
        }
        destroy_host_stream(mine).unwrap();
        backend.destroy_stream(1, internal[2]);
        assert!(host_stream(internal[2]).is_err(), "the backend destroys its own streams");
    }

    #[test]
    fn a_device_stream_serves_only_its_device_and_a_caller_stream_any() {
        let backend = HostBackend::new(2).unwrap();
        let (of_one, default_of_one, mine) =
            (backend.create_stream(1).unwrap(), backend.null_stream(1), create_host_stream().unwrap());
        let (from, mut to) = ([7u8; 64], [0u8; 64]);
        let segment =
            |to: &mut [u8; 64]| Segment::contiguous(from.as_ptr() as u64, to.as_mut_ptr() as u64, 64);
        for stream in [of_one, default_of_one] {
            // SAFETY: both buffers outlive the calls, which are refused before queuing anything.
            let err = unsafe { backend.copy_segments(0, stream, &[segment(&mut to)]) }.unwrap_err();
            assert_eq!(err.status, Status::InvalidArgument);
            assert!(
                err.message.contains("a stream of simulated device 1, and this work is on device 0"),
                "{}",
                err.message
            );
            assert_eq!(backend.sync_stream(0, stream).unwrap_err().status, Status::InvalidArgument);
        }
        assert_eq!(to, [0u8; 64]);
        for (device, stream) in [(1, of_one), (1, default_of_one), (0, mine), (1, mine)] {
            to = [0u8; 64];
            // SAFETY: as above; the copy is complete once the stream is synchronized.
            unsafe { backend.copy_segments(device, stream, &[segment(&mut to)]) }.unwrap();
            backend.sync_stream(device, stream).unwrap();
            assert_eq!(to, from);
        }
        destroy_host_stream(mine).unwrap();
        backend.destroy_stream(1, of_one);
    }

    #[test]
    fn bad_devices_and_handles_are_errors() {
        let backend = HostBackend::new(1).unwrap();
        assert_eq!(backend.create_stream(1).unwrap_err().status, Status::InvalidDevice);
        assert_eq!(backend.record(0, Event(3), Stream::NULL).unwrap_err().status, Status::InvalidArgument);
        assert_eq!(HostBackend::new(0).err().unwrap().status, Status::InvalidArgument);
    }
}
