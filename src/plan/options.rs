//! How to plan (owner policy, coalescing) and the bounds on the work and memory any tables may
//! cause, with the budgets that meter them while a plan is built.

use crate::error::{Error, Result, Status};

/// Which replica serves a replica set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerPolicy {
    /// The replica of the lowest (process, device), whatever order tables arrive in.
    First,
    /// A replica on the receiver's own device, else one in the receiver's process (NVLink peer),
    /// else the lowest (process, device).
    Local,
    /// Spread bytes over replicas so that the busiest source serves as little as possible:
    /// demand only one source can serve is assigned first, then replicated demand, largest first,
    /// each to the least-loaded replica; then demand moves off the busiest source while a move
    /// lowers its load without making another source as busy.
    Balanced,
}

/// How to plan. The default is `Local` (it never moves a byte further than `First` would) with
/// coalescing on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    pub policy: OwnerPolicy,
    /// Join segments across boxes and tensors (off only for A/B checks).
    pub coalesce: bool,
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions { policy: OwnerPolicy::Local, coalesce: true }
    }
}

/// Bounds on the work and memory hostile or pathological tables can cause. Exceeding one fails
/// early with OUT_OF_MEMORY (segments) or UNSUPPORTED (the others), naming the limit, never by
/// exhausting the machine. Memory the machine does not have is OUT_OF_MEMORY as well.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most segments a plan may hold before coalescing (also bounds the intersections kept).
    pub max_segments: u64,
    /// Most disjoint pieces overlapping offers may be cut into.
    pub max_pieces: u64,
    /// Most contiguous runs expanded to prove that destinations whose spans interleave do not overlap.
    pub max_overlap_runs: u64,
    /// Most box tests (a box or an index node against another box) while finding which offers,
    /// pieces and needs meet.
    pub max_box_tests: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        // About 600 MB of segments, 150 MB of pieces, 350 MB of runs and half a second of box
        // tests at most: several times what the largest refits in benches/plan_bench.rs use.
        Limits {
            max_segments: 1 << 23,
            max_pieces: 1 << 20,
            max_overlap_runs: 1 << 23,
            max_box_tests: 1 << 26,
        }
    }
}

/// What is left of one limit while a plan is built.
pub(crate) struct Budget {
    left: u64,
    limit: u64,
    status: Status,
    /// What is counted, plural ("segments").
    what: &'static str,
    /// The [`Limits`] field that sets it.
    name: &'static str,
}

impl Budget {
    pub fn new(limit: u64, status: Status, what: &'static str, name: &'static str) -> Budget {
        Budget { left: limit, limit, status, what, name }
    }

    /// A budget that is never spent (for work already bounded by another budget).
    pub fn unlimited(what: &'static str) -> Budget {
        Budget::new(u64::MAX, Status::Unsupported, what, "none")
    }

    pub fn segments(limits: &Limits) -> Budget {
        Budget::new(limits.max_segments, Status::OutOfMemory, "segments", "max_segments")
    }

    pub fn pieces(limits: &Limits) -> Budget {
        Budget::new(limits.max_pieces, Status::Unsupported, "pieces of overlapping offers", "max_pieces")
    }

    pub fn overlap_runs(limits: &Limits) -> Budget {
        Budget::new(
            limits.max_overlap_runs,
            Status::Unsupported,
            "destination runs to compare for overlaps",
            "max_overlap_runs",
        )
    }

    pub fn box_tests(limits: &Limits) -> Budget {
        Budget::new(limits.max_box_tests, Status::Unsupported, "box tests", "max_box_tests")
    }

    /// Counts `amount`; fails once more than the limit has been counted.
    #[inline]
    pub fn spend(&mut self, amount: u64) -> Result<()> {
        match self.left.checked_sub(amount) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => Err(self.exceeded()),
        }
    }

    /// Fails, as [`Budget::spend`] would, when `total` is more than the limit (for counts kept
    /// elsewhere).
    pub fn check_total(&self, total: u64) -> Result<()> {
        if total > self.limit {
            return Err(self.exceeded());
        }
        Ok(())
    }

    #[cold]
    fn exceeded(&self) -> Error {
        Error::new(
            self.status,
            format!(
                "planning needs more than {} {} (the planner's limit {})",
                self.limit, self.what, self.name
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_names_its_limit() {
        let mut budget = Budget::segments(&Limits { max_segments: 10, ..Limits::default() });
        budget.spend(4).unwrap();
        budget.spend(6).unwrap();
        let err = budget.spend(1).unwrap_err();
        assert_eq!(err.status, Status::OutOfMemory);
        assert_eq!(err.message, "planning needs more than 10 segments (the planner's limit max_segments)");
    }
}
