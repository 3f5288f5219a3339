//! Executing a reshard plan within one process: descriptors built once per plan and cached, bytes
//! moved on the group's streams (same device and NVLink peers), every stage timed.
//!
//! Ordering: the refit runs inside the group's open scope, or an implicit one (legacy default streams,
//! synchronous exit). Because a rank writes into other ranks' memory, every rank's stream first waits
//! for every other rank's (so each destination is written only after its caller's earlier work), and
//! every stream is joined again before the scope closes (so the caller may read the new weights, and
//! overwrite the training weights, as soon as its streams are ordered after the scope).

mod descriptors;

use crate::error::Result;
use crate::group::Group;
use crate::plan::Plan;
use descriptors::Descriptors;
use std::time::Instant;

/// How bytes are moved. Both arms install identical bytes; the per-run arm is the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arm {
    /// One batched copy launch per source device (its local and NVLink-peer segments together).
    Batched,
    /// One backend copy per contiguous run (copy engine on CUDA).
    PerRun,
}

/// Where one `execute` spent its time. `attributed_s() / total_s` is at least 0.95 when the stages
/// account for the step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageTimes {
    /// Whether the descriptors came from the cache.
    pub cached: bool,
    /// Building (and uploading) descriptors; 0 on a cache hit.
    pub descriptors_s: f64,
    /// Ordering the group's streams and queueing every launch.
    pub enqueue_s: f64,
    /// Waiting for the device work (0 inside a caller's scope, where the call does not wait).
    pub wait_s: f64,
    /// The whole call.
    pub total_s: f64,
    pub segments: u64,
    pub bytes: u64,
}

impl StageTimes {
    pub fn attributed_s(&self) -> f64 {
        self.descriptors_s + self.enqueue_s + self.wait_s
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct CacheKey {
    group: u64,
    fingerprint: u64,
    process: u32,
    arm: Arm,
}

/// Executes plans on a group, keeping the descriptors of the last (plan, group, arm) it ran: a rebuilt
/// plan (another fingerprint), another group or another arm invalidates them.
#[derive(Default)]
pub struct Executor {
    cached: Option<(CacheKey, Descriptors)>,
}

impl Executor {
    pub fn new() -> Executor {
        Executor::default()
    }

    /// Moves every byte that `plan` routes into process `process` over `group`'s devices (plan
    /// endpoints' devices are the group's device ordinals).
    ///
    /// # Safety
    /// Every source and destination address in the plan must be live memory of the device it names
    /// until the work is done (on return outside a scope; after the scope's exit inside one).
    pub unsafe fn execute(
        &mut self,
        group: &Group,
        plan: &Plan,
        process: u32,
        arm: Arm,
    ) -> Result<StageTimes> {
        let start = Instant::now();
        let key = CacheKey { group: group.id(), fingerprint: plan.fingerprint(), process, arm };
        let mut times = StageTimes { cached: true, ..StageTimes::default() };
        if self.cached.as_ref().map(|(k, _)| *k) != Some(key) {
            self.cached = None; // free the old descriptors (device memory) before building new ones
            let descriptors = Descriptors::build(group, plan, process, arm)?;
            self.cached = Some((key, descriptors));
            times.cached = false;
            times.descriptors_s = start.elapsed().as_secs_f64();
        }
        let descriptors = &self.cached.as_ref().expect("built above").1;
        times.segments = descriptors.segments;
        times.bytes = descriptors.bytes;
        let implicit = !group.in_scope();
        let enqueue_start = Instant::now();
        let mut wait_start = enqueue_start;
        group.in_implicit_scope(|| {
            group.mark_pending_join();
            group.join_if_pending()?;
            descriptors.launch(group)?;
            group.mark_pending_join();
            wait_start = Instant::now();
            Ok(())
        })?;
        let end = Instant::now();
        times.enqueue_s = (wait_start - enqueue_start).as_secs_f64();
        if implicit {
            times.wait_s = (end - wait_start).as_secs_f64();
        }
        times.total_s = (end - start).as_secs_f64();
        Ok(times)
    }
}
