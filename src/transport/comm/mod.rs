//! Communicators between processes: one rank per (process, device), created from an id the caller
//! distributes by its own means, or adopted from an `ncclComm_t` the framework already holds.
//!
//! Two links carry the bytes, chosen by the id:
//! - [`nccl_link`]: an NCCL communicator created nonblocking (`ncclCommInitRankConfig` with
//!   `blocking = 0`), so that no NCCL call blocks the host; a watchdog thread per communicator polls
//!   `ncclCommGetAsyncError` and the events recorded after each call, and aborts the communicator
//!   when an error appears or a call has not completed within the timeout.
//! - [`host_link`]: the host backend's stand-in for NCCL between OS processes, for CI: a full mesh of
//!   Unix sockets ([`super::mesh`]) moving host memory, with the same ordering, timeout and abort
//!   semantics. It is a test-only simulation: never a transport for real data between machines.
//!
//! Identity: an id carries a check of all its bytes (a changed byte is refused before anything
//! else) and a random secret every join is checked against: NCCL's magic, checked by NCCL's root; on
//! the host link the secret half of the mesh key, checked by the id's root ([`root`], in the process
//! that made the id, which also makes the id good for one communicator) and by every peer. A claim
//! of a rank fails at once: once the communicator formed, at the root (the id is spent); while it
//! forms, at the rank's socket name, which each host rank holds until it is destroyed.
//!
//! Every call either completes or fails with a status within the communicator's timeout: TIMEOUT when
//! a peer did not take part in time, ABORTED when a peer exited or aborted. The first failure is kept
//! ([`Health`]): the communicator is then aborted, and every later call returns that failure.
//!
//! Calls on one communicator must be issued in the same order on every rank, as NCCL requires;
//! stream-ordered calls run in that order whatever streams they are queued on.

mod agreement;
mod host_link;
mod nccl_link;
mod node;
mod root;

use super::mesh::{self, Message};
use super::nccl::{nccl, NcclComm, NcclUniqueId};
use super::{BackendKind, Stream};
use crate::bail;
use crate::error::{Error, Result, Status};
use crate::segment::Segment;
use crate::sync::lock;
pub use agreement::Agreement;
use host_link::HostLink;
use nccl_link::NcclLink;
pub use node::NodeMesh;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Tags of the host link's own steps (see [`Communicator::transfer`]), apart from any digest of
/// arguments callers use.
const ALL_GATHER_TAG: u64 = 0x6167_0000_0000_0000;
const LENGTHS_TAG: u64 = 0x6c65_6e67_7468_7300;
const BYTES_TAG: u64 = 0x6279_7465_7300_0000;
const AGREE_TAG: u64 = 0x6167_7265_6500_0000;

/// Bytes of a communicator id (C: REFIT_COMM_ID_BYTES).
pub const ID_BYTES: usize = 136;
const ID_MAGIC: &[u8; 4] = b"RFCM";
/// Version 2: ids carry a check of their bytes, and host ids a secret and a root.
const ID_VERSION: u8 = 2;
const ID_NCCL: u8 = 1;
const ID_HOST: u8 = 2;
/// Where the check of the id's other bytes lies (two bytes).
const ID_CHECK: usize = 6;
/// Where the link's own id starts (an ncclUniqueId, or the host mesh's key).
const ID_PAYLOAD: usize = 8;
const _: () = assert!(ID_PAYLOAD + mesh::KEY_BYTES == ID_BYTES && ID_PAYLOAD + 128 == ID_BYTES);

/// The bytes every rank of one communicator is created from: a header naming the link and checking
/// every other byte, then the link's id: NCCL's unique id (its bootstrap root's address and NCCL's
/// random magic, which NCCL checks at every join), or the host mesh's key (a random token naming the
/// rendezvous and a random secret every join must carry, both from the kernel's random source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommId(pub [u8; ID_BYTES]);

/// CRC-16/CCITT of every byte of an id but its check: it detects every change of up to 16
/// consecutive bits, so no single changed byte of an id goes unnoticed.
fn id_check(bytes: &[u8; ID_BYTES]) -> u16 {
    let checked = bytes[..ID_CHECK].iter().chain(&bytes[ID_PAYLOAD..]);
    checked.fold(0xffffu16, |mut crc, &byte| {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
        crc
    })
}

impl CommId {
    fn new(kind: u8, payload: &[u8]) -> CommId {
        let mut bytes = [0u8; ID_BYTES];
        bytes[..4].copy_from_slice(ID_MAGIC);
        bytes[4] = ID_VERSION;
        bytes[5] = kind;
        bytes[ID_PAYLOAD..ID_PAYLOAD + payload.len()].copy_from_slice(payload);
        let check = id_check(&bytes);
        bytes[ID_CHECK..ID_PAYLOAD].copy_from_slice(&check.to_le_bytes());
        CommId(bytes)
    }

    /// The backend the id was made for. INVALID_ARGUMENT when the bytes are not an id, or not the
    /// bytes refit_comm_get_unique_id wrote (any byte changed).
    pub fn kind(&self) -> Result<BackendKind> {
        if &self.0[..4] != ID_MAGIC || self.0[4] != ID_VERSION {
            bail!(
                Status::InvalidArgument,
                "the id was not made by refit_comm_get_unique_id (of this library version)"
            );
        }
        let stored = u16::from_le_bytes([self.0[ID_CHECK], self.0[ID_CHECK + 1]]);
        if stored != id_check(&self.0) {
            bail!(
                Status::InvalidArgument,
                "the id's bytes were changed on the way (its check does not match): pass the {ID_BYTES} \
                 bytes refit_comm_get_unique_id wrote, unchanged"
            );
        }
        match self.0[5] {
            ID_NCCL => Ok(BackendKind::Cuda),
            ID_HOST => Ok(BackendKind::Host),
            other => bail!(Status::InvalidArgument, "the id names link {other}, which this library lacks"),
        }
    }

    fn nccl_id(&self) -> NcclUniqueId {
        let mut internal = [0u8; 128];
        internal.copy_from_slice(&self.0[ID_PAYLOAD..ID_PAYLOAD + 128]);
        NcclUniqueId { internal }
    }

    fn mesh_key(&self) -> mesh::MeshKey {
        mesh::MeshKey::from_bytes(self.0[ID_PAYLOAD..].try_into().expect("key bytes"))
    }
}

/// How a communicator behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommOptions {
    /// No call waits for peers longer than this; past it the communicator is aborted with TIMEOUT.
    pub timeout: Duration,
    /// Staging each process may use for transfers that pack strided bytes (NCCL routes).
    pub staging_bytes: u64,
    /// Let processes on one machine write into each other's memory through CUDA IPC (else every
    /// pair takes staging).
    pub ipc: bool,
    /// On NCCL, compare the ranks' agreements (an allgather's counts) before the call, with a
    /// blocking exchange; the host link always compares them on the stream.
    pub check_counts: bool,
}

impl CommOptions {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
    pub const DEFAULT_STAGING_BYTES: u64 = 256 << 20;
}

impl Default for CommOptions {
    fn default() -> CommOptions {
        CommOptions {
            timeout: CommOptions::DEFAULT_TIMEOUT,
            staging_bytes: CommOptions::DEFAULT_STAGING_BYTES,
            ipc: true,
            check_counts: true,
        }
    }
}

/// A communicator's first failure, kept: once it failed, every later call returns it.
#[derive(Default)]
pub(crate) struct Health {
    failure: Mutex<Option<Error>>,
}

impl Health {
    /// Keeps `error` unless a failure is kept already; returns the kept one.
    pub fn fail(&self, error: Error) -> Error {
        let mut kept = lock(&self.failure);
        if kept.is_none() {
            log::warn!("communicator failed: {error}");
            *kept = Some(error);
        }
        kept.clone().expect("set above")
    }

    /// `Err` (the kept failure) once the communicator has failed.
    pub fn check(&self) -> Result<()> {
        match &*lock(&self.failure) {
            None => Ok(()),
            Some(error) => Err(error.clone().context("the communicator failed earlier")),
        }
    }

    pub fn failed(&self) -> bool {
        lock(&self.failure).is_some()
    }
}

enum Link {
    Host(HostLink),
    Nccl(NcclLink),
}

/// One rank of a communicator between processes.
///
/// Thread-safety: every method takes `&self`. Calls are meant for one thread at a time (their order is
/// the order every rank must share); [`Communicator::abort`] may come from any thread at any time.
pub struct Communicator {
    rank: usize,
    size: usize,
    device: i32,
    options: CommOptions,
    link: Link,
    /// The ranks on this machine, joined on first use (see [`Communicator::node_mesh`]).
    node: OnceLock<std::result::Result<Arc<NodeMesh>, Error>>,
}

impl Communicator {
    /// A new id for a communicator on `kind`, good for one communicator: an NCCL unique id for the
    /// CUDA backend (NCCL's bootstrap root then runs in this process), a random mesh key for the host
    /// backend (its root, [`root`], then runs in this process). Either way this process must live
    /// until every rank has joined.
    pub fn unique_id(kind: BackendKind) -> Result<CommId> {
        match kind {
            BackendKind::Cuda => Ok(CommId::new(ID_NCCL, &nccl()?.get_unique_id()?.internal)),
            BackendKind::Host => {
                let key = mesh::MeshKey::random()?;
                root::open(&key)?;
                Ok(CommId::new(ID_HOST, key.bytes()))
            }
        }
    }

    /// Joins the communicator `id` as `rank` of `size`, on CUDA device `device` (the host backend
    /// records it only). Blocks until every rank has joined, at most `options.timeout`.
    ///
    /// Errors: INVALID_ARGUMENT (not an id or a changed one, rank not below size, a size of 0, a taken
    /// rank, ranks that disagree on the size; on the host backend an id whose secret is not its
    /// rendezvous's, or a spent one), INVALID_DEVICE, TIMEOUT, ABORTED, NCCL_UNAVAILABLE, NCCL_ERROR,
    /// CUDA_UNAVAILABLE, CUDA_ERROR.
    pub fn create(
        id: &CommId,
        size: usize,
        rank: usize,
        device: i32,
        options: CommOptions,
    ) -> Result<Communicator> {
        let kind = id.kind()?;
        if size == 0 || rank >= size {
            bail!(
                Status::InvalidArgument,
                "rank {rank} of {size}: the rank must be below nranks, nranks above 0"
            );
        }
        if size > i32::MAX as usize {
            bail!(Status::InvalidArgument, "nranks {size} is above 2^31 - 1");
        }
        if device < 0 {
            bail!(Status::InvalidDevice, "device {device} is negative");
        }
        check_options(&options)?;
        let link = match kind {
            BackendKind::Host => Link::Host(HostLink::create(&id.mesh_key(), rank, size, options.timeout)?),
            BackendKind::Cuda => {
                Link::Nccl(NcclLink::create(id.nccl_id(), rank, size, device, options.timeout)?)
            }
        };
        Ok(Communicator { rank, size, device, options, link, node: OnceLock::new() })
    }

    /// Wraps `comm`, an NCCL communicator the caller holds and keeps owning: rank, size and device
    /// come from NCCL. Destroying the result does not destroy `comm`; a timeout or
    /// [`Communicator::abort`] revokes it (ncclCommRevoke, where the loaded NCCL has it) so its
    /// pending work ends, and then only the caller may destroy it.
    ///
    /// # Safety
    /// `comm` is a live communicator of the libnccl this library loaded, and outlives the result.
    pub unsafe fn adopt(comm: NcclComm, options: CommOptions) -> Result<Communicator> {
        if comm.is_null() {
            bail!(Status::NullArgument, "the NCCL communicator is NULL");
        }
        check_options(&options)?;
        let (rank, size, device) = nccl()?.comm_query(comm)?;
        let link = Link::Nccl(NcclLink::adopt(comm, device, options.timeout)?);
        Ok(Communicator { rank, size, device, options, link, node: OnceLock::new() })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    pub fn options(&self) -> &CommOptions {
        &self.options
    }

    /// The backend whose memory the communicator moves: CUDA (NCCL) or host.
    pub fn kind(&self) -> BackendKind {
        match self.link {
            Link::Host(_) => BackendKind::Host,
            Link::Nccl(_) => BackendKind::Cuda,
        }
    }

    /// `Err` with the first failure once the communicator has failed (or was aborted).
    pub fn check(&self) -> Result<()> {
        match &self.link {
            Link::Host(link) => link.health().check(),
            Link::Nccl(link) => link.health().check(),
        }
    }

    /// Ends this rank's part: pending and later calls fail with ABORTED, and so do the peers' calls
    /// that wait for this rank (host: at once; NCCL: when their own timeout or abort ends them).
    pub fn abort(&self) {
        let why = Error::new(Status::Aborted, format!("rank {} aborted the communicator", self.rank));
        match &self.link {
            Link::Host(link) => link.abort(why),
            Link::Nccl(link) => link.abort(why),
        }
        if let Some(Ok(node)) = self.node.get() {
            node.shutdown();
        }
    }

    /// The ranks of this communicator on this machine, joined by a mesh of Unix sockets that passes
    /// file descriptors (CUDA IPC of VMM memory). Made by the first call, a collective one: every
    /// rank makes it at the same point of its calls; later calls return the same mesh (or failure).
    pub fn node_mesh(&self) -> Result<Arc<NodeMesh>> {
        self.node
            .get_or_init(|| NodeMesh::join(self, self.options.timeout).map(Arc::new))
            .clone()
            .map_err(|e| e.context("joining the ranks on this machine"))
    }

    /// Queues on `stream` (a stream of this rank's device; NULL for its legacy default stream) one
    /// grouped step: every send of `sends` to its peer, every receive of `recvs` from its peer, and
    /// the contiguous copies `local` within this rank. The peers queue the matching step; messages
    /// between a pair match in order and must agree on their lengths. `tag` is a digest of the call's
    /// arguments that every rank's matching step passes alike: the host link checks it (and the
    /// lengths) on every message and fails the step on both sides when they differ; NCCL ignores it.
    /// Returns once queued; a failure while it runs fails the communicator (see
    /// [`Communicator::synchronize`]).
    ///
    /// # Safety
    /// Every address is device memory of this rank's device (host memory on the host backend), valid
    /// for its length until the queued step has run; receives do not overlap anything else.
    pub unsafe fn transfer(
        &self,
        sends: &[Message],
        recvs: &[Message],
        local: &[Segment],
        tag: u64,
        stream: Stream,
    ) -> Result<()> {
        self.queue(sends, recvs, local, tag, None, stream)
    }

    /// [`Communicator::transfer`] of a collective call whose `agreement` every rank must share: on
    /// the host link, the ranks first exchange their agreements' digests, and where any differs no
    /// byte moves and every rank's step is refused with INVALID_ARGUMENT naming the ranks that
    /// differ; the refusal is reported once (by the next [`Communicator::synchronize`]) and is not a
    /// failure: the communicator stays usable. NCCL does not compare (its calls must match).
    ///
    /// # Safety
    /// As for [`Communicator::transfer`].
    pub unsafe fn transfer_agreed(
        &self,
        sends: &[Message],
        recvs: &[Message],
        local: &[Segment],
        tag: u64,
        agreement: &Agreement,
        stream: Stream,
    ) -> Result<()> {
        self.queue(sends, recvs, local, tag, Some(agreement), stream)
    }

    /// # Safety
    /// As for [`Communicator::transfer`].
    unsafe fn queue(
        &self,
        sends: &[Message],
        recvs: &[Message],
        local: &[Segment],
        tag: u64,
        agreement: Option<&Agreement>,
        stream: Stream,
    ) -> Result<()> {
        self.check_peers(sends)?;
        self.check_peers(recvs)?;
        if let Some(s) = local.iter().find(|s| s.count != [1, 1]) {
            bail!(Status::InvalidArgument, "a communicator's local copy must be contiguous, not {s:?}");
        }
        match &self.link {
            Link::Host(link) => link.transfer(sends, recvs, local, tag, agreement.cloned(), stream),
            Link::Nccl(link) => {
                self.agree(agreement)?;
                link.transfer(sends, recvs, local, stream)
            }
        }
    }

    /// ncclAllGather of `bytes` per rank (in place when `send == recv + rank * bytes`), queued on
    /// `stream`; what NCCL does natively, and the host link with one
    /// [`Communicator::transfer_agreed`] of `agreement`.
    ///
    /// # Safety
    /// As for [`Communicator::transfer`]: `send` holds `bytes`, `recv` `bytes * size`.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        bytes: u64,
        agreement: &Agreement,
        stream: Stream,
    ) -> Result<()> {
        match &self.link {
            Link::Nccl(link) => {
                self.agree(Some(agreement))?;
                link.all_gather(send, recv, bytes, stream)
            }
            Link::Host(_) => {
                let (sends, recvs): (Vec<Message>, Vec<Message>) = (0..self.size)
                    .filter(|&p| p != self.rank)
                    .map(|p| {
                        (
                            Message { peer: p, addr: send, len: bytes },
                            Message { peer: p, addr: recv + p as u64 * bytes, len: bytes },
                        )
                    })
                    .unzip();
                let own = recv + self.rank as u64 * bytes;
                let local: Vec<Segment> =
                    if own == send { vec![] } else { vec![Segment::contiguous(send, own, bytes)] };
                self.transfer_agreed(&sends, &recvs, &local, ALL_GATHER_TAG ^ bytes, agreement, stream)
            }
        }
    }

    /// Blocks until the work queued on `stream` has run (bounded: every step ends within the timeout),
    /// then returns the communicator's failure, if any.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        match &self.link {
            Link::Host(link) => link.synchronize(stream),
            Link::Nccl(link) => link.synchronize(stream),
        }
    }

    /// Every rank's `mine`, in rank order (an allgather of host bytes of any length): blocks until
    /// every rank has called it, at most the timeout. Ordered with the communicator's other calls.
    pub fn allgather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        match &self.link {
            Link::Host(link) => link.allgather_bytes(mine),
            Link::Nccl(link) => link.allgather_bytes(mine, self.rank, self.size),
        }
    }

    /// On NCCL, where NCCL itself cannot compare the arguments of matching calls: every rank's
    /// agreement digest, exchanged (blocking, at most the timeout) before the call is issued, so that
    /// ranks that passed other arguments are refused on every rank instead of issuing NCCL calls
    /// that do not match. Nothing to do without an agreement or with `check_counts` off.
    fn agree(&self, agreement: Option<&Agreement>) -> Result<()> {
        let Some(agreement) = agreement.filter(|_| self.options.check_counts) else { return Ok(()) };
        let all = self.allgather_bytes(&agreement.digest.to_le_bytes())?;
        let mut digests = Vec::with_capacity(all.len());
        for (rank, bytes) in all.iter().enumerate() {
            let digest: [u8; 8] = bytes.as_slice().try_into().map_err(|_| {
                Error::new(
                    Status::InvalidState,
                    format!(
                        "rank {rank} sent {} bytes for the digest of its {}; 8 expected",
                        bytes.len(),
                        agreement.what
                    ),
                )
            })?;
            digests.push(u64::from_le_bytes(digest));
        }
        agreement.verdict(self.rank, &digests).map_or(Ok(()), Err)
    }

    fn check_peers(&self, messages: &[Message]) -> Result<()> {
        for m in messages {
            if m.peer >= self.size || m.peer == self.rank {
                bail!(
                    Status::InvalidArgument,
                    "peer {} is not another rank of {} (this is rank {})",
                    m.peer,
                    self.size,
                    self.rank
                );
            }
            if m.len > 0 && m.addr == 0 {
                bail!(
                    Status::NullArgument,
                    "a {}-byte message to or from rank {} is at address 0",
                    m.len,
                    m.peer
                );
            }
            if m.addr.checked_add(m.len).is_none() {
                bail!(
                    Status::InvalidArgument,
                    "a message to or from rank {} overflows the address space",
                    m.peer
                );
            }
        }
        Ok(())
    }
}

fn check_options(options: &CommOptions) -> Result<()> {
    if options.timeout.is_zero() {
        bail!(Status::InvalidArgument, "the timeout must be at least 1 ms");
    }
    if options.staging_bytes < 1 << 20 {
        bail!(Status::InvalidArgument, "staging_bytes {} is below 1 MiB", options.staging_bytes);
    }
    Ok(())
}

/// Every rank's bytes from an allgather of their lengths and an uneven allgather of the bytes, both
/// through `gather(sends, recvs, tag)` over host buffers: shared by both links' `allgather_bytes`.
pub(crate) fn lengths_then_bytes(
    rank: usize,
    size: usize,
    mine: &[u8],
    mut gather: impl FnMut(&[Message], &[Message], u64) -> Result<()>,
) -> Result<Vec<Vec<u8>>> {
    let my_len = (mine.len() as u64).to_le_bytes();
    let mut lengths = vec![[0u8; 8]; size];
    lengths[rank] = my_len;
    let others = || (0..size).filter(move |&p| p != rank);
    let sends: Vec<Message> =
        others().map(|p| Message { peer: p, addr: my_len.as_ptr() as u64, len: 8 }).collect();
    let recvs: Vec<Message> =
        others().map(|p| Message { peer: p, addr: lengths[p].as_mut_ptr() as u64, len: 8 }).collect();
    gather(&sends, &recvs, LENGTHS_TAG)?;
    let mut out: Vec<Vec<u8>> = Vec::with_capacity(size);
    for (p, len) in lengths.iter().enumerate() {
        let len = u64::from_le_bytes(*len);
        if p == rank {
            out.push(mine.to_vec());
            continue;
        }
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| Error::invalid_argument(format!("rank {p} announced {len} bytes")))?;
        let mut block = Vec::new();
        block.try_reserve_exact(len).map_err(|_| {
            Error::new(Status::OutOfMemory, format!("no memory for the {len} bytes rank {p} sends"))
        })?;
        block.resize(len, 0);
        out.push(block);
    }
    let sends: Vec<Message> =
        others().map(|p| Message { peer: p, addr: mine.as_ptr() as u64, len: mine.len() as u64 }).collect();
    let recvs: Vec<Message> = others()
        .map(|p| Message { peer: p, addr: out[p].as_mut_ptr() as u64, len: out[p].len() as u64 })
        .collect();
    gather(&sends, &recvs, BYTES_TAG)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_their_link_and_refuse_other_bytes() {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        assert_eq!(id.kind().unwrap(), BackendKind::Host);
        assert_ne!(id, Communicator::unique_id(BackendKind::Host).unwrap(), "ids are random");
        let mut bad = id;
        bad.0[0] = b'X';
        assert_eq!(bad.kind().unwrap_err().status, Status::InvalidArgument);
        let mut bad = id;
        bad.0[5] = 9;
        assert_eq!(bad.kind().unwrap_err().status, Status::InvalidArgument);
        let nccl = CommId::new(ID_NCCL, &[7u8; 128]);
        assert_eq!(nccl.kind().unwrap(), BackendKind::Cuda);
        assert_eq!(nccl.nccl_id().internal, [7u8; 128]);
    }

    #[test]
    fn an_id_with_another_secret_is_refused_by_its_live_rendezvous() {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        let mut key = *id.mesh_key().bytes();
        key[mesh::TOKEN_BYTES + 3] ^= 0x40; // the same rendezvous, another secret
        let stray = CommId::new(ID_HOST, &key); // its check holds: only the rendezvous can tell
        let options = CommOptions { timeout: Duration::from_secs(20), ..CommOptions::default() };
        let started = std::time::Instant::now();
        let err = Communicator::create(&stray, 2, 1, 0, options).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("secret"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "refused at once");
        // The rightful ranks still form the communicator.
        let first = std::thread::spawn(move || Communicator::create(&id, 2, 0, 0, options).map(|_| ()));
        Communicator::create(&id, 2, 1, 0, options).unwrap();
        first.join().unwrap().unwrap();
    }

    #[test]
    fn an_id_forms_one_communicator() {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        let options = CommOptions { timeout: Duration::from_secs(20), ..CommOptions::default() };
        // A join that fails before its ranks meet spends nothing.
        let short = CommOptions { timeout: Duration::from_millis(50), ..options };
        assert_eq!(Communicator::create(&id, 2, 0, 0, short).err().unwrap().status, Status::Timeout);
        drop(Communicator::create(&id, 1, 0, 0, options).unwrap());
        let started = std::time::Instant::now();
        let err = Communicator::create(&id, 1, 0, 0, options).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("the id is spent"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "refused at once");
    }

    /// A join refused for a spent id holds no rank's name, not even for a moment: two threads that
    /// claim the same rank of a spent id over and over are each refused as spent every time, never
    /// as "already taken" by the other's refused join.
    #[test]
    fn joins_refused_for_a_spent_id_hold_no_rank() {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        let options = CommOptions { timeout: Duration::from_secs(20), ..CommOptions::default() };
        drop(Communicator::create(&id, 1, 0, 0, options).unwrap());
        let claimants: Vec<_> = (0..2)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        let err = Communicator::create(&id, 1, 0, 0, options).err().unwrap();
                        assert_eq!(err.status, Status::InvalidArgument, "{err}");
                        assert!(err.message.contains("the id is spent"), "{err}");
                    }
                })
            })
            .collect();
        for claimant in claimants {
            claimant.join().unwrap();
        }
    }

    /// The exchange NCCL communicators make before a call (`agree`, which the host link does not
    /// need), over three host ranks: agreeing digests pass; one rank's other digest is refused on
    /// every rank naming that rank, and the communicator then agrees again; with check_counts off
    /// nothing is exchanged, so nothing is refused.
    #[test]
    fn agree_refuses_other_digests_on_every_rank_naming_the_rank() {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let options = CommOptions { timeout: Duration::from_secs(20), ..CommOptions::default() };
                    let comm = Communicator::create(&id, 3, rank, 0, options).unwrap();
                    let agreement =
                        |digest| Agreement { digest, what: "counts", mine: format!("[{digest}]") };
                    comm.agree(Some(&agreement(7))).unwrap();
                    let err = comm.agree(Some(&agreement(if rank == 2 { 8 } else { 7 }))).unwrap_err();
                    assert_eq!(err.status, Status::InvalidArgument, "rank {rank}: {err}");
                    assert!(
                        err.message.contains("ranks [2] differ from the other ranks [0, 1]"),
                        "rank {rank}: {err}"
                    );
                    comm.agree(Some(&agreement(9))).unwrap();
                    comm.agree(None).unwrap();
                    let unchecked =
                        Communicator { options: CommOptions { check_counts: false, ..comm.options }, ..comm };
                    unchecked.agree(Some(&agreement(rank as u64))).unwrap();
                })
            })
            .collect();
        for rank in ranks {
            rank.join().unwrap();
        }
    }

    #[test]
    fn bad_arguments_are_refused_before_joining() {
        let id = Communicator::unique_id(BackendKind::Host).unwrap();
        let options = CommOptions::default();
        let status = |r: Result<Communicator>| r.err().unwrap().status;
        assert_eq!(status(Communicator::create(&id, 0, 0, 0, options)), Status::InvalidArgument);
        assert_eq!(status(Communicator::create(&id, 2, 2, 0, options)), Status::InvalidArgument);
        assert_eq!(status(Communicator::create(&id, 2, 0, -1, options)), Status::InvalidDevice);
        let zero = CommOptions { timeout: Duration::ZERO, ..options };
        assert_eq!(status(Communicator::create(&id, 2, 0, 0, zero)), Status::InvalidArgument);
        let small = CommOptions { staging_bytes: 4096, ..options };
        assert_eq!(status(Communicator::create(&id, 2, 0, 0, small)), Status::InvalidArgument);
    }
}
