//! The sender path of quantized needs (`plan::QuantPath::Sender`): this process quantizes sources it
//! offers for receivers in other processes, and one byte per element crosses instead of two. Two
//! ways, per receiving process:
//!
//! - **straight**: through CUDA IPC, the quantizing kernel writes the codes and scales into the
//!   receiver's memory itself (its live buffers, or its landing under staged commit), between the
//!   meetings that bracket every IPC write; verify quantizes again and compares through the mapping.
//! - **buffered**: otherwise (the staged exchange over NCCL, the host backend's simulated IPC, or
//!   places the kernel cannot write as they are), it quantizes into a send buffer of its own, and
//!   the codes and scales cross from there as any bytes between processes do (`remote`).
//!
//! Either way the pair's segments include the codes and scales, after the plain routes', in the
//! order of the plan's quantized routes: both ends lay them out from the same jobs ([`pack`]), so a
//! receiver knows where each arrives without being told how it was sent.

use super::quantize::{allocate_packed, pack, packed_size, Label};
use crate::bail;
use crate::error::{Result, Status};
use crate::plan::{Endpoint, Plan, QuantPath, QuantRoute};
use crate::quant::{check_jobs, QuantJob};
use crate::segment::Segment;
use crate::transport::ipc::Opened;
use crate::transport::Backend;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Where the segments of codes and scales that a receiver lays out appear to come from: any
/// nonzero address serves, since their sources are only read where they are sent from.
pub(super) const ELSEWHERE: u64 = 16;

/// Sender-path jobs in plan order, with their tensors and receiving devices: as planned (codes and
/// scales at the receiver's addresses), or as they run.
#[derive(Default)]
pub(super) struct Planned {
    pub jobs: Vec<QuantJob>,
    pub labels: Vec<Label>,
}

impl Planned {
    /// The segments of their codes and scales, two per job, sources at [`ELSEWHERE`].
    pub fn segments(&self) -> Vec<Segment> {
        pack(&self.jobs, ELSEWHERE).1
    }
}

/// By receiving process: the sender-path routes of `plan` that `here` (the communicator's device of
/// its process) runs. UNSUPPORTED when such a route's sources are on another device of this
/// process: bytes between processes leave from the communicator's.
pub(super) fn outgoing(plan: &Plan, here: Endpoint) -> Result<BTreeMap<usize, Planned>> {
    let mut out: BTreeMap<usize, Planned> = BTreeMap::new();
    let routes = plan
        .quant_routes()
        .iter()
        .filter(|r| r.path == QuantPath::Sender && r.runner.process == here.process);
    for route in routes {
        if route.runner != here {
            bail!(
                Status::Unsupported,
                "quantized need of tensor '{}' on process {}: its sources on device {} of process {} are \
                 quantized for another process, which happens on the communicator's device ({})",
                route.name(),
                route.receiver.process,
                route.runner.device,
                here.process,
                here.device
            );
        }
        let planned = out.entry(route.receiver.process as usize).or_default();
        planned.jobs.extend_from_slice(&route.jobs);
        planned.labels.extend(std::iter::repeat_n(label(route), route.jobs.len()));
    }
    Ok(out)
}

/// By sending process: the segments of the codes and scales other processes quantize for `here`
/// (the communicator's device of its process), as their senders lay them out but for the sources:
/// all of one sender's jobs for this process packed together, in plan order, as [`outgoing`] gathers
/// them there (jobs sharing a per-tensor scale share its place). UNSUPPORTED for such a need on
/// another device: bytes between processes arrive at the communicator's.
pub(super) fn incoming(plan: &Plan, here: Endpoint) -> Result<BTreeMap<usize, Vec<Segment>>> {
    let mut jobs: BTreeMap<usize, Vec<QuantJob>> = BTreeMap::new();
    let routes = plan.quant_routes().iter().filter(|r| {
        r.path == QuantPath::Sender && r.receiver.process == here.process && r.runner.process != here.process
    });
    for route in routes {
        if route.receiver != here {
            bail!(
                Status::Unsupported,
                "quantized need of tensor '{}' on device {}: its codes and scales are quantized in process {}, \
                 and bytes from other processes arrive at the communicator's device ({})",
                route.name(),
                route.receiver.device,
                route.runner.process,
                here.device
            );
        }
        jobs.entry(route.runner.process as usize).or_default().extend_from_slice(&route.jobs);
    }
    Ok(jobs.into_iter().map(|(sender, jobs)| (sender, pack(&jobs, ELSEWHERE).1)).collect())
}

/// `planned`'s jobs writing straight into the peer's memory opened through CUDA IPC: each job's
/// codes and scales where `landed` (its two segments, as the receiver lays them out: live buffers
/// or landing) puts them, translated. None where a place is not in the opened memory or is not one
/// the kernel writes (alignment): those jobs go through the send buffer.
pub(super) fn straight(opened: &Opened, planned: &Planned, landed: &[Segment]) -> Option<Vec<QuantJob>> {
    let jobs: Option<Vec<QuantJob>> = planned
        .jobs
        .iter()
        .zip(landed.chunks_exact(2))
        .map(|(job, pair)| {
            let (codes, scales) =
                (opened.translate_destination(&pair[0]).ok()?, opened.translate_destination(&pair[1]).ok()?);
            let scale_size = job.quantization.scale_kind().size();
            Some(QuantJob {
                dst: codes.dst,
                dst_stride: codes.dst_stride[0],
                scales: scales.dst,
                scale_stride: scales.dst_stride[0] / scale_size,
                ..*job
            })
        })
        .collect();
    jobs.filter(|jobs| jobs.len() == planned.jobs.len() && check_jobs(jobs).is_ok())
}

/// What this process quantizes for others, as it runs.
#[derive(Default)]
pub(super) struct Outgoing {
    /// Jobs into the send buffer (run before the routes between processes).
    pub buffered: Planned,
    /// Jobs into receivers' memory through CUDA IPC (run with the IPC writes).
    pub straight: Planned,
    /// The send buffer (backend, device, allocation, bytes used), freed on drop (its owner drops
    /// it after the routes reading it drained).
    buffer: Option<(Arc<dyn Backend>, i32, u64, u64)>,
}

impl Outgoing {
    /// Bytes of the send buffer (0 without one).
    pub fn buffer_bytes(&self) -> u64 {
        self.buffer.as_ref().map_or(0, |buffer| buffer.3)
    }

    /// Lays `planned` (the jobs of the receivers that take them buffered, in order) out in a send
    /// buffer allocated on `device`, each receiver's jobs packed apart (scale addresses of two
    /// processes may be equal numbers: only one receiver's jobs may share a scale); returns the
    /// segments from there into the receivers' codes and scales, two per job, in the same order.
    pub fn buffer(
        &mut self,
        backend: &Arc<dyn Backend>,
        device: i32,
        planned: &[&Planned],
    ) -> Result<Vec<Segment>> {
        if planned.iter().all(|p| p.jobs.is_empty()) {
            return Ok(Vec::new());
        }
        let size = planned.iter().map(|p| packed_size(&p.jobs)).fold(0, u64::saturating_add);
        let allocation =
            allocate_packed(backend.as_ref(), device, size, "the buffer of codes and scales sent")?;
        self.buffer = Some((Arc::clone(backend), device, allocation, size));
        let (mut at, mut into, mut segments) = (allocation.next_multiple_of(16), Vec::new(), Vec::new());
        for p in planned {
            let (jobs, from) = pack(&p.jobs, at);
            at += packed_size(&p.jobs);
            into.extend(jobs);
            segments.extend(from);
        }
        let labels = planned.iter().flat_map(|p| p.labels.iter().cloned()).collect();
        self.buffered = Planned { jobs: into, labels };
        Ok(segments)
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        if let Some((backend, device, allocation, _)) = self.buffer.take() {
            // SAFETY: ours; the work reading and writing it has drained.
            if let Err(err) = unsafe { backend.free(device, allocation) } {
                log::warn!("freeing the buffer of codes and scales sent: {err}");
            }
        }
    }
}

/// A route's tensor and receiving device, for messages.
fn label(route: &QuantRoute) -> Label {
    (route.name().into_owned(), route.receiver.device)
}
