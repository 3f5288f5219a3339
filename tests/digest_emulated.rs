//! The digest kernel's own source (`src/kernels/digest.cu`), built as host C++ by
//! `tests/emulate/digest_kernel.cpp` and run on the CPU (every thread a coroutine, so its warp shuffles
//! and block barrier behave as on the GPU), against the Rust implementation (`kernels::gf64::digest`)
//! on random data, lengths, alignments and launch geometries; both entry points, one range
//! (`refit_digest`) and many in one launch (`refit_digest_many`, laid out by `many_layout`).

#[path = "common/emulator.rs"]
mod emulator;
#[path = "common/random_batch.rs"]
mod random_batch;

use random_batch::Rng;
use refit::kernels::digest::{geometry, many_layout, ByteRange, Geometry, ManyLayout, RangeDescriptor};
use refit::kernels::gf64;
use std::sync::OnceLock;

type Launch = unsafe extern "C" fn(u64, u64, u32, *const u64, *mut u64, u32);
type LaunchMany = unsafe extern "C" fn(*const RangeDescriptor, u32, u64, u64, *const u64, *mut u64, u32);

fn emulator() -> Launch {
    static LAUNCH: OnceLock<Launch> = OnceLock::new();
    // SAFETY: matches refit_emulate_digest in digest_kernel.cpp.
    *LAUNCH.get_or_init(|| unsafe { emulator::load::<Launch>("digest_kernel", c"refit_emulate_digest") })
}

fn many_emulator() -> LaunchMany {
    static LAUNCH: OnceLock<LaunchMany> = OnceLock::new();
    // SAFETY: matches refit_emulate_digest_many in digest_kernel.cpp.
    *LAUNCH.get_or_init(|| unsafe {
        emulator::load::<LaunchMany>("digest_kernel", c"refit_emulate_digest_many")
    })
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

/// The emulated kernel's digests of `ranges` in one launch, laid out as the library would with at
/// most `max_warps`.
///
/// # Safety
/// Every range with bytes lies in memory whose aligned 16-byte blocks are readable.
unsafe fn kernel_digests(ranges: &[ByteRange], max_warps: u64) -> Vec<u64> {
    let ManyLayout { descriptors, total_chunks, span, blocks } = many_layout(ranges, max_warps).unwrap();
    let mut out = vec![0xdead_beef_u64; ranges.len()];
    // SAFETY: the caller's promise on the ranges; `out` holds one word per range.
    unsafe {
        many_emulator()(
            descriptors.as_ptr(),
            descriptors.len() as u32,
            total_chunks,
            span,
            constants().as_ptr(),
            out.as_mut_ptr(),
            blocks,
        )
    };
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

/// Ranges of a buffer with room on both sides, and their digests computed on the host.
fn ranges_of(data: &[u8], base: usize, spans: &[(usize, usize)]) -> (Vec<ByteRange>, Vec<u64>) {
    let ranges = spans
        .iter()
        .map(|&(at, len)| ByteRange { addr: data.as_ptr() as u64 + (base + at) as u64, len: len as u64 });
    let want = spans.iter().map(|&(at, len)| gf64::digest(&data[base + at..base + at + len])).collect();
    (ranges.collect(), want)
}

#[test]
fn many_ranges_in_one_launch_agree_with_the_host_one_by_one() {
    let mut rng = Rng::new(21);
    let (words, range) = padded(&mut rng, 300_000, 0);
    let data = bytes_of(&words);
    // Empty ranges (aligned and not), lengths around the vector and chunk sizes, unaligned starts,
    // overlapping and repeated ranges, one range of most of the buffer among many tiny ones.
    let mut spans: Vec<(usize, usize)> = vec![(0, 0), (3, 0), (17, 1), (0, 1), (5, 15), (16, 16), (1, 17)];
    for len in [31usize, 496, 511, 512, 513, 1023, 1024, 1040, 4095, 4096, 8191, 20_000] {
        spans.push((rng.range(0, 1000) as usize, len));
    }
    spans.push((7, 250_003));
    for _ in 0..200 {
        spans.push((rng.range(0, 290_000) as usize, rng.range(0, 40) as usize));
    }
    spans.push((7, 250_003));
    let (ranges, want) = ranges_of(data, range.start, &spans);
    for max_warps in [1u64, 3, 64, 2000] {
        // SAFETY: every range lies in `words`, with 32 bytes to spare on both sides.
        let got = unsafe { kernel_digests(&ranges, max_warps) };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "range {i} {:?} with at most {max_warps} warps: {g:#x} != {w:#x}", spans[i]);
        }
    }
    // Each equals the single-range kernel's digest of that range.
    for (i, &(at, len)) in spans.iter().enumerate().take(20) {
        assert_eq!(kernel_digest(&data[range.start + at..range.start + at + len], 64), want[i], "range {i}");
    }
}

#[test]
fn one_huge_range_and_many_tiny_ones_split_across_warps() {
    // 1 MiB + 5 bytes beside 3000 ranges of 0 to 9 bytes: the huge range is cut into many warps'
    // pieces, and warps whose span covers hundreds of tiny ranges finish one piece per range.
    let mut rng = Rng::new(23);
    let (words, range) = padded(&mut rng, (1 << 20) + 5000, 0);
    let data = bytes_of(&words);
    let mut spans = vec![(3usize, (1usize << 20) + 5)];
    for k in 0..3000 {
        spans.push(((1 << 20) + 8 + k, k % 10));
    }
    let (ranges, want) = ranges_of(data, range.start, &spans);
    for max_warps in [5u64, 600] {
        // SAFETY: as above.
        let got = unsafe { kernel_digests(&ranges, max_warps) };
        assert_eq!(got, want, "at most {max_warps} warps");
    }
}

#[test]
fn a_pieces_factor_covers_every_bit_of_its_first_chunk() {
    // x^(4096 c0 - 8 delta) for first chunks up to 2^52 - 1 (ranges up to 2^60 bytes): the bits above
    // 31 are held by a second factor per lane, which no buffer of a test reaches through the kernel.
    type Factor = unsafe extern "C" fn(u64, u64, *const u64, *mut u64);
    // SAFETY: matches refit_emulate_piece_factor in digest_kernel.cpp.
    let factor = unsafe { emulator::load::<Factor>("digest_kernel", c"refit_emulate_piece_factor") };
    let mut rng = Rng::new(37);
    let mut cases: Vec<(u64, u64)> =
        vec![(0, 0), (1, 0), (0, 15), ((1 << 52) - 1, 15), (1 << 32, 3), (1 << 51, 1)];
    for bit in 0..52 {
        cases.push((1 << bit, bit % 16));
    }
    for _ in 0..40 {
        cases.push((rng.next() >> 12, rng.next() % 16));
    }
    for (c0, delta) in cases {
        let mut got = 0;
        // SAFETY: one warp, the constants, one output word.
        unsafe { factor(c0, delta, constants().as_ptr(), &mut got) };
        let want = gf64::mul(gf64::pow_x(4096 * c0), gf64::pow_x_inverse(8 * delta));
        assert_eq!(got, want, "c0 {c0:#x}, delta {delta}");
    }
}

#[test]
fn no_ranges_launch_nothing() {
    // SAFETY: no memory is named.
    assert!(unsafe { kernel_digests(&[], 64) }.is_empty());
}

/// Two pages whose second is inaccessible: a read there ends the test process.
struct GuardPage {
    base: *mut libc::c_void,
    page: usize,
}

impl GuardPage {
    fn new() -> GuardPage {
        // SAFETY: plain anonymous mappings, the second made inaccessible.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
            let base = libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            assert_eq!(libc::mprotect(base.cast::<u8>().add(page).cast(), page, libc::PROT_NONE), 0);
            GuardPage { base, page }
        }
    }

    /// The first inaccessible address.
    fn guard(&self) -> u64 {
        self.base as u64 + self.page as u64
    }
}

impl Drop for GuardPage {
    fn drop(&mut self) {
        // SAFETY: mapped in new.
        unsafe { libc::munmap(self.base, 2 * self.page) };
    }
}

#[test]
fn zero_bytes_are_read_nowhere_and_digest_to_one() {
    // Issue 26, 6: zero bytes at any address, the last one of the address space included, are the
    // marker alone (the digest 1) and read nothing, not even the aligned block holding the address.
    let guard = GuardPage::new();
    let addresses = [guard.guard(), guard.guard() + 5, guard.guard() + 15, u64::MAX, u64::MAX - 16, 1];
    for addr in addresses {
        let mut out = 0xdead_beef_u64;
        let Geometry { span_shift, blocks } = geometry(addr, 0, 8);
        // SAFETY: the kernel must read nothing for zero bytes (a read here would end the test).
        unsafe { emulator()(addr, 0, span_shift, constants().as_ptr(), &mut out, blocks) };
        assert_eq!(out, 1, "0 bytes at {addr:#x}");
    }
    // The same in one launch of many, beside ranges that end just before the guard page.
    let mut ranges: Vec<ByteRange> = addresses.iter().map(|&addr| ByteRange { addr, len: 0 }).collect();
    // SAFETY: the first page is ours.
    let first = unsafe { std::slice::from_raw_parts_mut(guard.base.cast::<u8>(), guard.page) };
    Rng::new(29).fill(first);
    ranges.push(ByteRange { addr: guard.guard() - 100, len: 100 });
    ranges.push(ByteRange { addr: guard.guard() - 16, len: 16 });
    // SAFETY: the ranges with bytes lie in the first page and end at its end, a 16-byte boundary.
    let got = unsafe { kernel_digests(&ranges, 8) };
    let tail = |n: usize| gf64::digest(&first[guard.page - n..]);
    assert_eq!(got, [1, 1, 1, 1, 1, 1, tail(100), tail(16)]);
}
