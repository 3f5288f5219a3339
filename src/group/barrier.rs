//! A barrier for the ranks of a collective call that can be broken, and that knows which call each
//! party is in: nobody waits forever for a rank that will never come, and nobody meets a call it did
//! not enter.
//!
//! - A party *enters* a new call ([`AbortableBarrier::enter`]) and then *meets* the other parties
//!   of that call again as often as the call needs ([`AbortableBarrier::meet`], with what `enter`
//!   returned, [`Entered`]). A crossing completes only when every party brought the same ticket.
//! - A party that left a call after failing in it, and enters a new one, releases the parties still
//!   waiting to meet in the old call with `Aborted` (their call cannot complete), and a party that
//!   then arrives to meet in the old call is refused the same way; the new call goes on once they
//!   enter it too. Without this, a retry's arrivals would complete the old call's crossing, and its
//!   parties would return from a call whose blocks never came.
//! - When one rank fails ([`AbortableBarrier::abort`]), or returns from its callback
//!   ([`AbortableBarrier::depart`]), every party waiting, and every later arrival, returns `Aborted`
//!   until [`AbortableBarrier::reset`].
//!
//! The ranks of a collective usually arrive within microseconds of each other: a waiter spins
//! briefly before it blocks (see `spin`).

use super::spin::spin_while;
use crate::error::{Error, Result, Status};
use crate::sync::{lock, wait};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

/// A party's place in the collective call it entered: the crossing count after its latest meeting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entered {
    met_at: u64,
}

/// What a party brings to a crossing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ticket {
    /// Entering a new call.
    Enter,
    /// Meeting again in the call whose latest crossing made the count this value.
    Meet(u64),
}

pub struct AbortableBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    changed: Condvar,
    /// Mirrors of `state.generation`, `state.released` and `state.stop.is_some()` for spinning waiters.
    generation: AtomicU64,
    released: AtomicU64,
    stopped: AtomicBool,
}

#[derive(Default)]
struct BarrierState {
    arrived: usize,
    /// The ticket of the crossing in progress, set by its first arrival.
    crossing: Option<Ticket>,
    /// Parties blocked on `changed` (the rest spin): the last arrival wakes them only when there are
    /// any, since a wake-up is a system call on the path of every party.
    blocked: usize,
    /// Completed crossings.
    generation: u64,
    /// How many times the waiting parties of a call were released because another party entered a
    /// new one.
    released: u64,
    /// Why every wait fails until `reset`.
    stop: Option<Stop>,
    /// The departed party that left others waiting, or that a later arrival was waiting for.
    stranded: Option<usize>,
    /// What the last party of the latest crossing computed for everyone (see `enter`).
    value: u64,
}

#[derive(Clone, Copy, Debug)]
enum Stop {
    /// A party failed.
    Failed,
    /// This party's callback returned: it will not arrive again.
    Departed(usize),
}

impl Stop {
    fn error(self) -> Error {
        match self {
            Stop::Failed => {
                Error::new(Status::Aborted, "another rank of this group failed first; this rank was released")
            }
            Stop::Departed(rank) => Error::new(
                Status::Aborted,
                format!(
                    "rank {rank}'s callback returned without joining this collective call (every rank's \
                     callback must make the same per-rank calls); this rank was released"
                ),
            ),
        }
    }
}

fn abandoned() -> Error {
    Error::new(
        Status::Aborted,
        "another rank left this collective call after failing in it and entered a new one: this call \
         cannot complete (call it again on every rank)",
    )
}

impl AbortableBarrier {
    pub fn new(parties: usize) -> AbortableBarrier {
        AbortableBarrier {
            parties,
            state: Mutex::new(BarrierState::default()),
            changed: Condvar::new(),
            generation: AtomicU64::new(0),
            released: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        }
    }

    /// How many times all parties have crossed so far. A party that is not waiting reads the same
    /// count as every other such party, up to the next crossing (which needs every party).
    pub fn crossings(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Enters a new collective call: waits until every party has entered one. The last party to
    /// arrive runs `last` before releasing the others, and every party returns its result (one value
    /// agreed on by all, such as the call's epoch) and the call, for its later meetings.
    pub fn enter(&self, last: impl FnOnce() -> u64) -> Result<(Entered, u64)> {
        let (value, met_at) = self.arrive(Ticket::Enter, last)?;
        Ok((Entered { met_at }, value))
    }

    /// Meets the other parties of the call this party `entered` again. `Aborted` when another party
    /// left the call and entered a new one (before or while this one waits), or when the barrier is
    /// aborted.
    pub fn meet(&self, entered: &mut Entered) -> Result<()> {
        let (_, met_at) = self.arrive(Ticket::Meet(entered.met_at), || 0)?;
        entered.met_at = met_at;
        Ok(())
    }

    /// Arrives with `ticket`; returns the crossing's value and the count after it.
    fn arrive(&self, ticket: Ticket, last: impl FnOnce() -> u64) -> Result<(u64, u64)> {
        let mut state = lock(&self.state);
        if let Some(stop) = state.stop {
            if let Stop::Departed(rank) = stop {
                state.stranded.get_or_insert(rank);
            }
            return Err(stop.error());
        }
        if ticket != Ticket::Enter && ticket != Ticket::Meet(state.generation) {
            return Err(abandoned());
        }
        match state.crossing {
            Some(current) if current != ticket && ticket == Ticket::Enter => {
                // The waiting parties meet in a call that this party left: it cannot complete.
                state.released += 1;
                self.released.store(state.released, Ordering::Release);
                state.arrived = 0;
                state.crossing = Some(ticket);
                if state.blocked > 0 {
                    self.changed.notify_all();
                }
            }
            Some(current) if current != ticket => return Err(abandoned()),
            _ => state.crossing = Some(ticket),
        }
        state.arrived += 1;
        if state.arrived == self.parties {
            state.arrived = 0;
            state.crossing = None;
            state.value = last();
            state.generation += 1;
            self.generation.store(state.generation, Ordering::Release);
            if state.blocked > 0 {
                self.changed.notify_all();
            }
            return Ok((state.value, state.generation));
        }
        let (generation, released) = (state.generation, state.released);
        drop(state);
        spin_while(|| {
            self.generation.load(Ordering::Acquire) == generation
                && self.released.load(Ordering::Acquire) == released
                && !self.stopped.load(Ordering::Acquire)
        });
        let mut state = lock(&self.state);
        state.blocked += 1;
        while state.generation == generation && state.released == released && state.stop.is_none() {
            state = wait(&self.changed, state);
        }
        state.blocked -= 1;
        if state.generation != generation {
            // The next crossing cannot complete, and overwrite the value, before this party arrives.
            return Ok((state.value, state.generation));
        }
        if state.released != released {
            return Err(abandoned());
        }
        let stop = state.stop.expect("the loop ended without a crossing or a release");
        Err(stop.error())
    }

    /// A party failed: releases every waiter with `Aborted`; later arrivals fail too until
    /// [`AbortableBarrier::reset`].
    pub fn abort(&self) {
        self.stop(Stop::Failed);
    }

    /// Party `party` will not arrive again before [`AbortableBarrier::reset`] (its callback returned):
    /// any party waiting, or arriving later, waits for it in vain and returns `Aborted` naming it
    /// (unless the barrier was already aborted, whose reason stands).
    pub fn depart(&self, party: usize) {
        self.stop(Stop::Departed(party));
    }

    fn stop(&self, stop: Stop) {
        let mut state = lock(&self.state);
        if state.stop.is_some() {
            return;
        }
        if let (Stop::Departed(party), true) = (stop, state.arrived > 0) {
            state.stranded = Some(party);
        }
        state.stop = Some(stop);
        self.stopped.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// The departed party that others waited for in vain since the last reset (see `depart`).
    pub fn stranded(&self) -> Option<usize> {
        lock(&self.state).stranded
    }

    /// Makes the barrier usable again. Only call when no party is inside `enter` or `meet`.
    pub fn reset(&self) {
        let mut state = lock(&self.state);
        state.stop = None;
        state.stranded = None;
        self.stopped.store(false, Ordering::Release);
        state.arrived = 0;
        state.crossing = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread::JoinHandle;
    use std::time::Duration;

    fn enter(barrier: &AbortableBarrier) -> Result<Entered> {
        barrier.enter(|| 0).map(|(call, _)| call)
    }

    /// A party meeting in `call` on its own thread, well past its spin by the time this returns.
    fn meeting(barrier: &Arc<AbortableBarrier>, call: Entered) -> JoinHandle<Result<()>> {
        let b = Arc::clone(barrier);
        let handle = std::thread::spawn(move || b.meet(&mut { call }));
        std::thread::sleep(Duration::from_millis(20));
        handle
    }

    /// Every party enters a call at once; returns each party's call.
    fn all_enter(barrier: &Arc<AbortableBarrier>, parties: usize) -> Vec<Entered> {
        let handles: Vec<_> = (0..parties)
            .map(|_| {
                let b = Arc::clone(barrier);
                std::thread::spawn(move || enter(&b).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_parties_pass_together_many_times_entering_and_meeting() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let b = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    (0..100).all(|_| {
                        enter(&b).and_then(|mut call| b.meet(&mut call).and(b.meet(&mut call))).is_ok()
                    })
                })
            })
            .collect();
        assert!(handles.into_iter().all(|h| h.join().unwrap()));
        assert_eq!(barrier.crossings(), 300);
    }

    #[test]
    fn every_party_gets_the_value_the_last_one_computed_once() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let computed = Arc::new(AtomicU64::new(0));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let (b, c) = (Arc::clone(&barrier), Arc::clone(&computed));
                std::thread::spawn(move || {
                    (0..200).map(|_| b.enter(|| c.fetch_add(1, Ordering::Relaxed) + 1).unwrap().1).collect()
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
            std::thread::spawn(move || passed.send(b.enter(|| 0).unwrap().1).unwrap());
        }
        // Well past the spin: both waiters are blocked on the condition variable by now.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(barrier.enter(|| 42).unwrap().1, 42);
        for _ in 0..2 {
            let value = passes.recv_timeout(Duration::from_secs(10));
            assert_eq!(value, Ok(42), "a blocked waiter was not woken");
        }
    }

    #[test]
    fn a_party_entering_a_new_call_releases_the_parties_still_meeting_in_the_old_one() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let calls = all_enter(&barrier, 3);
        // Parties 0 and 1 go on to meet in the call; party 2 failed in it and enters a new one.
        let meetings = [meeting(&barrier, calls[0]), meeting(&barrier, calls[1])];
        let b = Arc::clone(&barrier);
        let retry = std::thread::spawn(move || enter(&b));
        for met in meetings {
            let err = met.join().unwrap().unwrap_err();
            assert_eq!(err.status, Status::Aborted, "{err}");
            assert!(err.message.contains("left this collective call"), "{err}");
        }
        // They were not counted into the new call: it completes once they enter it too.
        let entered = all_enter(&barrier, 2);
        let retried = retry.join().unwrap().unwrap();
        assert!(entered.iter().all(|&call| call == retried));
        assert_eq!(barrier.crossings(), 2, "the old call's second meeting never completed");
    }

    #[test]
    fn a_party_meeting_in_a_call_that_another_left_is_refused() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        let calls = all_enter(&barrier, 3);
        let b = Arc::clone(&barrier);
        let retry = std::thread::spawn(move || enter(&b));
        std::thread::sleep(Duration::from_millis(20));
        for mut call in [calls[0], calls[1]] {
            assert_eq!(barrier.meet(&mut call).unwrap_err().status, Status::Aborted);
        }
        all_enter(&barrier, 2);
        retry.join().unwrap().unwrap();
        // A meeting of a call that has moved on is refused whatever is in progress.
        let mut stale = calls[0];
        assert_eq!(barrier.meet(&mut stale).unwrap_err().status, Status::Aborted);
    }

    #[test]
    fn a_departed_party_releases_its_waiters_and_later_arrivals_and_is_reported_until_reset() {
        let barrier = Arc::new(AbortableBarrier::new(3));
        barrier.depart(0);
        assert_eq!(barrier.stranded(), None, "nobody waited for it");
        barrier.reset();
        let b = Arc::clone(&barrier);
        let waiter = std::thread::spawn(move || enter(&b));
        std::thread::sleep(Duration::from_millis(20));
        barrier.depart(2);
        barrier.abort(); // a later failure does not replace the reason
        let err = waiter.join().unwrap().unwrap_err();
        assert_eq!(err.status, Status::Aborted);
        assert!(err.message.contains("rank 2's callback returned"), "{err}");
        assert_eq!(enter(&barrier).unwrap_err().status, Status::Aborted);
        assert_eq!(barrier.stranded(), Some(2));
        barrier.reset();
        assert_eq!(barrier.stranded(), None);
        all_enter(&barrier, 3);
    }

    #[test]
    fn abort_releases_waiters_and_reset_restores() {
        let barrier = Arc::new(AbortableBarrier::new(2));
        let b = Arc::clone(&barrier);
        let waiter = std::thread::spawn(move || enter(&b));
        std::thread::sleep(Duration::from_millis(20));
        barrier.abort();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(err.message.contains("failed first"), "{err}");
        assert_eq!(enter(&barrier).unwrap_err().status, Status::Aborted);
        assert_eq!(barrier.stranded(), None, "a failure is reported by the failing rank, not as a departure");
        barrier.reset();
        all_enter(&barrier, 2);
    }
}
