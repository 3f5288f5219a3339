//! Executing a plan: an executor prepared once for (plan, group, process), runs of the step, the
//! commit of a staged step, rebinds of moved buffers, and per-call stats.
//!
//! Thread-safety: an executor is used by one thread at a time, the thread driving its group (its
//! calls queue work on the group's streams).

// Raw pointers are the C ABI: handles are looked up (`live`), other pointers checked for NULL by
// `out`/`sized_out` and their validity is the caller's documented promise.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::comm::refit_comm;
use super::group::refit_group;
use super::handles::{destroy, live, publish};
use super::plan::refit_plan;
use super::{boundary, check_bool, in_use, options_in, out, sized_out, write_versioned, OptionsStruct};
use crate::error::{Error, Result, Status};
use crate::exec::{Arm, CommitMode, ExecOptions, Executor, RunStats};
use crate::sync::try_lock;
use std::sync::{Arc, Mutex, MutexGuard};

/// Executor arm, per contiguous run: the copy engine for runs of at least 16 MiB between GPUs, and
/// on one GPU for runs of at least 256 MiB and 0.3 of the bytes in runs from 64 MiB, the batched
/// kernel for the others, the two running side by side in one stage (REFIT_ARM_SPLIT when a route kind has both); the copy engine
/// where the kernel cannot run (no direct peer access, no
/// libnvrtc); the kernel for every run of a verified step (its copy records the digests the verify
/// checks); the copy engine for every run under an sm_budget (it uses no SMs). refit_run_stats.arm
/// says which ran.
pub const REFIT_ARM_AUTO: u32 = 0;
/// Executor arm: the batched copy kernel (one launch per rank and stage; any segment size near
/// memory bandwidth; capped by sm_budget).
pub const REFIT_ARM_KERNEL: u32 = 1;
/// Executor arm: one copy-engine copy per contiguous run, handed to the driver in batches
/// (cuMemcpyBatchAsync where the driver has it). Uses no SMs (NVLink peer copies overlap compute
/// freely); each copy costs the engine a fixed time, so short runs move far below memory bandwidth
/// (benches/gpu_sweep.rs measures each arm at every run size).
pub const REFIT_ARM_COPY_ENGINE: u32 = 2;
/// refit_run_stats.arm only: the call moved no bytes of that route kind.
pub const REFIT_ARM_NONE: u32 = 3;
/// refit_run_stats.arm only (an outcome of REFIT_ARM_AUTO): the copy engine moved that route kind's
/// long runs, on a stream of its own beside the batched kernel moving its other runs.
pub const REFIT_ARM_SPLIT: u32 = 4;
/// Executor commit: refit_executor_run copies straight into the live buffers.
pub const REFIT_COMMIT_DIRECT: u32 = 0;
/// Executor commit, all or nothing: refit_executor_run lands every byte in staging on the receiving
/// device (verified there when asked), refit_executor_commit copies it into the live buffers with one
/// batched launch per receiving device. A step larger than staging_limit runs in slices: run installs
/// every slice but the last, commit the last, and the guarantee then holds per slice.
pub const REFIT_COMMIT_STAGED: u32 = 1;

/// An executor: one process's share of a plan prepared for a group (descriptors built and uploaded
/// once), run step after step. Keeps no reference to the plan or the group: each call is passed the
/// group it was created with.
///
/// Thread-safety: an executor is used by one thread at a time, the thread driving its group (its
/// calls queue work on the group's streams, so no other call on the group may run meanwhile).
/// Different executors of one group are called one after the other from that thread. A call made
/// while another thread's call on the same executor is in progress returns INVALID_STATE and does
/// nothing.
pub struct refit_executor {
    /// One call at a time: a second thread's call while one runs is INVALID_STATE.
    executor: Mutex<Executor>,
}

impl refit_executor {
    fn new(executor: Executor) -> refit_executor {
        refit_executor { executor: Mutex::new(executor) }
    }

    /// The executor, for one call.
    fn take(&self) -> Result<MutexGuard<'_, Executor>> {
        try_lock(&self.executor).ok_or_else(|| in_use("executor"))
    }
}

/// Options of refit_executor_create. Fill with refit_executor_options_init, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_executor_options {
    /// sizeof(refit_executor_options) as the caller knows it (set by refit_executor_options_init).
    pub size: usize,
    /// REFIT_ARM_AUTO (default), REFIT_ARM_KERNEL or REFIT_ARM_COPY_ENGINE.
    pub arm: u32,
    /// Copies from the sources beside other work (0, the default: none). REFIT_ARM_KERNEL: the
    /// kernel uses at most this many thread blocks, so at most this many SMs. REFIT_ARM_AUTO
    /// (unverified): every run goes to the copy engine, which needs no SM, in copies of at most
    /// 64 MiB paced to what sm_budget SMs of the kernel would copy (a pause is one sleeping warp).
    /// The pace bounds the rate; how fast the copies move beside other work, and what they cost
    /// it, depends on that work (docs/decisions.md, "Copying beside inference", and the bench).
    /// Not with REFIT_ARM_COPY_ENGINE. The verify stage and the staged install are not capped.
    pub sm_budget: u32,
    /// After each copy, check on the device, on the copy's stream, every byte it wrote: the kernel's
    /// destinations against digests it recorded of the sources it read (reads the destinations only;
    /// detects any changed element, and other changes but for a 2^-64 chance), the copy engine's
    /// byte by byte against the sources. A mismatch is REFIT_STATUS_VERIFY_MISMATCH naming the
    /// tensor, box and element (default false).
    pub verify: bool,
    /// REFIT_COMMIT_DIRECT (default) or REFIT_COMMIT_STAGED.
    pub commit: u32,
    /// REFIT_COMMIT_STAGED only: the most staging bytes per receiving device, at least 4096; 0 (the
    /// default) stages the whole step at once. Staging aligns each run like its destination (up to
    /// 15 bytes of padding per run); a receiving device's payload at or below the limit is always
    /// staged in one slice (densely when the padding would not fit). A step above it runs in slices,
    /// which refit_executor_get_info reports at creation.
    pub staging_limit: u64,
    /// REFIT_COMMIT_STAGED only: refuse (INVALID_ARGUMENT naming options.single_slice, the slices
    /// and the payload) a step that would run in more than one slice under staging_limit, so that
    /// commit stays all or nothing for the whole step (default false).
    pub single_slice: bool,
}

/// What an executor was prepared to do, known from its creation (refit_executor_get_info). Set `size`
/// to sizeof(refit_executor_info) first (callers built against the struct before
/// `quantization_bytes` may pass its size then, 32, and get the fields up to `address_check_ns`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct refit_executor_info {
    /// sizeof(refit_executor_info) as the caller knows it.
    pub size: usize,
    /// Slices every run takes (REFIT_COMMIT_STAGED above staging_limit: more than 1, and the run
    /// installs all but the last before the commit; 0 when the executor moves nothing within the
    /// process).
    pub slices: u32,
    /// Staging allocated on the receiving devices, bytes summed over them (0 for direct commit).
    pub staging_bytes: u64,
    /// Host time the creation spent checking that every address it reads or writes is memory of the
    /// device the plan names (see refit_executor_create).
    pub address_check_ns: u64,
    /// Device memory held for quantized needs, bytes summed over devices, beside staging_limit: their
    /// staging under REFIT_COMMIT_STAGED (the codes and scales quantized at the run, installed by the
    /// commit), with verify the scratch each job is quantized into a second time, and the buffer of
    /// codes and scales this process quantizes for others where they cross through staging.
    pub quantization_bytes: u64,
    /// Device memory that bytes from other processes land in under REFIT_COMMIT_STAGED (installed
    /// by the commit), beside staging_limit; 0 otherwise.
    pub landing_bytes: u64,
}

/// sizeof(refit_executor_info) before `quantization_bytes` and `landing_bytes`, still accepted.
const INFO_BEFORE_QUANTIZATION_BYTES: usize = std::mem::offset_of!(refit_executor_info, quantization_bytes);

fn defaults() -> refit_executor_options {
    refit_executor_options {
        size: std::mem::size_of::<refit_executor_options>(),
        arm: REFIT_ARM_AUTO,
        sm_budget: 0,
        verify: false,
        commit: REFIT_COMMIT_DIRECT,
        staging_limit: 0,
        single_slice: false,
    }
}

impl OptionsStruct for refit_executor_options {
    unsafe fn check_fields(ptr: *const Self) -> Result<()> {
        check_bool(std::ptr::addr_of!((*ptr).verify), "options.verify")?;
        check_bool(std::ptr::addr_of!((*ptr).single_slice), "options.single_slice")
    }
}

/// sizeof(refit_executor_options) in headers before single_slice was appended: callers built
/// against them pass this size, and get the defaults of the fields they do not know.
const OPTIONS_BEFORE_SINGLE_SLICE: usize = std::mem::offset_of!(refit_executor_options, single_slice);

/// The options a caller built against the header before single_slice passes (`options.size` is
/// [`OPTIONS_BEFORE_SINGLE_SLICE`]), completed with the defaults; None for any other size.
///
/// # Safety
/// `options` is NULL or points to at least a readable `usize`, and to that many bytes when the
/// `usize` says so.
unsafe fn older_options(options: *const refit_executor_options) -> Result<Option<refit_executor_options>> {
    if options.is_null() || std::ptr::read(options.cast::<usize>()) != OPTIONS_BEFORE_SINGLE_SLICE {
        return Ok(None);
    }
    // Bytes first: the caller's may hold a bool byte that is neither 0 nor 1, which must be checked
    // before anything reads the struct as a Rust value.
    let mut completed = std::mem::MaybeUninit::new(defaults());
    // SAFETY: the caller's struct holds OPTIONS_BEFORE_SINGLE_SLICE bytes, a prefix of ours.
    std::ptr::copy_nonoverlapping(
        options.cast::<u8>(),
        completed.as_mut_ptr().cast::<u8>(),
        OPTIONS_BEFORE_SINGLE_SLICE,
    );
    refit_executor_options::check_fields(completed.as_ptr())?;
    // SAFETY: every byte is initialized (defaults, then the caller's prefix) and the bools checked.
    let mut completed = completed.assume_init();
    completed.size = std::mem::size_of::<refit_executor_options>();
    Ok(Some(completed))
}

fn convert_options(options: *const refit_executor_options) -> Result<ExecOptions> {
    let defaults = defaults();
    // SAFETY: NULL or a caller struct whose first field is its size.
    let older = unsafe { older_options(options) }?;
    // SAFETY: as above.
    let options = match &older {
        Some(completed) => completed,
        None => unsafe { options_in(options, "options") }?.unwrap_or(&defaults),
    };
    let arm = match options.arm {
        REFIT_ARM_AUTO => Arm::Auto,
        REFIT_ARM_KERNEL => Arm::Kernel,
        REFIT_ARM_COPY_ENGINE => Arm::CopyEngine,
        other => {
            return Err(Error::invalid_argument(format!(
                "options.arm = {other}; expected REFIT_ARM_AUTO, _KERNEL or _COPY_ENGINE"
            )))
        }
    };
    let commit = match options.commit {
        REFIT_COMMIT_DIRECT => CommitMode::Direct,
        REFIT_COMMIT_STAGED => CommitMode::Staged,
        other => {
            return Err(Error::invalid_argument(format!(
                "options.commit = {other}; expected REFIT_COMMIT_DIRECT or REFIT_COMMIT_STAGED"
            )))
        }
    };
    let converted = ExecOptions {
        arm,
        sm_budget: options.sm_budget,
        verify: options.verify,
        commit,
        staging_limit: options.staging_limit,
        single_slice: options.single_slice,
        hook: None,
    };
    converted.check().map_err(|e| e.context("options"))?;
    Ok(converted)
}

/// Fills `*options` with the defaults: size set, REFIT_ARM_AUTO, no SM cap, no verify,
/// REFIT_COMMIT_DIRECT, staging_limit 0, single_slice false. Thread-safe. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_executor_options_init(options: *mut refit_executor_options) -> Status {
    boundary("refit_executor_options_init", || {
        out(options, "options")?.write(defaults());
        Ok(())
    })
}

/// Prepares process `process`'s share of `plan` (every route whose source and destination are on
/// that process rank; endpoint devices are `group`'s device ordinals; `plan` is the whole plan or
/// the share refit_plan_build_share built for `process`) for `group`, with `options`
/// (NULL: the defaults), and writes the executor to `*executor`. Builds and uploads every stage's
/// descriptors and allocates staging now (blocking; not ordered with any stream); the first use of
/// the kernel on a device compiles it. The executor keeps nothing of `plan` that its destruction
/// would invalidate.
///
/// Addresses are checked here, once (runs never check them again): on CUDA every byte a step reads
/// or writes must lie in a live allocation of the device the plan names for it (cudaMalloc /
/// cuMemAlloc, cuMemCreate mappings, memory opened through CUDA IPC, managed memory; a range may
/// run from one allocation into the next where they meet); host memory from malloc, page-locked
/// host memory, another device's memory, freed or unmapped addresses are INVALID_ARGUMENT, the
/// message naming the tensor, its box, the range and the address found wanting. On the host
/// backend, ranges are checked as refit_copy_batch checks them (memory the process has mapped,
/// readable, and writable where written), and none may run past the end of the address space. The host time spent is refit_executor_get_info's address_check_ns. Planning checks no
/// address.
///
/// Thread-safety: as the group's calls (the thread driving the group); the plan may be shared.
///
/// Errors: NULL_ARGUMENT (plan, group, executor), INVALID_ARGUMENT (options.size, an unknown arm or
/// commit, a verify byte other than 0 or 1, sm_budget with REFIT_ARM_COPY_ENGINE, staging_limit
/// with REFIT_COMMIT_DIRECT or below 4096, single_slice with REFIT_COMMIT_DIRECT or a step that
/// needs more than one slice, a segment with a zero address, an address that is not memory of its
/// device (above), a plan that is another process's share, a process the plan does not name: no route or receiver of the plan is in it,
/// and the plan is not its share; the message lists the plan's processes), NOT_FOUND (a plan device not in the group), UNSUPPORTED (a route between this
/// process and another, or a quantized need that another process quantizes for this one or this one
/// for another (REFIT_PATH_SENDER): this executor moves bytes within one process; the kernel arm where a rank
/// has no direct access to its peer), OUT_OF_MEMORY (staging), NVRTC_UNAVAILABLE /
/// KERNEL_LOAD_FAILED (REFIT_ARM_KERNEL only: AUTO falls back to the copy engine), CUDA_ERROR.
#[no_mangle]
pub extern "C" fn refit_executor_create(
    plan: *const refit_plan,
    group: *const refit_group,
    process: u32,
    options: *const refit_executor_options,
    executor: *mut *mut refit_executor,
) -> Status {
    boundary("refit_executor_create", || {
        let slot = out(executor, "executor")?;
        let plan = live(plan, "plan")?;
        let group = live(group, "group")?;
        let options = convert_options(options)?;
        let created = Executor::new(&group.group, &plan.plan, process, options)?;
        slot.write(publish(refit_executor::new(created)));
        Ok(())
    })
}

/// As refit_executor_create, for the process whose communicator rank is `comm`'s, with the routes
/// between it and the other processes of `comm` as well (REFIT_ROUTE_REMOTE): `plan` is typically
/// this process's share from refit_plan_build_across. A collective call: every process of the
/// communicator makes it. Routes between processes must start or end on the communicator's device,
/// which must be a device of `group`. Per pair of processes, the bytes move through CUDA IPC where
/// both share a machine and the receiver's memory opens in the sender (the sender's batched kernel
/// writes straight into the receiver's buffers; cudaMalloc and cuMemCreate memory with POSIX
/// descriptors requested both share), else through bounded staging over the communicator (pack
/// with the batched kernel, NCCL send/recv, unpack; at most the communicator's staging_bytes per
/// process; exactly the segments' bytes on the wire); the first pair falling back from IPC is
/// logged once. refit_run_stats reports the bytes and peers of each way.
///
/// With REFIT_COMMIT_STAGED, bytes from other processes land in device memory of this process (as
/// many bytes as it receives, beside staging_limit: refit_executor_info.landing_bytes) and are
/// installed by the commit, which first waits for them and refuses (INVALID_STATE) when a peer
/// failed meanwhile: live buffers are then unchanged. verify checks the bytes written through IPC
/// (by the writer, through the opened memory) and the bytes through staging end to end (the sender
/// digests its sources, the receiver what landed; at most 0.1% of the payload in digests travels
/// over the communicator in one more meeting per run); the receiver's run reports a difference (VERIFY_MISMATCH naming the sending
/// process). Processes that exchange bytes through staging must all ask for verify or all not
/// (every process's create fails with INVALID_ARGUMENT otherwise). An executor with routes between
/// processes cannot rebind (UNSUPPORTED: buffers that moved need new IPC handles, so create the
/// executors again, collectively). When any pair uses IPC, every run meets the other processes
/// twice on the host (its streams first reach the step: a run inside a scope then blocks); every
/// process must run and commit its executor alike. The executor keeps `comm` alive. Each process
/// checks the addresses of its own side of every route (as refit_executor_create) before meeting
/// the others; a refusal there leaves the others' creates to fail with TIMEOUT or ABORTED.
///
/// Errors: as refit_executor_create, plus NULL_ARGUMENT (comm), INVALID_ARGUMENT (a plan process
/// that is not a communicator rank; processes that stage bytes between them and ask for verify
/// differently), UNSUPPORTED (a route between processes on another device), TIMEOUT, ABORTED.
#[no_mangle]
pub extern "C" fn refit_executor_create_across(
    plan: *const refit_plan,
    group: *const refit_group,
    comm: *const refit_comm,
    options: *const refit_executor_options,
    executor: *mut *mut refit_executor,
) -> Status {
    boundary("refit_executor_create_across", || {
        let slot = out(executor, "executor")?;
        let plan = live(plan, "plan")?;
        let group = live(group, "group")?;
        let comm = live(comm, "comm")?;
        let options = convert_options(options)?;
        let created = Executor::new_across(&group.group, &plan.plan, Arc::clone(comm.shared()), options)?;
        slot.write(publish(refit_executor::new(created)));
        Ok(())
    })
}

/// Checks a stats output before any work (NULL is allowed: no stats wanted).
unsafe fn stats_slot<'a>(stats: *mut RunStats) -> Result<Option<&'a mut std::mem::MaybeUninit<RunStats>>> {
    if stats.is_null() {
        return Ok(None);
    }
    sized_out(stats, "stats").map(Some)
}

/// Runs one step of the executor on `group` (the group it was created with): the copies from the
/// sources (into the live buffers, or into staging with REFIT_COMMIT_STAGED), the verify stage when
/// asked, and for a sliced staged step the install of every slice but the last. `stats` (NULL: not
/// wanted) receives what the call did; set stats->size first.
///
/// Stream ordering, as the group's scope rules: inside the group's scope the step is queued on the
/// group's streams after the work the scope's entry ordered them after (the callers' streams), and
/// the call returns without waiting, except when it must read a verify outcome first (after the
/// copies of a direct step; before each install of a sliced staged step): then the host blocks
/// until the verify stage has run. Outside a scope the step runs in an implicit scope on the legacy
/// default streams and is complete on return. Every rank's stream first waits for every other
/// rank's (a rank writes into others' memory). A staged step not yet committed is replaced.
///
/// Errors: NULL_ARGUMENT (executor, group), INVALID_ARGUMENT (another group than the executor's,
/// stats->size), INVALID_STATE (a rebind failed earlier; called from a rank callback of any
/// group, or while another thread's call on the executor or a whole-group call on the group is in
/// progress: nothing is queued), VERIFY_MISMATCH (the message names the tensor, box and element that
/// differ; with REFIT_COMMIT_STAGED nothing of that slice was installed), PLAN_STALE (rebinds left
/// two buffers overlapping; every later run is refused too: build a new plan), CUDA_ERROR. After an
/// error nothing can be committed until a run succeeds: any failed refit_executor_run or
/// refit_executor_commit on the executor, an argument refused included (a NULL or stale group,
/// another group, stats->size), leaves INVALID_STATE to every commit until then; only a call refused
/// because another thread's call holds the executor changes nothing. In a direct step live buffers
/// may hold part of the new bytes.
///
/// Thread-safety: see refit_executor. Every address of the plan (as rebound) must stay valid memory
/// of its device until the step has run.
#[no_mangle]
pub extern "C" fn refit_executor_run(
    executor: *mut refit_executor,
    group: *mut refit_group,
    stats: *mut RunStats,
) -> Status {
    boundary("refit_executor_run", || {
        let executor = live(executor, "executor")?;
        let mut taken = executor.take()?;
        let group = live(group, "group").inspect_err(|err| taken.refused(err))?;
        // SAFETY: stats NULL or writable (the caller's promise).
        let slot = unsafe { stats_slot(stats) }.inspect_err(|err| taken.refused(err))?;
        // SAFETY: the caller's documented promise on the plan's memory.
        let ran = unsafe { taken.run(&group.group) }?;
        if let Some(slot) = slot {
            slot.write(ran);
        }
        Ok(())
    })
}

/// Installs a staged step (REFIT_COMMIT_STAGED): copies the staging of its last slice into the live
/// buffers, one batched launch per receiving device on that device's group stream. When the run
/// was asked to verify and has not read the outcome (it ran inside a scope), the host first waits
/// for the verify stage and reads it; a mismatch installs nothing. `stats` as for
/// refit_executor_run.
///
/// Stream ordering as refit_executor_run: inside a scope, queued after the callers' streams (a
/// server stalls its own stream only for this copy); outside one, complete on return.
///
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT (another group, stats->size), INVALID_STATE (a direct
/// executor; nothing staged since the last commit; the last run or commit failed: the message says
/// why; run again; called from a rank callback of any group, or while another thread's call on
/// the executor or the group is in progress), VERIFY_MISMATCH (nothing installed),
/// CUDA_ERROR. After an error (any failed run or commit, as refit_executor_run says), run again
/// before committing. Thread-safety: see refit_executor.
#[no_mangle]
pub extern "C" fn refit_executor_commit(
    executor: *mut refit_executor,
    group: *mut refit_group,
    stats: *mut RunStats,
) -> Status {
    boundary("refit_executor_commit", || {
        let executor = live(executor, "executor")?;
        let mut taken = executor.take()?;
        let group = live(group, "group").inspect_err(|err| taken.refused(err))?;
        // SAFETY: stats NULL or writable (the caller's promise).
        let slot = unsafe { stats_slot(stats) }.inspect_err(|err| taken.refused(err))?;
        // SAFETY: as in refit_executor_run.
        let committed = unsafe { taken.commit(&group.group) }?;
        if let Some(slot) = slot {
            slot.write(committed);
        }
        Ok(())
    })
}

/// Writes the stats of the executor's last run or commit to `*stats` (set stats->size first),
/// device times included: blocks the host until that call's work has run on the device.
///
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT (stats->size), INVALID_STATE (no call has succeeded yet),
/// CUDA_ERROR. Thread-safety: see refit_executor.
#[no_mangle]
pub extern "C" fn refit_executor_stats(executor: *mut refit_executor, stats: *mut RunStats) -> Status {
    boundary("refit_executor_stats", || {
        let executor = live(executor, "executor")?;
        // SAFETY: stats NULL or writable (the caller's promise).
        let slot = unsafe { sized_out(stats, "stats") }?;
        slot.write(executor.take()?.stats()?);
        Ok(())
    })
}

/// Writes what `executor` was prepared to do to `*info` (set info->size first): the slices a run
/// takes, the device memory it holds (staging under staging_limit, and beside it quantization and
/// landing buffers), and what its creation spent checking addresses. Not ordered with
/// any stream; does not wait.
///
/// Errors: NULL_ARGUMENT (executor, info), INVALID_ARGUMENT (info->size, a handle that is not a live
/// executor), INVALID_STATE (another thread's call holds the executor). Thread-safety: see
/// refit_executor.
#[no_mangle]
pub extern "C" fn refit_executor_get_info(
    executor: *const refit_executor,
    info: *mut refit_executor_info,
) -> Status {
    boundary("refit_executor_get_info", || {
        let executor = live(executor, "executor")?;
        let executor = executor.take()?;
        let filled = refit_executor_info {
            size: std::mem::size_of::<refit_executor_info>(),
            slices: u32::try_from(executor.slices()).unwrap_or(u32::MAX),
            staging_bytes: executor.staging_bytes(),
            address_check_ns: executor.address_check_ns(),
            quantization_bytes: executor.quantization_bytes(),
            landing_bytes: executor.landing_bytes(),
        };
        // SAFETY: info writable with its size first, as many bytes as it says (the caller's promise).
        unsafe { write_versioned(info, "info", &[INFO_BEFORE_QUANTIZATION_BYTES], filled) }
    })
}

/// Tells the executor that the caller's memory [old_base, old_base + length) on `device` (a device
/// ordinal of the group) now lives at [new_base, new_base + length) (an engine freed and reallocated
/// its weights): later calls read and write the new place, with no planning and no host work per
/// segment. Blocks until the executor's queued work has run, then rewrites the prepared addresses in
/// that range (host work proportional to the segments touching it; the copy engine's verify, which
/// compares both sides, is rebuilt at the next run).
///
/// The range must hold whole buffers as the plan sees them: bytes that one segment reads or writes
/// together move together. A coalesced plan may join buffers that lie at regular distances into one
/// strided segment; a plan built with coalescing off keeps every buffer in segments of its own. A
/// buffer is named by where it is for the executor: where the last run had it, or where a rebind
/// since put it; a range holding both a moved and an unmoved buffer is refused (trade places through
/// a third address).
///
/// Errors (nothing changed): NULL_ARGUMENT, INVALID_DEVICE (not a device of the group),
/// INVALID_ARGUMENT (length 0, new_base 0, new_base equal to old_base: nothing moved, a range past
/// 2^64, a new place whose bytes the executor reads or writes are not memory of `device`: checked
/// here once, as refit_executor_create checks the plan's addresses, an ambiguous range, a new range
/// overlapping another buffer moved since the last run), NOT_FOUND (the plan uses no byte in the
/// range: nothing to rebind), PLAN_STALE (the range cuts through bytes the plan moves together: build
/// a new plan), INVALID_STATE (an earlier rebind failed to update the device; build a new executor),
/// CUDA_ERROR. Thread-safety: see refit_executor; not ordered with any stream (it waits for the
/// executor's own queued work first).
#[no_mangle]
pub extern "C" fn refit_executor_rebind(
    executor: *mut refit_executor,
    device: u32,
    old_base: u64,
    new_base: u64,
    length: u64,
) -> Status {
    boundary("refit_executor_rebind", || {
        let executor = live(executor, "executor")?;
        let device = i32::try_from(device).map_err(|_| {
            Error::new(Status::InvalidDevice, format!("device {device} is not a device ordinal"))
        })?;
        executor.take()?.rebind(device, old_base, new_base, length)?;
        Ok(())
    })
}

/// Releases an executor (NULL is ignored): waits for its queued work, then frees its descriptors,
/// streams and staging. A staged step not committed is dropped; the live buffers keep what they had.
/// Safe after its group was destroyed. Refused while another thread's call uses the executor (see
/// "Handles" at the top of this header).
#[no_mangle]
pub extern "C" fn refit_executor_destroy(executor: *mut refit_executor) {
    destroy(executor, "refit_executor_destroy")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::Method;
    use crate::ffi::group::{
        refit_group_create, refit_group_destroy, refit_group_options, refit_group_options_init,
        REFIT_BACKEND_HOST,
    };
    use crate::ffi::plan::{
        refit_plan_build, refit_plan_destroy, refit_table, refit_table_add_need, refit_table_add_offer,
        refit_table_add_tensor, refit_table_create, refit_table_destroy,
    };
    use std::ptr::{null, null_mut};

    #[test]
    fn calls_on_a_handle_another_thread_is_using_are_refused() {
        const N: usize = 64;
        let source: Vec<u32> = (0..N as u32).collect();
        let mut received = vec![0u32; N];
        let (mut group, mut table, mut plan, mut executor) = (null_mut(), null_mut(), null_mut(), null_mut());
        let mut options: refit_group_options = unsafe { std::mem::zeroed() };
        assert_eq!(refit_group_options_init(&mut options), Status::Success);
        options.backend = REFIT_BACKEND_HOST;
        assert_eq!(refit_group_create([0].as_ptr(), 1, &options, &mut group), Status::Success);
        let (shape, zero, unit) = ([N as u64], [0u64], [1u64]);
        let mut w = 0;
        // SAFETY: live handles and arrays of the lengths passed; the buffers outlive every call.
        unsafe {
            assert_eq!(refit_table_create(&mut table), Status::Success);
            let add = refit_table_add_tensor(table, c"w".as_ptr(), 1, 4, shape.as_ptr(), 1, &mut w);
            assert_eq!(add, Status::Success);
            let offer = refit_table_add_offer(
                table,
                w,
                0,
                0,
                source.as_ptr() as u64,
                zero.as_ptr(),
                shape.as_ptr(),
                null(),
                1,
                null(),
            );
            assert_eq!(offer, Status::Success);
            let need = refit_table_add_need(
                table,
                w,
                0,
                0,
                received.as_mut_ptr() as u64,
                zero.as_ptr(),
                shape.as_ptr(),
                null(),
                unit.as_ptr(),
                1,
            );
            assert_eq!(need, Status::Success);
            let tables = [table as *const refit_table];
            assert_eq!(refit_plan_build(tables.as_ptr(), 1, null(), &mut plan), Status::Success);
            assert_eq!(refit_executor_create(plan, group, 0, null(), &mut executor), Status::Success);

            // Another thread's call holds each handle: this one is refused and changes nothing.
            let (executor_object, table_object) = (live(executor, "e").unwrap(), live(table, "t").unwrap());
            let held = try_lock(&executor_object.executor).unwrap();
            assert_eq!(refit_executor_run(executor, group, null_mut()), Status::InvalidState);
            assert!(crate::error::last_error().contains("executor is in use"));
            drop(held);
            let writing = table_object.write().unwrap();
            let tensors = refit_table_add_tensor(table, c"x".as_ptr(), 1, 4, shape.as_ptr(), 1, &mut w);
            assert_eq!(tensors, Status::InvalidState);
            let mut other = null_mut();
            assert_eq!(refit_plan_build(tables.as_ptr(), 1, null(), &mut other), Status::InvalidState);
            assert!(crate::error::last_error().contains("table is in use"));
            drop(writing);
            // Readers overlap; a change waits for none of them, it is refused.
            let reading = table_object.read().unwrap();
            assert_eq!(refit_plan_build(tables.as_ptr(), 1, null(), &mut other), Status::Success);
            let tensors = refit_table_add_tensor(table, c"x".as_ptr(), 1, 4, shape.as_ptr(), 1, &mut w);
            assert_eq!(tensors, Status::InvalidState);
            drop(reading);
            refit_plan_destroy(other);
            // Destroying a handle that a call (these references) holds is refused, and changes nothing.
            refit_executor_destroy(executor);
            assert!(crate::error::last_error().contains("in use by a call in progress"));
            refit_table_destroy(table);
            assert!(crate::error::last_error().contains("in use by a call in progress"));
            drop((executor_object, table_object));

            assert_eq!(refit_executor_run(executor, group, null_mut()), Status::Success);
            assert_eq!(received, source);
            refit_executor_destroy(executor);
            refit_plan_destroy(plan);
            refit_table_destroy(table);
            refit_group_destroy(group);
        }
    }

    #[test]
    fn arm_codes_are_the_stats_codes() {
        assert_eq!(Method::code(Some(Method::Kernel)), REFIT_ARM_KERNEL);
        assert_eq!(Method::code(Some(Method::CopyEngine)), REFIT_ARM_COPY_ENGINE);
        assert_eq!(Method::code(Some(Method::Split)), REFIT_ARM_SPLIT);
        assert_eq!(Method::code(None), REFIT_ARM_NONE);
        for code in [REFIT_ARM_KERNEL, REFIT_ARM_COPY_ENGINE, REFIT_ARM_SPLIT, REFIT_ARM_NONE, REFIT_ARM_AUTO]
        {
            assert_eq!(
                Method::from_code(code).map(|m| Method::code(Some(m))),
                Some(code).filter(|&c| c == 1 || c == 2 || c == 4)
            );
        }
    }
}
