//! The check, once at creation, that every address an executor will read or write is memory of the
//! device the plan names (see `transport::access`): a bad address in a table is INVALID_ARGUMENT
//! naming the tensor, box and address, instead of a crash, a dead CUDA context or bytes read from
//! whatever lies there at the first run. Runs never check again: the caller promises the memory
//! stays live, and says where it moved (`rebind`, which checks the new place once the same way). Planning does not check addresses at all, so
//! planning-only callers may keep fake ones.

use super::batch::Batch;
use super::flows::RankFlow;
use super::rebind::{Ref, Target};
use crate::error::{Error, Result, Status};
use crate::group::Group;
use crate::plan::{Endpoint, Plan, RouteKind};
use crate::segment::check::validate;
use crate::segment::Segment;
use crate::segment::Side;
use crate::transport::access::{first_unusable, Owners, Unusable};
use crate::transport::Backend;
use std::time::Instant;

/// Checks the memory of `flows` (routes within `process`) and, when `across`, this process's side
/// of its routes to and from other processes (the other side is the other process's to check).
/// Returns the host time it took.
pub(crate) fn check(
    group: &Group,
    plan: &Plan,
    process: u32,
    flows: &[RankFlow],
    across: bool,
) -> Result<u64> {
    let started = Instant::now();
    let devices = group.devices();
    let mut items: Vec<(Segment, Owners)> = Vec::new();
    // Where each item's bytes land: the receiver whose needs name its tensor.
    let mut receivers = Vec::new();
    for flow in flows {
        let receiver = Endpoint { process, device: devices[flow.dst] as u32 };
        for segment in &flow.segments {
            items.push((*segment, (Some(devices[flow.src]), Some(devices[flow.dst]))));
            receivers.push(receiver);
        }
    }
    if across {
        for route in plan.routes().iter().filter(|r| r.kind() == RouteKind::Remote) {
            let mine = |end: Endpoint| (end.process == process).then_some(end.device as i32);
            let (source, destination) = (mine(route.src), mine(route.dst));
            if source.is_none() && destination.is_none() {
                continue;
            }
            validate(&route.segments)?;
            for segment in &route.segments {
                items.push((*segment, (source, destination)));
                receivers.push(route.dst);
            }
        }
    }
    let segments: Vec<Segment> = items.iter().map(|(s, _)| *s).collect();
    if let Some(bad) = first_unusable(group.backend().as_ref(), &segments, |i| items[i].1, false)? {
        return Err(refusal(plan, &items, &receivers, &bad));
    }
    Ok(started.elapsed().as_nanos() as u64)
}

/// INVALID_ARGUMENT naming the tensor and box of the refused bytes, the range and the device.
fn refusal(plan: &Plan, items: &[(Segment, Owners)], receivers: &[Endpoint], bad: &Unusable) -> Error {
    let (segment, (source, destination)) = items[bad.segment];
    let receiver = receivers[bad.segment];
    let (side, device) = match bad.side {
        Side::Source => ("source", source),
        Side::Destination => ("destination", destination),
    };
    // A destination byte names its own element's need; a source byte, the need its segment fills.
    let landing = if bad.side == Side::Destination { bad.refusal.at } else { segment.dst };
    let what = match plan.destinations().locate(receiver, landing) {
        Some(found) => {
            format!("tensor '{}' box offset {:?} extent {:?}", found.tensor, found.offset, found.extent)
        }
        None => format!(
            "the segment into {:#x} on process {} device {}",
            segment.dst, receiver.process, receiver.device
        ),
    };
    let (addr, len) = bad.range;
    Error::new(
        Status::InvalidArgument,
        format!(
            "{what}: its {side} [{addr:#x}, +{len:#x}) is not memory of device {}: {:#x} {}",
            device.unwrap_or(-1),
            bad.refusal.at,
            bad.refusal.why
        ),
    )
}

/// The check of a rebind, before anything moves: every segment side `refs` names (on `device`),
/// moved by `delta`, must be memory of `device`. Only copy batches are looked at: a verify reads
/// the same bytes.
pub(crate) fn check_moved(
    backend: &dyn Backend,
    device: i32,
    batches: &[Batch],
    refs: &[Ref],
    delta: u64,
) -> Result<()> {
    let mut moved = Vec::new();
    let mut sides = Vec::new();
    for r in refs {
        let Target::Copy(b) = r.target else { continue };
        let mut segment = batches[b as usize].segments()[r.index as usize];
        let address = segment.address_mut(r.side);
        *address = address.wrapping_add(delta);
        moved.push(segment);
        sides.push(r.side);
    }
    validate(&moved)?;
    let owners =
        |i: usize| if sides[i] == Side::Source { (Some(device), None) } else { (None, Some(device)) };
    let Some(bad) = first_unusable(backend, &moved, owners, false)? else { return Ok(()) };
    let side = if bad.side == Side::Source { "read" } else { "written" };
    let (addr, len) = bad.range;
    Err(Error::new(
        Status::InvalidArgument,
        format!(
            "after this rebind the executor would have [{addr:#x}, +{len:#x}) {side} on device {device}, which is \
             not memory of it: {:#x} {}",
            bad.refusal.at, bad.refusal.why
        ),
    ))
}
