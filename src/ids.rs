//! The opaque values refit hands out for the objects C holds: the C ABI's handles (src/ffi) and the
//! host backend's streams and events. One id space for all of them, so a value of one kind never
//! names an object of another.
//!
//! An id is unique for the life of the process (a destroyed object's value never names a later
//! one) and not guessable from another (a neighbour of a real value, or a small integer, names
//! nothing): the n-th id is a keyed bijection of n. It looks like a user-space pointer: non-zero,
//! 16-byte aligned, below 2^47.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

/// Bits of the permuted counter; ids are these shifted past the four alignment bits.
const BITS: u32 = 43;
const MASK: u64 = (1 << BITS) - 1;

/// A bijection of [0, 2^43): multiplications by odd constants and xor-shifts are each invertible
/// modulo a power of two, so distinct counters give distinct ids.
fn permute(mut x: u64) -> u64 {
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15) & MASK;
    x ^= x >> 23;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9) & MASK;
    x ^ (x >> 19)
}

/// A new id.
pub(crate) fn issue() -> u64 {
    static KEY: LazyLock<u64> =
        LazyLock::new(|| std::collections::hash_map::RandomState::new().hash_one(0u64));
    static ISSUED: AtomicU64 = AtomicU64::new(0);
    loop {
        // 2^43 ids: at a billion a second, hours; at any real rate, never exhausted.
        let n = ISSUED.fetch_add(1, Ordering::Relaxed);
        let id = permute((n ^ *KEY) & MASK) << 4;
        // Exactly one counter maps to 0, which is NULL.
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn permute_is_a_bijection_on_a_sample_and_ids_look_like_pointers() {
        // Distinct inputs, distinct outputs (checked on a million consecutive inputs and on the top of
        // the range, where a mask error would fold values together).
        let inputs = (0..1 << 20).chain(MASK - (1 << 16)..=MASK);
        let mut seen = HashSet::new();
        for x in inputs {
            assert!(seen.insert(permute(x)), "permute({x:#x}) repeats");
            assert!(permute(x) <= MASK);
        }
        let ids: Vec<u64> = (0..1000).map(|_| issue()).collect();
        assert!(ids.iter().all(|&id| id != 0 && id % 16 == 0 && id < 1 << 47));
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
        // Consecutive ids are not neighbours: the next aligned value after a real one names nothing
        // (two random 47-bit values fall within 256 of each other once in about 2^38 pairs).
        assert!(ids.windows(2).all(|pair| pair[0].abs_diff(pair[1]) > 256));
    }
}
