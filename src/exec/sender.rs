//! The sender path of quantized needs (`plan::QuantPath::Sender`): this process quantizes sources it
//! offers, for receivers in other processes, into a send buffer of its own, and the codes and
//! scales cross from there as any bytes between processes do (`remote`): through CUDA IPC or the
//! staged exchange, into the landing under staged commit, checked under verify. One byte per
//! element crosses instead of two, and nothing new is asked of the transports.
//!
//! Both ends lay the send buffer out from the same jobs ([`pack`]), so a receiver knows where each
//! of its codes and scales comes from without being told, and the segments of a pair of processes
//! line up in the order of the plan's quantized routes.

use super::quantize::{allocate_packed, pack, Label};
use crate::bail;
use crate::error::Result;
use crate::plan::{Endpoint, Plan, QuantPath, QuantRoute};
use crate::quant::QuantJob;
use crate::segment::Segment;
use crate::transport::Backend;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What this process quantizes for others.
#[derive(Default)]
pub(super) struct Outgoing {
    /// The jobs, pointed at the send buffer (in the order of the plan's routes), and for each its
    /// tensor and receiving device (for messages).
    pub jobs: Vec<QuantJob>,
    pub labels: Vec<Label>,
    /// By receiving process: the segments from the send buffer into its codes and scales.
    pub sends: BTreeMap<usize, Vec<Segment>>,
    /// The send buffer, freed on drop (after the routes reading it have drained: its owner drops
    /// it after the exchange).
    buffer: Option<(Arc<dyn Backend>, i32, u64)>,
}

/// Where a receiver's sender-path jobs appear to come from: any nonzero address serves, since the
/// receiver never reads a sender's memory; the sender's own layout gives the same segments but for it.
const ELSEWHERE: u64 = 16;

impl Outgoing {
    /// The sender-path routes of `plan` that `here` (the communicator's device of `process`) runs,
    /// laid out in a send buffer allocated on `device`. UNSUPPORTED when such a route's sources are
    /// on another device of this process: bytes between processes leave from the communicator's.
    pub fn new(backend: &Arc<dyn Backend>, plan: &Plan, here: Endpoint, device: i32) -> Result<Outgoing> {
        let routes: Vec<&QuantRoute> = plan
            .quant_routes()
            .iter()
            .filter(|r| r.path == QuantPath::Sender && r.runner.process == here.process)
            .collect();
        if routes.is_empty() {
            return Ok(Outgoing::default());
        }
        for route in &routes {
            if route.runner != here {
                bail!(
                    crate::error::Status::Unsupported,
                    "quantized need of tensor '{}' on process {}: its sources on device {} of process {} are \
                     quantized for another process, which happens on the communicator's device ({})",
                    route.name(),
                    route.receiver.process,
                    route.runner.device,
                    here.process,
                    here.device
                );
            }
        }
        let all: Vec<QuantJob> = routes.iter().flat_map(|r| r.jobs.iter().copied()).collect();
        let allocation =
            allocate_packed(backend.as_ref(), device, &all, "the buffer of codes and scales sent")?;
        let mut out = Outgoing::default();
        out.buffer = Some((Arc::clone(backend), device, allocation));
        let (jobs, segments) = pack(&all, allocation.next_multiple_of(16));
        let mut pairs = segments.chunks_exact(2);
        for route in &routes {
            let sends = out.sends.entry(route.receiver.process as usize).or_default();
            for pair in pairs.by_ref().take(route.jobs.len()) {
                sends.extend_from_slice(pair);
            }
            out.labels.extend(std::iter::repeat_n(label(route), route.jobs.len()));
        }
        out.jobs = jobs;
        Ok(out)
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        if let Some((backend, device, allocation)) = self.buffer.take() {
            // SAFETY: ours; the work reading and writing it has drained.
            if let Err(err) = unsafe { backend.free(device, allocation) } {
                log::warn!("freeing the buffer of codes and scales sent: {err}");
            }
        }
    }
}

/// By sending process: the segments of the codes and scales other processes quantize for `here`
/// (the communicator's device of its process), as their senders lay them out but for the sources.
/// UNSUPPORTED for such a need on another device: bytes between processes arrive at the
/// communicator's.
pub(super) fn incoming(plan: &Plan, here: Endpoint) -> Result<BTreeMap<usize, Vec<Segment>>> {
    let mut out: BTreeMap<usize, Vec<Segment>> = BTreeMap::new();
    let routes = plan.quant_routes().iter().filter(|r| {
        r.path == QuantPath::Sender && r.receiver.process == here.process && r.runner.process != here.process
    });
    for route in routes {
        if route.receiver != here {
            bail!(
                crate::error::Status::Unsupported,
                "quantized need of tensor '{}' on device {}: its codes and scales are quantized in process {}, \
                 and bytes from other processes arrive at the communicator's device ({})",
                route.name(),
                route.receiver.device,
                route.runner.process,
                here.device
            );
        }
        let (_, segments) = pack(&route.jobs, ELSEWHERE);
        out.entry(route.runner.process as usize).or_default().extend(segments);
    }
    Ok(out)
}

/// A route's tensor and receiving device, for messages.
fn label(route: &QuantRoute) -> Label {
    (route.name().into_owned(), route.receiver.device)
}
