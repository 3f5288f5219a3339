//! The rendezvous root of a host-backend communicator id: what makes an id good for one communicator
//! only, as NCCL's bootstrap root does for its ids.
//!
//! [`open`] runs in the process that makes the id: a thread listens on `refit-mesh/<token>/root`.
//! A joining rank asks it before meeting its peers whether it may ([`Ask::Check`]: the process holds
//! the id's secret, and the id is not spent; asked before and again after taking the rank's name,
//! see `HostLink::create`), so that a stale or stray process is refused at once instead of waiting
//! for peers that never come; and once the ranks have met ([`Ask::Register`]), to be counted. Once
//! every rank of the communicator is registered the root stops listening, for every process that
//! may hold a copy of its socket (a `fork` after the id was made): the id is spent, and a later join
//! with it (a stale process, or the same processes after destroying the communicator) is refused at
//! once. A join that failed before its ranks met spends nothing. Where no process answers at all
//! (the maker forked, then exited), a join waits its timeout.
//!
//! Ranks meet each other over the mesh ([`super::super::mesh`]), whose hellos carry the secret too.

use super::super::mesh::{
    hello_bytes, io_error, read_exact, read_hello, write_all, Deadline, MeshKey, ACCEPTED, RANK_REFUSED,
    WRONG_KEY,
};
use crate::bail;
use crate::error::{Error, Result, Status};
use std::collections::{HashMap, HashSet};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

const PLACE: &str = "root";

/// What a joining rank asks the root.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Ask {
    /// May this process join as this rank (nothing is recorded)?
    Check = 1,
    /// The ranks have met: count this rank (the last one spends the id).
    Register = 2,
}

/// Starts the root of a new id's `key` in this process (which must live until every rank has joined).
pub(super) fn open(key: &MeshKey) -> Result<()> {
    let listener = UnixListener::bind_addr(&key.address(PLACE)?)
        .map_err(|e| Error::new(Status::InternalError, format!("cannot listen for the id's ranks: {e}")))?;
    let key = *key;
    std::thread::Builder::new()
        .name("refit-comm-root".into())
        .spawn(move || serve(&listener, &key))
        .map_err(|e| Error::new(Status::InternalError, format!("no thread for the id's root: {e}")))?;
    Ok(())
}

/// Answers ranks until the ranks 0..n of some nranks n have all registered with that n, then stops
/// listening.
fn serve(listener: &UnixListener, key: &MeshKey) {
    let mut registered = HashSet::new();
    let mut registered_with_size: HashMap<usize, usize> = HashMap::new();
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                log::warn!("the rendezvous root of a communicator id could not accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        let deadline = Deadline::after(Duration::from_secs(5));
        let Some(hello) = read_hello(&stream, key, deadline) else {
            continue;
        };
        let mut ask = [0u8; 1];
        if read_exact(&stream, &mut ask, deadline, "the question").is_err() {
            continue;
        }
        let answer = if !hello.key_matches {
            WRONG_KEY
        } else if hello.rank >= hello.size || registered.contains(&hello.rank) {
            RANK_REFUSED
        } else {
            ACCEPTED
        };
        let mut spent = false;
        if answer == ACCEPTED && ask[0] == Ask::Register as u8 {
            registered.insert(hello.rank);
            let count = registered_with_size.entry(hello.size).or_default();
            *count += 1;
            spent = *count == hello.size;
        }
        if spent {
            // Before the last rank hears back, so that nothing can join after it: a listening Unix
            // socket that is shut down refuses connections in every process holding it.
            // SAFETY: shutdown of a descriptor this function borrows.
            unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let _ = write_all(&stream, &[answer], deadline, "the root's answer");
        if spent {
            return;
        }
    }
}

/// The refusal of a join whose id's root no longer answers.
fn spent() -> Error {
    Error::invalid_argument(
        "the id is spent: its communicator has formed (an id forms one communicator; make a new one with \
         refit_comm_get_unique_id), or the process that made it exited before every rank joined",
    )
}

/// Asks the id's root `ask` for this process as `rank` of `size`.
/// Errors: INVALID_ARGUMENT (the id is spent, or its maker exited, also where the root closed the
/// connection unanswered as it stopped listening; the rank registered before; the id's secret is not
/// the root's), TIMEOUT (the root did not answer in time).
pub(super) fn ask(key: &MeshKey, rank: usize, size: usize, ask: Ask, deadline: Deadline) -> Result<()> {
    let stream = match UnixStream::connect_addr(&key.address(PLACE)?) {
        Ok(stream) => stream,
        // The root listens from the moment the id exists: refused means it is gone.
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) => {
            return Err(spent())
        }
        Err(e) => return Err(io_error("connect")(e)),
    };
    stream.set_nonblocking(true).map_err(io_error("set_nonblocking"))?;
    let mut question = hello_bytes(key, rank, size);
    question.push(ask as u8);
    let mut answer = [0u8; 1];
    write_all(&stream, &question, deadline, "the question to the id's root")
        .and_then(|()| read_exact(&stream, &mut answer, deadline, "the answer of the id's root"))
        // A connection the root had not yet accepted when the last rank registered is reset when
        // it stops listening (as one is when its process exits): the id was spent meanwhile.
        .map_err(|e| if e.status == Status::Aborted { spent() } else { e })?;
    match answer[0] {
        ACCEPTED => Ok(()),
        WRONG_KEY => bail!(
            Status::InvalidArgument,
            "the id's secret is not the one its rendezvous holds (another job's id, or one changed on the way)"
        ),
        _ => bail!(
            Status::InvalidArgument,
            "rank {rank} of this id has joined before, in another process or an earlier join with this id \
             (an id forms one communicator)"
        ),
    }
}
