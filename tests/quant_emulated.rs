//! The quantizing kernel's own source (`src/kernels/quantize.cu`), built as host C++ by
//! `tests/emulate/quant_kernel.cpp` and run on the CPU (every thread a coroutine, so its shuffles and
//! barriers behave as on the GPU; the FP8 conversion takes the kernel's integer path, which the GPU
//! replaces by the hardware's on sm_89 and later), laid out by the library's own
//! `kernels::quantize::layout`: every FP8 byte and every scale equal to the Rust reference, and the
//! bytes no job covers untouched.

#[path = "common/emulator.rs"]
mod emulator;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use quant_cases::{case, outputs_and_jobs, standard_cases, Aligned, Case, Rng, SENTINEL};
use refit::kernels::quantize::layout;
use refit::quant::{Arithmetic, Fp8, Granularity, SourceType};
use std::sync::OnceLock;

type Launch = unsafe extern "C" fn(*const u8, u32, u64, u64, u64, u64, u32, bool);

fn emulator() -> Launch {
    static LAUNCH: OnceLock<Launch> = OnceLock::new();
    // SAFETY: matches refit_emulate_quantize in quant_kernel.cpp.
    *LAUNCH.get_or_init(|| unsafe { emulator::load::<Launch>("quant_kernel", c"refit_emulate_quantize") })
}

/// Runs the launches of `l` through the emulated kernel (none without tiles).
///
/// # Safety
/// The descriptors name memory that outlives the call, sources padded to whole 16-byte vectors.
unsafe fn emulate(l: &refit::kernels::quantize::Layout) {
    if l.tiles > 0 {
        // SAFETY: the caller's promise.
        unsafe {
            emulator()(
                l.to_bytes().as_ptr(),
                l.descs.len() as u32,
                l.group_tiles,
                l.narrow_tiles,
                l.rows_tiles,
                l.tiles,
                l.amax_words,
                l.tensor_phase,
            )
        };
    }
}

/// Runs `cases` as one batch through the emulated kernel and compares each with the reference.
fn check_batch(cases: &[Case]) {
    let (mut outputs, jobs) = outputs_and_jobs(cases);
    let l = layout(&jobs).unwrap();
    // SAFETY: the descriptors name the buffers above, which outlive the call; the sources are
    // padded to whole 16-byte vectors.
    unsafe { emulate(&l) };
    for (c, (dst, scales)) in cases.iter().zip(&mut outputs) {
        let (want_dst, want_scales) = c.expected();
        if let Some(at) = (0..want_scales.len()).find(|&i| scales.bytes()[i] != want_scales[i]) {
            panic!(
                "{}: scale byte {at}: kernel {:#04x}, reference {:#04x}",
                c.name,
                scales.bytes()[at],
                want_scales[at]
            );
        }
        if let Some(at) = (0..want_dst.len()).find(|&i| dst.bytes()[i] != want_dst[i]) {
            let (row, col) = (at as u64 / c.dst_stride, at as u64 % c.dst_stride);
            panic!(
                "{}: element ({row}, {col}): kernel {:#04x}, reference {:#04x}",
                c.name,
                dst.bytes()[at],
                want_dst[at]
            );
        }
    }
}

#[test]
fn every_granularity_target_and_source_matches_the_reference() {
    for case in standard_cases(1, false) {
        check_batch(std::slice::from_ref(&case));
    }
}

#[test]
fn a_mixed_batch_with_empty_jobs_matches_the_reference() {
    let mut rng = Rng::new(5);
    let block = Granularity::Block { rows: 128, cols: 128 };
    let cases = vec![
        case(&mut rng, "a", Fp8::E4m3fn, block, SourceType::Bf16, 200, 136, 1),
        case(&mut rng, "empty rows", Fp8::E4m3fn, Granularity::Row, SourceType::Bf16, 0, 64, 0),
        case(&mut rng, "b", Fp8::E5m2, Granularity::Mx, SourceType::Bf16, 33, 100, 0),
        case(&mut rng, "c", Fp8::E4m3fn, Granularity::Tensor, SourceType::F32, 17, 50, 1),
        case(&mut rng, "empty cols", Fp8::E5m2, Granularity::Mx, SourceType::F16, 5, 0, 0),
        case(&mut rng, "d", Fp8::E4m3fn, Granularity::Tensor, SourceType::Bf16, 40, 24, 0),
        case(&mut rng, "e", Fp8::E4m3fn, Granularity::Row, SourceType::F16, 9, 300, 0),
    ];
    check_batch(&cases);
}

#[test]
fn whole_tiles_and_rows_take_their_amax_from_every_cached_vector() {
    // 128 x 128 blocks of 16-bit elements are exactly the wide entry point's cache (8 vectors per
    // thread, 16 rows apart), so they take its whole-tile path. In tile b, one element far above the
    // rest sits in row 16 (b % 8) + b % 16: across the tiles, in every cache slot of several
    // threads. A path that left a slot out of the amax would get that tile's scale wrong.
    let mut rng = Rng::new(29);
    for source in [SourceType::Bf16, SourceType::F16] {
        for target in [Fp8::E4m3fn, Fp8::E5m2] {
            let block = Granularity::Block { rows: 128, cols: 128 };
            let mut c = case(&mut rng, "whole tiles", target, block, source, 384, 640, 1);
            let big: u16 = if source == SourceType::Bf16 { 0x7000 } else { 0x7800 }; // 2^97 / 2^15
            let stride = c.src_stride as usize;
            for b in 0..15usize {
                let (tile_row, tile_col) = (b / 5, b % 5);
                let row = tile_row * 128 + 16 * (b % 8) + b % 16;
                let col = tile_col * 128 + (b * 8) % 128;
                let at = (row * stride + col) * 2;
                c.data.bytes_mut()[at..at + 2].copy_from_slice(&big.to_le_bytes());
            }
            check_batch(std::slice::from_ref(&c));
        }
    }
    // Rows that are exactly the narrow entry point's cache (8192 bf16, 4 vectors per thread 256
    // apart along the row) take its whole-row path; rows of 16384 (the wide entry point's 8) its
    // general loops. Row r's maximum sits in slot r % (vectors per thread).
    for cols in [8192usize, 16384] {
        let mut c =
            case(&mut rng, "whole rows", Fp8::E4m3fn, Granularity::Row, SourceType::Bf16, 24, cols as u64, 1);
        let stride = c.src_stride as usize;
        for r in 0..24usize {
            let col = (r % (cols / 2048)) * 2048 + (r * 8) % 2048;
            let at = (r * stride + col) * 2;
            c.data.bytes_mut()[at..at + 2].copy_from_slice(&0x7000u16.to_le_bytes());
        }
        check_batch(std::slice::from_ref(&c));
    }
}

#[test]
fn rows_longer_than_the_registers_hold_are_read_twice_and_still_match() {
    // Per row and per tensor over rows of 2,500 vectors (more than 256 threads x 8 cached).
    let mut rng = Rng::new(9);
    for granularity in [Granularity::Row, Granularity::Tensor] {
        for source in [SourceType::Bf16, SourceType::F32] {
            let c = case(&mut rng, "long rows", Fp8::E4m3fn, granularity, source, 3, 20_000, 0);
            check_batch(std::slice::from_ref(&c));
        }
    }
    // Rows at the narrow entry point's edge: 1,024 bf16 vectors (4 per thread, all held) take it,
    // 1,025 the wide one; in one batch, so both launches run and the second starts past the first's
    // tiles.
    let edge: Vec<Case> = [8192, 8200]
        .map(|cols| case(&mut rng, "edge rows", Fp8::E4m3fn, Granularity::Row, SourceType::Bf16, 3, cols, 0))
        .into();
    let at = |i: u64, what: u64| (i + 1) << 30 | what << 24;
    let jobs: Vec<_> = (0u64..).zip(&edge).map(|(i, c)| c.job(at(i, 1), at(i, 2), at(i, 3))).collect();
    let l = layout(&jobs).unwrap();
    assert_eq!((l.narrow_tiles, l.tiles), (3, 6));
    check_batch(&edge);
    // Per tensor with several slabs of several rows.
    let c = case(&mut rng, "slabs", Fp8::E5m2, Granularity::Tensor, SourceType::Bf16, 300, 1000, 1);
    check_batch(std::slice::from_ref(&c));
}

#[test]
fn a_nan_or_an_infinity_takes_its_block_as_documented() {
    let mut rng = Rng::new(2);
    let mut c = case(
        &mut rng,
        "specials",
        Fp8::E4m3fn,
        Granularity::Block { rows: 2, cols: 8 },
        SourceType::Bf16,
        4,
        16,
        0,
    );
    // Block (0, 0): a NaN; block (0, 1): an infinity; block (1, *): zeros.
    let bytes = c.data.bytes_mut();
    let set = |bytes: &mut [u8], r: usize, col: usize, x: f32| {
        let at = (r * 16 + col) * 2;
        bytes[at..at + 2].copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
    };
    for r in 0..4 {
        for col in 0..16 {
            set(bytes, r, col, if r < 2 { 1.5 } else { 0.0 });
        }
    }
    set(bytes, 1, 3, f32::NAN);
    set(bytes, 0, 12, f32::NEG_INFINITY);
    set(bytes, 3, 5, -0.0);
    let (dst, scales) = c.expected();
    let scale = |i: usize| u32::from_le_bytes(scales[i * 4..i * 4 + 4].try_into().unwrap());
    assert_eq!(scale(0), 0x7fff_ffff);
    assert_eq!(f32::from_bits(scale(1)), f32::INFINITY);
    assert_eq!(f32::from_bits(scale(2)), 1e-10f32 / 448.0);
    assert!(dst[..8].iter().chain(&dst[16..24]).all(|&b| b == 0x7f), "NaN block: {dst:?}");
    assert_eq!(dst[12], 0x7f, "-inf / inf is NaN");
    assert_eq!(dst[8], 0x00, "1.5 / inf is +0");
    assert!(dst[32..].iter().enumerate().all(|(i, &b)| b == if i == 16 + 5 { 0x80 } else { 0 }));
    check_batch(std::slice::from_ref(&c));
}

/// The floorless arithmetic (vLLM's per tensor) where a scale's reciprocal is +inf: an all-zero
/// block (scale 0) and a block whose amax is a bf16 subnormal (its scale's reciprocal overflows),
/// whose codes are products by +inf, NaN for the zeros, +FP8_MAX under this arithmetic; beside a
/// NaN block and an infinite one. Every code and scale as the reference's, on each entry point.
#[test]
fn the_floorless_arithmetic_takes_infinite_reciprocals_as_documented() {
    let mut rng = Rng::new(3);
    let mut cases = Vec::new();
    for granularity in [
        Granularity::Block { rows: 2, cols: 8 },
        Granularity::Row,
        Granularity::Block { rows: 128, cols: 128 },
    ] {
        let mut c = case(&mut rng, "floorless", Fp8::E4m3fn, granularity, SourceType::Bf16, 8, 16, 0);
        c.quantization = c.quantization.with(Arithmetic::VllmTensor);
        let bytes = c.data.bytes_mut();
        let set = |bytes: &mut [u8], r: usize, col: usize, bits: u16| {
            bytes[(r * 16 + col) * 2..(r * 16 + col) * 2 + 2].copy_from_slice(&bits.to_le_bytes());
        };
        // Rows 0-1: zeros (and a -0.0); rows 2-3: subnormals; rows 4-5: a NaN; rows 6-7: an infinity.
        for r in 0..8 {
            for col in 0..16 {
                let bits = match r / 2 {
                    0 => 0,
                    1 => 1 + (col as u16 % 3),
                    _ => 0x3fc0, // 1.5
                };
                set(bytes, r, col, bits);
            }
        }
        set(bytes, 1, 4, 0x8000);
        set(bytes, 3, 9, 0x8002);
        set(bytes, 4, 2, 0x7fc0);
        set(bytes, 7, 11, 0xff80);
        let (dst, _) = c.expected();
        if granularity == (Granularity::Block { rows: 2, cols: 8 }) {
            assert!(dst[..32].iter().all(|&b| b == 0x7e), "zeros over scale 0: {:?}", &dst[..32]);
            assert!(dst[32..64].iter().all(|&b| b & 0x7f == 0x7e), "subnormals over +inf reciprocals");
        }
        cases.push(c);
    }
    check_batch(&cases);
}

#[test]
fn every_tile_finds_its_job_through_the_tile_index() {
    // Small jobs of 1 to 20 tiles (a 2 x 8 block each), many per index entry of 256 tiles, around a
    // job of 700 tiles that fills whole entries and starts and ends inside others.
    let mut rng = Rng::new(17);
    let small = Granularity::Block { rows: 2, cols: 8 };
    let mut cases: Vec<Case> = Vec::new();
    for i in 0..70u64 {
        let rows = if i == 30 { 2 * 700 } else { 2 * (1 + (i * 7) % 20) };
        cases.push(case(&mut rng, "indexed", Fp8::E4m3fn, small, SourceType::Bf16, rows, 8, 0));
    }
    let at = |i: u64, what: u64| (i + 1) << 30 | what << 24;
    let jobs: Vec<_> = (0u64..).zip(&cases).map(|(i, c)| c.job(at(i, 1), at(i, 2), at(i, 3))).collect();
    let l = layout(&jobs).unwrap();
    assert!(l.tiles > 4 * 256, "{} tiles", l.tiles);
    let spans = l.index.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>();
    assert!(spans.iter().any(|&n| n > 5) && spans.contains(&0), "index spans {spans:?}");
    check_batch(&cases);
}

#[test]
fn launches_of_many_tiles_in_every_mode_match_the_reference() {
    // Tens to hundreds of tiles per launch in block mode (whole tiles and ragged ones), group mode,
    // per row and per tensor, each padded, so that tiles find their jobs at every offset.
    let mut rng = Rng::new(11);
    let cases = [
        (Granularity::Block { rows: 128, cols: 128 }, SourceType::Bf16, 300, 1100),
        (Granularity::Block { rows: 16, cols: 32 }, SourceType::F32, 64, 250),
        (Granularity::Row, SourceType::Bf16, 40, 700),
        (Granularity::Tensor, SourceType::Bf16, 300, 1000),
        (Granularity::Mx, SourceType::Bf16, 200, 1000),
    ];
    for (granularity, source, rows, cols) in cases {
        let c = case(&mut rng, "waves", Fp8::E4m3fn, granularity, source, rows, cols, 1);
        check_batch(std::slice::from_ref(&c));
    }
}

/// Per-tensor jobs naming one scale, in a batch with every other granularity (so that their
/// descriptors are reordered, the narrow entry point's first): one amax word for all of them, the
/// scale written once, every code from the shared scale.
#[test]
fn per_tensor_jobs_naming_one_scale_share_one_amax_word() {
    use quant_cases::{check_shared, shared_scale_cases};
    use refit::quant::Arithmetic;
    let others = standard_cases(31, false);
    let shared = shared_scale_cases(4, Fp8::E4m3fn, Arithmetic::DeepGemm);
    let other_outputs: Vec<(Aligned, Aligned)> = others
        .iter()
        .map(|c| (Aligned::new(c.dst_len(), SENTINEL), Aligned::new(c.scale_len(), SENTINEL)))
        .collect();
    let codes: Vec<Aligned> = shared.iter().map(|c| Aligned::new(c.dst_len(), SENTINEL)).collect();
    let scale = Aligned::new(4, SENTINEL);
    // The shared jobs between the others: the first of them is not the first descriptor.
    let mut jobs: Vec<_> = others
        .iter()
        .zip(&other_outputs)
        .map(|(c, (d, s))| c.job(c.data.addr(), d.addr(), s.addr()))
        .collect();
    let at = jobs.len() / 2;
    for (i, (c, d)) in shared.iter().zip(&codes).enumerate() {
        jobs.insert(at + i * 2, c.job(c.data.addr(), d.addr(), scale.addr()));
    }
    let l = layout(&jobs).unwrap();
    let slots: Vec<u32> = l.descs.iter().filter(|d| d.scales == scale.addr()).map(|d| d.amax_slot).collect();
    assert!(slots.len() == 3 && slots.iter().all(|&s| s == slots[0]), "amax slots {slots:?}");
    // SAFETY: the descriptors name the buffers above, which outlive the call.
    unsafe { emulate(&l) };
    let codes: Vec<Vec<u8>> = codes.iter().map(|d| d.bytes().to_vec()).collect();
    check_shared(&shared, &codes, scale.bytes(), "emulated kernel");
    // Two scales joined through an amax key: one amax word, both scales the same value.
    let keyed_codes: Vec<Aligned> = shared.iter().map(|c| Aligned::new(c.dst_len(), SENTINEL)).collect();
    let (a, b) = (Aligned::new(4, SENTINEL), Aligned::new(4, SENTINEL));
    let mut keyed: Vec<refit::quant::QuantJob> =
        shared.iter().zip(&keyed_codes).map(|(c, d)| c.job(c.data.addr(), d.addr(), 0)).collect();
    quant_cases::key_jobs(&mut keyed, a.addr(), b.addr());
    let mut jobs: Vec<_> = others
        .iter()
        .zip(&other_outputs)
        .map(|(c, (d, s))| c.job(c.data.addr(), d.addr(), s.addr()))
        .collect();
    for (i, job) in keyed.into_iter().enumerate() {
        jobs.insert(at + i * 2, job);
    }
    let l = layout(&jobs).unwrap();
    let keyed_slots: Vec<u32> =
        l.descs.iter().filter(|d| [a.addr(), b.addr()].contains(&d.scales)).map(|d| d.amax_slot).collect();
    assert!(
        keyed_slots.len() == 3 && keyed_slots.iter().all(|&s| s == keyed_slots[0]),
        "amax slots {keyed_slots:?}"
    );
    // SAFETY: the descriptors name the buffers above, which outlive the call.
    unsafe { emulate(&l) };
    let got: Vec<Vec<u8>> = keyed_codes.iter().map(|d| d.bytes().to_vec()).collect();
    for scale in [&a, &b] {
        check_shared(&shared, &got, scale.bytes(), "emulated kernel, keyed");
    }
    for (c, (dst, scales)) in others.iter().zip(&other_outputs) {
        let (want_dst, want_scales) = c.expected();
        assert!(dst.bytes() == want_dst.as_slice() && scales.bytes() == want_scales.as_slice(), "{}", c.name);
    }
}

/// A row-parallel weight's column shards as per-row jobs sharing each row's amax, between other
/// jobs: two phases on their own entry point over slabs of whole rows, each set's words one per row,
/// every row's scale the whole row's on every shard. Three geometries: short rows whose warps span
/// rows; rows of whole warps' vectors, many to a slab and one longer than a slab's cache; f32 rows.
#[test]
fn per_row_jobs_sharing_an_amax_key_take_each_whole_rows_amax() {
    use quant_cases::RowShards;
    use refit::quant::Arithmetic;
    let shards = RowShards::new(5, Fp8::E4m3fn, Arithmetic::VllmChannel);
    shared_rows_between_other_jobs(shards, standard_cases(33, false), &[100, 100, 100]);
    // (Alone: the emulator takes a minute over the standard cases.)
    let (wide, f32) = (
        RowShards::wide(6, Fp8::E5m2, Arithmetic::Divide),
        RowShards::f32(7, Fp8::E4m3fn, Arithmetic::DeepGemm),
    );
    shared_rows_between_other_jobs(wide, Vec::new(), &[8, 10, 1, 10]);
    shared_rows_between_other_jobs(f32, Vec::new(), &[6, 6]);
}

/// `shards` laid out between the jobs of `others`: each shard's slab rows as `slab_rows` says, then
/// the emulated kernel's output checked.
fn shared_rows_between_other_jobs(shards: quant_cases::RowShards, others: Vec<Case>, slab_rows: &[u32]) {
    let (other_outputs, mut jobs) = outputs_and_jobs(&others);
    let outputs = shards.outputs();
    let at = jobs.len() / 2;
    for (k, (d, s)) in outputs.iter().enumerate() {
        jobs.insert(
            (at + 2 * k).min(jobs.len()),
            shards.job(k, shards.whole.data.addr(), d.addr(), s.addr()),
        );
    }
    let l = layout(&jobs).unwrap();
    let mine: Vec<_> =
        outputs.iter().map(|(_, s)| l.descs.iter().find(|d| d.scales == s.addr()).unwrap()).collect();
    assert!(mine.iter().all(|d| d.amax_slot == mine[0].amax_slot), "amax slots differ");
    let slabs: Vec<u32> = mine.iter().map(|d| d.block_rows).collect();
    assert_eq!(slabs, slab_rows, "rows to a slab");
    assert!(l.amax_words as u64 >= shards.whole.rows, "one word per row: {}", l.amax_words);
    // SAFETY: the descriptors name the buffers above, which outlive the call.
    unsafe { emulate(&l) };
    for (k, (codes, scales)) in outputs.iter().enumerate() {
        shards.check(k, codes.bytes(), scales.bytes(), "emulated kernel");
    }
    for (c, (dst, scales)) in others.iter().zip(&other_outputs) {
        let (want_dst, want_scales) = c.expected();
        assert!(dst.bytes() == want_dst.as_slice() && scales.bytes() == want_scales.as_slice(), "{}", c.name);
    }
}
