//! Locking that a panic elsewhere does not break: the one place that decides what a poisoned lock
//! means.
//!
//! A lock is poisoned when a thread panicked while holding it. In refit that thread is a rank
//! callback or an export, and the panic has already been caught and reported (a rank's error, or
//! `REFIT_STATUS_INTERNAL_ERROR` at the C boundary). Every critical section here leaves the data it
//! guards valid at each step (assignments of whole values, pushes and removals of whole entries), so
//! the next caller proceeds with it instead of failing, or panicking, forever after one bug.

use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::Duration;

/// Locks `mutex`, poisoned or not.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits on `condvar` with `guard`, poisoned or not (callers loop on their condition).
pub(crate) fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar.wait(guard).unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits on `condvar` with `guard` for at most `timeout`, poisoned or not; returns the guard and
/// whether the time ran out.
pub(crate) fn wait_timeout<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, bool) {
    let (guard, waited) =
        condvar.wait_timeout(guard, timeout).unwrap_or_else(|poisoned| poisoned.into_inner());
    (guard, waited.timed_out())
}

/// Locks `lock` for reading, poisoned or not.
pub(crate) fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Locks `lock` for writing, poisoned or not.
pub(crate) fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Locks `mutex` if no one holds it, poisoned or not; None while another holder has it.
pub(crate) fn try_lock<T: ?Sized>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Locks `lock` for reading unless a writer holds it, poisoned or not.
pub(crate) fn try_read<T: ?Sized>(lock: &RwLock<T>) -> Option<RwLockReadGuard<'_, T>> {
    match lock.try_read() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Locks `lock` for writing if no one holds it, poisoned or not.
pub(crate) fn try_write<T: ?Sized>(lock: &RwLock<T>) -> Option<RwLockWriteGuard<'_, T>> {
    match lock.try_write() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_lock_poisoned_by_a_panicking_holder_still_locks_with_its_last_value() {
        let mutex = Arc::new(Mutex::new(1));
        let rw = Arc::new(RwLock::new(1));
        let (m, r) = (Arc::clone(&mutex), Arc::clone(&rw));
        let panicked = std::thread::spawn(move || {
            let (mut a, mut b) = (m.lock().unwrap(), r.write().unwrap());
            (*a, *b) = (2, 2);
            panic!("holder panics");
        })
        .join();
        assert!(panicked.is_err());
        assert!(mutex.is_poisoned() && rw.is_poisoned());
        assert_eq!(*lock(&mutex), 2);
        assert_eq!(*read(&rw), 2);
        *write(&rw) = 3;
        assert_eq!(*read(&rw), 3);
    }
}
