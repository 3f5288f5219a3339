//! The batched copy kernel's verifying entry points (`src/kernels/batched_copy.cu`), built as host C++
//! and run on the CPU with every thread a coroutine (tests/emulate/runtime.hpp), so the lane groups'
//! shuffles behave as on the GPU: the copy that records tile digests still copies right, a check of its
//! destinations finds nothing, and one corrupted destination byte is found in the right segment, by
//! the digest check and by the byte compare, whatever the grid of either launch.

#[path = "common/emulator.rs"]
mod emulator;
#[path = "common/random_batch.rs"]
mod random_batch;

use random_batch::{first_difference, random_batch, rebase, reference, Rng, Shape};
use refit::kernels::layout::BatchLayout;
use refit::Segment;
use std::sync::OnceLock;

type Verify = unsafe extern "C" fn(u32, *const std::ffi::c_void, u64, u64, u32, u32, u32, *mut u64, *mut u64);

const COPY_DIGEST: u32 = 1;
const CHECK: u32 = 2;
const COMPARE: u32 = 3;

fn emulator() -> Verify {
    static VERIFY: OnceLock<Verify> = OnceLock::new();
    // SAFETY: matches refit_emulate_verify in host_kernel.cpp.
    *VERIFY.get_or_init(|| unsafe { emulator::load::<Verify>("host_kernel", c"refit_emulate_verify") })
}

/// Runs `mode` over `layout` on `blocks` blocks; returns the kernel's first bad descriptor index.
fn run(mode: u32, layout: &BatchLayout, group_shift: u32, blocks: u32, digests: &mut [u64]) -> u64 {
    let mut first_bad = 0u64;
    // SAFETY: descriptors hold host addresses of live buffers; `digests` has one word per tile.
    unsafe {
        emulator()(
            mode,
            layout.descriptors.as_ptr().cast(),
            layout.segments(),
            layout.tiles,
            layout.tile_shift,
            group_shift,
            blocks,
            digests.as_mut_ptr(),
            &mut first_bad,
        )
    };
    first_bad
}

/// For every destination byte (relative to the buffer), the descriptor index of the segment that
/// writes it (empty segments have no descriptor).
fn owners(segments: &[Segment], dst_len: usize) -> Vec<Option<u64>> {
    let mut owner = vec![None; dst_len];
    for (descriptor, s) in segments.iter().filter(|s| s.runs() > 0).enumerate() {
        s.for_each_run(|_, dst, len| owner[dst as usize..(dst + len) as usize].fill(Some(descriptor as u64)));
    }
    owner
}

fn verify_case(seed: u64, shape: Shape) {
    let mut rng = Rng::new(seed);
    let batch = random_batch(&mut rng, shape);
    let mut src = vec![0u8; batch.src_len];
    rng.fill(&mut src);
    let mut want = vec![0xCDu8; batch.dst_len];
    reference(&batch.segments, &src, &mut want);
    for group_shift in [3u32, 4, 5] {
        let mut dst = vec![0xCDu8; batch.dst_len];
        let segments = rebase(&batch.segments, src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        let layout = BatchLayout::new(&segments).unwrap();
        if layout.tiles == 0 {
            continue;
        }
        let mut digests = vec![0u64; layout.tiles as usize];
        run(COPY_DIGEST, &layout, group_shift, 7, &mut digests);
        if let Some((at, g, w)) = first_difference(&dst, &want) {
            panic!("seed {seed}: the digesting copy wrote byte {at} = {g:#x}, expected {w:#x}");
        }
        // Another grid than the copy's: tile digests do not depend on which warp took the tile.
        assert_eq!(run(CHECK, &layout, group_shift, 3, &mut digests), u64::MAX, "seed {seed}: false alarm");
        assert_eq!(run(COMPARE, &layout, group_shift, 5, &mut digests), u64::MAX, "seed {seed}: false alarm");

        // Corrupt one destination byte inside some segment, then two.
        let owner = owners(&batch.segments, batch.dst_len);
        let written: Vec<u64> = (0..batch.dst_len as u64).filter(|&b| owner[b as usize].is_some()).collect();
        let first = written[rng.range(0, written.len() as u64 - 1) as usize];
        dst[first as usize] ^= 0x04;
        let expect = owner[first as usize].unwrap();
        assert_eq!(run(CHECK, &layout, group_shift, 2, &mut digests), expect, "seed {seed}: check");
        assert_eq!(run(COMPARE, &layout, group_shift, 9, &mut digests), expect, "seed {seed}: compare");
        let second = written[rng.range(0, written.len() as u64 - 1) as usize];
        dst[second as usize] ^= 0x80;
        let lowest = expect.min(owner[second as usize].unwrap());
        let lowest = if first == second { u64::MAX } else { lowest };
        if lowest != u64::MAX {
            assert_eq!(run(CHECK, &layout, group_shift, 4, &mut digests), lowest, "seed {seed}: two bytes");
            assert_eq!(run(COMPARE, &layout, group_shift, 4, &mut digests), lowest, "seed {seed}: two bytes");
        }
    }
}

#[test]
fn corrupted_bytes_are_found_in_their_segment() {
    for (seed, misaligned) in [(1, false), (2, true), (3, true)] {
        let shape =
            Shape { segments: 40, max_len: 70_000, strided_percent: 30, misaligned, src_len: 1 << 20 };
        verify_case(seed, shape);
    }
}

#[test]
fn small_segments_and_column_splits() {
    let shape =
        Shape { segments: 300, max_len: 4096, strided_percent: 50, misaligned: true, src_len: 1 << 19 };
    verify_case(11, shape);
    let aligned =
        Shape { segments: 200, max_len: 2048, strided_percent: 80, misaligned: false, src_len: 1 << 19 };
    verify_case(12, aligned);
}
