//! Unix stream sockets between the processes of one job on one host: a full mesh, one connection per
//! pair of ranks, every wait bounded by a [`Deadline`].
//!
//! Rendezvous: a mesh is named by a [`MeshKey`]: a random token, which names its sockets, and a random
//! secret, which never appears in a name (every process of the network namespace can list the names
//! in /proc/net/unix). Rank r listens on the abstract socket name `refit-mesh/<token>/<r>` (Linux's
//! abstract namespace: no file to create or clean up, and the name goes away with the process) and
//! keeps that name for the mesh's whole life, so that a second process claiming rank r, before the
//! mesh formed or after, fails at once to take the name. Rank r connects to every lower rank and
//! accepts every higher one. Each connection opens with a hello (magic, rank, size, the whole key)
//! that the accepting rank answers with one byte: a hello with another key (a stray process that knows
//! the token only, or an id changed on the way) is refused and the wait goes on for the rightful
//! rank; a rank created with another size is refused with a message saying so on both sides.
//!
//! Transfers: [`Mesh::transfer`] moves any number of messages to and from any peers at once over
//! nonblocking sockets and `poll`, so two ranks sending to each other never both wait on full socket
//! buffers (what `ncclGroupStart`/`ncclGroupEnd` give NCCL's sends and receives). Messages between a
//! pair are matched in the order they were issued, and each carries its length and its call's tag
//! first: a receiver that expects another length, or is in a call with another tag (the ranks passed
//! different arguments), fails with a status naming both instead of reading the message's bytes as
//! something else, and shuts that connection down (its bytes are out of step from then on).
//!
//! Failures: a peer that exits closes its sockets, and the others fail with ABORTED as soon as they
//! next talk to it; a peer that stops answering fails them with TIMEOUT at the deadline;
//! [`Mesh::shutdown`] (a communicator's abort) makes both happen for every peer at once.
//!
//! Users: the host backend's communicator (a test-only simulation of NCCL between OS processes) and
//! CUDA IPC, whose VMM handles are file descriptors passed between processes with SCM_RIGHTS
//! ([`Mesh::send_fds`]).

use crate::bail;
use crate::error::{try_vec, Error, Result, Status};
use std::collections::VecDeque;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Bytes of the random token that names one mesh's sockets.
pub const TOKEN_BYTES: usize = 16;
/// Bytes of the random secret every connection of one mesh carries (never part of a name).
pub const SECRET_BYTES: usize = 112;
/// Bytes of a [`MeshKey`]: the token, then the secret.
pub const KEY_BYTES: usize = TOKEN_BYTES + SECRET_BYTES;
const HELLO_MAGIC: u32 = 0x7266_6d68;
const HELLO_BYTES: usize = 12 + KEY_BYTES;
/// Replies to a hello.
pub(crate) const ACCEPTED: u8 = 0;
pub(crate) const OTHER_SIZE: u8 = 1;
pub(crate) const RANK_REFUSED: u8 = 2;
pub(crate) const WRONG_KEY: u8 = 3;
/// How long an accepting side waits for a connection's hello (a joining rank writes it at once; a
/// stray connection must not hold the rendezvous up).
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// Most descriptors passed in one SCM_RIGHTS message (the kernel's limit is 253).
const FDS_PER_MESSAGE: usize = 64;

/// When a wait must end, and the timeout it came from (for messages).
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        let now = Instant::now();
        Deadline {
            at: now.checked_add(timeout).unwrap_or(now + Duration::from_secs(u32::MAX.into())),
            timeout,
        }
    }

    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    pub fn expired(&self) -> bool {
        self.remaining().is_zero()
    }

    /// The TIMEOUT error for `what` not having happened in time.
    pub fn error(&self, what: impl std::fmt::Display) -> Error {
        Error::new(Status::Timeout, format!("{what} within the timeout ({:?})", self.timeout))
    }

    /// This deadline, or `limit` from now if that comes sooner.
    pub fn at_most(&self, limit: Duration) -> Deadline {
        let sooner = Deadline::after(limit);
        if sooner.at < self.at {
            sooner
        } else {
            *self
        }
    }

    /// Milliseconds to pass to `poll`: the time left, rounded up, at most `i32::MAX`.
    fn poll_ms(&self) -> i32 {
        let left = self.remaining();
        let ms = left.as_millis() + u128::from(left.subsec_nanos() % 1_000_000 != 0);
        ms.min(i32::MAX as u128) as i32
    }
}

/// The most files this process may open (its soft RLIMIT_NOFILE; unlimited when it cannot be read).
fn open_files_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return u64::MAX;
    }
    limit.rlim_cur
}

/// `count` ranks, naming the first few of `ranks`: a message stays short whatever the size.
pub(crate) fn some_ranks(mut ranks: impl Iterator<Item = usize>, count: usize) -> String {
    const NAMED: usize = 8;
    let named: Vec<usize> = ranks.by_ref().take(NAMED).collect();
    if count <= NAMED {
        format!("ranks {named:?}")
    } else {
        format!("{count} ranks ({named:?} and {} more)", count - NAMED)
    }
}

/// Fills `bytes` from the kernel's random source.
fn fill_random(bytes: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < bytes.len() {
        // SAFETY: writes at most the bytes left in `bytes`.
        let got = unsafe { libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0) };
        if got < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == ErrorKind::Interrupted {
                continue;
            }
            bail!(Status::InternalError, "getrandom failed: {err}");
        }
        filled += got as usize;
    }
    Ok(())
}

/// What names one mesh and admits its ranks: a token (public: it names the sockets) and a secret
/// (private: every hello carries it, and a connection without it is refused).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct MeshKey([u8; KEY_BYTES]);

impl MeshKey {
    /// A fresh key, every byte from the kernel's random source.
    pub fn random() -> Result<MeshKey> {
        let mut bytes = [0u8; KEY_BYTES];
        fill_random(&mut bytes)?;
        Ok(MeshKey(bytes))
    }

    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> MeshKey {
        MeshKey(bytes)
    }

    pub fn bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    fn token(&self) -> &[u8] {
        &self.0[..TOKEN_BYTES]
    }

    /// Whether `bytes` are this key, compared without stopping at the first difference.
    fn matches(&self, bytes: &[u8]) -> bool {
        bytes.len() == KEY_BYTES && self.0.iter().zip(bytes).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }

    /// The abstract socket address `place` (a rank, or "root") of this key's mesh listens on.
    pub(crate) fn address(&self, place: impl std::fmt::Display) -> Result<SocketAddr> {
        let token: String = self.token().iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("refit-mesh/{token}/{place}");
        SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::new(Status::InternalError, format!("abstract socket name {name}: {e}")))
    }
}

impl std::fmt::Debug for MeshKey {
    /// The token only: the secret stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let token: String = self.token().iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "MeshKey({token}, secret)")
    }
}

/// A joining rank's hello, as the accepting side read it.
pub(crate) struct Hello {
    pub rank: usize,
    pub size: usize,
    /// Whether it carried the accepting side's key.
    pub key_matches: bool,
}

/// The hello rank `rank` of `size` sends on every connection it opens.
pub(crate) fn hello_bytes(key: &MeshKey, rank: usize, size: usize) -> Vec<u8> {
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(size as u32).to_le_bytes());
    hello.extend_from_slice(key.bytes());
    hello
}

/// Reads a connection's hello, for at most [`HELLO_WAIT`]. `None` for anything but a mesh hello
/// (the caller drops the connection and goes on waiting).
pub(crate) fn read_hello(stream: &UnixStream, key: &MeshKey, deadline: Deadline) -> Option<Hello> {
    let mut hello = [0u8; HELLO_BYTES];
    read_exact(stream, &mut hello, deadline.at_most(HELLO_WAIT), "a joining rank's hello").ok()?;
    let word = |i: usize| u32::from_le_bytes(hello[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    if word(0) != HELLO_MAGIC {
        return None;
    }
    Some(Hello { rank: word(1) as usize, size: word(2) as usize, key_matches: key.matches(&hello[12..]) })
}

/// One connection per pair of ranks of one job.
pub struct Mesh {
    rank: usize,
    size: usize,
    /// This rank's name, held for the mesh's whole life (never accepted on after it formed): a
    /// process claiming this rank fails to take it.
    _listener: UnixListener,
    /// The connection to each other rank (None at this rank's own index).
    peers: Vec<Option<UnixStream>>,
    /// Connections shut down (by [`Mesh::shutdown`], or after a length mismatch put them out of step).
    closed: Vec<AtomicBool>,
}

/// One message of a [`Mesh::transfer`]: `len` bytes at host address `addr`, to or from `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message {
    pub peer: usize,
    pub addr: u64,
    pub len: u64,
}

impl Mesh {
    /// Joins the mesh of `key` as `rank` of `size`, waiting until `deadline` for the others:
    /// [`Mesh::listen`], then [`Listening::join`].
    pub fn connect(key: &MeshKey, rank: usize, size: usize, deadline: Deadline) -> Result<Mesh> {
        Mesh::listen(key, rank, size)?.join(deadline)
    }

    /// Whether rank `rank` of `size` could ever join a mesh, asked of nothing but the arguments and
    /// this process's limits (so that a join can refuse them before it asks anyone anything).
    /// Errors: INVALID_ARGUMENT (rank not below size; more ranks than a process may open files).
    pub fn check_ranks(rank: usize, size: usize) -> Result<()> {
        if size == 0 || rank >= size || size > u32::MAX as usize {
            bail!(Status::InvalidArgument, "rank {rank} of {size}: the rank must be below the size");
        }
        // Every rank keeps a connection to every other open, so more ranks than a process may open
        // files can never all join: refused before anything is allocated for each of them.
        let files = open_files_limit();
        if size as u64 > files {
            bail!(
                Status::InvalidArgument,
                "nranks {size} needs a connection to every other rank in each process, but a process may \
                 open at most {files} files (RLIMIT_NOFILE)"
            );
        }
        Ok(())
    }

    /// Takes rank `rank`'s name in the mesh of `key`, without waiting for anyone.
    /// Errors: INVALID_ARGUMENT ([`Mesh::check_ranks`]; the rank is taken by another process, of a
    /// mesh forming or formed).
    pub fn listen(key: &MeshKey, rank: usize, size: usize) -> Result<Listening> {
        Mesh::check_ranks(rank, size)?;
        let listener = UnixListener::bind_addr(&key.address(rank)?).map_err(|e| {
            if e.kind() == ErrorKind::AddrInUse {
                Error::invalid_argument(format!(
                    "rank {rank} of this communicator is already taken by another process (the \
                     communicator is forming or has formed)"
                ))
            } else {
                Error::new(Status::InternalError, format!("cannot listen for rank {rank}: {e}"))
            }
        })?;
        Ok(Listening { key: *key, rank, size, listener })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn peer(&self, peer: usize) -> Result<&UnixStream> {
        let stream = self.peers.get(peer).and_then(Option::as_ref).ok_or_else(|| {
            Error::invalid_argument(format!(
                "rank {peer} is not a peer of rank {} of {}",
                self.rank, self.size
            ))
        })?;
        if self.closed[peer].load(Ordering::Acquire) {
            bail!(Status::Aborted, "the connection to rank {peer} was shut down after an earlier failure");
        }
        Ok(stream)
    }

    /// Shuts the connection to `peer` down for good.
    fn close(&self, peer: usize) {
        self.closed[peer].store(true, Ordering::Release);
        if let Some(stream) = &self.peers[peer] {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Sends and receives every message, all at once, until all are done or `deadline`. Messages to
    /// one peer go in the order given, and so are those from one peer matched. Zero-length messages
    /// are sent too (they still carry their header). `tag` names the call: every rank's matching call
    /// passes the same (a digest of its arguments), and each message carries it.
    ///
    /// Errors: INVALID_ARGUMENT (a peer that is not another rank; a received length or tag other than
    /// the one expected), ABORTED (a peer closed its connection), TIMEOUT.
    ///
    /// # Safety
    /// Every send's `len` bytes at `addr` are readable, and every receive's writable, host memory until
    /// this returns; no receive overlaps another message.
    pub unsafe fn transfer(
        &self,
        sends: &[Message],
        recvs: &[Message],
        tag: u64,
        deadline: Deadline,
    ) -> Result<()> {
        let mut lanes: Vec<Lane> = (0..self.size).map(|_| Lane::default()).collect();
        for m in sends {
            self.peer(m.peer)?;
            lanes[m.peer].sends.push_back(Progress::new(*m, tag));
        }
        for m in recvs {
            self.peer(m.peer)?;
            lanes[m.peer].recvs.push_back(Progress::new(*m, tag));
        }
        loop {
            let mut fds = Vec::new();
            let mut owners = Vec::new();
            for (peer, lane) in lanes.iter().enumerate() {
                let mut events = 0;
                if !lane.sends.is_empty() {
                    events |= libc::POLLOUT;
                }
                if !lane.recvs.is_empty() {
                    events |= libc::POLLIN;
                }
                if events != 0 {
                    fds.push(libc::pollfd { fd: self.peer(peer)?.as_raw_fd(), events, revents: 0 });
                    owners.push(peer);
                }
            }
            if fds.is_empty() {
                return Ok(());
            }
            if deadline.expired() {
                return Err(deadline.error(format_args!(
                    "rank {} waited for ranks {owners:?}, which did not send or receive",
                    self.rank
                )));
            }
            poll(&mut fds, deadline)?;
            for (pollfd, &peer) in fds.iter().zip(&owners) {
                if pollfd.revents == 0 {
                    continue;
                }
                let stream = self.peer(peer)?;
                let lane = &mut lanes[peer];
                if !lane.sends.is_empty()
                    && pollfd.revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0
                {
                    lane.send_some(stream, peer)?;
                }
                if !lane.recvs.is_empty()
                    && pollfd.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0
                {
                    lane.receive_some(stream, peer).inspect_err(|e| {
                        if e.status == Status::InvalidArgument {
                            // The rest of that message would be read as the next one's: this
                            // connection is out of step for good.
                            self.close(peer);
                        }
                    })?;
                }
            }
        }
    }

    /// Passes open file descriptors to `peer` (who calls [`Mesh::recv_fds`] at the same point in the
    /// order of messages), with SCM_RIGHTS. The descriptors stay open here.
    pub fn send_fds(&self, peer: usize, fds: &[RawFd], deadline: Deadline) -> Result<()> {
        let stream = self.peer(peer)?;
        let count = (fds.len() as u64).to_le_bytes();
        write_all(stream, &count, deadline, "a descriptor count")?;
        for chunk in fds.chunks(FDS_PER_MESSAGE) {
            wait_fd(stream.as_raw_fd(), libc::POLLOUT, deadline)?;
            send_rights(stream.as_raw_fd(), chunk, peer)?;
        }
        Ok(())
    }

    /// Receives the descriptors `peer` passes with [`Mesh::send_fds`]; they are close-on-exec and
    /// owned by the caller.
    pub fn recv_fds(&self, peer: usize, deadline: Deadline) -> Result<Vec<OwnedFd>> {
        let stream = self.peer(peer)?;
        let mut count = [0u8; 8];
        read_exact(stream, &mut count, deadline, "a descriptor count")?;
        let count = u64::from_le_bytes(count) as usize;
        let mut fds = Vec::with_capacity(count.min(1 << 16));
        while fds.len() < count {
            wait_fd(stream.as_raw_fd(), libc::POLLIN, deadline)?;
            let want = (count - fds.len()).min(FDS_PER_MESSAGE);
            fds.extend(receive_rights(stream.as_raw_fd(), want, peer)?);
        }
        Ok(fds)
    }

    /// Shuts every connection down (both directions): this rank's pending and later transfers fail,
    /// and every peer sees the connection end, so their waits on this rank end too.
    pub fn shutdown(&self) {
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            self.close(peer);
        }
    }
}

/// A rank that holds its name in a mesh and has not joined the others yet.
pub struct Listening {
    key: MeshKey,
    rank: usize,
    size: usize,
    listener: UnixListener,
}

impl Listening {
    /// Connects to every lower rank and accepts every higher one, until `deadline`.
    /// Errors: INVALID_ARGUMENT (a lower rank refused this rank: another key, another size, or the
    /// rank taken there; a higher rank joined with another size), TIMEOUT (a rank did not join in
    /// time), ABORTED (a peer went away while joining).
    pub fn join(self, deadline: Deadline) -> Result<Mesh> {
        let Listening { key, rank, size, listener } = self;
        let mut peers: Vec<Option<UnixStream>> = try_vec(size, "the connections to the other ranks")?;
        peers.resize_with(size, || None);
        for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
            *slot = Some(join(&key, rank, size, peer, deadline)?);
        }
        let mut missing = size - rank - 1;
        listener.set_nonblocking(true).map_err(io_error("set_nonblocking"))?;
        while missing > 0 {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    if deadline.expired() {
                        let waiting = (rank + 1..size).filter(|&r| peers[r].is_none());
                        return Err(
                            deadline.error(format_args!("{} did not join", some_ranks(waiting, missing)))
                        );
                    }
                    wait_fd(listener.as_raw_fd(), libc::POLLIN, deadline)?;
                    continue;
                }
                Err(e) => return Err(io_error("accept")(e)),
            };
            stream.set_nonblocking(true).map_err(io_error("set_nonblocking"))?;
            let Some(hello) = read_hello(&stream, &key, deadline) else {
                continue; // not one of ours, or silent: drop the connection
            };
            let reply = |answer: u8| {
                let _ = write_all(&stream, &[answer], deadline.at_most(HELLO_WAIT), "a reply");
            };
            if !hello.key_matches {
                // A stray process, or an id changed on the way: refused, and the rightful rank may
                // still come.
                reply(WRONG_KEY);
                continue;
            }
            let peer = hello.rank;
            if hello.size != size {
                reply(OTHER_SIZE);
                bail!(
                    Status::InvalidArgument,
                    "rank {peer} joined with nranks {}; this rank ({rank}) has nranks {size}",
                    hello.size
                );
            }
            if peer <= rank || peer >= size || peers[peer].is_some() {
                // Ranks hold their names, so this is no rank of this mesh: refused, and the wait goes on.
                reply(RANK_REFUSED);
                continue;
            }
            write_all(&stream, &[ACCEPTED], deadline, "a reply")?;
            peers[peer] = Some(stream);
            missing -= 1;
        }
        let mut closed = try_vec(size, "the connections to the other ranks")?;
        closed.resize_with(size, || AtomicBool::new(false));
        Ok(Mesh { rank, size, _listener: listener, peers, closed })
    }
}

/// The messages to and from one peer still in progress, in order.
#[derive(Default)]
struct Lane {
    sends: VecDeque<Progress>,
    recvs: VecDeque<Progress>,
}

/// Bytes before each message's payload: its length, then its call's tag (little-endian).
const HEADER: u64 = 16;

/// One message: its header, then its payload; `done` counts both.
struct Progress {
    message: Message,
    /// The call's tag this side expects.
    tag: u64,
    /// The header sent, or the one being received.
    header: [u8; HEADER as usize],
    done: u64,
}

impl Progress {
    fn new(message: Message, tag: u64) -> Progress {
        let mut header = [0u8; HEADER as usize];
        header[..8].copy_from_slice(&message.len.to_le_bytes());
        header[8..].copy_from_slice(&tag.to_le_bytes());
        Progress { message, tag, header, done: 0 }
    }

    fn total(&self) -> u64 {
        HEADER + self.message.len
    }

    /// Where the part in progress (the header, then the payload) continues, and how many of its
    /// bytes are left.
    fn rest(&mut self) -> (*mut u8, usize) {
        if self.done < HEADER {
            (self.header[self.done as usize..].as_mut_ptr(), (HEADER - self.done) as usize)
        } else {
            let at = self.done - HEADER;
            ((self.message.addr + at) as usize as *mut u8, (self.message.len - at) as usize)
        }
    }
}

/// What one nonblocking send or recv did.
enum Moved {
    /// It moved this many bytes (0 from recv: the peer closed its end).
    Bytes(u64),
    /// The socket takes or holds nothing more now.
    Later,
    /// A signal interrupted it before it moved anything.
    Again,
}

/// The outcome of a nonblocking send or recv that returned `ret` (errno read right after it).
fn moved(ret: isize) -> std::io::Result<Moved> {
    if ret >= 0 {
        return Ok(Moved::Bytes(ret as u64));
    }
    let err = std::io::Error::last_os_error();
    match err.kind() {
        ErrorKind::WouldBlock => Ok(Moved::Later),
        ErrorKind::Interrupted => Ok(Moved::Again),
        _ => Err(err),
    }
}

impl Lane {
    /// Writes what the socket takes now.
    fn send_some(&mut self, stream: &UnixStream, peer: usize) -> Result<()> {
        while let Some(front) = self.sends.front_mut() {
            let (ptr, len) = front.rest();
            if len > 0 {
                // SAFETY: the header, or the caller's readable payload (transfer's contract).
                let sent = unsafe {
                    libc::send(stream.as_raw_fd(), ptr.cast(), len, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
                };
                match moved(sent).map_err(|err| peer_gone(peer, &err))? {
                    Moved::Bytes(n) => front.done += n,
                    Moved::Later => return Ok(()),
                    Moved::Again => continue,
                }
            }
            if front.done == front.total() {
                self.sends.pop_front();
            }
        }
        Ok(())
    }

    /// Reads what the socket holds now, never past the current message.
    fn receive_some(&mut self, stream: &UnixStream, peer: usize) -> Result<()> {
        while let Some(front) = self.recvs.front_mut() {
            let (ptr, len) = front.rest();
            if len > 0 {
                // SAFETY: the header, or the caller's writable payload (transfer's contract).
                let got = unsafe { libc::recv(stream.as_raw_fd(), ptr.cast(), len, libc::MSG_DONTWAIT) };
                match moved(got).map_err(|err| peer_gone(peer, &err))? {
                    Moved::Bytes(0) => return Err(peer_gone(peer, &"end of stream")),
                    Moved::Bytes(n) => front.done += n,
                    Moved::Later => return Ok(()),
                    Moved::Again => continue,
                }
                if front.done == HEADER {
                    let (sent, tag) = front.header.split_at(8);
                    let sent = u64::from_le_bytes(sent.try_into().expect("8 bytes"));
                    let tag = u64::from_le_bytes(tag.try_into().expect("8 bytes"));
                    if tag != front.tag {
                        bail!(
                            Status::InvalidArgument,
                            "rank {peer} is in call {tag:#x} where this rank is in call {:#x}: the ranks \
                             made different calls (other arguments, or another order)",
                            front.tag
                        );
                    }
                    if sent != front.message.len {
                        bail!(
                            Status::InvalidArgument,
                            "rank {peer} sent {sent} bytes where {} were expected: the ranks passed \
                             different sizes",
                            front.message.len
                        );
                    }
                }
            }
            if front.done == front.total() {
                self.recvs.pop_front();
            }
        }
        Ok(())
    }
}

fn peer_gone(peer: usize, why: &dyn std::fmt::Display) -> Error {
    Error::new(
        Status::Aborted,
        format!("rank {peer} closed its connection ({why}): its process exited or aborted the communicator"),
    )
}

pub(crate) fn io_error(call: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::new(Status::InternalError, format!("{call} on a mesh socket failed: {e}"))
}

/// `poll` until one of `fds` is ready or the deadline passes (then returns with no revents set).
fn poll(fds: &mut [libc::pollfd], deadline: Deadline) -> Result<()> {
    loop {
        // SAFETY: `fds` is a valid array of its length.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, deadline.poll_ms()) };
        if ready >= 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != ErrorKind::Interrupted {
            bail!(Status::InternalError, "poll on mesh sockets failed: {err}");
        }
    }
}

fn wait_fd(fd: RawFd, events: i16, deadline: Deadline) -> Result<()> {
    poll(&mut [libc::pollfd { fd, events, revents: 0 }], deadline)
}

/// Connects rank `rank` to the lower rank `peer`, retrying until the peer listens or the deadline.
fn join(key: &MeshKey, rank: usize, size: usize, peer: usize, deadline: Deadline) -> Result<UnixStream> {
    let target = key.address(peer)?;
    let mut pause = Duration::from_millis(1);
    let stream = loop {
        match UnixStream::connect_addr(&target) {
            Ok(stream) => break stream,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused | ErrorKind::NotFound | ErrorKind::Interrupted
                ) =>
            {
                if deadline.expired() {
                    return Err(deadline.error(format_args!("rank {peer} did not join")));
                }
                std::thread::sleep(pause.min(deadline.remaining()));
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(io_error("connect")(e)),
        }
    };
    stream.set_nonblocking(true).map_err(io_error("set_nonblocking"))?;
    write_all(&stream, &hello_bytes(key, rank, size), deadline, "the hello")?;
    let mut reply = [0u8; 1];
    read_exact(&stream, &mut reply, deadline, &format!("rank {peer}'s reply"))?;
    match reply[0] {
        ACCEPTED => Ok(stream),
        OTHER_SIZE => bail!(
            Status::InvalidArgument,
            "rank {peer} has another nranks than this rank ({rank}), which has {size}"
        ),
        WRONG_KEY => bail!(
            Status::InvalidArgument,
            "rank {peer} refused this process: its id is not the one rank {peer} joined with (its \
             secret differs: another job's id, or one changed on the way)"
        ),
        _ => bail!(Status::InvalidArgument, "rank {peer} refused this process as rank {rank}: it is taken"),
    }
}

/// Reads exactly `buf.len()` bytes from a nonblocking socket before the deadline.
pub(crate) fn read_exact(stream: &UnixStream, buf: &mut [u8], deadline: Deadline, what: &str) -> Result<()> {
    let (at, total) = (buf.as_mut_ptr(), buf.len());
    move_all(stream, total, Way::Read, deadline, what, |done| {
        // SAFETY: writes into the rest of `buf`.
        unsafe { libc::recv(stream.as_raw_fd(), at.add(done).cast(), total - done, libc::MSG_DONTWAIT) }
    })
}

/// Writes all of `data` to a nonblocking socket before the deadline.
pub(crate) fn write_all(stream: &UnixStream, data: &[u8], deadline: Deadline, what: &str) -> Result<()> {
    move_all(stream, data.len(), Way::Write, deadline, what, |done| {
        // SAFETY: reads from the rest of `data`.
        unsafe {
            libc::send(
                stream.as_raw_fd(),
                data[done..].as_ptr().cast(),
                data.len() - done,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        }
    })
}

/// Which way [`move_all`] moves bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Read,
    Write,
}

/// Calls `io(done)` (one nonblocking recv or send of the bytes after the first `done`, returning
/// what the call returned) until `total` bytes have moved, waiting for the socket to be ready in
/// between, before the deadline. A read of 0 bytes is the peer's end of stream.
fn move_all(
    stream: &UnixStream,
    total: usize,
    way: Way,
    deadline: Deadline,
    what: &str,
    mut io: impl FnMut(usize) -> isize,
) -> Result<()> {
    let (events, stuck, verb) = match way {
        Way::Read => (libc::POLLIN, "did not arrive", "reading"),
        Way::Write => (libc::POLLOUT, "could not be sent", "sending"),
    };
    let mut done = 0;
    while done < total {
        match moved(io(done)) {
            Ok(Moved::Bytes(0)) if way == Way::Read => {
                bail!(Status::Aborted, "the connection closed while reading {what}: the peer process exited")
            }
            Ok(Moved::Bytes(n)) => done += n as usize,
            Ok(Moved::Again) => {}
            Ok(Moved::Later) => {
                if deadline.expired() {
                    return Err(deadline.error(format_args!("{what} {stuck}")));
                }
                wait_fd(stream.as_raw_fd(), events, deadline)?;
            }
            Err(err) => bail!(Status::Aborted, "{verb} {what} failed: {err}"),
        }
    }
    Ok(())
}

/// One byte of payload carrying `fds` as SCM_RIGHTS.
fn send_rights(socket: RawFd, fds: &[RawFd], peer: usize) -> Result<()> {
    let payload = [fds.len() as u8];
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut libc::c_void, iov_len: 1 };
    let data_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(data_bytes) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; the fields set below point at live buffers.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = space as _;
    // SAFETY: the control buffer holds one header of `space` bytes, as CMSG_FIRSTHDR expects.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(data_bytes) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), fds.len());
    }
    loop {
        // SAFETY: a fully initialized msghdr over live buffers.
        let sent = unsafe { libc::sendmsg(socket, &header, libc::MSG_NOSIGNAL) };
        if sent == 1 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != ErrorKind::Interrupted {
            return Err(peer_gone(peer, &err));
        }
    }
}

/// Receives one SCM_RIGHTS message of `want` descriptors.
fn receive_rights(socket: RawFd, want: usize, peer: usize) -> Result<Vec<OwnedFd>> {
    let mut payload = [0u8; 1];
    let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: 1 };
    let data_bytes = (want * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(data_bytes) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; the fields set below point at live buffers.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = space as _;
    let got = loop {
        // SAFETY: buffers live for the call.
        let got = unsafe { libc::recvmsg(socket, &mut header, libc::MSG_CMSG_CLOEXEC) };
        if got >= 0 {
            break got;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != ErrorKind::Interrupted {
            return Err(peer_gone(peer, &err));
        }
    };
    if got == 0 {
        return Err(peer_gone(peer, &"end of stream"));
    }
    let mut fds = Vec::with_capacity(want);
    // SAFETY: walking the control messages the kernel wrote into `control`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&header);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&header, cmsg);
        }
    }
    if header.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() != want || usize::from(payload[0]) != want {
        bail!(
            Status::InvalidArgument,
            "rank {peer} passed {} file descriptors where {want} were expected",
            fds.len()
        );
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};

    fn deadline() -> Deadline {
        Deadline::after(Duration::from_secs(10))
    }

    /// A mesh of `size` ranks, each joined from its own thread (the same code as between processes).
    fn mesh(size: usize) -> Vec<Mesh> {
        mesh_of(MeshKey::random().unwrap(), size)
    }

    fn mesh_of(key: MeshKey, size: usize) -> Vec<Mesh> {
        let joins: Vec<_> = (0..size)
            .map(|rank| std::thread::spawn(move || Mesh::connect(&key, rank, size, deadline())))
            .collect();
        joins.into_iter().map(|j| j.join().unwrap().unwrap()).collect()
    }

    #[test]
    fn every_pair_exchanges_large_messages_at_once() {
        let meshes = mesh(3);
        // Each rank sends 3 MiB to every other rank at once: more than the socket buffers hold, so a
        // rank that only sent before receiving would wait forever.
        const LEN: usize = 3 << 20;
        let len = LEN;
        fn block(from: usize, to: usize) -> Vec<u8> {
            (0..LEN).map(|i| (i * 7 + from * 31 + to * 101) as u8).collect()
        }
        let handles: Vec<_> = meshes
            .into_iter()
            .map(|mesh| {
                std::thread::spawn(move || {
                    let me = mesh.rank();
                    let outgoing: Vec<Vec<u8>> = (0..3).map(|to| block(me, to)).collect();
                    let mut incoming: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; len]).collect();
                    let sends: Vec<Message> = (0..3)
                        .filter(|&p| p != me)
                        .map(|p| Message { peer: p, addr: outgoing[p].as_ptr() as u64, len: len as u64 })
                        .collect();
                    let recvs: Vec<Message> = (0..3)
                        .filter(|&p| p != me)
                        .map(|p| Message { peer: p, addr: incoming[p].as_mut_ptr() as u64, len: len as u64 })
                        .collect();
                    // SAFETY: the buffers live until transfer returns.
                    unsafe { mesh.transfer(&sends, &recvs, 1, deadline()) }.unwrap();
                    for p in (0..3).filter(|&p| p != me) {
                        assert!(incoming[p] == block(p, me), "rank {me} got wrong bytes from {p}");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn a_length_mismatch_is_named_and_a_closed_peer_is_aborted() {
        let mut meshes = mesh(2);
        let second = meshes.pop().unwrap();
        let first = meshes.pop().unwrap();
        let data = [1u8; 10];
        let mut into = [0u8; 12];
        let sender = std::thread::spawn(move || {
            let m = Message { peer: 1, addr: data.as_ptr() as u64, len: 10 };
            // The receiver may close before every byte is out: either outcome is fine here.
            // SAFETY: `data` lives for the call.
            let _ = unsafe { first.transfer(&[m], &[], 5, deadline()) };
        });
        let m = Message { peer: 0, addr: into.as_mut_ptr() as u64, len: 12 };
        // SAFETY: `into` lives for the call.
        let err = unsafe { second.transfer(&[], &[m], 5, deadline()) }.unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("sent 10 bytes where 12 were expected"), "{err}");
        sender.join().unwrap();
        // SAFETY: as above.
        let err = unsafe { second.transfer(&[], &[m], 5, deadline()) }.unwrap_err();
        assert_eq!(err.status, Status::Aborted, "the connection is out of step: {err}");

        let mut meshes = mesh(2);
        drop(meshes.remove(0));
        // SAFETY: as above.
        let err = unsafe { meshes[0].transfer(&[], &[Message { peer: 0, ..m }], 5, deadline()) }.unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");
        assert!(err.message.contains("rank 0 closed its connection"), "{err}");
    }

    #[test]
    fn a_silent_peer_times_out_and_a_shutdown_ends_waits() {
        let meshes = mesh(2);
        let mut into = [0u8; 4];
        let m = Message { peer: 1, addr: into.as_mut_ptr() as u64, len: 4 };
        let started = Instant::now();
        // SAFETY: `into` lives for the call.
        let err = unsafe { meshes[0].transfer(&[], &[m], 0, Deadline::after(Duration::from_millis(200))) }
            .unwrap_err();
        assert_eq!(err.status, Status::Timeout, "{err}");
        assert!(started.elapsed() >= Duration::from_millis(200));
        meshes[1].shutdown();
        // SAFETY: as above.
        let err = unsafe { meshes[0].transfer(&[], &[m], 0, deadline()) }.unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");
    }

    #[test]
    fn sizes_no_process_can_hold_are_refused_and_absent_ranks_are_named_briefly() {
        let key = MeshKey::random().unwrap();
        let short = Deadline::after(Duration::from_millis(1));
        let err = Mesh::connect(&key, 0, i32::MAX as usize, short).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("RLIMIT_NOFILE"), "{err}");
        let err = Mesh::connect(&key, 0, 100, short).err().unwrap();
        assert_eq!(err.status, Status::Timeout, "{err}");
        assert!(
            err.message.starts_with("99 ranks ([1, 2, 3, 4, 5, 6, 7, 8] and 91 more) did not join"),
            "{err}"
        );
        assert_eq!(some_ranks([3, 5].into_iter(), 2), "ranks [3, 5]");
    }

    #[test]
    fn joining_refuses_a_taken_rank_another_size_and_times_out() {
        let key = MeshKey::random().unwrap();
        let short = Deadline::after(Duration::from_millis(300));
        let err = Mesh::connect(&key, 1, 2, short).err().unwrap();
        assert_eq!(err.status, Status::Timeout, "{err}");
        assert_eq!(Mesh::connect(&key, 2, 2, short).err().unwrap().status, Status::InvalidArgument);

        let key = MeshKey::random().unwrap();
        let holder = std::thread::spawn(move || Mesh::connect(&key, 0, 3, deadline()));
        std::thread::sleep(Duration::from_millis(50));
        let err = Mesh::connect(&key, 0, 3, short).err().unwrap();
        assert!(err.message.contains("already taken"), "{err}");
        let err = Mesh::connect(&key, 1, 2, deadline()).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("nranks"), "{err}");
        let err = holder.join().unwrap().err().unwrap();
        assert!(err.message.contains("rank 1 joined with nranks 2"), "{err}");
    }

    #[test]
    fn a_taken_rank_is_refused_at_once_while_the_mesh_lives_and_free_after() {
        let key = MeshKey::random().unwrap();
        let meshes = mesh_of(key, 2);
        let started = Instant::now();
        for rank in 0..2 {
            let err = Mesh::connect(&key, rank, 2, deadline()).err().unwrap();
            assert_eq!(err.status, Status::InvalidArgument, "{err}");
            assert!(err.message.contains("already taken"), "{err}");
        }
        assert!(started.elapsed() < Duration::from_secs(5), "refused without waiting for anyone");
        drop(meshes);
        let listening = Mesh::listen(&key, 1, 2).unwrap();
        drop(listening);
    }

    #[test]
    fn a_hello_with_another_secret_is_refused_and_the_rightful_rank_still_joins() {
        let key = MeshKey::random().unwrap();
        let mut other = *key.bytes();
        other[TOKEN_BYTES + 7] ^= 1; // same token (same socket names), another secret
        let stray = MeshKey::from_bytes(other);
        let holder = std::thread::spawn(move || Mesh::connect(&key, 0, 2, deadline()));
        let err = Mesh::connect(&stray, 1, 2, deadline()).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("secret differs"), "{err}");
        let rightful = Mesh::connect(&key, 1, 2, deadline()).unwrap();
        let first = holder.join().unwrap().unwrap();
        assert_eq!((first.rank(), rightful.rank()), (0, 1));
    }

    #[test]
    fn descriptors_pass_between_ranks() {
        let meshes = mesh(2);
        let mut file = tempfile();
        file.write_all(b"passed along").unwrap();
        meshes[0].send_fds(1, &[file.as_raw_fd(), file.as_raw_fd()], deadline()).unwrap();
        let fds = meshes[1].recv_fds(0, deadline()).unwrap();
        assert_eq!(fds.len(), 2);
        let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
        received.seek(SeekFrom::Start(0)).unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "passed along");
    }

    fn tempfile() -> std::fs::File {
        // SAFETY: memfd_create with a valid name; the descriptor is owned by the File.
        let fd = unsafe { libc::memfd_create(c"refit-mesh-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }
}
