//! The launch that copies a stage's segments and quantizes its in-place jobs at once
//! (`src/kernels/copy_quantize.cu`), built with the batched copy's and the quantize kernel's sources as
//! the library compiles it (tests/emulate/copy_quantize_kernel.cpp) and run on the CPU over descriptors
//! laid out by the library's own `kernels::layout` and `kernels::quantize::layout`: every copied byte
//! equal to a plain copy's, every code and scale equal to the Rust reference, for any number of copying
//! blocks in front of the quantizing tiles, and per-row jobs sharing each row's amax quantized by the
//! launches around it.

#[path = "common/emulator.rs"]
mod emulator;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use quant_cases::random_batch::{self, first_difference, random_batch, rebase, reference, Shape};
use quant_cases::{case, outputs_and_jobs, Case, RowShards};
use refit::kernels::layout::BatchLayout;
use refit::kernels::quantize::layout;
use refit::quant::{Arithmetic, Fp8, Granularity, SourceType};
use std::sync::OnceLock;

type Launch =
    unsafe extern "C" fn(*const u8, u64, u64, u32, u32, u32, *const u8, u32, u64, u64, u64, u32, bool);

fn emulator() -> Launch {
    static LAUNCH: OnceLock<Launch> = OnceLock::new();
    // SAFETY: matches refit_emulate_copy_quantize in copy_quantize_kernel.cpp.
    *LAUNCH.get_or_init(|| unsafe {
        emulator::load::<Launch>("copy_quantize_kernel", c"refit_emulate_copy_quantize")
    })
}

/// A batch of quantization jobs of every kind the fused launch carries: narrow (rows, MX) and wide
/// (128 x 128 blocks) tiles, and a per-tensor job, whose phase 1 runs before the fused launch.
fn quant_cases(seed: u64) -> Vec<Case> {
    let mut rng = random_batch::Rng::new(seed);
    vec![
        case(&mut rng, "rows", Fp8::E4m3fn, Granularity::Row, SourceType::Bf16, 37, 900, 1),
        case(
            &mut rng,
            "blocks",
            Fp8::E4m3fn,
            Granularity::Block { rows: 128, cols: 128 },
            SourceType::Bf16,
            300,
            700,
            0,
        ),
        case(&mut rng, "mx", Fp8::E5m2, Granularity::Mx, SourceType::F16, 90, 330, 0),
        case(&mut rng, "tensor", Fp8::E4m3fn, Granularity::Tensor, SourceType::F32, 70, 500, 1),
    ]
}

fn run(seed: u64, copy_blocks: u32) {
    let mut rng = random_batch::Rng::new(seed);
    let shape =
        Shape { segments: 60, max_len: 1 << 18, strided_percent: 30, misaligned: true, src_len: 2 << 20 };
    let batch = random_batch(&mut rng, shape);
    let mut src = vec![0u8; batch.src_len];
    rng.fill(&mut src);
    let mut want = vec![0xCDu8; batch.dst_len];
    reference(&batch.segments, &src, &mut want);
    let mut got = vec![0xCDu8; batch.dst_len];
    let segments = rebase(&batch.segments, src.as_ptr() as u64, got.as_mut_ptr() as u64);
    let copy = BatchLayout::new(&segments).unwrap();

    let cases = quant_cases(seed);
    let (mut outputs, mut jobs) = outputs_and_jobs(&cases);
    let shards = RowShards::new(seed, Fp8::E4m3fn, Arithmetic::VllmChannel);
    let shard_outputs = shards.outputs();
    for (k, (d, s)) in shard_outputs.iter().enumerate() {
        jobs.push(shards.job(k, shards.whole.data.addr(), d.addr(), s.addr()));
    }
    let quant = layout(&jobs).unwrap();
    assert!(quant.narrow_tiles > 0 && quant.wide_range().end > quant.narrow_tiles && quant.two_phase());
    assert!(!quant.rows_range().is_empty() && quant.tensor_phase);

    // SAFETY: both layouts name the live buffers above (sources padded to whole 16-byte vectors), with
    // the copy's sentinel descriptor after its segments.
    unsafe {
        emulator()(
            copy.descriptors.as_ptr().cast(),
            copy.segments(),
            copy.tiles,
            copy.tile_shift,
            copy.group_shift,
            copy_blocks,
            quant.to_bytes().as_ptr(),
            quant.descs.len() as u32,
            quant.narrow_tiles,
            quant.rows_tiles,
            quant.tiles,
            quant.amax_words,
            quant.tensor_phase,
        )
    };
    if let Some((at, g, w)) = first_difference(&got, &want) {
        panic!("seed {seed}, {copy_blocks} copying blocks: destination byte {at} is {g:#x}, expected {w:#x}");
    }
    for (c, (dst, scales)) in cases.iter().zip(&mut outputs) {
        let (want_dst, want_scales) = c.expected();
        assert!(
            scales.bytes() == want_scales.as_slice(),
            "seed {seed}, {copy_blocks} copying blocks: {} scales",
            c.name
        );
        assert!(
            dst.bytes() == want_dst.as_slice(),
            "seed {seed}, {copy_blocks} copying blocks: {} codes",
            c.name
        );
    }
    for (k, (codes, scales)) in shard_outputs.iter().enumerate() {
        shards.check(k, codes.bytes(), scales.bytes(), &format!("seed {seed}, {copy_blocks} copying blocks"));
    }
}

#[test]
fn one_launch_copies_every_byte_and_quantizes_every_job_as_the_reference() {
    for (seed, copy_blocks) in [(1, 1), (2, 3), (3, 17)] {
        run(seed, copy_blocks);
    }
}
