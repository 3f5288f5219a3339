//! Turning one box, laid out with source and destination byte strides, into strided segments: the
//! dimensions contiguous on both sides fold into one run, dimensions that continue each other fold
//! into one level, and what is left becomes at most two repetition levels per segment.

use super::boxes::{Dims, MAX_DIMS};
use super::memory;
use super::options::Budget;
use crate::error::{Error, Result};
use crate::segment::Segment;

/// One repetition level: `count` repetitions, `src`/`dst` bytes apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Level {
    dst: u64,
    src: u64,
    count: u64,
}

/// A box reduced to a contiguous run of `len` bytes and its repetition levels, innermost (smallest
/// destination stride) first.
pub(crate) struct Shape {
    pub len: u64,
    levels: [Level; MAX_DIMS],
    nlevels: usize,
}

/// A pair (a, b) of levels where b repeats a's whole span on both sides, so that b folds into a.
fn foldable(levels: &[Level]) -> Option<(usize, usize)> {
    for (a, l) in levels.iter().enumerate() {
        let (Some(span_src), Some(span_dst)) = (l.src.checked_mul(l.count), l.dst.checked_mul(l.count))
        else {
            continue;
        };
        if let Some(b) =
            (0..levels.len()).find(|&b| b != a && levels[b].src == span_src && levels[b].dst == span_dst)
        {
            return Some((a, b));
        }
    }
    None
}

impl Shape {
    /// Reduces a box of `ext` elements of `elem` bytes with byte strides `src` and `dst` (dimensions
    /// `< n`). The box must not be empty.
    pub fn of(n: usize, ext: &Dims, src: &Dims, dst: &Dims, elem: u64) -> Shape {
        let mut levels = [Level { dst: 0, src: 0, count: 0 }; MAX_DIMS];
        let mut nlevels = 0;
        for d in 0..n {
            if ext[d] > 1 {
                levels[nlevels] = Level { dst: dst[d], src: src[d], count: ext[d] };
                nlevels += 1;
            }
        }
        // Fold every level that continues the run on both sides into the run. The products stay
        // inside the box's byte span and element count, which were checked to fit in 64 bits;
        // saturating keeps that true of boxes that were not.
        let mut len = elem;
        while let Some(i) = levels[..nlevels].iter().position(|l| l.src == len && l.dst == len) {
            len = len.saturating_mul(levels[i].count);
            levels.copy_within(i + 1..nlevels, i);
            nlevels -= 1;
        }
        while let Some((a, b)) = foldable(&levels[..nlevels]) {
            levels[a].count = levels[a].count.saturating_mul(levels[b].count);
            levels.copy_within(b + 1..nlevels, b);
            nlevels -= 1;
        }
        levels[..nlevels].sort_unstable();
        Shape { len, levels, nlevels }
    }

    /// Contiguous runs this box stands for.
    pub fn runs(&self) -> u64 {
        self.levels[..self.nlevels].iter().fold(1u64, |acc, l| acc.saturating_mul(l.count))
    }

    /// Segments needed: one per combination of the levels beyond the first two.
    pub fn segments(&self) -> u64 {
        self.levels[..self.nlevels].iter().skip(2).fold(1u64, |acc, l| acc.saturating_mul(l.count))
    }

    /// Appends this box's segments, the base addresses being `src` and `dst`, counting them
    /// against `budget`. Fails with INVALID_ARGUMENT when an address passes 2^64 (never for boxes
    /// inside checked offers and needs) and OUT_OF_MEMORY when the segments do not fit.
    pub fn emit(&self, src: u64, dst: u64, out: &mut Vec<Segment>, budget: &mut Budget) -> Result<()> {
        let wanted = self.segments();
        budget.spend(wanted)?;
        memory::reserve(out, usize::try_from(wanted).unwrap_or(usize::MAX), "segments")?;
        let inner = |k: usize| self.levels.get(k).filter(|_| k < self.nlevels).copied();
        let mut seg = Segment::contiguous(src, dst, self.len);
        for k in 0..2 {
            if let Some(l) = inner(k) {
                seg.count[k] = l.count;
                seg.src_stride[k] = l.src;
                seg.dst_stride[k] = l.dst;
            }
        }
        let outer = &self.levels[2.min(self.nlevels)..self.nlevels];
        if outer.is_empty() {
            out.push(seg);
            return Ok(());
        }
        // Odometer over the outer levels, outermost slowest.
        let mut index = [0u64; MAX_DIMS];
        loop {
            let (mut s, mut d) = (src, dst);
            for (l, &i) in outer.iter().zip(&index) {
                s = offset(s, i, l.src)?;
                d = offset(d, i, l.dst)?;
            }
            out.push(Segment { src: s, dst: d, ..seg });
            let mut k = 0;
            loop {
                if k == outer.len() {
                    return Ok(());
                }
                index[k] += 1;
                if index[k] < outer[k].count {
                    break;
                }
                index[k] = 0;
                k += 1;
            }
        }
    }
}

/// `base + i * stride`, or INVALID_ARGUMENT when it passes 2^64.
fn offset(base: u64, i: u64, stride: u64) -> Result<u64> {
    i.checked_mul(stride).and_then(|o| base.checked_add(o)).ok_or_else(|| {
        Error::invalid_argument(format!(
            "address {base:#x} + {i} * {stride} runs past the end of the address space"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(v: &[u64]) -> Dims {
        let mut d = [0; 8];
        d[..v.len()].copy_from_slice(v);
        d
    }

    #[test]
    fn column_split_of_a_row_major_weight_is_one_strided_segment() {
        // 2048 rows of bf16; the source holds 768 columns per row, the receiver takes 384 of them.
        let shape = Shape::of(2, &dims(&[2048, 384]), &dims(&[1536, 2]), &dims(&[768, 2]), 2);
        assert_eq!(shape.len, 768);
        assert_eq!(shape.runs(), 2048);
        let mut out = Vec::new();
        shape.emit(1000, 0, &mut out, &mut Budget::unlimited("segments")).unwrap();
        assert_eq!(
            out,
            vec![Segment {
                src: 1000,
                dst: 0,
                len: 768,
                count: [2048, 1],
                src_stride: [1536, 0],
                dst_stride: [768, 0]
            }]
        );
    }

    #[test]
    fn contiguous_box_is_one_run_and_deep_boxes_split_into_segments() {
        let shape = Shape::of(3, &dims(&[4, 5, 6]), &dims(&[120, 24, 4]), &dims(&[120, 24, 4]), 4);
        assert_eq!((shape.len, shape.runs(), shape.segments()), (480, 1, 1));
        // Transposed destination: nothing folds beyond one element.
        let shape = Shape::of(3, &dims(&[2, 3, 4]), &dims(&[12, 4, 1]), &dims(&[1, 2, 6]), 1);
        assert_eq!((shape.len, shape.runs(), shape.segments()), (1, 24, 4));
        let mut out = Vec::new();
        let mut budget = Budget::segments(&crate::plan::Limits { max_segments: 4, ..Default::default() });
        shape.emit(0, 0, &mut out, &mut budget).unwrap();
        assert_eq!(out.len(), 4);
        let err = shape.emit(0, 0, &mut out, &mut budget).unwrap_err();
        assert_eq!(err.status, crate::Status::OutOfMemory);
        assert!(err.message.contains("max_segments"), "{err}");
        // Addresses past 2^64 are an error, never a wrapped address.
        let err = shape.emit(0, u64::MAX - 2, &mut out, &mut Budget::unlimited("segments")).unwrap_err();
        assert_eq!(err.status, crate::Status::InvalidArgument);
    }
}
