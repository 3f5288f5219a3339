//! Persistent per-rank threads: started once per group, each with its device bound, so that
//! `run` costs two channel hops per rank instead of a thread spawn.

use super::barrier::AbortableBarrier;
use crate::backend::{Backend, Stream};
use crate::error::{Error, Result, Status};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// The per-rank body: `(rank, the rank's stream) -> Result`.
pub type RankFn<'a> = dyn Fn(usize, Stream) -> Result<()> + Sync + 'a;

thread_local! {
    /// (group id, rank) of the rank thread we are on, while it runs a callback.
    static CURRENT_RANK: Cell<Option<(u64, usize)>> = const { Cell::new(None) };
}

/// The rank this thread is running a callback for, in the group with id `group_id`.
pub fn current_rank(group_id: u64) -> Option<usize> {
    CURRENT_RANK.with(|c| c.get()).filter(|(g, _)| *g == group_id).map(|(_, r)| r)
}

/// Whether this thread is any group's rank thread, inside a callback.
pub fn inside_any_run() -> bool {
    CURRENT_RANK.with(|c| c.get()).is_some()
}

struct Job {
    /// Lifetime-erased pointer to the caller's closure; `RankWorkers::run` waits for every rank to
    /// finish with it before returning, so it never dangles.
    body: *const RankFn<'static>,
    run: Arc<RunState>,
}

// SAFETY: the closure is Sync and outlives the job (see `body`).
unsafe impl Send for Job {}

struct RunState {
    first_error: Mutex<Option<Error>>,
    remaining: Mutex<usize>,
    finished: Condvar,
}

pub struct RankWorkers {
    senders: Vec<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    barrier: Arc<AbortableBarrier>,
}

impl RankWorkers {
    /// One thread per rank; rank r binds `devices[r]` and passes `streams[r]` to each callback.
    pub fn start(
        group_id: u64,
        backend: Arc<dyn Backend>,
        devices: &[usize],
        streams: &[Stream],
        barrier: Arc<AbortableBarrier>,
    ) -> Result<RankWorkers> {
        let mut senders = Vec::with_capacity(devices.len());
        let mut threads = Vec::with_capacity(devices.len());
        for (rank, (&device, &stream)) in devices.iter().zip(streams).enumerate() {
            let (sender, receiver) = channel::<Job>();
            let backend = Arc::clone(&backend);
            let barrier = Arc::clone(&barrier);
            let thread = std::thread::Builder::new()
                .name(format!("refit-rank{rank}"))
                .spawn(move || {
                    let bound = backend.bind(device);
                    while let Ok(job) = receiver.recv() {
                        let result = match &bound {
                            Ok(()) => {
                                CURRENT_RANK.with(|c| c.set(Some((group_id, rank))));
                                // SAFETY: see Job::body.
                                let body = unsafe { &*job.body };
                                let outcome = catch_unwind(AssertUnwindSafe(|| body(rank, stream)));
                                CURRENT_RANK.with(|c| c.set(None));
                                outcome.unwrap_or_else(|panic| {
                                    let what = panic
                                        .downcast_ref::<&str>()
                                        .map(|s| s.to_string())
                                        .or_else(|| panic.downcast_ref::<String>().cloned())
                                        .unwrap_or_default();
                                    Err(Error::new(
                                        Status::InternalError,
                                        format!("rank {rank} panicked: {what}"),
                                    ))
                                })
                            }
                            Err(err) => Err(err
                                .clone()
                                .context(format!("rank {rank} could not bind device {device}"))),
                        };
                        if let Err(err) = result {
                            let mut first = job.run.first_error.lock().unwrap_or_else(|p| p.into_inner());
                            if first.is_none() {
                                *first = Some(err);
                            }
                            drop(first);
                            // Recorded first, then released: a rank that fails because of the abort
                            // never wins over the rank that caused it.
                            barrier.abort();
                        }
                        let mut remaining = job.run.remaining.lock().unwrap_or_else(|p| p.into_inner());
                        *remaining -= 1;
                        if *remaining == 0 {
                            job.run.finished.notify_all();
                        }
                    }
                })
                .map_err(|e| {
                    Error::new(Status::OutOfMemory, format!("cannot start rank thread {rank}: {e}"))
                })?;
            senders.push(sender);
            threads.push(thread);
        }
        Ok(RankWorkers { senders, threads, barrier })
    }

    /// Runs `body` on every rank thread at once and waits for all of them. Returns the first error
    /// (in time); the barrier is aborted on the first error and reset before returning.
    pub fn run(&self, body: &RankFn<'_>) -> Result<()> {
        let run = Arc::new(RunState {
            first_error: Mutex::new(None),
            remaining: Mutex::new(self.senders.len()),
            finished: Condvar::new(),
        });
        // SAFETY: only erases the lifetime; we wait below until no rank uses the pointer.
        let body: *const RankFn<'static> = unsafe { std::mem::transmute(body as *const RankFn<'_>) };
        let mut sent = 0;
        for sender in &self.senders {
            if sender.send(Job { body, run: Arc::clone(&run) }).is_err() {
                break;
            }
            sent += 1;
        }
        {
            let mut remaining = run.remaining.lock().unwrap_or_else(|p| p.into_inner());
            *remaining -= self.senders.len() - sent;
            if sent < self.senders.len() {
                self.barrier.abort();
            }
            while *remaining > 0 {
                remaining = run.finished.wait(remaining).unwrap_or_else(|p| p.into_inner());
            }
        }
        let error = run.first_error.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.barrier.reset();
        if sent < self.senders.len() {
            return Err(Error::new(Status::InternalError, "a rank thread has stopped"));
        }
        error.map_or(Ok(()), Err)
    }
}

impl Drop for RankWorkers {
    fn drop(&mut self) {
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
