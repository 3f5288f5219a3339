//! The digest kernel's own source (`src/kernels/digest.cu`), built as host C++ by
//! `tests/emulate/digest_kernel.cpp` and run on the CPU (every thread a coroutine, so its warp shuffles
//! and block barrier behave as on the GPU), against the Rust implementation (`kernels::gf64::digest`)
//! on random data, lengths, alignments and launch geometries.

#[path = "common/emulator.rs"]
mod emulator;
#[path = "common/random_batch.rs"]
mod random_batch;

use random_batch::Rng;
use refit::kernels::digest::{geometry, Geometry};
use refit::kernels::gf64;
use std::sync::OnceLock;

type Launch = unsafe extern "C" fn(u64, u64, u32, *const u64, *mut u64, u32);

fn emulator() -> Launch {
    static LAUNCH: OnceLock<Launch> = OnceLock::new();
    // SAFETY: matches refit_emulate_digest in digest_kernel.cpp.
    *LAUNCH.get_or_init(|| unsafe { emulator::load::<Launch>("digest_kernel", c"refit_emulate_digest") })
}

fn constants() -> &'static [u64] {
    static CONSTANTS: OnceLock<Vec<u64>> = OnceLock::new();
    CONSTANTS.get_or_init(gf64::kernel_constants)
}

/// The emulated kernel's digest of `bytes`, launched as the library would with at most `max_warps`.
fn kernel_digest(bytes: &[u8], max_warps: u64) -> u64 {
    let addr = bytes.as_ptr() as u64;
    let Geometry { span_shift, blocks } = geometry(addr, bytes.len() as u64, max_warps);
    let mut out = 0xdead_beef_u64;
    // SAFETY: the kernel reads the aligned 16-byte vectors holding `bytes` (the test buffers below
    // leave room on both sides), the constants, and writes `out`.
    unsafe { emulator()(addr, bytes.len() as u64, span_shift, constants().as_ptr(), &mut out, blocks) };
    out
}

/// A buffer with 32 spare bytes on each side, so that every aligned vector the kernel reads is ours.
fn padded(rng: &mut Rng, len: usize, offset: usize) -> (Vec<u128>, std::ops::Range<usize>) {
    let mut words = vec![0u128; (len + offset + 64).div_ceil(16)];
    // SAFETY: u128 storage viewed as bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 16) };
    rng.fill(bytes);
    (words, 32 + offset..32 + offset + len)
}

fn bytes_of(words: &[u128]) -> &[u8] {
    // SAFETY: u128 storage viewed as bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 16) }
}

#[test]
fn random_lengths_and_alignments_agree_with_the_host() {
    let mut rng = Rng::new(7);
    let mut lengths: Vec<usize> = (0..40).collect();
    lengths.extend([496, 511, 512, 513, 1023, 1024, 1040, 4095, 4096, 8191, 20_000, 65_536, 100_003]);
    for len in lengths {
        for offset in [0usize, 1, 7, 8, 9, 15] {
            let (words, range) = padded(&mut rng, len, offset);
            let data = &bytes_of(&words)[range];
            let want = gf64::digest(data);
            for max_warps in [1u64, 3, 64, 2000] {
                let got = kernel_digest(data, max_warps);
                assert_eq!(
                    got, want,
                    "{len} bytes at offset {offset}, at most {max_warps} warps: {got:#x} != {want:#x}"
                );
            }
        }
    }
}

#[test]
fn large_spans_and_many_blocks() {
    // 1 MiB + 5 bytes: a few warps with 2^9 chunks each (the interior loop and its remainder), and
    // many warps with 4 each.
    let mut rng = Rng::new(11);
    let (words, range) = padded(&mut rng, (1 << 20) + 5, 3);
    let data = &bytes_of(&words)[range];
    let want = gf64::digest(data);
    for max_warps in [5u64, 4096] {
        assert_eq!(kernel_digest(data, max_warps), want, "at most {max_warps} warps");
    }
}

#[test]
fn every_bit_flip_and_word_swap_of_a_small_buffer_changes_the_kernels_digest() {
    let mut rng = Rng::new(3);
    let (mut words, range) = padded(&mut rng, 48, 5);
    let base = gf64::digest(&bytes_of(&words)[range.clone()]);
    assert_eq!(kernel_digest(&bytes_of(&words)[range.clone()], 8), base);
    for bit in 0..48 * 8 {
        let at = range.start + bit / 8;
        // SAFETY: u128 storage viewed as bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 16) };
        bytes[at] ^= 1 << (bit % 8);
        let flipped = kernel_digest(&bytes_of(&words)[range.clone()], 8);
        assert_eq!(flipped, gf64::digest(&bytes_of(&words)[range.clone()]), "bit {bit}");
        assert_ne!(flipped, base, "flipping bit {bit} went unnoticed");
        // SAFETY: as above.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 16) };
        bytes[at] ^= 1 << (bit % 8);
    }
    for (a, b) in [(0usize, 8usize), (0, 40), (3, 29), (16, 24), (33, 40)] {
        let mut data = bytes_of(&words)[range.clone()].to_vec();
        let first: Vec<u8> = data[a..a + 8].to_vec();
        let second: Vec<u8> = data[b..b + 8].to_vec();
        data[a..a + 8].copy_from_slice(&second);
        data[b..b + 8].copy_from_slice(&first);
        let (swapped_words, swapped_range) = {
            let mut w = vec![0u128; words.len()];
            // SAFETY: u128 storage viewed as bytes.
            let bytes = unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 16) };
            bytes[range.clone()].copy_from_slice(&data);
            (w, range.clone())
        };
        let got = kernel_digest(&bytes_of(&swapped_words)[swapped_range], 8);
        assert_eq!(got, gf64::digest(&data));
        assert_ne!(got, base, "swapping the words at {a} and {b} went unnoticed");
    }
}
