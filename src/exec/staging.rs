//! Where staged bytes wait for their commit: each segment bound for a receiving device gets a dense
//! box in that device's staging buffer, and a step larger than the staging limit is cut into slices
//! that each fit. Pure arithmetic over segments (no device): the executor allocates the buffers and
//! turns placements into copy, verify and install segments.
//!
//! A staged run starts at an offset congruent to its destination modulo 16, and the staged strides
//! are congruent to the destination strides modulo 16, so every staged run is as aligned as its
//! destination: the install (the copy a server stalls for) gets the kernel's widest accesses wherever
//! a direct copy would. The cost is under 16 bytes per run, so a step of many short runs needs more
//! staging than its payload: where that padding alone would cut a receiver's step into slices, the
//! receiver's staging is packed densely instead ([`Layout::Dense`]), so that a limit at or above the
//! payload always stages the step in one slice (all or nothing), at the price of narrower accesses.

use crate::segment::Segment;

/// Staged runs share their destination's address modulo this ([`Layout::Aligned`]).
const ALIGN: u64 = 16;

/// How pieces are laid out in staging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Each staged run as aligned as its destination, modulo [`ALIGN`].
    Aligned,
    /// Runs back to back: exactly the payload's bytes.
    Dense,
}

impl Layout {
    fn align(self) -> u64 {
        match self {
            Layout::Aligned => ALIGN,
            Layout::Dense => 1,
        }
    }
}

/// A segment's staged box: strides and total bytes (from the first staged byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StagedShape {
    pub stride: [u64; 2],
    pub footprint: u64,
}

/// `(to - from) mod align`: what to add to `from` to make it congruent to `to`.
fn pad(from: u64, to: u64, layout: Layout) -> u64 {
    to.wrapping_sub(from) & (layout.align() - 1)
}

/// The staged box of `segment` (non-empty, validated). Saturates instead of overflowing: a footprint
/// near 2^64 exceeds any staging limit and is split.
pub(crate) fn shape(segment: &Segment, layout: Layout) -> StagedShape {
    let s0 = if segment.count[0] > 1 {
        segment.len.saturating_add(pad(segment.len, segment.dst_stride[0], layout))
    } else {
        segment.len
    };
    let inner = (segment.count[0] - 1).saturating_mul(s0).saturating_add(segment.len);
    let s1 = if segment.count[1] > 1 {
        inner.saturating_add(pad(inner, segment.dst_stride[1], layout))
    } else {
        inner
    };
    let footprint = (segment.count[1] - 1).saturating_mul(s1).saturating_add(inner);
    StagedShape { stride: [s0, s1], footprint }
}

/// `segment` cut into pieces whose staged footprint under `layout` is at most `cap` (at least
/// `ALIGN`): first into groups of outer repetitions, then of inner runs, then runs into byte ranges.
/// Together the pieces copy exactly the segment's bytes, in its run order.
pub(crate) fn split(segment: &Segment, cap: u64, layout: Layout, out: &mut Vec<Segment>) {
    if shape(segment, layout).footprint <= cap {
        out.push(*segment);
        return;
    }
    let [c0, c1] = segment.count;
    if c1 > 1 {
        let one = Segment { count: [c0, 1], ..*segment };
        let per_piece = rows_within(shape(&one, layout).footprint, shape(segment, layout).stride[1], cap);
        repeat(segment, 1, c1, per_piece, (cap, layout), out);
    } else if c0 > 1 {
        let one = Segment { count: [1, 1], ..*segment };
        let per_piece = rows_within(shape(&one, layout).footprint, shape(segment, layout).stride[0], cap);
        repeat(segment, 0, c0, per_piece, (cap, layout), out);
    } else {
        // One run longer than the cap: byte ranges of a multiple of ALIGN, so each piece keeps the
        // run's alignment.
        let chunk = (cap & !(ALIGN - 1)).max(ALIGN);
        let mut done = 0;
        while done < segment.len {
            let len = chunk.min(segment.len - done);
            out.push(Segment::contiguous(segment.src + done, segment.dst + done, len));
            done += len;
        }
    }
}

/// How many repetitions of a `first`-byte block at `stride` fit in `cap` (0 when one does not).
fn rows_within(first: u64, stride: u64, cap: u64) -> u64 {
    if first > cap {
        0
    } else {
        1 + (cap - first) / stride.max(1)
    }
}

/// Pieces of `per_piece` repetitions of `level` (0 inner, 1 outer) out of `count`; with `per_piece`
/// 0, each repetition on its own, split further.
fn repeat(
    segment: &Segment,
    level: usize,
    count: u64,
    per_piece: u64,
    (cap, layout): (u64, Layout),
    out: &mut Vec<Segment>,
) {
    let step = per_piece.max(1);
    let mut first = 0;
    while first < count {
        let n = step.min(count - first);
        let mut piece = *segment;
        piece.src = segment.src + first * segment.src_stride[level];
        piece.dst = segment.dst + first * segment.dst_stride[level];
        piece.count[level] = n;
        if per_piece == 0 {
            split(&piece, cap, layout, out);
        } else {
            out.push(piece);
        }
        first += n;
    }
}

/// One piece's place in its receiver's staging buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub slice: usize,
    /// Offset of its first staged byte from the (ALIGN-aligned) buffer start.
    pub offset: u64,
    pub shape: StagedShape,
}

/// Places pieces one after the other in a buffer of at most `limit` bytes per slice (`u64::MAX`:
/// one slice), starting a new slice when the next does not fit.
pub(crate) struct Packer {
    limit: u64,
    layout: Layout,
    slice: usize,
    cursor: u64,
    /// The largest end offset of any slice: the buffer's size.
    pub size: u64,
}

impl Packer {
    pub fn new(limit: u64, layout: Layout) -> Packer {
        Packer { limit, layout, slice: 0, cursor: 0, size: 0 }
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The largest footprint a piece may have so that it always fits a slice of its own.
    pub fn cap(&self) -> u64 {
        self.limit.saturating_sub(self.layout.align() - 1)
    }

    /// Places `piece` (footprint at most [`Packer::cap`]).
    pub fn place(&mut self, piece: &Segment) -> Placement {
        let shape = shape(piece, self.layout);
        let mut offset = self.cursor + pad(self.cursor, piece.dst, self.layout);
        if self.cursor > 0 && offset.saturating_add(shape.footprint) > self.limit {
            self.slice += 1;
            offset = pad(0, piece.dst, self.layout);
        }
        self.cursor = offset + shape.footprint;
        self.size = self.size.max(self.cursor);
        Placement { slice: self.slice, offset, shape }
    }

    /// Slices used so far (0 when nothing was placed).
    pub fn slices(&self) -> usize {
        if self.size == 0 {
            0
        } else {
            self.slice + 1
        }
    }
}

/// The copy of `piece` into staging at `base + placement.offset`, and the install from there.
pub(crate) fn staged_pair(piece: &Segment, base: u64, placement: &Placement) -> (Segment, Segment) {
    let staged = base + placement.offset;
    let into = Segment { dst: staged, dst_stride: placement.shape.stride, ..*piece };
    let out = Segment { src: staged, src_stride: placement.shape.stride, ..*piece };
    (into, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strided(
        src: u64,
        dst: u64,
        len: u64,
        count: [u64; 2],
        src_stride: [u64; 2],
        dst_stride: [u64; 2],
    ) -> Segment {
        Segment { src, dst, len, count, src_stride, dst_stride }
    }

    /// Every (source, destination) byte pair of the segments, in run order.
    fn pairs(segments: &[Segment]) -> Vec<(u64, u64)> {
        let mut all = Vec::new();
        for s in segments {
            s.for_each_run(|src, dst, len| all.extend((0..len).map(|b| (src + b, dst + b))));
        }
        all
    }

    fn cases() -> Vec<Segment> {
        vec![
            Segment::contiguous(0x1000, 0x9003, 10_000),
            strided(0x1000, 0x20008, 24, [50, 1], [40, 0], [56, 0]),
            strided(0x1000, 0x30000, 768, [40, 3], [1536, 61_440], [768, 30_720]),
            strided(0x1001, 0x40005, 3, [7, 9], [5, 70], [3, 21]),
            strided(0x1000, 0x50000, 5000, [3, 2], [6000, 20_000], [5008, 16_000]),
        ]
    }

    #[test]
    fn staged_runs_keep_their_destination_alignment() {
        for segment in cases() {
            let shape = shape(&segment, Layout::Aligned);
            for base in [0u64, 16, 4096] {
                let placement = Placement { slice: 0, offset: pad(0, segment.dst, Layout::Aligned), shape };
                let (into, out) = staged_pair(&segment, base, &placement);
                let mut staged_runs = Vec::new();
                into.for_each_run(|_, dst, len| staged_runs.push((dst, len)));
                let mut runs = Vec::new();
                segment.for_each_run(|_, dst, _| runs.push(dst));
                for ((staged, len), dst) in staged_runs.iter().zip(&runs) {
                    assert_eq!(staged % ALIGN, dst % ALIGN, "{segment:?}");
                    assert!(staged + len <= base + placement.offset + shape.footprint);
                }
                // The staged runs are disjoint and in order, and the install reads them back.
                for pair in staged_runs.windows(2) {
                    assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{segment:?}");
                }
                assert_eq!(pairs(&[out]).len(), pairs(&[segment]).len());
                let through: Vec<(u64, u64)> = pairs(&[into])
                    .into_iter()
                    .zip(pairs(&[out]))
                    .map(|((s, m), (m2, d))| {
                        assert_eq!(m, m2);
                        (s, d)
                    })
                    .collect();
                assert_eq!(through, pairs(&[segment]));
            }
        }
    }

    #[test]
    fn pieces_copy_exactly_the_segment_and_each_fits_the_cap() {
        for segment in cases() {
            for cap in [16, 100, 1000, 4081, 50_000, u64::MAX] {
                let mut pieces = Vec::new();
                split(&segment, cap, Layout::Aligned, &mut pieces);
                assert_eq!(pairs(&pieces), pairs(&[segment]), "{segment:?} cap {cap}");
                for piece in &pieces {
                    assert!(shape(piece, Layout::Aligned).footprint <= cap.max(16), "{piece:?} cap {cap}");
                }
                if cap == u64::MAX {
                    assert_eq!(pieces, vec![segment]);
                }
            }
        }
    }

    #[test]
    fn slices_never_exceed_the_limit_and_follow_each_other() {
        let limit = 4096;
        let mut packer = Packer::new(limit, Layout::Aligned);
        let mut placements = Vec::new();
        for segment in cases() {
            let mut pieces = Vec::new();
            split(&segment, packer.cap(), Layout::Aligned, &mut pieces);
            for piece in pieces {
                placements.push((piece, packer.place(&piece)));
            }
        }
        assert!(packer.slices() > 5);
        assert!(packer.size <= limit);
        for pair in placements.windows(2) {
            let ((_, a), (_, b)) = (pair[0], pair[1]);
            assert!(b.slice == a.slice || b.slice == a.slice + 1);
            if a.slice == b.slice {
                assert!(a.offset + a.shape.footprint <= b.offset, "pieces of a slice overlap");
            }
        }
        for (piece, p) in &placements {
            assert!(p.offset + p.shape.footprint <= limit);
            assert_eq!(p.offset % ALIGN, piece.dst % ALIGN);
        }
        let unlimited = {
            let mut packer = Packer::new(u64::MAX, Layout::Aligned);
            for segment in cases() {
                packer.place(&segment);
            }
            packer.slices()
        };
        assert_eq!(unlimited, 1);
        assert_eq!(Packer::new(limit, Layout::Aligned).slices(), 0);
    }

    #[test]
    fn dense_staging_holds_exactly_the_payload() {
        // 1200 runs of 3 bytes: 3600 bytes of payload, three times more once each run is aligned.
        let short = strided(0x1000, 0x20001, 3, [1200, 1], [5, 0], [32, 0]);
        assert!(shape(&short, Layout::Aligned).footprint > 4096);
        assert_eq!(shape(&short, Layout::Dense).footprint, 3600);
        for segment in cases().into_iter().chain([short]) {
            let (mut pieces, mut packer) = (Vec::new(), Packer::new(4096, Layout::Dense));
            split(&segment, packer.cap(), Layout::Dense, &mut pieces);
            assert_eq!(pairs(&pieces), pairs(&[segment]));
            let bytes: u64 = pieces.iter().map(|p| p.bytes().unwrap()).sum();
            let placed: Vec<Placement> = pieces.iter().map(|p| packer.place(p)).collect();
            assert_eq!(placed.iter().map(|p| p.shape.footprint).sum::<u64>(), bytes);
            if bytes <= 4096 {
                assert_eq!(packer.slices(), 1, "{segment:?}");
            }
        }
    }
}
