//! Executing a reshard plan: an [`Executor`] for one (plan, group, process) prepares every stage once
//! (descriptors built and uploaded at creation), then each [`Executor::run`] queues the step on the
//! group's streams with no host work per segment, and each stage is stamped on the device.
//!
//! Stages of a step, per slice (one slice unless a staged step exceeds the staging limit):
//! 1. Copy: each source rank copies its local segments on its group stream and pushes its NVLink-peer
//!    segments on a stream of its own (`peer_streams`), side by side. Into the live buffers (direct
//!    commit) or the receivers' staging (staged commit).
//! 2. Verify (optional): each copy batch is checked on its own stream right after it (what it wrote
//!    against what it read); then the peer streams are joined back into the group streams.
//! 3. Install (staged): each receiving rank, once every rank pushing into it is done, copies its
//!    staging into its live buffers in one batched launch; the last slice's install is
//!    [`Executor::commit`].
//!
//! Routes between processes (an executor made with a communicator, [`Executor::new_across`]) run at
//! the start of the first slice on the communicator's device (`remote`): CUDA IPC writes into the
//! receivers' memory or a staged exchange over the communicator; with staged commit, bytes from other
//! processes land in a landing buffer and are installed with the last slice.
//!
//! Ordering follows the group's scope rules: inside the caller's scope the step is only queued;
//! outside one, an implicit scope makes it complete on return. Because a rank writes other ranks'
//! memory, every rank's stream first waits for every other rank's (each destination is written only
//! after its caller's earlier work), and a receiver waits for the ranks pushing into it before
//! installing. An executor keeps no reference to the group: each call is passed it and checks it is
//! the one the executor was made for.

mod addresses;
mod batch;
mod flows;
mod options;
mod quantize;
mod rebind;
mod remote;
mod sender;
mod staging;
mod stats;
mod timing;
mod verify;

pub use flows::KindTotals;
pub use options::{Arm, CommitMode, ExecOptions, Hook, Method, Stage};
pub use remote::RemoteTotals;
pub use stats::RunStats;

use crate::error::{Error, Result, Status};
use crate::group::{Driving, Group};
use crate::plan::{Destinations, Plan, RouteKind};
use crate::segment::{Segment, Side};
use crate::transport::comm::Communicator;
use crate::transport::{Backend, Event, Stream};
use batch::Batch;
use flows::RankFlow;
use quantize::{Quantizing, When};
use rebind::{AddressBook, Registrar, Target};
use remote::Remote;
use staging::{staged_pair, Layout, Packer, Placement};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use timing::Mark;
use verify::CopyCheck;

/// The stages that are stamped on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Timed {
    Local,
    Peer,
    VerifyLocal,
    VerifyPeer,
    Install,
}

/// One stamped launch: stage `timed` of slice `slice` on rank `rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Slot {
    slice: usize,
    timed: Timed,
    rank: usize,
}

/// One copy batch of a rank and the verify that checks it (indices into the executor's lists).
#[derive(Clone, Copy, Debug)]
struct CopyStage {
    batch: usize,
    verify: Option<usize>,
}

/// What one source rank copies in one slice.
#[derive(Debug, Default)]
struct RankCopies {
    rank: usize,
    /// On the group stream.
    local: Option<CopyStage>,
    /// On the rank's peer stream.
    peer: Option<CopyStage>,
    /// Whether other ranks wait for these copies (it pushes into them).
    pushes: bool,
}

/// What one receiving rank does after the copies into it (staged).
#[derive(Debug, Default)]
struct Receiving {
    rank: usize,
    /// Other ranks copying into this one, which it waits for before installing.
    sources: Vec<usize>,
    install: Option<usize>,
}

#[derive(Debug, Default)]
struct Slice {
    copies: Vec<RankCopies>,
    receiving: Vec<Receiving>,
}

/// Where a staged executor stands between calls.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Idle,
    /// The last run staged its last slice; `checked`: its verify outcome was read (or not asked).
    Staged {
        checked: bool,
    },
    /// The last run or commit failed: nothing may be committed until a run succeeds.
    Failed(String),
}

/// Ordering events of one rank (no timing).
#[derive(Clone, Copy)]
struct RankEvents {
    /// Recorded on the group stream where the peer stream forks from it.
    forked: Event,
    /// Recorded on the peer stream after its pushes; the group stream waits for it.
    peer_done: Event,
    /// Recorded on the group stream after the rank's copies; ranks it pushed into wait for it.
    pushed: Event,
    /// Recorded on the group stream at the end of every call; waited for before descriptors change
    /// and before anything the executor owns is freed.
    done: Event,
}

impl RankEvents {
    /// The four events on `device`; on failure, those made are destroyed.
    fn create(backend: &dyn Backend, device: i32) -> Result<RankEvents> {
        let mut made = Vec::with_capacity(4);
        for _ in 0..4 {
            match backend.create_event(device) {
                Ok(event) => made.push(event),
                Err(err) => {
                    made.into_iter().for_each(|event| backend.destroy_event(device, event));
                    return Err(err);
                }
            }
        }
        Ok(RankEvents { forked: made[0], peer_done: made[1], pushed: made[2], done: made[3] })
    }

    fn all(self) -> [Event; 4] {
        [self.forked, self.peer_done, self.pushed, self.done]
    }
}

/// Host-side bookkeeping of one call.
#[derive(Default)]
struct CallLog {
    recorded: Vec<Slot>,
    wait_ns: u64,
    /// Bytes of codes and scales the call's verify found equal to a second quantization.
    quant_verified: u64,
}

impl CallLog {
    /// Runs `wait` (a host wait for the device) and counts its time as waiting.
    fn waiting<T>(&mut self, wait: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let result = wait();
        self.wait_ns += start.elapsed().as_nanos() as u64;
        result
    }
}

/// Moves one process's share of a plan over a group's devices, step after step.
///
/// Thread-safety: one thread at a time (with its group).
pub struct Executor {
    group_id: u64,
    process: u32,
    backend: Arc<dyn Backend>,
    devices: Vec<i32>,
    options: ExecOptions,
    totals: KindTotals,
    methods: [Option<Method>; 3],
    batches: Vec<Batch>,
    verifies: Vec<CopyCheck>,
    slices: Vec<Slice>,
    peer_streams: Vec<Option<Stream>>,
    events: Vec<RankEvents>,
    marks: HashMap<Slot, (Mark, Mark)>,
    /// Ranks whose group stream the executor queues on; their `done` events were recorded by the
    /// last call when `done_recorded`.
    ranks: Vec<usize>,
    done_recorded: bool,
    /// (device, allocation) of each receiving rank's staging buffer.
    staging: Vec<(i32, u64)>,
    book: AddressBook,
    destinations: Destinations,
    state: State,
    last: Option<(RunStats, Vec<Slot>)>,
    /// Set when descriptors could not follow a rebind: every later call fails with it.
    broken: Option<Error>,
    /// Routes between processes (an executor made with a communicator).
    remote: Option<Remote>,
    /// Host time creation spent checking the plan's addresses against the backend's memory.
    address_check_ns: u64,
    /// Staging bytes per receiving device, summed (staged commit).
    staging_bytes: u64,
    /// The plan's quantization jobs for this process's receivers.
    quantizing: Quantizing,
    /// The amax keys whose jobs' devices agree on their amaxes at every run
    /// ([`crate::plan::AmaxExchange`]); empty: none.
    amax_keys: Vec<u64>,
}

/// What the routes between processes ask of the rest of an executor's step.
#[derive(Clone, Copy)]
struct RemotePart<'r> {
    /// The group rank they run on.
    rank: usize,
    /// With staged commit, their installs from the landing.
    installs: &'r [Segment],
    /// The codes and scales this process quantizes for other processes.
    outgoing: &'r sender::Outgoing,
}

/// Every segment into receiving rank `rank` cut to fit `limit` and placed in its staging under
/// `layout`: the packer (size, slices) and (flow index, piece, placement) per piece.
fn place_staging(
    flows: &[RankFlow],
    rank: usize,
    limit: u64,
    layout: Layout,
) -> (Packer, Vec<(usize, Segment, Placement)>) {
    let mut packer = Packer::new(limit, layout);
    let (mut placed, mut pieces) = (Vec::new(), Vec::new());
    for (f, flow) in flows.iter().enumerate().filter(|(_, f)| f.dst == rank) {
        for segment in &flow.segments {
            pieces.clear();
            staging::split(segment, packer.cap(), packer.layout(), &mut pieces);
            for piece in &pieces {
                placed.push((f, *piece, packer.place(piece)));
            }
        }
    }
    (packer, placed)
}

/// A segment's first and one-past-last byte on one side (the plan's segments were validated: no
/// span overflows).
fn extent(segment: &Segment, side: Side) -> (u64, u64) {
    let base = segment.address(side);
    (base, base + segment.span(side).unwrap_or(0))
}

/// The method for `segments` of `kind` under `arm`. `direct`: every pair has peer access.
/// `verified`: the copies will be verified. AUTO then keeps the kernel wherever it can run: its copy
/// records digests of the source tiles it reads, so the verify reads only the destinations, where a
/// copy-engine copy leaves the verify comparing both sides (benches/gpu_digest.rs measures both).
/// `budgeted`: the caller capped the SMs the copies may use (work runs beside them). AUTO then
/// gives every run to the copy engine, which uses none, in pieces (see [`Batch::new`]).
fn resolve(
    arm: Arm,
    kind: RouteKind,
    segments: &[&Segment],
    direct: bool,
    (verified, budgeted): (bool, bool),
) -> Result<Method> {
    if kind == RouteKind::Peer && !direct {
        return match arm {
            Arm::Kernel => Err(Error::unsupported(
                "a rank cannot write a peer's memory directly (no peer access): the kernel arm cannot \
                 push there; use REFIT_ARM_AUTO or REFIT_ARM_COPY_ENGINE",
            )),
            _ => Ok(Method::CopyEngine),
        };
    }
    Ok(match arm {
        Arm::Kernel => Method::Kernel,
        Arm::CopyEngine => Method::CopyEngine,
        Arm::Auto if verified => Method::Kernel,
        Arm::Auto if budgeted => Method::CopyEngine,
        Arm::Auto => {
            let engine = Arm::engine_segments(kind, segments.iter().copied());
            match engine.iter().filter(|&&to_engine| to_engine).count() {
                0 => Method::Kernel,
                n if n == segments.len() => Method::CopyEngine,
                _ => Method::Split,
            }
        }
    })
}

/// One segment a copy batch moves: as copied (into the live buffer, or into staging), as planned
/// (what a verify mismatch is reported against), and the rank receiving it.
#[derive(Clone, Copy, Debug)]
struct Copied {
    segment: Segment,
    planned: Segment,
    receiver: usize,
}

/// Segments of one slice before they become batches.
#[derive(Default)]
struct SliceLists {
    /// Per source rank: its local and its peer copies.
    local: HashMap<usize, Vec<Copied>>,
    peer: HashMap<usize, Vec<Copied>>,
    /// Per receiving rank: the installs from its staging.
    installs: HashMap<usize, Vec<Segment>>,
}

impl SliceLists {
    fn copy(&mut self, flow: &RankFlow, segment: Segment, planned: Segment) {
        let lists = if flow.kind == RouteKind::Local { &mut self.local } else { &mut self.peer };
        lists.entry(flow.src).or_default().push(Copied { segment, planned, receiver: flow.dst });
    }
}

impl Executor {
    /// Prepares `process`'s share of `plan` (routes whose endpoints are in that process; endpoint
    /// devices are the group's device ordinals) for `group`: batches for every stage built and
    /// uploaded, staging allocated, every address checked once against the backend's memory (see
    /// `addresses`). Errors: InvalidArgument (options; a process the plan does not name; an address
    /// that is not memory of the device the plan names; a step that needs more than one slice
    /// under `single_slice`), NotFound (a plan device not
    /// in the group), Unsupported (a route to or from another process; the kernel arm without
    /// peer access), InvalidArgument (a segment the batched copy refuses), and the driver's and
    /// compiler's errors.
    pub fn new(group: &Group, plan: &Plan, process: u32, options: ExecOptions) -> Result<Executor> {
        options.check()?;
        let flows = flows::flows(group, plan, process, false)?;
        flows::check_named(plan, process)?;
        let checked_ns = addresses::check(group, plan, process, &flows, false)?;
        let mut executor = Executor::build_any_arm(group, plan, process, &options, &flows, None)?;
        executor.address_check_ns = checked_ns;
        Ok(executor)
    }

    /// As [`Executor::new`] for the process whose communicator rank is `comm`'s, with the routes
    /// between it and the other processes of `comm` too (`plan` is typically its share, built
    /// across the processes): a collective call, every process of the communicator makes it. Those
    /// routes must start or end on the communicator's device, a device of `group`. Errors: those of
    /// [`Executor::new`], InvalidArgument (a plan process that is not a communicator rank),
    /// Unsupported (a route between processes on another device), the communicator's (TIMEOUT,
    /// ABORTED).
    pub fn new_across(
        group: &Group,
        plan: &Plan,
        comm: Arc<Communicator>,
        options: ExecOptions,
    ) -> Result<Executor> {
        options.check()?;
        let process = u32::try_from(comm.rank()).map_err(|_| Error::invalid_argument("a rank above 2^32"))?;
        let flows = flows::flows(group, plan, process, true)?;
        // Before the first meeting: a refusal here leaves the other processes' creates to fail
        // with TIMEOUT or ABORTED, as any failure of one process's create does.
        let checked_ns = addresses::check(group, plan, process, &flows, true)?;
        let remote = Remote::prepare(group, plan, process, comm, &options)?;
        let mut executor = Executor::build_any_arm(group, plan, process, &options, &flows, Some(remote))?;
        executor.address_check_ns = checked_ns;
        Ok(executor)
    }

    /// Builds with the options' arm and, when AUTO finds the kernel unavailable, with the copy engine.
    fn build_any_arm(
        group: &Group,
        plan: &Plan,
        process: u32,
        options: &ExecOptions,
        flows: &[RankFlow],
        remote: Option<Remote>,
    ) -> Result<Executor> {
        let remote_part = remote.as_ref().map(|r| RemotePart {
            rank: r.rank(),
            installs: r.installs(),
            outgoing: r.outgoing(),
        });
        let built = match Executor::build(group, plan, process, options, flows, true, remote_part) {
            Err(err)
                if options.arm == Arm::Auto
                    && matches!(err.status, Status::NvrtcUnavailable | Status::KernelLoadFailed) =>
            {
                log::warn!(
                    "the batched copy kernel is unavailable ({err}); the executor uses the copy engine"
                );
                Executor::build(group, plan, process, options, flows, false, remote_part)
            }
            built => built,
        };
        let mut executor = built?;
        executor.remote = remote;
        Ok(executor)
    }

    /// Builds everything; `kernel` false makes every stage use the copy engine. `remote`: what the
    /// routes between processes ask of the rest of the step.
    fn build(
        group: &Group,
        plan: &Plan,
        process: u32,
        options: &ExecOptions,
        flows: &[RankFlow],
        kernel: bool,
        remote: Option<RemotePart>,
    ) -> Result<Executor> {
        let direct = group.all_peers_direct();
        let arm = if kernel { options.arm } else { Arm::CopyEngine };
        let mut methods = [None; 3];
        for kind in [RouteKind::Local, RouteKind::Peer] {
            let segments: Vec<&Segment> =
                flows.iter().filter(|f| f.kind == kind).flat_map(|f| &f.segments).collect();
            if !segments.is_empty() {
                let asked = (options.verify, options.sm_budget > 0);
                methods[kind as usize] = Some(resolve(arm, kind, &segments, direct, asked)?);
            }
        }
        let backend = Arc::clone(group.backend());
        let mut executor = Executor {
            group_id: group.id(),
            process,
            backend: Arc::clone(&backend),
            devices: group.devices().to_vec(),
            options: ExecOptions { arm, ..options.clone() },
            totals: KindTotals::of(flows),
            methods,
            batches: Vec::new(),
            verifies: Vec::new(),
            slices: Vec::new(),
            peer_streams: vec![None; group.size()],
            events: Vec::new(),
            marks: HashMap::new(),
            ranks: Vec::new(),
            done_recorded: false,
            staging: Vec::new(),
            book: AddressBook::default(),
            destinations: plan.destinations().of_process(process),
            state: State::Idle,
            last: None,
            broken: None,
            remote: None,
            address_check_ns: 0,
            staging_bytes: 0,
            quantizing: Quantizing::default(),
            amax_keys: Vec::new(),
        };
        let mut lists = match options.commit {
            CommitMode::Direct => vec![executor.direct_lists(flows)],
            CommitMode::Staged => executor.staged_lists(flows)?,
        };
        if let Some(RemotePart { rank, installs, .. }) = remote.filter(|r| !r.installs.is_empty()) {
            // Bytes from other processes are installed with the last slice, at the commit.
            if lists.is_empty() {
                lists.push(SliceLists::default());
            }
            let last = lists.last_mut().expect("one slice at least");
            last.installs.entry(rank).or_default().extend_from_slice(installs);
        }
        let staged = options.commit == CommitMode::Staged;
        let exchange = plan.amax_exchange();
        if let Some(other) = exchange.processes.iter().find(|&&p| p != process).filter(|_| remote.is_none()) {
            crate::bail!(
                Status::Unsupported,
                "the plan's quantized needs share amaxes between devices of processes {} and {other}, which \
                 exchange them at every run: create the executor with a communicator \
                 (refit_executor_create_across)",
                process
            );
        }
        executor.amax_keys = exchange.keys.clone();
        let outgoing = remote.map(|r| (r.rank, r.outgoing));
        let mut quantizing =
            Quantizing::new(group, plan, process, (staged, options.verify), flows, outgoing)?;
        // Freed with the executor's other staging.
        executor.staging.append(&mut quantizing.staging);
        for (rank, installs) in std::mem::take(&mut quantizing.installs) {
            // Codes and scales quantized into staging are installed with the last slice, at the commit.
            if lists.is_empty() {
                lists.push(SliceLists::default());
            }
            let last = lists.last_mut().expect("one slice at least");
            last.installs.entry(rank).or_default().extend(installs);
        }
        executor.quantizing = quantizing;
        let mut registrar = Registrar::default();
        for (k, lists) in lists.into_iter().enumerate() {
            let slice = executor.prepare_slice(group, k, lists, &mut registrar)?;
            executor.slices.push(slice);
        }
        executor.book = registrar.build();
        // In-place quantization rides its rank's first local copy launch that can carry it: the stage
        // then ends with one launch, not two in a row (and no join of every rank's copies before it).
        let (slices, batches) = (&executor.slices, &mut executor.batches);
        executor.quantizing.ride(|rank, jobs| {
            slices
                .iter()
                .flat_map(|slice| &slice.copies)
                .filter(|copies| copies.rank == rank)
                .filter_map(|copies| copies.local.as_ref())
                .any(|stage| batches[stage.batch].carry(jobs))
        });
        let mut ranks: Vec<usize> = Vec::new();
        for slice in &executor.slices {
            ranks.extend(slice.copies.iter().map(|c| c.rank));
            ranks.extend(slice.receiving.iter().map(|r| r.rank));
        }
        ranks.extend(remote.map(|r| r.rank));
        ranks.extend(executor.quantizing.ranks());
        ranks.sort_unstable();
        ranks.dedup();
        executor.ranks = ranks;
        for rank in 0..group.size() {
            executor.events.push(RankEvents::create(backend.as_ref(), executor.devices[rank])?);
        }
        Ok(executor)
    }

    /// The one slice of a direct step: copies straight into the live buffers.
    fn direct_lists(&self, flows: &[RankFlow]) -> SliceLists {
        let mut lists = SliceLists::default();
        for flow in flows {
            for segment in &flow.segments {
                lists.copy(flow, *segment, *segment);
            }
        }
        lists
    }

    /// The slices of a staged step: every segment placed in its receiver's staging (cut where it
    /// exceeds the limit), staging allocated, copies into staging and installs out of it.
    fn staged_lists(&mut self, flows: &[RankFlow]) -> Result<Vec<SliceLists>> {
        let limit = if self.options.staging_limit == 0 { u64::MAX } else { self.options.staging_limit };
        let mut receivers: Vec<usize> = flows.iter().map(|f| f.dst).collect();
        receivers.sort_unstable();
        receivers.dedup();
        let mut slices: Vec<SliceLists> = Vec::new();
        for rank in receivers {
            let into = |f: &&RankFlow| f.dst == rank;
            let payload: u64 =
                flows.iter().filter(into).flat_map(|f| &f.segments).filter_map(|s| s.bytes()).sum();
            let (mut packer, mut placed) = place_staging(flows, rank, limit, Layout::Aligned);
            if packer.slices() > 1 && payload <= limit {
                // Only the alignment padding would cut the step: pack densely, in one slice.
                (packer, placed) = place_staging(flows, rank, limit, Layout::Dense);
            }
            let device = self.devices[rank];
            if self.options.single_slice && packer.slices() > 1 {
                let aligned = place_staging(flows, rank, u64::MAX, Layout::Aligned).0.size;
                return Err(Error::invalid_argument(format!(
                    "options.single_slice: the step into device {device} needs {} slices of staging_limit {limit} bytes ({payload} bytes of payload, {aligned} staged with alignment); raise staging_limit to at least {payload}, or set it to 0",
                    packer.slices()
                )));
            }
            self.staging_bytes += packer.size;
            let size = usize::try_from(packer.size + 16)
                .map_err(|_| Error::new(Status::OutOfMemory, "staging larger than the address space"))?;
            let allocation = self.backend.alloc(device, size).map_err(|e| {
                e.context(format!(
                    "allocating {size} bytes of staging on device {device} (see staging_limit)"
                ))
            })?;
            self.staging.push((device, allocation));
            let base = allocation.next_multiple_of(16);
            if slices.len() < packer.slices() {
                slices.resize_with(packer.slices(), SliceLists::default);
            }
            for (f, piece, placement) in placed {
                let (into, out) = staged_pair(&piece, base, &placement);
                let lists = &mut slices[placement.slice];
                lists.copy(&flows[f], into, piece);
                lists.installs.entry(rank).or_default().push(out);
            }
        }
        Ok(slices)
    }

    /// Builds slice `k`'s batches (with their verifies), stamps and peer streams, and registers every
    /// address it reads or writes in caller memory.
    fn prepare_slice(
        &mut self,
        group: &Group,
        k: usize,
        lists: SliceLists,
        registrar: &mut Registrar,
    ) -> Result<Slice> {
        let mut slice = Slice::default();
        let mut sources: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut copy_ranks: Vec<usize> = lists.local.keys().chain(lists.peer.keys()).copied().collect();
        copy_ranks.sort_unstable();
        copy_ranks.dedup();
        for rank in copy_ranks {
            let mut copies = RankCopies { rank, ..RankCopies::default() };
            for (kind, list) in
                [(RouteKind::Local, lists.local.get(&rank)), (RouteKind::Peer, lists.peer.get(&rank))]
            {
                let Some(list) = list else { continue };
                for copied in list.iter().filter(|c| c.receiver != rank) {
                    copies.pushes = true;
                    let into = sources.entry(copied.receiver).or_default();
                    if !into.contains(&rank) {
                        into.push(rank);
                    }
                }
                let stage = self.prepare_copy(group, k, rank, kind, list, registrar)?;
                if kind == RouteKind::Local {
                    copies.local = Some(stage);
                } else {
                    copies.peer = Some(stage);
                    if self.peer_streams[rank].is_none() {
                        self.peer_streams[rank] = Some(self.backend.create_stream(self.devices[rank])?);
                    }
                }
            }
            slice.copies.push(copies);
        }
        let mut receiving_ranks: Vec<usize> = lists.installs.keys().copied().collect();
        receiving_ranks.sort_unstable();
        for rank in receiving_ranks {
            let installs = &lists.installs[&rank];
            let index = self.batches.len();
            for (i, segment) in installs.iter().enumerate() {
                let (lo, hi) = extent(segment, Side::Destination);
                registrar.add(self.devices[rank], lo, hi, Target::Copy(index as u32), i, Side::Destination);
            }
            let refs: Vec<&Segment> = installs.iter().collect();
            let method = resolve(self.options.arm, RouteKind::Local, &refs, true, (false, false))?;
            self.batches.push(Batch::new(
                group,
                rank,
                installs.clone(),
                (method, RouteKind::Local),
                0,
                false,
            )?);
            self.add_marks(Slot { slice: k, timed: Timed::Install, rank })?;
            let sources = sources.remove(&rank).unwrap_or_default();
            slice.receiving.push(Receiving { rank, sources, install: Some(index) });
        }
        Ok(slice)
    }

    /// One copy batch of `rank` for route kind `kind` in slice `k`, and its verify when asked.
    fn prepare_copy(
        &mut self,
        group: &Group,
        k: usize,
        rank: usize,
        kind: RouteKind,
        list: &[Copied],
        registrar: &mut Registrar,
    ) -> Result<CopyStage> {
        // Staged copies write staging, which is the executor's own: only live addresses move.
        let live_destinations = self.options.commit == CommitMode::Direct;
        let batch = self.batches.len();
        let verify = self.options.verify.then_some(self.verifies.len());
        for (i, copied) in list.iter().enumerate() {
            let targets = [Some(Target::Copy(batch as u32)), verify.map(|v| Target::Verify(v as u32))];
            for target in targets.into_iter().flatten() {
                let (lo, hi) = extent(&copied.segment, Side::Source);
                registrar.add(self.devices[rank], lo, hi, target, i, Side::Source);
                if live_destinations {
                    let (lo, hi) = extent(&copied.segment, Side::Destination);
                    registrar.add(self.devices[copied.receiver], lo, hi, target, i, Side::Destination);
                }
            }
        }
        let method = self.methods[kind as usize].expect("a method for every kind with segments");
        let segments: Vec<Segment> = list.iter().map(|c| c.segment).collect();
        let (budget, verify_on) = (self.options.sm_budget, self.options.verify);
        self.batches.push(Batch::new(group, rank, segments, (method, kind), budget, verify_on)?);
        let (copy, check) = if kind == RouteKind::Local {
            (Timed::Local, Timed::VerifyLocal)
        } else {
            (Timed::Peer, Timed::VerifyPeer)
        };
        self.add_marks(Slot { slice: k, timed: copy, rank })?;
        if self.options.verify {
            let planned = list.iter().map(|c| (c.planned, c.receiver)).collect();
            self.verifies.push(CopyCheck::new(group, rank, &self.batches[batch], planned)?);
            self.add_marks(Slot { slice: k, timed: check, rank })?;
        }
        Ok(CopyStage { batch, verify })
    }

    fn add_marks(&mut self, slot: Slot) -> Result<()> {
        let device = self.devices[slot.rank];
        let pair = (Mark::new(self.backend.as_ref(), device)?, Mark::new(self.backend.as_ref(), device)?);
        self.marks.insert(slot, pair);
        Ok(())
    }
}

impl Executor {
    /// The plan share's payload bytes and segments per route kind.
    pub fn totals(&self) -> KindTotals {
        self.totals
    }

    /// How each route kind's copies from the sources are moved (None: no route of that kind).
    pub fn methods(&self) -> [Option<Method>; 3] {
        self.methods
    }

    /// Slices a step runs in.
    pub fn slices(&self) -> usize {
        self.slices.len()
    }

    /// Staging bytes allocated for the step, summed over the receiving devices (0: direct commit).
    /// What the routes between processes amount to (an executor made with a communicator).
    pub fn remote_totals(&self) -> Option<&RemoteTotals> {
        self.remote.as_ref().map(|r| &r.totals)
    }

    pub fn staging_bytes(&self) -> u64 {
        self.staging_bytes
    }

    /// Device memory held for quantized needs beside staging_limit, summed over devices: their
    /// staging under staged commit, the verify's scratch, and the send buffer of codes and scales
    /// quantized for other processes.
    pub fn quantization_bytes(&self) -> u64 {
        let sent = self.remote.as_ref().map_or(0, |r| r.outgoing().buffer_bytes());
        self.quantizing.staging_bytes + sent
    }

    /// Device memory that bytes from other processes land in under staged commit (beside
    /// staging_limit; 0 otherwise).
    pub fn landing_bytes(&self) -> u64 {
        self.remote.as_ref().map_or(0, |r| r.landing_bytes())
    }

    /// Host time the creation spent checking the plan's addresses (see `addresses`).
    pub fn address_check_ns(&self) -> u64 {
        self.address_check_ns
    }

    pub fn options(&self) -> &ExecOptions {
        &self.options
    }

    /// A run or commit may start: the executor's group, driven by this thread (see
    /// [`Group::drive`]), and no failed rebind. The guard drives the group until it drops.
    fn check_call<'g>(&self, group: &'g Group) -> Result<Driving<'g>> {
        if group.id() != self.group_id {
            return Err(Error::invalid_argument("this executor was made for another group"));
        }
        let driving = group.drive()?;
        match &self.broken {
            Some(err) => Err(Error::new(
                Status::InvalidState,
                format!("the executor is unusable since a rebind failed ({}): build a new one", err.message),
            )),
            None => Ok(driving),
        }
    }

    /// Queues one step: the copies, verify when asked and, when staged, the install of every slice
    /// but the last (see [`CommitMode::Staged`]). Inside the group's scope it is queued after the
    /// callers' streams; outside one it is complete on return. It waits for the device anyway when
    /// it must read a verify outcome first: after the copies of a direct step, and before each
    /// install of a sliced one. A staged step not yet committed is replaced.
    ///
    /// Errors: InvalidArgument (another group), InvalidState (a rebind failed earlier; called from
    /// a rank callback), VerifyMismatch (naming tensor, box and element), PlanStale (rebinds left
    /// buffers overlapping; so does every later run), the driver's errors. After an error nothing
    /// may be committed until a run succeeds; in a direct step, live buffers may hold some of the
    /// new bytes.
    ///
    /// # Safety
    /// Every address of the plan (as rebound) must be live memory of the device it names until the
    /// work is done (on return outside a scope; after the scope's exit inside one).
    pub unsafe fn run(&mut self, group: &Group) -> Result<RunStats> {
        // SAFETY: the caller's promise.
        let ran = unsafe { self.run_step(group) };
        self.disarm_on_error(ran)
    }

    /// Any failed run or commit, a refused argument included, leaves nothing to commit until a run
    /// succeeds (the staged step may be another than the caller thinks).
    fn disarm_on_error(&mut self, outcome: Result<RunStats>) -> Result<RunStats> {
        outcome.inspect_err(|err| {
            if !matches!(self.state, State::Failed(_)) {
                self.state = State::Failed(err.message.clone());
            }
        })
    }

    /// Records that a run or commit on this executor was refused before it reached the executor
    /// (an argument the C API checks first): as any failed call, it disarms the commit.
    pub fn refused(&mut self, err: &Error) {
        let _ = self.disarm_on_error(Err(err.clone()));
    }

    /// [`Executor::run`] without the disarming on error.
    unsafe fn run_step(&mut self, group: &Group) -> Result<RunStats> {
        let started = Instant::now();
        let _driving = self.check_call(group)?;
        let mut stats = RunStats { descriptors_reused: true, ..RunStats::default() };
        if self.book.has_moved() {
            self.book.settle().inspect_err(|err| self.state = State::Failed(err.message.clone()))?;
        }
        // Only descriptor rebuilds count as preparing: the call's other host work before queueing
        // (its checks, the settling of rebinds) is enqueue time, so prepare_ns is 0 when reused.
        let mut prepare_ns = 0;
        for verify in &mut self.verifies {
            let rebuilding = Instant::now();
            if verify.refresh(group)? {
                stats.descriptors_reused = false;
                prepare_ns += rebuilding.elapsed().as_nanos() as u64;
            }
        }
        let implicit = !group.in_scope();
        let staged = self.options.commit == CommitMode::Staged;
        let mut log = CallLog::default();
        self.state = State::Failed("the last run did not finish".into());
        let queued = group.in_implicit_scope(|| {
            let queued = self.queue_run(group, &mut log);
            let done = self.record_done(group);
            queued.and(done)?;
            // The exit of an implicit scope waits from here on.
            Ok(Instant::now())
        });
        let exited = Instant::now();
        let enqueued = match queued {
            Ok(at) => at,
            Err(err) => {
                self.state = State::Failed(err.message.clone());
                return Err(err);
            }
        };
        if implicit {
            log.wait_ns += (exited - enqueued).as_nanos() as u64;
            // The step has run: a peer that failed meanwhile failed the communicator.
            if let Some(remote) = &self.remote {
                remote.check().inspect_err(|err| self.state = State::Failed(err.message.clone()))?;
            }
        }
        let last = self.slices.len().saturating_sub(1);
        let mut checked = !self.options.verify;
        if self.options.verify && (!staged || implicit) {
            // Direct steps were checked slice by slice; an implicit scope has finished the last.
            if staged {
                self.check_slice(last, &mut log)
                    .inspect_err(|err| self.state = State::Failed(err.message.clone()))?;
            }
            checked = true;
        }
        self.state = if staged { State::Staged { checked } } else { State::Idle };

        stats.slices = self.slices.len() as u32;
        stats.arm = self.methods.map(Method::code);
        stats.bytes = self.totals.bytes;
        stats.segments = self.totals.segments;
        // What this call read the checks of: every slice, but the last when it left it to the commit.
        let read = if checked { self.slices.len() } else { last };
        stats.verified_bytes = if self.options.verify { self.verified_bytes(0..read) } else { 0 };
        stats.verified_bytes += log.quant_verified;
        stats.installed_bytes =
            if staged { self.installed_bytes(0..last) } else { self.totals.bytes.iter().sum() };
        stats.installed_bytes += self.quantizing.live_bytes(When::Run, staged);
        if let Some(remote) = &self.remote {
            remote_stats(&mut stats, &remote.totals, staged);
        }
        stats.verified = self.options.verify && checked && stats.verified_bytes > 0;
        stats.quantized_elements =
            [When::Send, When::Straight, When::Run].map(|w| self.quantizing.elements_at(w)).iter().sum();
        self.finish("run", stats, started, prepare_ns, log, implicit)
    }

    /// Queues every slice of a run (inside the scope).
    fn queue_run(&self, group: &Group, log: &mut CallLog) -> Result<()> {
        let staged = self.options.commit == CommitMode::Staged;
        let last = self.slices.len().saturating_sub(1);
        if !self.amax_keys.is_empty() {
            // The sources as the caller left them, on every rank, before their amaxes are taken.
            group.mark_pending_join();
            group.join_if_pending()?;
            let comm = self.remote.as_ref().map(Remote::comm);
            log.waiting(|| self.quantizing.exchange_amaxes(group, &self.amax_keys, comm))?;
        }
        if self.slices.is_empty() {
            if let Some(remote) = &self.remote {
                group.mark_pending_join();
                group.join_if_pending()?;
                self.queue_remote(group, remote, log)?;
            }
        }
        for (k, slice) in self.slices.iter().enumerate() {
            // Every rank waits for every other: destinations are written after their callers' earlier
            // work, and a slice's staging after the previous slice's installs have read it.
            group.mark_pending_join();
            group.join_if_pending()?;
            if let (0, Some(remote)) = (k, &self.remote) {
                self.queue_remote(group, remote, log)?;
            }
            self.options.call_hook(Stage::Copy { slice: k }, group)?;
            self.queue_copies(group, k, log)?;
            if staged {
                for receiving in &slice.receiving {
                    let device = self.devices[receiving.rank];
                    let stream = group.stream(receiving.rank)?;
                    for &source in &receiving.sources {
                        self.backend.wait(device, stream, self.events[source].pushed)?;
                    }
                }
            }
            if self.options.verify && (!staged || k < last) {
                self.check_slice(k, log)?;
            }
            if staged && k < last {
                self.queue_installs(group, k, log)?;
            }
        }
        if self.quantizing.has(When::Run) {
            // Every copy of the step has landed, on every rank, before anything is quantized.
            group.mark_pending_join();
            group.join_if_pending()?;
            let hook = || self.options.call_hook(Stage::QuantVerify, group);
            // SAFETY: the caller's promise on the plan's memory; the quantization staging is ours.
            unsafe { self.quantizing.queue(group, When::Run, hook) }?;
            if self.options.verify {
                log.quant_verified += log.waiting(|| self.quantizing.read_checks(group, When::Run))?;
            }
        }
        group.mark_pending_join();
        Ok(())
    }

    /// Queues the routes between processes, after the codes and scales this process quantizes for
    /// others (and, with verify, their check) on the same stream.
    fn queue_remote(&self, group: &Group, remote: &Remote, log: &mut CallLog) -> Result<()> {
        let mut quantize = |when: When| -> Result<()> {
            if self.quantizing.has(when) {
                let hook = || self.options.call_hook(Stage::QuantVerify, group);
                // SAFETY: the caller's promise on the plan's memory (and the peers' on theirs); the
                // send buffer is ours.
                unsafe { self.quantizing.queue(group, when, hook) }?;
                if self.options.verify {
                    log.quant_verified += log.waiting(|| self.quantizing.read_checks(group, when))?;
                }
            }
            Ok(())
        };
        quantize(When::Send)?;
        // SAFETY: the caller's promise on the plan's memory; the landing is ours.
        unsafe { remote.run(group, || quantize(When::Straight)) }
    }

    /// Queues slice `k`'s copies, then (when asked) each copy's verify after it on the same stream:
    /// local batches on each rank's group stream, peer pushes on its peer stream, forked from the
    /// group stream before and joined back into it after (also when queueing fails, so that the
    /// group stream covers whatever was queued). Then each pushing rank records `pushed`.
    fn queue_copies(&self, group: &Group, k: usize, log: &mut CallLog) -> Result<()> {
        let copies = &self.slices[k].copies;
        let mut forked = Vec::new();
        let mut result = (|| {
            for c in copies.iter().filter(|c| c.peer.is_some()) {
                let (device, stream, lane) = self.streams_of(group, c.rank)?;
                self.backend.record(device, self.events[c.rank].forked, stream)?;
                self.backend.wait(device, lane, self.events[c.rank].forked)?;
                forked.push(c.rank);
            }
            for c in copies {
                for (stage, timed, lane) in self.stages_of(group, c)? {
                    let slot = Slot { slice: k, timed, rank: c.rank };
                    let batch = &self.batches[stage.batch];
                    // SAFETY: the caller's promise on the plan's memory; staging is ours.
                    self.stamped(slot, lane, log, || unsafe { batch.launch(lane) })?;
                }
            }
            if self.options.verify {
                self.options.call_hook(Stage::Verify { slice: k }, group)?;
                for c in copies {
                    for (stage, timed, lane) in self.stages_of(group, c)? {
                        let timed =
                            if timed == Timed::Local { Timed::VerifyLocal } else { Timed::VerifyPeer };
                        let slot = Slot { slice: k, timed, rank: c.rank };
                        let verify =
                            &self.verifies[stage.verify.expect("a verify for every copy when asked")];
                        // SAFETY: as above.
                        self.stamped(slot, lane, log, || unsafe { verify.launch(lane) })?;
                    }
                }
            }
            Ok(())
        })();
        for &rank in &forked {
            let joined = self.streams_of(group, rank).and_then(|(device, stream, lane)| {
                self.backend.record(device, self.events[rank].peer_done, lane)?;
                self.backend.wait(device, stream, self.events[rank].peer_done)
            });
            result = result.and(joined);
        }
        result?;
        for c in copies.iter().filter(|c| c.pushes) {
            let (device, stream, _) = self.streams_of(group, c.rank)?;
            self.backend.record(device, self.events[c.rank].pushed, stream)?;
        }
        Ok(())
    }

    /// A rank's device, group stream and peer stream (the group stream when it has none).
    fn streams_of(&self, group: &Group, rank: usize) -> Result<(i32, Stream, Stream)> {
        let stream = group.stream(rank)?;
        Ok((self.devices[rank], stream, self.peer_streams[rank].unwrap_or(stream)))
    }

    /// A rank's copy stages with what they are stamped as and the stream each runs on.
    fn stages_of(&self, group: &Group, copies: &RankCopies) -> Result<Vec<(CopyStage, Timed, Stream)>> {
        let (_, stream, lane) = self.streams_of(group, copies.rank)?;
        let local = copies.local.map(|stage| (stage, Timed::Local, stream));
        let peer = copies.peer.map(|stage| (stage, Timed::Peer, lane));
        Ok(local.into_iter().chain(peer).collect())
    }

    /// Queues slice `k`'s installs from staging into the live buffers.
    fn queue_installs(&self, group: &Group, k: usize, log: &mut CallLog) -> Result<()> {
        self.options.call_hook(Stage::Install { slice: k }, group)?;
        for receiving in &self.slices[k].receiving {
            if let Some(b) = receiving.install {
                let stream = group.stream(receiving.rank)?;
                let slot = Slot { slice: k, timed: Timed::Install, rank: receiving.rank };
                // SAFETY: staging is ours; the caller's promise covers the live buffers.
                self.stamped(slot, stream, log, || unsafe { self.batches[b].launch(stream) })?;
            }
        }
        Ok(())
    }

    /// `launch` between the two stamps of `slot` on `stream`.
    fn stamped(
        &self,
        slot: Slot,
        stream: Stream,
        log: &mut CallLog,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let (start, end) = &self.marks[&slot];
        start.record(stream)?;
        launch()?;
        end.record(stream)?;
        log.recorded.push(slot);
        Ok(())
    }

    /// Waits for slice `k`'s verifies and reads their outcomes.
    fn check_slice(&self, k: usize, log: &mut CallLog) -> Result<()> {
        let Some(slice) = self.slices.get(k) else { return Ok(()) };
        for copies in &slice.copies {
            for (stage, timed) in [(copies.local, Timed::VerifyLocal), (copies.peer, Timed::VerifyPeer)] {
                let Some(v) = stage.and_then(|s| s.verify) else { continue };
                log.waiting(|| self.marks[&Slot { slice: k, timed, rank: copies.rank }].1.wait())?;
                self.verifies[v].check(
                    self.backend.as_ref(),
                    &self.devices,
                    self.process,
                    &self.destinations,
                )?;
            }
        }
        Ok(())
    }

    /// Records every used rank's `done` event on its group stream.
    fn record_done(&mut self, group: &Group) -> Result<()> {
        let mut result = Ok(());
        for &rank in &self.ranks {
            let stream = group.stream(rank)?;
            result = result.and(self.backend.record(self.devices[rank], self.events[rank].done, stream));
        }
        self.done_recorded = true;
        result
    }

    /// The bytes the verifies of `slices` check.
    fn verified_bytes(&self, slices: std::ops::Range<usize>) -> u64 {
        self.slices[slices]
            .iter()
            .flat_map(|s| &s.copies)
            .flat_map(|c| [c.local, c.peer])
            .filter_map(|stage| stage.and_then(|s| s.verify))
            .map(|v| self.verifies[v].bytes())
            .sum()
    }

    fn installed_bytes(&self, slices: std::ops::Range<usize>) -> u64 {
        self.slices[slices]
            .iter()
            .flat_map(|s| &s.receiving)
            .filter_map(|r| r.install)
            .map(|b| self.batches[b].bytes())
            .sum()
    }

    /// Installs the staged step's last slice into the live buffers with one batched launch per
    /// receiving rank, after reading its verify outcome if the run did not (the host then waits for
    /// the verify stage). Queued like `run`: inside the scope after the callers' streams, else
    /// complete on return.
    ///
    /// Errors: InvalidArgument (another group), InvalidState (direct commit; nothing staged; the
    /// last run failed), VerifyMismatch (nothing installed), the driver's errors. After an error
    /// nothing may be committed until a run succeeds.
    ///
    /// # Safety
    /// As for [`Executor::run`].
    pub unsafe fn commit(&mut self, group: &Group) -> Result<RunStats> {
        // SAFETY: the caller's promise.
        let committed = unsafe { self.commit_step(group) };
        self.disarm_on_error(committed)
    }

    /// [`Executor::commit`] without the disarming on error.
    unsafe fn commit_step(&mut self, group: &Group) -> Result<RunStats> {
        let started = Instant::now();
        let _driving = self.check_call(group)?;
        if self.options.commit == CommitMode::Direct {
            return Err(Error::invalid_state(
                "this executor commits directly (REFIT_COMMIT_DIRECT): run installs every byte; there is nothing \
                 to commit",
            ));
        }
        let checked = match &self.state {
            State::Staged { checked } => *checked,
            State::Idle => return Err(Error::invalid_state("nothing is staged: run first")),
            State::Failed(why) => {
                return Err(Error::invalid_state(format!(
                    "the last call failed ({why}): run again before committing"
                )))
            }
        };
        let implicit = !group.in_scope();
        let last = self.slices.len().saturating_sub(1);
        let mut log = CallLog::default();
        self.state = State::Failed("the last commit did not finish".into());
        if !checked {
            self.check_slice(last, &mut log)
                .inspect_err(|err| self.state = State::Failed(err.message.clone()))?;
        }
        if let Some(remote) = &self.remote {
            // Nothing from other processes is installed unless all of it arrived: wait for the
            // exchange, then ask the communicator whether a peer failed meanwhile.
            let (device, stream) = (self.devices[remote.rank()], group.stream(remote.rank())?);
            log.waiting(|| self.backend.sync_stream(device, stream))
                .and_then(|()| remote.check())
                .inspect_err(|err| self.state = State::Failed(err.message.clone()))?;
        }
        let queued = group.in_implicit_scope(|| {
            // Codes a rank quantized into another rank's staging at the run are installed by that
            // other rank: it waits for the run's ranks first (the run left its join pending).
            let joined = if self.quantizing.has(When::Run) { group.join_if_pending() } else { Ok(()) };
            let mut queued = joined.and_then(|()| {
                if self.slices.is_empty() {
                    Ok(())
                } else {
                    self.queue_installs(group, last, &mut log)
                }
            });
            if queued.is_ok() && self.quantizing.has(When::Commit) {
                // The needs' staging buffers are filled once every install has run, on every rank.
                group.mark_pending_join();
                let hook = || self.options.call_hook(Stage::QuantVerify, group);
                // SAFETY: as for the installs.
                queued = group
                    .join_if_pending()
                    .and_then(|()| unsafe { self.quantizing.queue(group, When::Commit, hook) });
                if self.options.verify {
                    queued = queued.and_then(|()| {
                        log.quant_verified +=
                            log.waiting(|| self.quantizing.read_checks(group, When::Commit))?;
                        Ok(())
                    });
                }
                group.mark_pending_join();
            }
            let done = self.record_done(group);
            queued.and(done)?;
            Ok(Instant::now())
        });
        let exited = Instant::now();
        let enqueued = queued.inspect_err(|err| self.state = State::Failed(err.message.clone()))?;
        if implicit {
            log.wait_ns += (exited - enqueued).as_nanos() as u64;
        }
        self.state = State::Idle;
        // A commit reports on the bytes it installs: the last slice's, checked by the run or above.
        // Codes and scales quantized into staging were checked by the run, and are installed now.
        let verified_bytes =
            if self.options.verify { self.verified_bytes(last..self.slices.len()) } else { 0 }
                + log.quant_verified
                + self.quantizing.checked_bytes(When::Run);
        let stats = RunStats {
            descriptors_reused: true,
            verified: verified_bytes > 0,
            verified_bytes,
            installed_bytes: if self.slices.is_empty() { 0 } else { self.installed_bytes(last..last + 1) }
                + self.quantizing.live_bytes(When::Commit, true),
            quantized_elements: self.quantizing.elements_at(When::Commit),
            ..RunStats::default()
        };
        // A commit rebuilds no descriptor.
        self.finish("commit", stats, started, 0, log, implicit)
    }

    /// Fills the host times (and device times when the call waited for the device), logs the call,
    /// keeps it for [`Executor::stats`]. `prepare_ns`: the call's host time rebuilding descriptors;
    /// the rest of its host time that did not wait is enqueue time.
    fn finish(
        &mut self,
        call: &str,
        mut stats: RunStats,
        started: Instant,
        prepare_ns: u64,
        log: CallLog,
        waited: bool,
    ) -> Result<RunStats> {
        let ended = Instant::now();
        stats.wall_ns = (ended - started).as_nanos() as u64;
        stats.prepare_ns = prepare_ns;
        stats.wait_ns = log.wait_ns;
        stats.enqueue_ns = stats.wall_ns.saturating_sub(prepare_ns).saturating_sub(log.wait_ns);
        if waited {
            self.device_times(&mut stats, &log.recorded)?;
        }
        log::info!("{}", stats.summary(call));
        self.last = Some((stats, log.recorded));
        Ok(stats)
    }

    /// Device time per stage and span from the stamps of `recorded` (waits for them).
    fn device_times(&self, stats: &mut RunStats, recorded: &[Slot]) -> Result<()> {
        // The longest rank's time per (slice, stage); a rank's local and peer verifies are one stage.
        let mut longest: HashMap<(usize, Timed), u64> = HashMap::new();
        // Per rank: a reference mark, and the earliest start and latest end relative to it (its
        // streams' stages overlap, and any of them may start first).
        let mut spans: HashMap<usize, (Slot, i64, i64)> = HashMap::new();
        for &slot in recorded {
            let (start, end) = &self.marks[&slot];
            let ns = end.since(start)?;
            let stage = if slot.timed == Timed::VerifyPeer { Timed::VerifyLocal } else { slot.timed };
            let entry = longest.entry((slot.slice, stage)).or_default();
            *entry = (*entry).max(ns);
            let (reference, first, last) = spans.entry(slot.rank).or_insert((slot, 0, 0));
            let reference = &self.marks[reference].0;
            *first = (*first).min(start.offset_from(reference)?);
            *last = (*last).max(end.offset_from(reference)?);
        }
        for (_, first, last) in spans.into_values() {
            stats.device_ns = stats.device_ns.max((last - first).max(0) as u64);
        }
        for ((_, timed), ns) in longest {
            let total = match timed {
                Timed::Local => &mut stats.local_ns,
                Timed::Peer => &mut stats.peer_ns,
                Timed::VerifyLocal | Timed::VerifyPeer => &mut stats.verify_ns,
                Timed::Install => &mut stats.commit_ns,
            };
            *total += ns;
        }
        stats.device_timed = true;
        Ok(())
    }

    /// The stats of the last run or commit, with device times: waits for its device work first.
    /// InvalidState before any call.
    pub fn stats(&mut self) -> Result<RunStats> {
        let Some((mut stats, recorded)) = self.last.clone() else {
            return Err(Error::invalid_state("no run or commit has completed yet"));
        };
        if !stats.device_timed {
            self.device_times(&mut stats, &recorded)?;
            self.last = Some((stats, recorded));
        }
        Ok(stats)
    }

    /// Blocks until the work of the last call has run.
    fn wait_outstanding(&self) -> Result<()> {
        if !self.done_recorded {
            return Ok(());
        }
        for &rank in &self.ranks {
            self.backend.sync_event(self.devices[rank], self.events[rank].done)?;
        }
        Ok(())
    }

    /// Tells the executor that the caller's memory `[old_base, old_base + length)` on `device` now
    /// lives at `new_base`: the next call reads and writes the new place, with nothing planned
    /// again. Waits for the executor's queued work, then rewrites the prepared addresses in that
    /// range (the host work is proportional to the segments that touch it; a verify comparing both
    /// sides is rebuilt at the next run). See `rebind` for how buffers are named.
    ///
    /// Errors (nothing changed): InvalidDevice (not a device of the group), InvalidArgument (empty
    /// or overflowing range, ambiguous or clashing moves, a new place that is not memory of the
    /// device: checked here, once, as creation checks the plan's), NotFound (the plan uses no byte there),
    /// PlanStale (the range cuts through bytes the plan moves together: build a new plan).
    pub fn rebind(&mut self, device: i32, old_base: u64, new_base: u64, length: u64) -> Result<()> {
        if self.remote.is_some() {
            return Err(Error::unsupported(
                "an executor with routes between processes cannot follow moved buffers yet (the peers \
                 hold their addresses): build a new plan and executor",
            ));
        }
        if let Some(err) = &self.broken {
            return Err(Error::invalid_state(format!("a rebind failed earlier ({})", err.message)));
        }
        if self.quantizing.touches(old_base, length) {
            return Err(Error::unsupported(format!(
                "[{old_base:#x}, +{length:#x}) holds memory a quantized need reads or writes, and quantization jobs do                  not follow moved buffers yet: build a new plan and executor"
            )));
        }
        if !self.devices.contains(&device) {
            crate::bail!(
                Status::InvalidDevice,
                "device {device} is not one of the group's {:?}",
                self.devices
            );
        }
        self.wait_outstanding()?;
        let (batches, backend) = (&self.batches, self.backend.as_ref());
        let (refs, delta) =
            self.book.rebind_checked(device, (old_base, new_base, length), |refs, delta| {
                addresses::check_moved(backend, device, batches, refs, delta)
            })?;
        let mut touched = Vec::new();
        for r in refs {
            match r.target {
                Target::Copy(b) => {
                    self.batches[b as usize].relocate(r.index as usize, r.side, delta);
                    touched.push(b as usize);
                }
                Target::Verify(v) => self.verifies[v as usize].relocate(r.index as usize, r.side, delta),
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for b in touched {
            // SAFETY: the executor's work has drained (waited above); nothing launches it meanwhile.
            if let Err(err) = unsafe { self.batches[b].flush() } {
                self.broken = Some(err.clone());
                return Err(err);
            }
        }
        log::debug!("rebind on device {device}: [{old_base:#x}, +{length:#x}) -> {new_base:#x}");
        Ok(())
    }
}

/// The stats of the routes between processes.
fn remote_stats(stats: &mut RunStats, totals: &RemoteTotals, staged: bool) {
    let k = RouteKind::Remote as usize;
    stats.bytes[k] = totals.sent_bytes;
    stats.segments[k] = totals.sent_segments;
    if totals.sent_bytes + totals.received_bytes > 0 {
        // The batched copy moves them: writes through IPC, or packs and unpacks around the wire.
        stats.arm[k] = Method::code(Some(Method::Kernel));
    }
    if !staged {
        stats.installed_bytes += totals.received_bytes;
    }
    stats.remote_received_bytes = totals.received_bytes;
    stats.remote_ipc_bytes = totals.ipc_bytes;
    stats.remote_wire_bytes = totals.wire_bytes;
    stats.remote_ipc_peers = totals.ipc_peers;
    stats.remote_staged_peers = totals.staged_peers;
    stats.verified_bytes += totals.verified_bytes;
}

impl Drop for Executor {
    fn drop(&mut self) {
        if let Err(err) = self.wait_outstanding() {
            log::warn!("waiting for an executor's work before releasing it: {err}");
        }
        for (rank, stream) in self.peer_streams.iter().enumerate() {
            if let Some(stream) = stream {
                let _ = self.backend.sync_stream(self.devices[rank], *stream);
                self.backend.destroy_stream(self.devices[rank], *stream);
            }
        }
        for (rank, events) in self.events.iter().enumerate() {
            for event in events.all() {
                self.backend.destroy_event(self.devices[rank], event);
            }
        }
        for &(device, allocation) in &self.staging {
            // SAFETY: allocated by this executor; its work has drained.
            if let Err(err) = unsafe { self.backend.free(device, allocation) } {
                log::warn!("freeing staging on device {device}: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_by_run_length_verify_and_budget() {
        let short = Segment::contiguous(0, 1 << 40, 1 << 20);
        let long = Segment::contiguous(1 << 30, 1 << 41, 300 << 20);
        let mid = Segment::contiguous(2 << 30, 1 << 42, 32 << 20);
        let plain = (false, false);
        let auto =
            |kind, segments: &[&Segment], asked| resolve(Arm::Auto, kind, segments, true, asked).unwrap();
        assert_eq!(auto(RouteKind::Local, &[&short], plain), Method::Kernel);
        assert_eq!(auto(RouteKind::Local, &[&long], plain), Method::CopyEngine);
        assert_eq!(auto(RouteKind::Local, &[&short, &long], plain), Method::Split);
        // 32 MiB runs: long enough for the copy engine between GPUs, not on one GPU.
        assert_eq!(auto(RouteKind::Local, &[&mid], plain), Method::Kernel);
        assert_eq!(auto(RouteKind::Peer, &[&mid], plain), Method::CopyEngine);
        // Many of them on one GPU: the kernel; many 64 MiB runs: 0.3 of them to the copy engine,
        // beside the kernel.
        let runs = |len: u64| -> Vec<Segment> {
            (0..10u64).map(|i| Segment::contiguous(i << 30, (i + 16) << 30, len)).collect()
        };
        let (mids, longer) = (runs(32 << 20), runs(64 << 20));
        assert_eq!(auto(RouteKind::Local, &mids.iter().collect::<Vec<_>>(), plain), Method::Kernel);
        assert_eq!(auto(RouteKind::Local, &longer.iter().collect::<Vec<_>>(), plain), Method::Split);
        assert_eq!(auto(RouteKind::Local, &[&short, &long], (true, false)), Method::Kernel);
        assert_eq!(auto(RouteKind::Local, &[&short, &long], (false, true)), Method::CopyEngine);
        assert_eq!(auto(RouteKind::Local, &[&short], (true, true)), Method::Kernel);
        // No direct peer access: the copy engine, and the kernel arm is refused.
        assert_eq!(resolve(Arm::Auto, RouteKind::Peer, &[&short], false, plain).unwrap(), Method::CopyEngine);
        let refused = resolve(Arm::Kernel, RouteKind::Peer, &[&short], false, plain).unwrap_err();
        assert_eq!(refused.status, Status::Unsupported);
    }
}
