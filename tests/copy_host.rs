//! The host backend's batched copy (`transport::host_copy::copy_segments`) against an independent
//! byte-by-byte reference: random batches of every size class from 0 to 1 MiB, misaligned on both
//! sides, strided levels, thousands of segments; the checked mode's overlap rejection; bad arguments.

#[path = "common/random_batch.rs"]
mod random_batch;

use random_batch::{first_difference, random_batch, rebase, reference, Rng, Shape};
use refit::transport::host_copy::copy_segments;
use refit::{Segment, Status};

const POISON: u8 = 0xCD;

/// Runs one batch through the host copy and the reference; destinations start poisoned so that
/// bytes the copy must not touch are checked too.
fn run(seed: u64, shape: Shape, checked: bool) {
    let mut rng = Rng::new(seed);
    let batch = random_batch(&mut rng, shape);
    let mut src = vec![0u8; batch.src_len];
    rng.fill(&mut src);
    let mut want = vec![POISON; batch.dst_len];
    reference(&batch.segments, &src, &mut want);
    let mut got = vec![POISON; batch.dst_len];
    let segments = rebase(&batch.segments, src.as_ptr() as u64, got.as_mut_ptr() as u64);
    // SAFETY: every run lies inside `src` / `got` by construction.
    unsafe { copy_segments(&segments, checked) }.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    if let Some((at, g, w)) = first_difference(&got, &want) {
        panic!("seed {seed} {shape:?}: destination byte {at} is {g:#x}, expected {w:#x}");
    }
}

#[test]
fn random_batches_of_every_size_class_aligned() {
    for seed in 0..6 {
        let shape = Shape {
            segments: 60,
            max_len: 1 << 20,
            strided_percent: 30,
            misaligned: false,
            src_len: 3 << 20,
        };
        run(seed, shape, true);
    }
}

#[test]
fn random_batches_misaligned_on_both_sides() {
    for seed in 100..106 {
        let shape =
            Shape { segments: 60, max_len: 1 << 20, strided_percent: 30, misaligned: true, src_len: 3 << 20 };
        run(seed, shape, seed % 2 == 0);
    }
}

#[test]
fn thousands_of_small_segments() {
    let shape =
        Shape { segments: 5000, max_len: 4096, strided_percent: 20, misaligned: true, src_len: 1 << 20 };
    run(7, shape, true);
    run(8, shape, false);
}

#[test]
fn every_segment_strided() {
    let shape =
        Shape { segments: 300, max_len: 65536, strided_percent: 100, misaligned: true, src_len: 4 << 20 };
    run(9, shape, true);
}

#[test]
fn tensor_parallel_column_split_interleaves_destinations() {
    // Two ranks' halves of 64 rows of 96 bytes, gathered into full rows: the two segments' destination
    // extents interleave, which the checked mode must accept.
    let rows = 64u64;
    let half = 96u64;
    let mut rng = Rng::new(11);
    let mut left = vec![0u8; (rows * half) as usize];
    let mut right = vec![0u8; (rows * half) as usize];
    rng.fill(&mut left);
    rng.fill(&mut right);
    let mut full = vec![POISON; (rows * 2 * half) as usize];
    let base = full.as_mut_ptr() as u64;
    let gather = |src: &[u8], column: u64| Segment {
        src: src.as_ptr() as u64,
        dst: base + column * half,
        len: half,
        count: [rows, 1],
        src_stride: [half, 0],
        dst_stride: [2 * half, 0],
    };
    let segments = [gather(&left, 0), gather(&right, 1)];
    // SAFETY: all runs inside the three buffers.
    unsafe { copy_segments(&segments, true) }.unwrap();
    for r in 0..rows as usize {
        let row = &full[r * 2 * half as usize..(r + 1) * 2 * half as usize];
        assert_eq!(&row[..half as usize], &left[r * half as usize..(r + 1) * half as usize], "row {r} left");
        assert_eq!(
            &row[half as usize..],
            &right[r * half as usize..(r + 1) * half as usize],
            "row {r} right"
        );
    }
}

#[test]
fn checked_mode_rejects_overlapping_destinations_and_copies_nothing() {
    let src = [1u8; 64];
    let mut dst = [POISON; 64];
    let base = dst.as_mut_ptr() as u64;
    let s = src.as_ptr() as u64;
    let segments = [
        Segment::contiguous(s, base, 16),
        Segment::contiguous(s, base + 40, 8),
        Segment::contiguous(s, base + 15, 4),
    ];
    // SAFETY: all runs inside the buffers.
    let err = unsafe { copy_segments(&segments, true) }.unwrap_err();
    assert_eq!(err.status, Status::Overlap);
    assert!(err.message.contains("segments 0 and 2"), "{}", err.message);
    assert!(dst.iter().all(|&b| b == POISON), "a rejected batch copies nothing");

    // One strided segment whose rows overlap each other.
    let rows = [Segment {
        count: [3, 1],
        src_stride: [4, 0],
        dst_stride: [4, 0],
        ..Segment::contiguous(s, base, 6)
    }];
    // SAFETY: as above.
    assert_eq!(unsafe { copy_segments(&rows, true) }.unwrap_err().status, Status::Overlap);
    assert!(dst.iter().all(|&b| b == POISON));
}

#[test]
fn unchecked_mode_copies_overlapping_destinations_in_order() {
    // Documented: unchecked overlap is the caller's error; on the host backend the later run wins.
    let first = [1u8; 8];
    let second = [2u8; 8];
    let mut dst = [0u8; 12];
    let base = dst.as_mut_ptr() as u64;
    let segments = [
        Segment::contiguous(first.as_ptr() as u64, base, 8),
        Segment::contiguous(second.as_ptr() as u64, base + 4, 8),
    ];
    // SAFETY: all runs inside the buffers.
    unsafe { copy_segments(&segments, false) }.unwrap();
    assert_eq!(dst, [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]);
}

#[test]
fn bad_segments_are_rejected_before_any_byte_moves() {
    let src = [7u8; 32];
    let mut dst = [POISON; 32];
    let s = src.as_ptr() as u64;
    let d = dst.as_mut_ptr() as u64;
    let good = Segment::contiguous(s, d, 8);
    let cases = [
        (Segment { count: [u64::MAX, 2], ..Segment::contiguous(s, d + 8, 2) }, "overflows"),
        (Segment::contiguous(0, d + 8, 4), "source address is 0"),
        (Segment::contiguous(s, 0, 4), "destination address is 0"),
        (Segment::contiguous(s, u64::MAX - 2, 4), "beyond"),
        (Segment { count: [2, 1], src_stride: [u64::MAX, 0], ..Segment::contiguous(s, d + 8, 4) }, "beyond"),
    ];
    for (bad, words) in cases {
        for checked in [false, true] {
            // SAFETY: validation fails before any access.
            let err = unsafe { copy_segments(&[good, bad], checked) }.unwrap_err();
            assert_eq!(err.status, Status::InvalidArgument, "{bad:?}");
            assert!(err.message.contains("segment 1") && err.message.contains(words), "{}", err.message);
            assert!(dst.iter().all(|&b| b == POISON), "nothing copied for {bad:?}");
        }
    }
}

#[test]
fn empty_batches_and_empty_segments_are_no_ops() {
    // SAFETY: nothing is accessed.
    unsafe { copy_segments(&[], true) }.unwrap();
    let empty = [Segment::contiguous(0, 0, 0), Segment { count: [0, 3], ..Segment::contiguous(0, 0, 5) }];
    // SAFETY: empty segments touch no memory, whatever their addresses.
    unsafe { copy_segments(&empty, true) }.unwrap();
}
