//! Argument checks shared by every implementation of the batched copy (kernel and host memcpy):
//! [`validate`] (always) and [`check_destinations`] (the checked mode). Pure functions over segments.

use crate::error::{Error, Result, Status};
use crate::segment::Segment;

/// Destination runs expanded at most this many in total to decide overlap exactly, beyond which the
/// checked mode refuses the batch (Unsupported) rather than spend unbounded time.
const MAX_EXPANDED_RUNS: u64 = 1 << 26;

/// One past the last byte a strided box touches, from `base`, or None on overflow.
fn extent_end(base: u64, segment: &Segment, stride: [u64; 2]) -> Option<u64> {
    let last0 = (segment.count[0] - 1).checked_mul(stride[0])?;
    let last1 = (segment.count[1] - 1).checked_mul(stride[1])?;
    base.checked_add(last0)?.checked_add(last1)?.checked_add(segment.len)
}

/// Checks what every batch must satisfy: payload and addresses of each segment fit in 64 bits, and a
/// segment that carries bytes has non-zero source and destination addresses.
pub fn validate(segments: &[Segment]) -> Result<()> {
    for (index, segment) in segments.iter().enumerate() {
        if segment.bytes().is_none() {
            return Err(Error::invalid_argument(format!(
                "segment {index}: len {} x count {:?} overflows 64 bits",
                segment.len, segment.count
            )));
        }
        if segment.runs() == 0 {
            continue;
        }
        if segment.src == 0 || segment.dst == 0 {
            return Err(Error::invalid_argument(format!(
                "segment {index}: {} address is 0",
                if segment.src == 0 { "source" } else { "destination" }
            )));
        }
        if extent_end(segment.src, segment, segment.src_stride).is_none()
            || extent_end(segment.dst, segment, segment.dst_stride).is_none()
        {
            return Err(Error::invalid_argument(format!(
                "segment {index}: its last byte lies beyond the 64-bit address space"
            )));
        }
    }
    Ok(())
}

/// True when the runs of one segment cannot overlap each other: inner runs step by at least `len`, and
/// outer blocks step by at least the inner extent (a sufficient condition; others are expanded).
fn runs_plainly_disjoint(segment: &Segment) -> bool {
    let inner_ok = segment.count[0] == 1 || segment.dst_stride[0] >= segment.len;
    let inner_extent = (segment.count[0] - 1) as u128 * segment.dst_stride[0] as u128 + segment.len as u128;
    let outer_ok = segment.count[1] == 1 || segment.dst_stride[1] as u128 >= inner_extent;
    inner_ok && outer_ok
}

/// The checked mode: fails with `Status::Overlap` when any destination byte would be written twice,
/// naming the two segments (or one segment with itself). Segments must have passed [`validate`].
///
/// Cost: a sort of the segments' destination extents; runs are expanded only for segments whose
/// extents intersect another's or whose own runs might overlap (at most [`MAX_EXPANDED_RUNS`]).
pub fn check_destinations(segments: &[Segment]) -> Result<()> {
    // (start, end, index) of every non-empty destination extent.
    let mut extents: Vec<(u64, u64, usize)> = segments
        .iter()
        .enumerate()
        .filter(|(_, s)| s.runs() > 0)
        .map(|(i, s)| (s.dst, extent_end(s.dst, s, s.dst_stride).expect("validated"), i))
        .collect();
    extents.sort_unstable();
    let mut suspects: Vec<usize> = Vec::new();
    let mut cluster_end = 0u64;
    let mut cluster: Vec<usize> = Vec::new();
    let flush = |cluster: &mut Vec<usize>, suspects: &mut Vec<usize>| {
        if cluster.len() > 1 || cluster.iter().any(|&i| !runs_plainly_disjoint(&segments[i])) {
            suspects.extend_from_slice(cluster);
        }
        cluster.clear();
    };
    for &(start, end, index) in &extents {
        if !cluster.is_empty() && start >= cluster_end {
            flush(&mut cluster, &mut suspects);
        }
        cluster_end = if cluster.is_empty() { end } else { cluster_end.max(end) };
        cluster.push(index);
    }
    flush(&mut cluster, &mut suspects);
    if suspects.is_empty() {
        return Ok(());
    }

    let total: u64 = suspects.iter().map(|&i| segments[i].runs()).fold(0, u64::saturating_add);
    if total > MAX_EXPANDED_RUNS {
        return Err(Error::new(
            Status::Unsupported,
            format!(
                "checked mode: {total} destination runs with interleaved extents exceed the {MAX_EXPANDED_RUNS} \
                 this check expands; check the batch yourself and use the unchecked mode"
            ),
        ));
    }
    let mut runs: Vec<(u64, u64, usize)> = Vec::with_capacity(total as usize);
    for &index in &suspects {
        segments[index].for_each_run(|_, dst, len| runs.push((dst, dst + len, index)));
    }
    runs.sort_unstable();
    for pair in runs.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if b.0 < a.1 {
            return Err(Error::new(
                Status::Overlap,
                if a.2 == b.2 {
                    format!(
                        "segment {} writes destination bytes [{:#x}, {:#x}) twice",
                        a.2,
                        b.0,
                        a.1.min(b.1)
                    )
                } else {
                    format!(
                        "segments {} and {} both write destination bytes [{:#x}, {:#x})",
                        a.2.min(b.2),
                        a.2.max(b.2),
                        b.0,
                        a.1.min(b.1)
                    )
                },
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strided(dst: u64, len: u64, count: [u64; 2], dst_stride: [u64; 2]) -> Segment {
        Segment { src: 1 << 40, dst, len, count, src_stride: [len, len * count[0]], dst_stride }
    }

    #[test]
    fn disjoint_batches_pass() {
        let segments = [
            Segment::contiguous(1, 100, 10),
            Segment::contiguous(1, 110, 10),
            Segment::contiguous(1, 0x1000, 0),
            // Interleaved columns: two segments writing alternate halves of rows.
            strided(0x10000, 8, [100, 1], [16, 0]),
            strided(0x10008, 8, [100, 1], [16, 0]),
        ];
        validate(&segments).unwrap();
        check_destinations(&segments).unwrap();
    }

    #[test]
    fn overlaps_between_segments_are_found() {
        let segments = [Segment::contiguous(1, 100, 10), Segment::contiguous(1, 109, 10)];
        let err = check_destinations(&segments).unwrap_err();
        assert_eq!(err.status, Status::Overlap);
        assert!(err.message.contains("segments 0 and 1"), "{}", err.message);
        let interleaved = [strided(0x10000, 8, [100, 1], [16, 0]), strided(0x10007, 8, [100, 1], [16, 0])];
        assert_eq!(check_destinations(&interleaved).unwrap_err().status, Status::Overlap);
    }

    #[test]
    fn overlaps_within_a_segment_are_found() {
        let rows = [strided(0x1000, 16, [4, 1], [8, 0])];
        let err = check_destinations(&rows).unwrap_err();
        assert_eq!(err.status, Status::Overlap);
        assert!(err.message.contains("segment 0 writes"), "{}", err.message);
        let blocks = [strided(0x1000, 4, [4, 2], [4, 12])];
        assert_eq!(check_destinations(&blocks).unwrap_err().status, Status::Overlap);
        let repeated = [strided(0x1000, 4, [2, 1], [0, 0])];
        assert_eq!(check_destinations(&repeated).unwrap_err().status, Status::Overlap);
        // Outer stride smaller than the inner extent, but interleaving without overlap: allowed.
        let woven = [strided(0x1000, 4, [4, 2], [8, 4])];
        check_destinations(&woven).unwrap();
    }

    #[test]
    fn validation_rejects_overflow_and_null_addresses() {
        let big = Segment { count: [u64::MAX, 2], ..Segment::contiguous(1, 2, 2) };
        assert_eq!(validate(&[big]).unwrap_err().status, Status::InvalidArgument);
        let wraps = Segment::contiguous(1, u64::MAX - 3, 8);
        assert!(validate(&[wraps]).unwrap_err().message.contains("beyond"));
        let strided_wrap =
            Segment { count: [3, 1], dst_stride: [u64::MAX / 2, 0], ..Segment::contiguous(1, 2, 1) };
        assert_eq!(validate(&[strided_wrap]).unwrap_err().status, Status::InvalidArgument);
        let null = Segment::contiguous(0, 2, 8);
        assert!(validate(&[null]).unwrap_err().message.contains("source address is 0"));
        // Empty segments may carry any addresses.
        validate(&[Segment::contiguous(0, 0, 0), Segment { count: [0, 5], ..Segment::contiguous(0, 0, 9) }])
            .unwrap();
    }

    #[test]
    fn huge_interleaved_checks_are_refused_not_run() {
        let a = strided(0x1000, 1, [1 << 26, 1], [2, 0]);
        let b = strided(0x1001, 1, [1 << 26, 1], [2, 0]);
        assert_eq!(check_destinations(&[a, b]).unwrap_err().status, Status::Unsupported);
    }
}
