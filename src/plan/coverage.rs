//! Coverage and overlap: every needed byte has exactly one source, and no two destination bytes of
//! a receiver are written twice (by two needs, or by one need whose strides alias).

use super::boxes::Boxed;
use super::layout::Shape;
use super::merge::{byte_span, CanonNeed, Catalog};
use super::owners::Piece;
use super::table::Endpoint;
use crate::bail;
use crate::error::{Error, Result, Status};

/// Most boxes kept while working out which part of a need is uncovered (error path only).
const MAX_GAP_BOXES: usize = 1 << 16;

/// The error for a need that the pieces do not cover: names the first uncovered region.
pub(crate) fn gap_error(catalog: &Catalog, need: &CanonNeed, pieces: &[Piece]) -> Error {
    let spec = &catalog.tensors[need.tensor];
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
            "tensor '{}' needed by rank {} device {}: offset {:?} extent {:?} is offered by no publisher",
            spec.name,
            need.receiver.rank,
            need.receiver.device,
            &first.lo[..n],
            &first.ext[..n]
        ),
    )
}

/// A byte range `[start, end)` of `receiver` written by need `need`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Written {
    receiver: Endpoint,
    start: u64,
    end: u64,
    need: usize,
}

/// Fails with OVERLAP when two destination bytes of one receiver are written twice. Needs whose
/// byte spans are disjoint are cleared without looking inside them; the rest are expanded into
/// their contiguous runs, at most `max_runs` in all (beyond that, UNSUPPORTED).
pub(crate) fn check_destinations(catalog: &Catalog, max_runs: u64) -> Result<()> {
    let mut spans: Vec<Written> = Vec::with_capacity(catalog.needs.len());
    let mut suspects: Vec<usize> = Vec::new();
    for (i, need) in catalog.needs.iter().enumerate() {
        let (n, elem) = catalog.layout[need.tensor];
        let span = byte_span(n, &need.ext, &need.strides, elem).expect("checked when merged");
        if span == 0 {
            continue;
        }
        spans.push(Written { receiver: need.receiver, start: need.addr, end: need.addr + span, need: i });
        if !strides_nest(n, &need.ext, &need.strides) {
            suspects.push(i);
        }
    }
    spans.sort_unstable();
    let mut cluster_end = 0;
    for k in 0..spans.len() {
        let same_receiver =
            k > 0 && catalog.needs[spans[k - 1].need].receiver == catalog.needs[spans[k].need].receiver;
        if same_receiver && spans[k].start < cluster_end {
            suspects.push(spans[k - 1].need);
            suspects.push(spans[k].need);
            cluster_end = cluster_end.max(spans[k].end);
        } else {
            cluster_end = spans[k].end;
        }
    }
    if suspects.is_empty() {
        return Ok(());
    }
    suspects.sort_unstable();
    suspects.dedup();
    let mut written = Vec::new();
    let mut budget = max_runs;
    for &i in &suspects {
        let need = &catalog.needs[i];
        let spec = &catalog.tensors[need.tensor];
        let (n, elem) = (spec.shape.len(), u64::from(spec.elem_size));
        let bytes: [u64; super::MAX_DIMS] = std::array::from_fn(|d| need.strides[d].saturating_mul(elem));
        let shape = Shape::of(n, &need.ext, &bytes, &bytes, elem);
        let mut segments = Vec::new();
        let runs = shape.runs();
        if runs > budget {
            bail!(
                Status::Unsupported,
                "cannot verify that the destinations of tensor '{}' do not overlap: too many runs",
                spec.name
            );
        }
        budget -= runs;
        shape.emit(0, need.addr, &mut segments, &mut u64::MAX.clone())?;
        for s in &segments {
            s.for_each_run(|_, dst, len| {
                written.push(Written { receiver: need.receiver, start: dst, end: dst + len, need: i })
            });
        }
    }
    written.sort_unstable();
    for pair in written.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let (na, nb) = (&catalog.needs[a.need], &catalog.needs[b.need]);
        if a.receiver == b.receiver && b.start < a.end {
            bail!(
                Status::Overlap,
                "rank {} device {}: destination bytes {:#x}..{:#x} are written by tensor '{}' offset {:?} and by tensor '{}' offset {:?}",
                na.receiver.rank,
                na.receiver.device,
                b.start,
                a.end.min(b.end),
                catalog.tensors[na.tensor].name,
                &na.lo[..catalog.tensors[na.tensor].shape.len()],
                catalog.tensors[nb.tensor].name,
                &nb.lo[..catalog.tensors[nb.tensor].shape.len()]
            );
        }
    }
    Ok(())
}

/// True when the strides prove that distinct elements land at distinct addresses: ordered by
/// stride, each stride exceeds the furthest offset reachable with the smaller ones.
fn strides_nest(n: usize, ext: &super::merge::Dims, strides: &super::merge::Dims) -> bool {
    let mut dims = [0usize; super::MAX_DIMS];
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
        reach += strides[d] * (ext[d] - 1);
    }
    true
}
