//! Communicators and transports between processes on real GPUs (run on the GPU machine with
//! `--ignored --test-threads=1`; each test runs its body in two processes, this binary run again).
//!
//! - One GPU: two processes write into each other's memory through CUDA IPC (legacy handles for
//!   cuMemAlloc memory, VMM descriptors for cuMemCreate memory mapped in two chunks), byte-exact
//!   against the bytes computed on the host; the control plane is a host-backend communicator, since
//!   NCCL cannot put two ranks on one GPU.
//! - Two GPUs (tests named `two_gpus`; on a one-GPU machine they print a note and check nothing):
//!   NCCL communicators between processes: allgather equal, uneven and in place; a rank that does
//!   not take part times the other out; plans across processes; the staged exchange (pack, NCCL
//!   send/recv, unpack) byte-exact with several chunks; a spent NCCL id joins nothing.
//! - Identity: an NCCL id with any byte changed is refused before NCCL sees it.

#[path = "common/cuda.rs"]
mod cuda;
#[path = "common/processes.rs"]
mod processes;

use cuda::{device_count, ok, on, Buffer, Stream};
use cudarc::driver::sys;
use processes::{in_processes, End};
use refit::allgather::comm::allgather;
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::cuda::cuda_backend;
use refit::transport::driver::check;
use refit::transport::ipc;
use refit::transport::staged::{Flow, StagedExchange};
use refit::transport::{Backend, BackendKind, Stream as RefitStream};
use refit::{Segment, Status};
use std::sync::Arc;
use std::time::{Duration, Instant};

const POISON: u8 = 0xCD;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((i * 131 + (i >> 9) + seed * 17) % 251) as u8).collect()
}

fn options(timeout_ms: u64) -> CommOptions {
    CommOptions { timeout: Duration::from_millis(timeout_ms), ..CommOptions::default() }
}

/// Applies `segments` (addresses relative to `src_base` / `dst_base`) to host copies.
fn apply(segments: &[Segment], src: &[u8], src_base: u64, dst: &mut [u8], dst_base: u64) {
    for s in segments {
        s.for_each_run(|from, to, len| {
            let (from, to, len) = ((from - src_base) as usize, (to - dst_base) as usize, len as usize);
            dst[to..to + len].copy_from_slice(&src[from..from + len]);
        });
    }
}

/// `chunks` chunks of cuMemCreate memory on `device`, exportable as POSIX descriptors, mapped
/// contiguously (what torch's expandable segments make).
struct VmmBuffer {
    device: i32,
    ptr: u64,
    len: usize,
    handles: Vec<sys::CUmemGenericAllocationHandle>,
}

impl VmmBuffer {
    fn new(device: i32, chunks: usize) -> VmmBuffer {
        on(device, || {
            let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            prop.location =
                sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device };
            let mut granularity = 0usize;
            let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
            ok(
                "granularity",
                check("cuMemGetAllocationGranularity", unsafe {
                    sys::cuMemGetAllocationGranularity(&mut granularity, &prop, flag)
                }),
            );
            let len = granularity * chunks;
            let mut ptr = 0;
            ok(
                "reserve",
                check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0) }),
            );
            let mut handles = Vec::new();
            for c in 0..chunks {
                let mut handle = 0;
                ok(
                    "create",
                    check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, granularity, &prop, 0) }),
                );
                let at = ptr + (c * granularity) as u64;
                ok("map", check("cuMemMap", unsafe { sys::cuMemMap(at, granularity, 0, handle, 0) }));
                handles.push(handle);
            }
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok("access", check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, len, &access, 1) }));
            VmmBuffer { device, ptr, len, handles }
        })
    }

    fn fill(&self, byte: u8) {
        on(self.device, || {
            ok("memset", check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(self.ptr, byte, self.len) }));
            ok("sync", check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }));
        });
    }

    fn download(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        on(self.device, || {
            ok(
                "DtoH",
                check("cuMemcpyDtoH", unsafe {
                    sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr, self.len)
                }),
            )
        });
        out
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        on(self.device, || unsafe {
            sys::cuMemUnmap(self.ptr, self.len);
            for &h in &self.handles {
                sys::cuMemRelease(h);
            }
            sys::cuMemAddressFree(self.ptr, self.len);
        });
    }
}

fn words(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect()
}

fn to_bytes(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

const SOURCE: usize = 6 << 20;
const LEGACY: usize = 3 << 20;

/// The writes rank 1 makes, from its source `src` into rank 0's legacy buffer `legacy` and VMM
/// buffer `vmm` (`vmm_len` bytes): strided rows into the legacy one, a run across the VMM chunk
/// boundary, and a short misaligned run.
fn writes(src: u64, legacy: u64, vmm: u64, vmm_len: u64) -> Vec<Segment> {
    let half = vmm_len / 2;
    vec![
        Segment {
            src,
            dst: legacy,
            len: 1000,
            count: [512, 1],
            src_stride: [1024, 0],
            dst_stride: [3000, 0],
        },
        Segment::contiguous(src + (1 << 20), vmm + half - (1 << 20) - 5, 2 << 20),
        Segment::contiguous(src + 12345, vmm + vmm_len - 40, 37),
    ]
}

/// Two processes on GPU 0: rank 1 writes into rank 0's cuMemAlloc and cuMemCreate memory through
/// CUDA IPC with the batched kernel (recording source digests) and verifies the destinations
/// through the opened memory; rank 0 checks every byte of both buffers.
#[test]
#[ignore = "needs a GPU"]
fn ipc_between_two_processes_on_one_gpu_is_byte_exact() {
    let test = "ipc_between_two_processes_on_one_gpu_is_byte_exact";
    in_processes(test, BackendKind::Host, &[End::Done; 2], |rank, size, id| {
        let comm = Communicator::create(id, size, rank, 0, options(60_000)).unwrap();
        cuda_backend().unwrap();
        if rank == 0 {
            let legacy = Buffer::new(0, LEGACY);
            legacy.fill(POISON);
            let vmm = VmmBuffer::new(0, 2);
            vmm.fill(POISON);
            let mine = [(legacy.ptr, LEGACY as u64), (vmm.ptr, vmm.len as u64)];
            let all = comm.allgather_bytes(&to_bytes(&[legacy.ptr, vmm.ptr, vmm.len as u64])).unwrap();
            let peers = ipc::connect(&comm, BackendKind::Cuda, 0, &mine, &[1], &[]).unwrap();
            assert!(peers.writers.contains(&1), "rank 1 could not open this process's memory (see its log)");
            comm.allgather_bytes(b"written").unwrap();
            let src_base = words(&all[1])[0];
            let segments = writes(src_base, legacy.ptr, vmm.ptr, vmm.len as u64);
            let source = pattern(1, SOURCE);
            let mut want_legacy = vec![POISON; LEGACY];
            apply(&segments[..1], &source, src_base, &mut want_legacy, legacy.ptr);
            let mut want_vmm = vec![POISON; vmm.len];
            apply(&segments[1..], &source, src_base, &mut want_vmm, vmm.ptr);
            assert!(legacy.download() == want_legacy, "cuMemAlloc memory received wrong bytes");
            assert!(vmm.download() == want_vmm, "cuMemCreate memory received wrong bytes");
        } else {
            let src = Buffer::new(0, SOURCE);
            src.upload(&pattern(1, SOURCE));
            let all = comm.allgather_bytes(&to_bytes(&[src.ptr])).unwrap();
            let owner = words(&all[0]);
            let peers = ipc::connect(&comm, BackendKind::Cuda, 0, &[], &[], &[0]).unwrap();
            let opened = peers.opened.get(&0).unwrap_or_else(|| panic!("rank 0's memory did not open"));
            let batch = opened.prepare_writes(&writes(src.ptr, owner[0], owner[1], owner[2]), true).unwrap();
            let check = batch.verify_destinations().unwrap();
            let stream = Stream::new(0);
            // SAFETY: the source and the opened memory live until the stream is synchronized.
            unsafe {
                batch.launch(RefitStream(stream.raw as usize as u64)).unwrap();
                check.launch(RefitStream(stream.raw as usize as u64)).unwrap();
            }
            stream.sync();
            assert_eq!(check.outcome().unwrap(), None, "the writes verify through the opened memory");
            comm.allgather_bytes(b"written").unwrap();
        }
    });
}

/// The two GPUs the NCCL tests need (rank r runs on GPU r): tests named `*_two_gpus` fail without
/// them; gpu/run.sh skips them by name on a one-GPU machine and says so.
/// `body` run by two ranks in two processes, rank r on GPU r, each expected to end done; the test's
/// own process (the parent) first checks that there are two GPUs.
fn on_two_gpus(test: &str, body: fn(usize, usize, &CommId)) {
    if std::env::var_os("REFIT_COMM_TEST_RANK").is_none() {
        let count = device_count();
        assert!(count >= 2, "NCCL between processes needs 2 GPUs, found {count}");
    }
    in_processes(test, BackendKind::Cuda, &[End::Done; 2], body);
}

/// NCCL allgather between two processes on two GPUs: equal, uneven (with an empty block) and in
/// place, byte-exact; then host bytes of two lengths (how plan tables travel), staged through the GPUs.
#[test]
#[ignore = "needs a GPU"]
fn nccl_allgather_between_processes_two_gpus() {
    on_two_gpus("nccl_allgather_between_processes_two_gpus", |rank, size, id| {
        let device = rank as i32;
        let comm = Communicator::create(id, size, rank, device, options(60_000)).unwrap();
        assert_eq!(comm.kind(), BackendKind::Cuda);
        let stream = Stream::new(device);
        for (call, counts) in [[1usize << 20, 1 << 20], [4097, 0], [3, 5 << 20]].iter().enumerate() {
            for in_place in [false, true] {
                let total: usize = counts.iter().sum();
                let offset: usize = counts[..rank].iter().sum();
                let mine = pattern(10 * call as u64 + rank as u64, counts[rank]);
                let recv = Buffer::new(device, total.max(1));
                recv.fill(POISON);
                let send = Buffer::new(device, counts[rank].max(1));
                send.upload(&mine);
                let send_at = if in_place {
                    let mut whole = vec![POISON; total];
                    whole[offset..offset + mine.len()].copy_from_slice(&mine);
                    recv.upload(&whole);
                    recv.ptr + offset as u64
                } else {
                    send.ptr
                };
                // SAFETY: buffers live until synchronize returns.
                unsafe {
                    allgather(&comm, send_at, recv.ptr, counts, RefitStream(stream.raw as usize as u64))
                }
                .unwrap();
                comm.synchronize(RefitStream(stream.raw as usize as u64)).unwrap();
                let want: Vec<u8> =
                    (0..2).flat_map(|p| pattern(10 * call as u64 + p, counts[p as usize])).collect();
                assert!(recv.download()[..total] == want[..], "call {call} in place {in_place}: wrong bytes");
            }
        }
        let mine = pattern(rank as u64, 1000 + 3000 * rank);
        let all = comm.allgather_bytes(&mine).unwrap();
        assert_eq!(all[1 - rank], pattern(1 - rank as u64, 1000 + 3000 * (1 - rank)));
    });
}

/// Ranks that pass other counts to an NCCL allgather: with check_counts (the default) every rank's
/// call returns INVALID_ARGUMENT naming the rank that differed, nothing moves, and the next
/// allgather with matching counts is byte-exact (the communicator stayed usable).
#[test]
#[ignore = "needs a GPU"]
fn nccl_allgather_with_other_counts_is_refused_on_every_rank_two_gpus() {
    on_two_gpus("nccl_allgather_with_other_counts_is_refused_on_every_rank_two_gpus", |rank, size, id| {
        let device = rank as i32;
        let comm = Communicator::create(id, size, rank, device, options(60_000)).unwrap();
        // Bound to a name: a temporary Stream would be destroyed at once, leaving NCCL a dead handle.
        let cuda_stream = Stream::new(device);
        let stream = RefitStream(cuda_stream.raw as usize as u64);
        let recv = Buffer::new(device, 4096);
        recv.fill(POISON);
        let send = Buffer::new(device, 2048);
        send.upload(&pattern(rank as u64, 2048));
        // Rank 1 believes rank 0 sends 1024 bytes; rank 0 says 2048.
        let counts = if rank == 0 { [2048usize, 2048] } else { [1024, 2048] };
        // SAFETY: buffers live until synchronize returns.
        let err = unsafe { allgather(&comm, send.ptr, recv.ptr, &counts, stream) }.unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "rank {rank}: {}", err.message);
        assert!(err.message.contains("ranks [1] differ"), "rank {rank}: {}", err.message);
        comm.synchronize(stream).unwrap();
        assert!(recv.download().iter().all(|&b| b == POISON), "rank {rank}: bytes moved");
        let counts = [2048usize, 2048];
        // SAFETY: as above.
        unsafe { allgather(&comm, send.ptr, recv.ptr, &counts, stream) }.unwrap();
        comm.synchronize(stream).unwrap();
        let want: Vec<u8> = (0..2).flat_map(|p| pattern(p, 2048)).collect();
        assert!(recv.download() == want, "rank {rank}: wrong bytes after the refusal");
    });
}

/// The counts' check on one GPU: a communicator of one rank exchanges its digest with itself
/// (check_counts on) or not at all (off); the allgather is byte-exact either way.
#[test]
#[ignore = "needs a GPU"]
fn nccl_allgather_of_one_rank_with_and_without_the_counts_check() {
    let test = "nccl_allgather_of_one_rank_with_and_without_the_counts_check";
    in_processes(test, BackendKind::Cuda, &[End::Done; 1], |rank, size, id| {
        for check_counts in [true, false] {
            let options = CommOptions { check_counts, ..options(60_000) };
            let id = if check_counts { *id } else { Communicator::unique_id(BackendKind::Cuda).unwrap() };
            let comm = Communicator::create(&id, size, rank, 0, options).unwrap();
            let cuda_stream = Stream::new(0);
            let stream = RefitStream(cuda_stream.raw as usize as u64);
            let recv = Buffer::new(0, 4096);
            recv.fill(POISON);
            let send = Buffer::new(0, 4096);
            send.upload(&pattern(7, 4096));
            // SAFETY: buffers live until synchronize returns.
            unsafe { allgather(&comm, send.ptr, recv.ptr, &[4096], stream) }.unwrap();
            comm.synchronize(stream).unwrap();
            assert!(recv.download() == pattern(7, 4096), "check_counts {check_counts}");
        }
    });
}

/// Every byte of an NCCL id matters: with any one byte changed (two ways), the id is refused with
/// INVALID_ARGUMENT before NCCL sees it (its check does not match); the unchanged id forms a
/// communicator of one rank.
#[test]
#[ignore = "needs a GPU"]
fn an_nccl_id_with_any_byte_changed_is_refused() {
    let id = Communicator::unique_id(BackendKind::Cuda).unwrap();
    for at in 0..id.0.len() {
        for flip in [0x01u8, 0xff] {
            let mut changed = id;
            changed.0[at] ^= flip;
            let err = Communicator::create(&changed, 1, 0, 0, options(10_000)).err().unwrap_or_else(|| {
                panic!("the id with byte {at} changed (^{flip:#x}) formed a communicator")
            });
            assert_eq!(err.status, Status::InvalidArgument, "byte {at} ^{flip:#x}: {err}");
        }
    }
    // As generous as the other tests' joins: under compute-sanitizer's memcheck NCCL's set-up of one
    // rank took over 20 s (H200, NCCL 2.28), and the abort after such a timeout leaves NCCL's own
    // 4-byte host allocation behind, which memcheck then reports.
    let comm = Communicator::create(&id, 1, 0, 0, options(60_000)).unwrap();
    assert_eq!((comm.size(), comm.kind()), (1, BackendKind::Cuda));
}

/// An NCCL id forms one communicator: once both ranks formed it and destroyed it, joining with the
/// id again fails on both (NCCL's bootstrap root ended once every rank had joined: NCCL_ERROR, or
/// TIMEOUT where nothing answers), within the timeout and what NCCL's abort takes.
#[test]
#[ignore = "needs a GPU"]
fn a_spent_nccl_id_joins_nothing_two_gpus() {
    on_two_gpus("a_spent_nccl_id_joins_nothing_two_gpus", |rank, size, id| {
        let device = rank as i32;
        let comm = Communicator::create(id, size, rank, device, options(60_000)).unwrap();
        comm.allgather_bytes(&[rank as u8]).unwrap();
        drop(comm);
        let started = Instant::now();
        let err = Communicator::create(id, size, rank, device, options(5_000))
            .err()
            .unwrap_or_else(|| panic!("rank {rank}: a spent NCCL id formed a communicator"));
        assert!(matches!(err.status, Status::NcclError | Status::Timeout), "rank {rank}: {err}");
        assert!(started.elapsed() < Duration::from_secs(60), "rank {rank} waited {:?}", started.elapsed());
    });
}

/// A rank that joins but skips a call: the other's call fails with TIMEOUT (the watchdog aborts the
/// communicator) within a few timeouts, and keeps failing.
#[test]
#[ignore = "needs a GPU"]
fn nccl_timeout_between_processes_two_gpus() {
    on_two_gpus("nccl_timeout_between_processes_two_gpus", |rank, size, id| {
        let device = rank as i32;
        let comm = Communicator::create(id, size, rank, device, options(2_000)).unwrap();
        if rank == 1 {
            std::thread::sleep(Duration::from_secs(8));
            return;
        }
        let stream = Stream::new(device);
        let (send, recv) = (Buffer::new(device, 4096), Buffer::new(device, 8192));
        let started = Instant::now();
        // SAFETY: buffers live until synchronize returns (the abort ends the kernel).
        let queued = unsafe {
            allgather(&comm, send.ptr, recv.ptr, &[4096, 4096], RefitStream(stream.raw as usize as u64))
        };
        let err =
            queued.and_then(|()| comm.synchronize(RefitStream(stream.raw as usize as u64))).unwrap_err();
        assert!(matches!(err.status, Status::Timeout | Status::Aborted), "{err}");
        assert!(started.elapsed() < Duration::from_secs(7), "waited {:?}", started.elapsed());
        assert_eq!(comm.allgather_bytes(b"x").unwrap_err().status, err.status);
        stream.sync();
    });
}

/// Strided segments both ways between two processes on two GPUs through bounded staging over NCCL:
/// several chunks per flow, byte-exact, wire bytes equal to the segments' bytes.
#[test]
#[ignore = "needs a GPU"]
fn staged_exchange_over_nccl_two_gpus() {
    on_two_gpus("staged_exchange_over_nccl_two_gpus", |rank, size, id| {
        let device = rank as i32;
        let comm = Communicator::create(id, size, rank, device, options(60_000)).unwrap();
        let (len, rows) = (3000u64, 2048u64);
        let src = Buffer::new(device, (len * rows * 2) as usize);
        src.upload(&pattern(rank as u64, (len * rows * 2) as usize));
        let dst = Buffer::new(device, (len * rows * 3) as usize);
        dst.fill(POISON);
        // Both sides describe the pair's segments alike: rows of `len` bytes from every other row of
        // the sender's source into every third row of the receiver's destination.
        let bases = comm.allgather_bytes(&to_bytes(&[src.ptr, dst.ptr])).unwrap();
        let segments_from = |sender: usize| -> Vec<Segment> {
            let (s, d) = (words(&bases[sender])[0], words(&bases[1 - sender])[1]);
            vec![Segment {
                src: s,
                dst: d,
                len,
                count: [rows, 1],
                src_stride: [2 * len, 0],
                dst_stride: [3 * len, 0],
            }]
        };
        let sends = [Flow { peer: 1 - rank, segments: segments_from(rank) }];
        let recvs = [Flow { peer: 1 - rank, segments: segments_from(1 - rank) }];
        let backend: Arc<dyn Backend> = cuda_backend().unwrap();
        let exchange = StagedExchange::prepare(&comm, backend, device, &sends, &recvs, 2 << 20).unwrap();
        let stats = exchange.stats();
        assert_eq!(stats.bytes_sent, len * rows);
        assert!(stats.steps >= 3 && stats.staging_bytes <= 2 << 20, "{stats:?}");
        let stream = Stream::new(device);
        // SAFETY: buffers live until synchronize returns.
        unsafe { exchange.run(&comm, RefitStream(stream.raw as usize as u64)) }.unwrap();
        comm.synchronize(RefitStream(stream.raw as usize as u64)).unwrap();
        let peer_src = pattern(1 - rank as u64, (len * rows * 2) as usize);
        let mut want = vec![POISON; (len * rows * 3) as usize];
        let peer_base = words(&bases[1 - rank])[0];
        apply(&recvs[0].segments, &peer_src, peer_base, &mut want, dst.ptr);
        assert!(dst.download() == want, "rank {rank}: staged bytes differ");
        comm.allgather_bytes(b"done").unwrap();
    });
}

/// The demo's tables (Qwen3-30B-A3B, 2 layers) with publishers in process 0 and receivers in process
/// 1, both on GPU 0: `Executor::new_across` moves every byte through CUDA IPC, direct and staged
/// (verified), twice each; process 1 checks every element against its known value, and before the
/// commit finds its live buffers unchanged.
#[test]
#[ignore = "needs a GPU"]
fn executor_across_two_processes_on_one_gpu_is_byte_exact() {
    use refit::across::build_plan;
    use refit::exec::{CommitMode, ExecOptions, Executor};
    use refit::group::{Group, GroupOptions};
    use refit::plan::{Endpoint, PlanOptions};
    use refit_workloads::{Megatron, Model, Packing, Role, Spec, Vllm, Workload};

    let test = "executor_across_two_processes_on_one_gpu_is_byte_exact";
    in_processes(test, BackendKind::Host, &[End::Done; 2], |rank, size, id| {
        let at = |process| vec![Endpoint { process, device: 0 }];
        let spec = Spec {
            model: Model::qwen3_30b_a3b().with_layers(2),
            publishers: Megatron { endpoints: at(0), tp: 1, ep: 1, grouped_experts: true },
            publisher_layout: Packing::Separate,
            receivers: Vllm { endpoints: at(1) },
            receiver_layout: Packing::Separate,
            digests: false,
        };
        let workload = Workload::generate(&spec).unwrap();
        let comm = Arc::new(Communicator::create(id, size, rank, 0, options(60_000)).unwrap());
        let group = Group::new(&[0], GroupOptions::default()).unwrap();
        let backend = Arc::clone(group.backend());
        let mine = |b: &refit_workloads::Buffer| b.endpoint.process == rank as u32;
        let mut host: Vec<Vec<u8>> = workload
            .buffers
            .iter()
            .map(|b| if mine(b) { vec![0xa5; b.bytes as usize] } else { vec![] })
            .collect();
        if rank == 0 {
            let mut views: Vec<&mut [u8]> = host.iter_mut().map(|v| v.as_mut_slice()).collect();
            workload.fill_offers(&mut views);
        }
        let bases: Vec<u64> = workload
            .buffers
            .iter()
            .zip(&host)
            .map(|(b, bytes)| {
                if !mine(b) {
                    return 0;
                }
                let ptr = backend.alloc(0, b.bytes as usize).unwrap();
                // SAFETY: just allocated with this many bytes.
                unsafe { backend.write(0, ptr, bytes) }.unwrap();
                ptr
            })
            .collect();
        let receivers = || -> Vec<Vec<u8>> {
            workload
                .buffers
                .iter()
                .zip(&bases)
                .map(|(b, &ptr)| {
                    let mut bytes = vec![0u8; b.bytes as usize];
                    if mine(b) && b.role == Role::Receiver {
                        // SAFETY: allocated with this many bytes.
                        unsafe { backend.read(0, ptr, &mut bytes) }.unwrap();
                    }
                    bytes
                })
                .collect()
        };
        let poison = || {
            for (b, &ptr) in
                workload.buffers.iter().zip(&bases).filter(|(b, _)| mine(b) && b.role == Role::Receiver)
            {
                // SAFETY: allocated with this many bytes.
                unsafe { backend.write(0, ptr, &vec![0xa5; b.bytes as usize]) }.unwrap();
            }
        };
        let share =
            build_plan(&comm, &workload.tables(&bases).unwrap()[rank], &PlanOptions::default()).unwrap();
        for (commit, verify) in [(CommitMode::Direct, false), (CommitMode::Staged, true)] {
            let options = ExecOptions { commit, verify, ..ExecOptions::default() };
            let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
            for step in 0..2 {
                poison();
                comm.allgather_bytes(b"poisoned").unwrap();
                // SAFETY: every address of the share is a buffer allocated above (or the peer's).
                let stats = unsafe { executor.run(&group) }.unwrap();
                assert_eq!(stats.remote_wire_bytes, 0, "{commit:?} step {step}: every byte through IPC");
                if commit == CommitMode::Staged {
                    comm.allgather_bytes(b"staged").unwrap();
                    if rank == 1 {
                        // Only this process's receiver buffers are read back (the others' views
                        // are zeros).
                        let views = receivers();
                        let live = workload
                            .buffers
                            .iter()
                            .zip(&views)
                            .filter(|(b, _)| mine(b) && b.role == Role::Receiver);
                        for (b, view) in live {
                            assert!(
                                view.iter().all(|&x| x == 0xa5),
                                "{:?}: live bytes changed before the commit",
                                b.name
                            );
                        }
                    }
                    // SAFETY: as above.
                    unsafe { executor.commit(&group) }.unwrap();
                }
                comm.allgather_bytes(b"installed").unwrap();
                if rank == 1 {
                    let views = receivers();
                    let slices: Vec<&[u8]> = views.iter().map(|v| v.as_slice()).collect();
                    workload.check_needs(&slices).unwrap_or_else(|e| panic!("{commit:?} step {step}: {e}"));
                }
            }
            // The writer closes what it opened before the receiver frees its landing.
            if rank == 0 {
                drop(executor);
                comm.allgather_bytes(b"closed").unwrap();
            } else {
                comm.allgather_bytes(b"closed").unwrap();
                drop(executor);
            }
        }
        for &ptr in bases.iter().filter(|&&p| p != 0) {
            // SAFETY: ours; the peer is done with it (the last meeting above).
            unsafe { backend.free(0, ptr) }.unwrap();
        }
    });
}
