//! Allgather on real GPUs (run on the GPU machine: `gpu_allgather --ignored --test-threads=1`): every
//! algorithm byte-exact with poisoned outputs, whole-group and per-rank, equal / uneven / zero / in
//! place, 200 calls in a row, and ordering after the caller's slow producer. Handles 1 or 2 GPUs.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

mod gpu_common;

use gpu_common::{caller_stream, cuda, device_of, group_sizes, pattern, DeviceBuffer, SpinKernel};
use refit::allgather::peer::{set_method, PeerMethod};
use refit::allgather::{allgather, allgather_rank, Algorithm};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::transport::Backend;

const ALGORITHMS: [Algorithm; 4] = [Algorithm::Peer, Algorithm::Nccl, Algorithm::Host, Algorithm::Auto];

fn gpu_group(size: usize) -> Group {
    let devices: Vec<i32> = (0..size as i32).collect();
    Group::new(&devices, GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 })
        .unwrap_or_else(|e| panic!("group of {size} GPUs: {e}"))
}

/// Count shapes for a group size: equal (odd sizes on purpose), uneven, a zero block, all zero.
fn shapes(size: usize) -> Vec<Vec<usize>> {
    let mib = 1 << 20;
    match size {
        1 => vec![vec![mib + 3], vec![4099], vec![0]],
        _ => {
            let mut out = vec![vec![mib + 3; size]];
            out.push((0..size).map(|r| if r == 0 { 5 } else { 3 * mib + r }).collect());
            out.push((0..size).map(|r| if r == size - 1 { 0 } else { 1000 + r }).collect());
            out.push(vec![0; size]);
            out
        }
    }
}

struct Case {
    counts: Vec<usize>,
    offsets: Vec<usize>,
    total: usize,
    blocks: Vec<Vec<u8>>,
    sends: Vec<DeviceBuffer>,
    recvs: Vec<DeviceBuffer>,
    in_place: bool,
}

impl Case {
    fn new(counts: &[usize], call: usize, in_place: bool) -> Case {
        let size = counts.len();
        let offsets: Vec<usize> = (0..size).map(|r| counts[..r].iter().sum()).collect();
        let total: usize = counts.iter().sum();
        let blocks: Vec<Vec<u8>> = (0..size).map(|r| pattern(r, call, counts[r])).collect();
        let sends: Vec<DeviceBuffer> =
            (0..size).map(|r| DeviceBuffer::new(device_of(r), counts[r].max(1))).collect();
        // One spare byte past the end catches writes beyond the gathered size.
        let recvs: Vec<DeviceBuffer> =
            (0..size).map(|r| DeviceBuffer::new(device_of(r), total + 1)).collect();
        let case = Case { counts: counts.to_vec(), offsets, total, blocks, sends, recvs, in_place };
        case.reset();
        case
    }

    /// Poisons every receive buffer and puts each block where the rank's send pointer points.
    fn reset(&self) {
        for r in 0..self.counts.len() {
            self.recvs[r].poison();
            if self.in_place {
                self.recvs[r].write(self.offsets[r], &self.blocks[r]);
            } else {
                self.sends[r].write(0, &self.blocks[r]);
            }
        }
    }

    fn send_ptr(&self, r: usize) -> u64 {
        if self.in_place {
            self.recvs[r].ptr + self.offsets[r] as u64
        } else {
            self.sends[r].ptr
        }
    }

    /// This case's whole-group allgather.
    fn gather(&self, group: &Group, algorithm: Algorithm) -> refit::Result<Algorithm> {
        let sends: Vec<u64> = (0..self.counts.len()).map(|r| self.send_ptr(r)).collect();
        let recvs: Vec<u64> = self.recvs.iter().map(|b| b.ptr).collect();
        unsafe { allgather(group, &sends, &recvs, &self.counts, algorithm) }
    }

    /// Rank `rank`'s share of this case's per-rank allgather (from its `Group::run` callback).
    fn gather_rank(&self, group: &Group, rank: usize, algorithm: Algorithm) -> refit::Result<Algorithm> {
        let (send, recv) = (self.send_ptr(rank), self.recvs[rank].ptr);
        unsafe { allgather_rank(group, rank, send, recv, &self.counts, algorithm) }
    }

    fn check(&self, what: &str) {
        let mut expected: Vec<u8> = self.blocks.concat();
        expected.push(0xAB);
        for (r, recv) in self.recvs.iter().enumerate() {
            let got = recv.read();
            if got != expected {
                let first = got.iter().zip(&expected).position(|(a, b)| a != b).unwrap_or(0);
                panic!(
                    "{what}: rank {r} differs at byte {first} of {} (got {:#x}, want {:#x})",
                    self.total + 1,
                    got[first],
                    expected[first]
                );
            }
        }
    }
}

/// Checks every case, named by `what` and its call index.
fn check_each(cases: &[Case], what: &str) {
    for (call, case) in cases.iter().enumerate() {
        case.check(&format!("{what} call {call}"));
    }
}

/// A hundred calls' cases, each with its own buffers and data, so that a call reading or writing too
/// early or too late shows in its own bytes; sizes on both sides of the peer method threshold, every
/// fourth in place.
fn hundred_cases(size: usize, first_call: usize) -> Vec<Case> {
    (0..100)
        .map(|call| {
            let bytes = [4096 + 16 * call, 3 << 20, 33 << 20][call % 3];
            Case::new(&vec![bytes; size], first_call + call, call % 4 == 3)
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU"]
fn whole_group_allgather_is_byte_exact_for_every_algorithm_and_shape() {
    for size in group_sizes() {
        let group = gpu_group(size);
        for algorithm in ALGORITHMS {
            for counts in shapes(size) {
                for in_place in [false, true] {
                    let case = Case::new(&counts, 1, in_place);
                    let ran = case
                        .gather(&group, algorithm)
                        .unwrap_or_else(|e| panic!("G={size} {algorithm:?} {counts:?}: {e}"));
                    if algorithm == Algorithm::Auto {
                        assert_eq!(
                            ran,
                            if group.all_peers_direct() { Algorithm::Peer } else { Algorithm::Nccl }
                        );
                    } else {
                        assert_eq!(ran, algorithm);
                    }
                    case.check(&format!("G={size} {algorithm:?} counts {counts:?} in_place {in_place}"));
                }
            }
            println!("G={size} {algorithm:?}: whole-group byte-exact");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn per_rank_allgather_inside_run_is_byte_exact_for_every_algorithm() {
    for size in group_sizes() {
        let group = gpu_group(size);
        for algorithm in ALGORITHMS {
            for counts in shapes(size) {
                for in_place in [false, true] {
                    let case = Case::new(&counts, 2, in_place);
                    group
                        .run(&|rank, _| case.gather_rank(&group, rank, algorithm).map(drop))
                        .unwrap_or_else(|e| panic!("G={size} {algorithm:?} {counts:?}: {e}"));
                    case.check(&format!(
                        "per-rank G={size} {algorithm:?} counts {counts:?} in_place {in_place}"
                    ));
                }
            }
            println!("G={size} {algorithm:?}: per-rank byte-exact");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn two_hundred_calls_in_a_row_stay_exact() {
    for size in group_sizes() {
        let group = gpu_group(size);
        for algorithm in [Algorithm::Peer, Algorithm::Nccl] {
            let counts: Vec<usize> = (0..size).map(|r| 65536 + 17 * r).collect();
            let mut case = Case::new(&counts, 0, false);
            for call in 0..200 {
                case.blocks = (0..size).map(|r| pattern(r, call + 1000, counts[r])).collect();
                case.reset();
                case.gather(&group, algorithm).unwrap();
                case.check(&format!("G={size} {algorithm:?} call {call}"));
            }
            println!("G={size} {algorithm:?}: 200 calls exact");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn inside_a_scope_the_allgather_comes_after_slow_producers_and_users_on_the_caller_streams() {
    for size in group_sizes() {
        let group = gpu_group(size);
        let kernels: Vec<SpinKernel> = (0..size).map(|r| SpinKernel::load(device_of(r))).collect();
        let methods = PeerMethod::ALL.map(|m| (Algorithm::Peer, Some(m)));
        for (algorithm, method) in methods.into_iter().chain([(Algorithm::Nccl, None)]) {
            set_method(&group, method).unwrap();
            let counts = vec![4096usize; size];
            let mut case = Case::new(&counts, 3, false);
            let callers: Vec<_> = (0..size).map(|r| caller_stream(device_of(r))).collect();
            for r in 0..size {
                // The producer's last word lands after 200 ms of spinning.
                let marker = 0xFEED0000u32 + r as u32;
                case.blocks[r][..4].copy_from_slice(&marker.to_le_bytes());
                kernels[r].launch(callers[r], 200, case.sends[r].ptr, marker);
            }
            // The last rank's caller is still using its recv buffer: a stale word lands in block 0's
            // slot after 300 ms, and the gathered block must land after it.
            let last = size - 1;
            kernels[last].launch(callers[last], 300, case.recvs[last].ptr, 0x57A1E);
            group.enter(Some(&callers)).unwrap();
            case.gather(&group, algorithm).unwrap();
            group.exit(ExitMode::Async).unwrap();
            for (r, &s) in callers.iter().enumerate() {
                cuda().sync_stream(device_of(r), s).unwrap();
            }
            case.check(&format!("scoped G={size} {algorithm:?} {method:?}"));
            for (r, &s) in callers.iter().enumerate() {
                cuda().destroy_stream(device_of(r), s);
            }
            println!("G={size} {algorithm:?} {method:?}: ordered after the callers' slow producer and user");
        }
        set_method(&group, None).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU"]
fn every_peer_method_is_byte_exact() {
    for size in group_sizes() {
        let group = gpu_group(size);
        let mib = 1 << 20;
        let uneven: Vec<usize> = (0..size).map(|r| if r == 0 { 0 } else { 8 * mib + 13 * r }).collect();
        for method in PeerMethod::ALL {
            // Every method at a size the rule gives to another, and at odd sizes and alignments.
            set_method(&group, Some(method)).unwrap();
            for counts in [vec![8 * mib + 5; size], uneven.clone(), vec![777; size]] {
                for in_place in [false, true] {
                    let case = Case::new(&counts, 4, in_place);
                    group.enter(None).unwrap();
                    for _ in 0..3 {
                        case.gather(&group, Algorithm::Peer).unwrap();
                    }
                    group.exit(ExitMode::Async).unwrap();
                    case.check(&format!("{method:?} G={size} counts {counts:?} in_place {in_place}"));
                    // The per-rank call, each rank's share of the same method.
                    let case = Case::new(&counts, 5, in_place);
                    group
                        .run(&|rank, _| {
                            (0..3).try_for_each(|_| case.gather_rank(&group, rank, Algorithm::Peer).map(drop))
                        })
                        .unwrap();
                    case.check(&format!(
                        "per-rank {method:?} G={size} counts {counts:?} in_place {in_place}"
                    ));
                }
            }
            println!("G={size} {method:?}: byte-exact, whole-group and per-rank");
        }
        set_method(&group, None).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU"]
fn an_owner_may_overwrite_its_send_buffer_on_its_stream_right_after_the_call_two_gpus() {
    need_two_gpus();
    let group = gpu_group(2);
    let kernels: Vec<SpinKernel> = (0..2).map(SpinKernel::load).collect();
    let scratch = DeviceBuffer::new(1, 4);
    for method in PeerMethod::ALL {
        set_method(&group, Some(method)).unwrap();
        for count in [4096usize, 3 << 20] {
            let counts = vec![count; 2];
            let case = Case::new(&counts, 5, false);
            group.enter(None).unwrap();
            // Rank 1 is busy for 200 ms (it reads or receives late); rank 0 then overwrites the first
            // word of its send block on its own stream right after the call, with no other group call.
            kernels[1].launch(group.stream(1).unwrap(), 200, scratch.ptr, 1);
            case.gather(&group, Algorithm::Peer).unwrap();
            kernels[0].launch(group.stream(0).unwrap(), 0, case.send_ptr(0), 0xDEAD);
            group.exit(ExitMode::Sync).unwrap();
            case.check(&format!("{method:?} {count} B: owner overwrote its send block early"));
        }
        println!("{method:?}: the send buffer is free on the owner's stream after the call");
    }
    set_method(&group, None).unwrap();
}

#[test]
#[ignore = "needs a GPU"]
fn a_rank_whose_launch_failed_is_released_where_its_stream_reaches_the_call_two_gpus() {
    use refit::kernels::rendezvous::Rendezvous;
    use refit::kernels::PreparedBatch;
    need_two_gpus();
    let group = gpu_group(2); // enables peer access both ways
    let rendezvous = Rendezvous::new(&[0, 1]).unwrap();
    let empty = PreparedBatch::new(0, &[], false).unwrap();
    let streams = [group.stream(0).unwrap(), group.stream(1).unwrap()];
    let scratch = DeviceBuffer::new(1, 4);
    let spin = SpinKernel::load(1);
    let busy = |rank: usize| !gpu_common::stream_idle(device_of(rank), streams[rank]);
    // Twice: the second call checks that the first left the departure counts where the kernel
    // expects them for the next epoch.
    for _ in 0..2 {
        let epoch = rendezvous.next_epoch();
        // Rank 0 launches; rank 1's launch "fails" while its stream is still busy with earlier work.
        spin.launch(streams[1], 400, scratch.ptr, 1);
        unsafe { empty.launch_synced(streams[0].as_ptr().cast(), rendezvous.rank(0), epoch) }.unwrap();
        rendezvous.release(epoch, &[(1, streams[1].as_ptr().cast())]);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(busy(1), "rank 1's earlier work ended too soon for this test");
        assert!(busy(0), "rank 0's launch was released before rank 1's stream reached the call");
        cuda().sync_stream(1, streams[1]).unwrap();
        cuda().sync_stream(0, streams[0]).unwrap();
    }
    // Then a call that both ranks launch meets and departs as usual: the counts the releases wrote
    // are where rank 1's own launches continue them.
    let batches = [empty, PreparedBatch::new(1, &[], false).unwrap()];
    let epoch = rendezvous.next_epoch();
    for (rank, batch) in batches.iter().enumerate() {
        unsafe { batch.launch_synced(streams[rank].as_ptr().cast(), rendezvous.rank(rank), epoch) }.unwrap();
    }
    for (rank, stream) in streams.iter().enumerate() {
        cuda().sync_stream(device_of(rank), *stream).unwrap();
    }
    println!("a launch waiting for a rank that never launched finished once that rank's stream got there");
}

#[test]
#[ignore = "needs a GPU"]
fn a_hundred_calls_in_one_scope_switching_methods_buffers_and_sizes() {
    for size in group_sizes().into_iter().filter(|&g| g > 1) {
        let group = gpu_group(size);
        let cases = hundred_cases(size, 7000);
        group.enter(None).unwrap();
        for (call, case) in cases.iter().enumerate() {
            set_method(
                &group,
                [None, Some(PeerMethod::KernelPushes), Some(PeerMethod::CopyEnginePushes)][(call / 3) % 3],
            )
            .unwrap();
            case.gather(&group, Algorithm::Peer).unwrap();
        }
        group.exit(ExitMode::Sync).unwrap();
        set_method(&group, None).unwrap();
        check_each(&cases, &format!("G={size}"));
        println!("G={size}: 100 calls in one scope, methods and buffers switching, all exact");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn kernel_pushes_launched_by_awake_or_sleeping_rank_threads_are_exact_and_keep_the_callers_context() {
    use cudarc::driver::sys;
    let current_context = || {
        let mut context = std::ptr::null_mut();
        gpu_common::ck("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut context) });
        context
    };
    for size in group_sizes().into_iter().filter(|&g| g > 1) {
        let group = gpu_group(size);
        set_method(&group, Some(PeerMethod::KernelPushes)).unwrap();
        let cases = hundred_cases(size, 9000);
        // The caller works on the last rank's device; the calling thread launches rank 0's kernel.
        cuda().bind(device_of(size - 1)).unwrap();
        let callers = current_context();
        group.enter(None).unwrap();
        for (call, case) in cases.iter().enumerate() {
            if call % 10 == 0 {
                // Long enough for the rank threads to stop spinning and sleep: the calling thread
                // then launches their kernels too.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            case.gather(&group, Algorithm::Peer).unwrap();
            assert_eq!(current_context(), callers, "call {call} changed the caller's current context");
        }
        group.exit(ExitMode::Sync).unwrap();
        check_each(&cases, &format!("G={size}"));
        println!("G={size}: 100 kernel-push calls, rank threads awake and asleep, all exact");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn per_rank_calls_that_disagree_fail_on_every_rank_and_the_next_call_works() {
    for size in group_sizes().into_iter().filter(|&g| g > 1) {
        let group = gpu_group(size);
        let case = Case::new(&vec![4096; size], 9, false);
        // Rank 0 disagrees about the other ranks' blocks: a few bytes more (the same method), or big
        // enough for the copy engine (another method). Its own block and buffers stay valid (a
        // receive buffer wide enough for its view), so only the ranks' disagreement fails the call:
        // on every rank, after they met. Whatever the order in which they met, the next call must
        // not wait for an epoch that nobody launched.
        let wide = DeviceBuffer::new(0, (64 << 20) * size + 4096);
        for (others, repeats) in [(4096 + 16, 3), (64 << 20, 10)] {
            let disagreeing: Vec<usize> = (0..size).map(|r| if r == 0 { 4096 } else { others }).collect();
            for _ in 0..repeats {
                let err = group
                    .run(&|rank, _| {
                        let (counts, recv) = match rank {
                            0 => (&disagreeing, wide.ptr),
                            _ => (&case.counts, case.recvs[rank].ptr),
                        };
                        unsafe {
                            allgather_rank(&group, rank, case.send_ptr(rank), recv, counts, Algorithm::Peer)
                        }
                        .map(drop)
                    })
                    .unwrap_err();
                assert_eq!(err.status, refit::Status::InvalidArgument, "{err}");
                case.reset();
                group.run(&|rank, _| case.gather_rank(&group, rank, Algorithm::Peer).map(drop)).unwrap();
                case.check(&format!("G={size}: the call after a disagreement ({others} B blocks)"));
            }
        }
        println!("G={size}: disagreeing per-rank calls fail everywhere; the next call is exact");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_hundred_per_rank_calls_in_one_run_switching_buffers_and_sizes() {
    for size in group_sizes().into_iter().filter(|&g| g > 1) {
        let group = gpu_group(size);
        // Sizes on both sides of the method threshold: rendezvous epochs and event-ordered calls
        // alternate within one run.
        let cases = hundred_cases(size, 8000);
        group
            .run(&|rank, _| {
                cases.iter().try_for_each(|case| case.gather_rank(&group, rank, Algorithm::Peer).map(drop))
            })
            .unwrap();
        check_each(&cases, &format!("per-rank G={size}"));
        println!("G={size}: 100 per-rank calls in one run, buffers and sizes switching, all exact");
    }
}

/// Tests named `*_two_gpus` need two GPUs and fail without them; gpu/run.sh skips them by name on a
/// one-GPU machine and says so, rather than counting them as passed.
fn need_two_gpus() {
    let n = cuda().device_count();
    assert!(n >= 2, "this test needs 2 GPUs, found {n} (gpu/run.sh skips *_two_gpus on one GPU)");
}
