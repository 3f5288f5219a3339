//! The host backend's communicator link: a test-only simulation of NCCL between OS processes, so that
//! communicators, allgather over them and plans across processes run in CI without a GPU.
//!
//! "Device memory" is host memory, as everywhere on the host backend. Bytes move over the Unix socket
//! mesh ([`super::mesh`]) between processes of one machine; nothing here is meant to carry real data.
//! What is simulated faithfully is what callers depend on: stream-ordered steps (queued on a host
//! stream and run by its worker, so a caller that does not synchronize sees stale bytes, as on a GPU),
//! one order of steps on every rank, matched sends and receives, and the timeout and abort semantics:
//! a step waits for its peers at most the timeout (then TIMEOUT), a peer that exits or aborts ends it
//! at once (ABORTED), and either failure is kept and returned by every later call.

use super::super::host::{create_host_stream, destroy_host_stream, host_stream};
use super::super::host_copy::copy_runs;
use super::super::mesh::{Deadline, Mesh, Message, TOKEN_BYTES};
use super::super::Stream;
use super::{lengths_then_bytes, Health};
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
    timeout: Duration,
}

impl Shared {
    /// Runs one transfer step now (the caller holds its turn), keeping a failure.
    ///
    /// # Safety
    /// As for `Communicator::transfer`.
    unsafe fn step(&self, sends: &[Message], recvs: &[Message], local: &[Segment], tag: u64) -> Result<()> {
        self.health.check()?;
        let moved = self.mesh.transfer(sends, recvs, tag, Deadline::after(self.timeout));
        let result = moved.and_then(|()| {
            validate(local)?;
            copy_runs(local);
            Ok(())
        });
        result.map_err(|e| {
            // A failed step leaves the peers' matching steps incomplete: stop them too.
            self.mesh.shutdown();
            self.health.fail(e)
        })
    }
}

pub(super) struct HostLink {
    shared: Arc<Shared>,
    /// The stream a NULL stream stands for (the rank's "legacy default stream").
    default_stream: Stream,
}

impl HostLink {
    pub fn create(
        token: &[u8; TOKEN_BYTES],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<HostLink> {
        let mesh = Mesh::connect(token, rank, size, Deadline::after(timeout))?;
        let default_stream = create_host_stream()?;
        let shared =
            Arc::new(Shared { mesh, sequencer: Sequencer::default(), health: Health::default(), timeout });
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
            let _ = shared.sequencer.run(ticket, || unsafe { shared.step(&sends, &recvs, &local, tag) });
        });
        if let Err(err) = queued {
            // The ticket must still be taken, or every later step would wait for it forever.
            self.shared.sequencer.run(ticket, || ());
            return Err(err);
        }
        Ok(())
    }

    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        host_stream(self.resolve(stream))?.synchronize()?;
        self.shared.health.check()
    }

    pub fn allgather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.shared.health.check()?;
        let ticket = self.shared.sequencer.issue();
        let shared = &self.shared;
        shared.sequencer.run(ticket, || {
            lengths_then_bytes(shared.mesh.rank(), shared.mesh.size(), mine, |sends, recvs, tag| {
                // SAFETY: host buffers owned by lengths_then_bytes for the length of the call.
                unsafe { shared.step(sends, recvs, &[], tag) }
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
