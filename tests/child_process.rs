//! Behaviour that can only be watched from outside a process: calls under an address-space limit
//! (`RLIMIT_AS`), which must return a status instead of aborting, and calls made while a thread
//! exits. Each test runs its body in a child process (this test binary run again, filtered to the
//! one test), so an abort fails that test alone.

use refit::ffi::allgather::{refit_allgather, refit_group_allgather_rank, REFIT_ALLGATHER_AUTO};
use refit::ffi::copy::{refit_copy_batch, REFIT_COPY_CHECKED};
use refit::ffi::group::{
    refit_group, refit_group_create, refit_group_destroy, refit_group_enter, refit_group_exit,
    refit_group_options, refit_group_options_init, refit_group_run, refit_group_size,
    refit_host_stream_create, refit_host_stream_destroy, REFIT_BACKEND_HOST, REFIT_EXIT_ASYNC,
};
use refit::ffi::status::refit_last_error_message;
use refit::{Segment, Status};
use std::ffi::{c_void, CStr};
use std::process::Command;

const CHILD: &str = "REFIT_TEST_CHILD";

/// Runs this binary again with only the test `name` and CHILD set; returns its stdout after checking
/// that it exited successfully.
fn run_child(name: &str) -> String {
    let output = Command::new(std::env::current_exe().expect("test binary path"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "child running {name} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Runs `body` in a child process: the test `name` runs again there, calls `in_child` once more and,
/// seeing CHILD set, runs the body. The parent checks that the child finished the body.
fn in_child(name: &str, body: impl FnOnce()) {
    let finished = format!("child finished: {name}");
    if std::env::var_os(CHILD).is_some() {
        body();
        println!("{finished}");
        return;
    }
    let stdout = run_child(name);
    assert!(stdout.contains(&finished), "child running {name} did not finish:\n{stdout}");
}

/// This process's address space now, in bytes (VmSize).
fn address_space_in_use() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmSize:")).expect("a VmSize line");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmSize in kB");
    kib * 1024
}

/// Lets this process map at most `headroom` bytes more than it has mapped now.
fn limit_address_space(headroom: u64) {
    let limit = address_space_in_use() + headroom;
    let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
    // SAFETY: plain system call on a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) }, 0, "setrlimit(RLIMIT_AS)");
}

const MIB: usize = 1 << 20;

fn host_group(devices: usize) -> *mut refit_group {
    let mut options = std::mem::MaybeUninit::<refit_group_options>::uninit();
    assert_eq!(refit_group_options_init(options.as_mut_ptr()), Status::Success);
    // SAFETY: initialized by the call above.
    let mut options = unsafe { options.assume_init() };
    options.backend = REFIT_BACKEND_HOST;
    let ordinals: Vec<i32> = (0..devices as i32).collect();
    let mut group = std::ptr::null_mut();
    assert_eq!(refit_group_create(ordinals.as_ptr(), devices, &options, &mut group), Status::Success);
    group
}

fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated string.
    unsafe { CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned()
}

/// Bytes 0..len of a pattern that differs between `seed`s.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ (i >> 8) as u8)).collect()
}

#[test]
fn checked_copy_of_interleaved_segments_within_an_address_limit() {
    in_child("checked_copy_of_interleaved_segments_within_an_address_limit", || {
        // The report's batch at half its size: two segments of 2^24 one-byte runs writing alternate
        // bytes. Checking it used to reserve 24 bytes per run (768 MiB here); 256 MiB of headroom
        // must be plenty.
        const RUNS: usize = 1 << 24;
        let group = host_group(1);
        let (even, odd) = (pattern(1, RUNS), pattern(2, RUNS));
        let mut dst = vec![0u8; 2 * RUNS];
        let base = dst.as_mut_ptr() as u64;
        let segment = |src: &[u8], dst: u64| Segment {
            src: src.as_ptr() as u64,
            dst,
            len: 1,
            count: [RUNS as u64, 1],
            src_stride: [1, 0],
            dst_stride: [2, 0],
        };
        let segments = [segment(&even, base), segment(&odd, base + 1)];
        limit_address_space(256 * MIB as u64);
        let status =
            refit_copy_batch(group, 0, std::ptr::null_mut(), segments.as_ptr(), 2, REFIT_COPY_CHECKED);
        assert_eq!(status, Status::Success, "{}", last_error());
        let interleaved =
            dst.chunks_exact(2).zip(even.iter().zip(&odd)).all(|(pair, (e, o))| pair == [*e, *o]);
        assert!(interleaved, "the copy did not interleave the two sources");
        refit_group_destroy(group);
    });
}

#[test]
fn host_allgather_of_a_block_larger_than_the_memory_left() {
    in_child("host_allgather_of_a_block_larger_than_the_memory_left", || {
        // The Host algorithm used to stage a whole block in one buffer of its size.
        const BLOCK: usize = 96 * MIB;
        let group = host_group(1);
        let send = pattern(3, BLOCK);
        let mut recv = vec![0u8; BLOCK];
        let (send_ptr, recv_ptr) = (send.as_ptr() as u64, recv.as_mut_ptr() as u64);
        let counts = [BLOCK];
        let mut picked = u32::MAX;
        limit_address_space(32 * MIB as u64);
        let host = refit::allgather::Algorithm::Host.code();
        let status = refit_allgather(group, &send_ptr, &recv_ptr, counts.as_ptr(), host, &mut picked);
        assert_eq!(status, Status::Success, "{}", last_error());
        assert_eq!(picked, host);
        assert!(recv == send, "the received block differs from the one sent");
        refit_group_destroy(group);
    });
}

#[test]
fn a_batch_larger_than_the_memory_left_is_out_of_memory() {
    in_child("a_batch_larger_than_the_memory_left_is_out_of_memory", || {
        // One million one-byte segments (72 MiB of descriptors): the host backend keeps a copy of the
        // list until the queued copy has run, which does not fit in the 16 MiB left.
        const SEGMENTS: usize = 1 << 20;
        let group = host_group(1);
        let src = pattern(4, SEGMENTS);
        let mut dst = vec![0u8; SEGMENTS];
        let base = dst.as_mut_ptr() as u64;
        let segments: Vec<Segment> = (0..SEGMENTS)
            .map(|i| Segment::contiguous(src.as_ptr() as u64 + i as u64, base + i as u64, 1))
            .collect();
        limit_address_space(16 * MIB as u64);
        let status = refit_copy_batch(group, 0, std::ptr::null_mut(), segments.as_ptr(), SEGMENTS, 0);
        assert_eq!(status, Status::OutOfMemory, "{}", last_error());
        assert!(last_error().contains("cannot allocate"), "{}", last_error());
        assert!(dst.iter().all(|&b| b == 0), "a failed call copied bytes");
        // The group still works for a batch that fits.
        let status = refit_copy_batch(group, 0, std::ptr::null_mut(), segments.as_ptr(), 1000, 0);
        assert_eq!(status, Status::Success, "{}", last_error());
        assert_eq!(dst[..1000], src[..1000]);
        refit_group_destroy(group);
    });
}

/// Each rank of a two-rank group gathers one byte from every rank.
struct Gather {
    group: *mut refit_group,
    send: [u8; 2],
    recv: [[u8; 2]; 2],
}

unsafe extern "C" fn gather_rank(rank: u32, _stream: *mut c_void, user_data: *mut c_void) -> i32 {
    // SAFETY: run with a live Gather; each rank writes only its own receive buffer.
    let gather = unsafe { &mut *(user_data as *mut Gather) };
    let (send, recv) = (&gather.send[rank as usize] as *const u8, gather.recv[rank as usize].as_mut_ptr());
    let mut picked = 0;
    let counts = [1usize, 1];
    let status = refit_group_allgather_rank(
        gather.group,
        rank,
        send as u64,
        recv as u64,
        counts.as_ptr(),
        REFIT_ALLGATHER_AUTO,
        &mut picked,
    );
    status as i32
}

/// A host group's whole life: a failing call, creation (its threads start), a per-rank allgather, a
/// scope ordered after a caller stream, release. The first step that goes wrong, if any.
fn group_life() -> Result<(), &'static str> {
    let mut size = 0usize;
    if refit_group_size(std::ptr::null(), &mut size) != Status::NullArgument {
        return Err("a NULL group was not NULL_ARGUMENT");
    }
    if last_error().is_empty() {
        return Err("no message after a failing call");
    }
    let group = host_group(2);
    let mut gather = Gather { group, send: [0x11, 0x22], recv: [[0; 2]; 2] };
    if refit_group_run(group, Some(gather_rank), &mut gather as *mut Gather as *mut c_void) != Status::Success
    {
        return Err("refit_group_run failed");
    }
    if gather.recv != [[0x11, 0x22]; 2] {
        return Err("the allgather delivered wrong bytes");
    }
    let mut callers = [std::ptr::null_mut(); 2];
    let ordered = refit_host_stream_create(&mut callers[0]) == Status::Success
        && refit_group_enter(group, callers.as_ptr()) == Status::Success
        && refit_group_exit(group, REFIT_EXIT_ASYNC) == Status::Success
        && refit_host_stream_destroy(callers[0]) == Status::Success;
    if !ordered {
        return Err("a scope with a caller stream failed");
    }
    refit_group_destroy(group);
    Ok(())
}

/// Runs `group_life` where nothing may panic (a thread-exit destructor, an atexit handler): reports
/// with raw writes, ends the process with `code` on failure.
fn group_life_or_exit(place: &str, code: i32) {
    let line = match group_life() {
        Ok(()) => format!("group life survived in {place}\n"),
        Err(step) => format!("{place}: {step}\n"),
    };
    // SAFETY: writes a valid buffer to the standard streams, which outlive every Rust object.
    unsafe {
        libc::write(1, line.as_ptr().cast(), line.len());
        if !line.starts_with("group life survived") {
            libc::_exit(code);
        }
    }
}

/// Where a thread's key destructor runs: the thread made a failing call before it exited, or the
/// destructor makes its first refit call (its storage is then made after the thread's other
/// thread-locals were destroyed).
static AFTER_A_FAILURE: &str = "a key destructor after a failing call";
static FIRST_CALL: &str = "a key destructor making the first call";

extern "C" fn group_life_at_thread_exit(place: *mut c_void) {
    // SAFETY: the test sets the key to one of the two statics above.
    group_life_or_exit(unsafe { *(place as *const &str) }, 20);
}

extern "C" fn group_life_at_exit() {
    group_life_or_exit("an atexit handler", 21);
}

#[test]
fn a_group_lives_and_dies_in_exit_handlers() {
    let name = "a_group_lives_and_dies_in_exit_handlers";
    if std::env::var_os(CHILD).is_some() {
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: plain libc calls with handlers that live as long as the process.
        unsafe {
            assert_eq!(libc::pthread_key_create(&mut key, Some(group_life_at_thread_exit)), 0);
            assert_eq!(libc::atexit(group_life_at_exit), 0);
        }
        for place in [&AFTER_A_FAILURE, &FIRST_CALL] {
            let place = place as *const &str as usize;
            std::thread::spawn(move || {
                if place == &AFTER_A_FAILURE as *const &str as usize {
                    let mut size = 0usize;
                    assert_eq!(refit_group_size(std::ptr::null(), &mut size), Status::NullArgument);
                }
                // SAFETY: the destructor runs at this thread's exit with this non-NULL value.
                assert_eq!(unsafe { libc::pthread_setspecific(key, place as *const c_void) }, 0);
            })
            .join()
            .unwrap();
        }
        return;
    }
    let stdout = run_child(name);
    for place in [AFTER_A_FAILURE, FIRST_CALL, "an atexit handler"] {
        assert!(stdout.contains(&format!("group life survived in {place}")), "in {place}:\n{stdout}");
    }
}
