//! Coalescing one route's segments: runs adjacent in memory on both sides join into one run, and
//! segments of the same shape that repeat with constant source and destination strides (the same
//! slice of consecutive experts, rows of consecutive tensors) join into one strided segment. Only
//! exact rewrites: the coalesced segments move exactly the same bytes to the same places.

use super::memory;
use crate::error::Result;
use crate::segment::Segment;

/// How many following candidates (in destination order) are tried as the second element of a
/// progression. Progressions interleave when several tensors land in one fused buffer (gate and up
/// of each expert alternate), so the immediate neighbour is not always the right partner.
const CANDIDATES: usize = 16;

/// Coalesces `segments` in place, in no particular order. Fails only with OUT_OF_MEMORY.
pub(crate) fn coalesce(segments: &mut Vec<Segment>) -> Result<()> {
    segments.retain(|s| s.runs() > 0);
    join_adjacent_runs(segments);
    // Twice: the first pass turns runs into one-level segments that the second can stack again.
    if join_progressions(segments)? {
        join_progressions(segments)?;
    }
    Ok(())
}

fn is_run(s: &Segment) -> bool {
    s.count == [1, 1]
}

/// Joins plain runs that continue each other on both sides. Destinations never overlap, so in
/// destination order a run's continuation is its immediate successor.
fn join_adjacent_runs(segments: &mut Vec<Segment>) {
    segments.sort_unstable_by_key(|s| (s.dst, s.src));
    // In place: the joined list is never longer than what has been read.
    let mut kept = 0;
    for i in 0..segments.len() {
        let s = segments[i];
        if kept > 0 {
            let last = &mut segments[kept - 1];
            let continues = is_run(last)
                && is_run(&s)
                && last.dst.checked_add(last.len) == Some(s.dst)
                && last.src.checked_add(last.len) == Some(s.src);
            if let Some(len) = last.len.checked_add(s.len).filter(|_| continues) {
                last.len = len;
                continue;
            }
        }
        segments[kept] = s;
        kept += 1;
    }
    segments.truncate(kept);
}

fn same_shape(a: &Segment, b: &Segment) -> bool {
    a.len == b.len && a.count == b.count && a.src_stride == b.src_stride && a.dst_stride == b.dst_stride
}

/// Orders by shape (everything but the base addresses), then destination, then source.
fn by_shape_then_dst(a: &Segment, b: &Segment) -> std::cmp::Ordering {
    a.len
        .cmp(&b.len)
        .then(a.count.cmp(&b.count))
        .then(a.src_stride.cmp(&b.src_stride))
        .then(a.dst_stride.cmp(&b.dst_stride))
        .then(a.dst.cmp(&b.dst))
        .then(a.src.cmp(&b.src))
}

/// Joins segments of one shape whose bases advance by a constant (source, destination) step into
/// one segment with one more level. Only segments with a free outer level take part. Returns
/// whether anything was joined.
fn join_progressions(segments: &mut Vec<Segment>) -> Result<bool> {
    // Segments with both levels in use cannot stack further: keep them out of the sort.
    let mut out: Vec<Segment> = memory::with_capacity(segments.len(), "segments")?;
    segments.retain(|s| {
        let free = s.count[1] == 1;
        if !free {
            out.push(*s);
        }
        free
    });
    segments.sort_unstable_by(by_shape_then_dst);
    let before = segments.len() + out.len();
    let mut start = 0;
    while start < segments.len() {
        let end = start
            + segments[start..]
                .iter()
                .position(|s| !same_shape(s, &segments[start]))
                .unwrap_or(segments.len() - start);
        let group = &segments[start..end];
        if group.len() == 1 {
            out.push(group[0]);
        } else {
            join_group(group, &mut out)?;
        }
        start = end;
    }
    *segments = out;
    Ok(segments.len() < before)
}

/// `group`: segments of one shape with `count[1] == 1`, sorted by destination. Appends at most
/// one segment per member to `out`, which has room for them.
fn join_group(group: &[Segment], out: &mut Vec<Segment>) -> Result<()> {
    let mut used = memory::filled(false, group.len(), "segments")?;
    for i in 0..group.len() {
        if used[i] {
            continue;
        }
        let first = group[i];
        // The longest chain over a few candidate steps; ties go to the earliest candidate.
        let mut best: Option<(u64, u64, usize)> = None;
        // Scan a bounded window, so that long runs of already-joined members cannot make this quadratic.
        let window = (i + 1..group.len()).take(4 * CANDIDATES);
        let candidates = window.filter(|&j| !used[j]).take(CANDIDATES);
        // Where the member tested first for each candidate is looked up from: that member's
        // destination grows with the candidate (and with the best length), so the lookups move
        // forward through the group and each starts where the previous one ended.
        let mut cursor = i + 1;
        for j in candidates {
            let second = group[j];
            // A chain steps forward on both sides. A second member at the same destination is a
            // duplicate (a share plans other processes' needs unchecked; their own builds refuse
            // the overlap), and a step of zero would find `first` again at every length.
            if second.src < first.src || second.dst == first.dst {
                continue;
            }
            let (step_src, step_dst) = (second.src - first.src, second.dst - first.dst);
            // Member k of the chain, if it is there and free.
            let member = |k: u64| -> Option<usize> {
                let src = first.src.checked_add(step_src.checked_mul(k)?)?;
                let at = find_from(group, j, first.dst.checked_add(step_dst.checked_mul(k)?)?)?;
                (!used[at] && group[at].src == src).then_some(at)
            };
            // A chain beats the best only if it reaches one member further: test that member first,
            // so that most candidates cost one lookup.
            let best_length = best.map_or(1, |(_, _, l)| l);
            let k = best_length as u64;
            let Some(target) = step_dst.checked_mul(k).and_then(|d| first.dst.checked_add(d)) else {
                continue;
            };
            cursor = lower_bound_from(group, cursor, target);
            let src = step_src.checked_mul(k).and_then(|d| first.src.checked_add(d));
            let found = group.get(cursor).is_some_and(|s| s.dst == target && Some(s.src) == src);
            if !found || used[cursor] {
                continue;
            }
            let mut length = 2;
            while member(length as u64).is_some() {
                length += 1;
            }
            if length > best_length {
                best = Some((step_src, step_dst, length));
            }
        }
        let stacked = best.and_then(|(step_src, step_dst, length)| {
            Some((step_dst, length, stack(first, step_src, step_dst, length as u64)?))
        });
        let Some((step_dst, length, joined)) = stacked else {
            used[i] = true;
            out.push(first);
            continue;
        };
        for k in 0..length as u64 {
            // Found above with checked arithmetic: the address fits.
            let at = find_from(group, i, first.dst + k * step_dst).expect("chain members were found above");
            used[at] = true;
        }
        out.push(joined);
    }
    Ok(())
}

/// The index of the segment of `group` (sorted by destination; destinations are distinct) whose
/// destination is `dst`, which is not below `group[from].dst`. Gallops forward from `from`: chain
/// members lie a few places apart, so this reads a handful of neighbours where a binary search over
/// the whole group would miss the cache at every step.
fn find_from(group: &[Segment], from: usize, dst: u64) -> Option<usize> {
    let rest = &group[from.min(group.len())..];
    let mut bound = 1;
    while bound < rest.len() && rest[bound].dst < dst {
        bound *= 2;
    }
    let window = &rest[bound / 2..(bound + 1).min(rest.len())];
    window.binary_search_by_key(&dst, |s| s.dst).ok().map(|k| from + bound / 2 + k)
}

/// The first index at or after `from` whose segment's destination is not below `dst`, in `group`
/// sorted by destination, given that every segment before `from` lies below `dst`. Gallops
/// forward, so a nearby answer costs a few reads.
fn lower_bound_from(group: &[Segment], from: usize, dst: u64) -> usize {
    let rest = &group[from.min(group.len())..];
    let mut end = 1;
    while end < rest.len() && rest[end - 1].dst < dst {
        end *= 2;
    }
    let end = end.min(rest.len());
    let start = end / 2;
    from + start + rest[start..end].partition_point(|s| s.dst < dst)
}

/// `first` repeated `n` times, `step_src`/`step_dst` bytes apart, as one segment (None when its
/// counts would pass 2^64: the members then stay apart).
fn stack(first: Segment, step_src: u64, step_dst: u64, n: u64) -> Option<Segment> {
    let mut s = first;
    if is_run(&first) {
        s.count = [n, 1];
        s.src_stride = [step_src, 0];
        s.dst_stride = [step_dst, 0];
    } else if first.src_stride[0].checked_mul(first.count[0]) == Some(step_src)
        && first.dst_stride[0].checked_mul(first.count[0]) == Some(step_dst)
    {
        // The repetition continues the inner level: one longer level instead of two.
        s.count[0] = first.count[0].checked_mul(n)?;
    } else {
        s.count[1] = n;
        s.src_stride[1] = step_src;
        s.dst_stride[1] = step_dst;
    }
    s.bytes().map(|_| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of(segments: &[Segment]) -> Vec<(u64, u64)> {
        let mut map = Vec::new();
        for s in segments {
            s.for_each_run(|src, dst, len| map.extend((0..len).map(|b| (dst + b, src + b))));
        }
        map.sort_unstable();
        map
    }

    #[test]
    fn adjacent_runs_join_and_interleaved_progressions_are_found() {
        // Two runs adjacent on both sides, then gate/up of 4 experts alternating in the destination.
        let mut segments = vec![Segment::contiguous(0, 0, 10), Segment::contiguous(10, 10, 6)];
        for e in 0..4u64 {
            segments.push(Segment::contiguous(1000 + e * 100, 100 + e * 200, 50));
            segments.push(Segment::contiguous(5000 + e * 100, 200 + e * 200, 50));
        }
        let before = bytes_of(&segments);
        coalesce(&mut segments).unwrap();
        assert_eq!(bytes_of(&segments), before);
        // Gate and up each form a progression over the experts; the two progressions then stack.
        assert_eq!(segments.len(), 2, "{segments:?}");
        assert_eq!(segments[0], Segment::contiguous(0, 0, 16));
        assert_eq!(segments[1].count, [4, 2]);
        assert_eq!((segments[1].src_stride, segments[1].dst_stride), ([100, 4000], [200, 100]));
    }

    #[test]
    fn duplicate_segments_end_and_stay_apart() {
        // A share may plan another process's needs twice over (that process refuses the overlap):
        // coalescing such duplicates once looped forever, chaining a member to itself at step 0.
        for copies in [2, 3] {
            let mut segments = vec![Segment::contiguous(7, 100, 1); copies];
            segments.push(Segment::contiguous(8, 101, 1));
            let before = bytes_of(&segments);
            coalesce(&mut segments).unwrap();
            assert_eq!(bytes_of(&segments), before);
        }
    }

    #[test]
    fn strided_segments_stack_into_two_levels_or_continue_their_level() {
        let row =
            |src, dst| Segment { src, dst, len: 8, count: [3, 1], src_stride: [16, 0], dst_stride: [8, 0] };
        // Continuation: rows 0..3 then rows 3..6 of the same column split.
        let mut segments = vec![row(0, 0), row(48, 24)];
        coalesce(&mut segments).unwrap();
        assert_eq!(segments, vec![Segment { count: [6, 1], ..row(0, 0) }]);
        // Consecutive experts: same slice shape, 1000 bytes apart in the source, 24 in the destination.
        let mut segments: Vec<Segment> = (0..5).map(|e| row(4 + e * 1000, e * 24 + 2000)).collect();
        segments.swap(0, 3);
        let before = bytes_of(&segments);
        coalesce(&mut segments).unwrap();
        assert_eq!(bytes_of(&segments), before);
        assert_eq!(segments.len(), 1);
    }
}
