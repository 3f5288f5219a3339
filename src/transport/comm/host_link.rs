//! The host backend's communicator link: a test-only simulation of NCCL between OS processes, so that
//! communicators, allgather over them and plans across processes run in CI without a GPU.
//!
//! "Device memory" is host memory, as everywhere on the host backend. Bytes move over the Unix socket
//! mesh ([`super::mesh`]) between processes of one machine; nothing here is meant to carry real data.
//! What is simulated faithfully is what callers depend on: stream-ordered steps (queued on a host
//! stream and run by its worker, so a caller that does not synchronize sees stale bytes, as on a GPU),
//! one order of steps on every rank, matched sends and receives, and the timeout and abort semantics:
//! a step waits for its peers at most the timeout (then TIMEOUT), a peer that exits or aborts ends it
//! at once (ABORTED), and either failure is kept and returned by every later call. A collective step
//! whose ranks passed different arguments ([`Agreement`]) is refused on every rank before anything
//! moves; a refusal is reported once and is no failure.

use super::super::host::{create_host_stream, destroy_host_stream, host_stream};
use super::super::host_copy::copy_runs;
use super::super::mesh::{Deadline, Mesh, MeshKey, Message};
use super::super::Stream;
use super::root::{self, Ask};
use super::{lengths_then_bytes, Agreement, Health, AGREE_TAG};
use crate::error::{Error, Result};
use crate::segment::check::validate;
use crate::segment::Segment;
use crate::sync::{lock, wait};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Runs steps one at a time in the order they were issued, whatever thread or stream runs them: the
/// ranks issue steps in one order, so they run them in one order, and the mesh's messages match.
#[derive(Default)]
struct Sequencer {
    state: Mutex<(u64, u64)>,
    turn: Condvar,
}

impl Sequencer {
    /// The next step's ticket (in issue order).
    fn issue(&self) -> u64 {
        let mut state = lock(&self.state);
        state.0 += 1;
        state.0
    }

    /// Waits until every step issued before `ticket` has run, runs `step`, and lets the next one go
    /// (also when `step` fails, so that no later step waits forever).
    fn run<T>(&self, ticket: u64, step: impl FnOnce() -> T) -> T {
        let mut state = lock(&self.state);
        while state.1 + 1 != ticket {
            state = wait(&self.turn, state);
        }
        drop(state);
        let result = step();
        lock(&self.state).1 = ticket;
        self.turn.notify_all();
        result
    }
}

/// What a queued step shares with the link.
struct Shared {
    mesh: Mesh,
    sequencer: Sequencer,
    health: Health,
    /// The first refused step not reported yet (by `synchronize`).
    refused: Mutex<Option<Error>>,
    timeout: Duration,
}

impl Shared {
    /// Runs one transfer step now (the caller holds its turn), keeping a failure. With an
    /// `agreement`, the ranks compare it first, and a step they disagree on is refused (kept for
    /// `synchronize`, not as a failure) before anything moves.
    ///
    /// # Safety
    /// As for `Communicator::transfer`.
    unsafe fn step(
        &self,
        sends: &[Message],
        recvs: &[Message],
        local: &[Segment],
        tag: u64,
        agreement: Option<&Agreement>,
    ) -> Result<()> {
        self.health.check()?;
        let deadline = Deadline::after(self.timeout);
        if let Some(agreement) = agreement {
            match self.disagreement(agreement, deadline) {
                Ok(None) => {}
                Ok(Some(refusal)) => {
                    lock(&self.refused).get_or_insert_with(|| refusal.clone());
                    return Err(refusal);
                }
                Err(e) => return Err(self.fail(e)),
            }
        }
        let moved = self.mesh.transfer(sends, recvs, tag, deadline);
        let result = moved.and_then(|()| {
            validate(local)?;
            copy_runs(local);
            Ok(())
        });
        result.map_err(|e| self.fail(e))
    }

    /// Every rank's digest of `agreement`, exchanged with every other rank; the refusal when they
    /// differ. Each message is whole when this returns, so the connections stay in step.
    fn disagreement(&self, agreement: &Agreement, deadline: Deadline) -> Result<Option<Error>> {
        let (rank, size) = (self.mesh.rank(), self.mesh.size());
        let mine = agreement.digest.to_le_bytes();
        let mut theirs = vec![[0u8; 8]; size];
        let others = || (0..size).filter(|&p| p != rank);
        let sends: Vec<Message> =
            others().map(|p| Message { peer: p, addr: mine.as_ptr() as u64, len: 8 }).collect();
        let recvs: Vec<Message> =
            others().map(|p| Message { peer: p, addr: theirs[p].as_mut_ptr() as u64, len: 8 }).collect();
        // SAFETY: the buffers above live until the transfer returns.
        unsafe { self.mesh.transfer(&sends, &recvs, AGREE_TAG, deadline) }?;
        theirs[rank] = mine;
        let digests: Vec<u64> = theirs.iter().map(|d| u64::from_le_bytes(*d)).collect();
        Ok(agreement.verdict(rank, &digests))
    }

    /// Keeps `error` as the communicator's failure and stops the peers' matching steps too (a failed
    /// step leaves them incomplete).
    fn fail(&self, error: Error) -> Error {
        self.mesh.shutdown();
        self.health.fail(error)
    }
}

pub(super) struct HostLink {
    shared: Arc<Shared>,
    /// The stream a NULL stream stands for (the rank's "legacy default stream").
    default_stream: Stream,
}

impl HostLink {
    /// Checks the ranks against this process's limits, asks the id's root whether it may join (a
    /// spent id or one with another secret fails here, at once), takes rank `rank`'s name (a rank
    /// held by a communicator forming or formed fails here, at once), asks the root again, meets the
    /// other ranks, and registers with the root (the last rank to do so spends the id).
    ///
    /// The root is asked before the name is taken so that a join refused for a spent id never holds
    /// a rank's name, not even for a moment (another process claiming that rank meanwhile would be
    /// told it is taken). It is asked again once the name is held because a name is free again once
    /// its communicator is destroyed: a join that passed the first question while that communicator
    /// formed, and took the name after it was destroyed, is refused there, at once, instead of
    /// waiting its whole timeout for peers that have gone.
    pub fn create(key: &MeshKey, rank: usize, size: usize, timeout: Duration) -> Result<HostLink> {
        let deadline = Deadline::after(timeout);
        Mesh::check_ranks(rank, size)?;
        root::ask(key, rank, size, Ask::Check, deadline)?;
        let listening = Mesh::listen(key, rank, size)?;
        root::ask(key, rank, size, Ask::Check, deadline)?;
        let mesh = listening.join(deadline)?;
        root::ask(key, rank, size, Ask::Register, deadline)?;
        let default_stream = create_host_stream()?;
        let shared = Arc::new(Shared {
            mesh,
            sequencer: Sequencer::default(),
            health: Health::default(),
            refused: Mutex::new(None),
            timeout,
        });
        Ok(HostLink { shared, default_stream })
    }

    pub fn health(&self) -> &Health {
        &self.shared.health
    }

    pub fn abort(&self, why: Error) {
        self.shared.health.fail(why);
        self.shared.mesh.shutdown();
    }

    fn resolve(&self, stream: Stream) -> Stream {
        if stream == Stream::NULL {
            self.default_stream
        } else {
            stream
        }
    }

    /// Queues the step on the host stream; it runs in issue order, and a failure is kept.
    ///
    /// # Safety
    /// As for `Communicator::transfer`.
    pub unsafe fn transfer(
        &self,
        sends: &[Message],
        recvs: &[Message],
        local: &[Segment],
        tag: u64,
        agreement: Option<Agreement>,
        stream: Stream,
    ) -> Result<()> {
        self.shared.health.check()?;
        validate(local)?;
        let worker = host_stream(self.resolve(stream))?;
        let ticket = self.shared.sequencer.issue();
        let shared = Arc::clone(&self.shared);
        let (sends, recvs, local) = (sends.to_vec(), recvs.to_vec(), local.to_vec());
        let queued = worker.enqueue(move || {
            // SAFETY: the caller promised the memory stays valid until the queued step has run.
            let _ = shared
                .sequencer
                .run(ticket, || unsafe { shared.step(&sends, &recvs, &local, tag, agreement.as_ref()) });
        });
        if let Err(err) = queued {
            // The ticket must still be taken, or every later step would wait for it forever.
            self.shared.sequencer.run(ticket, || ());
            return Err(err);
        }
        Ok(())
    }

    /// Waits for `stream`, then returns the communicator's failure, or else the first refused step
    /// not reported yet (once).
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        host_stream(self.resolve(stream))?.synchronize()?;
        self.shared.health.check()?;
        match lock(&self.shared.refused).take() {
            Some(refusal) => Err(refusal),
            None => Ok(()),
        }
    }

    pub fn allgather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.shared.health.check()?;
        let ticket = self.shared.sequencer.issue();
        let shared = &self.shared;
        shared.sequencer.run(ticket, || {
            lengths_then_bytes(shared.mesh.rank(), shared.mesh.size(), mine, |sends, recvs, tag| {
                // SAFETY: host buffers owned by lengths_then_bytes for the length of the call.
                unsafe { shared.step(sends, recvs, &[], tag, None) }
            })
        })
    }
}

impl Drop for HostLink {
    fn drop(&mut self) {
        // Steps still queued on the default stream run (or fail at their deadline) first.
        let _ = host_stream(self.default_stream).and_then(|s| s.synchronize());
        let _ = destroy_host_stream(self.default_stream);
    }
}
