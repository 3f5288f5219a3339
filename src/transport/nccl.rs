//! NCCL: our own loader and the communicators every NCCL transfer goes through.
//!
//! - [`nccl`]: libnccl is opened at run time (`REFIT_NCCL_LIBRARY`, else `libnccl.so.2`, else
//!   `libnccl.so`), and only the handful of calls we use are declared here, from nccl.h's documented
//!   ABI (ncclComm_t is an opaque pointer, ncclResult_t and ncclDataType_t are C ints).
//! - [`Communicators`]: one communicator per rank, and the calls a rank issues on its own (allgather,
//!   send, receive), alone or grouped between ncclGroupStart and ncclGroupEnd. Collectives decide what
//!   to send; this is how it is sent.

use super::driver::CurrentContext;
use super::dynlib::Library;
use super::Stream;
use crate::error::{Error, Result, Status};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

pub type NcclComm = *mut c_void;
type NcclResult = c_int;

/// ncclUint8: we move bytes.
const NCCL_UINT8: c_int = 1;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type CommInitAll = unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult;
type CommDestroy = unsafe extern "C" fn(NcclComm) -> NcclResult;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, *mut c_void) -> NcclResult;
type SendRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult;
type GroupCall = unsafe extern "C" fn() -> NcclResult;
type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;

/// The NCCL entry points we call.
pub struct Nccl {
    library: Library,
    version: i32,
    comm_init_all: CommInitAll,
    comm_destroy: CommDestroy,
    all_gather: AllGather,
    send: SendRecv,
    recv: SendRecv,
    group_start: GroupCall,
    group_end: GroupCall,
    get_error_string: GetErrorString,
}

/// The process-wide NCCL, loaded on first use. `NcclUnavailable` (listing what was searched) when the
/// library or one of its symbols is missing.
pub fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, Error>> = OnceLock::new();
    NCCL.get_or_init(Nccl::load).as_ref().map_err(Clone::clone)
}

impl Nccl {
    fn load() -> Result<Nccl> {
        let library = Library::open_first(
            "REFIT_NCCL_LIBRARY",
            &["libnccl.so.2", "libnccl.so"],
            Status::NcclUnavailable,
        )?;
        let missing = Status::NcclUnavailable;
        // SAFETY: each type matches the function's declaration in nccl.h.
        unsafe {
            let get_version: GetVersion = library.symbol(c"ncclGetVersion", missing)?;
            let mut version = 0;
            get_version(&mut version);
            let nccl = Nccl {
                version,
                comm_init_all: library.symbol(c"ncclCommInitAll", missing)?,
                comm_destroy: library.symbol(c"ncclCommDestroy", missing)?,
                all_gather: library.symbol(c"ncclAllGather", missing)?,
                send: library.symbol(c"ncclSend", missing)?,
                recv: library.symbol(c"ncclRecv", missing)?,
                group_start: library.symbol(c"ncclGroupStart", missing)?,
                group_end: library.symbol(c"ncclGroupEnd", missing)?,
                get_error_string: library.symbol(c"ncclGetErrorString", missing)?,
                library,
            };
            log::info!("NCCL {} from {}", nccl.version, nccl.library.path());
            Ok(nccl)
        }
    }

    /// NCCL's version code (e.g. 22807 for 2.28.7).
    pub fn version(&self) -> i32 {
        self.version
    }

    pub fn path(&self) -> &str {
        self.library.path()
    }

    fn check(&self, call: &str, result: NcclResult) -> Result<()> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string.
        let text = unsafe { (self.get_error_string)(result) };
        let text = if text.is_null() {
            "unknown".into()
        } else {
            // SAFETY: non-NULL static NUL-terminated string.
            unsafe { CStr::from_ptr(text) }.to_string_lossy()
        };
        Err(Error::new(Status::NcclError, format!("{call} failed: ncclResult {result} ({text})")))
    }

    /// One communicator per device, all in this process (rank r on `devices[r]`).
    pub fn comm_init_all(&self, devices: &[i32]) -> Result<Vec<NcclComm>> {
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: arrays of the length we pass.
        self.check("ncclCommInitAll", unsafe {
            (self.comm_init_all)(comms.as_mut_ptr(), devices.len() as c_int, devices.as_ptr())
        })?;
        Ok(comms)
    }

    /// # Safety
    /// `comm` must come from [`Nccl::comm_init_all`] and not be used afterwards.
    pub unsafe fn comm_destroy(&self, comm: NcclComm) -> Result<()> {
        self.check("ncclCommDestroy", (self.comm_destroy)(comm))
    }

    /// ncclAllGather of `bytes` per rank.
    ///
    /// # Safety
    /// Valid device buffers on the communicator's device, `stream` on that device.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        bytes: usize,
        comm: NcclComm,
        stream: u64,
    ) -> Result<()> {
        self.check(
            "ncclAllGather",
            (self.all_gather)(
                send as usize as *const c_void,
                recv as usize as *mut c_void,
                bytes,
                NCCL_UINT8,
                comm,
                stream as usize as *mut c_void,
            ),
        )
    }

    /// # Safety
    /// As for `all_gather`.
    pub unsafe fn send(
        &self,
        buffer: u64,
        bytes: usize,
        peer: usize,
        comm: NcclComm,
        stream: u64,
    ) -> Result<()> {
        self.check(
            "ncclSend",
            (self.send)(
                buffer as usize as *mut c_void,
                bytes,
                NCCL_UINT8,
                peer as c_int,
                comm,
                stream as usize as *mut c_void,
            ),
        )
    }

    /// # Safety
    /// As for `all_gather`.
    pub unsafe fn recv(
        &self,
        buffer: u64,
        bytes: usize,
        peer: usize,
        comm: NcclComm,
        stream: u64,
    ) -> Result<()> {
        self.check(
            "ncclRecv",
            (self.recv)(
                buffer as usize as *mut c_void,
                bytes,
                NCCL_UINT8,
                peer as c_int,
                comm,
                stream as usize as *mut c_void,
            ),
        )
    }

    pub fn group_start(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check("ncclGroupStart", unsafe { (self.group_start)() })
    }

    pub fn group_end(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check("ncclGroupEnd", unsafe { (self.group_end)() })
    }
}

/// One NCCL communicator per rank, all in this process, destroyed on drop. Every call is made by
/// rank `rank` on `stream`, a stream of that rank's device, and is queued there (nothing waits).
pub struct Communicators {
    comms: Vec<NcclComm>,
}

// SAFETY: NCCL communicators may be used from any thread, one thread at a time per communicator,
// which callers guarantee (each rank uses only its own).
unsafe impl Send for Communicators {}
unsafe impl Sync for Communicators {}

impl Communicators {
    /// Communicators for `devices` (rank r on `devices[r]`). NcclUnavailable when NCCL cannot be
    /// loaded. The calling thread's current CUDA context is left as it was.
    pub fn create(devices: &[i32]) -> Result<Communicators> {
        let _current = CurrentContext::preserve()?;
        Ok(Communicators { comms: nccl()?.comm_init_all(devices)? })
    }

    pub fn ranks(&self) -> usize {
        self.comms.len()
    }

    /// Runs `calls` (calls on these communicators) between ncclGroupStart and ncclGroupEnd, so that
    /// NCCL issues them together: what one thread must do when it drives several ranks, or when a rank
    /// both sends and receives. The group is ended even after a failed call, so NCCL's per-thread
    /// state stays balanced; the first error is returned. The current CUDA context is left as it was
    /// (NCCL switches devices).
    pub fn grouped(&self, calls: impl FnOnce() -> Result<()>) -> Result<()> {
        let lib = nccl()?;
        let _current = CurrentContext::preserve()?;
        lib.group_start()?;
        let issued = calls();
        let ended = lib.group_end();
        issued.and(ended)
    }

    /// ncclAllGather of `bytes` per rank, rank `rank`'s part. Every rank must make the same call
    /// (in one [`Communicators::grouped`] when one thread drives several ranks). NCCL may change the
    /// current CUDA context (see [`Communicators::grouped`]).
    ///
    /// # Safety
    /// `send` (`bytes`) and `recv` (`bytes` times the rank count) are device memory of the rank's
    /// device; `stream` is a live stream of that device.
    pub unsafe fn all_gather(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        nccl()?.all_gather(send, recv, bytes, self.comms[rank], stream.0)
    }

    /// Rank `rank` sends `bytes` at `buffer` to rank `peer`, which must post the matching receive.
    ///
    /// # Safety
    /// As for [`Communicators::all_gather`], for `buffer`.
    pub unsafe fn send(
        &self,
        rank: usize,
        peer: usize,
        buffer: u64,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        nccl()?.send(buffer, bytes, peer, self.comms[rank], stream.0)
    }

    /// Rank `rank` receives `bytes` from rank `peer` into `buffer`.
    ///
    /// # Safety
    /// As for [`Communicators::all_gather`], for `buffer`.
    pub unsafe fn recv(
        &self,
        rank: usize,
        peer: usize,
        buffer: u64,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        nccl()?.recv(buffer, bytes, peer, self.comms[rank], stream.0)
    }
}

impl Drop for Communicators {
    fn drop(&mut self) {
        if let Ok(nccl) = nccl() {
            for &comm in &self.comms {
                // SAFETY: ours, used no more.
                if let Err(err) = unsafe { nccl.comm_destroy(comm) } {
                    log::warn!("{err}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nccl_is_a_status_naming_the_file() {
        let err = Library::open_first(
            "REFIT_NCCL_LIBRARY_TEST_UNSET",
            &["/nowhere/libnccl.so.2", "/nowhere/libnccl.so"],
            Status::NcclUnavailable,
        )
        .err()
        .unwrap();
        assert_eq!(err.status, Status::NcclUnavailable);
        assert!(err.message.contains("/nowhere/libnccl.so.2"), "{}", err.message);
    }
}
