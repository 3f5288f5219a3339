//! Communicators between processes: ids, create / adopt / destroy / abort, queries, allgather over a
//! communicator, and plans built across processes.
//!
//! Exports take raw pointers from C and are not `unsafe fn` (C cannot tell the difference); each
//! pointer is checked by the argument helpers before use, inside the boundary.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::group::{backend_code, REFIT_BACKEND_AUTO, REFIT_BACKEND_CUDA, REFIT_BACKEND_HOST};
use super::handles::{destroy, live, publish};
use super::plan::{plan_options, refit_plan, refit_plan_options, refit_table};
use super::{arg, boundary, check_bool, options_in, out, slice, OptionsStruct};
use crate::across;
use crate::allgather::comm::allgather;
use crate::bail;
use crate::error::{Result, Status};
use crate::transport::comm::{CommId, CommOptions, Communicator, ID_BYTES};
use crate::transport::{driver, BackendKind, Stream};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// Bytes of a refit_comm_id.
pub const REFIT_COMM_ID_BYTES: u32 = 136;
const _: () = assert!(REFIT_COMM_ID_BYTES as usize == ID_BYTES);

/// The id every rank of one communicator is created from. One process makes it
/// (refit_comm_get_unique_id) and the caller hands it to the others by its own means (a TCP store,
/// MPI, a file, an environment variable); it is plain bytes, copied freely, and good for one
/// communicator. Every byte matters: an id with any byte changed is refused with INVALID_ARGUMENT
/// before it is used. It carries a random secret that every join is checked against (on the host
/// backend, bytes from the kernel's random source; on CUDA, NCCL's random magic), so that a stray
/// process holding another job's id, or a stale one, never joins a communicator.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct refit_comm_id {
    pub internal: [u8; 136],
}

/// One rank of a communicator between processes (a process and one of its devices).
///
/// Thread-safety: calls on one communicator are made by one thread at a time, in the same order on
/// every rank (as NCCL requires); refit_comm_abort may be called from any thread at any time, also
/// while another thread is inside a call on the same communicator. Different communicators are
/// independent.
pub struct refit_comm {
    comm: Arc<Communicator>,
}

impl refit_comm {
    /// The communicator, for exports of other areas that keep it (executors across processes).
    pub(crate) fn shared(&self) -> &Arc<Communicator> {
        &self.comm
    }
}

/// Options of refit_comm_create and refit_comm_adopt. Fill with refit_comm_options_init, then change
/// fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_comm_options {
    /// sizeof(refit_comm_options) as the caller was compiled with (set by refit_comm_options_init).
    pub size: usize,
    /// No call waits for peers longer than this many milliseconds (default 600000, ten minutes; at
    /// least 1). Past it the communicator is aborted and every rank's call fails with
    /// REFIT_STATUS_TIMEOUT (or REFIT_STATUS_ABORTED once a peer has aborted).
    pub timeout_ms: u64,
    /// Bytes of staging each process may use for transfers that pack strided data (default 256 MiB;
    /// at least 1 MiB).
    pub staging_bytes: u64,
    /// Executors across processes (refit_executor_create_across) write straight into the memory of
    /// processes on the same machine through CUDA IPC (default true); false sends every pair's
    /// bytes through staging over the communicator.
    pub ipc: bool,
    /// On CUDA, refit_comm_allgather first compares the ranks' counts (default true): a blocking
    /// exchange of 8 bytes per rank over the communicator, so the call returns once every rank has
    /// reached it; where the counts differ every rank's call returns INVALID_ARGUMENT naming the
    /// ranks that differ, nothing moves, and the communicator stays usable. false: the call only
    /// queues, as ncclAllGather does, and counts that differ make NCCL calls that do not match
    /// (undefined; typically TIMEOUT). The host backend always compares.
    pub check_counts: bool,
}

/// Fills `options` with the defaults and sets options->size. Thread-safe.
/// Errors: REFIT_STATUS_NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_comm_options_init(options: *mut refit_comm_options) -> Status {
    boundary("refit_comm_options_init", || {
        out(options, "options")?.write(refit_comm_options {
            size: std::mem::size_of::<refit_comm_options>(),
            timeout_ms: CommOptions::DEFAULT_TIMEOUT.as_millis() as u64,
            staging_bytes: CommOptions::DEFAULT_STAGING_BYTES,
            ipc: true,
            check_counts: true,
        });
        Ok(())
    })
}

impl OptionsStruct for refit_comm_options {
    unsafe fn check_fields(ptr: *const Self) -> Result<()> {
        check_bool(std::ptr::addr_of!((*ptr).ipc), "options.ipc")?;
        check_bool(std::ptr::addr_of!((*ptr).check_counts), "options.check_counts")
    }
}

fn convert_options(options: *const refit_comm_options) -> Result<CommOptions> {
    // SAFETY: NULL or a caller struct whose first field is its size.
    let Some(options) = (unsafe { options_in(options, "options") })? else {
        return Ok(CommOptions::default());
    };
    if options.timeout_ms == 0 {
        bail!(Status::InvalidArgument, "options.timeout_ms is 0; at least 1");
    }
    Ok(CommOptions {
        timeout: Duration::from_millis(options.timeout_ms),
        staging_bytes: options.staging_bytes,
        ipc: options.ipc,
        check_counts: options.check_counts,
    })
}

/// Writes a new id to `*id`. `backend` picks what the communicator moves: REFIT_BACKEND_CUDA (device
/// memory, through NCCL: the id holds an ncclUniqueId), REFIT_BACKEND_HOST (host memory, through Unix
/// sockets between the processes of one machine: a test-only simulation of NCCL for machines without
/// GPUs), or REFIT_BACKEND_AUTO (CUDA when libcuda loads and has a device, else HOST). Every rank
/// passes the same id to refit_comm_create. The id's rendezvous root runs in this process, which must
/// live until every rank has joined: NCCL's bootstrap root on CUDA; on HOST a thread that admits each
/// rank once, checking its secret, and stops listening once every rank has been admitted, which
/// spends the id (an id never used keeps that idle thread until this process exits). Thread-safe;
/// blocking; not ordered with any stream.
///
/// Errors: NULL_ARGUMENT, INVALID_ARGUMENT (backend), CUDA_UNAVAILABLE (CUDA asked for), NCCL_UNAVAILABLE
/// (libnccl missing, or older than 2.14), NCCL_ERROR.
#[no_mangle]
pub extern "C" fn refit_comm_get_unique_id(backend: u32, id: *mut refit_comm_id) -> Status {
    boundary("refit_comm_get_unique_id", || {
        let slot = out(id, "id")?;
        let kind = match backend {
            REFIT_BACKEND_AUTO if driver::device_count().is_ok_and(|n| n > 0) => BackendKind::Cuda,
            REFIT_BACKEND_AUTO | REFIT_BACKEND_HOST => BackendKind::Host,
            REFIT_BACKEND_CUDA => {
                driver::init()?;
                BackendKind::Cuda
            }
            other => bail!(Status::InvalidArgument, "backend {other} is not a REFIT_BACKEND_*"),
        };
        slot.write(refit_comm_id { internal: Communicator::unique_id(kind)?.0 });
        Ok(())
    })
}

/// Joins the communicator `id` as rank `rank` of `nranks`, on CUDA device `device` (on the host
/// backend `device` is recorded only), and writes the handle to `*comm`. Every rank calls it with the
/// same id and nranks, each with its own rank; the call blocks until every rank has joined, at most
/// options->timeout_ms. `options` may be NULL (defaults). On the CUDA backend the NCCL communicator is
/// created nonblocking, so that refit bounds every wait by the timeout. Not ordered with any stream;
/// the calling thread's current CUDA context is left as it was.
///
/// Identity: an id forms one communicator. A process that claims a rank another process holds, while
/// the communicator forms or after it formed, gets INVALID_ARGUMENT at once (on the host backend,
/// while it forms, every rank holds its rank's name; once it formed, the id is spent); when two
/// processes claim one rank together, whichever takes it first joins and the other gets
/// INVALID_ARGUMENT, and the communicator of the others forms. On the host backend a join with an
/// id whose secret is not its rendezvous's, or with a spent id (its communicator formed, also when
/// it was destroyed since; or its maker exited), is INVALID_ARGUMENT at once; where a process holds
/// the rendezvous's socket but nothing answers (the maker forked, then exited), TIMEOUT. On CUDA,
/// NCCL's root checks its magic and ends once every rank has joined: a spent id fails as NCCL
/// reports it (NCCL_ERROR, or TIMEOUT where nothing answers).
///
/// Errors: NULL_ARGUMENT (id, comm), INVALID_ARGUMENT (an id not made by refit_comm_get_unique_id or
/// with any byte changed, nranks 0 or above 2^31 - 1, rank not below nranks, bad options (size,
/// timeout_ms 0, staging_bytes below 1 MiB, an ipc byte other than 0 or 1), a rank taken by another
/// process, ranks that pass different nranks; on the host backend, an id with another secret or a
/// spent one, more ranks than a process may open files), INVALID_DEVICE, TIMEOUT (a rank did not
/// join in time), ABORTED, NCCL_UNAVAILABLE, NCCL_ERROR, CUDA_UNAVAILABLE, CUDA_ERROR.
#[no_mangle]
pub extern "C" fn refit_comm_create(
    id: *const refit_comm_id,
    nranks: u32,
    rank: u32,
    device: i32,
    options: *const refit_comm_options,
    comm: *mut *mut refit_comm,
) -> Status {
    boundary("refit_comm_create", || {
        let slot = out(comm, "comm")?;
        // SAFETY: a caller struct of REFIT_COMM_ID_BYTES bytes.
        let id = CommId(unsafe { arg(id, "id") }?.internal);
        let options = convert_options(options)?;
        let created = Communicator::create(&id, nranks as usize, rank as usize, device, options)?;
        slot.write(publish(refit_comm { comm: Arc::new(created) }));
        Ok(())
    })
}

/// Wraps `nccl_comm`, an ncclComm_t the caller already holds (a framework's process group), in a
/// handle written to `*comm`; rank, size and device are NCCL's. The caller keeps owning it:
/// refit_comm_destroy does not destroy it, and it must outlive the handle. `nccl_comm` must come from
/// the same libnccl that refit loads (the one already loaded in the process under the name
/// libnccl.so.2, else REFIT_NCCL_LIBRARY): a communicator of another copy of NCCL is undefined
/// behaviour. When a call times out, or on refit_comm_abort, refit revokes the communicator
/// (ncclCommRevoke, NCCL 2.28 and later; with an older NCCL its pending work is not stopped and a
/// warning says so): its owner must then destroy it. refit bounds its waits by the timeout only when
/// the communicator was created nonblocking (ncclConfig_t.blocking = 0); with a blocking one, NCCL
/// itself may block a call while it connects to peers. Not ordered with any stream.
///
/// Errors: NULL_ARGUMENT (nccl_comm, comm), INVALID_ARGUMENT (bad options, as for
/// refit_comm_create; NCCL reports an impossible rank), NCCL_UNAVAILABLE, NCCL_ERROR,
/// CUDA_UNAVAILABLE, INVALID_DEVICE.
#[no_mangle]
pub extern "C" fn refit_comm_adopt(
    nccl_comm: *mut c_void,
    options: *const refit_comm_options,
    comm: *mut *mut refit_comm,
) -> Status {
    boundary("refit_comm_adopt", || {
        let slot = out(comm, "comm")?;
        let options = convert_options(options)?;
        // SAFETY: the caller's promise: a live communicator of the loaded libnccl.
        let adopted = unsafe { Communicator::adopt(nccl_comm, options) }?;
        slot.write(publish(refit_comm { comm: Arc::new(adopted) }));
        Ok(())
    })
}

/// Destroys the handle (NULL is ignored). Waits, at most the timeout, for this rank's queued calls to
/// complete, then frees the communicator (a communicator of refit_comm_adopt is left to its owner);
/// an executor made with it (refit_executor_create_across) keeps it until that executor is destroyed.
/// If they do not complete in time, or the communicator failed, it is aborted instead, so destroy
/// never hangs. Peers still waiting for this rank fail (ABORTED on the host backend at once; TIMEOUT
/// on NCCL at their timeout). Refused while another thread's call uses the handle (see "Handles" at
/// the top of this header): to stop a call blocked on peers, call refit_comm_abort first.
#[no_mangle]
pub extern "C" fn refit_comm_destroy(comm: *mut refit_comm) {
    destroy(comm, "refit_comm_destroy")
}

/// Aborts this rank's part of the communicator: its pending work stops (NCCL: ncclCommAbort, or
/// ncclCommRevoke for an adopted communicator), and every later call on the handle returns
/// REFIT_STATUS_ABORTED; only refit_comm_destroy remains to do. Peers waiting for this rank fail too
/// (ABORTED on the host backend at once; on NCCL at their timeout, or at once where NCCL reports the
/// peer's failure). Any thread, at any time, also during another thread's call on this handle.
/// Aborting twice is harmless. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_comm_abort(comm: *mut refit_comm) -> Status {
    boundary("refit_comm_abort", || {
        live(comm, "comm")?.comm.abort();
        Ok(())
    })
}

/// This rank's index in the communicator. Thread-safe. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_comm_rank(comm: *const refit_comm, rank: *mut u32) -> Status {
    boundary("refit_comm_rank", || {
        let slot = out(rank, "rank")?;
        slot.write(live(comm, "comm")?.comm.rank() as u32);
        Ok(())
    })
}

/// The number of ranks. Thread-safe. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_comm_size(comm: *const refit_comm, size: *mut u32) -> Status {
    boundary("refit_comm_size", || {
        let slot = out(size, "size")?;
        slot.write(live(comm, "comm")?.comm.size() as u32);
        Ok(())
    })
}

/// The CUDA device of this rank (as passed to refit_comm_create, or NCCL's for an adopted
/// communicator). Thread-safe. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_comm_device(comm: *const refit_comm, device: *mut i32) -> Status {
    boundary("refit_comm_device", || {
        let slot = out(device, "device")?;
        slot.write(live(comm, "comm")?.comm.device());
        Ok(())
    })
}

/// The backend whose memory the communicator moves: REFIT_BACKEND_CUDA or REFIT_BACKEND_HOST.
/// Thread-safe. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_comm_backend(comm: *const refit_comm, backend: *mut u32) -> Status {
    boundary("refit_comm_backend", || {
        let slot = out(backend, "backend")?;
        slot.write(backend_code(live(comm, "comm")?.comm.kind()));
        Ok(())
    })
}

/// This rank's part of an allgather over the communicator, with refit_allgather's semantics: rank r
/// contributes `counts[r]` bytes, and `recv` (sum(counts) bytes) receives rank p's block at offset
/// counts[0] + ... + counts[p-1], in rank order. `counts` has refit_comm_size() entries, the same on
/// every rank; counts may differ (uneven: grouped ncclSend/ncclRecv of exactly each block, no padding)
/// and may be 0. In place: `send == recv + offset of this rank`. `send` and `recv` are memory of the
/// communicator's device (host memory on the host backend).
///
/// Ordering: stream-ordered like ncclAllGather. The work is queued on `stream` (a CUstream of the
/// communicator's device; NULL for its legacy default stream; on the host backend a host stream from
/// refit_host_stream_create, NULL for the communicator's own) and this returns without waiting. Once
/// that work has run, `recv` holds every block and `send` is no longer read. Every rank must make its
/// calls on the communicator in the same order; they run in that order on every rank.
///
/// A peer that does not take part within the timeout (or exits, or aborts) fails the communicator:
/// the queued work ends (recv is then undefined) and this call, a later one, or
/// refit_comm_synchronize returns REFIT_STATUS_TIMEOUT or REFIT_STATUS_ABORTED.
///
/// Counts that differ between ranks are refused on every rank, naming the ranks whose counts differ
/// from those most ranks passed (on a tie, the lowest rank's); nothing moves and the communicator
/// stays usable. On the host backend the ranks compare their counts on the stream, before any byte
/// moves, and the next refit_comm_synchronize on every rank returns INVALID_ARGUMENT (once). On
/// CUDA the ranks first exchange a digest of their counts (refit_comm_options.check_counts, default
/// true: a blocking exchange of 8 bytes per rank, so the call returns once every rank has reached
/// it) and where they differ this call returns INVALID_ARGUMENT on every rank. With check_counts
/// false the call only queues, as ncclAllGather does, and other counts make NCCL calls that do not
/// match, which NCCL leaves undefined (it typically ends in TIMEOUT).
///
/// Thread-safety: as the communicator's. Errors: NULL_ARGUMENT (comm, counts, a NULL buffer with bytes
/// to move), INVALID_ARGUMENT (overflowing sizes; `send` or `recv` not memory of the communicator's
/// device, checked as refit_copy_batch checks a source and a destination, the message naming
/// send[rank] or recv[rank]), OVERLAP (send overlapping recv other than in place), TIMEOUT, ABORTED,
/// NCCL_ERROR, CUDA_ERROR. A call refused for its own arguments meets no peer: the peers' calls wait
/// for it until their timeout.
#[no_mangle]
pub extern "C" fn refit_comm_allgather(
    comm: *mut refit_comm,
    send: u64,
    recv: u64,
    counts: *const usize,
    stream: *mut c_void,
) -> Status {
    boundary("refit_comm_allgather", || {
        let handle = live(comm, "comm")?;
        let comm = &handle.comm;
        // SAFETY: refit_comm_size() counts (the caller's promise).
        let counts = unsafe { slice(counts, comm.size(), "counts") }?;
        // SAFETY: the caller promises valid memory of the sizes given.
        unsafe { allgather(comm, send, recv, counts, Stream::from_ptr(stream)) }
    })
}

/// Blocks until the work queued on `stream` (a stream of the communicator's device; NULL as for
/// refit_comm_allgather) has run, then returns the communicator's failure, if any: how a caller
/// learns that a queued call failed. Bounded: every call of the communicator completes or is aborted
/// within the timeout (other work on the stream is waited for as it is). Thread-safety: as the
/// communicator's.
///
/// Errors: NULL_ARGUMENT, TIMEOUT, ABORTED, NCCL_ERROR (the communicator failed), CUDA_ERROR,
/// INVALID_ARGUMENT (on the host backend, a stream that is not a host stream; or an allgather
/// refused since the last synchronize because the ranks passed different counts: reported once, the
/// communicator stays usable).
#[no_mangle]
pub extern "C" fn refit_comm_synchronize(comm: *mut refit_comm, stream: *mut c_void) -> Status {
    boundary("refit_comm_synchronize", || live(comm, "comm")?.comm.synchronize(Stream::from_ptr(stream)))
}

/// Builds this rank's share of one plan over the communicator and writes it to `*plan`. Every rank
/// passes its own `table` (each process adds only its own offers and needs; the process index of
/// its entries is its communicator rank) and the same `options` (NULL: defaults). The encoded tables
/// are gathered (their sizes first, then the bytes); every rank builds its share: each route from or
/// to one of its own endpoints, exactly as refit_plan_build of all tables would make it (owners are
/// a deterministic function of all tables and the options), with the work beyond reading the tables
/// growing with its own entries; then the ranks compare the fingerprints of the planner's inputs
/// (tables, options, limits) and the library version before returning. Every rank gets its share,
/// or every rank gets a status. The share's stats count its own receivers; refit_plan_fingerprint
/// covers its own routes. Blocks until every rank has called it, each step at most the timeout. Host
/// memory only; not ordered with any stream.
///
/// Errors: the planner's (TENSOR_MISMATCH, REPLICA_MISMATCH, COVERAGE_GAP or OVERLAP in a rank's own
/// needs, ...) on each rank that failed, while the others get ABORTED naming the first such rank;
/// INVALID_ARGUMENT (bad options; ranks that passed different options or run another refit version:
/// the message names both; a table entry naming another rank's process) on every rank;
/// INVALID_STATE (another thread is changing `table`); DECODE_ERROR (a table's bytes changed on the
/// way), TIMEOUT, ABORTED, NULL_ARGUMENT (comm, table, plan).
#[no_mangle]
pub extern "C" fn refit_plan_build_across(
    comm: *mut refit_comm,
    table: *const refit_table,
    options: *const refit_plan_options,
    plan: *mut *mut refit_plan,
) -> Status {
    boundary("refit_plan_build_across", || {
        let slot = out(plan, "plan")?;
        let (comm, table) = (live(comm, "comm")?, live(table, "table")?);
        let table = table.read()?;
        // SAFETY: NULL or a caller options struct.
        let options = unsafe { plan_options(options) }?;
        let built = across::build_plan(&comm.comm, table.table(), &options)?;
        slot.write(publish(refit_plan::new(built)));
        Ok(())
    })
}
