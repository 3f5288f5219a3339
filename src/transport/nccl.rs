//! NCCL: our own loader and the communicators every NCCL transfer goes through.
//!
//! - [`nccl`]: libnccl is opened at run time (`REFIT_NCCL_LIBRARY`, else `libnccl.so.2`, else
//!   `libnccl.so`), and only the handful of calls we use are declared here, from nccl.h's documented
//!   ABI (ncclComm_t is an opaque pointer, ncclResult_t and ncclDataType_t are C ints).
//! - [`Communicators`]: one communicator per rank, and the calls a rank issues on its own (allgather,
//!   send, receive), alone or grouped between ncclGroupStart and ncclGroupEnd. Collectives decide what
//!   to send; this is how it is sent.
//! - Communicators between processes (`transport::comm`) use the calls NCCL added later (unique ids,
//!   `ncclCommInitRankConfig` with a nonblocking [`NcclConfig`], asynchronous errors, abort, revoke):
//!   they are looked up when the library loads but only required when used, so an older NCCL still
//!   serves the group's communicators and a missing call is NCCL_UNAVAILABLE naming it.

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
/// ncclInProgress: a nonblocking communicator's call has not finished issuing (or initializing).
pub const NCCL_IN_PROGRESS: c_int = 7;
/// NCCL_CONFIG_UNDEF_INT: "let NCCL choose".
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// The magic NCCL_CONFIG_INITIALIZER writes into ncclConfig_t.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// NCCL_VERSION(2, 28, 0): the ncclConfig_t layout [`NcclConfig`] declares.
const CONFIG_VERSION: u32 = 22800;

/// ncclUniqueId: NCCL_UNIQUE_ID_BYTES opaque bytes, passed by value as nccl.h declares it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclUniqueId {
    pub internal: [u8; 128],
}

/// ncclConfig_t as NCCL 2.28 declares it (`ncclConfig_v22800`). NCCL copies `size` bytes of it (at
/// most its own sizeof) over its defaults and ignores the fields of versions newer than `version`, so
/// this layout works with every NCCL from 2.14 (the first with nonblocking communicators) on: an
/// older one reads the prefix it knows, a newer one keeps its defaults for fields added after 2.28.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
    shrink_share: c_int,
    nvls_ctas: c_int,
    n_channels_per_net_peer: c_int,
    nvlink_centric_sched: c_int,
}

impl NcclConfig {
    /// NCCL_CONFIG_INITIALIZER with `blocking = 0`: calls on the communicator return at once
    /// (ncclInProgress while they complete), so every wait for peers is ours to bound and abort.
    pub fn nonblocking() -> NcclConfig {
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
            traffic_class: CONFIG_UNDEF_INT,
            comm_name: std::ptr::null(),
            collnet_enable: CONFIG_UNDEF_INT,
            cta_policy: CONFIG_UNDEF_INT,
            shrink_share: CONFIG_UNDEF_INT,
            nvls_ctas: CONFIG_UNDEF_INT,
            n_channels_per_net_peer: CONFIG_UNDEF_INT,
            nvlink_centric_sched: CONFIG_UNDEF_INT,
        }
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type CommInitAll = unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult;
type CommDestroy = unsafe extern "C" fn(NcclComm) -> NcclResult;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, *mut c_void) -> NcclResult;
type SendRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult;
type GroupCall = unsafe extern "C" fn() -> NcclResult;
type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type GetUniqueId = unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int, *mut NcclConfig) -> NcclResult;
type CommGetAsyncError = unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult;
type CommRevoke = unsafe extern "C" fn(NcclComm, c_int) -> NcclResult;
type CommQuery = unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult;
type GetLastError = unsafe extern "C" fn(NcclComm) -> *const c_char;

/// The calls communicators between processes need, each present or not in the loaded NCCL.
struct ProcessCalls {
    get_unique_id: Option<GetUniqueId>,
    comm_init_rank_config: Option<CommInitRankConfig>,
    comm_get_async_error: Option<CommGetAsyncError>,
    comm_abort: Option<CommDestroy>,
    comm_finalize: Option<CommDestroy>,
    comm_revoke: Option<CommRevoke>,
    comm_count: Option<CommQuery>,
    comm_cu_device: Option<CommQuery>,
    comm_user_rank: Option<CommQuery>,
    get_last_error: Option<GetLastError>,
}

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
    process: ProcessCalls,
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
                process: ProcessCalls {
                    get_unique_id: library.symbol(c"ncclGetUniqueId", missing).ok(),
                    comm_init_rank_config: library.symbol(c"ncclCommInitRankConfig", missing).ok(),
                    comm_get_async_error: library.symbol(c"ncclCommGetAsyncError", missing).ok(),
                    comm_abort: library.symbol(c"ncclCommAbort", missing).ok(),
                    comm_finalize: library.symbol(c"ncclCommFinalize", missing).ok(),
                    comm_revoke: library.symbol(c"ncclCommRevoke", missing).ok(),
                    comm_count: library.symbol(c"ncclCommCount", missing).ok(),
                    comm_cu_device: library.symbol(c"ncclCommCuDevice", missing).ok(),
                    comm_user_rank: library.symbol(c"ncclCommUserRank", missing).ok(),
                    get_last_error: library.symbol(c"ncclGetLastError", missing).ok(),
                },
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

    /// `Ok` for ncclSuccess, and for ncclInProgress: a nonblocking communicator's call that is still
    /// being issued, which its caller settles afterwards (`transport::comm` polls
    /// ncclCommGetAsyncError); blocking communicators never return it.
    fn check(&self, call: &str, result: NcclResult) -> Result<()> {
        if result == 0 || result == NCCL_IN_PROGRESS {
            return Ok(());
        }
        Err(Error::new(Status::NcclError, format!("{call} failed: {}", self.error_string(result))))
    }

    /// The name of an ncclResult_t ("unhandled cuda error", ...).
    pub fn error_string(&self, result: c_int) -> String {
        // SAFETY: ncclGetErrorString returns a static string or NULL.
        let text = unsafe { (self.get_error_string)(result) };
        if text.is_null() {
            return format!("ncclResult {result}");
        }
        // SAFETY: non-NULL static NUL-terminated string.
        format!("ncclResult {result} ({})", unsafe { CStr::from_ptr(text) }.to_string_lossy())
    }

    /// An optional call, or NCCL_UNAVAILABLE naming it and this NCCL's version.
    fn need<F: Copy>(&self, call: Option<F>, name: &str) -> Result<F> {
        call.ok_or_else(|| {
            Error::new(
                Status::NcclUnavailable,
                format!(
                    "{} (NCCL {}) has no {name}; communicators between processes need NCCL 2.14 or later",
                    self.library.path(),
                    self.version
                ),
            )
        })
    }

    /// ncclGetUniqueId: a new id for ncclCommInitRankConfig. NCCL starts its bootstrap root in this
    /// process, which must therefore live until every rank has joined.
    pub fn get_unique_id(&self) -> Result<NcclUniqueId> {
        let call = self.need(self.process.get_unique_id, "ncclGetUniqueId")?;
        let mut id = NcclUniqueId { internal: [0; 128] };
        // SAFETY: a valid output slot.
        self.check("ncclGetUniqueId", unsafe { call(&mut id) })?;
        Ok(id)
    }

    /// ncclCommInitRankConfig: rank `rank` of `nranks` on the calling thread's current device. With a
    /// nonblocking `config` it returns at once; the caller polls [`Nccl::comm_get_async_error`] until
    /// the communicator is ready (or aborts it).
    pub fn comm_init_rank_config(
        &self,
        nranks: usize,
        id: NcclUniqueId,
        rank: usize,
        config: &mut NcclConfig,
    ) -> Result<NcclComm> {
        let call = self.need(self.process.comm_init_rank_config, "ncclCommInitRankConfig")?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: valid output slot and config; id passed by value as declared.
        let result = unsafe { call(&mut comm, nranks as c_int, id, rank as c_int, config) };
        if result != 0 && result != NCCL_IN_PROGRESS && !comm.is_null() {
            // A failed creation that still returned a handle: release it.
            if let Some(abort) = self.process.comm_abort {
                // SAFETY: the handle NCCL just returned, used no more.
                unsafe { abort(comm) };
            }
        }
        self.check("ncclCommInitRankConfig", result)?;
        Ok(comm)
    }

    /// ncclCommGetAsyncError: the communicator's state, as a raw ncclResult_t (ncclInProgress while
    /// a nonblocking call or the creation is still under way).
    ///
    /// # Safety
    /// `comm` is a live communicator.
    pub unsafe fn comm_get_async_error(&self, comm: NcclComm) -> Result<c_int> {
        let call = self.need(self.process.comm_get_async_error, "ncclCommGetAsyncError")?;
        let mut state = 0;
        self.check("ncclCommGetAsyncError", call(comm, &mut state))?;
        Ok(state)
    }

    /// ncclCommAbort: frees the communicator and stops its work on the device.
    ///
    /// # Safety
    /// `comm` is a live communicator this process owns, not used afterwards.
    pub unsafe fn comm_abort(&self, comm: NcclComm) -> Result<()> {
        let call = self.need(self.process.comm_abort, "ncclCommAbort")?;
        self.check("ncclCommAbort", call(comm))
    }

    /// ncclCommFinalize: flushes the communicator's work; a nonblocking one reports ncclInProgress
    /// through [`Nccl::comm_get_async_error`] until it is done. None when this NCCL lacks it.
    ///
    /// # Safety
    /// `comm` is a live communicator.
    pub unsafe fn comm_finalize(&self, comm: NcclComm) -> Option<Result<()>> {
        let call = self.process.comm_finalize?;
        Some(self.check("ncclCommFinalize", call(comm)))
    }

    /// ncclCommRevoke: stops the communicator's work without freeing it. None when this NCCL lacks
    /// it (before 2.28).
    ///
    /// # Safety
    /// `comm` is a live communicator.
    pub unsafe fn comm_revoke(&self, comm: NcclComm) -> Option<Result<()>> {
        let call = self.process.comm_revoke?;
        Some(self.check("ncclCommRevoke", call(comm, 0)))
    }

    /// (rank, number of ranks, CUDA device) of a communicator.
    ///
    /// # Safety
    /// `comm` is a live communicator.
    pub unsafe fn comm_query(&self, comm: NcclComm) -> Result<(usize, usize, i32)> {
        let mut rank = -1;
        let mut count = -1;
        let mut device = -1;
        let user_rank = self.need(self.process.comm_user_rank, "ncclCommUserRank")?;
        self.check("ncclCommUserRank", user_rank(comm, &mut rank))?;
        let comm_count = self.need(self.process.comm_count, "ncclCommCount")?;
        self.check("ncclCommCount", comm_count(comm, &mut count))?;
        let cu_device = self.need(self.process.comm_cu_device, "ncclCommCuDevice")?;
        self.check("ncclCommCuDevice", cu_device(comm, &mut device))?;
        if rank < 0 || count <= 0 || rank >= count {
            return Err(Error::invalid_argument(format!(
                "the NCCL communicator reports rank {rank} of {count}: not a live communicator"
            )));
        }
        Ok((rank as usize, count as usize, device))
    }

    /// ncclGetLastError for `comm`, when this NCCL has it and has something to say.
    ///
    /// # Safety
    /// `comm` is a live communicator or NULL.
    pub unsafe fn last_error(&self, comm: NcclComm) -> Option<String> {
        let text = (self.process.get_last_error?)(comm);
        if text.is_null() {
            return None;
        }
        let text = CStr::from_ptr(text).to_string_lossy().into_owned();
        (!text.is_empty()).then_some(text)
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
    fn config_has_the_layout_of_nccl_2_28() {
        // ncclConfig_v22800 on x86-64: size, magic, version, four ints, netName, splitShare,
        // trafficClass, commName, six ints.
        use std::mem::offset_of;
        assert_eq!(std::mem::size_of::<NcclConfig>(), 80);
        assert_eq!(offset_of!(NcclConfig, blocking), 16);
        assert_eq!(offset_of!(NcclConfig, net_name), 32);
        assert_eq!(offset_of!(NcclConfig, split_share), 40);
        assert_eq!(offset_of!(NcclConfig, comm_name), 48);
        assert_eq!(offset_of!(NcclConfig, collnet_enable), 56);
        assert_eq!(offset_of!(NcclConfig, nvlink_centric_sched), 76);
        let config = NcclConfig::nonblocking();
        assert_eq!((config.size, config.magic, config.version, config.blocking), (80, 0xcafe_beef, 22800, 0));
        assert_eq!(std::mem::size_of::<NcclUniqueId>(), 128);
    }

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
