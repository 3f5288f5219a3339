//! The planning pipeline: merge, check destinations, group replicas, intersect needs with the
//! disjoint pieces (checking coverage), choose owners, lay out segments, coalesce, count.

use super::boxes::Boxed;
use super::destinations::Destinations;
use super::layout::Shape;
use super::merge::{merge, CanonNeed, Catalog, Dims};
use super::owners::{self, Owners};
use super::stats::PlanStats;
use super::table::{Endpoint, Table};
use super::{coalesce, coverage, OwnerPolicy, Plan, PlanOptions, Route};
use crate::bail;
use crate::error::{Result, Status};
use crate::segment::Segment;
use std::collections::BTreeMap;
use std::time::Instant;

/// Bounds on the work and memory hostile or pathological tables can cause. Exceeding one fails
/// with OUT_OF_MEMORY (segments) or UNSUPPORTED (the others), never by exhausting the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most segments a plan may hold before coalescing (also bounds the intersections kept).
    pub max_segments: u64,
    /// Most disjoint pieces overlapping offers may be cut into.
    pub max_pieces: usize,
    /// Most contiguous runs expanded to prove that destinations whose spans interleave do not overlap.
    pub max_overlap_runs: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        // About 1 GB of segments, 150 MB of pieces, 350 MB of runs at most: far beyond real models
        // (a Qwen3-30B-A3B refit has some 40,000 segments before coalescing and 22,000 pieces).
        Limits { max_segments: 1 << 24, max_pieces: 1 << 20, max_overlap_runs: 1 << 23 }
    }
}

/// Builds the plan that moves every needed byte exactly once. See [`build_with_limits`].
pub fn build(tables: &[Table], options: &PlanOptions) -> Result<Plan> {
    build_with_limits(tables, options, &Limits::default())
}

/// One needed box served by one replica set: need `need` intersected with piece `piece` (indices
/// into the catalog and the replicas). The box itself is recomputed where it is used: storing it
/// would make this a hundred and forty bytes instead of eight, for tens of thousands of items.
struct Item {
    need: u32,
    piece: u32,
}

impl Item {
    /// The piece's replica set and the box this item moves.
    fn resolve(&self, replicas: &owners::Replicas, need: &CanonNeed, n: usize) -> (usize, Boxed) {
        let piece = &replicas.pieces[self.piece as usize];
        let bx = piece
            .bx
            .intersect(&Boxed::new(need.lo, need.ext), n)
            .expect("intersected when the item was made");
        (piece.set, bx)
    }
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
    let merged = started.elapsed();
    coverage::check_destinations(&catalog, limits.max_overlap_runs)?;
    let checked = started.elapsed();
    let replicas = owners::replicas(&catalog, limits.max_pieces)?;
    let grouped = started.elapsed();

    // Intersect every need with the pieces of its tensor; count what reading every replica would cost.
    let mut items: Vec<Item> = Vec::with_capacity(catalog.needs.len());
    let mut receivers: Vec<(Endpoint, PlanStats)> = Vec::new();
    for i in 0..catalog.needs.len() {
        let need = &catalog.need(i);
        let (n, elem) = catalog.layout[need.tensor];
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
        stats.needed_bytes = stats.needed_bytes.saturating_add(volume * elem);
        let pieces = replicas.pieces_of(need.tensor);
        let first_piece = replicas.piece_start[need.tensor];
        let mut covered = 0;
        for (p, piece) in pieces.iter().enumerate() {
            if let Some(bx) = piece.bx.intersect(&wanted, n) {
                covered += bx.volume(n);
                // Both fit: merging and `owners::replicas` allow at most 2^32 needs and pieces.
                items.push(Item { need: i as u32, piece: (first_piece + p) as u32 });
            }
        }
        // Every item becomes at least one segment: stop before holding more than the limit.
        if items.len() as u64 > limits.max_segments {
            bail!(Status::OutOfMemory, "the plan would need more than {} segments", limits.max_segments);
        }
        if covered != volume {
            return Err(coverage::gap_error(&catalog, need, pieces));
        }
        let dst_bytes = byte_strides(&need.strides, elem);
        for o in catalog.offer_range(need.tensor) {
            let (lo, ext, strides) = catalog.offer_parts(o);
            if let Some(bx) = wanted.intersect_parts(lo, ext) {
                let src_bytes: Dims =
                    std::array::from_fn(|d| if d < n { strides[d].saturating_mul(elem) } else { 0 });
                let shape = Shape::of(n, &bx.ext, &src_bytes, &dst_bytes, elem);
                stats.ranges_all_replicas = stats.ranges_all_replicas.saturating_add(shape.runs());
                stats.bytes_all_replicas = stats.bytes_all_replicas.saturating_add(bx.volume(n) * elem);
            }
        }
        stats.duplicate_bytes_dropped = stats.bytes_all_replicas.saturating_sub(stats.needed_bytes);
    }

    let intersected = started.elapsed();
    let demand = if options.policy == OwnerPolicy::Balanced {
        demand(&catalog, &replicas, &items)
    } else {
        Vec::new()
    };
    let owners = Owners::choose(&catalog, &replicas.sets, options.policy, &demand);

    // Lay out each item's segments on its route.
    let mut routes: BTreeMap<(Endpoint, Endpoint), Vec<Segment>> = BTreeMap::new();
    let mut kept: Vec<(Endpoint, usize)> = Vec::with_capacity(items.len());
    let mut budget = limits.max_segments;
    let mut receiver = 0;
    // Items come grouped by need: expand each need once.
    let mut cached: Option<(usize, CanonNeed)> = None;
    for item in &items {
        let need_index = item.need as usize;
        if cached.as_ref().is_none_or(|(i, _)| *i != need_index) {
            cached = Some((need_index, catalog.need(need_index)));
        }
        let need = &cached.as_ref().expect("expanded above").1;
        let (set, bx) = item.resolve(&replicas, need, catalog.layout[need.tensor].0);
        while receivers[receiver].0 != need.receiver {
            receiver += 1;
        }
        let offer_index = owners.owner(&catalog, &replicas.sets, set, need.receiver);
        let offer = &catalog.offers[offer_index];
        let (offer_lo, _, offer_strides) = catalog.offer_parts(offer_index);
        kept.push((need.receiver, offer_index));
        let (n, elem) = catalog.layout[need.tensor];
        let src_bytes: Dims =
            std::array::from_fn(|d| if d < n { offer_strides[d].saturating_mul(elem) } else { 0 });
        let shape = Shape::of(n, &bx.ext, &src_bytes, &byte_strides(&need.strides, elem), elem);
        let stats = &mut receivers[receiver].1;
        stats.ranges_deduped = stats.ranges_deduped.saturating_add(shape.runs());
        stats.segments_deduped = stats.segments_deduped.saturating_add(shape.segments());
        let src = address(offer.addr, &bx.lo, offer_lo, offer_strides, n, elem);
        let dst = address(need.addr, &bx.lo, &need.lo, &need.strides, n, elem);
        shape.emit(src, dst, routes.entry((offer.owner, need.receiver)).or_default(), &mut budget)?;
    }

    let laid_out = started.elapsed();
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

    let coalesced = started.elapsed();
    for route in &routes {
        let at =
            receivers.binary_search_by_key(&route.dst, |(e, _)| *e).expect("every route ends at a receiver");
        let stats = &mut receivers[at].1;
        stats.routes += 1;
        let bytes =
            route.segments.iter().fold(0u64, |acc, s| acc.saturating_add(s.bytes().unwrap_or(u64::MAX)));
        match route.kind() {
            super::RouteKind::Local => stats.bytes_local = stats.bytes_local.saturating_add(bytes),
            super::RouteKind::Peer => stats.bytes_peer = stats.bytes_peer.saturating_add(bytes),
            super::RouteKind::Remote => stats.bytes_remote = stats.bytes_remote.saturating_add(bytes),
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
    log::debug!(
        "plan built in {:?}: merge {merged:?}, destinations checked {checked:?}, replicas {grouped:?}, \
         intersected {intersected:?}, laid out {laid_out:?}, coalesced {coalesced:?} (cumulative)",
        started.elapsed()
    );
    let build_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    total.build_ns = build_ns;
    for (_, stats) in &mut receivers {
        stats.build_ns = build_ns;
    }
    let destinations = Destinations::new(&catalog);
    Ok(Plan { routes, stats: total, receivers, fingerprint, destinations })
}

/// Bytes each (replica set, receiver) pair moves, sorted by (set, receiver).
fn demand(catalog: &Catalog, replicas: &owners::Replicas, items: &[Item]) -> Vec<(usize, Endpoint, u64)> {
    let mut demand: Vec<(usize, Endpoint, u64)> = items
        .iter()
        .map(|item| {
            let need = catalog.need(item.need as usize);
            let (n, elem) = catalog.layout[need.tensor];
            let (set, bx) = item.resolve(replicas, &need, n);
            (set, need.receiver, bx.volume(n) * elem)
        })
        .collect();
    demand.sort_unstable_by_key(|&(set, receiver, _)| (set, receiver));
    demand.dedup_by(|later, earlier| {
        let same = (later.0, later.1) == (earlier.0, earlier.1);
        if same {
            earlier.2 = earlier.2.saturating_add(later.2);
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
fn address(base: u64, at: &[u64], corner: &[u64], strides: &[u64], n: usize, elem: u64) -> u64 {
    let mut elements = 0;
    for d in 0..n {
        elements += (at[d] - corner[d]) * strides[d];
    }
    base + elements * elem
}
