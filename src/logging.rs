//! Routes the `log` crate's records to a host callback or to stderr.
//!
//! Quiet by default (warnings and errors only). REFIT_LOG raises or lowers the level for programs that
//! install no callback; `refit_set_log_callback` hands records to the host.

use crate::error::{Error, Result};
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::ffi::{c_char, c_void, CString};
use std::sync::{Once, RwLock};

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
unsafe impl Sync for HostSink {}

static SINK: RwLock<Option<HostSink>> = RwLock::new(None);
static LOGGER: Logger = Logger;
static INSTALL: Once = Once::new();

struct Logger;

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let sink = *SINK.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        match sink {
            Some(sink) => {
                let text = CString::new(format!("{}", record.args()).replace('\0', " ")).unwrap_or_default();
                // SAFETY: the host installed this callback for exactly this use.
                unsafe { (sink.callback)(level_number(record.level()), text.as_ptr(), sink.user_data) };
            }
            None => eprintln!("[refit {}] {}", record.level(), record.args()),
        }
    }

    fn flush(&self) {}
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
            log::set_max_level(filter_from_env());
        }
    });
}

pub fn set_callback(level: u32, callback: refit_log_callback, user_data: *mut c_void) -> Result<()> {
    let filter = filter_from_number(level)
        .ok_or_else(|| Error::invalid_argument(format!("log level {level} is above 5 (trace)")))?;
    init();
    *SINK.write().unwrap_or_else(|poisoned| poisoned.into_inner()) =
        callback.map(|callback| HostSink { callback, user_data });
    log::set_max_level(if callback.is_some() { filter } else { filter_from_env() });
    Ok(())
}
