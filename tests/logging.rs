//! The log callback's promises (`refit_set_log_callback`): a replaced callback is never entered once
//! the call returns, sink and level change together, and a callback may call refit without
//! recursing. The sink is process-wide, so the tests here take turns.

use refit::ffi::group::refit_group_size;
use refit::ffi::status::{refit_last_error_message, refit_set_log_callback};
use refit::Status;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

static TURN: Mutex<()> = Mutex::new(());

fn take_turn() -> MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

const DEBUG: u32 = 4;
const WARN: u32 = 2;

/// One failing call: a debug record ("refit_group_size failed: ...") on this thread.
fn failing_call() {
    let mut size = 0usize;
    assert_eq!(refit_group_size(std::ptr::null(), &mut size), Status::NullArgument);
}

fn uninstall() {
    assert_eq!(refit_set_log_callback(WARN, None, std::ptr::null_mut()), Status::Success);
}

/// What a callback's user_data points to: whether its owner has replaced it, the records it received,
/// and how many of those it should not have (after its release, or above its level).
#[derive(Default)]
struct Probe {
    released: AtomicBool,
    calls: AtomicUsize,
    unexpected: AtomicUsize,
}

unsafe extern "C" fn probe_callback(_level: u32, _message: *const c_char, user_data: *mut c_void) {
    // SAFETY: every test installs this callback with a live Probe.
    let probe = unsafe { &*(user_data as *const Probe) };
    probe.calls.fetch_add(1, Ordering::SeqCst);
    // Widen the window in which an uninstall could overtake this call.
    std::thread::yield_now();
    if probe.released.load(Ordering::SeqCst) {
        probe.unexpected.fetch_add(1, Ordering::SeqCst);
    }
}

fn install(level: u32, probe: &Probe) {
    let user_data = probe as *const Probe as *mut c_void;
    assert_eq!(refit_set_log_callback(level, Some(probe_callback), user_data), Status::Success);
}

/// Threads making failing calls (each logs a debug record) until `stop`.
fn producers(count: usize, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..count)
        .map(|_| {
            let stop = Arc::clone(stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    failing_call();
                }
            })
        })
        .collect()
}

#[test]
fn a_replaced_callback_is_never_entered_after_the_call_returns() {
    let _turn = take_turn();
    let stop = Arc::new(AtomicBool::new(false));
    let threads = producers(3, &stop);
    // Kept until the producers stop: a late call must find a live Probe to count on.
    let mut probes: Vec<Box<Probe>> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        let probe = Box::<Probe>::default();
        install(DEBUG, &probe);
        while probe.calls.load(Ordering::SeqCst) < 20 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        // Replaced by another callback or by stderr, alternately.
        if probes.len() % 2 == 0 {
            uninstall();
        } else {
            install(DEBUG, &Probe::default());
            uninstall();
        }
        probe.released.store(true, Ordering::SeqCst);
        probes.push(probe);
    }
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().unwrap());
    let delivered: usize = probes.iter().map(|p| p.calls.load(Ordering::SeqCst)).sum();
    let late: usize = probes.iter().map(|p| p.unexpected.load(Ordering::SeqCst)).sum();
    assert!(delivered > 0 && probes.len() > 2, "{delivered} records to {} callbacks", probes.len());
    assert_eq!(late, 0, "{late} of {delivered} records entered a callback after it was replaced");
}

/// Counts the records above warn it receives (a sink installed at warn must never get one).
unsafe extern "C" fn warn_only_callback(level: u32, _message: *const c_char, user_data: *mut c_void) {
    // SAFETY: installed with a live Probe.
    let probe = unsafe { &*(user_data as *const Probe) };
    probe.calls.fetch_add(1, Ordering::SeqCst);
    if level > WARN {
        probe.unexpected.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn sink_and_level_change_together() {
    let _turn = take_turn();
    // Two threads install, over and over, A at debug and B at warn while debug records flow: a
    // debug record reaching B means B was installed at A's level.
    let (a, b) = (Arc::new(Probe::default()), Arc::new(Probe::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let threads = producers(2, &stop);
    let setters: Vec<_> = [(Arc::clone(&a), DEBUG), (Arc::clone(&b), WARN)]
        .into_iter()
        .map(|(probe, level)| {
            std::thread::spawn(move || {
                let user_data = Arc::as_ptr(&probe) as *mut c_void;
                let callback = if level == WARN { warn_only_callback } else { probe_callback };
                let deadline = Instant::now() + Duration::from_secs(1);
                while Instant::now() < deadline {
                    assert_eq!(refit_set_log_callback(level, Some(callback), user_data), Status::Success);
                }
            })
        })
        .collect();
    setters.into_iter().for_each(|t| t.join().unwrap());
    uninstall();
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert!(a.calls.load(Ordering::SeqCst) > 0, "A at debug received no record");
    let wrong = b.unexpected.load(Ordering::SeqCst);
    assert_eq!(wrong, 0, "B, installed at warn, received {wrong} debug records");
}

static NESTED_STATUSES: Mutex<Vec<Status>> = Mutex::new(Vec::new());

/// Makes a failing call from inside the callback, and tries to replace itself.
unsafe extern "C" fn calls_refit(_level: u32, _message: *const c_char, user_data: *mut c_void) {
    // SAFETY: installed with a live Probe.
    let probe = unsafe { &*(user_data as *const Probe) };
    probe.calls.fetch_add(1, Ordering::SeqCst);
    let mut size = 0usize;
    let failed = refit_group_size(std::ptr::null(), &mut size);
    let replaced = refit_set_log_callback(WARN, None, std::ptr::null_mut());
    NESTED_STATUSES.lock().unwrap().extend([failed, replaced]);
}

#[test]
fn a_callback_calling_refit_does_not_recurse() {
    let _turn = take_turn();
    NESTED_STATUSES.lock().unwrap().clear();
    let probe = Probe::default();
    assert_eq!(
        refit_set_log_callback(DEBUG, Some(calls_refit), &probe as *const Probe as *mut c_void),
        Status::Success
    );
    for _ in 0..3 {
        failing_call();
    }
    // Still installed: the setter inside the callback changed nothing.
    assert_eq!(probe.calls.load(Ordering::SeqCst), 3, "one call per failure, none for the nested ones");
    uninstall();
    let nested = NESTED_STATUSES.lock().unwrap().clone();
    assert_eq!(nested, [Status::NullArgument, Status::InvalidState].repeat(3));
    // The last error on this thread is the outer call's own.
    let message = unsafe { CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned();
    assert_eq!(message, "refit_group_size: group is NULL");
}
