//! The refit digest in pure Rust: arithmetic in GF(2^64) and the host implementation of the digest
//! that the GPU kernel (`digest.cu`) computes. No CUDA here, so it is tested in CI and used by the host
//! backend; the kernel's constant tables are made here too.
//!
//! # Definition
//! Read a buffer of `n` bytes as the polynomial over GF(2) whose coefficient of `x^k` is bit `k % 8`
//! of byte `k / 8`, append a single 1 bit after the last byte (the term `x^(8n)`), and reduce modulo
//! the degree-64 polynomial `g(x) = x^64 + G` with `G` = [`DIGEST_POLY`]:
//!
//! `digest(b) = (sum_k b_k x^k + x^(8n)) mod g(x)`, as 64 bits (bit `i` = coefficient of `x^i`).
//!
//! It is a CRC (zero initial value, no final XOR, first byte in the lowest powers) with a marker bit
//! that makes trailing zero bytes count. `g` is primitive (tests prove it: irreducible, and `x` has
//! order `2^64 - 1`), and `x^4096 = x^6 + x^3 mod g`, which makes the GPU's inner loop a few shifts.
//!
//! # What it detects
//! Two buffers of the same length with the same digest differ by an error polynomial `E(x)` that `g`
//! divides. Because `g` is irreducible of degree 64 and `x` has order `2^64 - 1`:
//! - any single flipped bit (`E = x^k`), and any two flipped bits (`x^i (1 + x^(j-i))`);
//! - any change confined to 64 consecutive bits, e.g. one 8-byte word at any offset
//!   (`E = x^k e(x)`, `deg e < 64`);
//! - any two swapped non-overlapping 8-byte words at any byte offsets `a < b` whose values differ:
//!   `E = (P + Q) x^(8a) (1 + x^(8(b - a)))`, and `g` divides none of the three factors (the last
//!   because `2^64 - 1` does not divide `8 (b - a)` for buffers shorter than `2^64 - 1` bytes);
//! - appended or removed trailing zero bytes (the marker moves).
//!
//! Every other difference is missed exactly when `g` divides `E`: for corruption unrelated to `g`
//! that is a chance of about `2^-64`. The digest is linear, not cryptographic: anyone can construct
//! two buffers with the same digest on purpose.

/// The low 64 coefficients of the digest polynomial `g(x) = x^64 + DIGEST_POLY`.
pub const DIGEST_POLY: u64 = 0x41aa_2452_3c3d_140f;

/// `2^64 - 1`, the multiplicative order of `x` modulo `g`.
pub const ORDER: u64 = u64::MAX;

/// `a * x mod g`.
pub fn mul_x(a: u64) -> u64 {
    (a << 1) ^ if a >> 63 == 1 { DIGEST_POLY } else { 0 }
}

/// The carry-less product of `a` and `b` as (high, low) 64-bit halves.
pub fn clmul(a: u64, b: u64) -> (u64, u64) {
    let (mut hi, mut lo) = (0u64, 0u64);
    for i in 0..64 {
        if (b >> i) & 1 == 1 {
            lo ^= a << i;
            if i > 0 {
                hi ^= a >> (64 - i);
            }
        }
    }
    (hi, lo)
}

/// `hi * x^64 + lo mod g`, bit by bit (the slow reference; [`Tables::reduce`] is the fast one).
pub fn reduce_slow(hi: u64, lo: u64) -> u64 {
    let mut r = hi;
    for _ in 0..64 {
        r = mul_x(r);
    }
    r ^ lo
}

/// `a * b mod g`.
pub fn mul(a: u64, b: u64) -> u64 {
    let (hi, lo) = clmul(a, b);
    tables().reduce(hi, lo)
}

/// `x^e mod g`.
pub fn pow_x(e: u64) -> u64 {
    let (mut result, mut base, mut e) = (1u64, 2u64, e);
    while e != 0 {
        if e & 1 == 1 {
            result = mul(result, base);
        }
        base = mul(base, base);
        e >>= 1;
    }
    result
}

/// `x^(-k) mod g` (`x` is invertible: it has order `2^64 - 1`).
pub fn pow_x_inverse(k: u64) -> u64 {
    pow_x(ORDER - k % ORDER)
}

/// Byte tables for reducing and shifting: `fold[j][v] = v(x) * x^(64 + 8j) mod g`.
pub struct Tables {
    pub fold: [[u64; 256]; 8],
}

impl Tables {
    fn build() -> Tables {
        let mut fold = [[0u64; 256]; 8];
        for (j, table) in fold.iter_mut().enumerate() {
            // Every byte value is the sum of its bits; each bit's row is x^(64 + 8j + bit).
            let mut rows = [0u64; 8];
            for (bit, row) in rows.iter_mut().enumerate() {
                *row = reduce_slow(1u64 << (8 * j + bit), 0);
            }
            for (v, entry) in table.iter_mut().enumerate() {
                *entry = (0..8).filter(|b| (v >> b) & 1 == 1).fold(0, |acc, b| acc ^ rows[b]);
            }
        }
        Tables { fold }
    }

    /// `hi * x^64 + lo mod g` with eight table lookups.
    pub fn reduce(&self, hi: u64, lo: u64) -> u64 {
        let mut r = lo;
        for (j, table) in self.fold.iter().enumerate() {
            r ^= table[((hi >> (8 * j)) & 0xff) as usize];
        }
        r
    }
}

/// The byte tables, built once.
pub fn tables() -> &'static Tables {
    static TABLES: std::sync::OnceLock<Tables> = std::sync::OnceLock::new();
    TABLES.get_or_init(Tables::build)
}

/// The digest of `bytes` (see the module documentation), a word at a time from the end (Horner's rule:
/// `r = r * x^64 + word`), starting from the marker bit.
pub fn digest(bytes: &[u8]) -> u64 {
    let t = tables();
    let words = bytes.len() / 8;
    let mut r = 1u64; // x^(8n), the marker just past the last byte
    for &byte in bytes[8 * words..].iter().rev() {
        r = (r << 8) ^ t.fold[0][(r >> 56) as usize] ^ u64::from(byte);
    }
    for chunk in bytes[..8 * words].chunks_exact(8).rev() {
        let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        r = t.reduce(r, 0) ^ word;
    }
    r
}

/// The digest of the concatenation `a ‖ b`, from `digest(a)`, `digest(b)` and `a`'s length:
/// `digest(a) + x^(8|a|) (digest(b) + 1)`: `a`'s marker `x^(8|a|)` is dropped and `b`'s terms (its
/// marker included) move up by `8|a|` bits.
pub fn concat(digest_a: u64, len_a: u64, digest_b: u64) -> u64 {
    let shift = pow_x((u128::from(len_a) * 8 % u128::from(ORDER)) as u64);
    digest_a ^ shift ^ mul(shift, digest_b)
}

/// Words in [`kernel_constants`], in this order: the fold tables (8 x 256), `x^(2^b)` for b < 64,
/// `x^(-8d)` for d < 16, `x^(64 s)` for s < 64. Must match the offsets in `digest.cu`.
pub const KERNEL_CONSTANT_WORDS: usize = 2048 + 64 + 16 + 64;

/// The constants the digest kernel reads from device memory (see [`KERNEL_CONSTANT_WORDS`]).
pub fn kernel_constants() -> Vec<u64> {
    let mut out = Vec::with_capacity(KERNEL_CONSTANT_WORDS);
    for table in &tables().fold {
        out.extend_from_slice(table);
    }
    let mut power = 2u64; // x^(2^0)
    for _ in 0..64 {
        out.push(power);
        power = mul(power, power);
    }
    out.extend((0..16).map(|d| pow_x_inverse(8 * d)));
    out.extend((0..64).map(|s| pow_x(64 * s)));
    debug_assert_eq!(out.len(), KERNEL_CONSTANT_WORDS);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest straight from its definition: every set bit k adds x^k, computed bit by bit.
    fn digest_by_definition(bytes: &[u8]) -> u64 {
        let mut r = 0u64;
        let mut power = 1u64; // x^k
        for byte in bytes {
            for bit in 0..8 {
                if (byte >> bit) & 1 == 1 {
                    r ^= power;
                }
                power = mul_x(power);
            }
        }
        r ^ power
    }

    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect()
    }

    /// Polynomial remainder over GF(2) with u128 operands (degrees below 128).
    fn poly_mod(mut a: u128, m: u128) -> u128 {
        let dm = 127 - m.leading_zeros();
        while a != 0 && 127 - a.leading_zeros() >= dm {
            a ^= m << (127 - a.leading_zeros() - dm);
        }
        a
    }

    fn poly_gcd(mut a: u128, mut b: u128) -> u128 {
        while b != 0 {
            let r = poly_mod(a, b);
            a = b;
            b = r;
        }
        a
    }

    #[test]
    fn the_polynomial_is_irreducible_and_primitive() {
        // Rabin's test: x^(2^64) = x mod g, and gcd(x^(2^32) - x, g) = 1 (64's only prime factor is 2).
        let mut x_pow = 2u64;
        for _ in 0..32 {
            x_pow = mul(x_pow, x_pow);
        }
        let g = (1u128 << 64) | u128::from(DIGEST_POLY);
        assert_eq!(poly_gcd(g, u128::from(x_pow ^ 2)), 1, "g has a factor of degree dividing 32");
        for _ in 0..32 {
            x_pow = mul(x_pow, x_pow);
        }
        assert_eq!(x_pow, 2, "x^(2^64) != x: g is not irreducible");
        // Primitive: x^(2^64 - 1) = 1 and x^((2^64 - 1) / q) != 1 for every prime q dividing 2^64 - 1.
        let primes = [3u64, 5, 17, 257, 641, 65537, 6_700_417];
        assert_eq!(primes.iter().fold(1u128, |p, &q| p * u128::from(q)), u128::from(ORDER));
        assert_eq!(pow_x(ORDER), 1);
        for q in primes {
            assert_ne!(pow_x(ORDER / q), 1, "x^((2^64-1)/{q}) = 1: g is not primitive");
        }
    }

    #[test]
    fn x_to_the_4096_is_sparse() {
        // The GPU kernel's inner loop relies on this: a = a * x^4096 costs two shifts and one lookup.
        assert_eq!(pow_x(4096), (1 << 6) | (1 << 3));
    }

    #[test]
    fn field_arithmetic_agrees_with_the_slow_forms() {
        let t = tables();
        for seed in 1..200u64 {
            let a = u64::from_le_bytes(random_bytes(seed, 8).try_into().unwrap());
            let b = u64::from_le_bytes(random_bytes(seed + 1000, 8).try_into().unwrap());
            let (hi, lo) = clmul(a, b);
            assert_eq!(t.reduce(hi, lo), reduce_slow(hi, lo));
            assert_eq!(mul(a, b), mul(b, a));
            assert_eq!(mul(a, mul(b, 2)), mul(mul(a, b), 2));
            assert_eq!(mul(a, 2), mul_x(a));
        }
        assert_eq!(mul(pow_x(12345), pow_x_inverse(12345)), 1);
        assert_eq!(mul(pow_x(1 << 40), pow_x(3)), pow_x((1 << 40) + 3));
    }

    #[test]
    fn digest_matches_its_definition() {
        for n in (0..40).chain([63, 64, 65, 127, 128, 129, 1000]) {
            let bytes = random_bytes(n as u64 + 7, n);
            assert_eq!(digest(&bytes), digest_by_definition(&bytes), "{n} bytes");
        }
        assert_eq!(digest(&[]), 1, "an empty buffer is the marker alone");
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        for n in [1usize, 7, 8, 9, 33, 64] {
            let bytes = random_bytes(n as u64, n);
            let base = digest(&bytes);
            for bit in 0..8 * n {
                let mut flipped = bytes.clone();
                flipped[bit / 8] ^= 1 << (bit % 8);
                assert_ne!(digest(&flipped), base, "{n} bytes, bit {bit}");
            }
        }
    }

    #[test]
    fn every_swap_of_two_differing_words_is_detected() {
        let bytes = random_bytes(99, 96);
        let base = digest(&bytes);
        // Aligned and misaligned 8-byte words, every non-overlapping pair.
        for a in 0..=88 {
            for b in a + 8..=88 {
                let mut swapped = bytes.clone();
                let (x, y) = (bytes[a..a + 8].to_vec(), bytes[b..b + 8].to_vec());
                if x == y {
                    continue;
                }
                swapped[a..a + 8].copy_from_slice(&y);
                swapped[b..b + 8].copy_from_slice(&x);
                assert_ne!(digest(&swapped), base, "words at {a} and {b}");
            }
        }
    }

    #[test]
    fn trailing_zeros_count_and_concatenation_composes() {
        let bytes = random_bytes(5, 50);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_ne!(digest(&bytes), digest(&longer));
        for split in [0usize, 1, 8, 13, 50] {
            let (a, b) = bytes.split_at(split);
            assert_eq!(concat(digest(a), a.len() as u64, digest(b)), digest(&bytes), "split at {split}");
        }
    }

    #[test]
    fn kernel_constants_have_the_documented_layout() {
        let c = kernel_constants();
        assert_eq!(c.len(), KERNEL_CONSTANT_WORDS);
        assert_eq!(c[5], reduce_slow(5, 0));
        assert_eq!(c[2048 + 10], pow_x(1 << 10));
        assert_eq!(mul(c[2048 + 64 + 3], pow_x(24)), 1);
        assert_eq!(c[2048 + 80 + 7], pow_x(7 * 64));
    }
}
