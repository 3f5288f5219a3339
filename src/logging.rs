//! Routes the `log` crate's records to a host callback or to stderr.
//!
//! Quiet by default (warnings and errors only). REFIT_LOG raises or lowers the level for programs that
//! install no callback; `refit_set_log_callback` hands records to the host.
//!
//! Promises to the host, and how they are kept:
//! - **Once `refit_set_log_callback` returns, the callback it replaced is never entered again** (the
//!   host may free its user_data). Callbacks run outside any lock, so each counts itself in flight
//!   under the *generation* of the sink it was given; the setter switches to the next generation and
//!   waits until the previous one has no callback in flight. Setters take turns, so at most two
//!   generations are ever live and a parity bit names them.
//! - **Sink and level change together**: both live in one state under one lock, and a record is
//!   filtered by the level stored with the sink it goes to.
//! - **A callback may call refit**: records emitted on a thread while it is inside the callback are
//!   dropped (a failing call would otherwise log again, recursing until the stack overflows), and a
//!   setter called from inside the callback returns INVALID_STATE instead of waiting for itself.
//! - **Nothing here panics**, also during thread exit: stderr write errors are ignored and the
//!   thread-local flag has no destructor.

use crate::error::{Error, Result};
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};
use std::sync::{Condvar, Mutex, MutexGuard, Once};

/// `callback(level, message, user_data)`: level 1 error .. 5 trace; `message` valid during the call.
#[allow(non_camel_case_types)]
pub type refit_log_callback =
    Option<unsafe extern "C" fn(level: u32, message: *const c_char, user_data: *mut c_void)>;

#[derive(Clone, Copy)]
struct HostSink {
    callback: unsafe extern "C" fn(level: u32, message: *const c_char, user_data: *mut c_void),
    user_data: *mut c_void,
}

// SAFETY: the host promises, by installing it, that the callback may be called from any thread with
// its user_data; we only pass the pointer back.
unsafe impl Send for HostSink {}

/// Where records go and which ones: changed only by `set_callback`, read by every record.
struct Sink {
    /// None: stderr.
    host: Option<HostSink>,
    /// The most verbose level delivered to `host` (or to stderr).
    level: LevelFilter,
    /// Parity of the current generation: callbacks entered now count in `in_flight[generation]`.
    generation: usize,
    /// Callbacks running, by the parity of the generation whose sink they were given.
    in_flight: [usize; 2],
}

static SINK: Mutex<Sink> =
    Mutex::new(Sink { host: None, level: LevelFilter::Warn, generation: 0, in_flight: [0, 0] });
/// Signalled when a generation's last callback in flight returns.
static DRAINED: Condvar = Condvar::new();
/// Held by one setter at a time, for the whole switch including the wait.
static SETTER: Mutex<()> = Mutex::new(());
static LOGGER: Logger = Logger;
static INSTALL: Once = Once::new();

thread_local! {
    /// Whether this thread is inside the host's log callback.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is a few plain fields updated whole; a panic elsewhere cannot leave it half-changed.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn inside_callback() -> bool {
    IN_CALLBACK.try_with(Cell::get).unwrap_or(false)
}

/// Where one record goes.
enum Route {
    Host(HostSink, InFlight),
    Stderr,
    Nowhere,
}

/// Picks the route for a record at `level`; a host callback is counted in flight before the lock is
/// released, so a setter that runs next waits for it.
fn route(level: Level) -> Route {
    let mut sink = lock(&SINK);
    if level > sink.level {
        return Route::Nowhere;
    }
    let Some(host) = sink.host else { return Route::Stderr };
    let generation = sink.generation;
    sink.in_flight[generation] += 1;
    let _ = IN_CALLBACK.try_with(|inside| inside.set(true));
    Route::Host(host, InFlight { generation })
}

/// One callback in flight. Dropping it (also on unwind) marks the thread as out of the callback and
/// releases its generation.
struct InFlight {
    generation: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let _ = IN_CALLBACK.try_with(|inside| inside.set(false));
        let mut sink = lock(&SINK);
        sink.in_flight[self.generation] -= 1;
        if sink.in_flight[self.generation] == 0 && sink.generation != self.generation {
            DRAINED.notify_all();
        }
    }
}

struct Logger;

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        // A cheap prefilter only: `route` decides by the level stored with the sink.
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) || inside_callback() {
            return;
        }
        match route(record.level()) {
            Route::Host(host, _in_flight) => {
                let text = CString::new(format!("{}", record.args()).replace('\0', " ")).unwrap_or_default();
                // SAFETY: the host installed this callback for exactly this use; `_in_flight` keeps a
                // setter that replaces it waiting until this call has returned.
                unsafe { (host.callback)(level_number(record.level()), text.as_ptr(), host.user_data) };
            }
            Route::Stderr => to_stderr(record),
            Route::Nowhere => {}
        }
    }

    fn flush(&self) {}
}

/// A record on stderr. Write errors are ignored: logging never panics.
#[cfg(not(test))]
fn to_stderr(record: &Record) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "[refit {}] {}", record.level(), record.args());
}

/// A record on stderr, in the crate's own unit tests: through `eprintln!`, which the test harness
/// captures per test (threads a test spawns included) and shows only when that test fails. Tests
/// that provoke an error check it through the thread's last error; a passing run prints no line.
#[cfg(test)]
fn to_stderr(record: &Record) {
    eprintln!("[refit {}] {}", record.level(), record.args());
}

fn level_number(level: Level) -> u32 {
    match level {
        Level::Error => 1,
        Level::Warn => 2,
        Level::Info => 3,
        Level::Debug => 4,
        Level::Trace => 5,
    }
}

fn filter_from_number(level: u32) -> Option<LevelFilter> {
    Some(match level {
        0 => LevelFilter::Off,
        1 => LevelFilter::Error,
        2 => LevelFilter::Warn,
        3 => LevelFilter::Info,
        4 => LevelFilter::Debug,
        5 => LevelFilter::Trace,
        _ => return None,
    })
}

fn filter_from_env() -> LevelFilter {
    std::env::var("REFIT_LOG").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(LevelFilter::Warn)
}

/// Installs our logger once per process, unless the embedding Rust program installed its own.
pub fn init() {
    INSTALL.call_once(|| {
        if log::set_logger(&LOGGER).is_ok() {
            let level = filter_from_env();
            lock(&SINK).level = level;
            log::set_max_level(level);
        }
    });
}

/// Hands records at `level` and below to `callback` (None: stderr at the REFIT_LOG level), and
/// returns once the callback it replaces has returned everywhere and can never be entered again.
pub fn set_callback(level: u32, callback: refit_log_callback, user_data: *mut c_void) -> Result<()> {
    let filter = filter_from_number(level)
        .ok_or_else(|| Error::invalid_argument(format!("log level {level} is above 5 (trace)")))?;
    if inside_callback() {
        return Err(Error::invalid_state(
            "called from inside the log callback, which it would have to wait for; nothing was changed",
        ));
    }
    init();
    let _turn = lock(&SETTER);
    let mut sink = lock(&SINK);
    sink.host = callback.map(|callback| HostSink { callback, user_data });
    sink.level = if callback.is_some() { filter } else { filter_from_env() };
    log::set_max_level(sink.level);
    let previous = sink.generation;
    sink.generation ^= 1;
    while sink.in_flight[previous] > 0 {
        sink = DRAINED.wait(sink).unwrap_or_else(|poisoned| poisoned.into_inner());
    }
    Ok(())
}
