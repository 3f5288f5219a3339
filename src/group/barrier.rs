//! A barrier that can be broken: when one rank fails, every rank waiting (or arriving later) returns
//! `Status::Aborted` instead of waiting forever for the rank that will never come.

use crate::error::{Error, Result, Status};
use std::sync::{Condvar, Mutex};

pub struct AbortableBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    changed: Condvar,
}

#[derive(Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: bool,
}

impl AbortableBarrier {
    pub fn new(parties: usize) -> AbortableBarrier {
        AbortableBarrier { parties, state: Mutex::new(BarrierState::default()), changed: Condvar::new() }
    }

    /// Waits until all parties have arrived, or fails once the barrier is aborted.
    pub fn wait(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.aborted {
            return Err(aborted());
        }
        state.arrived += 1;
        if state.arrived == self.parties {
            state.arrived = 0;
            state.generation += 1;
            self.changed.notify_all();
            return Ok(());
        }
        let generation = state.generation;
        while state.generation == generation && !state.aborted {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        if state.generation == generation {
            return Err(aborted());
        }
        Ok(())
    }

    /// Releases every waiter with `Aborted`; later waits fail too until [`AbortableBarrier::reset`].
    pub fn abort(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.aborted = true;
        self.changed.notify_all();
    }

    /// Makes the barrier usable again. Only call when no party is inside `wait`.
    pub fn reset(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.aborted = false;
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
