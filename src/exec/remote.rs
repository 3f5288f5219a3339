//! Routes between processes, for an executor made with a communicator (a plan share built across
//! processes, whose process indices are the communicator's ranks).
//!
//! What this process sends to another and receives from it moves, per pair of processes:
//! - through CUDA IPC where both share a machine and the receiver's memory opens in the sender
//!   (`transport::ipc::connect`): the sender's batched kernel writes straight into the receiver's
//!   buffers, no staging;
//! - otherwise through bounded staging over the communicator (`transport::staged`): pack with the
//!   batched kernel, NCCL send/recv, unpack with the batched kernel; exactly the segments' bytes on
//!   the wire.
//!
//! Every route between processes runs on the group stream of the communicator's device, whose rank
//! both ends must be (the routes' local endpoints are checked at creation). With all-or-nothing
//! commit, bytes from other processes land in a landing buffer of this process (packed, one region
//! per sending process, whose address the sender learns at creation) and are installed from there by
//! the commit, with this process's own installs.
//!
//! IPC writes cross into another process's memory, which stream order cannot cover: when any pair
//! of the communicator uses IPC, every process meets every other twice per run on the host (through
//! the communicator), once its streams have reached the step (so the receivers' buffers may be
//! overwritten) and once the writes are done (so the receivers may read them).
//!
//! Codes and scales that this process quantizes for another (`super::sender`) are segments of the
//! pair like any other bytes, after the plan's routes between them, laid out alike at both ends.
//! Through CUDA IPC the quantizing kernel writes them itself, between the meetings; otherwise they
//! go from the sender's send buffer.
//!
//! Verify: the writer of IPC writes checks them through the opened memory (a recording copy, then a
//! check of the destinations). Bytes through staging are checked end to end: the sender digests its
//! sources, the receiver digests where they landed, tile by tile over the same segments, and the
//! digests travel over the communicator in one more meeting per run (8 bytes per kernel tile of
//! 8 to 64 KiB, at most 0.1% of the payload; per segment on the host backend). The receiver's run
//! reports a difference. Both ends take part, so the processes that exchange bytes through staging
//! must all ask for verify or all not; creation checks that on every rank.

use super::flows::rank_of;
use super::options::{CommitMode, ExecOptions, Stage};
use super::sender::{self, incoming, Outgoing};
use crate::bail;
use crate::error::{try_vec, Error, Result, Status};
use crate::group::Group;
use crate::plan::{Endpoint, Plan, RouteKind};
use crate::segment::check::validate;
use crate::segment::Segment;
use crate::transport::comm::Communicator;
use crate::transport::ipc;
use crate::transport::staged::{Flow, StagedExchange};
use crate::transport::{
    Backend, BackendKind, PreparedCheck, PreparedCopy, PreparedDigestCheck, PreparedRecord,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What the routes between processes amount to, for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteTotals {
    /// Payload bytes and segments this process sends to others.
    pub sent_bytes: u64,
    pub sent_segments: u64,
    /// Payload bytes this process receives from others.
    pub received_bytes: u64,
    /// Payload bytes sent through CUDA IPC (written into the receivers' memory).
    pub ipc_bytes: u64,
    /// Payload bytes sent through staging over the communicator: the bytes on the wire.
    pub wire_bytes: u64,
    /// Of `ipc_bytes`: codes and scales that this process's quantizing kernel writes straight into
    /// the receivers' memory (the sender path without a send buffer).
    pub quantized_straight_bytes: u64,
    /// Peers exchanged with (either way) through IPC, and through staging.
    pub ipc_peers: u32,
    pub staged_peers: u32,
    /// Payload bytes each verified run checks: IPC writes (by this process, the writer) and bytes
    /// received through staging (by this process, the receiver).
    pub verified_bytes: u64,
}

/// One pair's IPC writes, with their verify when asked.
struct Write {
    peer: usize,
    batch: Box<dyn PreparedCopy>,
    verify: Option<Box<dyn PreparedCheck>>,
    /// The segments as planned (destinations in the receiver's live buffers), for messages.
    planned: Vec<Segment>,
}

/// The check of what one peer sends through staging, against the digests it took of its sources.
struct StagedCheck {
    peer: usize,
    check: Box<dyn PreparedDigestCheck>,
    /// The segments as planned, for messages.
    planned: Vec<Segment>,
}

pub(crate) struct Remote {
    comm: Arc<Communicator>,
    backend: Arc<dyn Backend>,
    /// The group rank (and device) of the communicator's device: every remote route runs there.
    rank: usize,
    device: i32,
    writes: Vec<Write>,
    /// Dropped before `landing` and `outgoing` (fields drop in order): it drains the streams that
    /// write and read there.
    exchange: StagedExchange,
    /// What this process quantizes for others: the jobs (queued by the executor, before
    /// [`Remote::run`] or within it) and the send buffer.
    outgoing: Outgoing,
    /// The peers' memory the straight jobs write into, kept open for them (the batches of the
    /// other IPC writes hold theirs).
    _opened_for_straight: Vec<Arc<ipc::Opened>>,
    /// Staged commit: where bytes from other processes land (held for its drop), and the installs
    /// from there.
    landing: Option<LandingBuffer>,
    installs: Vec<Segment>,
    /// Some pair of the communicator uses IPC: every run meets the other processes twice.
    handshake: bool,
    /// Verify of the bytes through staging: digests of what this process sends (one record per
    /// receiving peer), and checks of what it receives (one per sending peer).
    records: Vec<(usize, Box<dyn PreparedRecord>)>,
    checks: Vec<StagedCheck>,
    /// Some process verifies bytes through staging: every run meets once more to hand over digests.
    digest_meeting: bool,
    /// The executor's options, for its test hook (called before the checks of bytes through
    /// staging).
    options: ExecOptions,
    pub totals: RemoteTotals,
}

/// Device memory bytes from other processes land in, freed on drop (the executor has waited for
/// its work by then).
struct LandingBuffer {
    backend: Arc<dyn Backend>,
    device: i32,
    allocation: u64,
    /// The bytes that land (the allocation holds 16 more, for alignment).
    bytes: u64,
}

impl Drop for LandingBuffer {
    fn drop(&mut self) {
        // SAFETY: ours; the work writing it has drained.
        if let Err(err) = unsafe { self.backend.free(self.device, self.allocation) } {
            log::warn!("freeing the landing of bytes from other processes: {err}");
        }
    }
}

/// `segments` with their destinations packed from `base` (16-byte aligned) in order, run after run,
/// each segment from a 16-byte boundary (where a sender's quantizing kernel may write its codes and
/// scales itself), and the installs from there into the original destinations.
fn landed(segments: &[Segment], base: u64) -> (Vec<Segment>, Vec<Segment>) {
    let mut at = base;
    let mut into = Vec::with_capacity(segments.len());
    let mut out = Vec::with_capacity(segments.len());
    for s in segments {
        let packed = [s.len, s.len * s.count[0]];
        into.push(Segment { dst: at, dst_stride: packed, ..*s });
        out.push(Segment { src: at, src_stride: packed, ..*s });
        at += s.bytes().unwrap_or(0).next_multiple_of(16);
    }
    (into, out)
}

/// Bytes [`landed`] lays `segments` out in.
fn landed_size(segments: &[Segment]) -> u64 {
    segments.iter().map(|s| s.bytes().unwrap_or(0).next_multiple_of(16)).sum()
}

/// Bytes of `segments`.
fn bytes(segments: &[Segment]) -> u64 {
    segments.iter().map(|s| s.bytes().unwrap_or(0)).sum()
}

impl Remote {
    /// The routes of `plan` between `process` and the other processes of `comm`, prepared: a
    /// collective call (every process of the communicator makes it, creating its executor).
    pub fn prepare(
        group: &Group,
        plan: &Plan,
        process: u32,
        comm: Arc<Communicator>,
        options: &ExecOptions,
    ) -> Result<Remote> {
        if comm.rank() as u64 != u64::from(process) {
            bail!(
                Status::InvalidArgument,
                "process {process} but the communicator's rank is {}: a plan across processes numbers \
                 them by communicator rank",
                comm.rank()
            );
        }
        let device = comm.device();
        let here = Endpoint { process, device: device as u32 };
        let rank = rank_of(group, here)?;
        let (mut sends, mut recvs): (BTreeMap<usize, Vec<Segment>>, BTreeMap<usize, Vec<Segment>>) =
            Default::default();
        for route in plan.routes().iter().filter(|r| r.kind() == RouteKind::Remote) {
            let (local, peer, into) = if route.src.process == process {
                (route.src, route.dst.process, &mut sends)
            } else if route.dst.process == process {
                (route.dst, route.src.process, &mut recvs)
            } else {
                continue;
            };
            if local != here {
                bail!(
                    Status::Unsupported,
                    "a route between processes {} and {} uses device {} of this process; routes between \
                     processes must start or end on the communicator's device ({device})",
                    route.src.process,
                    route.dst.process,
                    local.device
                );
            }
            if peer as usize >= comm.size() {
                bail!(
                    Status::InvalidArgument,
                    "a route names process {peer}; the communicator has {}",
                    comm.size()
                );
            }
            validate(&route.segments)?;
            into.entry(peer as usize).or_default().extend(route.segments.iter().filter(|s| s.runs() > 0));
        }
        let backend = Arc::clone(group.backend());
        // Codes and scales quantized by the sender, after the pair's plain routes at both ends (their
        // sources in this process are set once it is known how each pair takes them).
        let quantized_there = sender::outgoing(plan, here)?;
        let plain_sends: BTreeMap<usize, usize> =
            quantized_there.keys().map(|&peer| (peer, sends.get(&peer).map_or(0, Vec::len))).collect();
        let quantized_here = incoming(plan, here)?;
        let quantized_sends: BTreeMap<usize, Vec<Segment>> =
            quantized_there.iter().map(|(&peer, planned)| (peer, planned.segments())).collect();
        for (lists, into) in [(&quantized_sends, &mut sends), (&quantized_here, &mut recvs)] {
            for (&peer, segments) in lists {
                if peer >= comm.size() {
                    bail!(
                        Status::InvalidArgument,
                        "a quantized need's route names process {peer}; the communicator has {}",
                        comm.size()
                    );
                }
                into.entry(peer).or_default().extend_from_slice(segments);
            }
        }
        if comm.kind() == BackendKind::Cuda && backend.kind() == BackendKind::Host {
            bail!(
                Status::InvalidArgument,
                "an NCCL communicator moves device memory, and this group's backend is the host's"
            );
        }
        let staged_commit = options.commit == CommitMode::Staged;
        // Where each sender's bytes land here: the live buffers (direct), or its region of the
        // landing buffer (staged commit). Senders learn their region's address.
        let received: u64 = recvs.values().map(|s| landed_size(s)).sum();
        let landing = if staged_commit && received > 0 {
            let size = usize::try_from(received + 16)
                .map_err(|_| Error::new(Status::OutOfMemory, "landing larger than the address space"))?;
            let allocation = backend.alloc(device, size)?;
            Some(LandingBuffer { backend: Arc::clone(&backend), device, allocation, bytes: received })
        } else {
            None
        };
        let mut totals = RemoteTotals::default();
        let (mut writes, mut installs) = (Vec::new(), Vec::new());
        let mut targets: BTreeMap<usize, Vec<Segment>> = BTreeMap::new();
        let mut bases: Vec<u8> = Vec::new();
        let mut at = landing.as_ref().map(|l| l.allocation.next_multiple_of(16));
        for (&peer, segments) in &recvs {
            let target = match at {
                Some(base) => {
                    let (into, out) = landed(segments, base);
                    installs.extend(out);
                    at = Some(base + landed_size(segments));
                    bases.extend_from_slice(&(peer as u64).to_le_bytes());
                    bases.extend_from_slice(&base.to_le_bytes());
                    into
                }
                None => segments.clone(),
            };
            targets.insert(peer, target);
        }
        let all_bases = comm.allgather_bytes(&bases)?;
        let landing_for = |peer: usize| -> Option<u64> {
            all_bases[peer].chunks_exact(16).find_map(|e| {
                let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
                (word(&e[..8]) == process as u64).then(|| word(&e[8..]))
            })
        };
        let mut sent: BTreeMap<usize, Vec<Segment>> = sends
            .iter()
            .map(|(&peer, segments)| {
                let target = match landing_for(peer) {
                    Some(base) => landed(segments, base).0,
                    None => segments.clone(),
                };
                (peer, target)
            })
            .collect();

        // IPC where the pair can; the rest through staging.
        // Only the bytes the writers touch: a strided segment's footprint may span gaps between
        // this process's buffers, which are no memory that could be shared.
        let spans = targets.values().flatten().try_fold(0u64, |n, s| n.checked_add(s.destination_spans()));
        let spans = spans.and_then(|n| usize::try_from(n).ok()).unwrap_or(usize::MAX);
        let mut mine: Vec<(u64, u64)> = try_vec(spans, "the ranges of this process that peers write")?;
        for s in targets.values().flatten() {
            s.for_each_destination_span(|addr, len| mine.push((addr, len)));
        }
        let writers: Vec<usize> = recvs.keys().copied().collect();
        let owners: Vec<usize> = sends.keys().copied().collect();
        let peers = ipc::connect(&comm, backend.kind(), device, &mine, &writers, &owners)?;

        // Codes and scales for other processes: straight into the receiver's memory where CUDA IPC
        // opened it and the kernel can write there, else through the send buffer, whose addresses
        // become the sources of those segments.
        let mut outgoing = Outgoing::default();
        let (mut opened_for_straight, mut straight) = (Vec::new(), Vec::new());
        let mut through_buffer: Vec<(usize, &sender::Planned)> = Vec::new();
        for (&peer, planned) in &quantized_there {
            let opened = peers.opened.get(&peer).filter(|_| backend.kind() == BackendKind::Cuda);
            match opened
                .and_then(|o| Some((o, sender::straight(o, planned, &sent[&peer][plain_sends[&peer]..])?)))
            {
                Some((opened, jobs)) => {
                    totals.quantized_straight_bytes += bytes(&sent[&peer][plain_sends[&peer]..]);
                    opened_for_straight.push(Arc::clone(opened));
                    straight.push(peer);
                    outgoing.straight.jobs.extend(jobs);
                    outgoing.straight.labels.extend_from_slice(&planned.labels);
                }
                None => through_buffer.push((peer, planned)),
            }
        }
        let lists: Vec<&sender::Planned> = through_buffer.iter().map(|&(_, p)| p).collect();
        let mut from_buffer = outgoing.buffer(&backend, device, &lists)?.into_iter();
        for &(peer, planned) in &through_buffer {
            let first = plain_sends[&peer];
            let pairs = first..first + 2 * planned.jobs.len();
            for (k, buffered) in pairs.zip(from_buffer.by_ref()) {
                sends.get_mut(&peer).expect("listed above")[k].src = buffered.src;
                sent.get_mut(&peer).expect("listed above")[k].src = buffered.src;
            }
        }

        let (mut staged_sends, mut staged_recvs) = (Vec::new(), Vec::new());
        let (mut records, mut checks) = (Vec::new(), Vec::new());
        for (&peer, planned) in &sends {
            totals.sent_bytes += bytes(planned);
            totals.sent_segments += planned.len() as u64;
            match peers.opened.get(&peer) {
                Some(opened) => {
                    // The quantizing kernel writes (and verifies) the codes and scales of a pair it
                    // takes straight; the batch, the rest.
                    let copied = if straight.contains(&peer) { plain_sends[&peer] } else { planned.len() };
                    totals.ipc_bytes += bytes(planned);
                    if copied > 0 {
                        let batch = opened.prepare_writes(&sent[&peer][..copied], options.verify)?;
                        let verify = if options.verify { Some(batch.verify_destinations()?) } else { None };
                        totals.verified_bytes += if options.verify { bytes(&planned[..copied]) } else { 0 };
                        writes.push(Write { peer, batch, verify, planned: planned[..copied].to_vec() });
                    }
                }
                None => {
                    totals.wire_bytes += bytes(planned);
                    staged_sends.push(Flow { peer, segments: planned.clone() });
                    if options.verify {
                        // The segments the receiver checks: where the bytes land there.
                        records.push((peer, backend.prepare_digest_record(device, &sent[&peer])?));
                    }
                }
            }
        }
        for (&peer, target) in &targets {
            totals.received_bytes += bytes(target);
            if !peers.writers.contains(&peer) {
                staged_recvs.push(Flow { peer, segments: target.clone() });
                if options.verify {
                    let check = backend.prepare_digest_check(device, target)?;
                    checks.push(StagedCheck { peer, check, planned: recvs[&peer].clone() });
                    totals.verified_bytes += bytes(target);
                }
            }
        }
        let ipc_with: std::collections::BTreeSet<usize> =
            peers.opened.keys().chain(peers.writers.iter()).copied().collect();
        let staged_with: std::collections::BTreeSet<usize> =
            staged_sends.iter().chain(&staged_recvs).map(|f| f.peer).collect();
        totals.ipc_peers = ipc_with.len() as u32;
        totals.staged_peers = staged_with.len() as u32;
        // A host-backend communicator can coordinate IPC between GPU processes, but its transfers
        // move host memory: device bytes cannot take staging over it. Every rank learns whether any
        // pair would have to, and all fail alike (a failure on some ranks only would leave the
        // others waiting for them).
        let host_comm_for_devices = comm.kind() == BackendKind::Host && backend.kind() == BackendKind::Cuda;
        let stages = !(staged_sends.is_empty() && staged_recvs.is_empty());
        let cannot_stage = host_comm_for_devices && stages;
        let uses_ipc = !ipc_with.is_empty();
        let mut flags =
            vec![u8::from(uses_ipc), u8::from(cannot_stage), u8::from(stages), u8::from(options.verify)];
        if cannot_stage {
            flags
                .extend_from_slice(staging_reasons(process, &staged_sends, &staged_recvs, &peers).as_bytes());
        }
        let flags = comm.allgather_bytes(&flags)?;
        let stuck: Vec<String> = flags
            .iter()
            .enumerate()
            .filter(|(_, f)| f.get(1) == Some(&1))
            .map(|(rank, f)| {
                format!("process {rank}: {}", String::from_utf8_lossy(f.get(4..).unwrap_or_default()))
            })
            .collect();
        if !stuck.is_empty() {
            bail!(
                Status::Unsupported,
                "bytes between processes that cannot go through CUDA IPC, and a host-backend communicator \
                 cannot carry device memory (use an NCCL communicator): {}",
                stuck.join("; ")
            );
        }
        // Bytes through staging are verified end to end, by both of their processes: they must agree,
        // and every rank learns here whether they do (none would otherwise until a receiver's run).
        let staging_verify: Vec<(usize, bool)> = flags
            .iter()
            .enumerate()
            .filter(|(_, f)| f.get(2) == Some(&1))
            .map(|(rank, f)| (rank, f.get(3) == Some(&1)))
            .collect();
        if staging_verify.iter().any(|&(_, on)| on) && staging_verify.iter().any(|&(_, on)| !on) {
            let with = |on: bool| -> Vec<String> {
                staging_verify.iter().filter(|&&(_, v)| v == on).map(|(rank, _)| rank.to_string()).collect()
            };
            bail!(
                Status::InvalidArgument,
                "processes that exchange bytes through staging create their executors with verify on in \
                 processes {} and off in processes {}: all of them must ask for the same",
                with(true).join(", "),
                with(false).join(", ")
            );
        }
        let handshake = flags.iter().any(|f| f.first() == Some(&1));
        let digest_meeting = staging_verify.iter().any(|&(_, on)| on);
        let staging = comm.options().staging_bytes;
        let exchange = StagedExchange::prepare(
            &comm,
            Arc::clone(&backend),
            device,
            &staged_sends,
            &staged_recvs,
            staging,
        )?;
        Ok(Remote {
            comm,
            backend,
            rank,
            device,
            writes,
            exchange,
            outgoing,
            _opened_for_straight: opened_for_straight,
            landing,
            installs,
            handshake,
            records,
            checks,
            digest_meeting,
            options: options.clone(),
            totals,
        })
    }

    /// The group rank every route between processes runs on.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator the routes run over.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// What this process quantizes for others.
    pub fn outgoing(&self) -> &Outgoing {
        &self.outgoing
    }

    /// Bytes of the buffer that bytes from other processes land in (staged commit; else 0).
    pub fn landing_bytes(&self) -> u64 {
        self.landing.as_ref().map_or(0, |l| l.bytes)
    }

    /// The installs from the landing buffer into the live buffers (staged commit).
    pub fn installs(&self) -> &[Segment] {
        &self.installs
    }

    /// Queues this process's part of the routes between processes on its rank's group stream, after
    /// the work queued there so far (see the module docs for the meetings IPC needs). `write_straight`
    /// queues the quantizing that writes into other processes' memory ([`Outgoing::straight`]) on
    /// that stream, once the peers' buffers may be written.
    ///
    /// # Safety
    /// Every address of the routes (sources here, destinations here or in the peers) is live memory
    /// until the work has run.
    pub unsafe fn run(&self, group: &Group, write_straight: impl FnOnce() -> Result<()>) -> Result<()> {
        self.comm.check()?;
        let stream = group.stream(self.rank)?;
        if self.handshake {
            self.backend.sync_stream(self.device, stream)?;
            self.comm.allgather_bytes(b"refit: ready for writes")?;
        }
        let mut queued = write_straight();
        for write in &self.writes {
            queued = queued.and_then(|()| write.batch.launch(stream));
            if let Some(verify) = &write.verify {
                queued = queued.and_then(|()| verify.launch(stream));
            }
        }
        if self.handshake {
            // Meet even after a failure here, so that the peers do not wait for this process.
            let landed = queued.and_then(|()| self.backend.sync_stream(self.device, stream));
            let met = self.comm.allgather_bytes(b"refit: writes done");
            landed?;
            met?;
            self.check_writes()?;
        } else {
            queued?;
        }
        self.exchange.run(&self.comm, stream)?;
        if self.digest_meeting {
            self.verify_staged(group, stream)?;
        }
        Ok(())
    }

    /// The end-to-end check of the bytes through staging (see the module docs), once the exchange
    /// is queued on `stream`: digests of this process's sources for its receivers, then the check of
    /// what it received against its senders' digests. Every process meets here, whatever fails.
    ///
    /// # Safety
    /// As for [`Remote::run`].
    unsafe fn verify_staged(&self, group: &Group, stream: crate::transport::Stream) -> Result<()> {
        let recorded = (|| {
            for (_, record) in &self.records {
                // SAFETY: the caller's promise on the sources.
                unsafe { record.launch(stream) }?;
            }
            self.backend.sync_stream(self.device, stream)?;
            let mut out = Vec::new();
            for (peer, record) in &self.records {
                encode_digests(&mut out, *peer, &record.digests()?);
            }
            Ok(out)
        })();
        // A process that failed sends no digests; its receivers report ABORTED, and it its own error.
        let all = self.comm.allgather_bytes(recorded.as_deref().unwrap_or_default())?;
        recorded?;
        self.options.call_hook(Stage::Verify { slice: 0 }, group)?;
        let me = self.comm.rank() as u64;
        for staged in &self.checks {
            let Some(digests) = digests_for(&all[staged.peer], me)? else {
                bail!(
                    Status::Aborted,
                    "process {} failed before it sent the digests of the bytes it stages to process {me}",
                    staged.peer
                );
            };
            staged.check.expect(&digests)?;
            // SAFETY: the caller's promise on the destinations; the exchange has run.
            unsafe { staged.check.launch(stream) }?;
        }
        self.backend.sync_stream(self.device, stream)?;
        for staged in &self.checks {
            if let Some(index) = staged.check.outcome()? {
                let planned = staged.planned[index];
                bail!(
                    Status::VerifyMismatch,
                    "{} bytes received from process {} at {:#x} (segment {index} of the routes from it, through \
                     staging) differ from their source",
                    planned.bytes().unwrap_or(0),
                    staged.peer,
                    planned.dst
                );
            }
        }
        Ok(())
    }

    /// The outcome of the IPC writes' verify (the writes have run).
    fn check_writes(&self) -> Result<()> {
        for write in &self.writes {
            let Some(verify) = &write.verify else { continue };
            if let Some(index) = verify.outcome()? {
                let planned = write.planned[index];
                bail!(
                    Status::VerifyMismatch,
                    "{} bytes written into process {} at {:#x} (segment {index} of the routes to it) differ \
                     from their source after the copy",
                    planned.bytes().unwrap_or(0),
                    write.peer,
                    planned.dst
                );
            }
        }
        Ok(())
    }

    /// The communicator's failure, if any (a peer that timed out, exited or aborted).
    pub fn check(&self) -> Result<()> {
        self.comm.check()
    }
}

/// Appends the digests for process `receiver` to `out`: its index, their count, the digests, each
/// a little-endian u64.
fn encode_digests(out: &mut Vec<u8>, receiver: usize, digests: &[u64]) {
    out.extend_from_slice(&(receiver as u64).to_le_bytes());
    out.extend_from_slice(&(digests.len() as u64).to_le_bytes());
    digests.iter().for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
}

/// The digests a sender's bytes (from [`encode_digests`]) hold for process `receiver`, if any.
/// DECODE_ERROR for bytes that are not such a list.
fn digests_for(bytes: &[u8], receiver: u64) -> Result<Option<Vec<u64>>> {
    let word = |at: usize| -> Result<u64> {
        bytes
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .ok_or_else(|| Error::new(Status::DecodeError, "a peer's digests end early"))
    };
    let mut at = 0;
    while at < bytes.len() {
        let (peer, count) = (word(at)?, word(at + 8)?);
        let end = usize::try_from(count)
            .ok()
            .and_then(|n| n.checked_mul(8))
            .and_then(|n| n.checked_add(at + 16))
            .filter(|&end| end <= bytes.len())
            .ok_or_else(|| Error::new(Status::DecodeError, "a peer's digests end early"))?;
        if peer == receiver {
            return (at + 16..end).step_by(8).map(word).collect::<Result<Vec<u64>>>().map(Some);
        }
        at = end;
    }
    Ok(None)
}

/// Why each pair of `staged_sends` and `staged_recvs` is not IPC, for the error that a host-backend
/// communicator cannot stage device memory.
fn staging_reasons(process: u32, sends: &[Flow], recvs: &[Flow], peers: &ipc::Peers) -> String {
    let sends = sends.iter().map(|f| {
        let why = peers.not_opened.get(&f.peer).map_or("not opened", String::as_str);
        format!("to process {} ({} bytes): {why}", f.peer, bytes(&f.segments))
    });
    let recvs = recvs.iter().map(|f| {
        format!(
            "from process {} ({} bytes): it did not open process {process}'s memory (its reason is \
             listed under it)",
            f.peer,
            bytes(&f.segments)
        )
    });
    sends.chain(recvs).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn landing_packs_each_segment_from_16_bytes_and_installs_it_back() {
        let s =
            Segment { src: 100, dst: 5000, len: 3, count: [2, 2], src_stride: [4, 10], dst_stride: [7, 30] };
        let t = Segment::contiguous(200, 9000, 5);
        let (into, out) = landed(&[s, t], 1 << 20);
        assert_eq!(into[0], Segment { dst: 1 << 20, dst_stride: [3, 6], ..s });
        // Each segment from a 16-byte boundary: the first's 12 bytes, then 4 of padding.
        assert_eq!(into[1], Segment { dst: (1 << 20) + 16, dst_stride: [5, 5], ..t });
        assert_eq!(out[0], Segment { src: 1 << 20, src_stride: [3, 6], ..s });
        assert_eq!(out[1].dst, 9000);
        assert_eq!(landed_size(&[s, t]), 32);
        // Every byte lands exactly once, each segment's densely.
        let mut landed_bytes = Vec::new();
        for seg in &into {
            seg.for_each_run(|_, dst, len| landed_bytes.extend(dst..dst + len));
        }
        landed_bytes.sort_unstable();
        let base = 1u64 << 20;
        assert_eq!(landed_bytes, (base..base + 12).chain(base + 16..base + 21).collect::<Vec<u64>>());
    }

    #[test]
    fn digests_reach_their_receiver_and_cut_bytes_are_refused() {
        let mut bytes = Vec::new();
        encode_digests(&mut bytes, 2, &[7, 8, 9]);
        encode_digests(&mut bytes, 5, &[]);
        encode_digests(&mut bytes, 1, &[u64::MAX]);
        assert_eq!(digests_for(&bytes, 2).unwrap(), Some(vec![7, 8, 9]));
        assert_eq!(digests_for(&bytes, 5).unwrap(), Some(vec![]));
        assert_eq!(digests_for(&bytes, 1).unwrap(), Some(vec![u64::MAX]));
        assert_eq!(digests_for(&bytes, 3).unwrap(), None);
        assert_eq!(digests_for(&[], 0).unwrap(), None);
        for cut in 1..bytes.len() {
            // Every cut either ends cleanly before the entry for process 1, or is refused.
            match digests_for(&bytes[..cut], 1) {
                Ok(found) => assert_eq!(found, None, "cut at {cut}"),
                Err(err) => assert_eq!(err.status, Status::DecodeError, "cut at {cut}"),
            }
        }
        let mut huge = Vec::new();
        encode_digests(&mut huge, 0, &[1]);
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(digests_for(&huge, 0).unwrap_err().status, Status::DecodeError);
    }

    #[test]
    fn each_pair_that_is_not_ipc_says_why() {
        let peers = ipc::Peers {
            opened: Default::default(),
            writers: Default::default(),
            not_opened: [(2, "rank 2's memory cannot be opened by rank 0: cuIpcOpenMemHandle failed".into())]
                .into(),
        };
        let flow = |peer| Flow { peer, segments: vec![Segment::contiguous(0, 4096, 100)] };
        let reasons = staging_reasons(0, &[flow(2), flow(3)], &[flow(1)], &peers);
        assert_eq!(
            reasons,
            "to process 2 (100 bytes): rank 2's memory cannot be opened by rank 0: cuIpcOpenMemHandle failed, \
             to process 3 (100 bytes): not opened, from process 1 (100 bytes): it did not open process 0's \
             memory (its reason is listed under it)"
        );
    }
}
