//! Persistent per-rank threads: started once per group, each with its device bound, so that
//! handing every rank a body costs a channel hop per rank instead of a thread spawn.

use super::barrier::AbortableBarrier;
use super::spin::spin_while;
use crate::error::{Error, Result, Status};
use crate::sync::{lock, wait};
use crate::transport::{Backend, Stream};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
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
    /// Lifetime-erased pointer to the caller's closure. The dispatching call waits until every body
    /// it handed out has returned, and a thread dereferences it only after claiming its rank, so it
    /// never dangles.
    body: *const RankFn<'static>,
    run: Arc<RunState>,
}

// SAFETY: the closure is Sync and outlives every use of the pointer (see `body`).
unsafe impl Send for Job {}

/// One dispatch: who has taken each rank's body, how many are still running, the first error.
struct RunState {
    /// Set by whoever runs rank r's body: its thread, or (`fan_out`) the calling thread.
    claimed: Vec<AtomicBool>,
    /// Bodies not finished yet, claimed or not.
    remaining: AtomicUsize,
    first_error: Mutex<Option<Error>>,
    /// Set by a caller that stopped spinning on `remaining` and is about to block on `finished`:
    /// only then does the last body to finish pay for a wake-up (a system call).
    caller_blocked: AtomicBool,
    finish_lock: Mutex<()>,
    finished: Condvar,
    /// Whether bodies meet at the barrier (`run`, not `fan_out`): then a body that returns departs,
    /// and ranks still waiting for it, or arriving later, are released.
    departs: bool,
}

impl RunState {
    fn new(ranks: usize, departs: bool) -> RunState {
        RunState {
            departs,
            claimed: (0..ranks).map(|_| AtomicBool::new(false)).collect(),
            remaining: AtomicUsize::new(ranks),
            first_error: Mutex::new(None),
            caller_blocked: AtomicBool::new(false),
            finish_lock: Mutex::new(()),
            finished: Condvar::new(),
        }
    }

    /// Takes rank `rank`'s body; false when someone else already has.
    fn claim(&self, rank: usize) -> bool {
        !self.claimed[rank].swap(true, Ordering::AcqRel)
    }

    /// Records rank `rank`'s body's outcome. A failure is recorded first, then the barrier is broken,
    /// so that a rank failing because of the abort never wins over the rank that caused it. A body
    /// that returns normally departs (when bodies meet at the barrier): it will never arrive again.
    fn finish(&self, rank: usize, result: Result<()>, barrier: &AbortableBarrier) {
        match result {
            Err(err) => {
                let mut first = lock(&self.first_error);
                if first.is_none() {
                    *first = Some(err);
                }
                drop(first);
                barrier.abort();
            }
            Ok(()) if self.departs => barrier.depart(rank),
            Ok(()) => {}
        }
        // SeqCst here and in `wait_until_finished`: either the caller sees the count reach zero, or
        // this sees the caller blocked.
        if self.remaining.fetch_sub(1, Ordering::SeqCst) == 1 && self.caller_blocked.load(Ordering::SeqCst) {
            // Under the lock: a caller between its last check and its wait cannot miss this.
            let _guard = lock(&self.finish_lock);
            self.finished.notify_all();
        }
    }

    /// Returns once every body has finished (spinning first: they usually take microseconds).
    fn wait_until_finished(&self) {
        if !spin_while(|| self.remaining.load(Ordering::Acquire) > 0) {
            return;
        }
        let mut guard = lock(&self.finish_lock);
        self.caller_blocked.store(true, Ordering::SeqCst);
        while self.remaining.load(Ordering::SeqCst) > 0 {
            guard = wait(&self.finished, guard);
        }
    }
}

/// Runs a claimed body, turning a panic into an error (it must not unwind past the dispatcher while
/// other threads still hold the body).
fn run_body(body: &RankFn<'_>, rank: usize, stream: Stream) -> Result<()> {
    catch_unwind(AssertUnwindSafe(|| body(rank, stream))).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(Error::new(Status::InternalError, format!("rank {rank} panicked: {what}")))
    })
}

/// The next job for a rank thread: spins briefly on the queue (a loop of collectives hands over the
/// next job within microseconds), then blocks. None once the group is dropped.
fn next_job(receiver: &Receiver<Job>) -> Option<Job> {
    let mut job = None;
    spin_while(|| match receiver.try_recv() {
        Ok(received) => {
            job = Some(received);
            false
        }
        Err(TryRecvError::Empty) => true,
        Err(TryRecvError::Disconnected) => false,
    });
    job.or_else(|| receiver.recv().ok())
}

pub struct RankWorkers {
    senders: Vec<Sender<Job>>,
    streams: Vec<Stream>,
    threads: Vec<JoinHandle<()>>,
    barrier: Arc<AbortableBarrier>,
}

impl RankWorkers {
    /// One thread per rank; rank r binds `devices[r]` and passes `streams[r]` to each body.
    pub fn start(
        group_id: u64,
        backend: Arc<dyn Backend>,
        devices: &[i32],
        streams: &[Stream],
        barrier: Arc<AbortableBarrier>,
    ) -> Result<RankWorkers> {
        let mut workers = RankWorkers {
            senders: Vec::with_capacity(devices.len()),
            streams: streams.to_vec(),
            threads: Vec::with_capacity(devices.len()),
            barrier,
        };
        for (rank, (&device, &stream)) in devices.iter().zip(streams).enumerate() {
            let (sender, receiver) = channel::<Job>();
            let backend = Arc::clone(&backend);
            let barrier = Arc::clone(&workers.barrier);
            let thread = std::thread::Builder::new()
                .name(format!("refit-rank{rank}"))
                .spawn(move || {
                    let bound = backend.bind(device);
                    while let Some(job) = next_job(&receiver) {
                        if !job.run.claim(rank) {
                            continue; // the caller of fan_out ran it
                        }
                        let result = match &bound {
                            Ok(()) => {
                                CURRENT_RANK.with(|c| c.set(Some((group_id, rank))));
                                // SAFETY: claimed above (see Job::body).
                                let result = run_body(unsafe { &*job.body }, rank, stream);
                                CURRENT_RANK.with(|c| c.set(None));
                                result
                            }
                            Err(err) => Err(err
                                .clone()
                                .context(format!("rank {rank} could not bind device {device}"))),
                        };
                        job.run.finish(rank, result, &barrier);
                    }
                })
                .map_err(|e| {
                    Error::new(Status::OutOfMemory, format!("cannot start rank thread {rank}: {e}"))
                })?;
            workers.senders.push(sender);
            workers.threads.push(thread);
        }
        Ok(workers)
    }

    /// Runs `body` on every rank thread at once and waits for all of them. Returns the first error
    /// (in time); the barrier is aborted on the first error and reset before returning. When every
    /// body succeeded but one returned while others waited for it at the barrier (they were released
    /// with `Aborted`), returns `Aborted` naming it: the bodies did not make the same collective calls.
    pub fn run(&self, body: &RankFn<'_>) -> Result<()> {
        let (run, stopped) = self.hand_out(body, 0, true);
        for rank in stopped {
            // Its thread will never take it: count it as failed, which releases the ranks that wait
            // for it.
            run.claim(rank);
            let stopped = Error::new(Status::InternalError, format!("rank {rank}'s thread has stopped"));
            run.finish(rank, Err(stopped), &self.barrier);
        }
        self.finish(run)
    }

    /// Runs `body` for every rank, at once where the rank threads are awake: the calling thread
    /// runs rank 0's body, then every body its rank thread has not taken yet (a blocked thread takes
    /// several microseconds to wake), so the call never costs much more than running the bodies one
    /// after another on the calling thread. For bodies that may run on any thread and never wait for
    /// each other (no barrier). Returns the first error (in time).
    pub fn fan_out(&self, body: &RankFn<'_>) -> Result<()> {
        let (run, _) = self.hand_out(body, 1, false);
        for rank in 0..self.senders.len() {
            if run.claim(rank) {
                let result = run_body(body, rank, self.streams[rank]);
                run.finish(rank, result, &self.barrier);
            }
        }
        self.finish(run)
    }

    /// Queues `body` for the rank threads from `first` on; returns the dispatch and the ranks whose
    /// thread has stopped (it dropped its queue, so it will never take the body). `departs`: as
    /// `RunState::departs`.
    fn hand_out(&self, body: &RankFn<'_>, first: usize, departs: bool) -> (Arc<RunState>, Vec<usize>) {
        let run = Arc::new(RunState::new(self.senders.len(), departs));
        // SAFETY: only erases the lifetime; `finish` waits until no thread uses the pointer.
        let body: *const RankFn<'static> = unsafe { std::mem::transmute(body as *const RankFn<'_>) };
        let stopped = (first..self.senders.len())
            .filter(|&rank| self.senders[rank].send(Job { body, run: Arc::clone(&run) }).is_err())
            .collect();
        (run, stopped)
    }

    /// Waits for every body of `run`, resets the barrier, and returns the first error, or one naming
    /// the rank whose body returned while others waited for it (see `run`).
    fn finish(&self, run: Arc<RunState>) -> Result<()> {
        run.wait_until_finished();
        let error = lock(&run.first_error).take();
        let stranded = self.barrier.stranded().filter(|_| run.departs);
        self.barrier.reset();
        match (error, stranded) {
            (Some(err), _) => Err(err),
            (None, Some(rank)) => Err(Error::new(
                Status::Aborted,
                format!(
                    "rank {rank}'s callback returned while other ranks waited for it in a per-rank \
                     collective call (their calls returned ABORTED): every rank's callback must make the \
                     same per-rank calls"
                ),
            )),
            (None, None) => Ok(()),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::host::HostBackend;
    use std::sync::mpsc::sync_channel;
    use std::thread::ThreadId;

    fn count(ran: &AtomicUsize) -> Result<()> {
        ran.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn workers(ranks: usize) -> RankWorkers {
        let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(ranks).unwrap());
        let devices: Vec<i32> = (0..ranks as i32).collect();
        let streams: Vec<Stream> = (0..ranks as u64).map(|r| Stream(100 + r)).collect();
        RankWorkers::start(7, backend, &devices, &streams, Arc::new(AbortableBarrier::new(ranks))).unwrap()
    }

    #[test]
    fn fan_out_runs_every_body_once_with_its_stream_whether_threads_are_awake_or_asleep() {
        let workers = workers(4);
        let runs: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        for call in 0..300 {
            if call % 50 == 0 {
                // Past the spin: the rank threads are blocked, and the caller takes their bodies.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            workers
                .fan_out(&|rank, stream| {
                    assert_eq!(stream, Stream(100 + rank as u64));
                    runs[rank].fetch_add(1, Ordering::Relaxed);
                    Ok(())
                })
                .unwrap();
            let counts: Vec<usize> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
            assert_eq!(counts, vec![call + 1; 4], "after call {call}");
        }
    }

    #[test]
    fn a_caller_that_stopped_spinning_is_woken_when_the_last_body_finishes() {
        let workers = workers(2);
        let (done, finished) = channel();
        std::thread::spawn(move || {
            let slow = |_, _| {
                // Well past the caller's spin: it blocks, and the last body to finish must wake it.
                std::thread::sleep(std::time::Duration::from_millis(5));
                Ok(())
            };
            for _ in 0..3 {
                done.send((workers.run(&slow), workers.fan_out(&slow))).unwrap();
            }
        });
        for _ in 0..3 {
            let outcome = finished.recv_timeout(std::time::Duration::from_secs(10));
            assert!(matches!(outcome, Ok((Ok(()), Ok(())))), "a blocked caller was not woken");
        }
    }

    #[test]
    fn fan_out_runs_on_the_calling_thread_what_busy_rank_threads_cannot_take() {
        let workers = Arc::new(workers(3));
        // Hold every rank thread inside a run() body until released.
        let (entered, entered_rx) = sync_channel::<()>(3);
        let (release, release_rx) = channel::<()>();
        let release_rx = Mutex::new(release_rx);
        let held = {
            let workers = Arc::clone(&workers);
            std::thread::spawn(move || {
                workers.run(&|_, _| {
                    entered.send(()).unwrap();
                    let _ = release_rx.lock().unwrap().recv();
                    Ok(())
                })
            })
        };
        for _ in 0..3 {
            entered_rx.recv().unwrap();
        }
        let ran_on: Mutex<Vec<(usize, ThreadId)>> = Mutex::new(Vec::new());
        workers
            .fan_out(&|rank, _| {
                ran_on.lock().unwrap().push((rank, std::thread::current().id()));
                Ok(())
            })
            .unwrap();
        let me = std::thread::current().id();
        assert_eq!(ran_on.into_inner().unwrap(), vec![(0, me), (1, me), (2, me)]);
        for _ in 0..3 {
            release.send(()).unwrap();
        }
        held.join().unwrap().unwrap();
        // The rank threads found the fan-out's bodies taken and skipped them; both kinds still work.
        let ran = AtomicUsize::new(0);
        workers.run(&|_, _| count(&ran)).unwrap();
        workers.fan_out(&|_, _| count(&ran)).unwrap();
        assert_eq!(ran.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn fan_out_returns_a_failing_or_panicking_body_as_an_error_and_stays_usable() {
        let workers = workers(3);
        let failed = workers
            .fan_out(&|rank, _| match rank {
                1 => Err(Error::invalid_argument("rank 1 refuses")),
                _ => Ok(()),
            })
            .unwrap_err();
        assert_eq!((failed.status, failed.message.as_str()), (Status::InvalidArgument, "rank 1 refuses"));
        let panicked =
            workers.fan_out(&|rank, _| if rank == 2 { panic!("rank 2 breaks") } else { Ok(()) }).unwrap_err();
        assert_eq!(panicked.status, Status::InternalError);
        assert!(panicked.message.contains("rank 2 breaks"), "{}", panicked.message);
        let ran = AtomicUsize::new(0);
        workers.fan_out(&|_, _| count(&ran)).unwrap();
        workers.run(&|_, _| count(&ran)).unwrap();
        assert_eq!(ran.load(Ordering::Relaxed), 6);
    }
}
