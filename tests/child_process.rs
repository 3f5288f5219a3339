//! Behaviour that can only be watched from outside a process: calls under an address-space limit
//! (`RLIMIT_AS`), which must return a status instead of aborting, and calls made while a thread
//! exits. Each test runs its body in a child process (this test binary run again, filtered to the
//! one test), so an abort fails that test alone.

use refit::ffi::allgather::refit_allgather;
use refit::ffi::copy::{refit_copy_batch, REFIT_COPY_CHECKED};
use refit::ffi::group::{
    refit_group, refit_group_create, refit_group_destroy, refit_group_options, refit_group_options_init,
    refit_group_size, REFIT_BACKEND_HOST,
};
use refit::ffi::status::refit_last_error_message;
use refit::{Segment, Status};
use std::ffi::{c_void, CStr};
use std::process::Command;

const CHILD: &str = "REFIT_TEST_CHILD";

/// Runs `body` in a child process: this binary again, with only the test `name`, which calls
/// `in_child` once more and, seeing CHILD set, runs the body. The parent checks that the child
/// exited successfully and finished the body.
fn in_child(name: &str, body: impl FnOnce()) {
    let finished = format!("child finished: {name}");
    if std::env::var_os(CHILD).is_some() {
        body();
        println!("{finished}");
        return;
    }
    let output = Command::new(std::env::current_exe().expect("test binary path"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains(&finished),
        "child running {name} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
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

static KEY_DESTRUCTOR_STATUS: std::sync::Mutex<Option<(Status, String)>> = std::sync::Mutex::new(None);

extern "C" fn calls_refit_at_thread_exit(_value: *mut c_void) {
    let mut size = 0usize;
    let status = refit_group_size(std::ptr::null(), &mut size);
    let message = last_error();
    *KEY_DESTRUCTOR_STATUS.lock().unwrap_or_else(|p| p.into_inner()) = Some((status, message));
}

#[test]
fn a_threads_first_refit_call_from_its_key_destructor() {
    in_child("a_threads_first_refit_call_from_its_key_destructor", || {
        // cpp_tests/test_teardown.c covers a thread that failed a call before it exits; here the key
        // destructor makes the thread's first call, after its Rust thread-locals were destroyed.
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: plain pthread calls with a destructor that lives as long as the process.
        assert_eq!(unsafe { libc::pthread_key_create(&mut key, Some(calls_refit_at_thread_exit)) }, 0);
        std::thread::spawn(move || {
            // SAFETY: any non-NULL value makes the destructor run at this thread's exit.
            assert_eq!(unsafe { libc::pthread_setspecific(key, std::ptr::dangling::<c_void>()) }, 0);
        })
        .join()
        .unwrap();
        let seen = KEY_DESTRUCTOR_STATUS.lock().unwrap().clone();
        let (status, message) = seen.expect("the key destructor ran");
        assert_eq!(status, Status::NullArgument);
        assert!(message.contains("group is NULL") || message == "REFIT_STATUS_NULL_ARGUMENT", "{message}");
    });
}
