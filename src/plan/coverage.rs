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
/// byte spans are disjoint are cleared without looking inside them; the rest are expanded into
/// their contiguous runs, at most `max_runs` in all (beyond that, UNSUPPORTED).
pub(crate) fn check_destinations(catalog: &Catalog, max_runs: u64) -> Result<()> {
    let mut spans: Vec<Written> = Vec::with_capacity(catalog.needs.len());
    for i in 0..catalog.needs.len() {
        let need = &catalog.need(i);
        let (n, elem) = catalog.layout[need.tensor];
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
    // Clusters: spans of one receiver whose byte ranges chain into each other. Disjoint clusters
    // cannot share a byte; inside a cluster, box arithmetic settles the usual cases and the rest
    // are expanded into runs.
    let mut expand: Vec<usize> = Vec::new();
    let mut k = 0;
    while k < spans.len() {
        let (mut j, mut end) = (k + 1, spans[k].end);
        while j < spans.len() && spans[j].receiver == spans[k].receiver && spans[j].start < end {
            end = end.max(spans[j].end);
            j += 1;
        }
        // A lone span is settled by its own strides, without reading the need again.
        let settled = if j == k + 1 { spans[k].nests } else { cluster_disjoint(catalog, &spans[k..j])? };
        if !settled {
            expand.extend(spans[k..j].iter().map(|w| w.need));
        }
        k = j;
    }
    if expand.is_empty() {
        return Ok(());
    }
    let mut written = Vec::new();
    let mut budget = max_runs;
    for &i in &expand {
        let need = &catalog.need(i);
        let (n, elem) = catalog.layout[need.tensor];
        let bytes: [u64; super::MAX_DIMS] = std::array::from_fn(|d| need.strides[d].saturating_mul(elem));
        let shape = Shape::of(n, &need.ext, &bytes, &bytes, elem);
        let mut segments = Vec::new();
        let runs = shape.runs();
        if runs > budget {
            bail!(
                Status::Unsupported,
                "cannot verify that the destinations of tensor '{}' do not overlap: too many runs",
                catalog.tensors[need.tensor].name
            );
        }
        budget -= runs;
        shape.emit(0, need.addr, &mut segments, &mut u64::MAX.clone())?;
        for s in &segments {
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
            return Err(overlap_error(catalog, a.need, b.need, b.start, a.end.min(b.end)));
        }
    }
    Ok(())
}

/// Most needs in one cluster compared pairwise by their boxes; larger clusters are expanded.
const MAX_PAIRWISE: usize = 2048;

/// Settles a cluster by box arithmetic when every member addresses one frame: the same element
/// size, rank, element strides and origin (the address of index 0), with strides that keep
/// distinct indices of the members' bounding box at distinct addresses. Then two members share a
/// byte exactly when their boxes intersect (OVERLAP). Returns false when it cannot tell.
fn cluster_disjoint(catalog: &Catalog, cluster: &[Written]) -> Result<bool> {
    let first = &catalog.need(cluster[0].need);
    let (n, elem) = catalog.layout[first.tensor];
    if cluster.len() > MAX_PAIRWISE {
        return Ok(false);
    }
    let origin = |need: &super::merge::CanonNeed| -> i128 {
        let index: i128 = (0..n).map(|d| i128::from(need.lo[d]) * i128::from(need.strides[d])).sum();
        i128::from(need.addr) - index * i128::from(elem)
    };
    let frame = origin(first);
    let (mut lo, mut hi) = ([u64::MAX; super::MAX_DIMS], [0u64; super::MAX_DIMS]);
    for w in cluster {
        let need = &catalog.need(w.need);
        if catalog.layout[need.tensor] != (n, elem)
            || need.strides[..n] != first.strides[..n]
            || origin(need) != frame
        {
            return Ok(false);
        }
        for d in 0..n {
            lo[d] = lo[d].min(need.lo[d]);
            hi[d] = hi[d].max(need.lo[d] + need.ext[d]);
        }
    }
    let bounding: super::merge::Dims = std::array::from_fn(|d| if d < n { hi[d] - lo[d] } else { 0 });
    if !strides_nest(n, &bounding, &first.strides) {
        return Ok(false);
    }
    for (x, a) in cluster.iter().enumerate() {
        let na = &catalog.need(a.need);
        for b in &cluster[x + 1..] {
            let nb = &catalog.need(b.need);
            if Boxed::new(na.lo, na.ext).intersect(&Boxed::new(nb.lo, nb.ext), n).is_some() {
                return Err(overlap_error(catalog, a.need, b.need, a.start.max(b.start), a.end.min(b.end)));
            }
        }
    }
    Ok(true)
}

fn overlap_error(catalog: &Catalog, a: usize, b: usize, start: u64, end: u64) -> Error {
    let (na, nb) = (&catalog.need(a), &catalog.need(b));
    let (ta, tb) = (catalog.tensors[na.tensor], catalog.tensors[nb.tensor]);
    Error::new(
        Status::Overlap,
        format!(
            "rank {} device {}: destination bytes in {start:#x}..{end:#x} are written by tensor '{}' offset {:?} and by tensor '{}' offset {:?}",
            na.receiver.rank,
            na.receiver.device,
            ta.name,
            &na.lo[..ta.shape.len()],
            tb.name,
            &nb.lo[..tb.shape.len()]
        ),
    )
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
