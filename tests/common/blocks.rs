//! The allgather tests' blocks (tests/allgather_host.rs, tests/comm_host.rs): bytes every rank can
//! compute for every other rank, so each checks what it gathered on its own.

/// Deterministic, call- and rank-dependent bytes (never the poison pattern throughout).
pub fn block(rank: usize, call: usize, len: usize) -> Vec<u8> {
    let mut x = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (call as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
