//! Box arithmetic in global tensor coordinates: intersection, difference and volume, computed from
//! the corners only (never per element); and the bytes a strided box spans.

/// Most dimensions a tensor may have (C callers: REFIT_MAX_DIMS).
///
/// cbindgen:ignore
pub const MAX_DIMS: usize = 8;

/// Per-dimension values of one box or layout; entries past the tensor's dimensions are zero.
pub(crate) type Dims = [u64; MAX_DIMS];

/// The byte span `[addr, addr + span)` touched by a strided box, or None when it does not fit in
/// 64 bits.
pub(crate) fn byte_span(n: usize, ext: &Dims, strides: &Dims, elem: u64) -> Option<u64> {
    if ext[..n].contains(&0) {
        return Some(0);
    }
    let mut last = 0u64;
    for d in 0..n {
        last = last.checked_add((ext[d] - 1).checked_mul(strides[d])?)?;
    }
    last.checked_add(1)?.checked_mul(elem)
}

/// A box of an `n`-dimensional tensor: `lo[d] .. lo[d] + ext[d]` in every dimension `d < n`. Boxes
/// lie inside their tensor's shape (checked when tables are merged), so `lo + ext` never overflows
/// and the volume times the element size fits in 64 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Boxed {
    pub lo: Dims,
    pub ext: Dims,
}

impl Boxed {
    pub fn new(lo: Dims, ext: Dims) -> Boxed {
        Boxed { lo, ext }
    }

    /// The box with corner `lo` and extents `ext` (one value per dimension).
    pub fn from_parts(lo: &[u64], ext: &[u64]) -> Boxed {
        let n = lo.len();
        Boxed {
            lo: std::array::from_fn(|d| if d < n { lo[d] } else { 0 }),
            ext: std::array::from_fn(|d| if d < n { ext[d] } else { 0 }),
        }
    }

    pub fn is_empty(&self, n: usize) -> bool {
        self.ext[..n].contains(&0)
    }

    /// Number of elements (saturating; boxes are validated to fit in 64 bits of bytes).
    pub fn volume(&self, n: usize) -> u64 {
        self.ext[..n].iter().fold(1u64, |acc, &e| acc.saturating_mul(e))
    }

    /// The common part of two boxes, or None when they share no element.
    pub fn intersect(&self, other: &Boxed, n: usize) -> Option<Boxed> {
        self.intersect_parts(&other.lo[..n], &other.ext[..n])
    }

    /// The common part of this box and the box with corner `lo` and extents `ext` (one value per
    /// dimension), or None when they share no element.
    pub fn intersect_parts(&self, lo: &[u64], ext: &[u64]) -> Option<Boxed> {
        let n = lo.len();
        let mut out = Boxed { lo: [0; MAX_DIMS], ext: [0; MAX_DIMS] };
        for d in 0..n {
            let hi = (self.lo[d] + self.ext[d]).min(lo[d] + ext[d]);
            let lo = self.lo[d].max(lo[d]);
            if hi <= lo {
                return None;
            }
            out.lo[d] = lo;
            out.ext[d] = hi - lo;
        }
        Some(out)
    }

    /// `self` minus `other`, as at most `2n` disjoint boxes appended to `out`.
    pub fn subtract(&self, other: &Boxed, n: usize, out: &mut Vec<Boxed>) {
        let Some(common) = self.intersect(other, n) else {
            out.push(*self);
            return;
        };
        // Peel slabs below and above the common part, one dimension at a time.
        let mut rest = *self;
        for d in 0..n {
            let (lo, hi) = (rest.lo[d], rest.lo[d] + rest.ext[d]);
            let (clo, chi) = (common.lo[d], common.lo[d] + common.ext[d]);
            if lo < clo {
                let mut slab = rest;
                slab.ext[d] = clo - lo;
                out.push(slab);
            }
            if chi < hi {
                let mut slab = rest;
                slab.lo[d] = chi;
                slab.ext[d] = hi - chi;
                out.push(slab);
            }
            rest.lo[d] = clo;
            rest.ext[d] = chi - clo;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b2(lo: [u64; 2], ext: [u64; 2]) -> Boxed {
        let mut b = Boxed { lo: [0; 8], ext: [0; 8] };
        b.lo[..2].copy_from_slice(&lo);
        b.ext[..2].copy_from_slice(&ext);
        b
    }

    #[test]
    fn intersection_and_difference_partition_the_box() {
        let a = b2([0, 0], [4, 6]);
        let b = b2([1, 2], [10, 2]);
        let common = a.intersect(&b, 2).unwrap();
        assert_eq!(common, b2([1, 2], [3, 2]));
        let mut rest = Vec::new();
        a.subtract(&b, 2, &mut rest);
        let total: u64 = rest.iter().map(|r| r.volume(2)).sum();
        assert_eq!(total + common.volume(2), a.volume(2));
        for (i, x) in rest.iter().enumerate() {
            assert!(x.intersect(&b, 2).is_none());
            for y in &rest[i + 1..] {
                assert!(x.intersect(y, 2).is_none());
            }
        }
        assert!(b2([0, 0], [1, 1]).intersect(&b2([1, 0], [1, 1]), 2).is_none());
    }
}
