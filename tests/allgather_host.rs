//! Allgather on the host backend, byte-exact against an expectation built independently (the blocks
//! concatenated in rank order by plain Vec operations), for every shape the API allows.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

#[path = "common/blocks.rs"]
mod blocks;

use blocks::block;
use refit::allgather::peer::{set_method, PeerMethod};
use refit::allgather::{allgather, allgather_rank, Algorithm};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::transport::host::{create_host_stream, destroy_host_stream, host_stream};
use refit::Status;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const POISON: u8 = 0xAB;

fn host(n: usize) -> Group {
    let devices: Vec<i32> = (0..n as i32).collect();
    Group::new(&devices, GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

/// The size rule (None) and every whole-group peer method forced at every size.
const METHODS: [Option<PeerMethod>; 3] =
    [None, Some(PeerMethod::KernelPushes), Some(PeerMethod::CopyEnginePushes)];

fn host_with(n: usize, method: Option<PeerMethod>) -> Group {
    let group = host(n);
    set_method(&group, method).unwrap();
    group
}

fn expected(blocks: &[Vec<u8>]) -> Vec<u8> {
    let mut all = Vec::new();
    for b in blocks {
        all.extend_from_slice(b);
    }
    all
}

/// Runs one whole-group allgather out of place and checks every rank's bytes.
fn check_whole_group(group: &Group, counts: &[usize], algorithm: Algorithm, call: usize) -> Algorithm {
    let n = group.size();
    let sends: Vec<Vec<u8>> = (0..n).map(|r| block(r, call, counts[r])).collect();
    let total: usize = counts.iter().sum();
    let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; total]; n];
    let send_ptrs: Vec<u64> = sends.iter().map(|s| s.as_ptr() as u64).collect();
    let recv_ptrs: Vec<u64> = recvs.iter_mut().map(|r| r.as_mut_ptr() as u64).collect();
    let ran = unsafe { allgather(group, &send_ptrs, &recv_ptrs, counts, algorithm) }.unwrap();
    let want = expected(&sends);
    for (r, got) in recvs.iter().enumerate() {
        assert!(
            *got == want,
            "rank {r} received wrong bytes (counts {counts:?}, {algorithm:?}, call {call})"
        );
    }
    ran
}

#[test]
fn equal_uneven_zero_and_single_rank_byte_exact_for_peer_and_host() {
    let cases = [Algorithm::Peer, Algorithm::Host, Algorithm::Auto]
        .into_iter()
        .flat_map(|algorithm| METHODS.map(|method| (algorithm, method)));
    for (algorithm, method) in cases {
        let group = host_with(4, method);
        check_whole_group(&group, &[1000, 1000, 1000, 1000], algorithm, 0);
        check_whole_group(&group, &[5, 0, 1234, 17], algorithm, 1);
        check_whole_group(&group, &[0, 0, 0, 0], algorithm, 2);
        check_whole_group(&group, &[0, 0, 0, 3], algorithm, 3);
        let single = host_with(1, method);
        check_whole_group(&single, &[777], algorithm, 4);
    }
}

#[test]
fn auto_picks_peer_on_the_host_backend_and_nccl_is_unsupported_there() {
    let group = host(2);
    assert_eq!(check_whole_group(&group, &[8, 8], Algorithm::Auto, 0), Algorithm::Peer);
    let mut recv = vec![0u8; 16];
    let send = [1u8; 8];
    let r = recv.as_mut_ptr() as u64;
    let err =
        unsafe { allgather(&group, &[send.as_ptr() as u64; 2], &[r, r + 16], &[8, 8], Algorithm::Nccl) };
    assert_eq!(err.unwrap_err().status, Status::Unsupported);
}

#[test]
fn in_place_ranks_keep_their_block_and_receive_the_others() {
    let cases = [(Algorithm::Host, None)].into_iter().chain(METHODS.map(|method| (Algorithm::Peer, method)));
    for (algorithm, method) in cases {
        let group = host_with(3, method);
        let counts = [64usize, 10, 300];
        let offsets = [0usize, 64, 74];
        let total = 374;
        let blocks: Vec<Vec<u8>> = (0..3).map(|r| block(r, 9, counts[r])).collect();
        // Rank 0 and 2 in place (their block already sits in their slot), rank 1 out of place.
        let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; total]; 3];
        for r in [0, 2] {
            recvs[r][offsets[r]..offsets[r] + counts[r]].copy_from_slice(&blocks[r]);
        }
        let recv_ptrs: Vec<u64> = recvs.iter_mut().map(|r| r.as_mut_ptr() as u64).collect();
        let send_ptrs =
            [recv_ptrs[0] + offsets[0] as u64, blocks[1].as_ptr() as u64, recv_ptrs[2] + offsets[2] as u64];
        unsafe { allgather(&group, &send_ptrs, &recv_ptrs, &counts, algorithm) }.unwrap();
        let want = expected(&blocks);
        for (r, got) in recvs.iter().enumerate() {
            assert!(*got == want, "rank {r} wrong ({algorithm:?}, {method:?})");
        }
    }
}

#[test]
fn two_hundred_calls_in_a_row_inside_one_scope_and_outside() {
    let group = host(3);
    let counts = [33usize, 0, 129];
    for call in 0..200 {
        set_method(&group, METHODS[call / 67]).unwrap();
        check_whole_group(&group, &counts, Algorithm::Peer, call);
    }
    // Inside one scope: each call is only queued; buffers must live until the exit. The method
    // changes from call to call, so every hand-over between methods' orderings is crossed.
    let n = 3;
    let total: usize = counts.iter().sum();
    let sends: Vec<Vec<Vec<u8>>> =
        (0..200).map(|c| (0..n).map(|r| block(r, c, counts[r])).collect()).collect();
    let mut recvs: Vec<Vec<Vec<u8>>> = (0..200).map(|_| vec![vec![POISON; total]; n]).collect();
    group.enter(None).unwrap();
    for call in 0..200 {
        set_method(&group, METHODS[(call * 7 / 3) % 3]).unwrap();
        let s: Vec<u64> = sends[call].iter().map(|b| b.as_ptr() as u64).collect();
        let r: Vec<u64> = recvs[call].iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        unsafe { allgather(&group, &s, &r, &counts, Algorithm::Peer) }.unwrap();
    }
    group.exit(ExitMode::Sync).unwrap();
    for call in 0..200 {
        let want = expected(&sends[call]);
        assert!(recvs[call].iter().all(|got| *got == want), "call {call} wrong");
    }
}

/// Callers produce the send blocks late (behind a gate) on their own streams; the allgather inside
/// the scope must still read the final bytes.
fn scoped_allgather_sees_late_producers(n: usize, method: Option<PeerMethod>) {
    let group = host_with(n, method);
    let callers: Vec<_> = (0..n).map(|_| create_host_stream().unwrap()).collect();
    let counts = vec![256usize; n];
    let final_blocks: Vec<Vec<u8>> = (0..n).map(|r| block(r, 5, 256)).collect();
    let mut sends: Vec<Vec<u8>> = vec![vec![0u8; 256]; n];
    let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; 256 * n]; n];
    let gate = Arc::new(AtomicBool::new(false));
    for r in 0..n {
        let (gate, dst, src) = (Arc::clone(&gate), sends[r].as_mut_ptr() as usize, final_blocks[r].clone());
        host_stream(callers[r])
            .unwrap()
            .enqueue(move || {
                while !gate.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
            })
            .unwrap();
    }
    group.enter(Some(&callers)).unwrap();
    let s: Vec<u64> = sends.iter().map(|b| b.as_ptr() as u64).collect();
    let r: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    unsafe { allgather(&group, &s, &r, &counts, Algorithm::Peer) }.unwrap();
    std::thread::sleep(Duration::from_millis(20));
    gate.store(true, Ordering::SeqCst);
    group.exit(ExitMode::Async).unwrap();
    for &c in &callers {
        host_stream(c).unwrap().synchronize().unwrap();
    }
    let want = expected(&final_blocks);
    assert!(
        recvs.iter().all(|got| *got == want),
        "n={n} {method:?}: the allgather read the send buffers before the callers wrote them"
    );
    for c in callers {
        destroy_host_stream(c).unwrap();
    }
}

#[test]
fn inside_a_scope_the_allgather_sees_the_caller_stream_work_queued_before_enter() {
    for method in METHODS {
        for n in [2, 3, 5] {
            scoped_allgather_sees_late_producers(n, method);
        }
    }
}

#[test]
fn every_peer_method_byte_exact_for_uneven_and_empty_blocks_call_after_call() {
    for method in METHODS {
        let group = host_with(4, method);
        check_whole_group(&group, &[1000, 1000, 1000, 1000], Algorithm::Peer, 0);
        check_whole_group(&group, &[5, 0, 1234, 17], Algorithm::Peer, 1);
        for call in 0..50 {
            check_whole_group(&group, &[64, 3, 0, 129], Algorithm::Peer, call);
        }
        // Inside one scope, with buffers alive until the exit.
        let counts = [40usize, 0, 7, 300];
        let sends: Vec<Vec<Vec<u8>>> =
            (0..50).map(|c| (0..4).map(|r| block(r, c, counts[r])).collect()).collect();
        let mut recvs: Vec<Vec<Vec<u8>>> = (0..50).map(|_| vec![vec![POISON; 347]; 4]).collect();
        group.enter(None).unwrap();
        for call in 0..50 {
            let s: Vec<u64> = sends[call].iter().map(|b| b.as_ptr() as u64).collect();
            let r: Vec<u64> = recvs[call].iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
            unsafe { allgather(&group, &s, &r, &counts, Algorithm::Peer) }.unwrap();
        }
        group.exit(ExitMode::Sync).unwrap();
        for call in 0..50 {
            let want = expected(&sends[call]);
            assert!(recvs[call].iter().all(|got| *got == want), "{method:?} call {call} wrong");
        }
    }
}

fn per_rank(group: &Group, counts: &[usize], algorithm: Algorithm, calls: usize, in_place: bool) {
    let n = group.size();
    let total: usize = counts.iter().sum();
    let offsets: Vec<usize> = (0..n).map(|r| counts[..r].iter().sum()).collect();
    for call in 0..calls {
        let blocks: Vec<Vec<u8>> = (0..n).map(|r| block(r, call, counts[r])).collect();
        let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; total]; n];
        if in_place {
            for r in 0..n {
                recvs[r][offsets[r]..offsets[r] + counts[r]].copy_from_slice(&blocks[r]);
            }
        }
        let recv_ptrs: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        let send_ptrs: Vec<u64> = (0..n)
            .map(|r| if in_place { recv_ptrs[r] + offsets[r] as u64 } else { blocks[r].as_ptr() as u64 })
            .collect();
        group
            .run(&|rank, _| unsafe {
                let ran = allgather_rank(group, rank, send_ptrs[rank], recv_ptrs[rank], counts, algorithm)?;
                assert_ne!(ran, Algorithm::Auto);
                Ok(())
            })
            .unwrap();
        let want = expected(&blocks);
        for (r, got) in recvs.iter().enumerate() {
            assert!(*got == want, "rank {r} wrong (counts {counts:?}, {algorithm:?}, call {call})");
        }
    }
}

#[test]
fn per_rank_allgather_inside_run_byte_exact() {
    for algorithm in [Algorithm::Peer, Algorithm::Host, Algorithm::Auto] {
        let group = host(4);
        per_rank(&group, &[100, 100, 100, 100], algorithm, 3, false);
        per_rank(&group, &[7, 0, 513, 1], algorithm, 3, false);
        per_rank(&group, &[7, 0, 513, 1], algorithm, 3, true);
        per_rank(&group, &[0, 0, 0, 0], algorithm, 2, false);
        per_rank(&host(1), &[99], algorithm, 2, false);
    }
}

#[test]
fn host_staging_moves_blocks_larger_than_its_buffer_in_parts() {
    // The Host algorithm stages 8 MiB at a time: blocks of two parts and a bit, one part and a byte,
    // and a short one, whole-group and per rank.
    const PART: usize = 8 << 20;
    let counts = [2 * PART + 3, 5, PART + 1];
    check_whole_group(&host(3), &counts, Algorithm::Host, 0);
    per_rank(&host(3), &counts, Algorithm::Host, 1, false);
}

#[test]
fn per_rank_allgather_two_hundred_collectives_in_one_run() {
    let group = host(3);
    let counts = [40usize, 3, 0];
    let calls = 200;
    let blocks: Vec<Vec<Vec<u8>>> =
        (0..calls).map(|c| (0..3).map(|r| block(r, c, counts[r])).collect()).collect();
    let mut recvs: Vec<Vec<Vec<u8>>> = (0..calls).map(|_| vec![vec![POISON; 43]; 3]).collect();
    let recv_ptrs: Vec<Vec<u64>> = recvs
        .iter_mut()
        .map(|per_call| per_call.iter_mut().map(|b| b.as_mut_ptr() as u64).collect())
        .collect();
    group
        .run(&|rank, _| {
            for call in 0..calls {
                let send = blocks[call][rank].as_ptr() as u64;
                unsafe {
                    allgather_rank(&group, rank, send, recv_ptrs[call][rank], &counts, Algorithm::Peer)
                }?;
            }
            Ok(())
        })
        .unwrap();
    for call in 0..calls {
        let want = expected(&blocks[call]);
        assert!(recvs[call].iter().all(|got| *got == want), "collective {call} wrong");
    }
}

#[test]
fn every_bad_argument_has_its_own_status() {
    let group = host(2);
    let send = [1u8; 8];
    let mut recv = vec![0u8; 32];
    let s = send.as_ptr() as u64;
    let r0 = recv.as_mut_ptr() as u64;
    let r1 = r0 + 16;
    let status = |send: &[u64], recv: &[u64], counts: &[usize]| unsafe {
        allgather(&group, send, recv, counts, Algorithm::Peer).unwrap_err()
    };
    assert_eq!(status(&[s], &[r0, r1], &[8, 8]).status, Status::InvalidArgument);
    assert_eq!(status(&[s, s], &[r0, r1], &[8]).status, Status::InvalidArgument);
    let null_send = status(&[s, 0], &[r0, r1], &[8, 8]);
    assert_eq!(null_send.status, Status::NullArgument);
    assert!(null_send.message.contains("send[1]"), "{}", null_send.message);
    assert_eq!(status(&[s, s], &[r0, 0], &[8, 8]).status, Status::NullArgument);
    assert_eq!(status(&[s, s], &[r0, r0 + 8], &[8, 8]).status, Status::Overlap);
    // Overlapping the own receive buffer other than exactly in place.
    assert_eq!(status(&[r0 + 1, s], &[r0, r1], &[8, 8]).status, Status::Overlap);
    assert_eq!(status(&[s, s], &[r0, r1], &[usize::MAX, 8]).status, Status::InvalidArgument);
    assert_eq!(status(&[s, s], &[u64::MAX - 4, r1], &[8, 8]).status, Status::InvalidArgument);
    assert_eq!(Algorithm::from_code(4).unwrap_err().status, Status::InvalidArgument);
    // NULL buffers are fine where nothing is moved.
    unsafe { allgather(&group, &[0, 0], &[0, 0], &[0, 0], Algorithm::Peer) }.unwrap();
    // Nothing was written by any refused call.
    assert!(recv.iter().all(|&b| b == 0));
}

#[test]
fn ranks_that_disagree_on_counts_all_fail() {
    let group = host(2);
    let send = [3u8; 8];
    let mut recv = vec![0u8; 32];
    let r = recv.as_mut_ptr() as u64;
    let err = group
        .run(&|rank, _| unsafe {
            let counts = if rank == 0 { [8usize, 8] } else { [8usize, 4] };
            let total = 16;
            allgather_rank(
                &group,
                rank,
                send.as_ptr() as u64,
                r + (rank * total) as u64,
                &counts,
                Algorithm::Peer,
            )
            .map(|_| ())
        })
        .unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("same"), "{}", err.message);
    assert!(recv.iter().all(|&b| b == 0));
}

/// Queues on rank `rank`'s group stream a step that waits for `gate` (a slow reader).
fn slow_down(group: &Group, rank: usize, gate: &Arc<AtomicBool>) {
    let gate = Arc::clone(gate);
    host_stream(group.stream(rank).unwrap())
        .unwrap()
        .enqueue(move || {
            while !gate.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .unwrap();
}

#[test]
fn after_async_exit_an_owner_may_reuse_its_send_buffer_only_once_every_reader_is_done() {
    for method in METHODS {
        after_async_exit_an_owner_may_reuse_its_send_buffer_only_once_every_reader_is_done_with(method);
    }
}

fn after_async_exit_an_owner_may_reuse_its_send_buffer_only_once_every_reader_is_done_with(
    method: Option<PeerMethod>,
) {
    let group = host_with(2, method);
    let callers = [create_host_stream().unwrap(), create_host_stream().unwrap()];
    let blocks: Vec<Vec<u8>> = (0..2).map(|r| block(r, 11, 64)).collect();
    let mut sends = blocks.clone();
    let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; 128]; 2];
    let gate = Arc::new(AtomicBool::new(false));
    group.enter(Some(&callers)).unwrap();
    slow_down(&group, 1, &gate); // rank 1 reads rank 0's block late
    let s: Vec<u64> = sends.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    let r: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    unsafe { allgather(&group, &s, &r, &[64, 64], Algorithm::Peer) }.unwrap();
    group.exit(ExitMode::Async).unwrap();
    // The owner's next work on its own stream overwrites its send buffer.
    let send0 = s[0] as usize;
    host_stream(callers[0])
        .unwrap()
        .enqueue(move || unsafe { std::ptr::write_bytes(send0 as *mut u8, 0, 64) })
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    gate.store(true, Ordering::SeqCst);
    for c in callers {
        host_stream(c).unwrap().synchronize().unwrap();
    }
    group.synchronize().unwrap();
    assert!(
        recvs[1] == expected(&blocks),
        "{method:?}: rank 1 read rank 0's block after the owner overwrote it"
    );
    assert!(sends[0].iter().all(|&b| b == 0));
    for c in callers {
        destroy_host_stream(c).unwrap();
    }
}

#[test]
fn run_after_a_scoped_allgather_starts_only_after_every_reader_is_done() {
    for method in METHODS {
        run_after_a_scoped_allgather_starts_only_after_every_reader_is_done_with(method);
    }
}

fn run_after_a_scoped_allgather_starts_only_after_every_reader_is_done_with(method: Option<PeerMethod>) {
    let group = host_with(2, method);
    let blocks: Vec<Vec<u8>> = (0..2).map(|r| block(r, 12, 64)).collect();
    let mut sends = blocks.clone();
    let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; 128]; 2];
    let gate = Arc::new(AtomicBool::new(false));
    group.enter(None).unwrap();
    slow_down(&group, 1, &gate);
    let s: Vec<u64> = sends.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    let r: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    unsafe { allgather(&group, &s, &r, &[64, 64], Algorithm::Peer) }.unwrap();
    let opener = Arc::clone(&gate);
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        opener.store(true, Ordering::SeqCst)
    });
    // Rank 0's callback queues an overwrite of its send buffer on its stream.
    group
        .run(&|rank, stream| {
            if rank == 0 {
                let send0 = s[0] as usize;
                host_stream(stream)
                    .unwrap()
                    .enqueue(move || unsafe { std::ptr::write_bytes(send0 as *mut u8, 0, 64) })?;
            }
            Ok(())
        })
        .unwrap();
    group.exit(ExitMode::Sync).unwrap();
    assert!(
        recvs[1] == expected(&blocks),
        "{method:?}: rank 1 read rank 0's block after the owner overwrote it"
    );
    assert!(sends[0].iter().all(|&b| b == 0));
}

#[test]
fn async_exit_after_a_peer_allgather_orders_the_caller_after_every_copy() {
    for method in METHODS {
        async_exit_after_a_peer_allgather_orders_the_caller_after_every_copy_with(method);
    }
}

fn async_exit_after_a_peer_allgather_orders_the_caller_after_every_copy_with(method: Option<PeerMethod>) {
    let n = 3;
    let len = 8 << 20; // large enough that a lane's copy takes milliseconds
    let group = host_with(n, method);
    let callers: Vec<_> = (0..n).map(|_| create_host_stream().unwrap()).collect();
    let blocks: Vec<Vec<u8>> = (0..n).map(|r| block(r, 21, len)).collect();
    let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; len * n]; n];
    let gate = Arc::new(AtomicBool::new(false));
    // A gated step on caller 0's stream only: rank 0's block moves late, while the other ranks' own
    // work is done at once; their callers must still wait for rank 0's block to land.
    for &c in &callers[..1] {
        let gate = Arc::clone(&gate);
        host_stream(c)
            .unwrap()
            .enqueue(move || {
                while !gate.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
            .unwrap();
    }
    group.enter(Some(&callers)).unwrap();
    let s: Vec<u64> = blocks.iter().map(|b| b.as_ptr() as u64).collect();
    let r: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    unsafe { allgather(&group, &s, &r, &vec![len; n], Algorithm::Peer) }.unwrap();
    group.exit(ExitMode::Async).unwrap();
    // The caller's next work snapshots what it received.
    let snapshots: Vec<Arc<std::sync::Mutex<Vec<u8>>>> =
        (0..n).map(|_| Arc::new(std::sync::Mutex::new(Vec::new()))).collect();
    for i in 0..n {
        let (snap, src) = (Arc::clone(&snapshots[i]), r[i] as usize);
        host_stream(callers[i])
            .unwrap()
            .enqueue(move || {
                *snap.lock().unwrap() =
                    unsafe { std::slice::from_raw_parts(src as *const u8, len * n) }.to_vec()
            })
            .unwrap();
    }
    gate.store(true, Ordering::SeqCst);
    for &c in &callers {
        host_stream(c).unwrap().synchronize().unwrap();
    }
    let want = expected(&blocks);
    for (i, snap) in snapshots.iter().enumerate() {
        assert!(
            *snap.lock().unwrap() == want,
            "{method:?}: caller {i} ran before the group's copies finished"
        );
    }
    for c in callers {
        destroy_host_stream(c).unwrap();
    }
}

#[test]
fn copies_into_a_receiver_land_after_its_earlier_work_on_the_recv_buffer() {
    for method in METHODS {
        let n = 3;
        let len = 4096;
        let group = host_with(n, method);
        let callers: Vec<_> = (0..n).map(|_| create_host_stream().unwrap()).collect();
        let blocks: Vec<Vec<u8>> = (0..n).map(|r| block(r, 31, len)).collect();
        let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; len * n]; n];
        let r: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        // Rank 1's caller still uses its recv buffer (clears it) behind a gate when the group enters.
        let gate = Arc::new(AtomicBool::new(false));
        let (opened, recv1) = (Arc::clone(&gate), r[1] as usize);
        host_stream(callers[1])
            .unwrap()
            .enqueue(move || {
                while !opened.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                unsafe { std::ptr::write_bytes(recv1 as *mut u8, 0, len * n) };
            })
            .unwrap();
        group.enter(Some(&callers)).unwrap();
        let s: Vec<u64> = blocks.iter().map(|b| b.as_ptr() as u64).collect();
        unsafe { allgather(&group, &s, &r, &vec![len; n], Algorithm::Peer) }.unwrap();
        group.exit(ExitMode::Async).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        gate.store(true, Ordering::SeqCst);
        for &c in &callers {
            host_stream(c).unwrap().synchronize().unwrap();
        }
        let want = expected(&blocks);
        for (rank, got) in recvs.iter().enumerate() {
            assert!(*got == want, "{method:?}: rank {rank}'s earlier work overwrote the gathered blocks");
        }
        for c in callers {
            destroy_host_stream(c).unwrap();
        }
    }
}

#[test]
fn an_owner_may_overwrite_its_send_buffer_on_its_stream_right_after_the_call() {
    for method in METHODS {
        let group = host_with(2, method);
        let blocks: Vec<Vec<u8>> = (0..2).map(|r| block(r, 41, 64)).collect();
        let mut sends = blocks.clone();
        let mut recvs: Vec<Vec<u8>> = vec![vec![POISON; 128]; 2];
        let gate = Arc::new(AtomicBool::new(false));
        group.enter(None).unwrap();
        slow_down(&group, 1, &gate); // rank 1 reads rank 0's block late
        let s: Vec<u64> = sends.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        let r: Vec<u64> = recvs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        unsafe { allgather(&group, &s, &r, &[64, 64], Algorithm::Peer) }.unwrap();
        // Still inside the scope, no other group call: the owner's next step on its own stream.
        let send0 = s[0] as usize;
        host_stream(group.stream(0).unwrap())
            .unwrap()
            .enqueue(move || unsafe { std::ptr::write_bytes(send0 as *mut u8, 0, 64) })
            .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        gate.store(true, Ordering::SeqCst);
        group.exit(ExitMode::Sync).unwrap();
        assert!(
            recvs[1] == expected(&blocks),
            "{method:?}: rank 1 read rank 0's block after it was overwritten"
        );
        assert!(sends[0].iter().all(|&b| b == 0));
    }
}

/// Runs `group.run(body)` on another thread and returns its result, or panics when it has not
/// returned within `limit`: a regression to waiting forever fails the test instead of hanging it.
fn run_bounded(
    group: &Arc<Group>,
    limit: Duration,
    body: impl Fn(usize) -> refit::Result<()> + Send + Sync + 'static,
) -> refit::Result<()> {
    let (done, finished) = std::sync::mpsc::channel();
    let group = Arc::clone(group);
    std::thread::spawn(move || done.send(group.run(&|rank, _| body(rank))));
    finished.recv_timeout(limit).expect("refit_group_run did not return: ranks wait forever")
}

/// The bytes at `addr` (a live buffer of at least `len` bytes no stream is writing).
fn bytes_at(addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) }.to_vec()
}

/// Waits until the work queued on `rank`'s stream has run.
fn drain(group: &Group, rank: usize) -> refit::Result<()> {
    group.backend().sync_stream(group.device(rank)?, group.stream(rank)?)
}

#[test]
fn per_rank_retries_after_overlap_never_return_success_with_blocks_missing() {
    // Issue 14 item 2: four ranks; ranks 1 and 2 first pass overlapping receive buffers and retry
    // with their own. A rank's call that returns Ok must have every block; every rank retries a
    // failed call, so all of them end with every block.
    const N: usize = 4;
    const LEN: usize = 64;
    for method in METHODS {
        let group = Arc::new(host_with(N, method));
        let sends: Vec<Vec<u8>> = (0..N).map(|r| block(r, 7, LEN)).collect();
        let mut recvs = vec![vec![POISON; N * LEN]; N];
        let mut shared = vec![POISON; N * LEN + LEN];
        let want = expected(&sends);
        let send: Vec<u64> = sends.iter().map(|s| s.as_ptr() as u64).collect();
        let recv: Vec<u64> = recvs.iter_mut().map(|r| r.as_mut_ptr() as u64).collect();
        let overlapping = [0, shared.as_mut_ptr() as u64, shared.as_mut_ptr() as u64 + LEN as u64, 0];
        let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (o, w, g) = (Arc::clone(&outcomes), want.clone(), Arc::clone(&group));
        let ran = run_bounded(&group, Duration::from_secs(30), move |rank| {
            for attempt in 0..3 {
                let to = if attempt == 0 && overlapping[rank] != 0 { overlapping[rank] } else { recv[rank] };
                // SAFETY: every buffer lives until the run returns.
                let got = unsafe { allgather_rank(&g, rank, send[rank], to, &[LEN; N], Algorithm::Peer) };
                drain(&g, rank)?;
                let complete = to == recv[rank] && bytes_at(to, N * LEN) == w;
                o.lock().unwrap().push((
                    rank,
                    attempt,
                    got.as_ref().map(drop).map_err(|e| e.status),
                    complete,
                ));
                if got.is_ok() {
                    return Ok(());
                }
            }
            Ok(())
        });
        ran.unwrap_or_else(|e| panic!("{method:?}: {e}"));
        let outcomes = outcomes.lock().unwrap().clone();
        for &(rank, attempt, status, complete) in &outcomes {
            assert!(
                status.is_err() || complete,
                "{method:?}: rank {rank} attempt {attempt}: Ok without every block"
            );
        }
        for (rank, got) in recvs.iter().enumerate() {
            assert_eq!(*got, want, "{method:?}: rank {rank} ends without every block");
        }
        // The overlap is every rank's error, not only that of the two ranks whose buffers overlap.
        let first: Vec<_> = outcomes.iter().filter(|o| o.1 == 0).map(|o| o.2).collect();
        assert_eq!(first, vec![Err(Status::Overlap); N], "{method:?}");
    }
}

#[test]
fn a_callback_that_returns_without_the_call_its_peers_are_in_releases_them_with_aborted() {
    // Issue 14 item 7: rank 1's callback returns at once (or after its own call failed before it
    // met the others, its error ignored); ranks 0 and 2 wait for it in their call. They are released
    // with ABORTED naming rank 1, and the run reports it even though every callback returned Ok.
    const N: usize = 3;
    const LEN: usize = 16;
    for rank_one_calls in [false, true] {
        let group = Arc::new(host(N));
        let sends: Vec<Vec<u8>> = (0..N).map(|r| block(r, 9, LEN)).collect();
        let mut recvs = vec![vec![POISON; N * LEN]; N];
        let send: Vec<u64> = sends.iter().map(|s| s.as_ptr() as u64).collect();
        let recv: Vec<u64> = recvs.iter_mut().map(|r| r.as_mut_ptr() as u64).collect();
        let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (o, g, (s, r)) = (Arc::clone(&outcomes), Arc::clone(&group), (send.clone(), recv.clone()));
        let ran = run_bounded(&group, Duration::from_secs(30), move |rank| {
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(20)); // the others are waiting by now
                if rank_one_calls {
                    // A NULL send buffer: refused before the ranks meet. The callback ignores it.
                    let refused = unsafe { allgather_rank(&g, rank, 0, r[rank], &[LEN; N], Algorithm::Peer) };
                    assert_eq!(refused.unwrap_err().status, Status::NullArgument);
                }
                return Ok(());
            }
            // SAFETY: the buffers live until the run returns.
            let got = unsafe { allgather_rank(&g, rank, s[rank], r[rank], &[LEN; N], Algorithm::Peer) };
            o.lock().unwrap().push((rank, got.map(drop).map_err(|e| (e.status, e.message))));
            Ok(())
        });
        let err = ran.unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");
        assert!(err.message.contains("rank 1's callback returned"), "{err}");
        let mut outcomes = outcomes.lock().unwrap().clone();
        outcomes.sort_by_key(|o| o.0);
        assert_eq!(outcomes.len(), 2);
        for (rank, outcome) in outcomes {
            let (status, message) = outcome.unwrap_err();
            assert_eq!(status, Status::Aborted, "rank {rank}: {message}");
            assert!(message.contains("rank 1's callback returned"), "rank {rank}: {message}");
        }
        // The group stays usable: the same call on every rank completes.
        let g = Arc::clone(&group);
        run_bounded(&group, Duration::from_secs(30), move |rank| {
            // SAFETY: as above.
            unsafe { allgather_rank(&g, rank, send[rank], recv[rank], &[LEN; N], Algorithm::Peer) }
                .map(drop)?;
            drain(&g, rank)
        })
        .unwrap();
        let want = expected(&sends);
        assert!(recvs.iter().all(|r| *r == want));
    }
}
