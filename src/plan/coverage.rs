//! Coverage and overlap: every needed byte has exactly one source, and no two destination bytes of
//! a receiver are written twice (by two needs, or by one need whose strides alias).

use super::box_index::BoxForest;
use super::boxes::MAX_DIMS;
use super::boxes::{byte_span, Boxed, Dims};
use super::memory;
use super::merge::{CanonNeed, Merged};
use super::options::{Budget, Limits};
use super::replicas::Piece;
use super::shape::Shape;
use super::table::Endpoint;
use crate::error::{Error, Result, Status};
use std::ops::Range;

/// Most boxes kept while working out which part of a need is uncovered (error path only).
const MAX_GAP_BOXES: usize = 1 << 16;

/// The error for a need that `pieces` (those meeting it) do not cover: names the first uncovered
/// region.
pub(crate) fn gap_error<'p>(
    merged: &Merged,
    need: &CanonNeed,
    pieces: impl Iterator<Item = &'p Piece>,
) -> Error {
    let spec = &merged.tensors[need.tensor];
    let n = spec.shape.len();
    let mut left = vec![Boxed::new(need.lo, need.ext)];
    for piece in pieces {
        let mut next = Vec::new();
        for b in &left {
            b.subtract(&piece.bx, n, &mut next);
        }
        left = next;
        if left.len() > MAX_GAP_BOXES {
            break;
        }
    }
    let first = left.iter().min().copied().unwrap_or(Boxed::new(need.lo, need.ext));
    Error::new(
        Status::CoverageGap,
        format!(
            "tensor '{}' needed by process {} device {}: offset {:?} extent {:?} is offered by no publisher",
            spec.name,
            need.receiver.process,
            need.receiver.device,
            &first.lo[..n],
            &first.ext[..n]
        ),
    )
}

/// A byte range `[start, end)` of `receiver` written by need `need`; `nests` when the need's own
/// strides keep its elements apart.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Written {
    receiver: Endpoint,
    start: u64,
    end: u64,
    need: usize,
    nests: bool,
}

/// Fails with OVERLAP when two destination bytes of one receiver are written twice. Needs whose
/// byte spans are disjoint are cleared without looking inside them; clusters of needs whose spans
/// chain into each other are settled by box arithmetic where they share one frame, and the rest
/// are expanded into their contiguous runs (at most `max_overlap_runs` in all).
///
/// `needs`: the merged needs to check (those of one process's receivers, or all).
pub(crate) fn check_destinations(
    merged: &Merged,
    needs: Range<usize>,
    limits: &Limits,
    work: &mut Budget,
) -> Result<()> {
    let mut spans: Vec<Written> = memory::with_capacity(needs.len(), "destination spans")?;
    for i in needs {
        let need = &merged.need(i);
        let (n, elem) = merged.geometry[need.tensor];
        // Checked when merged: the span and its end fit in 64 bits.
        let span = byte_span(n, &need.ext, &need.strides, elem).expect("checked when merged");
        if span > 0 {
            let nests = strides_nest(n, &need.ext, &need.strides);
            spans.push(Written {
                receiver: need.receiver,
                start: need.addr,
                end: need.addr + span,
                need: i,
                nests,
            });
        }
    }
    spans.sort_unstable();
    let mut expand: Vec<usize> = Vec::new();
    let mut k = 0;
    while k < spans.len() {
        let (mut j, mut end) = (k + 1, spans[k].end);
        while j < spans.len() && spans[j].receiver == spans[k].receiver && spans[j].start < end {
            end = end.max(spans[j].end);
            j += 1;
        }
        // A lone span is settled by its own strides, without reading the need again.
        let settled = if j == k + 1 { spans[k].nests } else { cluster_disjoint(merged, &spans[k..j], work)? };
        if !settled {
            memory::reserve(&mut expand, j - k, "destination spans")?;
            expand.extend(spans[k..j].iter().map(|w| w.need));
        }
        k = j;
    }
    if expand.is_empty() {
        return Ok(());
    }
    let mut runs_left = Budget::overlap_runs(limits);
    let mut written: Vec<Written> = Vec::new();
    let mut segments = Vec::new();
    for &i in &expand {
        let need = &merged.need(i);
        let (n, elem) = merged.geometry[need.tensor];
        let bytes: Dims = std::array::from_fn(|d| need.strides[d].saturating_mul(elem));
        let shape = Shape::of(n, &need.ext, &bytes, &bytes, elem);
        runs_left.spend(shape.runs()).map_err(|e| {
            e.context(format!(
                "cannot verify that the destinations of tensor '{}' do not overlap",
                merged.tensors[need.tensor].name
            ))
        })?;
        segments.clear();
        shape.emit(0, need.addr, &mut segments, &mut Budget::unlimited("segments"))?;
        for s in &segments {
            memory::reserve(
                &mut written,
                usize::try_from(s.runs()).unwrap_or(usize::MAX),
                "destination runs",
            )?;
            // Runs of a need whose span was checked: every end fits in 64 bits.
            s.for_each_run(|_, dst, len| {
                written.push(Written {
                    receiver: need.receiver,
                    start: dst,
                    end: dst + len,
                    need: i,
                    nests: true,
                })
            });
        }
    }
    written.sort_unstable();
    for pair in written.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.receiver == b.receiver && b.start < a.end {
            return Err(overlap_error(merged, a.need, b.need, b.start, a.end.min(b.end)));
        }
    }
    Ok(())
}

/// Settles a cluster by box arithmetic when every member addresses one frame: the same element
/// size, dimensions, element strides and origin (the address of index 0), with strides that keep
/// distinct indices of the members' bounding box at distinct addresses. Then two members share a
/// byte exactly when their boxes intersect (OVERLAP), which an index over the boxes finds in
/// `n log n`. Returns false when it cannot tell.
fn cluster_disjoint(merged: &Merged, cluster: &[Written], work: &mut Budget) -> Result<bool> {
    let first = &merged.need(cluster[0].need);
    let (n, elem) = merged.geometry[first.tensor];
    // The address of index 0 (None when it is beyond 128 bits: no frame can be shown then).
    let origin = |need: &CanonNeed| -> Option<i128> {
        let mut index = 0i128;
        for d in 0..n {
            index = index.checked_add(i128::from(need.lo[d]).checked_mul(i128::from(need.strides[d]))?)?;
        }
        i128::from(need.addr).checked_sub(index.checked_mul(i128::from(elem))?)
    };
    let Some(frame) = origin(first) else {
        return Ok(false);
    };
    let (mut lo, mut hi) = ([u64::MAX; MAX_DIMS], [0u64; MAX_DIMS]);
    let mut boxes: Vec<(u32, Boxed)> = memory::with_capacity(cluster.len(), "destination boxes")?;
    for (k, w) in cluster.iter().enumerate() {
        let need = &merged.need(w.need);
        if merged.geometry[need.tensor] != (n, elem)
            || need.strides[..n] != first.strides[..n]
            || origin(need) != Some(frame)
        {
            return Ok(false);
        }
        for d in 0..n {
            lo[d] = lo[d].min(need.lo[d]);
            hi[d] = hi[d].max(need.lo[d] + need.ext[d]);
        }
        boxes.push((k as u32, Boxed::new(need.lo, need.ext)));
    }
    let bounding: Dims = std::array::from_fn(|d| if d < n { hi[d] - lo[d] } else { 0 });
    if !strides_nest(n, &bounding, &first.strides) {
        return Ok(false);
    }
    let mut index = BoxForest::new();
    let tree = index.add_tree(n, boxes.iter().copied())?;
    for (k, (_, bx)) in boxes.iter().enumerate() {
        let mut other = None;
        index.for_each_meeting(tree, bx, work, |j| {
            if j as usize != k {
                other = Some(j as usize);
            }
            Ok(())
        })?;
        if let Some(j) = other {
            let (a, b) = (&cluster[k], &cluster[j]);
            return Err(overlap_error(merged, a.need, b.need, a.start.max(b.start), a.end.min(b.end)));
        }
    }
    Ok(true)
}

fn overlap_error(merged: &Merged, a: usize, b: usize, start: u64, end: u64) -> Error {
    let (na, nb) = (&merged.need(a), &merged.need(b));
    let (ta, tb) = (merged.tensors[na.tensor], merged.tensors[nb.tensor]);
    Error::new(
        Status::Overlap,
        format!(
            "process {} device {}: destination bytes in {start:#x}..{end:#x} are written by tensor '{}' offset {:?} and by tensor '{}' offset {:?}",
            na.receiver.process,
            na.receiver.device,
            ta.name,
            &na.lo[..ta.shape.len()],
            tb.name,
            &nb.lo[..tb.shape.len()]
        ),
    )
}

/// True when the strides prove that distinct elements land at distinct addresses: ordered by
/// stride, each stride exceeds the furthest offset reachable with the smaller ones. An offset past
/// 2^64 proves nothing (false): the box may wrap onto itself.
fn strides_nest(n: usize, ext: &Dims, strides: &Dims) -> bool {
    let mut dims = [0usize; MAX_DIMS];
    let mut count = 0;
    for d in (0..n).filter(|&d| ext[d] > 1) {
        dims[count] = d;
        count += 1;
    }
    dims[..count].sort_unstable_by_key(|&d| strides[d]);
    let mut reach = 0u64;
    for &d in &dims[..count] {
        if strides[d] <= reach {
            return false;
        }
        match strides[d].checked_mul(ext[d] - 1).and_then(|r| reach.checked_add(r)) {
            Some(r) => reach = r,
            None => return false,
        }
    }
    true
}
