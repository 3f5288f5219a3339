//! The quantizing stage of a step: the plan's quantization jobs (`plan::QuantRoute`), run on the
//! runner's group stream once every copy of the step has landed.
//!
//! - Sender path (`super::sender`): jobs quantizing for another process run at the start of every
//!   run, into the send buffer, before the routes between processes carry what they wrote; or,
//!   through CUDA IPC, within those routes, straight into the receiver's memory.
//! - Direct commit: every other job runs at the end of the run, writing the live codes and scales.
//! - Staged commit: jobs reading sources in place write into quantization staging the executor owns
//!   on the receiver, which the commit installs with the step's other bytes (codes and scales are
//!   segments of the last slice's install); jobs reading a need's staging buffer run at the commit,
//!   after the install has filled that buffer, so nothing live is written before the commit.

use super::flows::{rank_of, RankFlow};
use super::sender::Outgoing;
use crate::error::{Error, Result, Status};
use crate::group::Group;
use crate::plan::{AmaxExchange, Plan, QuantPath};
use crate::quant::job::{exchanges_amax, merge_amaxes, scale_owners, Amaxes};
use crate::quant::{check_jobs, QuantJob};
use crate::segment::check::check_destinations;
use crate::segment::Segment;
use crate::transport::access::first_unusable;
use crate::transport::comm::Communicator;
use crate::transport::verify::PreparedVerify;
use crate::transport::{Backend, PreparedQuantize, Stream};
use std::sync::Arc;

/// When a group of jobs runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum When {
    /// At the start of every run, before the routes between processes (the sender path, into its
    /// send buffer).
    Send,
    /// Within the routes between processes, with the IPC writes (the sender path, straight into the
    /// receiver's memory).
    Straight,
    /// At the end of every run, after its copies.
    Run,
    /// At the commit, after the installs (staged commit).
    Commit,
}

/// A job's tensor and receiving device, for messages.
pub(super) type Label = (String, u32);

/// Which jobs run together: the runner's rank, when, and whether they read their sources in place.
type Gathering = (usize, When, bool);

/// Jobs gathered under a key, with their labels.
type Gathered<K> = Vec<(K, Vec<QuantJob>, Vec<Label>)>;

/// The jobs one rank runs at one point of the step.
pub(super) struct RankJobs {
    pub rank: usize,
    pub when: When,
    pub jobs: Vec<QuantJob>,
    /// The jobs prepared on the rank's device (laid out and uploaded once, at creation).
    prepared: Arc<dyn PreparedQuantize>,
    /// Jobs reading sources in place (which no copy of the step writes): they need not wait for the
    /// step's copies.
    in_place: bool,
    /// Queued by a copy stage of the rank, in its launch ([`Quantizing::ride`]), rather than after
    /// the copies.
    carried: bool,
    labels: Vec<Label>,
    /// Bytes of codes and scales the jobs write (a shared scale once), counted at creation.
    written: u64,
    /// With verify: the same jobs into scratch, compared with what the jobs wrote.
    check: Option<Check>,
    /// Some job shares an amax exchanged between devices at every run ([`AmaxExchange`]).
    exchanges: bool,
}

/// The verify of one rank's jobs: each job quantized again into scratch of the rank's device, then
/// its codes and scales compared on the device with that second quantization of the same sources.
struct Check {
    /// The jobs into scratch, prepared on the rank's device.
    prepared: Box<dyn PreparedQuantize>,
    /// From the scratch to what the jobs wrote: for segment i, [`Check::compared`]`[i]` is 2j for job
    /// j's codes, 2j + 1 for its scales.
    compare: PreparedVerify,
    compared: Vec<usize>,
    bytes: u64,
}

/// Everything the executor quantizes.
#[derive(Default)]
pub(super) struct Quantizing {
    pub ranks: Vec<RankJobs>,
    /// Install segments per receiving rank: quantization staging into the live codes and scales.
    pub installs: Vec<(usize, Vec<Segment>)>,
    /// (device, allocation) of each quantization staging buffer.
    pub staging: Vec<(i32, u64)>,
    /// Bytes of those buffers (quantization staging and the verify's scratch), summed.
    pub staging_bytes: u64,
}

impl Quantizing {
    /// The jobs of `process`'s receivers in `plan`, checked (the jobs of all needs together write no
    /// byte twice; every byte they touch is memory of the device that runs them, or of a device it
    /// reaches directly) and, under staged commit, given their staging; and `outgoing`'s jobs for
    /// other processes, on `rank`.
    pub fn new(
        group: &Group,
        plan: &Plan,
        process: u32,
        (staged, verify): (bool, bool),
        flows: &[RankFlow],
        outgoing: Option<(usize, &Outgoing)>,
    ) -> Result<Quantizing> {
        let mut out = Quantizing::default();
        let mine = plan.quant_routes().iter().filter(|r| r.receiver.process == process);
        // Codes and scales other processes quantize for this one land here too: checked with the rest.
        let all: Vec<QuantJob> = mine.clone().flat_map(|r| r.jobs.iter().copied()).collect();
        if !all.is_empty() {
            check_jobs(&all)
                .map_err(|e| Error::new(e.status, format!("the plan's quantized needs: {}", e.message)))?;
            check_apart(&all, flows)?;
        }
        let routes: Vec<_> = mine.filter(|r| r.path != QuantPath::Sender).collect();
        let mut gathered: Gathered<Gathering> = Vec::new();
        if let Some((rank, sent)) = outgoing {
            let device = group.device(rank)?;
            let ways = [(When::Send, &sent.buffered), (When::Straight, &sent.straight)];
            for (when, planned) in ways.into_iter().filter(|(_, p)| !p.jobs.is_empty()) {
                // The straight jobs' codes and scales are another process's memory, opened here.
                let what = if when == When::Straight { Regions::Sources } else { Regions::All };
                for (job, (tensor, _)) in planned.jobs.iter().zip(&planned.labels) {
                    check_memory(group.backend().as_ref(), device, tensor, std::slice::from_ref(job), what)?;
                }
                gathered.push(((rank, when, true), planned.jobs.clone(), planned.labels.clone()));
            }
        }
        for route in &routes {
            let runner = rank_of(group, route.runner)?;
            let receiver = rank_of(group, route.receiver)?;
            if runner != receiver && !group.all_peers_direct() {
                crate::bail!(
                    Status::Unsupported,
                    "quantized need of tensor '{}': device {} quantizes in place for device {} but cannot write its \
                     memory (no peer access); give the need a staging buffer",
                    route.name(),
                    route.runner.device,
                    route.receiver.device
                );
            }
            let device = group.device(runner)?;
            check_memory(group.backend().as_ref(), device, &route.name(), &route.jobs, Regions::All)?;
        }
        // Each runner's jobs at each point of the step, in place or not, gathered over the routes,
        // then prepared. Under staged commit, jobs in place write quantization staging on their
        // receiver instead, packed per (runner, receiver) so that jobs sharing a scale share it there.
        let mut to_pack: Gathered<(usize, usize)> = Vec::new();
        for route in routes {
            let runner = rank_of(group, route.runner)?;
            let receiver = rank_of(group, route.receiver)?;
            let in_place = route.path == QuantPath::Direct;
            let labels = vec![(route.name().into_owned(), route.receiver.device); route.jobs.len()];
            let when = match (staged, route.path) {
                (false, _) => When::Run,
                (true, QuantPath::Staged) => When::Commit,
                (true, _) => {
                    gather(&mut to_pack, (runner, receiver), route.jobs.clone(), labels);
                    continue;
                }
            };
            gather(&mut gathered, (runner, when, in_place), route.jobs.clone(), labels);
        }
        for ((runner, receiver), jobs, labels) in to_pack {
            let (into, mut installs) = out.packed(group, receiver, &jobs)?;
            installs.retain(|segment| segment.runs() > 0);
            match out.installs.iter_mut().find(|(rank, _)| *rank == receiver) {
                Some((_, list)) => list.extend(installs),
                None => out.installs.push((receiver, installs)),
            }
            gather(&mut gathered, (runner, When::Run, true), into, labels);
        }
        check_shared_scales_together(&gathered, plan.amax_exchange())?;
        for ((rank, when, in_place), jobs, labels) in gathered {
            let device = group.device(rank)?;
            let check = match verify {
                true => {
                    let (scratch_jobs, mut segments) = out.packed(group, rank, &jobs)?;
                    // A shared scale is compared once, in its owner's pair.
                    let compared: Vec<usize> =
                        (0..segments.len()).filter(|&i| segments[i].runs() > 0).collect();
                    segments.retain(|segment| segment.runs() > 0);
                    let bytes = segments.iter().filter_map(Segment::bytes).sum();
                    let compare = PreparedVerify::new(group.backend().as_ref(), device, &segments)?;
                    let prepared = group.backend().prepare_quantize(device, &scratch_jobs)?;
                    Some(Check { prepared, compare, compared, bytes })
                }
                false => None,
            };
            let prepared = Arc::from(group.backend().prepare_quantize(device, &jobs)?);
            let written = written_bytes(&jobs);
            let exchanges =
                when != When::Commit && jobs.iter().any(|j| exchanges_amax(j, &plan.amax_exchange().keys));
            out.ranks.push(RankJobs {
                rank,
                when,
                jobs,
                labels,
                prepared,
                in_place,
                carried: false,
                written,
                check,
                exchanges,
            });
        }
        Ok(out)
    }

    /// `jobs` pointed at packed buffers allocated on `rank`'s device ([`pack`]), and the segments
    /// from there into the places the jobs name (the staged commit's installs; the verify's
    /// comparisons).
    fn packed(
        &mut self,
        group: &Group,
        rank: usize,
        jobs: &[QuantJob],
    ) -> Result<(Vec<QuantJob>, Vec<Segment>)> {
        let device = group.device(rank)?;
        let size = packed_size(jobs);
        let allocation = allocate_packed(group.backend().as_ref(), device, size, "quantization staging")?;
        self.staging.push((device, allocation));
        self.staging_bytes += size;
        Ok(pack(jobs, allocation.next_multiple_of(16)))
    }

    /// Offers the jobs that may run with the step's copies (in place, at the run, not verified: the
    /// verify's second quantization runs after them) to `carry`, which is given the rank and the
    /// prepared jobs and says whether a copy stage of that rank took them into its launch; those jobs
    /// are then not queued on their own.
    pub fn ride(&mut self, mut carry: impl FnMut(usize, &Arc<dyn PreparedQuantize>) -> bool) {
        for r in self.ranks.iter_mut().filter(|r| r.when == When::Run && r.in_place && r.check.is_none()) {
            r.carried = carry(r.rank, &r.prepared);
            if r.carried {
                log::debug!("{} quantization jobs ride a copy launch of rank {}", r.jobs.len(), r.rank);
            }
        }
    }

    /// The ranks whose streams run jobs.
    pub fn ranks(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranks.iter().map(|r| r.rank)
    }

    pub fn has(&self, when: When) -> bool {
        self.ranks.iter().any(|r| r.when == when)
    }

    /// Whether a job reads or writes a byte of `[start, start + length)` (on any device: ranges of
    /// one process's devices do not overlap).
    pub fn touches(&self, start: u64, length: u64) -> bool {
        let end = start.saturating_add(length);
        self.ranks.iter().flat_map(|r| &r.jobs).flat_map(QuantJob::regions).any(|region| {
            let (lo, span) = (region.src, region.span(crate::segment::Side::Source).unwrap_or(u64::MAX));
            region.runs() > 0 && lo < end && start < lo.saturating_add(span)
        })
    }

    /// Bytes of codes and scales the jobs that run at `when` write into the live buffers: every job's
    /// under direct commit; under staged commit the commit's (jobs at the run write staging, which
    /// the install counts).
    pub fn live_bytes(&self, when: When, staged: bool) -> u64 {
        if staged && when == When::Run {
            return 0;
        }
        self.ranks.iter().filter(|r| r.when == when).map(|r| r.written).sum()
    }

    /// Elements the jobs that run at `when` quantize.
    pub fn elements_at(&self, when: When) -> u64 {
        self.ranks.iter().filter(|r| r.when == when).flat_map(|r| &r.jobs).map(QuantJob::elements).sum()
    }

    /// Queues the jobs that run at `when`, each rank's on its group stream (ordered after every
    /// rank's copies by the caller), but for those a copy launch carries.
    ///
    /// # Safety
    /// The jobs' memory is live (the caller's promise on the plan's; the staging is ours).
    pub unsafe fn queue(&self, group: &Group, when: When, hook: impl Fn() -> Result<()>) -> Result<()> {
        for r in self.ranks.iter().filter(|r| r.when == when && !r.jobs.is_empty() && !r.carried) {
            let stream: Stream = group.stream(r.rank)?;
            // SAFETY: the caller's promise; every byte was checked to be the device's at creation.
            unsafe { r.prepared.launch(stream) }?;
        }
        if self.ranks.iter().any(|r| r.when == when && r.check.is_some()) {
            hook()?;
        }
        for r in self.ranks.iter().filter(|r| r.when == when) {
            let Some(check) = &r.check else { continue };
            let stream = group.stream(r.rank)?;
            // SAFETY: as above; the scratch is ours.
            unsafe { check.prepared.launch(stream) }?;
            // SAFETY: the jobs' outputs and the scratch stay valid until the comparison has run.
            unsafe { check.compare.launch(stream) }?;
        }
        Ok(())
    }

    /// Agrees with every device quantizing jobs of the amax keys `keys` (sorted) on their amaxes,
    /// before this run's quantizing: each of this process's ranks reduces its jobs' elements (waited
    /// for), the processes of `comm` exchange what they found (a collective call: every process
    /// makes it, with or without such jobs), and every batch of those jobs, and its verify, starts
    /// from the maximum.
    pub fn exchange_amaxes(&self, group: &Group, keys: &[u64], comm: Option<&Communicator>) -> Result<()> {
        let mine = self.exchanging().try_fold(Amaxes::new(), |mut amaxes, r| {
            // SAFETY: the sources are live (the caller's promise on the plan's memory); waited for.
            let found = unsafe { r.prepared.partial_amaxes(group.stream(r.rank)?, keys) }?;
            merge_amaxes(&mut amaxes, &found);
            Ok::<_, Error>(amaxes)
        });
        let Some(comm) = comm else { return self.seed(&mine?) };
        // Meet even after a failure here (sending FAILED_AMAXES), so that the peers do not wait.
        let sent = mine.as_ref().map_or_else(|_| FAILED_AMAXES.to_vec(), encode_amaxes);
        let all = comm.allgather_bytes(&sent)?;
        let mut amaxes = mine?;
        for (peer, bytes) in all.iter().enumerate() {
            if bytes.as_slice() == FAILED_AMAXES {
                crate::bail!(
                    Status::Aborted,
                    "process {peer} failed before it sent the amaxes it quantizes with"
                );
            }
            let theirs = decode_amaxes(bytes).map_err(|why| {
                Error::new(Status::InternalError, format!("process {peer} sent its amaxes {why}"))
            })?;
            merge_amaxes(&mut amaxes, &theirs);
        }
        self.seed(&amaxes)
    }

    /// The batches holding jobs whose amax is exchanged (none runs at the commit: such jobs read
    /// sources in place).
    fn exchanging(&self) -> impl Iterator<Item = &RankJobs> {
        self.ranks.iter().filter(|r| r.exchanges)
    }

    /// Seeds every batch holding jobs whose amax is exchanged (and its verify) with `amaxes`.
    fn seed(&self, amaxes: &Amaxes) -> Result<()> {
        for r in self.exchanging() {
            r.prepared.seed_amaxes(amaxes)?;
            if let Some(check) = &r.check {
                check.prepared.seed_amaxes(amaxes)?;
            }
        }
        Ok(())
    }

    /// Bytes of codes and scales the verify of the jobs at `when` compares (0 without verify).
    pub fn checked_bytes(&self, when: When) -> u64 {
        self.ranks.iter().filter(|r| r.when == when).filter_map(|r| r.check.as_ref()).map(|c| c.bytes).sum()
    }

    /// With verify: waits for the comparisons queued at `when` and reads them. Returns the bytes
    /// found equal to a second quantization of the same sources, or VerifyMismatch naming the tensor,
    /// the job and whether its codes or its scales differ.
    pub fn read_checks(&self, group: &Group, when: When) -> Result<u64> {
        let mut bytes = 0;
        for r in self.ranks.iter().filter(|r| r.when == when) {
            let Some(check) = &r.check else { continue };
            let (stream, device) = (group.stream(r.rank)?, group.device(r.rank)?);
            group.backend().sync_stream(device, stream)?;
            if let Some(differing) = check.compare.outcome()? {
                let segment = check.compared[differing];
                let j = segment / 2;
                let (tensor, receiver) = &r.labels[j];
                let job = &r.jobs[j];
                crate::bail!(
                    Status::VerifyMismatch,
                    "quantized need of tensor '{tensor}' on device {receiver}: the {} of its {} x {} matrix at {:#x} \
                     differ from a second quantization of the same sources",
                    if segment % 2 == 0 { "codes" } else { "scales" },
                    job.rows,
                    job.cols,
                    job.dst
                );
            }
            bytes += check.bytes;
        }
        Ok(bytes)
    }
}

/// Bytes of codes and scales `jobs` write: every code, and each scale grid once (a scale jobs share
/// is written once, by its owner).
fn written_bytes(jobs: &[QuantJob]) -> u64 {
    let owners = scale_owners(jobs);
    let written = |(index, job): (usize, &QuantJob)| {
        let (grid_rows, grid_cols) = job.quantization.scale_grid(job.rows, job.cols);
        let scales = grid_rows * grid_cols * job.quantization.scale_kind().size();
        job.elements() + if owners[index] == index { scales } else { 0 }
    };
    jobs.iter().enumerate().map(written).sum()
}

/// Appends `jobs` (and their labels) to the gathering of `key`, made when there is none.
fn gather<K: PartialEq>(
    gathered: &mut Vec<(K, Vec<QuantJob>, Vec<Label>)>,
    key: K,
    jobs: Vec<QuantJob>,
    labels: Vec<Label>,
) {
    match gathered.iter_mut().find(|(k, _, _)| *k == key) {
        Some((_, existing, existing_labels)) => {
            existing.extend(jobs);
            existing_labels.extend(labels);
        }
        None => gathered.push((key, jobs, labels)),
    }
}

/// Amaxes as one process sends them to the others: per entry its key and row (u64) and bits (u32),
/// little-endian.
fn encode_amaxes(amaxes: &Amaxes) -> Vec<u8> {
    let mut entries: Vec<_> = amaxes.iter().collect();
    entries.sort_unstable();
    let mut out = Vec::with_capacity(entries.len() * AMAX_ENTRY);
    for (&(key, row), &bits) in entries {
        out.extend_from_slice(&key.to_le_bytes());
        out.extend_from_slice(&row.to_le_bytes());
        out.extend_from_slice(&bits.to_le_bytes());
    }
    out
}

const AMAX_ENTRY: usize = 20;

/// What a process sends in place of its amaxes when it could not take them (no whole entry).
const FAILED_AMAXES: &[u8] = b"failed";

fn decode_amaxes(bytes: &[u8]) -> std::result::Result<Amaxes, String> {
    if bytes.len() % AMAX_ENTRY != 0 {
        return Err(format!("in {} bytes, not a multiple of {AMAX_ENTRY}", bytes.len()));
    }
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let mut out = Amaxes::new();
    for entry in bytes.chunks_exact(AMAX_ENTRY) {
        let bits = u32::from_le_bytes(entry[16..].try_into().expect("4 bytes"));
        merge_amaxes(&mut out, &Amaxes::from([((word(&entry[..8]), word(&entry[8..16])), bits)]));
    }
    Ok(out)
}

/// Internal unless the jobs sharing each per-tensor amax (a scale, or a key) run in one gathering
/// (one batch, so one amax), but for those whose amax `exchange` covers: what the planner's routes
/// promise (`plan::quantized`'s ScaleTies).
fn check_shared_scales_together(gathered: &Gathered<Gathering>, exchange: &AmaxExchange) -> Result<()> {
    let mut batch_of: std::collections::HashMap<(bool, u64), usize> = std::collections::HashMap::new();
    for (index, (_, jobs, labels)) in gathered.iter().enumerate() {
        let shared = jobs.iter().zip(labels).filter(|(j, _)| {
            j.quantization.granularity == crate::quant::Granularity::Tensor
                && j.elements() > 0
                && !exchange.covers(j.amax_key)
        });
        for (job, (tensor, _)) in shared {
            let keys = [Some((false, job.scales)), (job.amax_key != 0).then_some((true, job.amax_key))];
            for key in keys.into_iter().flatten() {
                if *batch_of.entry(key).or_insert(index) != index {
                    crate::bail!(
                        Status::InternalError,
                        "quantized need of tensor '{tensor}': its per-tensor amax (scale at {:#x}, key {}) is shared by \
                         jobs the plan runs apart",
                        job.scales,
                        job.amax_key
                    );
                }
            }
        }
    }
    Ok(())
}

/// OVERLAP when codes or scales share a byte with what the plan's copies write in this process (a
/// plain need's destination, a staged need's staging): the jobs' outputs were checked among
/// themselves (`check_jobs`), the copies' destinations by the planner.
fn check_apart(jobs: &[QuantJob], flows: &[RankFlow]) -> Result<()> {
    let owners = scale_owners(jobs);
    let written = jobs.iter().enumerate().flat_map(|(index, j)| {
        let [_, codes, scales] = j.regions();
        // A shared scale once, its owner's.
        [codes, if owners[index] == index { scales } else { Segment::default() }]
    });
    let copied = flows.iter().flat_map(|f| f.segments.iter().copied());
    let all: Vec<Segment> = written.chain(copied).collect();
    check_destinations(&all).map_err(|e| {
        if e.status != Status::Overlap {
            return e;
        }
        Error::new(
            Status::Overlap,
            format!(
                "a quantized need's codes or scales share bytes with a need's destination or staging: {}",
                e.message
            ),
        )
    })
}

/// Which of a job's regions [`check_memory`] checks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Regions {
    All,
    Sources,
}

/// INVALID_ARGUMENT unless every byte the jobs read or write (`what`) is memory `device` can use.
fn check_memory(
    backend: &dyn Backend,
    device: i32,
    tensor: &str,
    jobs: &[QuantJob],
    what: Regions,
) -> Result<()> {
    let per_job = if what == Regions::All { 3 } else { 1 };
    let regions: Vec<Segment> = jobs.iter().flat_map(|j| j.regions().into_iter().take(per_job)).collect();
    let owners = |i| QuantJob::region_owners(i, per_job, device);
    let Some(bad) = first_unusable(backend, &regions, owners, true)? else { return Ok(()) };
    let what = ["source", "codes", "scales"][bad.segment % per_job];
    let (addr, len) = bad.range;
    crate::bail!(
        Status::InvalidArgument,
        "quantized need of tensor '{tensor}': its {what} [{addr:#x}, +{len:#x}) is not memory device {device} can use: \
         {:#x} {}",
        bad.refusal.at,
        bad.refusal.why
    )
}

/// Bytes [`pack`] lays `jobs` out in.
pub(super) fn packed_size(jobs: &[QuantJob]) -> u64 {
    let owners = scale_owners(jobs);
    jobs.iter().enumerate().map(|(index, job)| packed_places(job, owners[index] == index).2).sum()
}

/// Where one job's codes and scales start in its packed region (codes rows `cols` rounded up to 16
/// bytes apart, then the scale grid, row after row, unless another job owns the scale it shares),
/// and the region's size (a multiple of 16).
fn packed_places(job: &QuantJob, owns_scales: bool) -> (u64, u64, u64) {
    let pitch = job.cols.next_multiple_of(16);
    let codes = (job.rows * pitch).next_multiple_of(16);
    let (grid_rows, grid_cols) = job.quantization.scale_grid(job.rows, job.cols);
    let scales = (grid_rows * grid_cols * job.quantization.scale_kind().size()).next_multiple_of(16);
    (pitch, codes, codes + if owns_scales { scales } else { 0 })
}

/// `jobs` pointed at packed buffers from `base` (16-byte aligned): each job's codes, then its scale
/// grid, every start 16-byte aligned; jobs sharing a per-tensor scale (`scale_owners`) share its
/// packed place too, so that they still share it. Also the segments from there into the places the
/// jobs name, two per job (codes, then scales; a shared scale's only in its owner's pair, the others'
/// empty). A function of the jobs and `base` only, so that two processes lay the same jobs out alike.
pub(super) fn pack(jobs: &[QuantJob], base: u64) -> (Vec<QuantJob>, Vec<Segment>) {
    let owners = scale_owners(jobs);
    let mut at = base;
    let mut packed: Vec<QuantJob> = Vec::with_capacity(jobs.len());
    let mut segments = Vec::with_capacity(2 * jobs.len());
    for (index, job) in jobs.iter().enumerate() {
        let owns_scales = owners[index] == index;
        let (pitch, codes_size, size) = packed_places(job, owns_scales);
        let scale_size = job.quantization.scale_kind().size();
        let (grid_rows, grid_cols) = job.quantization.scale_grid(job.rows, job.cols);
        let scales = if owns_scales { at + codes_size } else { packed[owners[index]].scales };
        let into = QuantJob { dst: at, dst_stride: pitch, scales, scale_stride: grid_cols, ..*job };
        segments.push(Segment {
            src: into.dst,
            dst: job.dst,
            len: job.cols,
            count: [job.rows, 1],
            src_stride: [pitch, 0],
            dst_stride: [job.dst_stride, 0],
        });
        segments.push(match owns_scales {
            true => Segment {
                src: into.scales,
                dst: job.scales,
                len: grid_cols * scale_size,
                count: [grid_rows, 1],
                src_stride: [grid_cols * scale_size, 0],
                dst_stride: [job.scale_stride * scale_size, 0],
            },
            false => Segment::default(),
        });
        packed.push(into);
        at += size;
    }
    (packed, segments)
}

/// Device memory on `device` for [`pack`]ing jobs of `size` bytes ([`packed_size`]; 16 bytes more,
/// for the alignment), named `what` in errors.
pub(super) fn allocate_packed(backend: &dyn Backend, device: i32, size: u64, what: &str) -> Result<u64> {
    let bytes = usize::try_from(size.saturating_add(16))
        .map_err(|_| Error::new(Status::OutOfMemory, format!("{what} larger than the address space")))?;
    backend
        .alloc(device, bytes)
        .map_err(|e| e.context(format!("allocating {bytes} bytes of {what} on device {device}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amaxes_cross_processes_whole_and_a_failure_is_no_entry() {
        let amaxes = Amaxes::from([((7, 0), 0x4380_0000), ((7, 1), 0x7fc0_0000), ((u64::MAX, u64::MAX), 0)]);
        let bytes = encode_amaxes(&amaxes);
        assert_eq!(bytes.len(), 3 * AMAX_ENTRY);
        assert_eq!(decode_amaxes(&bytes).unwrap(), amaxes);
        assert_eq!(decode_amaxes(&[]).unwrap(), Amaxes::new());
        assert!(decode_amaxes(&bytes[1..]).unwrap_err().contains("not a multiple of 20"));
        assert!(decode_amaxes(FAILED_AMAXES).is_err(), "the failure marker is no list of entries");
        // Entries repeated (by a hostile peer) merge to their maximum, a NaN's bits above numbers'.
        let twice = [encode_amaxes(&Amaxes::from([((7, 1), 1)])), bytes].concat();
        assert_eq!(decode_amaxes(&twice).unwrap()[&(7, 1)], 0x7fc0_0000);
    }
}
