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
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

pub mod barrier;
mod spin;
pub mod workers;

use crate::allgather::peer::{PeerMethod, PreparedCall};
use crate::bail;
use crate::error::{Error, Result, Status};
use crate::kernels::rendezvous::Rendezvous;
use crate::transport::cuda::cuda_backend;
use crate::transport::host::HostBackend;
use crate::transport::nccl::Communicators;
use crate::transport::{Backend, BackendKind, Event, Stream};
use barrier::AbortableBarrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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

/// What one rank published for the per-rank collective in flight (see `allgather`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Published {
    pub send: u64,
    pub recv: u64,
    pub counts: Vec<usize>,
    pub algorithm: u32,
}

/// Per-rank events and slots that collectives reuse call after call (no per-call creation).
pub(crate) struct CollectiveState {
    /// Recorded on rank r's stream before a collective touches its buffers: its earlier work is done,
    /// so peers may read its send buffer and write its receive buffer.
    pub ready: Vec<Event>,
    /// Recorded on rank r's stream after its copies into or out of its peers' buffers.
    pub done: Vec<Event>,
    /// `slots[parity][rank]`: alternating by call so a rank one call ahead never overwrites what a
    /// slower rank is still reading.
    pub slots: [Vec<Mutex<Published>>; 2],
    /// How many per-rank collectives each rank has started.
    pub calls: Vec<AtomicU64>,
    /// The prepared per-rank kernel batches of the last whole-group peer allgather, reused while its
    /// method, buffers and counts stay the same (see `allgather::peer`).
    pub prepared: Mutex<Option<PreparedCall>>,
    /// The device flags of group-synchronized kernel launches (CUDA), created on first use.
    pub rendezvous: OnceLock<std::result::Result<Rendezvous, Error>>,
    /// NCCL communicators, created on first use from the group's devices.
    pub nccl: OnceLock<std::result::Result<Communicators, Error>>,
    /// Per-rank copy-engine streams for pushing to several ranks at once (created on first use).
    pub lanes: OnceLock<std::result::Result<Lanes, Error>>,
    /// Whether refit's copy kernel runs on every rank's device, decided at the first peer allgather
    /// (see `allgather::peer::kernels_run`).
    pub kernels_run: OnceLock<bool>,
    /// The whole-group peer allgather method to use at every size, or None for the size rule
    /// (`allgather::peer::method_for`).
    pub peer_method: Mutex<Option<PeerMethod>>,
}

/// `streams[rank][lane]` on the rank's device and `joined[rank][lane]`, recorded on the lane when its
/// copy is queued and waited by the streams that depend on it.
pub(crate) struct Lanes {
    pub streams: Vec<Vec<Stream>>,
    pub joined: Vec<Vec<Event>>,
}

impl Lanes {
    /// `size - 1` lanes per device, each with its event; on failure, what was made is destroyed.
    fn create(backend: &dyn Backend, devices: &[usize]) -> Result<Lanes> {
        let mut made = Lanes { streams: Vec::new(), joined: Vec::new() };
        let created = (|| -> Result<()> {
            for &device in devices {
                made.streams.push(Vec::new());
                made.joined.push(Vec::new());
                for _ in 1..devices.len() {
                    made.streams.last_mut().expect("pushed").push(backend.create_stream(device)?);
                    made.joined.last_mut().expect("pushed").push(backend.create_event(device)?);
                }
            }
            Ok(())
        })();
        match created {
            Ok(()) => Ok(made),
            Err(err) => {
                made.destroy(backend, devices);
                Err(err)
            }
        }
    }

    fn destroy(&self, backend: &dyn Backend, devices: &[usize]) {
        for (r, streams) in self.streams.iter().enumerate() {
            for &stream in streams {
                backend.destroy_stream(devices[r], stream);
            }
        }
        for (r, events) in self.joined.iter().enumerate() {
            for &event in events {
                backend.destroy_event(devices[r], event);
            }
        }
    }
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

pub struct Group {
    id: u64,
    backend: Arc<dyn Backend>,
    devices: Vec<usize>,
    streams: Vec<Stream>,
    peer: Vec<Vec<bool>>,
    entry_events: Vec<Event>,
    exit_events: Vec<Event>,
    /// The caller streams of the open scope, or None.
    scope: Mutex<Option<Vec<Stream>>>,
    barrier: Arc<AbortableBarrier>,
    workers: Mutex<Option<RankWorkers>>,
    /// A reshard execution left copies between ranks with no wait queued on the other ranks'
    /// streams yet; the next group call, run() or exit joins them (see `join_if_pending`).
    pending_join: AtomicBool,
    pub(crate) collective: CollectiveState,
}

/// The host backend runs a thread per simulated device: it simulates at most this many.
const MAX_HOST_DEVICES: usize = 64;

fn backend_for(devices: &[i64], options: &GroupOptions) -> Result<Arc<dyn Backend>> {
    let host = || -> Result<Arc<dyn Backend>> {
        if options.host_devices > MAX_HOST_DEVICES {
            bail!(
                Status::InvalidArgument,
                "host_devices = {} is above the {MAX_HOST_DEVICES} devices the host backend simulates",
                options.host_devices
            );
        }
        let highest = devices.iter().copied().max().unwrap_or(0).max(0);
        if options.host_devices == 0 && highest >= MAX_HOST_DEVICES as i64 {
            bail!(
                Status::InvalidDevice,
                "device {highest} is not below the {MAX_HOST_DEVICES} devices the host backend simulates"
            );
        }
        let count = if options.host_devices == 0 { highest as usize + 1 } else { options.host_devices };
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
    pub fn new(devices: &[i64], options: GroupOptions) -> Result<Group> {
        if devices.is_empty() {
            return Err(Error::new(Status::EmptyDeviceList, "the device list is empty"));
        }
        for (i, &d) in devices.iter().enumerate() {
            if d < 0 {
                bail!(Status::InvalidDevice, "devices[{i}] = {d} is negative");
            }
            if let Some(j) = devices[..i].iter().position(|&e| e == d) {
                bail!(Status::DuplicateDevice, "device {d} appears twice (devices[{j}] and devices[{i}])");
            }
        }
        let backend = backend_for(devices, &options)?;
        let count = backend.device_count();
        if let Some((i, &d)) = devices.iter().enumerate().find(|(_, &d)| d as u64 >= count as u64) {
            bail!(
                Status::InvalidDevice,
                "devices[{i}] = {d} is not below the {count} devices of the backend"
            );
        }
        let devices: Vec<usize> = devices.iter().map(|&d| d as usize).collect();
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
            collective: CollectiveState {
                ready: Vec::with_capacity(n),
                done: Vec::with_capacity(n),
                slots: [
                    (0..n).map(|_| Mutex::default()).collect(),
                    (0..n).map(|_| Mutex::default()).collect(),
                ],
                calls: (0..n).map(|_| AtomicU64::new(0)).collect(),
                prepared: Mutex::new(None),
                rendezvous: OnceLock::new(),
                nccl: OnceLock::new(),
                lanes: OnceLock::new(),
                kernels_run: OnceLock::new(),
                peer_method: Mutex::new(None),
            },
        };
        // Pushed one by one so that Drop releases exactly what was created if a step fails.
        for r in 0..n {
            let device = group.devices[r];
            group.streams.push(backend.create_stream(device)?);
            group.entry_events.push(backend.create_event(device)?);
            group.exit_events.push(backend.create_event(device)?);
            group.collective.ready.push(backend.create_event(device)?);
            group.collective.done.push(backend.create_event(device)?);
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

    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.size() {
            bail!(Status::InvalidArgument, "rank {rank} is not below the group size {}", self.size());
        }
        Ok(())
    }

    /// The device of a rank.
    pub fn device(&self, rank: usize) -> Result<usize> {
        self.check_rank(rank)?;
        Ok(self.devices[rank])
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

    /// Whether a scope is open.
    pub fn in_scope(&self) -> bool {
        self.scope.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Opens a scope: rank r's stream waits for the work queued so far on `caller_streams[r]` (all
    /// legacy default streams when None). `InvalidState` when a scope is already open.
    pub fn enter(&self, caller_streams: Option<&[Stream]>) -> Result<()> {
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
        let mut scope = self.scope.lock().unwrap_or_else(|p| p.into_inner());
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

    /// Closes the open scope (`InvalidState` when none is open). The scope is closed even when
    /// ordering fails; the error is returned.
    pub fn exit(&self, mode: ExitMode) -> Result<()> {
        let callers = self
            .scope
            .lock()
            .unwrap_or_else(|p| p.into_inner())
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

    /// Records that the last call left copies between ranks to be joined (see `join_if_pending`).
    pub(crate) fn mark_pending_join(&self) {
        if self.size() > 1 {
            self.pending_join.store(true, Ordering::Relaxed);
        }
    }

    /// Makes every rank's stream wait for every other rank's stream, if a reshard execution left its
    /// copies between ranks unjoined. Deferring this join to the next group call (or the exit) keeps
    /// G records and G(G-1) cross-GPU waits out of every execution in a loop of refits.
    pub(crate) fn join_if_pending(&self) -> Result<()> {
        if !self.pending_join.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        let done = &self.collective.done;
        for r in 0..self.size() {
            self.backend.record(self.devices[r], done[r], self.streams[r])?;
        }
        for r in 0..self.size() {
            for p in (0..self.size()).filter(|&p| p != r) {
                self.backend.wait(self.devices[r], self.streams[r], done[p])?;
            }
        }
        Ok(())
    }

    /// Runs `body` inside the open scope, or inside an implicit one (legacy default streams, `Sync`
    /// exit) when none is open.
    pub fn in_implicit_scope<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
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
        if workers::inside_any_run() {
            bail!(Status::InvalidState, "run cannot be called from inside a rank callback");
        }
        self.in_implicit_scope(|| {
            // Callbacks may reuse any buffer on their stream: earlier collectives must be joined.
            self.join_if_pending()?;
            let workers = self.workers()?;
            let result = workers.as_ref().expect("started by workers()").run(body);
            // No rank is inside a collective now. After a failure ranks may have started different
            // numbers of collectives; restart every count so the next run's ranks agree on slots.
            for calls in &self.collective.calls {
                calls.store(0, Ordering::Relaxed);
            }
            result
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
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
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

    /// Makes every whole-group peer allgather use `method` (`None`: pick by block size, see
    /// `allgather::peer::method_for`). A knob for benchmarks and tests; a method this group cannot
    /// run (kernels without direct peer access or without libnvrtc, or one rank) still falls back to
    /// the copy engine.
    pub fn set_peer_method(&self, method: Option<PeerMethod>) {
        *self.collective.peer_method.lock().unwrap_or_else(|p| p.into_inner()) = method;
    }

    /// The group's rendezvous flags, created on first use (CUDA backend only).
    pub(crate) fn rendezvous(&self) -> Result<&Rendezvous> {
        self.collective
            .rendezvous
            .get_or_init(|| {
                let devices: Vec<i32> = self.devices.iter().map(|&d| d as i32).collect();
                Rendezvous::new(&devices)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    pub(crate) fn peer_method_override(&self) -> Option<PeerMethod> {
        *self.collective.peer_method.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The group's lanes, created on first use: `size - 1` extra streams per rank (none for a single
    /// rank) and their events. Rank threads issuing a call's pushes at once share them without a lock;
    /// a failed creation is kept and returned by every later call, as for the rendezvous and NCCL.
    pub(crate) fn lanes(&self) -> Result<&Lanes> {
        self.collective
            .lanes
            .get_or_init(|| Lanes::create(self.backend.as_ref(), &self.devices))
            .as_ref()
            .map_err(Clone::clone)
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
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).take();
        // Communicators go before the streams they use.
        drop(self.collective.nccl.take());
        if let Some(Ok(lanes)) = self.collective.lanes.take() {
            lanes.destroy(self.backend.as_ref(), &self.devices);
        }
        for r in 0..self.streams.len() {
            self.backend.destroy_stream(self.devices[r], self.streams[r]);
        }
        let events = [&self.entry_events, &self.exit_events, &self.collective.ready, &self.collective.done];
        for list in events {
            for (r, &event) in list.iter().enumerate() {
                self.backend.destroy_event(self.devices[r], event);
            }
        }
    }
}
