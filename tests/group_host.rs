//! The device group on the host backend: creation errors, queries, scope ordering (with streams that
//! really run later), run() on persistent threads, error propagation and release.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::transport::host::{create_host_stream, destroy_host_stream, host_stream};
use refit::transport::{BackendKind, Stream};
use refit::{Error, Status};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn host(devices: &[i32]) -> Group {
    Group::new(devices, GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

fn host_err(devices: &[i32], simulated: usize) -> Error {
    Group::new(devices, GroupOptions { backend: BackendChoice::Host, host_devices: simulated }).err().unwrap()
}

/// Queues on `stream` a step that waits until `gate` opens, then stores `value` into `cell`.
fn gated_store(stream: Stream, gate: &Arc<AtomicBool>, cell: &Arc<AtomicU8>, value: u8) {
    let (gate, cell) = (Arc::clone(gate), Arc::clone(cell));
    host_stream(stream)
        .unwrap()
        .enqueue(move || {
            while !gate.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            cell.store(value, Ordering::SeqCst);
        })
        .unwrap();
}

/// Queues on `stream` a step that copies `from` into `to`.
fn queued_copy(stream: Stream, from: &Arc<AtomicU8>, to: &Arc<AtomicU8>) {
    let (from, to) = (Arc::clone(from), Arc::clone(to));
    host_stream(stream)
        .unwrap()
        .enqueue(move || to.store(from.load(Ordering::SeqCst), Ordering::SeqCst))
        .unwrap();
}

#[test]
fn bad_device_lists_have_their_own_status() {
    assert_eq!(host_err(&[], 0).status, Status::EmptyDeviceList);
    assert_eq!(host_err(&[-1], 0).status, Status::InvalidDevice);
    let out_of_range = host_err(&[0, 2], 2);
    assert_eq!(out_of_range.status, Status::InvalidDevice);
    assert!(out_of_range.message.contains("devices[1] = 2"), "{}", out_of_range.message);
    // The host backend simulates a bounded number of devices (a thread each): no runaway spawning.
    assert_eq!(host_err(&[1_000_000_000], 0).status, Status::InvalidDevice);
    assert_eq!(host_err(&[0], 1_000_000).status, Status::InvalidArgument);
    let duplicate = host_err(&[1, 0, 1], 0);
    assert_eq!(duplicate.status, Status::DuplicateDevice);
    assert!(duplicate.message.contains("devices[0] and devices[2]"), "{}", duplicate.message);
    // Long lists are refused in time that grows with their length, not with its square (the search
    // for repeats ran first, over every pair).
    let distinct: Vec<i32> = (0..1 << 20).collect();
    assert_eq!(host_err(&distinct, 0).status, Status::InvalidDevice);
    let mut repeated = vec![3i32; 1 << 20];
    repeated[0] = 2;
    let repeat = host_err(&repeated, 0);
    assert_eq!(repeat.status, Status::DuplicateDevice);
    assert!(repeat.message.contains("devices[1] and devices[2]"), "{}", repeat.message);
}

#[test]
fn queries_report_devices_streams_and_peers() {
    let group = host(&[2, 0, 1]);
    assert_eq!(group.size(), 3);
    assert_eq!(group.backend_kind(), BackendKind::Host);
    assert_eq!(group.device(0).unwrap(), 2);
    assert_eq!(group.device(2).unwrap(), 1);
    assert_eq!(group.device(3).unwrap_err().status, Status::InvalidArgument);
    let streams: Vec<Stream> = (0..3).map(|r| group.stream(r).unwrap()).collect();
    for (r, s) in streams.iter().enumerate() {
        assert_ne!(*s, Stream::NULL, "rank {r} runs on the null stream");
        assert_ne!(
            *s,
            group.backend().null_stream(group.device(r).unwrap()),
            "rank {r} runs on the default stream"
        );
        assert!(streams[..r].iter().all(|o| o != s), "rank {r} shares a stream");
        assert_eq!(group.stream(r).unwrap(), *s, "stream changed between calls");
    }
    assert!(group.peer_access(0, 2).unwrap());
    assert_eq!(group.peer_access(0, 3).unwrap_err().status, Status::InvalidArgument);
    assert!(group.all_peers_direct());
}

#[test]
fn enter_orders_the_group_after_work_queued_earlier_on_the_caller_stream() {
    let group = host(&[0, 1]);
    let callers = [create_host_stream().unwrap(), create_host_stream().unwrap()];
    let gate = Arc::new(AtomicBool::new(false));
    let input = Arc::new(AtomicU8::new(1));
    let seen = Arc::new(AtomicU8::new(0));
    // The caller's (slow) producer, then the group's consumer queued inside the scope.
    gated_store(callers[1], &gate, &input, 42);
    group.enter(Some(&callers)).unwrap();
    queued_copy(group.stream(1).unwrap(), &input, &seen);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(seen.load(Ordering::SeqCst), 0, "the group's stream ran before the caller's earlier work");
    gate.store(true, Ordering::SeqCst);
    group.exit(ExitMode::Sync).unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 42, "SYNC exit returned before the group's work was done");
    for s in callers {
        destroy_host_stream(s).unwrap();
    }
}

#[test]
fn async_exit_orders_the_caller_stream_without_blocking_the_host() {
    let group = host(&[0, 1]);
    let callers = [create_host_stream().unwrap(), create_host_stream().unwrap()];
    let gate = Arc::new(AtomicBool::new(false));
    let result = Arc::new(AtomicU8::new(1));
    let seen = Arc::new(AtomicU8::new(0));
    group.enter(Some(&callers)).unwrap();
    gated_store(group.stream(0).unwrap(), &gate, &result, 77);
    // Returns although the group's work cannot finish until the gate opens: no host blocking.
    group.exit(ExitMode::Async).unwrap();
    queued_copy(callers[0], &result, &seen);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(seen.load(Ordering::SeqCst), 0, "the caller stream did not wait for the group");
    gate.store(true, Ordering::SeqCst);
    host_stream(callers[0]).unwrap().synchronize().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 77);
    for s in callers {
        destroy_host_stream(s).unwrap();
    }
}

#[test]
fn null_caller_streams_mean_each_device_default_stream() {
    let group = host(&[0, 1]);
    let gate = Arc::new(AtomicBool::new(false));
    let input = Arc::new(AtomicU8::new(1));
    let seen = Arc::new(AtomicU8::new(0));
    let default1 = group.backend().null_stream(1);
    gated_store(default1, &gate, &input, 9);
    group.enter(None).unwrap();
    queued_copy(group.stream(1).unwrap(), &input, &seen);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    gate.store(true, Ordering::SeqCst);
    group.exit(ExitMode::Sync).unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 9);
}

#[test]
fn scopes_do_not_nest_and_exit_needs_an_enter() {
    let group = host(&[0, 1]);
    assert_eq!(group.exit(ExitMode::Sync).unwrap_err().status, Status::InvalidState);
    group.enter(None).unwrap();
    let nested = group.enter(None).unwrap_err();
    assert_eq!(nested.status, Status::InvalidState);
    assert!(nested.message.contains("do not nest"), "{}", nested.message);
    group.exit(ExitMode::Async).unwrap();
    assert_eq!(group.exit(ExitMode::Async).unwrap_err().status, Status::InvalidState);
    assert_eq!(group.enter(Some(&[Stream::NULL])).unwrap_err().status, Status::InvalidArgument);
    // A stream handle that is not a host stream is refused and leaves no scope open.
    assert_eq!(group.enter(Some(&[Stream(8), Stream(16)])).unwrap_err().status, Status::InvalidArgument);
    assert!(!group.in_scope());
}

#[test]
fn a_missing_exit_leaves_the_scope_open_and_destroy_drains_it() {
    let group = host(&[0, 1]);
    group.enter(None).unwrap();
    let gate = Arc::new(AtomicBool::new(false));
    let cell = Arc::new(AtomicU8::new(0));
    gated_store(group.stream(0).unwrap(), &gate, &cell, 5);
    assert!(group.in_scope());
    // run() inside the open scope does not close it.
    group.run(&|_, _| Ok(())).unwrap();
    assert!(group.in_scope());
    let opener = Arc::clone(&gate);
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        opener.store(true, Ordering::SeqCst)
    });
    drop(group);
    assert_eq!(cell.load(Ordering::SeqCst), 5, "destroy did not drain the open scope's work");
}

#[test]
fn run_calls_every_rank_on_its_own_persistent_thread_with_its_stream() {
    let group = host(&[1, 0, 2]);
    let seen: Mutex<Vec<(usize, Stream, std::thread::ThreadId)>> = Mutex::new(Vec::new());
    for _ in 0..3 {
        group
            .run(&|rank, stream| {
                seen.lock().unwrap().push((rank, stream, std::thread::current().id()));
                Ok(())
            })
            .unwrap();
    }
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 9);
    for rank in 0..3 {
        let calls: Vec<_> = seen.iter().filter(|(r, _, _)| *r == rank).collect();
        assert_eq!(calls.len(), 3, "rank {rank} not called once per run");
        assert!(calls.iter().all(|(_, s, _)| *s == group.stream(rank).unwrap()));
        assert!(calls.iter().all(|(_, _, t)| *t == calls[0].2), "rank {rank}'s thread changed between runs");
        assert_ne!(calls[0].2, std::thread::current().id());
    }
    let threads: std::collections::HashSet<_> = seen.iter().map(|(_, _, t)| *t).collect();
    assert_eq!(threads.len(), 3, "ranks share threads");
}

#[test]
fn the_first_failing_rank_wins_others_are_released_and_the_group_stays_usable() {
    let group = host(&[0, 1, 2]);
    let mut buffers = vec![vec![0u8; 12]; 3];
    let sends: Vec<Vec<u8>> = (0..3).map(|r| vec![r as u8 + 1; 4]).collect();
    let recv: Vec<u64> = buffers.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
    let counts = [4usize, 4, 4];
    let outcomes: Mutex<Vec<(usize, Status)>> = Mutex::new(Vec::new());
    let err = group
        .run(&|rank, _| {
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(20));
                return Err(Error::new(Status::CallbackFailed, "rank 1 gives up"));
            }
            // Ranks 0 and 2 wait in the collective for rank 1, which never comes.
            let got = unsafe {
                refit::allgather::allgather_rank(
                    &group,
                    rank,
                    sends[rank].as_ptr() as u64,
                    recv[rank],
                    &counts,
                    refit::allgather::Algorithm::Peer,
                )
            };
            outcomes
                .lock()
                .unwrap()
                .push((rank, got.as_ref().err().map(|e| e.status).unwrap_or(Status::Success)));
            got.map(|_| ())
        })
        .unwrap_err();
    assert_eq!(err.status, Status::CallbackFailed);
    assert!(err.message.contains("rank 1 gives up"), "{}", err.message);
    let mut outcomes = outcomes.into_inner().unwrap();
    outcomes.sort_by_key(|o| o.0);
    assert_eq!(outcomes, vec![(0, Status::Aborted), (2, Status::Aborted)]);

    // Usable afterwards: the same collective now completes with the right bytes.
    group
        .run(&|rank, _| unsafe {
            refit::allgather::allgather_rank(
                &group,
                rank,
                sends[rank].as_ptr() as u64,
                recv[rank],
                &counts,
                refit::allgather::Algorithm::Peer,
            )
            .map(|_| ())
        })
        .unwrap();
    let expected: Vec<u8> = sends.concat();
    for b in &buffers {
        assert_eq!(*b, expected);
    }
}

#[test]
fn a_panicking_rank_is_an_internal_error_not_a_crash() {
    let group = host(&[0, 1]);
    let err = group.run(&|rank, _| if rank == 0 { panic!("boom") } else { Ok(()) }).unwrap_err();
    assert_eq!(err.status, Status::InternalError);
    assert!(err.message.contains("rank 0 panicked: boom"), "{}", err.message);
    group.run(&|_, _| Ok(())).unwrap();
}

#[test]
fn run_and_rank_collectives_are_refused_in_the_wrong_place() {
    let group = host(&[0, 1]);
    let nested = Mutex::new(Vec::new());
    group
        .run(&|_, _| {
            nested.lock().unwrap().push(group.run(&|_, _| Ok(())).unwrap_err().status);
            Ok(())
        })
        .unwrap();
    assert_eq!(nested.into_inner().unwrap(), vec![Status::InvalidState; 2]);
    let mut recv = [0u8; 2];
    let outside = unsafe {
        refit::allgather::allgather_rank(&group, 0, 1, recv.as_mut_ptr() as u64, &[1, 1], Default::default())
    };
    assert_eq!(outside.unwrap_err().status, Status::InvalidState);
    let wrong = group
        .run(&|rank, _| unsafe {
            refit::allgather::allgather_rank(&group, 1 - rank, 0, 0, &[0, 0], Default::default()).map(|_| ())
        })
        .unwrap_err();
    assert_eq!(wrong.status, Status::InvalidArgument);
    assert!(wrong.message.contains("called from rank"), "{}", wrong.message);
}

#[test]
fn auto_uses_cuda_when_it_works_and_the_host_backend_otherwise() {
    let group = Group::new(&[0], GroupOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let cuda_works = refit::transport::cuda::cuda_backend().is_ok();
    let expected = if cuda_works { BackendKind::Cuda } else { BackendKind::Host };
    assert_eq!(group.backend_kind(), expected);
}

#[test]
fn extensions_are_made_once_per_type_shared_and_dropped_with_the_group_before_its_streams() {
    // A layer's per-group value that records, when dropped, whether the group's streams still ran.
    struct Kept {
        made: usize,
        stream: Stream,
        dropped: Arc<Mutex<Option<bool>>>,
    }
    impl Drop for Kept {
        fn drop(&mut self) {
            *self.dropped.lock().unwrap() = Some(host_stream(self.stream).is_ok());
        }
    }
    struct Other(u32);

    let group = host(&[0, 1]);
    let dropped = Arc::new(Mutex::new(None));
    let made = AtomicU8::new(0);
    let make = |g: &Group| -> refit::Result<Kept> {
        made.fetch_add(1, Ordering::SeqCst);
        Ok(Kept { made: 1, stream: g.stream(1)?, dropped: Arc::clone(&dropped) })
    };
    let first = group.extension(make).unwrap();
    let again = group.extension(make).unwrap();
    assert!(Arc::ptr_eq(&first, &again), "one value per type");
    assert_eq!((made.load(Ordering::SeqCst), first.made), (1, 1), "made once");
    assert_eq!(group.extension(|_| Ok(Other(7))).unwrap().0, 7, "another type, another value");
    let failed = group.extension::<u64>(|_| Err(Error::invalid_state("cannot make it"))).unwrap_err();
    assert_eq!(failed.status, Status::InvalidState);
    assert_eq!(*group.extension(|_| Ok(5u64)).unwrap(), 5, "a failed creation is tried again");
    drop((first, again));
    assert_eq!(*dropped.lock().unwrap(), None, "kept while the group lives");
    drop(group);
    assert_eq!(*dropped.lock().unwrap(), Some(true), "dropped with the group, before its streams");
}

#[test]
fn a_group_driven_by_one_thread_refuses_another_threads_calls() {
    let group = host(&[0, 1]);
    let driving = group.drive().unwrap();
    // The driving thread's own calls nest.
    group.enter(None).unwrap();
    group.run(&|_, _| Ok(())).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            for err in [
                group.enter(None).unwrap_err(),
                group.exit(ExitMode::Sync).unwrap_err(),
                group.run(&|_, _| Ok(())).unwrap_err(),
            ] {
                assert_eq!(err.status, Status::InvalidState, "{err}");
                assert!(err.message.contains("another thread"), "{err}");
            }
        });
    });
    // The refused exit left the scope open; the driver closes it.
    group.exit(ExitMode::Sync).unwrap();
    drop(driving);
    std::thread::scope(|s| {
        s.spawn(|| {
            group.enter(None).unwrap();
            group.exit(ExitMode::Sync).unwrap();
        });
    });
}
