//! The executor on real GPUs (run on the GPU machine with `--ignored --test-threads=1`): a colocated
//! EP -> TP refit of a small MoE model on one GPU and, where there are two, on two. Receivers are
//! poisoned before every step and every needed element is compared with the value of the tensor
//! element it stands for (`Workload::check_needs`: values computed on the host, never copied), for every arm,
//! on caller streams, under an SM budget, staged (with and without slices), with verify catching a
//! byte corrupted between copy and verify, with failures injected before the commit (live bytes
//! must stay poisoned), and after rebinding the receivers to new allocations.

#[path = "common/hooks.rs"]
mod hooks;

mod gpu_common;

use cudarc::driver::sys;
use gpu_common::{caller_stream, ck, cuda, group_sizes, DeviceBuffer};
use hooks::failing_at;
use refit::exec::{Arm, CommitMode, ExecOptions, Executor, Hook, Method, Stage};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::plan::{self, Endpoint, Plan, PlanOptions, RouteKind};
use refit::transport::{Backend, Stream};
use refit::Status;
use refit_workloads::{Megatron, Model, Moe, Packing, Role, Spec, Vllm, Workload};
use std::sync::Arc;

const POISON: u8 = 0xAB;

fn small_moe() -> Model {
    Model {
        name: "small-moe".into(),
        layers: 2,
        hidden: 256,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        qk_norm: true,
        ffn: 0,
        moe: Some(Moe { experts: 8, ffn: 192 }),
        vocab: 1001,
        elem_size: 2,
        dtype: 2,
    }
}

fn gpu_group(size: usize) -> Group {
    let devices: Vec<i32> = (0..size as i32).collect();
    Group::new(&devices, GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }).unwrap()
}

/// The workload on `size` GPUs: publishers filled with known values, receivers poisoned.
struct Refit {
    w: Workload,
    buffers: Vec<DeviceBuffer>,
    plan: Plan,
}

impl Refit {
    fn new(size: usize, coalesce: bool) -> Refit {
        Refit::of(small_moe(), size, coalesce)
    }

    fn of(model: Model, size: usize, coalesce: bool) -> Refit {
        let endpoints: Vec<Endpoint> =
            (0..size as u32).map(|device| Endpoint { process: 0, device }).collect();
        let spec = Spec {
            model,
            publishers: Megatron {
                endpoints: endpoints.clone(),
                tp: 1,
                ep: size as u64,
                grouped_experts: true,
            },
            publisher_layout: Packing::Separate,
            receivers: Vllm { endpoints },
            receiver_layout: Packing::Separate,
            digests: true,
        };
        let w = Workload::generate(&spec).unwrap();
        let buffers: Vec<DeviceBuffer> =
            w.buffers.iter().map(|b| DeviceBuffer::new(b.endpoint.device as i32, b.bytes as usize)).collect();
        let mut host: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![0u8; b.bytes as usize]).collect();
        w.fill_offers(&mut host.iter_mut().map(|m| m.as_mut_slice()).collect::<Vec<_>>());
        for (b, buffer) in w.buffers.iter().enumerate() {
            if buffer.role == Role::Publisher {
                buffers[b].write(0, &host[b]);
            }
        }
        let bases: Vec<u64> = buffers.iter().map(|b| b.ptr).collect();
        let options = PlanOptions { coalesce, ..PlanOptions::default() };
        let plan = plan::build(&w.tables(&bases).unwrap(), &options).unwrap();
        let refit = Refit { w, buffers, plan };
        refit.poison();
        refit
    }

    fn receivers(&self) -> Vec<usize> {
        (0..self.w.buffers.len()).filter(|&b| self.w.buffers[b].role == Role::Receiver).collect()
    }

    fn poison(&self) {
        for b in self.receivers() {
            self.buffers[b].poison();
        }
    }

    /// Every receiver buffer read back (empty for publishers).
    fn read(&self) -> Vec<Vec<u8>> {
        (0..self.buffers.len())
            .map(
                |b| {
                    if self.w.buffers[b].role == Role::Receiver {
                        self.buffers[b].read()
                    } else {
                        Vec::new()
                    }
                },
            )
            .collect()
    }

    fn assert_installed(&self, what: &str) {
        let memory = self.read();
        let slices: Vec<&[u8]> = memory.iter().map(|m| m.as_slice()).collect();
        let checked = self.w.check_needs(&slices).unwrap_or_else(|wrong| panic!("{what}: {wrong}"));
        assert!(checked > 0);
    }

    /// Moves every receiver to a new, poisoned allocation and tells `executor`; returns the old
    /// allocations, poisoned and kept (nothing may write them any more).
    fn move_receivers(&mut self, executor: &mut Executor) -> Vec<DeviceBuffer> {
        let mut old = Vec::new();
        for b in self.receivers() {
            let fresh = DeviceBuffer::new(self.buffers[b].device, self.buffers[b].len);
            fresh.poison();
            let was = std::mem::replace(&mut self.buffers[b], fresh);
            executor.rebind(was.device, was.ptr, self.buffers[b].ptr, was.len as u64).unwrap();
            was.poison();
            old.push(was);
        }
        old
    }

    fn assert_untouched(old: &[DeviceBuffer]) {
        for was in old {
            assert!(was.read().iter().all(|&x| x == POISON), "an old allocation was written");
        }
    }

    fn assert_poisoned(&self, what: &str) {
        for (b, bytes) in self.read().iter().enumerate() {
            if self.w.buffers[b].role == Role::Receiver {
                assert!(bytes.iter().all(|&x| x == POISON), "{what}: {} was written", self.w.buffers[b].name);
            }
        }
    }
}

/// Runs one step outside a scope (and commits it when staged).
fn step(executor: &mut Executor, group: &Group) -> refit::Result<refit::exec::RunStats> {
    // SAFETY: every address of the plan is a live DeviceBuffer of the test.
    let ran = unsafe { executor.run(group) }?;
    if executor.options().commit == CommitMode::Staged {
        // SAFETY: as above.
        unsafe { executor.commit(group) }?;
    }
    Ok(ran)
}

#[test]
#[ignore = "needs a GPU"]
fn every_arm_installs_every_element() {
    for size in group_sizes().into_iter().filter(|&s| s <= 2) {
        let refit = Refit::new(size, true);
        let group = gpu_group(size);
        for (arm, sm_budget) in
            [(Arm::Kernel, 0), (Arm::Kernel, 8), (Arm::CopyEngine, 0), (Arm::Auto, 0), (Arm::Auto, 8)]
        {
            let options = ExecOptions { arm, sm_budget, ..ExecOptions::default() };
            let mut executor = Executor::new(&group, &refit.plan, 0, options).unwrap();
            for round in 0..2 {
                refit.poison();
                let stats = step(&mut executor, &group).unwrap();
                refit.assert_installed(&format!("{size} GPU(s), {arm:?} budget {sm_budget}, round {round}"));
                assert!(stats.device_timed && stats.device_ns > 0 && stats.local_ns > 0);
                assert_eq!(stats.peer_ns > 0, size > 1);
                // AUTO under an SM budget moves everything by the copy engine, which uses no SMs.
                let engine = arm == Arm::CopyEngine || (arm == Arm::Auto && sm_budget > 0);
                let want = if engine { Method::CopyEngine } else { Method::Kernel };
                assert_eq!(stats.method(RouteKind::Local), Some(want));
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_run_on_caller_streams_is_ordered_and_does_not_wait() {
    for size in group_sizes().into_iter().filter(|&s| s <= 2) {
        let refit = Refit::new(size, true);
        let group = gpu_group(size);
        let mut executor = Executor::new(&group, &refit.plan, 0, ExecOptions::default()).unwrap();
        let callers: Vec<Stream> = (0..size as i32).map(caller_stream).collect();
        for round in 0..3 {
            refit.poison();
            group.enter(Some(&callers)).unwrap();
            // SAFETY: as in `step`.
            let queued = unsafe { executor.run(&group) }.unwrap();
            assert!(!queued.device_timed);
            group.exit(ExitMode::Async).unwrap();
            for (rank, &stream) in callers.iter().enumerate() {
                cuda().sync_stream(rank as i32, stream).unwrap();
            }
            refit.assert_installed(&format!("{size} GPU(s) on caller streams, round {round}"));
            assert!(executor.stats().unwrap().device_timed);
        }
        for (rank, stream) in callers.into_iter().enumerate() {
            cuda().destroy_stream(rank as i32, stream);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn staged_steps_touch_live_bytes_only_at_commit() {
    for size in group_sizes().into_iter().filter(|&s| s <= 2) {
        let refit = Refit::new(size, true);
        let group = gpu_group(size);
        for limit in [0u64, 256 << 10] {
            let options =
                ExecOptions { commit: CommitMode::Staged, staging_limit: limit, ..ExecOptions::default() };
            let mut executor = Executor::new(&group, &refit.plan, 0, options).unwrap();
            refit.poison();
            // SAFETY: as in `step`.
            let ran = unsafe { executor.run(&group) }.unwrap();
            if ran.slices == 1 {
                refit.assert_poisoned("after a staged run");
            } else {
                assert!(limit > 0 && ran.installed_bytes > 0);
            }
            // SAFETY: as in `step`.
            let committed = unsafe { executor.commit(&group) }.unwrap();
            assert!(committed.commit_ns > 0);
            refit.assert_installed(&format!("{size} GPU(s) staged, limit {limit}"));
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_failure_before_commit_leaves_every_live_byte_unchanged() {
    let size = group_sizes().into_iter().filter(|&s| s <= 2).max().unwrap();
    let refit = Refit::new(size, true);
    let group = gpu_group(size);
    let staged = |hook| ExecOptions { commit: CommitMode::Staged, hook, ..ExecOptions::default() };
    let mut failing =
        Executor::new(&group, &refit.plan, 0, staged(Some(failing_at(Stage::Copy { slice: 0 })))).unwrap();
    // SAFETY: as in `step`.
    assert_eq!(unsafe { failing.run(&group) }.unwrap_err().status, Status::CudaError);
    assert_eq!(unsafe { failing.commit(&group) }.unwrap_err().status, Status::InvalidState);
    let mut failing =
        Executor::new(&group, &refit.plan, 0, staged(Some(failing_at(Stage::Install { slice: 0 })))).unwrap();
    // SAFETY: as in `step`.
    unsafe { failing.run(&group) }.unwrap();
    assert_eq!(unsafe { failing.commit(&group) }.unwrap_err().status, Status::CudaError);
    let mut cancelled = Executor::new(&group, &refit.plan, 0, staged(None)).unwrap();
    // SAFETY: as in `step`.
    unsafe { cancelled.run(&group) }.unwrap();
    drop(cancelled);
    group.synchronize().unwrap();
    refit.assert_poisoned("after failures before commit");
}

/// A hook that, just before the verify stage, changes one byte at `address` (after the copies,
/// before the comparison): it waits for every device of the group (whichever stream copied the
/// byte), then writes it.
fn corrupting(address: u64) -> Hook {
    Arc::new(move |stage, group: &Group| {
        if stage == (Stage::Verify { slice: 0 }) {
            for rank in 0..group.size() {
                cuda().bind(group.device(rank)?)?;
                ck("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
            }
            // SAFETY: a byte of a live DeviceBuffer; synchronous on the legacy stream, then waited.
            ck("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(address, 0x5A, 1) });
            ck("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
        }
        Ok(())
    })
}

#[test]
#[ignore = "needs a GPU"]
fn verify_catches_a_byte_corrupted_between_copy_and_verify() {
    let size = group_sizes().into_iter().filter(|&s| s <= 2).max().unwrap();
    let refit = Refit::new(size, true);
    let group = gpu_group(size);
    // Clean, with the kernel (digests recorded by the copy) and the copy engine (both sides compared).
    for arm in [Arm::Kernel, Arm::CopyEngine] {
        let options = ExecOptions { arm, verify: true, ..ExecOptions::default() };
        let mut clean = Executor::new(&group, &refit.plan, 0, options).unwrap();
        refit.poison();
        let stats = step(&mut clean, &group).unwrap();
        assert!(stats.verified && stats.verify_ns > 0, "{arm:?}");
        refit.assert_installed("verified");
    }
    // Direct, the kernel: a receiver byte changed after the copy (an unfused parameter, whose
    // buffer is named as its tensor).
    let b = *refit.receivers().iter().rev().find(|&&b| refit.w.buffers[b].name.contains("o_proj")).unwrap();
    let options = ExecOptions {
        arm: Arm::Kernel,
        verify: true,
        hook: Some(corrupting(refit.buffers[b].ptr + 3)),
        ..ExecOptions::default()
    };
    let mut corrupted = Executor::new(&group, &refit.plan, 0, options).unwrap();
    let err = step(&mut corrupted, &group).unwrap_err();
    assert_eq!(err.status, Status::VerifyMismatch, "{}", err.message);
    assert!(err.message.contains(&format!("tensor '{}'", refit.w.buffers[b].name)), "{}", err.message);
    // Staged: a source changed after the copy into staging; nothing is installed. The kernel's
    // verify checks what the copy wrote against what it read (a source changed afterwards is no
    // copy error); the copy engine's compares both sides again, and finds it.
    refit.poison();
    let source = refit.plan.routes()[0].segments[0].src;
    let options = ExecOptions {
        arm: Arm::CopyEngine,
        verify: true,
        commit: CommitMode::Staged,
        hook: Some(corrupting(source)),
        ..ExecOptions::default()
    };
    let mut staged = Executor::new(&group, &refit.plan, 0, options).unwrap();
    let err = step(&mut staged, &group).unwrap_err();
    assert_eq!(err.status, Status::VerifyMismatch, "{}", err.message);
    refit.assert_poisoned("after a verify mismatch");
}

#[test]
#[ignore = "needs a GPU"]
fn rebound_receivers_get_every_element_at_their_new_place() {
    for size in group_sizes().into_iter().filter(|&s| s <= 2) {
        let mut refit = Refit::new(size, false);
        let group = gpu_group(size);
        for arm in [Arm::Kernel, Arm::CopyEngine] {
            let options = ExecOptions { arm, ..ExecOptions::default() };
            let mut executor = Executor::new(&group, &refit.plan, 0, options).unwrap();
            step(&mut executor, &group).unwrap();
            refit.assert_installed("before the move");
            let old = refit.move_receivers(&mut executor);
            step(&mut executor, &group).unwrap();
            refit.assert_installed(&format!("{size} GPU(s) {arm:?} after rebinds"));
            Refit::assert_untouched(&old);
            // Back to where the plan put them, for the next arm (named where the last run had them).
            for (b, was) in refit.receivers().into_iter().zip(old) {
                executor.rebind(was.device, refit.buffers[b].ptr, was.ptr, was.len as u64).unwrap();
                refit.buffers[b] = was;
            }
            refit.poison();
            step(&mut executor, &group).unwrap();
            refit.assert_installed("moved back");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn auto_gives_long_runs_to_the_copy_engine_and_the_rest_to_the_kernel() {
    // A vocabulary of 600,000 rows of 256 BF16 values: embedding and LM head are 307 MB runs each,
    // past the 256 MiB from which AUTO gives a same-device run to the copy engine; every other
    // tensor is far shorter.
    let mut refit = Refit::of(Model { vocab: 600_000, ..small_moe() }, 1, false);
    let group = gpu_group(1);
    let mut executor = Executor::new(&group, &refit.plan, 0, ExecOptions::default()).unwrap();
    let stats = step(&mut executor, &group).unwrap();
    assert_eq!(stats.method(RouteKind::Local), Some(Method::Split));
    refit.assert_installed("split");
    // Under an SM budget every run goes to the copy engine, the long ones in 64 MiB pieces.
    let budgeted = ExecOptions { sm_budget: 8, ..ExecOptions::default() };
    let mut beside = Executor::new(&group, &refit.plan, 0, budgeted).unwrap();
    refit.poison();
    let stats = step(&mut beside, &group).unwrap();
    assert_eq!(stats.method(RouteKind::Local), Some(Method::CopyEngine));
    refit.assert_installed("copy engine in pieces");
    // A verified step keeps every run on the kernel (its copy records the digests the check reads).
    let verified = ExecOptions { verify: true, ..ExecOptions::default() };
    let mut checked = Executor::new(&group, &refit.plan, 0, verified).unwrap();
    refit.poison();
    let stats = step(&mut checked, &group).unwrap();
    assert_eq!(stats.method(RouteKind::Local), Some(Method::Kernel));
    refit.assert_installed("verified");
    // Both halves of the split follow a rebind.
    let old = refit.move_receivers(&mut executor);
    step(&mut executor, &group).unwrap();
    refit.assert_installed("split after rebinds");
    Refit::assert_untouched(&old);
}

/// Physical chunks of cuMemCreate memory on `device` in one reserved range of `reserved` chunks:
/// chunk i is mapped at `ptr + i * chunk` for i < `mapped`, the rest is reserved but unmapped.
/// Two mapped chunks are two allocations that meet.
struct Chunks {
    device: i32,
    ptr: u64,
    chunk: u64,
    reserved: u64,
    mapped: Vec<sys::CUmemGenericAllocationHandle>,
}

impl Chunks {
    fn new(device: i32, mapped: usize, reserved: usize) -> Chunks {
        cuda().bind(device).unwrap();
        // SAFETY: plain driver calls with valid out-pointers, the device's context current.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location =
                sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device };
            let mut chunk = 0usize;
            let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
            ck("cuMemGetAllocationGranularity", sys::cuMemGetAllocationGranularity(&mut chunk, &prop, flag));
            let mut ptr = 0;
            ck("cuMemAddressReserve", sys::cuMemAddressReserve(&mut ptr, chunk * reserved, 0, 0, 0));
            let mut handles = Vec::new();
            for c in 0..mapped {
                let mut handle = 0;
                ck("cuMemCreate", sys::cuMemCreate(&mut handle, chunk, &prop, 0));
                ck("cuMemMap", sys::cuMemMap(ptr + (c * chunk) as u64, chunk, 0, handle, 0));
                handles.push(handle);
            }
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ck("cuMemSetAccess", sys::cuMemSetAccess(ptr, chunk * mapped, &access, 1));
            Chunks { device, ptr, chunk: chunk as u64, reserved: reserved as u64, mapped: handles }
        }
    }

    fn write(&self, offset: u64, bytes: &[u8]) {
        unsafe { cuda().write(self.device, self.ptr + offset, bytes) }.unwrap();
    }

    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        unsafe { cuda().read(self.device, self.ptr + offset, &mut out) }.unwrap();
        out
    }
}

impl Drop for Chunks {
    fn drop(&mut self) {
        cuda().bind(self.device).unwrap();
        // SAFETY: unmapping and releasing what `new` mapped and created.
        unsafe {
            sys::cuCtxSynchronize();
            sys::cuMemUnmap(self.ptr, self.chunk as usize * self.mapped.len());
            for &handle in &self.mapped {
                sys::cuMemRelease(handle);
            }
            sys::cuMemAddressFree(self.ptr, (self.chunk * self.reserved) as usize);
        }
    }
}

/// A plan moving tensor "w" of `len` bytes, offered whole at `src` and needed whole at `dst`, both
/// on device 0 (the planner checks no address).
fn whole_tensor_plan(src: u64, dst: u64, len: u64) -> Plan {
    use refit::plan::{Need, Offer, Region, Table, TensorSpec};
    let here = Endpoint { process: 0, device: 0 };
    let whole = Region { offset: vec![0], extent: vec![len] };
    let table = Table {
        tensors: vec![TensorSpec { name: "w".into(), dtype: 1, elem_size: 1, shape: vec![len] }],
        offers: vec![Offer {
            tensor: 0,
            owner: here,
            addr: src,
            region: whole.clone(),
            strides: None,
            digest: None,
        }],
        needs: vec![Need {
            tensor: 0,
            receiver: here,
            addr: dst,
            region: whole,
            perm: None,
            strides: vec![1],
        }],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    };
    plan::build(&[table], &PlanOptions::default()).unwrap()
}

/// Every way a plan can name memory that is not the device's: each refused at create with
/// INVALID_ARGUMENT naming the tensor, its box and the address, on every arm, direct and staged;
/// then a range across two allocations that meet is accepted, and the context still copies
/// byte-exact (a refused address never reached the device).
#[test]
#[ignore = "needs a GPU"]
fn addresses_that_are_not_the_devices_memory_are_refused_at_create() {
    const MIB: u64 = 1 << 20;
    let group = gpu_group(1);
    let device = DeviceBuffer::new(0, MIB as usize);
    let other = DeviceBuffer::new(0, MIB as usize);
    let mut host = vec![0u8; MIB as usize];
    let host_ptr = host.as_mut_ptr() as u64;
    let mut pinned: *mut std::ffi::c_void = std::ptr::null_mut();
    cuda().bind(0).unwrap();
    ck("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut pinned, MIB as usize, 0) });
    // One chunk mapped, the next reserved only: a range off the end of the mapping.
    let lonely = Chunks::new(0, 1, 2);
    // Freed last: nothing allocated after it may take its place before the cases are refused (each
    // refusal comes before the executor allocates anything).
    let freed = DeviceBuffer::new(0, MIB as usize);
    let freed_ptr = freed.ptr;
    drop(freed);
    let cases: Vec<(&str, u64, u64, u64, &str)> = vec![
        ("host malloc source", host_ptr, device.ptr, MIB, "its source"),
        ("host malloc destination", device.ptr, host_ptr, MIB, "its destination"),
        ("page-locked host source", pinned as u64, device.ptr, MIB, "page-locked"),
        ("freed source", freed_ptr, device.ptr, MIB, "no memory CUDA knows"),
        ("unmapped source", 0x7f00_0000_0000, device.ptr, MIB, "no memory CUDA knows"),
        (
            "source past its allocation's end",
            device.ptr,
            other.ptr,
            64 * MIB,
            "past the end of its allocation",
        ),
        ("destination past its mapping", device.ptr, lonely.ptr + lonely.chunk - 4096, 8192, "past the end"),
    ];
    for (what, src, dst, len, words) in cases {
        let plan = whole_tensor_plan(src, dst, len);
        for (arm, commit) in [
            (Arm::Kernel, CommitMode::Direct),
            (Arm::CopyEngine, CommitMode::Direct),
            (Arm::Auto, CommitMode::Staged),
        ] {
            let options = ExecOptions { arm, commit, ..ExecOptions::default() };
            let err =
                Executor::new(&group, &plan, 0, options).err().unwrap_or_else(|| panic!("{what} accepted"));
            assert_eq!(err.status, Status::InvalidArgument, "{what}: {}", err.message);
            for word in ["tensor 'w' box offset [0]", words] {
                assert!(err.message.contains(word), "{what}: {word:?} missing from {}", err.message);
            }
        }
    }
    // Two allocations that meet: a range across the seam is memory of the device, and moves.
    let seam = Chunks::new(0, 2, 2);
    let len = 64 << 10;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
    device.write(0, &bytes);
    let at = seam.chunk - len as u64 / 2;
    let plan = whole_tensor_plan(device.ptr, seam.ptr + at, len as u64);
    for arm in [Arm::Kernel, Arm::CopyEngine] {
        seam.write(at, &vec![POISON; len]);
        let mut executor =
            Executor::new(&group, &plan, 0, ExecOptions { arm, ..ExecOptions::default() }).unwrap();
        step(&mut executor, &group).unwrap();
        assert_eq!(seam.read(at, len), bytes, "{arm:?} across the seam");
    }
    // The other way round, reading across the seam.
    let back = whole_tensor_plan(seam.ptr + at, other.ptr, len as u64);
    other.poison();
    let mut executor = Executor::new(&group, &back, 0, ExecOptions::default()).unwrap();
    step(&mut executor, &group).unwrap();
    assert_eq!(other.read()[..len], bytes[..]);
    ck("cuMemFreeHost", unsafe { sys::cuMemFreeHost(pinned) });
}

/// The copy-engine arm's copies (`Backend::copy_segments`) in batches: more runs than one driver
/// batch call takes (`engine_copy::RUNS_PER_CALL`), of every length from 1 byte, misaligned, written
/// in reverse order; then a call whose batch holds a run across two allocations that meet, which the
/// driver refuses as a batch and which is copied run by run, split at the seam. Every destination
/// byte is compared, those no run writes included.
#[test]
#[ignore = "needs a GPU"]
fn copy_engine_runs_go_in_batches_and_a_run_across_a_seam_still_copies() {
    let group = gpu_group(1);
    let backend = group.backend();
    let stream = group.stream(0).unwrap();
    let runs = refit::transport::engine_copy::RUNS_PER_CALL * 2 + 123;
    let lengths: Vec<usize> = (0..runs).map(|k| 1 + (k * 7919) % 1500).collect();
    let total: usize = lengths.iter().sum();
    let (src, dst) = (DeviceBuffer::new(0, total + 64), DeviceBuffer::new(0, total + 64));
    let bytes: Vec<u8> = (0..src.len).map(|i| (i * 131 + i / 251) as u8).collect();
    src.write(0, &bytes);
    dst.poison();
    // Run k reads at its place in the source and lands where the runs after it end, shifted by 3.
    let mut segments = Vec::new();
    let mut want = vec![POISON; dst.len];
    let (mut from, mut to) = (0usize, total);
    for &len in &lengths {
        to -= len;
        segments.push(refit::Segment::contiguous(
            src.ptr + from as u64 + 1,
            dst.ptr + to as u64 + 3,
            len as u64,
        ));
        want[to + 3..to + 3 + len].copy_from_slice(&bytes[from + 1..from + 1 + len]);
        from += len;
    }
    // SAFETY: live buffers of device 0 and the group's stream; destination runs are disjoint.
    unsafe { backend.copy_segments(0, stream, &segments) }.unwrap();
    backend.sync_stream(0, stream).unwrap();
    assert!(dst.read() == want, "a byte differs after {runs} runs in batches");

    // 64 runs of 4 KiB into two chunks that meet, the 32nd across the seam.
    let seam = Chunks::new(0, 2, 2);
    let (len, count) = (4096u64, 64u64);
    let start = seam.chunk - 31 * len - len / 2;
    seam.write(start, &vec![POISON; (len * count) as usize]);
    let across: Vec<refit::Segment> = (0..count)
        .map(|k| refit::Segment::contiguous(src.ptr + k * len, seam.ptr + start + k * len, len))
        .collect();
    // SAFETY: as above; the seam's chunks are mapped and readable and writable by device 0.
    unsafe { backend.copy_segments(0, stream, &across) }.unwrap();
    backend.sync_stream(0, stream).unwrap();
    assert!(seam.read(start, (len * count) as usize) == bytes[..(len * count) as usize], "across the seam");
}

/// On two GPUs: memory of device 1 named as device 0's is refused (the plan says where it is).
#[test]
#[ignore = "needs a GPU"]
fn another_devices_memory_is_refused_at_create() {
    if cuda().device_count() < 2 {
        println!("note: one GPU: not run");
        return;
    }
    let group = gpu_group(2);
    let (mine, theirs) = (DeviceBuffer::new(0, 4096), DeviceBuffer::new(1, 4096));
    let plan = whole_tensor_plan(theirs.ptr, mine.ptr, 4096);
    let err = Executor::new(&group, &plan, 0, ExecOptions::default()).err().unwrap();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("memory of device 1, not of device 0"), "{}", err.message);
}

/// The check's cost at create, for the record (benches/gpu_refit.rs measures the demo's plan).
#[test]
#[ignore = "needs a GPU"]
fn the_address_check_is_paid_at_create_only() {
    let refit = Refit::new(1, true);
    let group = gpu_group(1);
    let mut executor = Executor::new(&group, &refit.plan, 0, ExecOptions::default()).unwrap();
    assert!(executor.address_check_ns() > 0);
    for _ in 0..3 {
        refit.poison();
        let stats = step(&mut executor, &group).unwrap();
        assert_eq!(stats.prepare_ns, 0, "a run checked or prepared something");
        refit.assert_installed("after the check");
    }
    println!("address check at create: {} ns", executor.address_check_ns());
}
