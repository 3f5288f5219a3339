//! What the copy and digest benches share: timing on a stream, random contents, and the
//! tensor-parallel column split both measure.

use super::cuda::{ok, on, Buffer, Stream, Timer};
use super::random_batch::Rng;
use cudarc::driver::sys;
use refit::transport::driver::check;
use refit::Segment;

pub const MIB: u64 = 1 << 20;

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

pub fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

/// Median milliseconds of `reps` runs of `work` on `stream`, after `warm` unmeasured runs.
pub fn time_ms(stream: &Stream, warm: usize, reps: usize, mut work: impl FnMut()) -> f64 {
    for _ in 0..warm {
        work();
    }
    stream.sync();
    let timer = Timer::new(stream.device);
    median(
        (0..reps)
            .map(|_| {
                timer.start(stream);
                work();
                timer.stop(stream)
            })
            .collect(),
    )
}

/// Fills `buffer` with random bytes (a 64 MiB random block repeated).
pub fn randomize(buffer: &Buffer, rng: &mut Rng) {
    let block = (64 * MIB as usize).min(buffer.len);
    let mut bytes = vec![0u8; block];
    rng.fill(&mut bytes);
    let mut at = 0;
    while at < buffer.len {
        let n = block.min(buffer.len - at);
        on(buffer.device, || {
            ok(
                "cuMemcpyHtoD",
                check("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(buffer.ptr + at as u64, bytes.as_ptr().cast(), n)
                }),
            )
        });
        at += n;
    }
}

/// The tensor-parallel column split: 2,048 rows of 768 B out of rows of 1,536 B, one segment per
/// tensor, repeated over 256 MiB of payload (sources 512 MiB).
pub fn column_split(src: u64, dst: u64) -> Vec<Segment> {
    let shard = 2048 * 1536u64;
    let tensors = 256 * MIB / (2048 * 768);
    (0..tensors)
        .map(|t| Segment {
            src: src + t * shard,
            dst: dst + t * 2048 * 768,
            len: 768,
            count: [2048, 1],
            src_stride: [1536, 0],
            dst_stride: [768, 0],
        })
        .collect()
}
