//! The reshard executor on the host backend: a colocated EP2 -> TP2 refit of a small MoE model over
//! two simulated devices. Every needed element of every receiver is compared with the value of the
//! tensor element it stands for (`element_value`, computed independently of the copy), for every arm,
//! direct and staged commit, sliced staging, verify, injected failures before commit, and rebinds.

#[path = "common/hooks.rs"]
mod hooks;

use hooks::failing_at;
use refit::exec::{Arm, CommitMode, ExecOptions, Executor, Method, RunStats, Stage};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::plan::{self, Endpoint, Need, Offer, Plan, PlanOptions, Region, Table, TensorSpec};
use refit::Status;
use refit_workloads::{element_value, Model, Moe, Packing, Role, Spec, Workload};
use std::sync::Arc;

const POISON: u8 = 0xa5;

/// Small enough to run in CI, large enough that every kind of slice (column splits, row splits,
/// whole experts, the vocabulary split) spans many strided rows.
fn small_moe() -> Model {
    Model {
        name: "small-moe".into(),
        layers: 2,
        hidden: 64,
        heads: 8,
        kv_heads: 4,
        head_dim: 8,
        qk_norm: true,
        ffn: 0,
        moe: Some(Moe { experts: 4, ffn: 48 }),
        vocab: 101,
        elem_size: 2,
        dtype: 2,
    }
}

fn host_group() -> Group {
    Group::new(&[0, 1], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

/// The workload in host memory: publishers filled, receivers poisoned, and its plan.
struct Refit {
    w: Workload,
    memory: Vec<Vec<u8>>,
    plan: Plan,
}

impl Refit {
    fn new(layout: Packing) -> Refit {
        Refit::with(layout, true)
    }

    /// `coalesce` false keeps every buffer's bytes in segments of their own (rebinds move buffers
    /// one by one; a coalesced plan may join buffers at regular distances into one segment).
    fn with(layout: Packing, coalesce: bool) -> Refit {
        let spec = Spec::qwen3_colocated_ep2_tp2(layout).with_model(small_moe());
        let w = Workload::generate(&spec).unwrap();
        let mut memory: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![POISON; b.bytes as usize]).collect();
        w.fill_offers(&mut memory.iter_mut().map(|m| m.as_mut_slice()).collect::<Vec<_>>());
        let bases: Vec<u64> = memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
        let options = PlanOptions { coalesce, ..PlanOptions::default() };
        let plan = plan::build(&w.tables(&bases).unwrap(), &options).unwrap();
        assert!(plan.stats().bytes_peer > 0 && plan.stats().bytes_local > 0, "both routes exercised");
        Refit { w, memory, plan }
    }

    fn receivers(&self) -> impl Iterator<Item = usize> + '_ {
        self.w.buffers.iter().enumerate().filter(|(_, b)| b.role == Role::Receiver).map(|(i, _)| i)
    }

    fn poison_receivers(&mut self) {
        for b in self.receivers().collect::<Vec<_>>() {
            self.memory[b].fill(POISON);
        }
    }

    /// Every receiver element that differs from the value it stands for, as "buffer: element".
    fn wrong_elements(&self) -> Vec<String> {
        let mut wrong = Vec::new();
        for n in &self.w.needs {
            let bytes = &self.memory[n.buffer as usize];
            self.w.for_each_element(n, |at, global| {
                let at = at as usize;
                let got = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
                if u64::from(got) != element_value(n.tensor, global) & 0xffff {
                    wrong.push(format!("{}: element {global}", self.w.buffers[n.buffer as usize].name));
                }
            });
        }
        wrong
    }

    fn assert_installed(&self, what: &str) {
        let wrong = self.wrong_elements();
        assert!(wrong.is_empty(), "{what}: {} wrong, first {}", wrong.len(), wrong[0]);
    }

    /// Whether every receiver byte still holds the poison.
    fn receivers_untouched(&self) -> bool {
        self.receivers().all(|b| self.memory[b].iter().all(|&x| x == POISON))
    }

    fn needed_bytes(&self) -> u64 {
        self.plan.receiver_stats(Endpoint { process: 0, device: 0 }).needed_bytes
            + self.plan.receiver_stats(Endpoint { process: 0, device: 1 }).needed_bytes
    }
}

fn executor(group: &Group, refit: &Refit, options: ExecOptions) -> Executor {
    Executor::new(group, &refit.plan, 0, options).unwrap()
}

/// Runs (and, when staged, commits) outside a scope.
fn step(executor: &mut Executor, group: &Group) -> refit::Result<RunStats> {
    // SAFETY: every address in the plan lies in the test's memory, alive for the whole test.
    let ran = unsafe { executor.run(group) }?;
    if executor.options().commit == CommitMode::Staged {
        // SAFETY: as above.
        unsafe { executor.commit(group) }?;
    }
    Ok(ran)
}

#[test]
fn every_arm_installs_every_element_in_both_publisher_layouts() {
    for layout in [Packing::Separate, Packing::Packed] {
        let mut results = Vec::new();
        for (arm, scoped) in [(Arm::Kernel, false), (Arm::CopyEngine, true), (Arm::Auto, false)] {
            let mut refit = Refit::new(layout);
            let group = host_group();
            let mut executor = executor(&group, &refit, ExecOptions { arm, ..ExecOptions::default() });
            for round in 0..3 {
                refit.poison_receivers();
                if scoped {
                    group.enter(None).unwrap();
                }
                // SAFETY: as in `step`.
                let stats = unsafe { executor.run(&group) }.unwrap();
                if scoped {
                    assert!(!stats.device_timed, "inside a scope the run does not wait");
                    group.exit(ExitMode::Sync).unwrap();
                    let later = executor.stats().unwrap();
                    assert!(later.device_timed && later.device_ns > 0);
                } else {
                    assert!(stats.device_timed && stats.local_ns > 0 && stats.peer_ns > 0);
                }
                assert!(stats.descriptors_reused);
                refit.assert_installed(&format!("{layout:?} {arm:?} round {round}"));
            }
            let expected = if arm == Arm::CopyEngine { Method::CopyEngine } else { Method::Kernel };
            assert_eq!(executor.methods()[0], Some(expected), "{arm:?}: small runs");
            results.push(refit.receivers().map(|b| refit.memory[b].clone()).collect::<Vec<_>>());
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{layout:?}: the arms installed different bytes");
    }
}

#[test]
fn stats_count_the_plan_and_attribute_the_wall_time() {
    let refit = Refit::new(Packing::Separate);
    let group = host_group();
    let mut executor = executor(&group, &refit, ExecOptions::default());
    let stats = step(&mut executor, &group).unwrap();
    let plan = refit.plan.stats();
    assert_eq!(stats.bytes, [plan.bytes_local, plan.bytes_peer, 0]);
    assert_eq!(stats.segments[0] + stats.segments[1], plan.ranges_coalesced);
    assert_eq!(stats.installed_bytes, refit.needed_bytes());
    assert_eq!((stats.slices, stats.verified, stats.verified_bytes), (1, false, 0));
    assert!(stats.attributed_ns() <= stats.wall_ns);
    assert!(stats.wait_ns > 0 && stats.enqueue_ns > 0);
    assert!(stats.device_ns >= stats.local_ns.max(stats.peer_ns));
    assert!(stats.summary("run").contains("kernel"));
    assert_eq!(executor.stats().unwrap(), stats);
}

#[test]
fn staged_runs_leave_live_buffers_alone_until_commit() {
    for (limit, verify) in [(0, false), (0, true), (4096, true), (64 << 10, false)] {
        let mut refit = Refit::new(Packing::Separate);
        let group = host_group();
        let options = ExecOptions {
            commit: CommitMode::Staged,
            staging_limit: limit,
            verify,
            ..ExecOptions::default()
        };
        let mut executor = executor(&group, &refit, options);
        let what = format!("limit {limit} verify {verify}");
        for round in 0..2 {
            refit.poison_receivers();
            // Inside a scope, as a server receiving while it generates would.
            group.enter(None).unwrap();
            // SAFETY: as in `step`.
            let ran = unsafe { executor.run(&group) }.unwrap();
            group.exit(ExitMode::Sync).unwrap();
            if executor.slices() == 1 {
                assert!(refit.receivers_untouched(), "{what}: a staged run wrote live bytes");
                assert_eq!(ran.installed_bytes, 0);
            } else {
                assert!(ran.installed_bytes > 0 && ran.installed_bytes < refit.needed_bytes());
            }
            // SAFETY: as in `step`.
            let committed = unsafe { executor.commit(&group) }.unwrap();
            assert_eq!(ran.installed_bytes + committed.installed_bytes, refit.needed_bytes(), "{what}");
            assert_eq!(committed.verified, verify);
            refit.assert_installed(&format!("{what} round {round}"));
        }
        if limit == 4096 {
            assert!(executor.slices() > 10, "a small limit cuts the step into slices");
        }
        // SAFETY: as in `step`.
        let err = unsafe { executor.commit(&group) }.unwrap_err();
        assert_eq!(err.status, Status::InvalidState, "a second commit of one run: {}", err.message);
    }
}

#[test]
fn a_failure_before_commit_leaves_every_live_byte_unchanged() {
    let staged =
        |hook| ExecOptions { commit: CommitMode::Staged, verify: true, hook, ..ExecOptions::default() };
    let group = host_group();

    // A driver error while verifying: the run fails, nothing may be committed, nothing was written.
    let refit = Refit::new(Packing::Separate);
    let mut failing = executor(&group, &refit, staged(Some(failing_at(Stage::Verify { slice: 0 }))));
    // SAFETY: as in `step`.
    assert_eq!(unsafe { failing.run(&group) }.unwrap_err().status, Status::CudaError);
    let err = unsafe { failing.commit(&group) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidState);
    assert!(err.message.contains("injected failure"), "{}", err.message);
    assert!(refit.receivers_untouched());

    // A failure in the commit itself, before its install is queued.
    let mut failing = executor(&group, &refit, staged(Some(failing_at(Stage::Install { slice: 0 }))));
    // SAFETY: as in `step`.
    unsafe { failing.run(&group) }.unwrap();
    assert_eq!(unsafe { failing.commit(&group) }.unwrap_err().status, Status::CudaError);
    assert!(refit.receivers_untouched());

    // A cancelled step: run, never committed, the executor dropped.
    let mut cancelled = executor(&group, &refit, staged(None));
    // SAFETY: as in `step`.
    unsafe { cancelled.run(&group) }.unwrap();
    drop(cancelled);
    assert!(refit.receivers_untouched());
}

/// A hook that, just before the verify stage, queues on rank 1's stream a change of one byte at
/// `address` (after the copies, before the comparison).
fn corrupting(address: u64) -> refit::exec::Hook {
    Arc::new(move |stage, group: &Group| {
        if stage == (Stage::Verify { slice: 0 }) {
            let stream = refit::transport::host::host_stream(group.stream(1)?)?;
            // SAFETY: the address is a byte of the test's memory, alive for the whole test.
            stream.enqueue(move || unsafe { *(address as usize as *mut u8) ^= 0x10 })?;
        }
        Ok(())
    })
}

#[test]
fn verify_names_the_tensor_of_a_corrupted_byte() {
    let group = host_group();
    // Direct: one byte of a receiver buffer on device 1 flipped between copy and verify.
    let mut refit = Refit::new(Packing::Separate);
    let (b, buffer) = refit
        .w
        .buffers
        .iter()
        .enumerate()
        .find(|(_, b)| b.role == Role::Receiver && b.endpoint.device == 1 && b.name.contains("o_proj"))
        .map(|(i, b)| (i, b.clone()))
        .expect("a receiver o_proj on device 1");
    let address = refit.memory[b].as_mut_ptr() as u64 + 37;
    let options = ExecOptions { verify: true, hook: Some(corrupting(address)), ..ExecOptions::default() };
    let mut direct = executor(&group, &refit, options);
    // SAFETY: as in `step`.
    let err = unsafe { direct.run(&group) }.unwrap_err();
    assert_eq!(err.status, Status::VerifyMismatch, "{}", err.message);
    assert!(err.message.contains(&format!("tensor '{}'", buffer.name)), "names the tensor: {}", err.message);
    // Byte 37 is element 18 of the row-major [64, 32] box at columns 32.. (the second TP half of
    // the row-parallel o_proj): row 0, column 32 + 18.
    assert!(err.message.contains("box offset [0, 32] extent [64, 32]: element [0, 50]"), "{}", err.message);
    assert!(err.message.contains("box offset") && err.message.contains("element"), "{}", err.message);
    // Without the corruption the same executor verifies clean.
    let mut clean = executor(&group, &refit, ExecOptions { verify: true, ..ExecOptions::default() });
    refit.poison_receivers();
    let stats = step(&mut clean, &group).unwrap();
    assert!(stats.verified && stats.verified_bytes == refit.needed_bytes());
    refit.assert_installed("verified");

    // Staged: a publisher byte (a source replica) changed after the copy into staging; commit is
    // refused and the live buffers keep what they had.
    let refit = Refit::new(Packing::Separate);
    let source = refit.plan.routes().iter().find(|r| r.dst.device == 1).unwrap().segments[0].src;
    let options = ExecOptions {
        verify: true,
        commit: CommitMode::Staged,
        hook: Some(corrupting(source)),
        ..ExecOptions::default()
    };
    let mut staged = executor(&group, &refit, options);
    group.enter(None).unwrap();
    // SAFETY: as in `step`.
    unsafe { staged.run(&group) }.unwrap();
    group.exit(ExitMode::Sync).unwrap();
    let err = unsafe { staged.commit(&group) }.unwrap_err();
    assert_eq!(err.status, Status::VerifyMismatch, "{}", err.message);
    assert!(err.message.contains("tensor '"), "{}", err.message);
    assert!(refit.receivers_untouched());
}

#[test]
fn rebound_buffers_receive_at_their_new_place() {
    for commit in [CommitMode::Direct, CommitMode::Staged] {
        let mut refit = Refit::with(Packing::Separate, false);
        let group = host_group();
        let options = ExecOptions { commit, verify: true, ..ExecOptions::default() };
        let mut executor = executor(&group, &refit, options);
        step(&mut executor, &group).unwrap();
        refit.assert_installed("before the move");
        // Every receiver buffer and the first publisher buffer move (an engine that freed and
        // reallocated its weights); the old places are poisoned and must stay so.
        let first_publisher = refit.w.buffers.iter().position(|b| b.role == Role::Publisher).unwrap();
        let moved: Vec<usize> = refit.receivers().chain([first_publisher]).collect();
        let mut old_memory = Vec::new();
        for &b in &moved {
            let mut fresh = if b == first_publisher {
                refit.memory[b].clone()
            } else {
                vec![POISON; refit.memory[b].len()]
            };
            std::mem::swap(&mut refit.memory[b], &mut fresh);
            let device = refit.w.buffers[b].endpoint.device as i32;
            let (old, new) = (fresh.as_ptr() as u64, refit.memory[b].as_ptr() as u64);
            executor.rebind(device, old, new, fresh.len() as u64).unwrap();
            fresh.fill(POISON);
            old_memory.push(fresh);
        }
        let stats = step(&mut executor, &group).unwrap();
        assert!(!stats.descriptors_reused, "verify descriptors were rebuilt");
        refit.assert_installed(&format!("{commit:?} after rebinds"));
        assert!(old_memory.iter().all(|m| m.iter().all(|&x| x == POISON)), "an old place was written");
        let again = step(&mut executor, &group).unwrap();
        assert!(again.descriptors_reused);
    }
}

#[test]
fn bad_rebinds_and_calls_get_their_status() {
    let mut refit = Refit::with(Packing::Separate, false);
    let group = host_group();
    let mut executor = executor(&group, &refit, ExecOptions::default());
    let b = refit.receivers().next().unwrap();
    let device = refit.w.buffers[b].endpoint.device as i32;
    let (base, len) = (refit.memory[b].as_mut_ptr() as u64, refit.memory[b].len() as u64);
    let cut = executor.rebind(device, base, 0x1000, len / 2).unwrap_err();
    assert_eq!(cut.status, Status::PlanStale, "{}", cut.message);
    assert!(cut.message.contains("new plan"), "{}", cut.message);
    let elsewhere = [0u8; 64];
    let none = executor.rebind(device, elsewhere.as_ptr() as u64, 0x1000, 64).unwrap_err();
    assert_eq!(none.status, Status::NotFound, "{}", none.message);
    assert_eq!(executor.rebind(5, base, 0x1000, len).unwrap_err().status, Status::InvalidDevice);
    assert_eq!(executor.rebind(device, base, 0x1000, 0).unwrap_err().status, Status::InvalidArgument);
    assert_eq!(executor.rebind(device, base, u64::MAX - 8, len).unwrap_err().status, Status::InvalidArgument);
    // Nothing changed: the executor still installs into the original buffers.
    refit.poison_receivers();
    step(&mut executor, &group).unwrap();
    refit.assert_installed("after refused rebinds");

    let other = host_group();
    // SAFETY: as in `step` (refused before anything is queued).
    assert_eq!(unsafe { executor.run(&other) }.unwrap_err().status, Status::InvalidArgument);
    assert_eq!(unsafe { executor.commit(&group) }.unwrap_err().status, Status::InvalidState);
    let mut staged = Executor::new(
        &group,
        &refit.plan,
        0,
        ExecOptions { commit: CommitMode::Staged, ..ExecOptions::default() },
    )
    .unwrap();
    let err = unsafe { staged.commit(&group) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidState);
    assert!(err.message.contains("run first"), "{}", err.message);
    assert_eq!(staged.stats().unwrap_err().status, Status::InvalidState);

    for (options, what) in [
        (ExecOptions { arm: Arm::CopyEngine, sm_budget: 8, ..ExecOptions::default() }, "sm_budget"),
        (ExecOptions { staging_limit: 1 << 20, ..ExecOptions::default() }, "staged"),
        (ExecOptions { commit: CommitMode::Staged, staging_limit: 100, ..ExecOptions::default() }, "below"),
    ] {
        let err = Executor::new(&group, &refit.plan, 0, options).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument);
        assert!(err.message.contains(what), "{}", err.message);
    }
    // A process the plan never names would move nothing and report success: refused.
    for commit in [CommitMode::Direct, CommitMode::Staged] {
        let options = ExecOptions { commit, verify: true, ..ExecOptions::default() };
        let err = Executor::new(&group, &refit.plan, 7, options).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
        assert!(err.message.contains("process 7") && err.message.contains("[0]"), "{}", err.message);
    }
    // Its own share names it, even when it moves nothing.
    let bases: Vec<u64> = refit.memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
    let tables = refit.w.tables(&bases).unwrap();
    let refs: Vec<&plan::Table> = tables.iter().collect();
    let idle_share = plan::build_share(&refs, 7, &PlanOptions::default(), &plan::Limits::default()).unwrap();
    let mut idle = Executor::new(&group, &idle_share, 7, ExecOptions::default()).unwrap();
    let stats = step(&mut idle, &group).unwrap();
    assert_eq!((stats.bytes, stats.installed_bytes), ([0, 0, 0], 0));
    // The plan names device 1; a group without it cannot run it.
    let lonely = Group::new(&[0], GroupOptions { backend: BackendChoice::Host, host_devices: 2 }).unwrap();
    assert_eq!(
        Executor::new(&lonely, &refit.plan, 0, ExecOptions::default()).err().unwrap().status,
        Status::NotFound
    );
}

#[test]
fn a_share_drives_its_own_process_only() {
    let mut refit = Refit::new(Packing::Separate);
    let group = host_group();
    let bases: Vec<u64> = refit.memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
    let tables = refit.w.tables(&bases).unwrap();
    let refs: Vec<&plan::Table> = tables.iter().collect();
    let share =
        |process| plan::build_share(&refs, process, &PlanOptions::default(), &plan::Limits::default());
    let own = share(0).unwrap();
    assert_eq!(own.share_of(), Some(0));
    let mut executor = Executor::new(&group, &own, 0, ExecOptions::default()).unwrap();
    refit.poison_receivers();
    step(&mut executor, &group).unwrap();
    refit.assert_installed("process 0's share");
    // Process 3 takes part in nothing, so its share holds none of process 0's routes: driving
    // process 0 with it would move nothing and report success.
    let err = Executor::new(&group, &share(3).unwrap(), 0, ExecOptions::default()).err().unwrap();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    assert!(err.message.contains("process 3's share"), "{}", err.message);
    assert_eq!(refit.plan.share_of(), None);
}

#[test]
fn a_failed_call_disarms_the_commit_until_a_run_succeeds() {
    let refit = Refit::new(Packing::Separate);
    let (group, other) = (host_group(), host_group());
    let options = ExecOptions { commit: CommitMode::Staged, ..ExecOptions::default() };
    let mut executor = executor(&group, &refit, options);
    // SAFETY (every call below): as in `step`; a refused call queues nothing.
    unsafe {
        // A refused run (another group) after a good one: the step staged before is not committed.
        executor.run(&group).unwrap();
        assert_eq!(executor.run(&other).unwrap_err().status, Status::InvalidArgument);
        let err = executor.commit(&group).unwrap_err();
        assert_eq!(err.status, Status::InvalidState, "{}", err.message);
        assert!(err.message.contains("another group"), "{}", err.message);
        assert!(refit.receivers_untouched(), "a commit after a failed run installed the earlier step");
        // A refused commit: nothing can be committed until a run succeeds.
        executor.run(&group).unwrap();
        assert_eq!(executor.commit(&other).unwrap_err().status, Status::InvalidArgument);
        assert_eq!(executor.commit(&group).unwrap_err().status, Status::InvalidState);
        assert!(refit.receivers_untouched());
        // A refusal recorded by the C API (an argument it checks before the executor sees the call).
        executor.run(&group).unwrap();
        executor.refused(&refit::Error::invalid_argument("stats->size = 3"));
        let err = executor.commit(&group).unwrap_err();
        assert!(err.message.contains("stats->size"), "{}", err.message);
        // A run that succeeds arms it again.
        executor.run(&group).unwrap();
        executor.commit(&group).unwrap();
    }
    refit.assert_installed("after the run that re-armed the commit");
}

#[test]
fn prepare_time_is_zero_exactly_when_descriptors_are_reused() {
    let mut refit = Refit::with(Packing::Separate, false);
    let group = host_group();
    // The copy engine's verify compares both sides: a rebind of a source rebuilds it.
    let options = ExecOptions { arm: Arm::CopyEngine, verify: true, ..ExecOptions::default() };
    let mut executor = executor(&group, &refit, options);
    for _ in 0..3 {
        let stats = step(&mut executor, &group).unwrap();
        assert!(stats.descriptors_reused);
        assert_eq!(stats.prepare_ns, 0, "{stats:?}");
        assert!(stats.attributed_ns() <= stats.wall_ns && stats.enqueue_ns > 0);
    }
    let publisher = refit.w.buffers.iter().position(|b| b.role == Role::Publisher).unwrap();
    let mut moved = refit.memory[publisher].clone();
    std::mem::swap(&mut refit.memory[publisher], &mut moved);
    let device = refit.w.buffers[publisher].endpoint.device as i32;
    let len = moved.len() as u64;
    executor.rebind(device, moved.as_ptr() as u64, refit.memory[publisher].as_ptr() as u64, len).unwrap();
    let rebuilt = step(&mut executor, &group).unwrap();
    assert!(!rebuilt.descriptors_reused);
    assert!(rebuilt.prepare_ns > 0, "{rebuilt:?}");
    refit.assert_installed("after the rebind");
    let again = step(&mut executor, &group).unwrap();
    assert_eq!((again.descriptors_reused, again.prepare_ns), (true, 0));
}

#[test]
fn verified_is_reported_with_the_bytes_the_call_checked() {
    let mut refit = Refit::new(Packing::Separate);
    let group = host_group();
    let options = ExecOptions { commit: CommitMode::Staged, verify: true, ..ExecOptions::default() };
    let mut executor = executor(&group, &refit, options);
    let payload = refit.needed_bytes();
    // SAFETY (every call below): as in `step`.
    unsafe {
        // Outside a scope the run reads every check; the commit reports the checked bytes it installs.
        let ran = executor.run(&group).unwrap();
        assert_eq!((ran.verified, ran.verified_bytes), (true, payload));
        let committed = executor.commit(&group).unwrap();
        assert_eq!((committed.verified, committed.verified_bytes), (true, payload), "{committed:?}");
        // Inside a scope the run leaves the (one) slice's check to the commit.
        refit.poison_receivers();
        group.enter(None).unwrap();
        let ran = executor.run(&group).unwrap();
        group.exit(ExitMode::Sync).unwrap();
        assert_eq!((ran.verified, ran.verified_bytes), (false, 0), "{ran:?}");
        let committed = executor.commit(&group).unwrap();
        assert_eq!((committed.verified, committed.verified_bytes), (true, payload), "{committed:?}");
    }
    refit.assert_installed("verified staged step");
}

#[test]
fn a_rebind_onto_the_same_place_is_refused_and_changes_nothing() {
    let mut refit = Refit::with(Packing::Separate, false);
    let group = host_group();
    let mut executor = executor(&group, &refit, ExecOptions::default());
    let b = refit.receivers().next().unwrap();
    let device = refit.w.buffers[b].endpoint.device as i32;
    let (base, len) = (refit.memory[b].as_mut_ptr() as u64, refit.memory[b].len() as u64);
    let err = executor.rebind(device, base, base, len).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    assert!(err.message.contains("has not moved"), "{}", err.message);
    // A new place that is no memory (the first page) is refused the same way, changing nothing.
    let err = executor.rebind(device, base, 0x100, len).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    assert!(err.message.contains("[0x100,") && err.message.contains("first page"), "{}", err.message);
    for round in 0..2 {
        refit.poison_receivers();
        step(&mut executor, &group).unwrap();
        refit.assert_installed(&format!("round {round} after the refused rebind"));
    }
}

/// A plan moving `rows` runs of `len` bytes of tensor "w" ([rows, len] bytes, offered whole at
/// `src` on device 0) into `dst` on device `to`, each run `pitch` bytes from the next.
fn rows_plan(src: u64, dst: u64, to: u32, (rows, len, pitch): (u64, u64, u64)) -> Plan {
    let here = |device| Endpoint { process: 0, device };
    let whole = Region { offset: vec![0, 0], extent: vec![rows, len] };
    let table = Table {
        tensors: vec![TensorSpec { name: "w".into(), dtype: 1, elem_size: 1, shape: vec![rows, len] }],
        offers: vec![Offer {
            tensor: 0,
            owner: here(0),
            addr: src,
            region: whole.clone(),
            strides: None,
            digest: None,
        }],
        needs: vec![Need {
            tensor: 0,
            receiver: here(to),
            addr: dst,
            region: whole,
            perm: None,
            strides: vec![pitch, 1],
        }],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    };
    plan::build(&[table], &PlanOptions::default()).unwrap()
}

#[test]
fn addresses_in_the_first_page_are_refused_at_create_and_planning_keeps_them() {
    let group = host_group();
    let mut memory = vec![7u8; 1 << 16];
    let real = memory.as_mut_ptr() as u64;
    // The planner checks no address: fake ones plan (an offer at 0 plans to a segment near 0).
    for (src, dst, side) in [(0x10, real, "source"), (real, 0xf80, "destination")] {
        let plan = rows_plan(src, dst, 1, (4, 64, 64));
        for commit in [CommitMode::Direct, CommitMode::Staged] {
            let err = Executor::new(&group, &plan, 0, ExecOptions { commit, ..ExecOptions::default() })
                .err()
                .unwrap_or_else(|| panic!("{side} at {src:#x}/{dst:#x} was accepted"));
            assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
            for word in ["tensor 'w'", "box offset [0, 0] extent [4, 64]", side, "first page"] {
                assert!(err.message.contains(word), "{word:?} missing: {}", err.message);
            }
        }
    }
    // A segment at address 0 itself was refused before (by the batched copy's checks).
    let at_zero = rows_plan(0, real, 1, (4, 64, 64));
    let err = Executor::new(&group, &at_zero, 0, ExecOptions::default()).err().unwrap();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    // Real memory on both sides: created, and it moves the bytes.
    let (src, dst) = (real, real + (1 << 15));
    let plan = rows_plan(src, dst, 1, (4, 64, 64));
    let mut executor = Executor::new(&group, &plan, 0, ExecOptions::default()).unwrap();
    step(&mut executor, &group).unwrap();
    assert_eq!(memory[1 << 15..(1 << 15) + 256], [7u8; 256]);
}

#[test]
fn a_payload_within_the_staging_limit_is_staged_in_one_slice() {
    let group = host_group();
    // 1200 runs of 3 bytes (3,600 bytes of payload) into rows 16 bytes apart, at an odd address:
    // aligned like their destinations they would need more than 4,096 bytes of staging.
    let (rows, len, pitch) = (1200u64, 3u64, 16u64);
    let source: Vec<u8> = (0..rows * len).map(|i| (i * 7 + 1) as u8).collect();
    let mut received = vec![0u8; (rows * pitch + 1) as usize];
    let dst = received.as_mut_ptr() as u64 + 1;
    let plan = rows_plan(source.as_ptr() as u64, dst, 1, (rows, len, pitch));
    let staged = |limit, single_slice| ExecOptions {
        commit: CommitMode::Staged,
        staging_limit: limit,
        single_slice,
        ..ExecOptions::default()
    };
    let mut executor = Executor::new(&group, &plan, 0, staged(4096, true)).unwrap();
    assert_eq!(executor.slices(), 1, "the padding alone cut the step into slices");
    assert!(executor.staging_bytes() >= rows * len && executor.staging_bytes() < 4096 + 32);
    // SAFETY: the plan's memory is this test's, alive throughout.
    let ran = unsafe { executor.run(&group) }.unwrap();
    assert_eq!((ran.slices, ran.installed_bytes), (1, 0));
    assert!(received.iter().all(|&b| b == 0), "a staged run wrote live bytes");
    unsafe { executor.commit(&group) }.unwrap();
    for r in 0..rows as usize {
        let at = 1 + r * pitch as usize;
        assert_eq!(received[at..at + 3], source[3 * r..3 * r + 3], "row {r}");
    }
    // Verified, the densely staged step checks out, and installs the same bytes.
    let installed = received.clone();
    received.fill(0);
    let verified = ExecOptions { verify: true, ..staged(4096, true) };
    let mut executor = Executor::new(&group, &plan, 0, verified).unwrap();
    let ran = step(&mut executor, &group).unwrap();
    assert!(ran.verified && ran.verified_bytes == rows * len, "{ran:?}");
    assert_eq!(received, installed);
    // A payload above the limit: slices, seen at create, and refused when one slice is required.
    let (rows, len) = (64u64, 128u64);
    let big: Vec<u8> = vec![1; (rows * len) as usize];
    let mut into = vec![0u8; (rows * len) as usize];
    let plan = rows_plan(big.as_ptr() as u64, into.as_mut_ptr() as u64, 1, (rows, len, len));
    assert!(Executor::new(&group, &plan, 0, staged(4096, false)).unwrap().slices() > 1);
    let err = Executor::new(&group, &plan, 0, staged(4096, true)).err().unwrap();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("single_slice") && err.message.contains("8192"), "{}", err.message);
    let direct = ExecOptions { single_slice: true, ..ExecOptions::default() };
    assert_eq!(Executor::new(&group, &plan, 0, direct).err().unwrap().status, Status::InvalidArgument);
}
