//! A barrier that can be broken: when one rank fails, every rank waiting (or arriving later) returns
//! `Status::Aborted` instead of waiting forever for the rank that will never come.
//!
//! The ranks of a collective usually arrive within microseconds of each other: a waiter spins
//! briefly before it blocks (see `spin`).

use super::spin::spin_while;
use crate::error::{Error, Result, Status};
use crate::sync::{lock, wait};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

pub struct AbortableBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    changed: Condvar,
    /// Mirrors of `state.generation` and `state.aborted` for spinning waiters.
    generation: AtomicU64,
    aborted: AtomicBool,
}

#[derive(Default)]
struct BarrierState {
    arrived: usize,
    /// Parties blocked on `changed` (the rest spin): the last arrival wakes them only when there are
    /// any, since a wake-up is a system call on the path of every party.
    blocked: usize,
    generation: u64,
    aborted: bool,
    /// What the last party of the latest crossing computed for everyone (see `wait_then`).
    value: u64,
}

impl AbortableBarrier {
    pub fn new(parties: usize) -> AbortableBarrier {
        AbortableBarrier {
            parties,
            state: Mutex::new(BarrierState::default()),
            changed: Condvar::new(),
            generation: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
        }
    }

    /// How many times all parties have crossed so far. A party that is not waiting reads the same
    /// count as every other such party, up to the next crossing (which needs every party).
    pub fn crossings(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Waits until all parties have arrived, or fails once the barrier is aborted.
    pub fn wait(&self) -> Result<()> {
        self.wait_then(|| 0).map(drop)
    }

    /// As [`AbortableBarrier::wait`]; the last party to arrive also runs `last` before releasing the
    /// others, and every party returns its result: one value agreed on by all (a call's epoch).
    pub fn wait_then(&self, last: impl FnOnce() -> u64) -> Result<u64> {
        let mut state = lock(&self.state);
        if state.aborted {
            return Err(aborted());
        }
        state.arrived += 1;
        if state.arrived == self.parties {
            state.arrived = 0;
            state.value = last();
            state.generation += 1;
            self.generation.store(state.generation, Ordering::Release);
            if state.blocked > 0 {
                self.changed.notify_all();
            }
            return Ok(state.value);
        }
        let generation = state.generation;
        drop(state);
        spin_while(|| {
            self.generation.load(Ordering::Acquire) == generation && !self.aborted.load(Ordering::Acquire)
        });
        let mut state = lock(&self.state);
        state.blocked += 1;
        while state.generation == generation && !state.aborted {
            state = wait(&self.changed, state);
        }
        state.blocked -= 1;
        if state.generation == generation {
            return Err(aborted());
        }
        // The next crossing cannot complete, and overwrite the value, before this party arrives.
        Ok(state.value)
    }

    /// Releases every waiter with `Aborted`; later waits fail too until [`AbortableBarrier::reset`].
    pub fn abort(&self) {
        let mut state = lock(&self.state);
        state.aborted = true;
        self.aborted.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// Makes the barrier usable again. Only call when no party is inside `wait`.
    pub fn reset(&self) {
        let mut state = lock(&self.state);
        state.aborted = false;
        self.aborted.store(false, Ordering::Release);
        state.arrived = 0;
    }
}

fn aborted() -> Error {
    Error::new(Status::Aborted, "another rank of this group failed first; this rank was released")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn all_parties_pass_together_many_times() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let b = Arc::clone(&barrier);
                std::thread::spawn(move || (0..100).all(|_| b.wait().is_ok()))
            })
            .collect();
        assert!(handles.into_iter().all(|h| h.join().unwrap()));
    }

    #[test]
    fn every_party_gets_the_value_the_last_one_computed_once() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let computed = Arc::new(AtomicU64::new(0));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let (b, c) = (Arc::clone(&barrier), Arc::clone(&computed));
                std::thread::spawn(move || {
                    (0..200).map(|_| b.wait_then(|| c.fetch_add(1, Ordering::Relaxed) + 1).unwrap()).collect()
                })
            })
            .collect();
        let seen: Vec<Vec<u64>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let want: Vec<u64> = (1..=200).collect();
        assert!(seen.iter().all(|s| *s == want), "every party sees 1, 2, ... in order");
        assert_eq!(computed.load(Ordering::Relaxed), 200, "once per crossing");
    }

    #[test]
    fn parties_that_stopped_spinning_and_blocked_are_woken_by_the_last() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let (passed, passes) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (b, passed) = (Arc::clone(&barrier), passed.clone());
            std::thread::spawn(move || passed.send(b.wait_then(|| 0).unwrap()).unwrap());
        }
        // Well past the spin: both waiters are blocked on the condition variable by now.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(barrier.wait_then(|| 42).unwrap(), 42);
        for _ in 0..2 {
            let value = passes.recv_timeout(std::time::Duration::from_secs(10));
            assert_eq!(value, Ok(42), "a blocked waiter was not woken");
        }
    }

    #[test]
    fn abort_releases_waiters_and_reset_restores() {
        let barrier = Arc::new(AbortableBarrier::new(2));
        let b = Arc::clone(&barrier);
        let waiter = std::thread::spawn(move || b.wait());
        std::thread::sleep(std::time::Duration::from_millis(20));
        barrier.abort();
        assert_eq!(waiter.join().unwrap().unwrap_err().status, Status::Aborted);
        assert_eq!(barrier.wait().unwrap_err().status, Status::Aborted);
        barrier.reset();
        let b = Arc::clone(&barrier);
        let waiter = std::thread::spawn(move || b.wait());
        barrier.wait().unwrap();
        waiter.join().unwrap().unwrap();
    }
}
