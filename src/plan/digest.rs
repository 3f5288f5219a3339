//! FNV-1a 64, the one digest the planner uses wherever a value must be the same in every process
//! and on every build: tensor-name order, plan and input fingerprints, the wire checksum. Fast on
//! short keys; not a defence against chosen collisions (nothing relies on it being one).

/// An FNV-1a 64 state.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    pub fn new() -> Fnv1a {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    pub fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Eats `v` as 8 little-endian bytes.
    pub fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// The digest of `bytes`.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::new();
    h.bytes(bytes);
    h.finish()
}

/// A digest of a sequence of 64-bit words: each word is folded in with one multiplication (the
/// state rotated first, so that high bits reach the low ones of later words), and the result is
/// mixed with the splitmix64 finalizer so that every input bit reaches every output bit. About a
/// nanosecond a word, where FNV-1a takes eight multiplications: for digests of whole tables
/// (hundreds of thousands of entries). Detects differences; not a defence against chosen ones.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Words(u64);

impl Words {
    pub fn new() -> Words {
        Words(0x6a09_e667_f3bc_c908)
    }

    #[inline]
    pub fn u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(23) ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    /// Folds in `bytes`, eight at a time (the length first, so that padding cannot collide).
    pub fn bytes(&mut self, bytes: &[u8]) {
        self.u64(bytes.len() as u64);
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            self.u64(u64::from_le_bytes(word.try_into().expect("eight bytes")));
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            self.u64(tail.iter().rev().fold(0, |acc, &b| (acc << 8) | u64::from(b)));
        }
    }

    pub fn finish(self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_see_every_bit() {
        // FNV-1a 64's published value for "a".
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        // Flipping the top bit of two words cancels in a plain xor-multiply fold; not here.
        let digest = |a: u64, b: u64| {
            let mut h = Words::new();
            h.u64(a);
            h.u64(b);
            h.finish()
        };
        assert_ne!(digest(1, 2), digest(1 ^ (1 << 63), 2 ^ (1 << 63)));
        assert_ne!(digest(1, 2), digest(2, 1));
        let bytes = |b: &[u8]| {
            let mut h = Words::new();
            h.bytes(b);
            h.finish()
        };
        assert_ne!(bytes(b"ab"), bytes(b"ab\0"));
        assert_ne!(bytes(b"abcdefgh1"), bytes(b"abcdefgh2"));
        assert_ne!(bytes(b"abcdefgh"), bytes(b"abcdefgi"));
    }
}
