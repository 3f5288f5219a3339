//! The planning pipeline: merge, check destinations, group replicas, intersect needs with the
//! disjoint pieces (checking coverage), choose owners, lay out segments, coalesce, count.

use super::boxes::Boxed;
use super::layout::Shape;
use super::merge::{merge, Catalog, Dims};
use super::owners::{self, Owners};
use super::stats::PlanStats;
use super::table::{Endpoint, Table};
use super::{coalesce, coverage, OwnerPolicy, Plan, PlanOptions, Route};
use crate::error::Result;
use crate::segment::Segment;
use std::collections::BTreeMap;
use std::time::Instant;

/// Bounds on the work and memory hostile or pathological tables can cause. Exceeding one fails
/// with OUT_OF_MEMORY (segments) or UNSUPPORTED (the others), never by exhausting the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most segments a plan may hold before coalescing.
    pub max_segments: u64,
    /// Most disjoint pieces overlapping offers may be cut into.
    pub max_pieces: usize,
    /// Most contiguous runs expanded to prove that destinations whose spans interleave do not overlap.
    pub max_overlap_runs: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_segments: 1 << 26, max_pieces: 1 << 24, max_overlap_runs: 1 << 26 }
    }
}

/// Builds the plan that moves every needed byte exactly once. See [`build_with_limits`].
pub fn build(tables: &[Table], options: &PlanOptions) -> Result<Plan> {
    build_with_limits(tables, options, &Limits::default())
}

/// One needed box served by one replica set.
struct Item {
    need: usize,
    set: usize,
    bx: Boxed,
}

/// Builds a plan from every rank's table. Deterministic: tables and their entries in any order give
/// the same plan. Errors: TENSOR_MISMATCH (a tensor described two ways, a box outside its tensor),
/// INVALID_ARGUMENT (bad index, stride count, permutation, address overflow), REPLICA_MISMATCH,
/// COVERAGE_GAP, OVERLAP, and OUT_OF_MEMORY / UNSUPPORTED beyond `limits`.
pub fn build_with_limits(tables: &[Table], options: &PlanOptions, limits: &Limits) -> Result<Plan> {
    let refs: Vec<&Table> = tables.iter().collect();
    build_from(&refs, options, limits)
}

/// [`build_with_limits`] over borrowed tables (for callers that keep tables apart, such as the C API).
pub fn build_from(tables: &[&Table], options: &PlanOptions, limits: &Limits) -> Result<Plan> {
    let started = Instant::now();
    let catalog = merge(tables)?;
    coverage::check_destinations(&catalog, limits.max_overlap_runs)?;
    let replicas = owners::replicas(&catalog, limits.max_pieces)?;

    // Intersect every need with the pieces of its tensor; count what reading every replica would cost.
    let mut items: Vec<Item> = Vec::new();
    let mut receivers: Vec<(Endpoint, PlanStats)> = Vec::new();
    for (i, need) in catalog.needs.iter().enumerate() {
        let spec = &catalog.tensors[need.tensor];
        let (n, elem) = (spec.shape.len(), u64::from(spec.elem_size));
        if receivers.last().is_none_or(|(e, _)| *e != need.receiver) {
            receivers.push((need.receiver, PlanStats::default()));
        }
        let stats = &mut receivers.last_mut().expect("pushed above").1;
        stats.needs += 1;
        let wanted = Boxed::new(need.lo, need.ext);
        if wanted.is_empty(n) {
            continue;
        }
        let volume = wanted.volume(n);
        stats.needed_bytes += volume * elem;
        let pieces = replicas.pieces_of(need.tensor);
        let mut covered = 0;
        for piece in pieces {
            if let Some(bx) = piece.bx.intersect(&wanted, n) {
                covered += bx.volume(n);
                items.push(Item { need: i, set: piece.set, bx });
            }
        }
        if covered != volume {
            return Err(coverage::gap_error(&catalog, need, pieces));
        }
        let dst_bytes = byte_strides(&need.strides, elem);
        for offer in catalog.offers_of(need.tensor) {
            if let Some(bx) = Boxed::new(offer.lo, offer.ext).intersect(&wanted, n) {
                let shape = Shape::of(n, &bx.ext, &byte_strides(&offer.strides, elem), &dst_bytes, elem);
                stats.ranges_all_replicas += shape.runs();
                stats.bytes_all_replicas += bx.volume(n) * elem;
            }
        }
        stats.duplicate_bytes_dropped = stats.bytes_all_replicas - stats.needed_bytes;
    }

    let demand = if options.policy == OwnerPolicy::Balanced { demand(&catalog, &items) } else { Vec::new() };
    let owners = Owners::choose(&catalog, &replicas.sets, options.policy, &demand);

    // Lay out each item's segments on its route.
    let mut routes: BTreeMap<(Endpoint, Endpoint), Vec<Segment>> = BTreeMap::new();
    let mut kept: Vec<(Endpoint, usize)> = Vec::with_capacity(items.len());
    let mut budget = limits.max_segments;
    let mut receiver = 0;
    for item in &items {
        let need = &catalog.needs[item.need];
        while receivers[receiver].0 != need.receiver {
            receiver += 1;
        }
        let offer_index = owners.owner(&catalog, &replicas.sets, item.set, need.receiver);
        let offer = &catalog.offers[offer_index];
        kept.push((need.receiver, offer_index));
        let spec = &catalog.tensors[need.tensor];
        let (n, elem) = (spec.shape.len(), u64::from(spec.elem_size));
        let shape = Shape::of(
            n,
            &item.bx.ext,
            &byte_strides(&offer.strides, elem),
            &byte_strides(&need.strides, elem),
            elem,
        );
        let stats = &mut receivers[receiver].1;
        stats.ranges_deduped += shape.runs();
        stats.segments_deduped += shape.segments();
        let src = address(offer.addr, &item.bx.lo, &offer.lo, &offer.strides, n, elem);
        let dst = address(need.addr, &item.bx.lo, &need.lo, &need.strides, n, elem);
        shape.emit(src, dst, routes.entry((offer.owner, need.receiver)).or_default(), &mut budget)?;
    }

    let mut routes: Vec<Route> = routes
        .into_iter()
        .map(|((src, dst), mut segments)| {
            if options.coalesce {
                coalesce::coalesce(&mut segments);
            }
            segments.sort_unstable_by_key(|s| (s.src, s.dst));
            Route { src, dst, segments }
        })
        .collect();
    routes.sort_by_key(|r| (r.dst, r.kind(), r.src));

    for route in &routes {
        let at =
            receivers.binary_search_by_key(&route.dst, |(e, _)| *e).expect("every route ends at a receiver");
        let stats = &mut receivers[at].1;
        stats.routes += 1;
        let bytes: u64 = route.segments.iter().map(|s| s.bytes().unwrap_or(u64::MAX)).sum();
        match route.kind() {
            super::RouteKind::Local => stats.bytes_local += bytes,
            super::RouteKind::Peer => stats.bytes_peer += bytes,
            super::RouteKind::Remote => stats.bytes_remote += bytes,
        }
        for s in &route.segments {
            stats.add_segment(s);
        }
    }

    let mut total = PlanStats {
        offers_in: catalog.offers.len() as u64,
        replica_sets: replicas.sets.len() as u64,
        ..PlanStats::default()
    };
    kept.sort_unstable();
    kept.dedup();
    for (endpoint, stats) in &mut receivers {
        stats.offers_in = total.offers_in;
        stats.replica_sets = total.replica_sets;
        stats.offers_kept = kept.iter().filter(|(e, _)| e == endpoint).count() as u64;
        total.add(stats);
    }
    let mut offers_kept: Vec<usize> = kept.iter().map(|&(_, o)| o).collect();
    offers_kept.sort_unstable();
    offers_kept.dedup();
    total.offers_kept = offers_kept.len() as u64;

    let fingerprint = super::fingerprint_of(&routes);
    let build_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    total.build_ns = build_ns;
    for (_, stats) in &mut receivers {
        stats.build_ns = build_ns;
    }
    Ok(Plan { routes, stats: total, receivers, fingerprint })
}

/// Bytes each (replica set, receiver) pair moves, sorted by (set, receiver).
fn demand(catalog: &Catalog, items: &[Item]) -> Vec<(usize, Endpoint, u64)> {
    let mut demand: Vec<(usize, Endpoint, u64)> = items
        .iter()
        .map(|item| {
            let need = &catalog.needs[item.need];
            let spec = &catalog.tensors[need.tensor];
            (item.set, need.receiver, item.bx.volume(spec.shape.len()) * u64::from(spec.elem_size))
        })
        .collect();
    demand.sort_unstable_by_key(|&(set, receiver, _)| (set, receiver));
    demand.dedup_by(|later, earlier| {
        let same = (later.0, later.1) == (earlier.0, earlier.1);
        if same {
            earlier.2 += later.2;
        }
        same
    });
    demand
}

fn byte_strides(strides: &Dims, elem: u64) -> Dims {
    // Saturating: only dimensions with extent above 1 are used, and those were checked to fit.
    std::array::from_fn(|d| strides[d].saturating_mul(elem))
}

/// Address of element `at` of a box stored at `base` from its corner `corner` with `strides`.
fn address(base: u64, at: &Dims, corner: &Dims, strides: &Dims, n: usize, elem: u64) -> u64 {
    let mut elements = 0;
    for d in 0..n {
        elements += (at[d] - corner[d]) * strides[d];
    }
    base + elements * elem
}
