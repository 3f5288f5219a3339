//! Random segment batches and an independent reference, shared by tests/copy_host.rs and
//! tests/gpu_copy.rs. Segments are generated with offsets relative to a source and a destination
//! buffer; `rebase` turns them into real addresses. Destinations are disjoint by construction.

#![allow(dead_code)]

use refit::Segment;

/// splitmix64: small, seedable, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// A batch with offsets relative to its buffers, and the buffer sizes it needs.
pub struct Batch {
    pub segments: Vec<Segment>,
    pub src_len: usize,
    pub dst_len: usize,
}

/// How a batch is drawn.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub segments: usize,
    /// Largest run length; lengths are drawn across size classes up to it (0 included).
    pub max_len: u64,
    /// Percent of segments with strided (2- or 3-level) layouts.
    pub strided_percent: u64,
    /// Random byte misalignment on both sides; otherwise every address is 16-byte aligned.
    pub misaligned: bool,
    /// Source buffer size; every source extent fits in it.
    pub src_len: usize,
}

fn draw_len(rng: &mut Rng, max_len: u64) -> u64 {
    let class_top = [0u64, 15, 512, 8192, 65536, 1 << 20];
    let usable: Vec<u64> = class_top.iter().copied().filter(|&t| t <= max_len).collect();
    let class = rng.range(0, usable.len() as u64 - 1) as usize;
    if class == 0 {
        return 0;
    }
    let lo = usable[class - 1] + 1;
    let hi = usable[class].min(max_len);
    rng.range(lo, hi)
}

pub fn random_batch(rng: &mut Rng, shape: Shape) -> Batch {
    let align =
        |rng: &mut Rng, x: u64| if shape.misaligned { x + rng.range(0, 15) } else { x.next_multiple_of(16) };
    let mut segments = Vec::with_capacity(shape.segments);
    let mut cursor = 0u64;
    let src_len = shape.src_len as u64;
    for _ in 0..shape.segments {
        let mut len = draw_len(rng, shape.max_len);
        let mut count = [1u64, 1];
        let mut src_stride = [0u64, 0];
        let mut dst_stride = [0u64, 0];
        if rng.chance(shape.strided_percent) {
            len = len.min(16 << 10);
            let max_count = if len <= 512 { 40 } else { 6 };
            count = [rng.range(1, max_count), rng.range(1, 4)];
            if rng.chance(5) {
                count[rng.range(0, 1) as usize] = 0;
            }
            let pad = |rng: &mut Rng| if shape.misaligned { rng.range(0, 40) } else { 16 * rng.range(0, 3) };
            dst_stride[0] = len + pad(rng);
            dst_stride[1] = count[0].max(1) * dst_stride[0] + pad(rng);
            // Sources may be read more than once: strides below len, or 0, are legal.
            src_stride[0] = if rng.chance(10) { 0 } else { len.saturating_sub(8) + pad(rng) };
            src_stride[1] = count[0].max(1) * len + pad(rng);
        }
        let src_extent = extent(len, count, src_stride);
        let dst_extent = extent(len, count, dst_stride);
        let src = if src_extent >= src_len {
            len = 0;
            0
        } else {
            let room = src_len - src_extent;
            let start = rng.range(0, room);
            if shape.misaligned {
                start
            } else {
                start / 16 * 16
            }
        };
        let dst = align(rng, cursor);
        cursor = dst + if len == 0 { 0 } else { dst_extent } + rng.range(0, 64);
        segments.push(Segment { src, dst, len, count, src_stride, dst_stride });
    }
    Batch { segments, src_len: shape.src_len, dst_len: cursor as usize + 16 }
}

/// Bytes spanned from the first to one past the last byte of a strided box (0 when empty).
pub fn extent(len: u64, count: [u64; 2], stride: [u64; 2]) -> u64 {
    if len == 0 || count[0] == 0 || count[1] == 0 {
        return 0;
    }
    (count[1] - 1) * stride[1] + (count[0] - 1) * stride[0] + len
}

/// The same segments at real addresses.
pub fn rebase(segments: &[Segment], src_base: u64, dst_base: u64) -> Vec<Segment> {
    segments.iter().map(|s| Segment { src: s.src + src_base, dst: s.dst + dst_base, ..*s }).collect()
}

/// The expected destination: written byte by byte from the segment definition (offsets relative to
/// the buffers), independently of the library's own run iteration.
pub fn reference(segments: &[Segment], src: &[u8], dst: &mut [u8]) {
    for s in segments {
        for j in 0..s.count[1] {
            for i in 0..s.count[0] {
                for b in 0..s.len {
                    let from = s.src + j * s.src_stride[1] + i * s.src_stride[0] + b;
                    let to = s.dst + j * s.dst_stride[1] + i * s.dst_stride[0] + b;
                    dst[to as usize] = src[from as usize];
                }
            }
        }
    }
}

/// Index and values of the first differing byte, for a readable failure.
pub fn first_difference(got: &[u8], want: &[u8]) -> Option<(usize, u8, u8)> {
    got.iter().zip(want).position(|(a, b)| a != b).map(|i| (i, got[i], want[i]))
}

/// Payload bytes of a batch.
pub fn payload(segments: &[Segment]) -> u64 {
    segments.iter().map(|s| s.bytes().unwrap()).sum()
}
