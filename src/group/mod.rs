//! The device group: rank r is a device, with one non-blocking stream created once and reused by
//! every call; scopes that order the group's streams after the caller's; and `run`, which calls a body
//! once per rank on persistent rank threads.
//!
//! Scope rules (also in the C header):
//! - `enter(caller_streams)` makes rank r's stream wait (an event, no host blocking) for the work queued
//!   so far on `caller_streams[r]` (NULL / `None`: the device's legacy default stream).
//! - `exit(Sync)` blocks until every rank's stream has drained; `exit(Async)` makes each caller stream
//!   wait for its rank's stream instead and returns at once.
//! - Scopes do not nest: `enter` while a scope is open is `InvalidState`, and so is `exit` without one.
//! - A whole-group call (allgather, run) made outside a scope opens an implicit one on the legacy
//!   default streams and closes it with `Sync`: it is complete when the call returns. Inside a scope
//!   it is only queued on the group's streams.
//! - A missing exit leaves the scope open: later calls keep queueing into it, and destroying the group
//!   drains its streams first (the caller's streams are then not ordered; a warning is logged).
//! - A call that leaves copies between ranks in flight may defer joining the ranks' streams to the
//!   next whole-group call, `run` or exit (`mark_pending_join` / `join_if_pending`).
//!
//! The group knows no collective and no plan: the layers above (allgather, exec) keep what they reuse
//! per group in its extension slot ([`Group::extension`]), and meet their ranks through its barrier
//! and rank threads.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

pub mod barrier;
mod spin;
pub mod workers;

use crate::bail;
use crate::error::{Error, Result, Status};
use crate::sync::{lock, read, write};
use crate::transport::cuda::cuda_backend;
use crate::transport::host::HostBackend;
use crate::transport::{Backend, BackendKind, Event, Stream};
use barrier::AbortableBarrier;
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use workers::{RankFn, RankWorkers};

/// Which backend a group should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when libcuda loads and has a device, else the host backend.
    Auto,
    Cuda,
    Host,
}

#[derive(Clone, Copy, Debug)]
pub struct GroupOptions {
    pub backend: BackendChoice,
    /// Devices the host backend simulates; 0 means "as many as the device list needs" (max + 1).
    pub host_devices: usize,
}

impl Default for GroupOptions {
    fn default() -> GroupOptions {
        GroupOptions { backend: BackendChoice::Auto, host_devices: 0 }
    }
}

/// How a scope ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitMode {
    /// Block the host until the group's work is done.
    Sync,
    /// Make each caller stream wait for the group's work; do not block the host.
    Async,
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

pub struct Group {
    id: u64,
    backend: Arc<dyn Backend>,
    devices: Vec<i32>,
    streams: Vec<Stream>,
    peer: Vec<Vec<bool>>,
    entry_events: Vec<Event>,
    exit_events: Vec<Event>,
    /// The caller streams of the open scope, or None.
    scope: Mutex<Option<Vec<Stream>>>,
    barrier: Arc<AbortableBarrier>,
    workers: Mutex<Option<RankWorkers>>,
    /// A call left copies between ranks with no wait queued on the other ranks' streams yet; the
    /// next group call, run() or exit joins them (see `join_if_pending`).
    pending_join: AtomicBool,
    /// Recorded on rank r's stream by a join, for the other ranks' streams to wait on.
    join_events: Vec<Event>,
    /// What the layers above keep per group, one value per type (see `extension`).
    extensions: RwLock<Vec<Arc<dyn Any + Send + Sync>>>,
    /// The thread driving a whole-group call now, and how deeply (see [`Group::drive`]).
    driver: Mutex<(Option<libc::pthread_t>, usize)>,
}

/// A whole-group call in progress on this thread (see [`Group::drive`]); ends when dropped.
pub struct Driving<'a> {
    group: &'a Group,
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        let mut driver = lock(&self.group.driver);
        driver.1 -= 1;
        if driver.1 == 0 {
            driver.0 = None;
        }
    }
}

/// The host backend runs a thread per simulated device: it simulates at most this many.
const MAX_HOST_DEVICES: usize = 64;

fn backend_for(devices: &[i32], options: &GroupOptions) -> Result<Arc<dyn Backend>> {
    let host = || -> Result<Arc<dyn Backend>> {
        if options.host_devices > MAX_HOST_DEVICES {
            bail!(
                Status::InvalidArgument,
                "host_devices = {} is above the {MAX_HOST_DEVICES} devices the host backend simulates",
                options.host_devices
            );
        }
        // Devices are checked non-negative before, so the highest is a valid index.
        let needed = devices.iter().map(|&d| usize::try_from(d).unwrap_or(0) + 1).max().unwrap_or(1);
        if options.host_devices == 0 && needed > MAX_HOST_DEVICES {
            bail!(
                Status::InvalidDevice,
                "device {} is not below the {MAX_HOST_DEVICES} devices the host backend simulates",
                needed - 1
            );
        }
        let count = if options.host_devices == 0 { needed } else { options.host_devices };
        Ok(Arc::new(HostBackend::new(count)?))
    };
    match options.backend {
        BackendChoice::Host => host(),
        BackendChoice::Cuda => Ok(cuda_backend()? as Arc<dyn Backend>),
        BackendChoice::Auto => match cuda_backend() {
            Ok(cuda) => Ok(cuda as Arc<dyn Backend>),
            Err(err) if err.status == Status::CudaUnavailable => {
                log::info!("no CUDA ({}); using the host backend", err.message);
                host()
            }
            Err(err) => Err(err),
        },
    }
}

impl Group {
    /// A group where rank r is `devices[r]`. Rejects an empty list (`EmptyDeviceList`), a device out
    /// of range (`InvalidDevice`) and a repeated device (`DuplicateDevice`). Enables peer access for
    /// every pair that supports it and creates each rank's stream and events.
    pub fn new(devices: &[i32], options: GroupOptions) -> Result<Group> {
        if devices.is_empty() {
            return Err(Error::new(Status::EmptyDeviceList, "the device list is empty"));
        }
        if let Some((i, &d)) = devices.iter().enumerate().find(|(_, &d)| d < 0) {
            bail!(Status::InvalidDevice, "devices[{i}] = {d} is negative");
        }
        let backend = backend_for(devices, &options)?;
        let count = backend.device_count();
        if let Some((i, &d)) =
            devices.iter().enumerate().find(|(_, &d)| usize::try_from(d).map_or(true, |d| d >= count))
        {
            bail!(
                Status::InvalidDevice,
                "devices[{i}] = {d} is not below the {count} devices of the backend"
            );
        }
        // After the range check, so that a repeat turns up within the first `count + 1` entries: the
        // search costs devices x count, however long the caller's list.
        for (i, &d) in devices.iter().enumerate() {
            if let Some(j) = devices[..i].iter().position(|&e| e == d) {
                bail!(Status::DuplicateDevice, "device {d} appears twice (devices[{j}] and devices[{i}])");
            }
        }
        let devices = crate::error::try_to_vec(devices, "the device list")?;
        let n = devices.len();

        let mut peer = vec![vec![false; n]; n];
        for a in 0..n {
            for b in 0..n {
                peer[a][b] = a == b || {
                    let can = backend.can_access_peer(devices[a], devices[b])?;
                    if can {
                        backend.enable_peer_access(devices[a], devices[b])?;
                    } else {
                        log::warn!(
                            "device {} cannot access device {} directly: copies between them are staged \
                             by the driver (slower)",
                            devices[a],
                            devices[b]
                        );
                    }
                    can
                };
            }
        }

        let mut group = Group {
            id: NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed),
            backend: Arc::clone(&backend),
            devices,
            streams: Vec::with_capacity(n),
            peer,
            entry_events: Vec::with_capacity(n),
            exit_events: Vec::with_capacity(n),
            scope: Mutex::new(None),
            barrier: Arc::new(AbortableBarrier::new(n)),
            workers: Mutex::new(None),
            pending_join: AtomicBool::new(false),
            join_events: Vec::with_capacity(n),
            extensions: RwLock::new(Vec::new()),
            driver: Mutex::new((None, 0)),
        };
        // Pushed one by one so that Drop releases exactly what was created if a step fails.
        for r in 0..n {
            let device = group.devices[r];
            group.streams.push(backend.create_stream(device)?);
            group.entry_events.push(backend.create_event(device)?);
            group.exit_events.push(backend.create_event(device)?);
            group.join_events.push(backend.create_event(device)?);
        }
        log::debug!("group {} on devices {:?} ({:?} backend)", group.id, group.devices, backend.kind());
        Ok(group)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn size(&self) -> usize {
        self.devices.len()
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }

    pub fn devices(&self) -> &[i32] {
        &self.devices
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.size() {
            bail!(Status::InvalidArgument, "rank {rank} is not below the group size {}", self.size());
        }
        Ok(())
    }

    /// The device of a rank.
    pub fn device(&self, rank: usize) -> Result<i32> {
        self.check_rank(rank)?;
        Ok(self.devices[rank])
    }

    /// The rank whose device is `device` (a group's devices are distinct, so there is at most one).
    pub fn rank_of(&self, device: i32) -> Result<usize> {
        self.devices.iter().position(|&d| d == device).ok_or_else(|| {
            Error::new(
                Status::InvalidArgument,
                format!("device {device} is not in the group (its devices are {:?})", self.devices),
            )
        })
    }

    /// The rank's stream: created with the group, the same for every call.
    pub fn stream(&self, rank: usize) -> Result<Stream> {
        self.check_rank(rank)?;
        Ok(self.streams[rank])
    }

    pub fn streams(&self) -> &[Stream] {
        &self.streams
    }

    /// Whether `rank` reaches `peer`'s memory directly (peer access on). Without it, copies still work
    /// through a slower path.
    pub fn peer_access(&self, rank: usize, peer: usize) -> Result<bool> {
        self.check_rank(rank)?;
        self.check_rank(peer)?;
        Ok(self.peer[rank][peer])
    }

    /// Whether every pair of ranks has direct peer access.
    pub fn all_peers_direct(&self) -> bool {
        self.peer.iter().all(|row| row.iter().all(|&p| p))
    }

    /// Marks a whole-group call (scopes, `run`, a collective, an executor's step) as driven by this
    /// thread until the guard drops; calls nest on one thread. `InvalidState`, doing nothing:
    /// - from a rank callback (of any group): it runs inside its group's call, on one of several
    ///   rank threads at once, so a whole-group call from there would reorder the streams under the
    ///   other ranks' feet (callbacks make per-rank calls: `allgather_rank`);
    /// - while another thread's whole-group call is in progress: a group is driven by one thread at
    ///   a time, and two calls would interleave their work on the same streams and barrier (and could
    ///   wait for each other forever).
    pub fn drive(&self) -> Result<Driving<'_>> {
        if workers::inside_any_run() {
            bail!(
                Status::InvalidState,
                "called from inside a rank callback: whole-group calls (scopes, run, allgather, an executor's \
                 run or commit) are made by the thread that drives the group; callbacks make per-rank calls"
            );
        }
        // pthread_self rather than thread::current(), which panics in a thread's exit destructors,
        // where C may still call in.
        // SAFETY: no preconditions.
        let me = unsafe { libc::pthread_self() };
        let mut driver = lock(&self.driver);
        if driver.0.is_some_and(|thread| thread != me) {
            bail!(
                Status::InvalidState,
                "the group is in use by a call on another thread; a group is driven by one thread at a time"
            );
        }
        *driver = (Some(me), driver.1 + 1);
        Ok(Driving { group: self })
    }

    /// Whether a scope is open.
    pub fn in_scope(&self) -> bool {
        lock(&self.scope).is_some()
    }

    /// Opens a scope: rank r's stream waits for the work queued so far on `caller_streams[r]` (all
    /// legacy default streams when None). `InvalidState` when a scope is already open, or when called
    /// from a rank callback (of any group): nothing is done then.
    pub fn enter(&self, caller_streams: Option<&[Stream]>) -> Result<()> {
        let _driving = self.drive()?;
        if let Some(streams) = caller_streams {
            if streams.len() != self.size() {
                bail!(
                    Status::InvalidArgument,
                    "{} caller streams given for a group of {}",
                    streams.len(),
                    self.size()
                );
            }
        }
        let mut scope = lock(&self.scope);
        if scope.is_some() {
            bail!(Status::InvalidState, "a scope is already open (scopes do not nest; exit it first)");
        }
        let callers: Vec<Stream> = match caller_streams {
            Some(streams) => streams.to_vec(),
            None => vec![Stream::NULL; self.size()],
        };
        for r in 0..self.size() {
            let device = self.devices[r];
            let caller =
                if callers[r] == Stream::NULL { self.backend.null_stream(device) } else { callers[r] };
            self.backend
                .record(device, self.entry_events[r], caller)
                .map_err(|e| e.context(format!("rank {r}")))?;
            self.backend.wait(device, self.streams[r], self.entry_events[r])?;
        }
        *scope = Some(callers);
        Ok(())
    }

    /// Closes the open scope. `InvalidState`, doing nothing, when none is open or when called from a
    /// rank callback (of any group). Once the scope is taken it is closed even when ordering the
    /// streams fails; that error is returned.
    pub fn exit(&self, mode: ExitMode) -> Result<()> {
        let _driving = self.drive()?;
        let callers = lock(&self.scope)
            .take()
            .ok_or_else(|| Error::invalid_state("no scope is open (exit without enter)"))?;
        match mode {
            ExitMode::Sync => self.synchronize(),
            ExitMode::Async => {
                self.join_if_pending()?;
                for r in 0..self.size() {
                    let device = self.devices[r];
                    let caller = if callers[r] == Stream::NULL {
                        self.backend.null_stream(device)
                    } else {
                        callers[r]
                    };
                    self.backend.record(device, self.exit_events[r], self.streams[r])?;
                    self.backend.wait(device, caller, self.exit_events[r])?;
                }
                Ok(())
            }
        }
    }

    /// Blocks until every rank's stream has drained.
    pub fn synchronize(&self) -> Result<()> {
        for (r, &stream) in self.streams.iter().enumerate() {
            self.backend.sync_stream(self.devices[r], stream).map_err(|e| e.context(format!("rank {r}")))?;
        }
        self.pending_join.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Records that the last call left copies between ranks to be joined (see `join_if_pending`): a
    /// whole-group call that writes into other ranks' memory (a reshard execution) defers its join.
    pub(crate) fn mark_pending_join(&self) {
        if self.size() > 1 {
            self.pending_join.store(true, Ordering::Relaxed);
        }
    }

    /// Makes every rank's stream wait for every other rank's stream, if a call left its copies
    /// between ranks unjoined. Deferring this join to the next group call (or the exit) keeps G
    /// records and G(G-1) cross-GPU waits out of every call in a loop of refits. Every whole-group
    /// call, `run` and an async exit call this before touching the streams.
    pub(crate) fn join_if_pending(&self) -> Result<()> {
        if !self.pending_join.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        for r in 0..self.size() {
            self.backend.record(self.devices[r], self.join_events[r], self.streams[r])?;
        }
        for r in 0..self.size() {
            for p in (0..self.size()).filter(|&p| p != r) {
                self.backend.wait(self.devices[r], self.streams[r], self.join_events[p])?;
            }
        }
        Ok(())
    }

    /// Runs `body` inside the open scope, or inside an implicit one (legacy default streams, `Sync`
    /// exit) when none is open.
    pub fn in_implicit_scope<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let _driving = self.drive()?;
        if self.in_scope() {
            return body();
        }
        self.enter(None)?;
        let result = body();
        let exited = self.exit(ExitMode::Sync);
        let value = result?;
        exited?;
        Ok(value)
    }

    /// Calls `body(rank, stream)` for every rank at once, each on its own persistent thread with its
    /// device current, inside the open scope (or an implicit one). Returns the first failing rank's
    /// error; the other ranks' collectives are released with `Aborted`. The group stays usable.
    /// `InvalidState` when called from inside a rank body.
    pub fn run(&self, body: &RankFn<'_>) -> Result<()> {
        self.in_implicit_scope(|| {
            // Callbacks may reuse any buffer on their stream: earlier collectives must be joined.
            self.join_if_pending()?;
            let workers = self.workers()?;
            workers.as_ref().expect("started by workers()").run(body)
        })
    }

    /// Calls `body(rank, stream)` once for every rank, at once where the rank threads can take
    /// their bodies right away, else on the calling thread (see `RankWorkers::fan_out`); returns the
    /// first error. For a whole-group call's per-rank launches: bodies that may run on any thread,
    /// switch to their device themselves, and never wait for each other. Every body runs, even
    /// when the rank threads cannot be started.
    pub(crate) fn fan_out(&self, body: &RankFn<'_>) -> Result<()> {
        match self.workers() {
            Ok(workers) => workers.as_ref().expect("started by workers()").fan_out(body),
            Err(err) => {
                log::warn!("rank threads unavailable, launching from the calling thread: {err}");
                let mut first_error = None;
                for rank in 0..self.size() {
                    if let Err(err) = body(rank, self.streams[rank]) {
                        first_error.get_or_insert(err);
                    }
                }
                first_error.map_or(Ok(()), Err)
            }
        }
    }

    /// The rank threads, started on first use.
    fn workers(&self) -> Result<std::sync::MutexGuard<'_, Option<RankWorkers>>> {
        let mut workers = lock(&self.workers);
        if workers.is_none() {
            *workers = Some(RankWorkers::start(
                self.id,
                Arc::clone(&self.backend),
                &self.devices,
                &self.streams,
                Arc::clone(&self.barrier),
            )?);
        }
        Ok(workers)
    }

    /// The rank the calling thread runs a body for, checked against `rank` (per-rank collectives).
    pub(crate) fn check_rank_thread(&self, rank: usize) -> Result<()> {
        self.check_rank(rank)?;
        match workers::current_rank(self.id) {
            Some(current) if current == rank => Ok(()),
            Some(current) => {
                bail!(Status::InvalidArgument, "rank {rank} called from rank {current}'s callback")
            }
            None => bail!(
                Status::InvalidState,
                "per-rank collectives are called from inside this group's run callbacks only"
            ),
        }
    }

    pub(crate) fn barrier(&self) -> &AbortableBarrier {
        &self.barrier
    }

    /// The value of type `T` that a layer above keeps for this group (a collective's events,
    /// communicators, prepared calls), made by `create` at the first call. One value per type; the
    /// group never looks inside. Values are dropped with the group, after its streams have drained
    /// and its rank threads have stopped, before its own streams are destroyed. Two threads asking at
    /// once for a value not made yet may both run `create`; one result is kept, the other dropped.
    pub fn extension<T: Any + Send + Sync>(
        &self,
        create: impl FnOnce(&Group) -> Result<T>,
    ) -> Result<Arc<T>> {
        let find = |extensions: &[Arc<dyn Any + Send + Sync>]| {
            extensions.iter().find_map(|value| Arc::clone(value).downcast::<T>().ok())
        };
        if let Some(found) = find(&read(&self.extensions)) {
            return Ok(found);
        }
        // Made outside the lock: `create` may use the group.
        let made = Arc::new(create(self)?);
        let mut extensions = write(&self.extensions);
        if let Some(found) = find(&extensions) {
            return Ok(found);
        }
        extensions.push(Arc::clone(&made) as Arc<dyn Any + Send + Sync>);
        Ok(made)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.in_scope() {
            log::warn!(
                "group destroyed with its scope open: draining its streams (caller streams not ordered)"
            );
        }
        if let Err(err) = self.synchronize() {
            log::warn!("draining the group's streams: {err}");
        }
        lock(&self.workers).take();
        // The layers' values (communicators, their own streams and events) go before the streams.
        write(&self.extensions).clear();
        for r in 0..self.streams.len() {
            self.backend.destroy_stream(self.devices[r], self.streams[r]);
        }
        let events = [&self.entry_events, &self.exit_events, &self.join_events];
        for list in events {
            for (r, &event) in list.iter().enumerate() {
                self.backend.destroy_event(self.devices[r], event);
            }
        }
    }
}
