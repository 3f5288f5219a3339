//! Brief spinning before blocking. The ranks of a group hand each other work and wait for each other
//! within microseconds, and waking a thread blocked in the kernel costs several microseconds on its
//! own (often more than the work handed over): a waiter spins for a short while first, and blocks
//! only when the other side is late.

use std::time::{Duration, Instant};

/// How long a waiter spins before it blocks.
pub const SPIN: Duration = Duration::from_micros(50);

/// Spins while `waiting()` holds, for at most [`SPIN`]. Returns whether it still holds (the caller
/// then blocks).
pub fn spin_while(mut waiting: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    while waiting() {
        if started.elapsed() >= SPIN {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}
