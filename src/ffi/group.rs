//! The device group's C API: create/destroy, queries, scopes, run-per-rank, host streams.
//!
//! Exports take raw pointers from C and are not `unsafe fn` (C cannot tell the difference); each
//! pointer is checked by the argument helpers before use, inside the boundary.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::handles::{destroy, live, publish};
use super::{boundary, options_in, out, slice, OptionsStruct};
use crate::error::{clear_last_error, last_error, Error, Result, Status};
use crate::group::{BackendChoice, ExitMode, Group, GroupOptions};
use crate::transport::host::{create_host_stream, destroy_host_stream};
use crate::transport::{BackendKind, Stream};
use std::ffi::c_void;

/// Pick the CUDA backend when libcuda loads and has a device, else the host backend.
pub const REFIT_BACKEND_AUTO: u32 = 0;
/// The CUDA backend (REFIT_STATUS_CUDA_UNAVAILABLE when libcuda or a device is missing).
pub const REFIT_BACKEND_CUDA: u32 = 1;
/// The host backend: devices simulated with threads and host memory ("device pointers" are host
/// addresses; NULL streams are each simulated device's default stream; a group's streams and the
/// default streams serve only their own simulated device, as a CUDA stream serves only its device;
/// see refit_host_stream_create for streams that serve any).
pub const REFIT_BACKEND_HOST: u32 = 2;

/// refit_group_exit: block the host until the group's work is done.
pub const REFIT_EXIT_SYNC: u32 = 0;
/// refit_group_exit: make each caller stream wait for the group's work; return at once.
pub const REFIT_EXIT_ASYNC: u32 = 1;

/// A device group: one rank per device, each with its own non-blocking stream created once, and one
/// persistent thread per rank, started at the first call that needs them (refit_group_run, a PEER
/// allgather). After each such call a rank thread spins for up to 50 us waiting for the
/// next before it sleeps: a loop of calls then costs no thread wake-ups (each a system call and a
/// context switch).
///
/// Thread-safety: a group is used by one thread at a time, except that inside refit_group_run the
/// rank callbacks may call refit_group_allgather_rank and the query functions concurrently. A
/// whole-group call (refit_group_enter, _exit, _run, refit_allgather, an executor's run or commit)
/// made while another thread's whole-group call on the group is in progress returns INVALID_STATE
/// and does nothing.
pub struct refit_group {
    pub(crate) group: Group,
}

/// Options of refit_group_create. Fill with refit_group_options_init, then change fields.
#[repr(C)]
pub struct refit_group_options {
    /// sizeof(refit_group_options) as the caller was compiled with (set by refit_group_options_init).
    pub size: usize,
    /// REFIT_BACKEND_AUTO (default), REFIT_BACKEND_CUDA or REFIT_BACKEND_HOST.
    pub backend: u32,
    /// Host backend only: how many devices to simulate (at most 64); 0 (default) = the largest listed
    /// device + 1.
    pub host_devices: u32,
}

/// `callback(rank, stream, user_data)`: runs once per rank on that rank's thread, with the rank's
/// device current and `stream` the rank's stream. Returns 0 on success; any other value fails the run.
pub type refit_rank_callback =
    Option<unsafe extern "C" fn(rank: u32, stream: *mut c_void, user_data: *mut c_void) -> i32>;

/// Fills `options` with the defaults (AUTO backend) and sets options->size.
///
/// Errors: REFIT_STATUS_NULL_ARGUMENT when `options` is NULL.
#[no_mangle]
pub extern "C" fn refit_group_options_init(options: *mut refit_group_options) -> Status {
    boundary("refit_group_options_init", || {
        let slot = out(options, "options")?;
        slot.write(refit_group_options {
            size: std::mem::size_of::<refit_group_options>(),
            backend: REFIT_BACKEND_AUTO,
            host_devices: 0,
        });
        Ok(())
    })
}

impl OptionsStruct for refit_group_options {}

fn convert_options(options: *const refit_group_options) -> Result<GroupOptions> {
    // SAFETY: NULL or a caller struct whose first field is its size.
    let Some(first) = (unsafe { options_in(options, "options") })? else {
        return Ok(GroupOptions::default());
    };
    let backend = match first.backend {
        REFIT_BACKEND_AUTO => BackendChoice::Auto,
        REFIT_BACKEND_CUDA => BackendChoice::Cuda,
        REFIT_BACKEND_HOST => BackendChoice::Host,
        other => {
            return Err(Error::invalid_argument(format!(
                "options.backend = {other} is not a REFIT_BACKEND_*"
            )))
        }
    };
    Ok(GroupOptions { backend, host_devices: first.host_devices as usize })
}

/// Creates a group where rank r is `devices[r]` (`n` devices). Enables peer access between every
/// pair that supports it (a pair without it still works, slower; see refit_group_peer_access),
/// creates one non-blocking stream per device and the events the group reuses. `options` may be NULL
/// (defaults). Not ordered with any stream; blocking.
///
/// Errors: NULL_ARGUMENT (`devices` with n > 0, or `group`), EMPTY_DEVICE_LIST (n == 0),
/// INVALID_DEVICE (negative or not below the device count), DUPLICATE_DEVICE, INVALID_ARGUMENT (bad
/// options), CUDA_UNAVAILABLE (CUDA backend asked for but missing), CUDA_ERROR.
#[no_mangle]
pub extern "C" fn refit_group_create(
    devices: *const i32,
    n: usize,
    options: *const refit_group_options,
    group: *mut *mut refit_group,
) -> Status {
    boundary("refit_group_create", || {
        let slot = out(group, "group")?;
        // SAFETY: `devices` points to `n` ints (the caller's promise).
        let devices = unsafe { slice(devices, n, "devices") }?;
        let options = convert_options(options)?;
        let created = Group::new(devices, options)?;
        slot.write(publish(refit_group { group: created }));
        Ok(())
    })
}

/// Destroys a group (NULL is ignored): drains its streams, stops its rank threads, releases its
/// streams, events and NCCL communicators. A scope left open is drained, not ordered with the caller's
/// streams (a warning is logged). Refused while a call on the group is in progress, on another
/// thread or the refit_group_run whose rank callback calls it (its threads would wait for
/// themselves): see "Handles" at the top of this header.
#[no_mangle]
pub extern "C" fn refit_group_destroy(group: *mut refit_group) {
    destroy(group, "refit_group_destroy")
}

/// The number of ranks. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_group_size(group: *const refit_group, size: *mut usize) -> Status {
    boundary("refit_group_size", || {
        let slot = out(size, "size")?;
        slot.write(live(group, "group")?.group.size());
        Ok(())
    })
}

/// The device ordinal of `rank`. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (rank not below the size).
#[no_mangle]
pub extern "C" fn refit_group_device(group: *const refit_group, rank: u32, device: *mut i32) -> Status {
    boundary("refit_group_device", || {
        let slot = out(device, "device")?;
        slot.write(live(group, "group")?.group.device(rank as usize)?);
        Ok(())
    })
}

/// The rank of the group whose device is `device` (the inverse of refit_group_device): plans,
/// routes and tables name device ordinals, calls on a group take ranks. Thread-safe.
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT (`device` is not one of the group's devices; the message
/// names it and lists the group's devices).
#[no_mangle]
pub extern "C" fn refit_group_rank_of(group: *const refit_group, device: i32, rank: *mut u32) -> Status {
    boundary("refit_group_rank_of", || {
        let slot = out(rank, "rank")?;
        let found = live(group, "group")?.group.rank_of(device)?;
        slot.write(u32::try_from(found).map_err(|_| Error::new(Status::InternalError, "a rank past 2^32"))?);
        Ok(())
    })
}

/// The stream of `rank` (a CUstream on the CUDA backend, an opaque host-stream handle on the host
/// backend): non-blocking, created with the group, the same for every call until refit_group_destroy.
/// Work you queue on it yourself inside a scope is ordered after the group's earlier work on this rank;
/// after a PEER allgather, other ranks may still be reading this rank's buffers until the next group
/// call, refit_group_run or refit_group_exit (which join them), so do not overwrite them from here
/// before that. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (rank).
#[no_mangle]
pub extern "C" fn refit_group_stream(
    group: *const refit_group,
    rank: u32,
    stream: *mut *mut c_void,
) -> Status {
    boundary("refit_group_stream", || {
        let slot = out(stream, "stream")?;
        slot.write(live(group, "group")?.group.stream(rank as usize)?.as_ptr());
        Ok(())
    })
}

/// Whether `rank` accesses `peer`'s memory directly (peer access enabled). false means copies between
/// them take a slower, driver-staged path. A rank always reaches itself.
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT (a rank not below the size).
#[no_mangle]
pub extern "C" fn refit_group_peer_access(
    group: *const refit_group,
    rank: u32,
    peer: u32,
    direct: *mut bool,
) -> Status {
    boundary("refit_group_peer_access", || {
        let slot = out(direct, "direct")?;
        slot.write(live(group, "group")?.group.peer_access(rank as usize, peer as usize)?);
        Ok(())
    })
}

/// The backend in use: REFIT_BACKEND_CUDA or REFIT_BACKEND_HOST (never AUTO). Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_group_backend(group: *const refit_group, backend: *mut u32) -> Status {
    boundary("refit_group_backend", || {
        let slot = out(backend, "backend")?;
        slot.write(backend_code(live(group, "group")?.group.backend_kind()));
        Ok(())
    })
}

/// The REFIT_BACKEND_* code of a backend in use (never AUTO).
pub(crate) fn backend_code(kind: BackendKind) -> u32 {
    match kind {
        BackendKind::Cuda => REFIT_BACKEND_CUDA,
        BackendKind::Host => REFIT_BACKEND_HOST,
    }
}

/// Opens a scope: each rank's stream waits (an event; the host does not block) for the work queued
/// so far on `caller_streams[rank]`, a stream of that rank's device. `caller_streams` is an array of
/// refit_group_size() streams, or NULL for every device's legacy default stream; NULL entries also mean
/// the legacy default stream. Work the group queues inside the scope sees the caller's earlier work.
///
/// Scopes do not nest. Whole-group calls made outside a scope run in an implicit scope on the legacy
/// default streams and are complete on return. Scopes are opened and closed by the thread that drives
/// the group, never from a rank callback (refit_group_run).
///
/// Errors: NULL_ARGUMENT (group), INVALID_STATE (a scope is already open, or called from a rank
/// callback of any group: nothing is done), CUDA_ERROR, INVALID_ARGUMENT (a host-backend stream handle
/// that is not a host stream).
#[no_mangle]
pub extern "C" fn refit_group_enter(group: *mut refit_group, caller_streams: *const *mut c_void) -> Status {
    boundary("refit_group_enter", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        if caller_streams.is_null() {
            return group.enter(None);
        }
        // SAFETY: the caller passes one stream per rank.
        let raw = unsafe { slice(caller_streams, group.size(), "caller_streams") }?;
        let streams: Vec<Stream> = raw.iter().map(|&s| Stream::from_ptr(s)).collect();
        group.enter(Some(&streams))
    })
}

/// Closes the open scope. REFIT_EXIT_SYNC blocks until all of the group's queued work is done.
/// REFIT_EXIT_ASYNC makes each caller stream given to refit_group_enter wait for its rank's stream
/// and returns without blocking: the caller's later work sees the group's results.
///
/// A call refused for its arguments or state does nothing and leaves the scope open: NULL group,
/// INVALID_ARGUMENT (mode is not a REFIT_EXIT_*), INVALID_STATE (no scope is open, or called from a
/// rank callback of any group). Once those checks pass, the scope is closed even when ordering the
/// streams fails: CUDA_ERROR (or INVALID_ARGUMENT for a caller stream that stopped being a host
/// stream) is returned with the scope closed.
///
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT, INVALID_STATE, CUDA_ERROR, as above.
#[no_mangle]
pub extern "C" fn refit_group_exit(group: *mut refit_group, mode: u32) -> Status {
    boundary("refit_group_exit", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        let mode = match mode {
            REFIT_EXIT_SYNC => ExitMode::Sync,
            REFIT_EXIT_ASYNC => ExitMode::Async,
            other => return Err(Error::invalid_argument(format!("mode {other} is not a REFIT_EXIT_*"))),
        };
        group.exit(mode)
    })
}

struct UserData(*mut c_void);
// SAFETY: the caller passes user_data to run knowing every rank thread receives it at once.
unsafe impl Sync for UserData {}

/// Calls `callback(rank, stream, user_data)` for every rank at once, each on the group's persistent
/// thread for that rank, with the rank's device current and its stream passed in; returns when every
/// callback has returned. Runs inside the open scope, or in an implicit one (legacy default streams,
/// then synchronized) when none is open. Callbacks may call refit_group_allgather_rank and queries.
///
/// The first callback to fail decides the result: REFIT_STATUS_CALLBACK_FAILED, with a message naming
/// the rank, its return code and the last refit error on that rank's thread. Other ranks waiting in a
/// collective are released (their calls return REFIT_STATUS_ABORTED) and nothing waits forever. The
/// group stays usable.
///
/// Every rank's callback must make the same per-rank collective calls. A callback that returns
/// (0 or not) while other ranks wait for it in one, or before they start one it never makes, releases
/// them: their calls return REFIT_STATUS_ABORTED, naming the rank. If every callback then returns 0,
/// refit_group_run returns REFIT_STATUS_ABORTED naming that rank.
///
/// Errors: NULL_ARGUMENT (group, callback), CALLBACK_FAILED, ABORTED (all callbacks returned 0 but
/// one returned while others waited for it), INVALID_STATE (called from a callback), CUDA_ERROR.
#[no_mangle]
pub extern "C" fn refit_group_run(
    group: *mut refit_group,
    callback: refit_rank_callback,
    user_data: *mut c_void,
) -> Status {
    boundary("refit_group_run", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        let callback = callback.ok_or_else(|| Error::new(Status::NullArgument, "callback is NULL"))?;
        let user_data = UserData(user_data);
        group.run(&|rank, stream| {
            let user_data = &user_data;
            clear_last_error();
            // SAFETY: the caller's callback, called as documented.
            let code = unsafe { callback(rank as u32, stream.as_ptr(), user_data.0) };
            if code == 0 {
                return Ok(());
            }
            let known = Status::from_code(code.into()).map(|s| format!(" ({})", s.name().to_string_lossy()));
            let detail = last_error();
            let detail =
                if detail.is_empty() { String::new() } else { format!("; last refit error: {detail}") };
            Err(Error::new(
                Status::CallbackFailed,
                format!("rank {rank} callback returned {code}{}{detail}", known.unwrap_or_default()),
            ))
        })
    })
}

/// Host backend only: creates a caller-side host stream (a FIFO queue with its own worker thread)
/// usable as a caller stream of any host-backend group, e.g. to test scope ordering. Release it with
/// refit_host_stream_destroy. Thread-safe. Errors: NULL_ARGUMENT, OUT_OF_MEMORY (no thread could be
/// started).
#[no_mangle]
pub extern "C" fn refit_host_stream_create(stream: *mut *mut c_void) -> Status {
    boundary("refit_host_stream_create", || {
        let slot = out(stream, "stream")?;
        slot.write(create_host_stream()?.as_ptr());
        Ok(())
    })
}

/// Destroys a host stream made by refit_host_stream_create, after its queued work has run. Only those
/// streams: a group's streams (refit_group_stream) and a simulated device's default stream are
/// released by refit_group_destroy, and any other value is refused without effect. Handle values are
/// not sequential, so a guessed value names no stream. Thread-safe.
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT (not made by refit_host_stream_create, destroyed already,
/// or a group's stream).
#[no_mangle]
pub extern "C" fn refit_host_stream_destroy(stream: *mut c_void) -> Status {
    boundary("refit_host_stream_destroy", || {
        if stream.is_null() {
            return Err(Error::new(Status::NullArgument, "stream is NULL"));
        }
        destroy_host_stream(Stream::from_ptr(stream))
    })
}
