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

impl Segment {
    /// A contiguous copy of `len` bytes.
    pub fn contiguous(src: u64, dst: u64, len: u64) -> Segment {
        Segment { src, dst, len, count: [1, 1], src_stride: [0, 0], dst_stride: [0, 0] }
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
