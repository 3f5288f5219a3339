//! Copy descriptors for one plan on one group: the plan's segments regrouped by the group rank whose
//! stream moves them, prepared once (uploaded to the device for the batched arm) and launched at every
//! refit step with no host work proportional to the number of segments.

use super::Arm;
use crate::error::{try_reserve, Error, Result, Status};
use crate::group::Group;
use crate::plan::{Endpoint, Plan, RouteKind};
use crate::segment::Segment;
use crate::transport::{BackendKind, PreparedCopy};

/// What one rank's stream does at each step.
pub(crate) enum RankWork {
    /// One batched launch (the batched copy kernel on CUDA).
    Batched(Box<dyn PreparedCopy>),
    /// The backend's per-run copies (copy engine on CUDA), the reference arm.
    PerRun(Vec<Segment>),
}

/// Every rank's work for one (plan, group, process, arm).
pub(crate) struct Descriptors {
    /// `(group rank, work)`, ranks ascending, only ranks that send bytes.
    pub work: Vec<(usize, RankWork)>,
    pub segments: u64,
    pub bytes: u64,
}

/// The group rank whose device is `endpoint.device`.
fn rank_of(group: &Group, endpoint: Endpoint) -> Result<usize> {
    group.devices().iter().position(|&d| u32::try_from(d) == Ok(endpoint.device)).ok_or_else(|| {
        Error::new(
            Status::NotFound,
            format!(
                "the plan uses device {} but the group's devices are {:?}",
                endpoint.device,
                group.devices()
            ),
        )
    })
}

impl Descriptors {
    /// Regroups the routes of `plan` that `process` executes (both ends in this process) by source
    /// rank: each rank's stream moves, in one launch, what it copies within its own device and what it
    /// writes into its NVLink peers' memory. Writing to a peer beats reading from it over NVLink:
    /// writes are posted, reads wait a round trip (benches/gpu_allgather.rs measures kernel pulls
    /// against pushes, benches/probes/ce_lanes_probe.py the copy engine's). Routes from other
    /// processes need a transport between processes, which this executor does not have yet: they are
    /// `Unsupported`.
    pub fn build(group: &Group, plan: &Plan, process: u32, arm: Arm) -> Result<Descriptors> {
        let mut per_rank: Vec<Vec<Segment>> = vec![Vec::new(); group.size()];
        for route in plan.routes().iter().filter(|r| r.dst.process == process) {
            if route.kind() == RouteKind::Remote {
                return Err(Error::unsupported(format!(
                    "route from process {} device {} to process {} device {} crosses processes; this executor \
                     moves bytes within one process only",
                    route.src.process, route.src.device, route.dst.process, route.dst.device
                )));
            }
            let dst = rank_of(group, route.dst)?;
            let src = rank_of(group, route.src)?;
            if src != dst && !group.peer_access(src, dst)? && arm == Arm::Batched {
                return Err(Error::unsupported(format!(
                    "rank {src} cannot write rank {dst}'s memory directly (no peer access); use the per-run arm"
                )));
            }
            try_reserve(&mut per_rank[src], route.segments.len(), "the executor's segments")?;
            per_rank[src].extend_from_slice(&route.segments);
        }
        let mut segments = 0u64;
        let mut bytes = 0u64;
        let mut work = Vec::new();
        for (rank, list) in per_rank.into_iter().enumerate().filter(|(_, l)| !l.is_empty()) {
            segments += list.len() as u64;
            bytes += list.iter().map(|s| s.bytes().unwrap_or(0)).sum::<u64>();
            let prepared = match (arm, group.backend_kind()) {
                // The planner already proved destinations disjoint: no need for the checked mode.
                (Arm::Batched, BackendKind::Cuda) => {
                    RankWork::Batched(group.backend().prepare_batch(group.device(rank)?, &list, false)?)
                }
                // On the host backend both arms are the same memmove loop; queued on the rank's
                // simulated stream it runs beside the other ranks' (a prepared host batch would
                // complete on return, one rank after another).
                (Arm::Batched, BackendKind::Host) | (Arm::PerRun, _) => RankWork::PerRun(list),
            };
            work.push((rank, prepared));
        }
        Ok(Descriptors { work, segments, bytes })
    }

    /// Queues every rank's work on its group stream.
    ///
    /// # Safety
    /// Every address in the plan must be live memory of the devices it names until the work is done.
    pub unsafe fn launch(&self, group: &Group) -> Result<()> {
        for (rank, work) in &self.work {
            let stream = group.stream(*rank)?;
            match work {
                RankWork::Batched(batch) => batch.launch(stream)?,
                RankWork::PerRun(list) => {
                    group.backend().copy_segments(group.device(*rank)?, stream, list)?
                }
            }
        }
        Ok(())
    }
}
