//! Argument checks shared by every implementation of the batched copy (kernel and host memcpy):
//! [`validate`] (always) and [`check_destinations`] (the checked mode). Pure functions over segments.

use crate::error::{try_reserve, try_vec, Error, Result, Status};
use crate::segment::Segment;
use std::cmp::Reverse;
use std::collections::binary_heap::PeekMut;
use std::collections::BinaryHeap;

/// Destination runs visited at most this many in total to decide overlap exactly, beyond which the
/// checked mode refuses the batch (Unsupported) rather than spend unbounded time.
const MAX_VISITED_RUNS: u64 = 1 << 26;

/// One past the last byte a strided box touches, from `base`, or None on overflow.
fn extent_end(base: u64, segment: &Segment, stride: [u64; 2]) -> Option<u64> {
    let last0 = (segment.count[0] - 1).checked_mul(stride[0])?;
    let last1 = (segment.count[1] - 1).checked_mul(stride[1])?;
    base.checked_add(last0)?.checked_add(last1)?.checked_add(segment.len)
}

/// Checks what every batch must satisfy: payload and addresses of each segment fit in 64 bits, a
/// segment that carries bytes has non-zero source and destination addresses, and no segment surely
/// writes one of its destination bytes twice ([`repeats_its_destination`]; `Overlap`). The last
/// costs O(1) per segment, so it holds without [`check_destinations`] too: such a segment is never
/// a layout, and copying it would write the same bytes count times over (2^64 of them, for a
/// caller who asks).
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
        if repeats_its_destination(segment) {
            return Err(Error::new(
                Status::Overlap,
                format!(
                    "segment {index} writes its destination bytes more than once: runs of {} bytes, counts {:?}, \
                     destination strides {:?}",
                    segment.len, segment.count, segment.dst_stride
                ),
            ));
        }
    }
    Ok(())
}

/// Whether a segment that carries bytes surely writes one destination byte twice: neighbouring inner
/// runs closer than `len`, outer blocks at stride 0, or (with one inner run) outer runs closer than
/// `len`. Other outer strides below the inner extent may interleave without overlapping, which only
/// [`check_destinations`] tells apart.
fn repeats_its_destination(segment: &Segment) -> bool {
    let (count, stride, len) = (segment.count, segment.dst_stride, segment.len);
    (count[0] > 1 && stride[0] < len)
        || (count[1] > 1 && (stride[1] == 0 || (count[0] == 1 && stride[1] < len)))
}

/// The inner level (0 or 1) for which a segment's runs, visited inner level fastest, start at strictly
/// increasing addresses and cannot overlap: inner runs step by at least `len`, and outer blocks by at
/// least the inner extent. None when neither order has that shape (the runs interleave, or overlap).
fn increasing_order(segment: &Segment) -> Option<usize> {
    [0, 1].into_iter().find(|&inner| {
        let outer = 1 - inner;
        let (count, stride) = (segment.count, segment.dst_stride);
        let inner_ok = count[inner] == 1 || stride[inner] >= segment.len;
        let inner_extent = (count[inner] - 1) as u128 * stride[inner] as u128 + segment.len as u128;
        let outer_ok = count[outer] == 1 || stride[outer] as u128 >= inner_extent;
        inner_ok && outer_ok
    })
}

/// Walks some of one segment's destination runs in non-decreasing address order: every run of the
/// outer indices `outer..outer_end`, inner level `inner` fastest.
struct Cursor {
    segment: usize,
    inner: usize,
    inner_index: u64,
    outer: u64,
    outer_end: u64,
}

impl Cursor {
    /// The cursors that together walk every run of a validated, non-empty segment: one when its runs
    /// are in increasing order, else one per index of its shorter level (each walks the longer level,
    /// whose stride is never negative, so in non-decreasing order).
    fn for_segment(index: usize, segment: &Segment, out: &mut Vec<Cursor>) -> Result<()> {
        if let Some(inner) = increasing_order(segment) {
            try_reserve(out, 1, "the overlap check's cursors")?;
            out.push(Cursor {
                segment: index,
                inner,
                inner_index: 0,
                outer: 0,
                outer_end: segment.count[1 - inner],
            });
            return Ok(());
        }
        let inner = if segment.count[0] >= segment.count[1] { 0 } else { 1 };
        let lines = segment.count[1 - inner];
        try_reserve(out, usize::try_from(lines).unwrap_or(usize::MAX), "the overlap check's cursors")?;
        out.extend((0..lines).map(|line| Cursor {
            segment: index,
            inner,
            inner_index: 0,
            outer: line,
            outer_end: line + 1,
        }));
        Ok(())
    }

    /// Destination address of the run under the cursor (no overflow: the segment was validated).
    fn address(&self, segment: &Segment) -> u64 {
        let outer = 1 - self.inner;
        segment.dst
            + self.inner_index * segment.dst_stride[self.inner]
            + self.outer * segment.dst_stride[outer]
    }

    /// Moves to the next run; false past the last.
    fn advance(&mut self, segment: &Segment) -> bool {
        self.inner_index += 1;
        if self.inner_index == segment.count[self.inner] {
            self.inner_index = 0;
            self.outer += 1;
        }
        self.outer < self.outer_end
    }
}

/// The checked mode: fails with `Status::Overlap` when any destination byte would be written twice,
/// naming the two segments (or one segment with itself). Segments must have passed [`validate`].
///
/// Cost: a sort of the segments' destination extents. Runs are visited only for the segments whose
/// extents intersect another's or whose own runs might overlap (at most [`MAX_VISITED_RUNS`] runs),
/// cluster by cluster of intersecting extents, in address order by merging cursors that each walk
/// runs already in order. Memory grows with the number of segments, never with their runs: one
/// extent per segment, and one cursor per segment or, for a segment whose runs interleave, per index
/// of its shorter level (at most the square root of its runs).
pub fn check_destinations(segments: &[Segment]) -> Result<()> {
    // (start, end, index) of every non-empty destination extent.
    let mut extents: Vec<(u64, u64, usize)> = try_vec(segments.len(), "the overlap check's extents")?;
    for (index, segment) in segments.iter().enumerate().filter(|(_, s)| s.runs() > 0) {
        let end = extent_end(segment.dst, segment, segment.dst_stride).ok_or_else(|| {
            Error::invalid_argument(format!(
                "segment {index}: its last byte lies beyond the 64-bit address space"
            ))
        })?;
        extents.push((segment.dst, end, index));
    }
    extents.sort_unstable();

    // Clusters of extents that intersect (ranges of `extents`); a lone extent is suspect only when its
    // own runs might overlap.
    let mut suspects: Vec<std::ops::Range<usize>> = Vec::new();
    let mut first = 0;
    let mut cluster_end = 0u64;
    for position in 0..=extents.len() {
        let closes = position == extents.len() || (position > first && extents[position].0 >= cluster_end);
        if closes && position > first {
            let lone = position - first == 1;
            if !lone || increasing_order(&segments[extents[first].2]).is_none() {
                try_reserve(&mut suspects, 1, "the overlap check's clusters")?;
                suspects.push(first..position);
            }
            first = position;
        }
        if let Some(&(_, end, _)) = extents.get(position) {
            cluster_end = if position == first { end } else { cluster_end.max(end) };
        }
    }

    let total: u64 = suspects
        .iter()
        .flat_map(|cluster| &extents[cluster.clone()])
        .map(|&(_, _, index)| segments[index].runs())
        .fold(0, u64::saturating_add);
    if total > MAX_VISITED_RUNS {
        return Err(Error::new(
            Status::Unsupported,
            format!(
                "checked mode: {total} destination runs with interleaved extents exceed the {MAX_VISITED_RUNS} \
                 this check visits; check the batch yourself and use the unchecked mode"
            ),
        ));
    }
    let mut cursors = Vec::new();
    let mut heap = BinaryHeap::new();
    for cluster in suspects {
        cursors.clear();
        for &(_, _, index) in &extents[cluster] {
            Cursor::for_segment(index, &segments[index], &mut cursors)?;
        }
        heap.clear();
        try_reserve_heap(&mut heap, cursors.len())?;
        heap.extend(
            cursors
                .iter()
                .enumerate()
                .map(|(c, cursor)| Reverse((cursor.address(&segments[cursor.segment]), c))),
        );
        check_merged(segments, &mut cursors, &mut heap)?;
    }
    Ok(())
}

fn try_reserve_heap(heap: &mut BinaryHeap<Reverse<(u64, usize)>>, additional: usize) -> Result<()> {
    heap.try_reserve_exact(additional).map_err(|_| {
        Error::new(
            Status::OutOfMemory,
            format!("cannot allocate the overlap check's queue of {additional} cursors"),
        )
    })
}

/// Visits the runs of one cluster in address order (smallest start first) and fails at the first run
/// that starts before the previous one ends: with runs sorted by start, some two overlap exactly when
/// two neighbours do.
fn check_merged(
    segments: &[Segment],
    cursors: &mut [Cursor],
    heap: &mut BinaryHeap<Reverse<(u64, usize)>>,
) -> Result<()> {
    let mut previous: Option<(u64, usize)> = None; // (end, segment) of the last run visited
    while let Some(mut top) = heap.peek_mut() {
        let Reverse((start, c)) = *top;
        let index = cursors[c].segment;
        let segment = &segments[index];
        let end = start + segment.len;
        if let Some((previous_end, previous_index)) =
            previous.filter(|&(previous_end, _)| start < previous_end)
        {
            let bytes = format!("[{start:#x}, {:#x})", previous_end.min(end));
            return Err(Error::new(
                Status::Overlap,
                if previous_index == index {
                    format!("segment {index} writes destination bytes {bytes} twice")
                } else {
                    let (a, b) = (previous_index.min(index), previous_index.max(index));
                    format!("segments {a} and {b} both write destination bytes {bytes}")
                },
            ));
        }
        previous = Some((end, index));
        // The cursor's next run replaces its current one in place (one sift instead of two).
        if cursors[c].advance(segment) {
            *top = Reverse((cursors[c].address(segment), c));
        } else {
            PeekMut::pop(top);
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
    fn validation_refuses_a_segment_that_surely_writes_its_destination_twice() {
        let refused = [
            strided(0x1000, 4, [2, 1], [0, 0]),
            strided(0x1000, 16, [4, 1], [8, 0]),
            // What a caller may ask for: 2^61 copies of the same 4 bytes, from one source.
            Segment { src_stride: [0, 0], ..strided(0x1000, 4, [1, u64::MAX / 8], [0, 0]) },
            strided(0x1000, 4, [2, 2], [4, 0]),
            strided(0x1000, 8, [1, 3], [0, 4]),
        ];
        for segment in refused {
            let err = validate(&[segment]).unwrap_err();
            assert_eq!(err.status, Status::Overlap, "{segment:?}");
            assert!(
                err.message.contains("segment 0 writes its destination bytes more than once"),
                "{}",
                err.message
            );
        }
        // Dense, repeated-source, and interleaved layouts pass; so does a segment with no bytes.
        let accepted = [
            strided(0x1000, 4, [4, 2], [4, 16]),
            Segment { src_stride: [0, 0], ..strided(0x1000, 4, [4, 2], [4, 16]) },
            strided(0x1000, 4, [4, 2], [8, 4]),
            strided(0x1000, 4, [1, 3], [0, 4]),
            strided(0x1000, 0, [5, 5], [0, 0]),
        ];
        validate(&accepted).unwrap();
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

    /// Whether any destination byte is written twice, by marking every byte (small addresses only).
    fn overlaps_by_bytes(segments: &[Segment]) -> bool {
        let mut written = std::collections::HashSet::new();
        let mut twice = false;
        for segment in segments {
            segment.for_each_run(|_, dst, len| twice |= !(dst..dst + len).all(|b| written.insert(b)));
        }
        twice
    }

    #[test]
    fn agrees_with_marking_every_byte() {
        // Small random batches: strides that interleave, repeat (0), nest or step past each other.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |below: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % below
        };
        let (mut overlapping, mut disjoint) = (0, 0);
        for _ in 0..20_000 {
            let segments: Vec<Segment> = (0..1 + next(4))
                .map(|_| {
                    let count = [1 + next(5), 1 + next(4)];
                    Segment {
                        src: 1 << 40,
                        dst: 0x1000 + next(48),
                        len: 1 + next(4),
                        count,
                        src_stride: [0, 0],
                        dst_stride: [next(10), next(24)],
                    }
                })
                .collect();
            let expected = overlaps_by_bytes(&segments);
            match check_destinations(&segments) {
                Ok(()) => assert!(!expected, "missed an overlap in {segments:?}"),
                Err(err) => {
                    assert_eq!(err.status, Status::Overlap, "{}", err.message);
                    assert!(expected, "false overlap in {segments:?}: {}", err.message);
                }
            }
            if expected {
                overlapping += 1
            } else {
                disjoint += 1
            }
        }
        assert!(overlapping > 1000 && disjoint > 1000, "{overlapping} overlapping, {disjoint} disjoint");
    }

    #[test]
    fn interleaved_segments_are_walked_not_expanded() {
        // Two segments writing alternate bytes (the out-of-memory report's shape, smaller: a larger
        // one runs under an address-space limit in tests/child_process.rs), then a third segment
        // writing into the middle of them.
        let a = strided(0x1000, 1, [1 << 20, 1], [2, 0]);
        let b = strided(0x1001, 1, [1 << 20, 1], [2, 0]);
        check_destinations(&[a, b]).unwrap();
        let c = strided(0x1000 + (1 << 20) + 1, 1, [1, 1], [0, 0]);
        let err = check_destinations(&[a, c, b]).unwrap_err();
        assert_eq!(err.status, Status::Overlap);
        let at = 0x1000 + (1 << 20) + 1;
        assert_eq!(
            err.message,
            format!("segments 1 and 2 both write destination bytes [{at:#x}, {:#x})", at + 1)
        );
    }
}
