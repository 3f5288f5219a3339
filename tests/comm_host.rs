//! Communicators between OS processes on the host backend (CI has no GPU): each test runs its body
//! in several processes (this test binary run again, filtered to the one test, with the rank and the
//! communicator id in its environment), and the parent checks how each process ended.
//!
//! Byte-exact checks compare with expectations every process computes on its own (the blocks are a
//! function of rank and call). Failure tests check that every rank gets a status, within the timeout,
//! when a peer never arrives, exits, is killed or aborts.

#[path = "common/blocks.rs"]
mod blocks;

#[path = "common/processes.rs"]
mod processes;

use blocks::block;
use processes::{in_processes, End};
use refit::across::build_plan;
use refit::allgather::comm::allgather;
use refit::exec::{CommitMode, ExecOptions, Executor, Stage};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{
    self, Endpoint, Need, Offer, OwnerPolicy, PlanOptions, Region, RouteKind, Table, TensorSpec,
};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::host::{create_host_stream, destroy_host_stream, HostBackend};
use refit::transport::ipc;
use refit::transport::staged::{Flow, StagedExchange};
use refit::transport::{Backend, BackendKind, Stream};
use refit::{Segment, Status};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

const POISON: u8 = 0xAB;

/// Runs `body` in processes joined by a host-backend communicator (see `processes::in_processes`).
fn on_host(test: &str, ends: &[End], body: fn(usize, usize, &CommId)) {
    in_processes(test, BackendKind::Host, ends, body)
}

fn options(timeout_ms: u64) -> CommOptions {
    CommOptions { timeout: Duration::from_millis(timeout_ms), ..CommOptions::default() }
}

fn join(rank: usize, size: usize, id: &CommId, timeout_ms: u64) -> Communicator {
    Communicator::create(id, size, rank, 0, options(timeout_ms)).unwrap()
}

/// One allgather of `counts` (in place or not) on `stream`, checked against the blocks concatenated.
fn gather_and_check(comm: &Communicator, counts: &[usize], call: usize, in_place: bool, stream: Stream) {
    let rank = comm.rank();
    let total: usize = counts.iter().sum();
    let offset: usize = counts[..rank].iter().sum();
    let mine = block(rank, call, counts[rank]);
    let mut recv = vec![POISON; total];
    let send = if in_place {
        recv[offset..offset + mine.len()].copy_from_slice(&mine);
        recv.as_ptr() as u64 + offset as u64
    } else {
        mine.as_ptr() as u64
    };
    // SAFETY: both buffers live until synchronize returns below.
    unsafe { allgather(comm, send, recv.as_mut_ptr() as u64, counts, stream) }.unwrap();
    comm.synchronize(stream).unwrap();
    let expected: Vec<u8> = (0..counts.len()).flat_map(|p| block(p, call, counts[p])).collect();
    assert!(
        recv == expected,
        "rank {rank}: call {call} ({counts:?}, in place {in_place}) gathered wrong bytes"
    );
}

#[test]
fn allgather_equal_uneven_and_in_place_across_processes() {
    in_processes(
        "allgather_equal_uneven_and_in_place_across_processes",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            let comm = join(rank, size, id, 20_000);
            assert_eq!((comm.rank(), comm.size(), comm.kind()), (rank, 3, BackendKind::Host));
            let stream = create_host_stream().unwrap();
            let cases: [&[usize]; 5] =
                [&[64, 64, 64], &[5, 0, 3_000_001], &[0, 0, 0], &[1, 1 << 20, 17], &[4096, 4096, 4096]];
            for (call, counts) in cases.iter().enumerate() {
                for in_place in [false, true] {
                    for s in [Stream::NULL, stream] {
                        gather_and_check(&comm, counts, call, in_place, s);
                    }
                }
            }
            // Host bytes of any length, as plan tables travel.
            let mine = block(rank, 99, 1000 * rank + 3);
            let all = comm.allgather_bytes(&mine).unwrap();
            for (p, bytes) in all.iter().enumerate() {
                assert_eq!(*bytes, block(p, 99, 1000 * p + 3), "rank {rank}: bytes of rank {p}");
            }
            destroy_host_stream(stream).unwrap();
        },
    );
}

#[test]
fn bad_allgather_arguments_fail_before_anything_moves() {
    in_processes(
        "bad_allgather_arguments_fail_before_anything_moves",
        BackendKind::Host,
        &[End::Done; 2],
        |rank, size, id| {
            let comm = join(rank, size, id, 20_000);
            let mut recv = [0u8; 8];
            let recv_at = recv.as_mut_ptr() as u64;
            let status = |send: u64, recv: u64, counts: &[usize]| {
                // SAFETY: every call below is refused before it touches memory.
                unsafe { allgather(&comm, send, recv, counts, Stream::NULL) }.unwrap_err().status
            };
            assert_eq!(status(recv_at, recv_at, &[4]), Status::InvalidArgument, "one count for two ranks");
            assert_eq!(status(0, recv_at, &[4, 4]), Status::NullArgument);
            assert_eq!(status(recv_at + 4, 0, &[4, 4]), Status::NullArgument);
            assert_eq!(status(recv_at + 1, recv_at, &[4, 4]), Status::Overlap, "send straddles two slots");
            assert_eq!(status(recv_at, recv_at, &[usize::MAX, 4]), Status::InvalidArgument);
            // The communicator still works afterwards.
            gather_and_check(&comm, &[3, 5], 1, false, Stream::NULL);
        },
    );
}

/// Rank 1 passes other counts than ranks 0 and 2 (uneven against uneven, equal against uneven, equal
/// against equal, nothing against something): every rank's call is refused with INVALID_ARGUMENT
/// naming rank 1, nothing moves, and the communicator stays usable: a correct allgather follows.
#[test]
fn ranks_that_pass_other_counts_are_refused_on_every_rank_naming_the_rank() {
    in_processes(
        "ranks_that_pass_other_counts_are_refused_on_every_rank_naming_the_rank",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            let comm = join(rank, size, id, 20_000);
            let cases: [(&[usize], &[usize]); 4] = [
                (&[4, 6, 2], &[4, 7, 2]),
                (&[4, 4, 4], &[4, 5, 4]),
                (&[4, 4, 4], &[5, 5, 5]),
                (&[0, 0, 0], &[0, 1, 0]),
            ];
            for (call, (most, odd)) in cases.into_iter().enumerate() {
                let counts = if rank == 1 { odd } else { most };
                let send = block(rank, call, counts[rank]);
                let mut recv = vec![POISON; counts.iter().sum::<usize>().max(1)];
                // SAFETY: buffers live until synchronize.
                unsafe {
                    allgather(&comm, send.as_ptr() as u64, recv.as_mut_ptr() as u64, counts, Stream::NULL)
                }
                .unwrap();
                let err = comm.synchronize(Stream::NULL).unwrap_err();
                assert_eq!(err.status, Status::InvalidArgument, "rank {rank}, case {call}: {err}");
                assert!(err.message.contains("counts: ranks [1] differ"), "rank {rank}, case {call}: {err}");
                assert!(recv.iter().all(|&b| b == POISON), "rank {rank}, case {call}: bytes moved");
                // Reported once; the communicator has not failed.
                comm.synchronize(Stream::NULL).unwrap();
                comm.check().unwrap();
                gather_and_check(&comm, &[3, 5, 2], 10 + call, false, Stream::NULL);
            }
            assert_eq!(comm.allgather_bytes(&[rank as u8]).unwrap(), vec![vec![0], vec![1], vec![2]]);
        },
    );
}

#[test]
fn a_rank_that_never_calls_times_out_every_other_rank() {
    in_processes(
        "a_rank_that_never_calls_times_out_every_other_rank",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            let comm = join(rank, size, id, 1_000);
            if rank == 2 {
                // Joins, then does not take part in the allgather; waits past the others' timeout.
                std::thread::sleep(Duration::from_millis(2_500));
                return;
            }
            let started = Instant::now();
            let err = comm.allgather_bytes(b"hello").unwrap_err();
            let waited = started.elapsed();
            assert!(matches!(err.status, Status::Timeout | Status::Aborted), "rank {rank}: {err}");
            assert!(waited < Duration::from_millis(2_000), "rank {rank} waited {waited:?}");
            assert_eq!(comm.check().unwrap_err().status, err.status, "the failure is kept");
        },
    );
}

#[test]
fn a_killed_process_fails_the_others_at_once() {
    let ends = [End::Done, End::Killed, End::Done];
    on_host("a_killed_process_fails_the_others_at_once", &ends, |rank, size, id| {
        // A long timeout: the others must not need it to notice the crash.
        let comm = join(rank, size, id, 60_000);
        if rank == 1 {
            // SAFETY: plain system calls; this process ends here.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let started = Instant::now();
        let mut recv = vec![0u8; 3 * 1024];
        let send = block(rank, 0, 1024);
        // SAFETY: buffers live until synchronize.
        unsafe { allgather(&comm, send.as_ptr() as u64, recv.as_mut_ptr() as u64, &[1024; 3], Stream::NULL) }
            .unwrap();
        let err = comm.synchronize(Stream::NULL).unwrap_err();
        assert_eq!(err.status, Status::Aborted, "rank {rank}: {err}");
        assert!(started.elapsed() < Duration::from_secs(10), "rank {rank} waited {:?}", started.elapsed());
    });
}

#[test]
fn an_abort_ends_the_peers_calls() {
    on_host("an_abort_ends_the_peers_calls", &[End::Done; 2], |rank, size, id| {
        let comm = join(rank, size, id, 60_000);
        if rank == 1 {
            comm.abort();
            comm.abort(); // harmless twice
            assert_eq!(comm.allgather_bytes(b"late").unwrap_err().status, Status::Aborted);
            return;
        }
        let started = Instant::now();
        let err = comm.allgather_bytes(b"waits").unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
    });
}

#[test]
fn ranks_created_with_other_sizes_are_refused() {
    in_processes(
        "ranks_created_with_other_sizes_are_refused",
        BackendKind::Host,
        &[End::Done; 2],
        |rank, _size, id| {
            let size = if rank == 0 { 2 } else { 3 };
            let err = Communicator::create(id, size, rank, 0, options(5_000)).err().unwrap();
            assert_eq!(err.status, Status::InvalidArgument, "rank {rank}: {err}");
            assert!(err.message.contains("nranks"), "{err}");
        },
    );
}

// --- communicator identity ----------------------------------------------------------------------

/// A file both sides of a test can see: `what` happened for the communicator `id`.
fn marker(id: &CommId, what: &str) -> std::path::PathBuf {
    let name: String = id.0[8..24].iter().map(|b| format!("{b:02x}")).collect();
    std::env::temp_dir().join(format!("refit-comm-test-{name}-{what}"))
}

fn wait_for(path: &std::path::Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(started.elapsed() < Duration::from_secs(60), "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Ranks 0 and 1 form a communicator; a third process then claims each of their ranks and is refused
/// with INVALID_ARGUMENT at once (not at its 30 s timeout): the id is spent; the communicator works
/// on. Once both have destroyed it, its id joins nothing: every rank, in the third process and in
/// theirs, is refused at once, the same way, also while they claim their own ranks again (a refused
/// join holds no rank's name).
#[test]
fn a_rank_claimed_after_the_communicator_formed_is_refused_at_once() {
    in_processes(
        "a_rank_claimed_after_the_communicator_formed_is_refused_at_once",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, _size, id| {
            let refused_at_once = |rank: usize| {
                let started = Instant::now();
                let err = Communicator::create(id, 2, rank, 0, options(30_000)).err().unwrap();
                assert_eq!(err.status, Status::InvalidArgument, "claiming rank {rank}: {err}");
                assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
                err
            };
            if rank == 2 {
                wait_for(&marker(id, "formed-0"));
                wait_for(&marker(id, "formed-1"));
                for claimed in [0, 1] {
                    let err = refused_at_once(claimed);
                    assert!(err.message.contains("the id is spent"), "{err}");
                }
                std::fs::write(marker(id, "claimed"), b"").unwrap();
                wait_for(&marker(id, "destroyed-0"));
                wait_for(&marker(id, "destroyed-1"));
                for claimed in [0, 1] {
                    let err = refused_at_once(claimed);
                    assert!(err.message.contains("the id is spent"), "{err}");
                }
                for what in ["formed-0", "formed-1", "claimed", "destroyed-0", "destroyed-1"] {
                    let _ = std::fs::remove_file(marker(id, what));
                }
                return;
            }
            let comm = join(rank, 2, id, 30_000);
            std::fs::write(marker(id, &format!("formed-{rank}")), b"").unwrap();
            wait_for(&marker(id, "claimed"));
            gather_and_check(&comm, &[7, 9], 0, false, Stream::NULL);
            drop(comm);
            std::fs::write(marker(id, &format!("destroyed-{rank}")), b"").unwrap();
            let err = refused_at_once(rank);
            assert!(err.message.contains("the id is spent"), "{err}");
        },
    );
}

/// Three processes start together as ranks 0, 1 and 1 of two, twenty times over (threads of one
/// process, which meet exactly as processes do; the third starts up to 16 ms later, so that it comes
/// while the communicator forms or just after): every time exactly one claimant of rank 1 is refused
/// with INVALID_ARGUMENT, at once, and the other two form the communicator. Likewise with rank 0
/// claimed twice.
#[test]
fn a_rank_claimed_twice_at_once_is_refused_every_time_and_the_others_form() {
    for round in 0..20 {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        let twice = round % 2;
        let claims = [0, 1, twice];
        let start = Arc::new(std::sync::Barrier::new(claims.len()));
        let joins: Vec<_> = claims
            .into_iter()
            .enumerate()
            .map(|(claim, rank)| {
                let start = Arc::clone(&start);
                let late = if claim == 2 {
                    Duration::from_millis(4 * (round as u64 / 2 % 5))
                } else {
                    Duration::ZERO
                };
                std::thread::spawn(move || {
                    start.wait();
                    std::thread::sleep(late);
                    let started = Instant::now();
                    let joined = Communicator::create(&id, 2, rank, 0, options(5_000));
                    let took = started.elapsed();
                    // Formed communicators take part in one allgather before they are dropped.
                    let checked =
                        joined.map(|comm| comm.allgather_bytes(&[rank as u8]).map(|all| all.concat()));
                    (rank, checked, took)
                })
            })
            .collect();
        let mut refused = 0;
        for (rank, checked, took) in joins.into_iter().map(|j| j.join().unwrap()) {
            match checked {
                Ok(gathered) => assert_eq!(gathered.unwrap(), vec![0, 1], "round {round}, rank {rank}"),
                Err(err) => {
                    assert_eq!(err.status, Status::InvalidArgument, "round {round}, rank {rank}: {err}");
                    assert_eq!(rank, twice, "round {round}: only a claimant of rank {twice} is refused");
                    assert!(took < Duration::from_secs(5), "round {round}: refused after {took:?}");
                    refused += 1;
                }
            }
        }
        assert_eq!(refused, 1, "round {round}");
    }
}

/// Every byte of an id matters: with any one byte changed (two ways), the id is refused with
/// INVALID_ARGUMENT at once, and the unchanged id still forms its communicator.
#[test]
fn an_id_with_any_byte_changed_is_refused() {
    let id = Communicator::unique_id(BackendKind::Host).unwrap();
    let started = Instant::now();
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
    assert!(started.elapsed() < Duration::from_secs(10), "refused without waiting: {:?}", started.elapsed());
    let comm = Communicator::create(&id, 1, 0, 0, options(10_000)).unwrap();
    assert_eq!(comm.size(), 1);
}

/// Rank `rank`'s table of a small refit: ranks 0 and 1 publish replicas of `w` (8 x 16, 4-byte
/// elements) and `b` (16), rank 2 receives `w`'s column halves into two buffers and all of `b`, rank
/// 0 receives `b`. Addresses are numbers only: planning reads no memory.
fn table_of(rank: u32) -> Table {
    let tensors = vec![
        TensorSpec { name: "w".into(), dtype: 1, elem_size: 4, shape: vec![8, 16] },
        TensorSpec { name: "b".into(), dtype: 1, elem_size: 4, shape: vec![16] },
    ];
    let region = |offset: Vec<u64>, extent: Vec<u64>| Region { offset, extent };
    let base = 0x10_0000 * (u64::from(rank) + 1);
    let mut table =
        Table { tensors, offers: vec![], needs: vec![], quant_needs: Vec::new(), shared_amax: Vec::new() };
    if rank < 2 {
        let owner = Endpoint { process: rank, device: 0 };
        table.offers.push(Offer {
            tensor: 0,
            owner,
            addr: base,
            region: region(vec![0, 0], vec![8, 16]),
            strides: None,
            digest: None,
        });
        table.offers.push(Offer {
            tensor: 1,
            owner,
            addr: base + 4096,
            region: region(vec![0], vec![16]),
            strides: None,
            digest: None,
        });
    }
    let receiver = Endpoint { process: rank, device: 0 };
    if rank == 2 {
        for half in 0..2u64 {
            table.needs.push(Need {
                tensor: 0,
                receiver,
                addr: base + half * 1024,
                region: region(vec![0, 8 * half], vec![8, 8]),
                perm: None,
                strides: vec![8, 1],
            });
        }
    }
    if rank == 2 || rank == 0 {
        table.needs.push(Need {
            tensor: 1,
            receiver,
            addr: base + 8192,
            region: region(vec![0], vec![16]),
            perm: None,
            strides: vec![1],
        });
    }
    table
}

/// The routes of `whole` that process `rank` takes part in (its share).
fn share_of(whole: &plan::Plan, rank: usize) -> Vec<plan::Route> {
    let rank = rank as u32;
    whole.routes().iter().filter(|r| r.src.process == rank || r.dst.process == rank).cloned().collect()
}

#[test]
fn plans_built_across_processes_are_shares_of_the_single_process_plan() {
    let test = "plans_built_across_processes_are_shares_of_the_single_process_plan";
    on_host(test, &[End::Done; 3], |rank, size, id| {
        let comm = join(rank, size, id, 20_000);
        let all: Vec<Table> = (0..3).map(table_of).collect();
        for policy in [OwnerPolicy::First, OwnerPolicy::Local, OwnerPolicy::Balanced] {
            let options = PlanOptions { policy, coalesce: true };
            let across = build_plan(&comm, &table_of(rank as u32), &options).unwrap();
            let whole = plan::build(&all, &options).unwrap();
            assert_eq!(across.routes(), share_of(&whole, rank), "rank {rank}, {policy:?}");
            assert_eq!(across.inputs_fingerprint(), whole.inputs_fingerprint(), "rank {rank}, {policy:?}");
            if rank == 2 {
                assert!(across.routes().iter().any(|r| r.src.process != 2), "rank 2 receives from others");
            }
        }
    });
}

#[test]
fn ranks_with_other_options_fail_on_every_rank_and_can_try_again() {
    in_processes(
        "ranks_with_other_options_fail_on_every_rank_and_can_try_again",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            let comm = join(rank, size, id, 20_000);
            let local = PlanOptions { policy: OwnerPolicy::Local, coalesce: true };
            let first = PlanOptions { policy: OwnerPolicy::First, coalesce: true };
            let mine = if rank == 2 { first.clone() } else { local.clone() };
            let err = build_plan(&comm, &table_of(rank as u32), &mine).unwrap_err();
            assert_eq!(err.status, Status::InvalidArgument, "rank {rank}: {err}");
            assert!(err.message.contains("ranks 0 and 2 have different plan options"), "rank {rank}: {err}");
            // A coverage gap in rank 2's needs: rank 2 reports it, the others that rank 2 failed.
            let mut table = table_of(rank as u32);
            if rank == 2 {
                table.tensors.push(TensorSpec {
                    name: "orphan".into(),
                    dtype: 1,
                    elem_size: 2,
                    shape: vec![4],
                });
                table.needs.push(Need {
                    tensor: 2,
                    receiver: Endpoint { process: 2, device: 0 },
                    addr: 0x9000_0000,
                    region: Region { offset: vec![0], extent: vec![4] },
                    perm: None,
                    strides: vec![1],
                });
            }
            let err = build_plan(&comm, &table, &local).unwrap_err();
            if rank == 2 {
                assert_eq!(err.status, Status::CoverageGap, "rank {rank}: {err}");
            } else {
                assert_eq!(err.status, Status::Aborted, "rank {rank}: {err}");
                assert!(
                    err.message.contains("rank 2 could not build the plan (REFIT_STATUS_COVERAGE_GAP"),
                    "{err}"
                );
            }
            // Rank 1's table names process 0 as the owner of an offer: every rank refuses it alike.
            let mut table = table_of(rank as u32);
            if rank == 1 {
                table.offers[0].owner.process = 0;
            }
            let err = build_plan(&comm, &table, &local).unwrap_err();
            assert_eq!(err.status, Status::InvalidArgument, "rank {rank}: {err}");
            assert!(err.message.contains("rank 1's table has an offer of tensor 'w' on process 0"), "{err}");
            // Agreement restored: the communicator is still usable.
            let plan = build_plan(&comm, &table_of(rank as u32), &local).unwrap();
            let whole = plan::build(&(0..3).map(table_of).collect::<Vec<_>>(), &local).unwrap();
            assert_eq!(plan.routes(), share_of(&whole, rank));
        },
    );
}

// --- a refit across processes through the transports between processes (host simulations) -------

const ROWS: u64 = 512;
const COLS: u64 = 384;

/// The value of element (i, j) of "w" and element j of "b": what every process expects, computed
/// without the plan.
fn w_value(i: u64, j: u64) -> u32 {
    (i * 1000 + j) as u32 ^ 0x5a5a_0000
}

fn b_value(j: u64) -> u32 {
    (j * 7 + 3) as u32 | 0x0100_0000
}

/// One process's memory and table: rank 0 publishes rows [0, 256) of "w" and needs columns [192, 384)
/// of rows [128, 384) (partly its own rows); rank 1 publishes rows [256, 512) and a replica of rows
/// [0, 256), and needs all of "b"; rank 2 publishes "b" and needs columns [0, 192) of every row.
struct Process {
    table: Table,
    /// Buffers this process owns (u32 elements), kept alive while the test runs.
    buffers: Vec<Vec<u32>>,
    /// (buffer index, expected content) for every need.
    expected: Vec<(usize, Vec<u32>)>,
}

fn process_of(rank: u32) -> Process {
    let tensors = vec![
        TensorSpec { name: "w".into(), dtype: 1, elem_size: 4, shape: vec![ROWS, COLS] },
        TensorSpec { name: "b".into(), dtype: 1, elem_size: 4, shape: vec![COLS] },
    ];
    let mut p = Process {
        table: Table {
            tensors,
            offers: vec![],
            needs: vec![],
            quant_needs: Vec::new(),
            shared_amax: Vec::new(),
        },
        buffers: vec![],
        expected: vec![],
    };
    let here = Endpoint { process: rank, device: 0 };
    let offer_rows = |p: &mut Process, rows: std::ops::Range<u64>| {
        let data: Vec<u32> = rows.clone().flat_map(|i| (0..COLS).map(move |j| w_value(i, j))).collect();
        p.buffers.push(data);
        let addr = p.buffers.last().unwrap().as_ptr() as u64;
        let region = Region { offset: vec![rows.start, 0], extent: vec![rows.end - rows.start, COLS] };
        p.table.offers.push(Offer { tensor: 0, owner: here, addr, region, strides: None, digest: None });
    };
    let need_box = |p: &mut Process, rows: std::ops::Range<u64>, cols: std::ops::Range<u64>| {
        let expected: Vec<u32> =
            rows.clone().flat_map(|i| cols.clone().map(move |j| w_value(i, j))).collect();
        p.buffers.push(vec![0xDEAD_BEEF; expected.len()]);
        p.expected.push((p.buffers.len() - 1, expected));
        let addr = p.buffers.last().unwrap().as_ptr() as u64;
        let width = cols.end - cols.start;
        let region =
            Region { offset: vec![rows.start, cols.start], extent: vec![rows.end - rows.start, width] };
        p.table.needs.push(Need {
            tensor: 0,
            receiver: here,
            addr,
            region,
            perm: None,
            strides: vec![width, 1],
        });
    };
    match rank {
        0 => {
            offer_rows(&mut p, 0..256);
            need_box(&mut p, 128..384, 192..384);
        }
        1 => {
            offer_rows(&mut p, 256..512);
            offer_rows(&mut p, 0..256);
            p.buffers.push(vec![0xDEAD_BEEF; COLS as usize]);
            p.expected.push((p.buffers.len() - 1, (0..COLS).map(b_value).collect()));
            let addr = p.buffers.last().unwrap().as_ptr() as u64;
            let region = Region { offset: vec![0], extent: vec![COLS] };
            p.table.needs.push(Need {
                tensor: 1,
                receiver: here,
                addr,
                region,
                perm: None,
                strides: vec![1],
            });
        }
        _ => {
            p.buffers.push((0..COLS).map(b_value).collect());
            let addr = p.buffers.last().unwrap().as_ptr() as u64;
            let region = Region { offset: vec![0], extent: vec![COLS] };
            p.table.offers.push(Offer { tensor: 1, owner: here, addr, region, strides: None, digest: None });
            need_box(&mut p, 0..512, 0..192);
        }
    }
    p
}

/// The flows of a share between this process and the others, and its routes within the process.
fn flows_of(share: &plan::Plan, rank: u32) -> (Vec<Flow>, Vec<Flow>, Vec<Segment>) {
    let (mut sends, mut recvs, mut local): (Vec<Flow>, Vec<Flow>, Vec<Segment>) = Default::default();
    let add = |flows: &mut Vec<Flow>, peer: u32, segments: &[Segment]| match flows
        .iter_mut()
        .find(|f| f.peer == peer as usize)
    {
        Some(flow) => flow.segments.extend_from_slice(segments),
        None => flows.push(Flow { peer: peer as usize, segments: segments.to_vec() }),
    };
    for route in share.routes() {
        match (route.src.process == rank, route.dst.process == rank) {
            (true, true) => local.extend_from_slice(&route.segments),
            (true, false) => add(&mut sends, route.dst.process, &route.segments),
            (false, true) => add(&mut recvs, route.src.process, &route.segments),
            (false, false) => panic!("a share holds a route between two other processes"),
        }
    }
    (sends, recvs, local)
}

/// Whether `segment` writes the byte at `addr`.
fn writes_byte(segment: &Segment, addr: u64) -> bool {
    let mut hit = false;
    segment.for_each_run(|_, dst, len| hit |= (dst..dst + len).contains(&addr));
    hit
}

fn check_received(p: &Process, rank: usize, how: &str) {
    for (buffer, expected) in &p.expected {
        assert!(p.buffers[*buffer] == *expected, "rank {rank} ({how}): a need received wrong bytes");
    }
}

/// Plans across the processes, then moves the remote routes through staging over the communicator
/// (the NCCL route's simulation) with a small staging budget (several chunks per flow, each staging
/// slot reused), runs the local routes, and checks every need against values computed without the
/// plan; twice, so that a prepared exchange runs again. Wire bytes equal the plan's remote bytes.
#[test]
fn a_refit_across_processes_through_staging_is_byte_exact() {
    in_processes(
        "a_refit_across_processes_through_staging_is_byte_exact",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            let comm = join(rank, size, id, 30_000);
            let mut p = process_of(rank as u32);
            let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
            let (sends, recvs, local) = flows_of(&share, rank as u32);
            let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(1).unwrap());
            let exchange =
                StagedExchange::prepare(&comm, Arc::clone(&backend), 0, &sends, &recvs, 512 << 10).unwrap();
            let stats = exchange.stats();
            assert_eq!(
                stats.bytes_received,
                share.stats().bytes_remote,
                "rank {rank}: wire bytes are the plan's"
            );
            assert!(stats.staging_bytes <= 512 << 10, "rank {rank}: staging {}", stats.staging_bytes);
            if rank == 2 {
                assert!(stats.steps >= 3, "rank 2 reuses each staging slot: {stats:?}");
            }
            let stream = create_host_stream().unwrap();
            for run in 0..2 {
                for (buffer, _) in &p.expected {
                    p.buffers[*buffer].fill(0xDEAD_BEEF);
                }
                // No peer writes before this rank poisoned.
                comm.allgather_bytes(b"poisoned").unwrap();
                // SAFETY: every buffer lives until synchronize returns.
                unsafe {
                    exchange.run(&comm, stream).unwrap();
                    backend.copy_segments(0, stream, &local).unwrap();
                }
                comm.synchronize(stream).unwrap();
                check_received(&p, rank, &format!("staged run {run}"));
            }
            comm.allgather_bytes(b"done").unwrap(); // every peer has sent everything it reads from us
            destroy_host_stream(stream).unwrap();
            drop(exchange);
        },
    );
}

/// The same refit with the remote routes written straight into the receivers' memory (the IPC
/// route's simulation): receivers share their need buffers with their writers (`ipc::connect`),
/// writers open them and write; every rank learns which pairs use IPC.
#[test]
fn a_refit_across_processes_through_ipc_is_byte_exact() {
    in_processes(
        "a_refit_across_processes_through_ipc_is_byte_exact",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            let comm = join(rank, size, id, 30_000);
            let p = process_of(rank as u32);
            let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
            let (sends, recvs, local) = flows_of(&share, rank as u32);
            let ranges: Vec<(u64, u64)> = p
                .expected
                .iter()
                .map(|(b, _)| (p.buffers[*b].as_ptr() as u64, 4 * p.buffers[*b].len() as u64))
                .collect();
            let writers: Vec<usize> = recvs.iter().map(|f| f.peer).collect();
            let owners: Vec<usize> = sends.iter().map(|f| f.peer).collect();
            let peers = ipc::connect(&comm, BackendKind::Host, 0, &ranges, &writers, &owners).unwrap();
            if peers.opened.is_empty() && peers.writers.is_empty() {
                // A kernel that forbids cross-process access: every pair falls back to staging.
                println!("rank {rank}: IPC unavailable here; not checked");
                return;
            }
            assert_eq!(
                peers.opened.keys().copied().collect::<HashSet<_>>(),
                owners.iter().copied().collect()
            );
            assert_eq!(
                peers.writers,
                writers.iter().copied().collect(),
                "rank {rank} knows who writes into it"
            );
            let stream = create_host_stream().unwrap();
            let mut checks = Vec::new();
            for flow in &sends {
                let writes = peers.opened[&flow.peer].prepare_writes(&flow.segments, true).unwrap();
                checks.push(writes.verify_destinations().unwrap());
                // SAFETY: the sources live until the launch returns (host writes complete on return).
                unsafe { writes.launch(stream) }.unwrap();
            }
            // SAFETY: local buffers live until the stream is synchronized below.
            unsafe { HostBackend::new(1).unwrap().copy_segments(0, stream, &local).unwrap() };
            let verify = |checks: &[Box<dyn refit::transport::PreparedCheck>]| -> Vec<Option<usize>> {
                for check in checks {
                    // SAFETY: the sources live until the stream is synchronized below.
                    unsafe { check.launch(stream) }.unwrap();
                }
                refit::transport::host::host_stream(stream).unwrap().synchronize().unwrap();
                checks.iter().map(|c| c.outcome().unwrap()).collect()
            };
            assert!(verify(&checks).iter().all(Option::is_none), "rank {rank}: its writes verify");
            comm.allgather_bytes(b"written").unwrap(); // every writer is done
            check_received(&p, rank, "ipc");
            // A receiver's byte changed after the writes: the writer's verify finds the segment that
            // wrote it (every rank changes the first byte of its first need and says where).
            let mut p = p;
            let (buffer, _) = p.expected[0];
            p.buffers[buffer][0] ^= 1;
            let changed = comm.allgather_bytes(&(p.buffers[buffer].as_ptr() as u64).to_le_bytes()).unwrap();
            for (flow, found) in sends.iter().zip(verify(&checks)) {
                let at = u64::from_le_bytes(changed[flow.peer].as_slice().try_into().unwrap());
                let expected = flow.segments.iter().position(|s| writes_byte(s, at));
                assert_eq!(found, expected, "rank {rank}: verify of its writes into rank {}", flow.peer);
            }
            comm.allgather_bytes(b"verified").unwrap();
            destroy_host_stream(stream).unwrap();
            // A write outside what the owner shared is refused before anything moves.
            if let Some(flow) = sends.first() {
                let stray = Segment { dst: 8, ..flow.segments[0] };
                let err = peers.opened[&flow.peer].prepare_writes(&[stray], false).err().unwrap();
                assert_eq!(err.status, Status::NotFound, "{err}");
            }
        },
    );
}

/// A process killed between preparing and running an exchange: the others' runs fail with ABORTED,
/// well within the timeout.
#[test]
fn a_process_killed_mid_refit_fails_the_others() {
    let ends = [End::Done, End::Killed, End::Done];
    in_processes(
        "a_process_killed_mid_refit_fails_the_others",
        BackendKind::Host,
        &ends,
        |rank, size, id| {
            let comm = join(rank, size, id, 60_000);
            let p = process_of(rank as u32);
            let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
            let (sends, recvs, _) = flows_of(&share, rank as u32);
            let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(1).unwrap());
            let exchange = StagedExchange::prepare(&comm, backend, 0, &sends, &recvs, 1 << 20).unwrap();
            if rank == 1 {
                // SAFETY: plain system calls; this process ends here.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            let started = Instant::now();
            let stream = create_host_stream().unwrap();
            // SAFETY: buffers live until synchronize returns.
            let queued = unsafe { exchange.run(&comm, stream) };
            let err = queued.and_then(|()| comm.synchronize(stream)).unwrap_err();
            assert_eq!(err.status, Status::Aborted, "rank {rank}: {err}");
            assert!(started.elapsed() < Duration::from_secs(10));
            drop(exchange);
            destroy_host_stream(stream).unwrap();
        },
    );
}

/// The ranks on one machine find each other and pass file descriptors (how VMM memory is shared):
/// rank 0 passes a memfd holding a message to rank 2, which reads it.
#[test]
fn descriptors_pass_between_processes_on_one_machine() {
    in_processes(
        "descriptors_pass_between_processes_on_one_machine",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| {
            use std::io::{Read, Seek, SeekFrom, Write};
            use std::os::fd::{AsRawFd, FromRawFd};
            let comm = join(rank, size, id, 20_000);
            let node = comm.node_mesh().unwrap();
            assert_eq!(node.ranks(), &[0, 1, 2]);
            assert!(Arc::ptr_eq(&node, &comm.node_mesh().unwrap()), "made once");
            let timeout = Duration::from_secs(20);
            if rank == 0 {
                // SAFETY: memfd_create with a valid name; the descriptor is owned by the File.
                let mut file =
                    unsafe { std::fs::File::from_raw_fd(libc::memfd_create(c"refit-test".as_ptr(), 0)) };
                file.write_all(b"from rank 0").unwrap();
                node.send_fds(2, &[file.as_raw_fd()], timeout).unwrap();
            }
            if rank == 2 {
                let fds = node.recv_fds(0, timeout).unwrap();
                let mut file = std::fs::File::from(fds.into_iter().next().unwrap());
                file.seek(SeekFrom::Start(0)).unwrap();
                let mut text = String::new();
                file.read_to_string(&mut text).unwrap();
                assert_eq!(text, "from rank 0");
            }
            assert_eq!(node.send_fds(5, &[], timeout).unwrap_err().status, Status::InvalidArgument);
            comm.allgather_bytes(b"done").unwrap();
        },
    );
}

// --- the executor across processes (C ABI's refit_executor_create_across) --------------------------

/// A host-backend group of one device (device 0) and a communicator with IPC on or off.
fn executor_setup(rank: usize, size: usize, id: &CommId, ipc: bool) -> (Group, Arc<Communicator>) {
    let group = Group::new(&[0], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap();
    let options = CommOptions { timeout: Duration::from_secs(30), ipc, ..CommOptions::default() };
    (group, Arc::new(Communicator::create(id, size, rank, 0, options).unwrap()))
}

fn poison_needs(p: &mut Process) {
    for (buffer, _) in &p.expected {
        p.buffers[*buffer].fill(0xDEAD_BEEF);
    }
}

/// Every need still holds the poison.
fn untouched(p: &Process) -> bool {
    p.expected.iter().all(|(b, _)| p.buffers[*b].iter().all(|&v| v == 0xDEAD_BEEF))
}

/// One refit across three processes through the executor, for every (way, commit, verify): byte
/// exact against values computed without the plan, twice (descriptors reused), the route choice
/// and the bytes each way in the stats; staged, nothing is live before the commit.
fn executor_refit(rank: usize, size: usize, id: &CommId, ipc: bool) {
    let (group, comm) = executor_setup(rank, size, id, ipc);
    let mut p = process_of(rank as u32);
    let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
    for (commit, verify) in
        [(CommitMode::Direct, false), (CommitMode::Staged, true), (CommitMode::Direct, true)]
    {
        let options = ExecOptions { commit, verify, ..ExecOptions::default() };
        let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
        for step in 0..2 {
            poison_needs(&mut p);
            // No peer writes before this rank poisoned.
            comm.allgather_bytes(b"poisoned").unwrap();
            // SAFETY: every buffer of the plan lives until the run (outside a scope) returns.
            let stats = unsafe { executor.run(&group) }.unwrap();
            let how = format!("ipc {ipc}, {commit:?}, verify {verify}, step {step}");
            if commit == CommitMode::Staged {
                comm.allgather_bytes(b"staged").unwrap(); // every peer has staged its step
                assert!(untouched(&p), "rank {rank} ({how}): live bytes changed before the commit");
                // SAFETY: as above.
                unsafe { executor.commit(&group) }.unwrap();
            }
            comm.allgather_bytes(b"installed").unwrap(); // every peer is done writing into us
            check_received(&p, rank, &how);
            let remote = RouteKind::Remote as usize;
            assert_eq!(stats.remote_received_bytes, share.stats().bytes_remote, "rank {rank} ({how})");
            assert_eq!(stats.remote_ipc_bytes + stats.remote_wire_bytes, stats.bytes[remote], "rank {rank}");
            if ipc {
                assert_eq!(stats.remote_wire_bytes, 0, "rank {rank} ({how}): every pair shares a machine");
            } else {
                assert_eq!(stats.remote_ipc_bytes, 0, "rank {rank} ({how}): IPC is off");
            }
            assert_eq!(
                stats.remote_ipc_peers > 0,
                ipc && stats.bytes[remote] + stats.remote_received_bytes > 0
            );
        }
        assert_eq!(executor.rebind(0, 4096, 8192, 16).unwrap_err().status, Status::Unsupported);
        comm.allgather_bytes(b"next").unwrap();
    }
}

#[test]
fn an_executor_across_processes_through_ipc_is_byte_exact() {
    on_host("an_executor_across_processes_through_ipc_is_byte_exact", &[End::Done; 3], |rank, size, id| {
        executor_refit(rank, size, id, true)
    });
}

#[test]
fn an_executor_across_processes_through_staging_is_byte_exact() {
    on_host(
        "an_executor_across_processes_through_staging_is_byte_exact",
        &[End::Done; 3],
        |rank, size, id| executor_refit(rank, size, id, false),
    );
}

/// Through staging with verify: the first byte rank 0 receives from another process, changed after
/// it landed and before the check (a one-shot hook), fails rank 0's run with VERIFY_MISMATCH naming
/// the sender; the other ranks' runs succeed, and the next run, unchanged, verifies clean everywhere.
fn corrupted_through_staging(rank: usize, size: usize, id: &CommId) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (group, comm) = executor_setup(rank, size, id, false);
    let mut p = process_of(rank as u32);
    let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
    let received = share.routes().iter().find(|r| r.dst.process == 0 && r.src.process != 0);
    let (sender, address) = received.map_or((0, 0), |r| (r.src.process, r.segments[0].dst));
    let fired = Arc::new(AtomicBool::new(rank != 0));
    let hook: refit::exec::Hook = Arc::new(move |stage, group: &Group| {
        if stage == (Stage::Verify { slice: 0 }) && !fired.swap(true, Ordering::SeqCst) {
            let stream = refit::transport::host::host_stream(group.stream(0)?)?;
            // SAFETY: a byte of this process's receiving buffer, alive for the whole test.
            stream.enqueue(move || unsafe { *(address as usize as *mut u8) ^= 0x20 })?;
        }
        Ok(())
    });
    let options = ExecOptions { verify: true, hook: Some(hook), ..ExecOptions::default() };
    let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
    for step in 0..2 {
        poison_needs(&mut p);
        comm.allgather_bytes(b"poisoned").unwrap();
        // SAFETY: every buffer of the plan lives until the run (outside a scope) returns.
        let ran = unsafe { executor.run(&group) };
        comm.allgather_bytes(b"ran").unwrap();
        if rank == 0 && step == 0 {
            assert_ne!(address, 0, "rank 0 receives bytes from another process");
            let err = ran.unwrap_err();
            assert_eq!(err.status, Status::VerifyMismatch, "{}", err.message);
            let from = format!("received from process {sender}");
            assert!(err.message.contains(&from) && err.message.contains("staging"), "{}", err.message);
        } else {
            let stats = ran.unwrap_or_else(|e| panic!("rank {rank} step {step}: {e}"));
            assert!(stats.verified, "rank {rank}");
            assert_eq!(stats.remote_ipc_bytes, 0, "rank {rank}: IPC is off");
            check_received(&p, rank, "verified through staging");
        }
    }
}

#[test]
fn a_byte_changed_after_staging_fails_the_receivers_verify() {
    let test = "a_byte_changed_after_staging_fails_the_receivers_verify";
    on_host(test, &[End::Done; 3], corrupted_through_staging);
}

/// Through staging, processes that ask for verify differently: every rank's create fails with
/// INVALID_ARGUMENT naming them (none would otherwise learn of it before a receiver's run), and
/// executors made again alike verify and install every byte.
fn verify_asked_differently(rank: usize, size: usize, id: &CommId) {
    let (group, comm) = executor_setup(rank, size, id, false);
    let mut p = process_of(rank as u32);
    let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
    let options = ExecOptions { verify: rank != 0, ..ExecOptions::default() };
    let Err(err) = Executor::new_across(&group, &share, Arc::clone(&comm), options) else {
        panic!("rank {rank}: an executor although the processes ask for verify differently");
    };
    assert_eq!(err.status, Status::InvalidArgument, "rank {rank}: {err}");
    assert!(err.message.contains("verify on in processes 1, 2 and off in processes 0"), "{}", err.message);
    let options = ExecOptions { verify: true, ..ExecOptions::default() };
    let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
    poison_needs(&mut p);
    comm.allgather_bytes(b"poisoned").unwrap();
    // SAFETY: every buffer of the plan lives until the run (outside a scope) returns.
    let stats = unsafe { executor.run(&group) }.unwrap();
    comm.allgather_bytes(b"ran").unwrap();
    assert!(stats.verified, "rank {rank}");
    check_received(&p, rank, "verified through staging, made again alike");
}

#[test]
fn processes_that_ask_for_verify_differently_fail_at_create_on_every_rank() {
    let test = "processes_that_ask_for_verify_differently_fail_at_create_on_every_rank";
    on_host(test, &[End::Done; 3], verify_asked_differently);
}

/// A process killed after the executors were made: the others' runs fail within the timeout, their
/// commits are refused, and with all-or-nothing commit their live weights are unchanged; through
/// IPC (the meeting before the writes fails) and through staging (the exchange fails).
fn killed_mid_refit(rank: usize, size: usize, id: &CommId, ipc: bool) {
    let (group, comm) = executor_setup(rank, size, id, ipc);
    let mut p = process_of(rank as u32);
    let share = build_plan(&comm, &p.table, &PlanOptions::default()).unwrap();
    let options = ExecOptions { commit: CommitMode::Staged, ..ExecOptions::default() };
    let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
    poison_needs(&mut p);
    comm.allgather_bytes(b"ready").unwrap();
    if rank == 1 {
        // SAFETY: plain system calls; this process ends here.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let started = Instant::now();
    // SAFETY: every buffer of the plan lives until the calls return.
    let ran = unsafe { executor.run(&group) };
    let committed = ran.clone().and_then(|_| unsafe { executor.commit(&group) });
    let err = committed.unwrap_err();
    assert!(matches!(err.status, Status::Aborted | Status::InvalidState), "rank {rank}: {err}");
    assert!(started.elapsed() < Duration::from_secs(20), "rank {rank} waited {:?}", started.elapsed());
    // SAFETY: as above.
    let again = unsafe { executor.commit(&group) }.unwrap_err();
    assert_eq!(again.status, Status::InvalidState, "rank {rank}: nothing to commit after a failure");
    assert!(untouched(&p), "rank {rank}: live weights changed although the step failed");
}

#[test]
fn a_process_killed_mid_refit_leaves_committed_weights_unchanged() {
    let ends = [End::Done, End::Killed, End::Done];
    on_host("a_process_killed_mid_refit_leaves_committed_weights_unchanged", &ends, |rank, size, id| {
        killed_mid_refit(rank, size, id, false)
    });
}

#[test]
fn a_process_killed_mid_refit_through_ipc_leaves_committed_weights_unchanged() {
    let ends = [End::Done, End::Killed, End::Done];
    let test = "a_process_killed_mid_refit_through_ipc_leaves_committed_weights_unchanged";
    on_host(test, &ends, |rank, size, id| killed_mid_refit(rank, size, id, true));
}
