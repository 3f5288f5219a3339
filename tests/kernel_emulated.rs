//! The CUDA kernel's own source (`src/kernels/batched_copy.cu`), built as host C++ by
//! `tests/emulate/host_kernel.cpp` and run on the CPU (tests/emulate/runtime.hpp) over descriptors laid out by
//! `kernels::layout` (exactly what the GPU receives, with host addresses). This tests the kernel's
//! tile split, segment search, strided walk and alignment paths in CI, where there is no GPU; the GPU
//! tests (tests/gpu_copy.rs) then only need to confirm the device behaves like this.

#[path = "common/emulator.rs"]
mod emulator;
#[path = "common/random_batch.rs"]
mod random_batch;

use random_batch::{first_difference, random_batch, rebase, reference, Rng, Shape};
use refit::kernels::layout::BatchLayout;
use refit::segment::check::validate;
use refit::Segment;
use std::sync::OnceLock;

type Launch = unsafe extern "C" fn(*const std::ffi::c_void, u64, u64, u32, u32, u32, u32);

fn emulator() -> Launch {
    static LAUNCH: OnceLock<Launch> = OnceLock::new();
    // SAFETY: matches refit_emulate_launch in host_kernel.cpp.
    *LAUNCH.get_or_init(|| unsafe { emulator::load::<Launch>("host_kernel", c"refit_emulate_launch") })
}

/// Every lane-group width the kernel supports (log2 lanes per tile: 8, 16, 32).
const GROUP_SHIFTS: [u32; 3] = [3, 4, 5];

/// Lays out `segments` with tiles of `2^tile_shift` bytes and runs the emulated kernel over them with
/// `blocks` blocks of 256 threads and `2^group_shift` lanes per tile.
fn emulate(segments: &[Segment], blocks: u32, tile_shift: u32, group_shift: u32) {
    validate(segments).unwrap();
    let layout = BatchLayout::with_tile_shift(segments, tile_shift).unwrap();
    if layout.tiles == 0 {
        return;
    }
    // SAFETY: descriptors hold host addresses of live buffers; nseg + sentinel entries are present.
    unsafe {
        emulator()(
            layout.descriptors.as_ptr().cast(),
            layout.segments(),
            layout.tiles,
            layout.tile_shift,
            group_shift,
            blocks,
            256,
        )
    };
}

fn run(seed: u64, shape: Shape, blocks: u32) {
    run_with_tile(seed, shape, blocks, BatchLayout::default_tile_shift());
}

fn run_with_tile(seed: u64, shape: Shape, blocks: u32, tile_shift: u32) {
    let mut rng = Rng::new(seed);
    let batch = random_batch(&mut rng, shape);
    let mut src = vec![0u8; batch.src_len];
    rng.fill(&mut src);
    let mut want = vec![0xCDu8; batch.dst_len];
    reference(&batch.segments, &src, &mut want);
    for group_shift in GROUP_SHIFTS {
        let mut got = vec![0xCDu8; batch.dst_len];
        let segments = rebase(&batch.segments, src.as_ptr() as u64, got.as_mut_ptr() as u64);
        emulate(&segments, blocks, tile_shift, group_shift);
        if let Some((at, g, w)) = first_difference(&got, &want) {
            panic!(
                "seed {seed}, {blocks} blocks, tile 2^{tile_shift}, 2^{group_shift} lanes per tile, {shape:?}: \
                 destination byte {at} is {g:#x}, expected {w:#x}"
            );
        }
    }
}

#[test]
fn random_batches_aligned_and_misaligned() {
    for (seed, blocks) in [(1, 1), (2, 3), (3, 17), (4, 64)] {
        for misaligned in [false, true] {
            let shape =
                Shape { segments: 50, max_len: 1 << 20, strided_percent: 30, misaligned, src_len: 3 << 20 };
            run(seed, shape, blocks);
        }
    }
}

#[test]
fn other_tile_sizes() {
    for (seed, shift) in [(61, 10), (62, 12), (63, 16), (64, 20)] {
        let shape =
            Shape { segments: 40, max_len: 1 << 20, strided_percent: 40, misaligned: true, src_len: 3 << 20 };
        run_with_tile(seed, shape, 11, shift);
    }
}

#[test]
fn thousands_of_small_segments_over_many_warps() {
    let shape =
        Shape { segments: 4000, max_len: 4096, strided_percent: 25, misaligned: true, src_len: 1 << 20 };
    run(21, shape, 5);
    run(22, shape, 200);
}

#[test]
fn strided_segments_only() {
    let shape =
        Shape { segments: 200, max_len: 65536, strided_percent: 100, misaligned: true, src_len: 4 << 20 };
    run(31, shape, 9);
}

#[test]
fn more_warps_than_tiles_and_one_warp_for_everything() {
    let shape =
        Shape { segments: 30, max_len: 8192, strided_percent: 30, misaligned: false, src_len: 1 << 20 };
    run(41, shape, 100); // most warps get no tile
    run(42, shape, 1);
}

type Shape2 = (u64, [u64; 2], [u64; 2], [u64; 2]);

#[test]
fn aligned_rows_take_the_row_spread_path() {
    // 16-byte aligned rows with 16-byte multiple lengths and strides: the column split and variants
    // whose tiles cross an outer repetition (which must fall back to the row-by-row walk).
    let mut rng = Rng::new(51);
    // (len, count, src_stride, dst_stride)
    let cases: [Shape2; 5] = [
        (768, [2048, 1], [1536, 0], [768, 0]),
        (768, [5, 7], [1536, 1536 * 6], [768, 768 * 5 + 32]),
        (16, [100, 3], [48, 4800], [16, 1600]),
        (4096, [3, 2], [4096 + 64, 20000 * 16], [4096, 3 * 4096]),
        (48, [33, 2], [0, 48], [48, 33 * 48]),
    ];
    for (len, count, src_stride, dst_stride) in cases {
        let src_extent = random_batch::extent(len, count, src_stride);
        let dst_extent = random_batch::extent(len, count, dst_stride);
        let segment = Segment { src: 0, dst: 16, len, count, src_stride, dst_stride };
        // u128 storage: 16-byte aligned bases, so the relative offsets keep their alignment.
        let mut src_words = vec![0u128; (src_extent as usize).div_ceil(16) + 1];
        let src = as_bytes(&mut src_words);
        rng.fill(src);
        let dst_words_len = (dst_extent as usize + 16).div_ceil(16);
        let mut want = vec![0xCDu8; dst_words_len * 16];
        reference(&[segment], src, &mut want);
        let src_ptr = src.as_ptr() as u64;
        for group_shift in GROUP_SHIFTS {
            let mut dst_words = vec![0xCDCD_CDCD_CDCD_CDCD_CDCD_CDCD_CDCD_CDCDu128; dst_words_len];
            let got = as_bytes(&mut dst_words);
            let segments = rebase(&[segment], src_ptr, got.as_mut_ptr() as u64);
            emulate(&segments, 3, BatchLayout::default_tile_shift(), group_shift);
            if let Some((at, g, w)) = first_difference(got, &want) {
                panic!(
                    "{segment:?}, 2^{group_shift} lanes: destination byte {at} is {g:#x}, expected {w:#x}"
                );
            }
        }
    }
}

fn as_bytes(words: &mut [u128]) -> &mut [u8] {
    // SAFETY: u128 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 16) }
}
