//! A plan's share for one process, by route kind: the segments moved from one group rank to another
//! (or within one), and the per-kind totals the stats report. Routes are dispatched by kind in one
//! place ([`flows`]): local and NVLink-peer routes move within the process; a route to or from another
//! process goes to the executor's routes between processes (`remote`), when it has a communicator.

use crate::error::{Error, Result, Status};
use crate::group::Group;
use crate::plan::{Endpoint, Plan, QuantPath, RouteKind};
use crate::segment::check::validate;
use crate::segment::Segment;

/// Every segment one group rank moves to another (or to itself) for one route kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RankFlow {
    pub src: usize,
    pub dst: usize,
    pub kind: RouteKind,
    /// Non-empty segments, as the plan gives them.
    pub segments: Vec<Segment>,
}

/// Payload bytes and segments per route kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindTotals {
    pub bytes: [u64; 3],
    pub segments: [u64; 3],
}

impl KindTotals {
    pub(crate) fn of(flows: &[RankFlow]) -> KindTotals {
        let mut totals = KindTotals::default();
        for flow in flows {
            let k = flow.kind as usize;
            totals.segments[k] += flow.segments.len() as u64;
            totals.bytes[k] += flow.segments.iter().map(|s| s.bytes().unwrap_or(0)).sum::<u64>();
        }
        totals
    }
}

/// The group rank whose device is `endpoint.device`.
pub(crate) fn rank_of(group: &Group, endpoint: Endpoint) -> Result<usize> {
    group.devices().iter().position(|&d| i64::from(d) == i64::from(endpoint.device)).ok_or_else(|| {
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

/// InvalidArgument unless `plan` names `process`: as a route's or a receiver's process, or as the
/// process whose share it is (a share names its process even when that process moves nothing).
/// An executor for a process the plan never names would move nothing, silently.
pub(crate) fn check_named(plan: &Plan, process: u32) -> Result<()> {
    if plan.share_of() == Some(process) {
        return Ok(());
    }
    let mut named: Vec<u32> = plan.routes().iter().flat_map(|r| [r.src.process, r.dst.process]).collect();
    named.extend(plan.receivers().map(|e| e.process));
    named.sort_unstable();
    named.dedup();
    if named.binary_search(&process).is_ok() {
        return Ok(());
    }
    Err(Error::invalid_argument(format!(
        "process {process}: the plan names no route or receiver of it (its processes are {named:?})"
    )))
}

/// The routes of `plan` that `process` takes part in within the process, as flows between group
/// ranks (plan endpoints' devices are the group's device ordinals). Routes between this process and
/// another are left to `remote` when `across` (an executor with a communicator), and Unsupported
/// otherwise; NotFound for a device outside the group; InvalidArgument for a segment the batched
/// copy refuses (a zero address, an extent past 2^64), or for another process's share of a plan.
pub(crate) fn flows(group: &Group, plan: &Plan, process: u32, across: bool) -> Result<Vec<RankFlow>> {
    // Another process's share lacks this process's routes with every third process: executing it
    // would silently move part of the step.
    if let Some(owner) = plan.share_of().filter(|&owner| owner != process) {
        return Err(Error::invalid_argument(format!(
            "this plan is process {owner}'s share; process {process} needs its own share or the whole plan"
        )));
    }
    let mut flows = Vec::new();
    for route in plan.routes().iter().filter(|r| r.src.process == process || r.dst.process == process) {
        let kind = route.kind();
        match kind {
            RouteKind::Local | RouteKind::Peer => {}
            RouteKind::Remote if across => continue,
            RouteKind::Remote => {
                return Err(Error::unsupported(format!(
                    "route from process {} device {} to process {} device {} crosses processes; an executor \
                     made without a communicator moves bytes within one process only",
                    route.src.process, route.src.device, route.dst.process, route.dst.device
                )))
            }
        }
        let (src, dst) = (rank_of(group, route.src)?, rank_of(group, route.dst)?);
        validate(&route.segments).map_err(|e| {
            e.context(format!(
                "route from device {} to device {} of process {process}",
                route.src.device, route.dst.device
            ))
        })?;
        let segments: Vec<Segment> = route.segments.iter().filter(|s| s.runs() > 0).copied().collect();
        if !segments.is_empty() {
            flows.push(RankFlow { src, dst, kind, segments });
        }
    }
    // Codes and scales quantized in one process for another cross processes as well.
    let mut sent = plan.quant_routes().iter().filter(|r| r.path == QuantPath::Sender);
    if let (false, Some(route)) =
        (across, sent.find(|r| r.runner.process == process || r.receiver.process == process))
    {
        return Err(Error::unsupported(format!(
            "quantized need of tensor '{}' on process {} is quantized by process {}; an executor made without a \
             communicator moves bytes within one process only",
            route.name(),
            route.receiver.process,
            route.runner.process
        )));
    }
    Ok(flows)
}
