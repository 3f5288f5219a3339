//! The NCCL link: one NCCL communicator per rank, created nonblocking so that no NCCL call blocks the
//! host, and watched so that no wait for peers outlasts the timeout.
//!
//! - Creation: `ncclCommInitRankConfig` with `blocking = 0` returns at once; we poll
//!   `ncclCommGetAsyncError` until the communicator is ready, and abort it at the timeout.
//! - Each call: issued under the communicator's lock, then settled (polled until NCCL has queued it:
//!   a nonblocking communicator reports ncclInProgress while it connects to peers), then an event is
//!   recorded after it on the caller's stream.
//! - The watchdog (one thread per communicator) polls the asynchronous error and those events. An
//!   error, or a call whose event has not completed within the timeout of being queued, aborts the
//!   communicator: `ncclCommAbort` for one we created (its kernels then exit, so the streams move on),
//!   `ncclCommRevoke` for an adopted one (which its owner must then destroy; refit never frees what it
//!   adopted). The failure is kept and returned by every later call.
//! - Host bytes (plan tables, handles) cross through a device staging buffer and an internal stream.

use super::super::driver::{check, primary_context, CurrentContext};
use super::super::mesh::{Deadline, Message};
use super::super::nccl::{nccl, Nccl, NcclComm, NcclConfig, NcclUniqueId, NCCL_IN_PROGRESS};
use super::super::Stream;
use super::{lengths_then_bytes, Health};
use crate::bail;
use crate::error::{Error, Result, Status};
use crate::segment::Segment;
use crate::sync::{lock, wait_timeout};
use cudarc::driver::sys::{self, CUresult};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The communicator handle: NULL once aborted (owned), revoked once stopped (adopted).
struct Slot {
    raw: NcclComm,
    revoked: bool,
}

/// A call queued on a stream, with the event recorded after it.
struct Pending {
    event: sys::CUevent,
    queued: Instant,
}

/// What the link, its calls and its watchdog share.
struct Shared {
    slot: Mutex<Slot>,
    pending: Mutex<VecDeque<Pending>>,
    /// Whether this process created the communicator (and so may abort and destroy it).
    owned: bool,
    context: usize,
    timeout: Duration,
    health: Health,
    stop: Mutex<bool>,
    wake: Condvar,
}

// SAFETY: the raw handles (communicator, context, events) are process-wide driver and NCCL objects;
// every use of the communicator goes through `slot`'s lock.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// Device staging for host bytes, with the internal stream that moves them.
struct Staging {
    stream: sys::CUstream,
    buffer: sys::CUdeviceptr,
    capacity: usize,
}

pub(super) struct NcclLink {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
    staging: Mutex<Option<Staging>>,
}

// SAFETY: as for Shared; Staging's stream and buffer are used under its lock only.
unsafe impl Send for NcclLink {}
unsafe impl Sync for NcclLink {}

/// Sleeps between polls: short at first (a call usually settles within microseconds), then longer.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Backoff {
        Backoff(Duration::from_micros(20))
    }

    fn pause(&mut self, deadline: &Deadline) {
        std::thread::sleep(self.0.min(deadline.remaining()));
        self.0 = (self.0 * 2).min(Duration::from_millis(2));
    }
}

impl NcclLink {
    pub fn create(
        id: NcclUniqueId,
        rank: usize,
        size: usize,
        device: i32,
        timeout: Duration,
    ) -> Result<NcclLink> {
        let lib = nccl()?;
        let context = primary_context(device)?;
        // SAFETY: a retained primary context; NCCL takes the current device from it.
        let _current = unsafe { CurrentContext::enter(context) }?;
        let deadline = Deadline::after(timeout);
        let raw = lib.comm_init_rank_config(size, id, rank, &mut NcclConfig::nonblocking())?;
        // SAFETY: the communicator NCCL just returned.
        if let Err(err) = unsafe { settle(lib, raw, &deadline, "ranks joining the communicator") } {
            // SAFETY: ours, used no more.
            if let Err(abort) = unsafe { lib.comm_abort(raw) } {
                log::warn!("{abort}");
            }
            return Err(err);
        }
        Ok(NcclLink::start(raw, true, context as usize, timeout))
    }

    /// # Safety
    /// `raw` is a live communicator that outlives the link.
    pub unsafe fn adopt(raw: NcclComm, device: i32, timeout: Duration) -> Result<NcclLink> {
        let context = primary_context(device)?;
        Ok(NcclLink::start(raw, false, context as usize, timeout))
    }

    fn start(raw: NcclComm, owned: bool, context: usize, timeout: Duration) -> NcclLink {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot { raw, revoked: false }),
            pending: Mutex::new(VecDeque::new()),
            owned,
            context,
            timeout,
            health: Health::default(),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let watched = Arc::clone(&shared);
        let watchdog = std::thread::Builder::new()
            .name("refit-comm-watchdog".into())
            .spawn(move || watch(&watched))
            .map_err(|e| log::warn!("no watchdog thread ({e}): calls are bounded only when synchronized"))
            .ok();
        NcclLink { shared, watchdog, staging: Mutex::new(None) }
    }

    pub fn health(&self) -> &Health {
        &self.shared.health
    }

    pub fn abort(&self, why: Error) {
        let mut slot = self.shared.lock_slot();
        self.shared.stop_communicator(&mut slot, why);
    }

    /// Issues `calls` on the communicator under its lock, settles them and records an event after
    /// them on `stream` for the watchdog. A failure aborts the communicator.
    fn issue(&self, stream: Stream, calls: impl FnOnce(&Nccl, NcclComm) -> Result<()>) -> Result<()> {
        let shared = &self.shared;
        shared.health.check()?;
        let mut slot = shared.lock_slot();
        let raw = shared.live(&slot)?;
        let lib = nccl()?;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(shared.context as sys::CUcontext) }?;
        let deadline = Deadline::after(shared.timeout);
        // SAFETY: a live communicator, under its lock.
        let done = calls(lib, raw)
            .and_then(|()| unsafe { settle(lib, raw, &deadline, "peers taking part in a call") });
        let recorded = done.and_then(|()| record(stream));
        match recorded {
            Ok(event) => {
                lock(&shared.pending).push_back(Pending { event, queued: Instant::now() });
                shared.wake.notify_all();
                Ok(())
            }
            Err(err) => Err(shared.stop_communicator(&mut slot, err)),
        }
    }

    /// # Safety
    /// As for `Communicator::transfer`.
    pub unsafe fn transfer(
        &self,
        sends: &[Message],
        recvs: &[Message],
        local: &[Segment],
        stream: Stream,
    ) -> Result<()> {
        let cu_stream = stream.0 as usize as sys::CUstream;
        self.issue(stream, |lib, comm| {
            for copy in local.iter().filter(|s| s.len > 0) {
                // SAFETY: the caller's device memory, on its stream.
                check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(copy.dst, copy.src, copy.len as usize, cu_stream)
                })?;
            }
            lib.group_start()?;
            let issued = (|| {
                for m in sends.iter().filter(|m| m.len > 0) {
                    // SAFETY: the caller's device memory, on its stream.
                    unsafe { lib.send(m.addr, m.len as usize, m.peer, comm, stream.0) }?;
                }
                for m in recvs.iter().filter(|m| m.len > 0) {
                    // SAFETY: as above.
                    unsafe { lib.recv(m.addr, m.len as usize, m.peer, comm, stream.0) }?;
                }
                Ok(())
            })();
            let ended = lib.group_end();
            issued.and(ended)
        })
    }

    /// # Safety
    /// As for `Communicator::all_gather`.
    pub unsafe fn all_gather(&self, send: u64, recv: u64, bytes: u64, stream: Stream) -> Result<()> {
        if bytes == 0 {
            return self.shared.health.check();
        }
        // SAFETY: the caller's device memory, on its stream.
        self.issue(stream, |lib, comm| unsafe { lib.all_gather(send, recv, bytes as usize, comm, stream.0) })
    }

    /// Waits for `stream` by polling an event recorded on it; ends early when the communicator fails.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        self.shared.health.check()?;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.shared.context as sys::CUcontext) }?;
        let event = record(stream)?;
        let waited = self.wait_event(event);
        // SAFETY: ours; the driver releases it once it has completed.
        unsafe { sys::cuEventDestroy_v2(event) };
        waited.and_then(|()| self.shared.health.check())
    }

    /// Polls `event` until it completes or the communicator fails (the watchdog bounds every call of
    /// ours, so this ends within the timeout of the last one).
    fn wait_event(&self, event: sys::CUevent) -> Result<()> {
        let mut backoff = Backoff::new();
        let forever = Deadline::after(Duration::from_secs(u32::MAX.into()));
        loop {
            // SAFETY: a live event.
            match unsafe { sys::cuEventQuery(event) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                other => return check("cuEventQuery", other),
            }
            self.shared.health.check()?;
            backoff.pause(&forever);
        }
    }

    pub fn allgather_bytes(&self, mine: &[u8], rank: usize, size: usize) -> Result<Vec<Vec<u8>>> {
        self.shared.health.check()?;
        let mut staging = lock(&self.staging);
        lengths_then_bytes(rank, size, mine, |sends, recvs, _tag| self.host_step(&mut staging, sends, recvs))
    }

    /// One grouped step over host buffers: staged to the device, sent and received on the internal
    /// stream, waited for, and copied back.
    fn host_step(&self, staging: &mut Option<Staging>, sends: &[Message], recvs: &[Message]) -> Result<()> {
        // Every send of one step carries the same bytes (this rank's block): stage them once.
        let send_len = sends.first().map_or(0, |m| m.len as usize);
        let needed = send_len + recvs.iter().map(|m| m.len as usize).sum::<usize>();
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.shared.context as sys::CUcontext) }?;
        let staged = self.staging_for(staging, needed)?;
        let stream = Stream(staged.stream as usize as u64);
        if send_len > 0 {
            // SAFETY: the host block is readable for its length; the staging buffer holds `needed`.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    staged.buffer,
                    sends[0].addr as usize as *const _,
                    send_len,
                    staged.stream,
                )
            })?;
        }
        let mut at = staged.buffer + send_len as u64;
        let mut device_recvs = Vec::with_capacity(recvs.len());
        for m in recvs {
            device_recvs.push(Message { peer: m.peer, addr: at, len: m.len });
            at += m.len;
        }
        let device_sends: Vec<Message> =
            sends.iter().map(|m| Message { addr: staged.buffer, ..*m }).collect();
        // SAFETY: staging memory of this device, on the internal stream.
        unsafe { self.transfer(&device_sends, &device_recvs, &[], stream) }?;
        self.synchronize(stream)?;
        for (host, device) in recvs.iter().zip(&device_recvs).filter(|(m, _)| m.len > 0) {
            // SAFETY: the host buffer is writable for its length; the stream is idle.
            check("cuMemcpyDtoH", unsafe {
                sys::cuMemcpyDtoH_v2(host.addr as usize as *mut _, device.addr, host.len as usize)
            })?;
        }
        Ok(())
    }

    /// The staging buffer, grown to at least `bytes` (and the internal stream, made on first use).
    fn staging_for<'a>(&self, staging: &'a mut Option<Staging>, bytes: usize) -> Result<&'a Staging> {
        if staging.is_none() {
            let mut stream = std::ptr::null_mut();
            // SAFETY: valid output slot; the link's context is current.
            check("cuStreamCreate", unsafe {
                sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            })?;
            *staging = Some(Staging { stream, buffer: 0, capacity: 0 });
        }
        let staged = staging.as_mut().expect("made above");
        if staged.capacity < bytes.max(1) {
            if staged.buffer != 0 {
                // SAFETY: the stream is idle (every host step waits for it); ours.
                unsafe { sys::cuMemFree_v2(staged.buffer) };
                staged.buffer = 0;
                staged.capacity = 0;
            }
            let capacity = bytes.max(1).next_power_of_two();
            // SAFETY: valid output slot; the link's context is current.
            check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut staged.buffer, capacity) })?;
            staged.capacity = capacity;
        }
        Ok(staged)
    }
}

impl Shared {
    fn lock_slot(&self) -> MutexGuard<'_, Slot> {
        lock(&self.slot)
    }

    /// The communicator, unless it was stopped (then the kept failure).
    fn live(&self, slot: &Slot) -> Result<NcclComm> {
        if slot.raw.is_null() || slot.revoked {
            self.health.check()?;
            bail!(Status::Aborted, "the communicator was aborted");
        }
        Ok(slot.raw)
    }

    /// Keeps `why` as the failure and stops the communicator's work: abort (ours) or revoke (adopted).
    /// Returns the kept failure.
    fn stop_communicator(&self, slot: &mut Slot, why: Error) -> Error {
        let kept = self.health.fail(why);
        let Ok(lib) = nccl() else { return kept };
        if slot.raw.is_null() || slot.revoked {
            return kept;
        }
        // SAFETY: a retained primary context; the communicator is live and we hold its lock.
        let _current = unsafe { CurrentContext::enter(self.context as sys::CUcontext) };
        if self.owned {
            // SAFETY: ours, and NULL from now on.
            if let Err(err) = unsafe { lib.comm_abort(slot.raw) } {
                log::warn!("{err}");
            }
            slot.raw = std::ptr::null_mut();
        } else {
            // SAFETY: live; its owner destroys it.
            match unsafe { lib.comm_revoke(slot.raw) } {
                Some(Ok(())) => {}
                Some(Err(err)) => log::warn!("{err}"),
                None => log::warn!(
                    "NCCL {} has no ncclCommRevoke: the adopted communicator's pending work was not stopped; \
                     abort it (ncclCommAbort) before waiting on its streams",
                    lib.version()
                ),
            }
            slot.revoked = true;
        }
        self.drop_pending();
        kept
    }

    fn drop_pending(&self) {
        for pending in lock(&self.pending).drain(..) {
            // SAFETY: ours; the driver releases it once it has completed.
            unsafe { sys::cuEventDestroy_v2(pending.event) };
        }
    }

    /// One round of the watchdog: the asynchronous error, then the oldest pending calls.
    fn inspect(&self) {
        let mut slot = self.lock_slot();
        let Ok(raw) = self.live(&slot) else { return };
        let Ok(lib) = nccl() else { return };
        // SAFETY: live, under its lock.
        let state = unsafe { lib.comm_get_async_error(raw) };
        let failure = match state {
            Ok(0) | Ok(NCCL_IN_PROGRESS) => self.overdue(),
            // SAFETY: as above.
            Ok(code) => Some(async_error(lib, raw, code)),
            Err(err) => Some(err),
        };
        if let Some(why) = failure {
            self.stop_communicator(&mut slot, why);
        }
    }

    /// Drops the completed pending calls; a TIMEOUT error when the oldest one left is overdue.
    fn overdue(&self) -> Option<Error> {
        let mut pending = lock(&self.pending);
        while let Some(front) = pending.front() {
            // SAFETY: a live event of ours.
            match unsafe { sys::cuEventQuery(front.event) } {
                CUresult::CUDA_SUCCESS => {
                    // SAFETY: completed and ours.
                    unsafe { sys::cuEventDestroy_v2(front.event) };
                    pending.pop_front();
                }
                CUresult::CUDA_ERROR_NOT_READY => break,
                other => return check("cuEventQuery (a communicator call)", other).err(),
            }
        }
        let front = pending.front()?;
        let waited = front.queued.elapsed();
        (waited > self.timeout).then(|| {
            Error::new(
                Status::Timeout,
                format!(
                    "a communicator call queued {waited:?} ago has not completed within the timeout ({:?}): \
                     a peer did not take part",
                    self.timeout
                ),
            )
        })
    }
}

/// The watchdog thread's loop: inspect often while calls are pending, rarely otherwise.
fn watch(shared: &Shared) {
    // SAFETY: a retained primary context, current on this thread for its whole life.
    if let Err(err) =
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(shared.context as sys::CUcontext) })
    {
        log::warn!("watchdog: {err}");
    }
    loop {
        let busy = !lock(&shared.pending).is_empty();
        let pause = if busy { Duration::from_millis(1) } else { Duration::from_millis(50) };
        let stop = lock(&shared.stop);
        let (stop, _) = wait_timeout(&shared.wake, stop, pause);
        if *stop {
            return;
        }
        drop(stop);
        shared.inspect();
    }
}

/// Polls a nonblocking communicator until its last call (or creation) is no longer in progress.
///
/// # Safety
/// `raw` is a live communicator.
unsafe fn settle(lib: &Nccl, raw: NcclComm, deadline: &Deadline, what: &str) -> Result<()> {
    let mut backoff = Backoff::new();
    loop {
        match lib.comm_get_async_error(raw)? {
            0 => return Ok(()),
            NCCL_IN_PROGRESS if deadline.expired() => {
                return Err(deadline.error(format_args!("{what} did not finish")))
            }
            NCCL_IN_PROGRESS => backoff.pause(deadline),
            code => return Err(async_error(lib, raw, code)),
        }
    }
}

/// The error for an asynchronous ncclResult_t, with NCCL's last message when it has one.
fn async_error(lib: &Nccl, raw: NcclComm, code: i32) -> Error {
    // SAFETY: live communicator.
    let detail = unsafe { lib.last_error(raw) }.map(|t| format!(": {t}")).unwrap_or_default();
    // ncclRemoteError: a peer failed or went away.
    let status = if code == 6 { Status::Aborted } else { Status::NcclError };
    Error::new(status, format!("the communicator reported {}{detail}", lib.error_string(code)))
}

/// A new event recorded on `stream` (the caller has the device's context current).
fn record(stream: Stream) -> Result<sys::CUevent> {
    let mut event = std::ptr::null_mut();
    // SAFETY: valid output slot in the current context.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    })?;
    // SAFETY: a live event and the caller's stream of this device.
    let recorded =
        check("cuEventRecord", unsafe { sys::cuEventRecord(event, stream.0 as usize as sys::CUstream) });
    if let Err(err) = recorded {
        // SAFETY: ours.
        unsafe { sys::cuEventDestroy_v2(event) };
        return Err(err);
    }
    Ok(event)
}

impl Drop for NcclLink {
    fn drop(&mut self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        let shared = &self.shared;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(shared.context as sys::CUcontext) };
        let mut slot = shared.lock_slot();
        if shared.owned && !slot.raw.is_null() {
            close_owned(shared, &mut slot);
        }
        shared.drop_pending();
        if let Some(staging) = lock(&self.staging).take() {
            // SAFETY: ours; the communicator is gone, so nothing uses them any more.
            unsafe {
                if staging.buffer != 0 {
                    sys::cuMemFree_v2(staging.buffer);
                }
                sys::cuStreamDestroy_v2(staging.stream);
            }
        }
    }
}

/// Ends a communicator we created: once its calls have completed (within the timeout), finalize and
/// destroy it; if they do not, or anything fails, abort it instead, so that closing never hangs.
fn close_owned(shared: &Shared, slot: &mut Slot) {
    let Ok(lib) = nccl() else { return };
    let deadline = Deadline::after(shared.timeout);
    let mut backoff = Backoff::new();
    let quiet = loop {
        match shared.overdue() {
            Some(_) => break false,
            None if lock(&shared.pending).is_empty() => break true,
            None if deadline.expired() => break false,
            None => backoff.pause(&deadline),
        }
    };
    // SAFETY: ours, under its lock; after either branch the handle is used no more.
    let closed = quiet
        && !shared.health.failed()
        && unsafe {
            let finalized = match lib.comm_finalize(slot.raw) {
                Some(started) => {
                    started.and_then(|()| settle(lib, slot.raw, &deadline, "finalizing the communicator"))
                }
                None => Ok(()),
            };
            finalized.and_then(|()| lib.comm_destroy(slot.raw)).map_err(|e| log::warn!("{e}")).is_ok()
        };
    if !closed {
        // SAFETY: ours, used no more.
        if let Err(err) = unsafe { lib.comm_abort(slot.raw) } {
            log::warn!("{err}");
        }
    }
    slot.raw = std::ptr::null_mut();
}
