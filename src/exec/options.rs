//! What an executor is asked to do: the arm that moves bytes, the SM budget, verify, and how bytes
//! reach the live buffers.

use crate::error::{Error, Result};
use crate::group::Group;
use crate::plan::RouteKind;
use crate::segment::Segment;
use std::fmt;
use std::sync::Arc;

/// How bytes are moved, as asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arm {
    /// Per contiguous run, by size: the copy engine for a share of the long runs
    /// ([`Arm::engine_share_permille`]), running beside the kernel, which takes the others, in one
    /// stage; the copy engine everywhere the
    /// kernel cannot run (no direct peer access, no NVRTC); the kernel for every run when the step is
    /// verified (its copy records the digests the verify checks); the copy engine for every run,
    /// in paced pieces, under an SM budget (it uses no SMs).
    Auto,
    /// The batched copy kernel: one launch per rank and stage, any segment size near memory bandwidth.
    Kernel,
    /// One copy-engine copy per contiguous run: no SMs used; host time grows with the runs.
    CopyEngine,
}

impl Arm {
    /// The share of the bytes in contiguous runs of `len` bytes that AUTO gives the copy engine, in
    /// thousandths, per route kind; the copy engine runs beside the kernel (a stream of its own), so
    /// the stage ends when the slower of the two does.
    /// - Between GPUs (and processes), every run of 16 MiB or more: there a copy-engine peer copy
    ///   moves what the kernel's push does (shared/CEILINGS.md, peer copy by size).
    /// - On one GPU, all of each run of 256 MiB or more (one copy-engine copy then reaches 0.98 of
    ///   one large copy, the kernel 0.92: benches/results/gpu_sweep.json), and 0.3 of the bytes in
    ///   runs from 64 MiB (0.930 of one large copy through the executor against the kernel's 0.921,
    ///   same run). Shares of shorter runs lost to the kernel alone in the executor (0.1 of 4 MiB
    ///   runs 0.879, 0.2 of 16 MiB runs 0.903), though a probe timing both streams from a common
    ///   start found them faster (benches/probes/split_copy_probe.py), and still lost with every
    ///   copy issued in one batch call (docs/decisions.md).
    pub const fn engine_share_permille(kind: RouteKind, len: u64) -> u64 {
        const MIB: u64 = 1 << 20;
        match kind {
            RouteKind::Local if len >= 256 * MIB => 1000,
            RouteKind::Local if len >= 64 * MIB => 300,
            RouteKind::Local => 0,
            RouteKind::Peer | RouteKind::Remote if len >= 16 * MIB => 1000,
            RouteKind::Peer | RouteKind::Remote => 0,
        }
    }

    /// Which of `segments` (of route kind `kind`) AUTO gives the copy engine: whole segments, those
    /// of the largest share and longest runs first, for as long as each brings the copy engine's
    /// bytes closer to the sum of every segment's share ([`Arm::engine_share_permille`]).
    pub fn engine_segments<'a>(kind: RouteKind, segments: impl Iterator<Item = &'a Segment>) -> Vec<bool> {
        let candidates: Vec<(u64, u64, u64)> = segments
            .map(|s| (Arm::engine_share_permille(kind, s.len), s.len, s.bytes().unwrap_or(0)))
            .collect();
        let target: u128 =
            candidates.iter().map(|&(share, _, bytes)| u128::from(share) * u128::from(bytes)).sum();
        let mut order: Vec<usize> = (0..candidates.len()).filter(|&i| candidates[i].0 > 0).collect();
        order.sort_by_key(|&i| std::cmp::Reverse((candidates[i].0, candidates[i].1)));
        let mut engine = vec![false; candidates.len()];
        // In thousandths of a byte, as the target.
        let mut taken: u128 = 0;
        for i in order {
            let with = taken + 1000 * u128::from(candidates[i].2);
            if with.abs_diff(target) < taken.abs_diff(target) {
                engine[i] = true;
                taken = with;
            }
        }
        engine
    }
}

/// What actually moves a batch (an [`Arm`] resolved). Its codes in [`super::RunStats::arm`] are
/// the C API's REFIT_ARM_KERNEL, REFIT_ARM_COPY_ENGINE and REFIT_ARM_SPLIT, and REFIT_ARM_NONE for
/// no method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    Kernel = 1,
    CopyEngine = 2,
    /// The copy engine for the segments [`Arm::engine_segments`] chooses, beside the kernel for the
    /// others.
    Split = 4,
}

impl Method {
    /// REFIT_ARM_NONE: the code of no method.
    const NONE: u32 = 3;

    /// The method's code in the stats (REFIT_ARM_NONE for None).
    pub const fn code(method: Option<Method>) -> u32 {
        match method {
            Some(method) => method as u32,
            None => Method::NONE,
        }
    }

    /// The method of a stats code (None for REFIT_ARM_NONE or an unknown code).
    pub fn from_code(code: u32) -> Option<Method> {
        [Method::Kernel, Method::CopyEngine, Method::Split].into_iter().find(|&m| m as u32 == code)
    }
}

/// How bytes reach the live buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommitMode {
    /// `run` copies straight into the live buffers.
    Direct,
    /// `run` lands every byte in staging on the receiver's device (and verifies it when asked);
    /// `commit` copies staging into the live buffers with one batched launch per receiving device.
    /// A step larger than the staging limit runs in slices: `run` installs every slice but the last,
    /// `commit` the last; the all-or-nothing guarantee then holds per slice.
    Staged,
}

/// Where a [`Hook`] is called: just before the stage is queued, for slice `slice`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The copies from the sources (into live buffers, or into staging).
    Copy { slice: usize },
    /// The comparison of what was copied with its sources.
    Verify { slice: usize },
    /// The copy from staging into the live buffers.
    Install { slice: usize },
    /// The second quantization and comparison that verify quantized needs' codes and scales (after
    /// their quantization was queued).
    QuantVerify,
}

/// A test seam: called on the calling thread before each stage is queued, after the previous stage
/// was. It may queue work of its own on the group's streams (to corrupt a byte between copy and
/// verify), or fail (to stand for a driver error at that point); its error fails the call.
pub type Hook = Arc<dyn Fn(Stage, &Group) -> Result<()> + Send + Sync>;

/// Options of [`super::Executor::new`].
#[derive(Clone)]
pub struct ExecOptions {
    pub arm: Arm,
    /// Copies from the sources beside other work; 0 for none. The kernel arm uses at most this many
    /// thread blocks (so at most this many SMs); AUTO (unverified) gives every run to the copy
    /// engine, which uses none, in pieces of at most 64 MiB paced to what that many SMs of the kernel
    /// would copy (see `batch::Pace`). Verify and the staged install are not capped: a
    /// server stalls for the install, and runs it at full speed.
    pub sm_budget: u32,
    /// Check every copied byte on the device after its copy: a kernel batch's destinations against
    /// digests it recorded of the sources it read, a copy-engine batch's against the sources.
    pub verify: bool,
    pub commit: CommitMode,
    /// Staged only: the most staging bytes per receiving device (0: the whole step). A step above it
    /// runs in slices. A receiver's payload at or below it is staged in one slice (densely, when
    /// aligning each run would not fit).
    pub staging_limit: u64,
    /// Staged only: creation fails (InvalidArgument) when the step would run in more than one slice,
    /// for callers that need all or nothing for the whole step.
    pub single_slice: bool,
    /// See [`Hook`]. Not reachable from C.
    pub hook: Option<Hook>,
}

impl Default for ExecOptions {
    fn default() -> ExecOptions {
        ExecOptions {
            arm: Arm::Auto,
            sm_budget: 0,
            verify: false,
            commit: CommitMode::Direct,
            staging_limit: 0,
            single_slice: false,
            hook: None,
        }
    }
}

impl fmt::Debug for ExecOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecOptions")
            .field("arm", &self.arm)
            .field("sm_budget", &self.sm_budget)
            .field("verify", &self.verify)
            .field("commit", &self.commit)
            .field("staging_limit", &self.staging_limit)
            .field("single_slice", &self.single_slice)
            .field("hook", &self.hook.is_some())
            .finish()
    }
}

impl ExecOptions {
    /// The smallest staging limit: room for a few runs of any size (longer runs are cut).
    pub const MIN_STAGING_LIMIT: u64 = 4096;

    /// Rejects combinations that cannot mean what the caller wants.
    pub fn check(&self) -> Result<()> {
        if self.sm_budget > 0 && self.arm == Arm::CopyEngine {
            return Err(Error::invalid_argument(
                "sm_budget caps the kernel arm; the copy-engine arm uses no SMs (set sm_budget to 0)",
            ));
        }
        if self.commit == CommitMode::Direct && self.staging_limit != 0 {
            return Err(Error::invalid_argument(
                "staging_limit applies to staged commit only (set it to 0, or commit staged)",
            ));
        }
        if self.commit == CommitMode::Direct && self.single_slice {
            return Err(Error::invalid_argument(
                "single_slice applies to staged commit only (a direct step has no slices)",
            ));
        }
        if self.staging_limit != 0 && self.staging_limit < ExecOptions::MIN_STAGING_LIMIT {
            return Err(Error::invalid_argument(format!(
                "staging_limit {} is below the smallest, {} bytes (0 means the whole step)",
                self.staging_limit,
                ExecOptions::MIN_STAGING_LIMIT
            )));
        }
        Ok(())
    }

    pub(crate) fn call_hook(&self, stage: Stage, group: &Group) -> Result<()> {
        match &self.hook {
            Some(hook) => hook(stage, group),
            None => Ok(()),
        }
    }
}
