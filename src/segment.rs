//! The unit of copying shared by the planner (which emits it), the executors and the batched copy
//! kernel (which move it). Plain addresses and byte counts: nothing here knows where memory lives.
//! [`check`] holds the checks every batched copy applies to a list of segments.

pub mod check;

/// A strided box of bytes: a contiguous run of `len` bytes, repeated `count[0]` times with strides
/// `src_stride[0]` / `dst_stride[0]`, and that whole pattern repeated `count[1]` times with strides
/// `src_stride[1]` / `dst_stride[1]`. Byte `b` of repetition `(i, j)` is read from
/// `src + j*src_stride[1] + i*src_stride[0] + b` and written to the matching destination address.
/// A plain contiguous copy has `count = [1, 1]`. A count of 0 means no bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Segment {
    /// Source address (device pointer, or host address on the host backend).
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes in the innermost contiguous run.
    pub len: u64,
    /// Repetitions of the inner level, then of the outer level.
    pub count: [u64; 2],
    /// Source byte strides between repetitions, inner level first.
    pub src_stride: [u64; 2],
    /// Destination byte strides between repetitions, inner level first.
    pub dst_stride: [u64; 2],
}

/// One side of a segment: where it reads, or where it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Source,
    Destination,
}

impl Segment {
    /// A contiguous copy of `len` bytes.
    pub fn contiguous(src: u64, dst: u64, len: u64) -> Segment {
        Segment { src, dst, len, count: [1, 1], src_stride: [0, 0], dst_stride: [0, 0] }
    }

    /// The first address of `side`.
    pub fn address(&self, side: Side) -> u64 {
        match side {
            Side::Source => self.src,
            Side::Destination => self.dst,
        }
    }

    /// The first address of `side`, to move it.
    pub fn address_mut(&mut self, side: Side) -> &mut u64 {
        match side {
            Side::Source => &mut self.src,
            Side::Destination => &mut self.dst,
        }
    }

    /// The strides of `side`, inner level first.
    pub fn strides(&self, side: Side) -> [u64; 2] {
        match side {
            Side::Source => self.src_stride,
            Side::Destination => self.dst_stride,
        }
    }

    /// Bytes from the first byte of `side` to one past its last (0 for no bytes), or None when that
    /// overflows u64.
    pub fn span(&self, side: Side) -> Option<u64> {
        if self.runs() == 0 {
            return Some(0);
        }
        let strides = self.strides(side);
        let inner = strides[0].checked_mul(self.count[0] - 1)?;
        let outer = strides[1].checked_mul(self.count[1] - 1)?;
        inner.checked_add(outer)?.checked_add(self.len)
    }

    /// Payload bytes, or None when the product overflows u64.
    pub fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.count[0])?.checked_mul(self.count[1])
    }

    /// Number of contiguous runs this segment stands for.
    pub fn runs(&self) -> u64 {
        if self.len == 0 {
            0
        } else {
            self.count[0].saturating_mul(self.count[1])
        }
    }

    /// Each repetition of the outer level as a segment of its own (count `[count[0], 1]`), in order.
    pub fn rows(&self) -> impl Iterator<Item = Segment> + '_ {
        (0..self.count[1]).map(move |j| Segment {
            src: self.src + j * self.src_stride[1],
            dst: self.dst + j * self.dst_stride[1],
            count: [self.count[0], 1],
            ..*self
        })
    }

    /// How many spans [`Segment::for_each_destination_span`] calls back with.
    pub fn destination_spans(&self) -> u64 {
        match self.runs() {
            0 => 0,
            _ if self.rows_abut() => self.count[1],
            runs => runs,
        }
    }

    /// Whether each row's runs follow each other on the destination side.
    fn rows_abut(&self) -> bool {
        self.count[0] == 1 || self.dst_stride[0] == self.len
    }

    /// The destination bytes as contiguous spans `(address, length)`, in order: one per row where
    /// its runs abut, else one per run. Spans may touch or overlap each other.
    pub fn for_each_destination_span(&self, mut f: impl FnMut(u64, u64)) {
        if self.runs() == 0 {
            return;
        }
        if self.rows_abut() {
            for j in 0..self.count[1] {
                f(self.dst + j * self.dst_stride[1], self.len * self.count[0]);
            }
        } else {
            self.for_each_run(|_, dst, len| f(dst, len));
        }
    }

    /// Every contiguous run as (src, dst, len), inner level fastest. For tests and the host backend.
    pub fn for_each_run(&self, mut f: impl FnMut(u64, u64, u64)) {
        if self.len == 0 {
            return;
        }
        for j in 0..self.count[1] {
            for i in 0..self.count[0] {
                let src = self.src + j * self.src_stride[1] + i * self.src_stride[0];
                let dst = self.dst + j * self.dst_stride[1] + i * self.dst_stride[0];
                f(src, dst, self.len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn destination_bytes(segments: impl IntoIterator<Item = Segment>) -> Vec<u64> {
        let mut bytes = Vec::new();
        for s in segments {
            s.for_each_run(|_, dst, len| bytes.extend(dst..dst + len));
        }
        bytes
    }

    #[test]
    fn rows_and_spans_cover_exactly_the_runs() {
        let strided =
            Segment { src: 7, dst: 1000, len: 3, count: [4, 3], src_stride: [3, 12], dst_stride: [5, 100] };
        assert_eq!(strided.span(Side::Destination), Some(5 * 3 + 100 * 2 + 3));
        assert_eq!(strided.span(Side::Source), Some(3 * 3 + 12 * 2 + 3));
        assert_eq!(Segment { count: [0, 3], ..strided }.span(Side::Source), Some(0));
        assert_eq!(Segment { dst_stride: [u64::MAX, 0], ..strided }.span(Side::Destination), None);
        let abutting = Segment { dst_stride: [3, 100], ..strided };
        for s in [strided, abutting, Segment::contiguous(1, 50, 9)] {
            let rows: Vec<Segment> = s.rows().collect();
            assert_eq!(rows.len() as u64, s.count[1]);
            assert_eq!(destination_bytes(rows.iter().copied()), destination_bytes([s]));
            assert!(rows.iter().all(|r| r.count[1] == 1 && r.bytes() == Some(s.len * s.count[0])));
            let mut spans = Vec::new();
            s.for_each_destination_span(|addr, len| spans.extend(addr..addr + len));
            assert_eq!(spans, destination_bytes([s]));
        }
        let mut spans = 0;
        abutting.for_each_destination_span(|_, len| {
            assert_eq!(len, 12);
            spans += 1;
        });
        assert_eq!(spans, 3, "abutting runs make one span per row");
        assert_eq!(abutting.destination_spans(), 3);
        assert_eq!(strided.destination_spans(), 12);
        assert_eq!(Segment { len: 0, ..strided }.destination_spans(), 0);
        Segment { len: 0, ..strided }.for_each_destination_span(|_, _| panic!("no bytes, no spans"));
    }
}
