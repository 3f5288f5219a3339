//! The planning pipeline, one function per stage: [`merge`], [`Scope`] (the whole plan or one
//! process's share), [`coverage::check_destinations`], [`replicas::replicas`], [`intersect`]
//! (needs with the disjoint pieces, checking coverage), [`Owners::choose`], [`lay_out`] (segments
//! per route), [`finish_routes`] (coalesce and order), [`tally`] (counts).

use super::boxes::{Boxed, Dims};
use super::destinations::Destinations;
use super::digest::Words;
use super::memory;
use super::merge::{merge, CanonNeed, Merged};
use super::options::{Budget, Limits, OwnerPolicy, PlanOptions};
use super::owners::{Demand, Owners};
use super::replicas::{self, Replicas};
use super::routes::{fingerprint_of, Plan, Route, RouteKind};
use super::scope::Scope;
use super::shape::Shape;
use super::stats::PlanStats;
use super::table::{Endpoint, Table};
use super::{coalesce, coverage, quantized};
use crate::error::{Error, Result};
use crate::segment::Segment;
use std::collections::BTreeMap;
use std::time::Instant;

/// Builds the plan that moves every needed byte exactly once. See [`build_with_limits`].
pub fn build(tables: &[Table], options: &PlanOptions) -> Result<Plan> {
    build_with_limits(tables, options, &Limits::default())
}

/// Builds a plan from every process's table. Deterministic: tables and their entries in any order
/// give the same plan. Errors: TENSOR_MISMATCH (a tensor described two ways, a box outside its
/// tensor), INVALID_ARGUMENT (bad index, stride count, permutation, address overflow),
/// REPLICA_MISMATCH, COVERAGE_GAP, OVERLAP, and OUT_OF_MEMORY / UNSUPPORTED beyond `limits` or
/// beyond the memory the process can allocate.
pub fn build_with_limits(tables: &[Table], options: &PlanOptions, limits: &Limits) -> Result<Plan> {
    let refs: Vec<&Table> = tables.iter().collect();
    build_from(&refs, options, limits)
}

/// [`build_with_limits`] over borrowed tables (for callers that keep tables apart, such as the C API).
pub fn build_from(tables: &[&Table], options: &PlanOptions, limits: &Limits) -> Result<Plan> {
    build_part(tables, None, options, limits)
}

/// The share of the plan that process `process` takes part in, from every process's table: each
/// route from or to one of its endpoints, exactly as [`build_from`] would make it (owners are a
/// function of all tables and the options, so every process agrees on them), and the counts of
/// its own receivers. Every table is read, but the work beyond reading them grows with this
/// process's own needs and offers (with BALANCED, with every need: it weighs all demand). Errors
/// as [`build_from`], except that coverage and overlaps are checked for this process's needs only:
/// each process checks its own, and callers compare [`Plan::inputs_fingerprint`] and statuses
/// across processes before any byte moves.
pub fn build_share(tables: &[&Table], process: u32, options: &PlanOptions, limits: &Limits) -> Result<Plan> {
    build_part(tables, Some(process), options, limits)
}

/// The whole plan (`process` None) or one process's share.
fn build_part(
    tables: &[&Table],
    process: Option<u32>,
    options: &PlanOptions,
    limits: &Limits,
) -> Result<Plan> {
    let mut clock = StageClock::start();
    let mut work = Budget::box_tests(limits);
    let quantized = quantized::plan(tables, process, limits)?;
    let with_shadow: Vec<&Table>;
    let tables = if quantized.shadow.needs.is_empty() {
        tables
    } else {
        with_shadow = tables.iter().copied().chain([&quantized.shadow]).collect();
        &with_shadow
    };
    let merged = merge(tables)?;
    let inputs = inputs_fingerprint(&merged, options, limits, quantized.fingerprint);
    clock.mark("merge");
    let scope = match process {
        None => Scope::whole(&merged)?,
        Some(p) => Scope::process(&merged, p, options.policy)?,
    };
    clock.mark("scope");
    coverage::check_destinations(&merged, scope.own(), limits, &mut work)?;
    clock.mark("destinations");
    let replicas = replicas::replicas(&merged, &scope.tensors, limits, &mut work)?;
    clock.mark("replicas");
    let Intersections { items, mut receivers } = intersect(&merged, &replicas, &scope, limits, &mut work)?;
    clock.mark("intersect");
    let demand = match options.policy {
        OwnerPolicy::Balanced => demand(&merged, &replicas, &items)?,
        _ => Vec::new(),
    };
    let owners = Owners::choose(&merged, &replicas.sets, options.policy, &demand, &mut work)?;
    clock.mark("owners");
    let laid_out = lay_out(&merged, &replicas, &items, &owners, &scope, &mut receivers, limits)?;
    clock.mark("lay out");
    let routes = finish_routes(laid_out.routes, options)?;
    clock.mark("coalesce");
    let (mut stats, mut receivers) = tally(&routes, receivers, laid_out.kept, &merged, &replicas, &scope);
    let shared = stats;
    quantized::tally(&quantized.routes, process, &mut stats, &mut receivers, &shared);
    let fingerprint = fingerprint_of(&routes, &quantized.routes);
    clock.mark("tally");
    log::debug!("plan built: {:?}", clock.stages);
    let build_ns = clock.stages.iter().map(|(_, ns)| ns).sum();
    stats.build_ns = build_ns;
    for (_, s) in &mut receivers {
        s.build_ns = build_ns;
    }
    let destinations = Destinations::new(&merged, scope.own());
    Ok(Plan {
        routes,
        stats,
        receivers,
        fingerprint,
        inputs,
        stages: clock.stages,
        destinations,
        share: process,
        quant: quantized.routes,
        amax_exchange: quantized.exchange,
    })
}

/// Wall time of each stage of one build.
struct StageClock {
    last: Instant,
    stages: Vec<(&'static str, u64)>,
}

impl StageClock {
    fn start() -> StageClock {
        StageClock { last: Instant::now(), stages: Vec::with_capacity(10) }
    }

    /// Ends stage `name` now.
    fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        let ns = u64::try_from((now - self.last).as_nanos()).unwrap_or(u64::MAX);
        self.stages.push((name, ns));
        self.last = now;
    }
}

/// The inputs' fingerprint: the merged tables' and everything that decides the plan from them.
fn inputs_fingerprint(merged: &Merged, options: &PlanOptions, limits: &Limits, quantized: u64) -> u64 {
    let mut h = Words::new();
    h.u64(merged.fingerprint());
    if quantized != 0 {
        h.u64(quantized);
    }
    h.u64(options.policy as u64);
    h.u64(options.coalesce.into());
    let Limits { max_segments, max_pieces, max_overlap_runs, max_box_tests } = limits;
    for v in [max_segments, max_pieces, max_overlap_runs, max_box_tests] {
        h.u64(*v);
    }
    h.finish()
}

/// One needed box served by one replica set: need `need` intersected with piece `piece` (indices
/// into the merged needs and the pieces). The box itself is recomputed where it is used: storing
/// it would make this a hundred and forty bytes instead of eight, for tens of thousands of items.
struct Item {
    need: u32,
    piece: u32,
}

impl Item {
    /// The piece's replica set and the box this item moves.
    fn resolve(&self, replicas: &Replicas, need: &CanonNeed, n: usize) -> (usize, Boxed) {
        let piece = &replicas.pieces[self.piece as usize];
        let bx = piece
            .bx
            .intersect(&Boxed::new(need.lo, need.ext), n)
            .expect("intersected when the item was made");
        (piece.set, bx)
    }
}

/// Every need's items, grouped by need in canonical order, and each receiver's counts so far.
struct Intersections {
    items: Vec<Item>,
    /// Sorted by endpoint (needs are sorted by receiver first).
    receivers: Vec<(Endpoint, PlanStats)>,
}

/// Intersects the scope's needs with the pieces of their tensors that meet them. Its own needs
/// must be covered (COVERAGE_GAP otherwise) and are counted, with what reading every replica would
/// cost.
fn intersect(
    merged: &Merged,
    replicas: &Replicas,
    scope: &Scope,
    limits: &Limits,
    work: &mut Budget,
) -> Result<Intersections> {
    let mut items: Vec<Item> = memory::with_capacity(scope.needs.len(), "intersections")?;
    let mut receivers: Vec<(Endpoint, PlanStats)> = Vec::new();
    // Every item becomes at least one segment: stop before holding more than the limit.
    let mut segments = Budget::segments(limits);
    let mut hits: Vec<u32> = Vec::new();
    for &i in &scope.needs {
        let i = i as usize;
        let need = &merged.need(i);
        let (n, elem) = merged.geometry[need.tensor];
        if receivers.last().is_none_or(|(e, _)| *e != need.receiver) {
            memory::push(&mut receivers, (need.receiver, PlanStats::default()), "receivers")?;
        }
        let own = scope.is_own(i);
        let stats = &mut receivers.last_mut().expect("pushed above").1;
        stats.needs += u64::from(own);
        let wanted = Boxed::new(need.lo, need.ext);
        if wanted.is_empty(n) {
            continue;
        }
        let volume = wanted.volume(n);
        if own {
            stats.needed_bytes = stats.needed_bytes.saturating_add(volume * elem);
        }
        hits.clear();
        replicas
            .piece_index
            .for_each_meeting(need.tensor, &wanted, work, |p| memory::push(&mut hits, p, "pieces"))?;
        if !own {
            // Another process's need: only what this process may serve.
            hits.retain(|&p| {
                let set = replicas.sets[replicas.pieces[p as usize].set];
                scope.may_serve(&merged.offers[set.first..set.first + set.len])
            });
        }
        hits.sort_unstable();
        segments.spend(hits.len() as u64)?;
        memory::reserve(&mut items, hits.len(), "intersections")?;
        let mut covered = 0u64;
        for &p in &hits {
            let bx =
                replicas.pieces[p as usize].bx.intersect(&wanted, n).expect("the index found it meeting");
            // Disjoint parts of the need: their volumes add up to at most its own.
            covered += bx.volume(n);
            // Both fit: merging and `replicas::replicas` allow at most 2^32 needs and pieces.
            items.push(Item { need: i as u32, piece: p });
        }
        if !own {
            continue;
        }
        if covered != volume {
            return Err(coverage::gap_error(
                merged,
                need,
                hits.iter().map(|&p| &replicas.pieces[p as usize]),
            ));
        }
        count_all_replicas(merged, replicas, need, &wanted, stats, &mut hits, work)?;
    }
    Ok(Intersections { items, receivers })
}

/// Adds to `stats` the runs and bytes of reading `wanted` from every replica offer that meets it
/// (`sets`: room for the replica sets found).
fn count_all_replicas(
    merged: &Merged,
    replicas: &Replicas,
    need: &CanonNeed,
    wanted: &Boxed,
    stats: &mut PlanStats,
    sets: &mut Vec<u32>,
    work: &mut Budget,
) -> Result<()> {
    let (n, elem) = merged.geometry[need.tensor];
    let dst_bytes = byte_strides(&need.strides, elem);
    sets.clear();
    replicas
        .set_index
        .for_each_meeting(need.tensor, wanted, work, |s| memory::push(sets, s, "replica sets"))?;
    for &s in sets.iter() {
        let set = replicas.sets[s as usize];
        let bx = wanted.intersect(&merged.offer_box(set.first), n).expect("the index found it meeting");
        work.spend(set.len as u64)?;
        for o in set.first..set.first + set.len {
            let (_, _, strides) = merged.offer_parts(o);
            let src_bytes: Dims =
                std::array::from_fn(|d| if d < n { strides[d].saturating_mul(elem) } else { 0 });
            let shape = Shape::of(n, &bx.ext, &src_bytes, &dst_bytes, elem);
            stats.ranges_all_replicas = stats.ranges_all_replicas.saturating_add(shape.runs());
            stats.bytes_all_replicas = stats.bytes_all_replicas.saturating_add(bx.volume(n) * elem);
        }
    }
    stats.duplicate_bytes_dropped = stats.bytes_all_replicas.saturating_sub(stats.needed_bytes);
    Ok(())
}

/// Bytes each (replica set, receiver) pair moves, sorted by (set, receiver), each pair once.
fn demand(merged: &Merged, replicas: &Replicas, items: &[Item]) -> Result<Vec<Demand>> {
    let mut demand = memory::collect(
        items.len(),
        items.iter().map(|item| {
            let need = merged.need(item.need as usize);
            let (n, elem) = merged.geometry[need.tensor];
            let (set, bx) = item.resolve(replicas, &need, n);
            Demand { set: set as u32, receiver: need.receiver, bytes: bx.volume(n) * elem }
        }),
        "demands",
    )?;
    demand.sort_unstable_by_key(|d| (d.set, d.receiver));
    demand.dedup_by(|later, earlier| {
        let same = (later.set, later.receiver) == (earlier.set, earlier.receiver);
        if same {
            earlier.bytes = earlier.bytes.saturating_add(later.bytes);
        }
        same
    });
    Ok(demand)
}

/// Segments per (source, destination) route, and the (receiver, offer) pairs that serve them.
struct LaidOut {
    routes: BTreeMap<(Endpoint, Endpoint), Vec<Segment>>,
    kept: Vec<(Endpoint, usize)>,
}

/// Lays out each item's segments on the route from its owner to its receiver (for the routes the
/// scope keeps), counting the deduplicated ranges per receiver.
fn lay_out(
    merged: &Merged,
    replicas: &Replicas,
    items: &[Item],
    owners: &Owners,
    scope: &Scope,
    receivers: &mut [(Endpoint, PlanStats)],
    limits: &Limits,
) -> Result<LaidOut> {
    let mut out =
        LaidOut { routes: BTreeMap::new(), kept: memory::with_capacity(items.len(), "owner choices")? };
    let mut budget = Budget::segments(limits);
    let mut receiver = 0;
    // Items come grouped by need: expand each need once.
    let mut cached: Option<(usize, CanonNeed)> = None;
    for item in items.iter().filter(|item| scope.lays_out(item.need as usize)) {
        let need_index = item.need as usize;
        if cached.as_ref().is_none_or(|(i, _)| *i != need_index) {
            cached = Some((need_index, merged.need(need_index)));
        }
        let need = &cached.as_ref().expect("expanded above").1;
        let (n, elem) = merged.geometry[need.tensor];
        let (set, bx) = item.resolve(replicas, need, n);
        while receivers[receiver].0 != need.receiver {
            receiver += 1;
        }
        let offer_index = owners.owner(merged, &replicas.sets, set, need.receiver);
        let offer = &merged.offers[offer_index];
        if !scope.keeps(offer.owner, need.receiver) {
            continue;
        }
        let (offer_lo, _, offer_strides) = merged.offer_parts(offer_index);
        out.kept.push((need.receiver, offer_index));
        let src_bytes: Dims =
            std::array::from_fn(|d| if d < n { offer_strides[d].saturating_mul(elem) } else { 0 });
        let shape = Shape::of(n, &bx.ext, &src_bytes, &byte_strides(&need.strides, elem), elem);
        let stats = &mut receivers[receiver].1;
        stats.ranges_deduped = stats.ranges_deduped.saturating_add(shape.runs());
        stats.segments_deduped = stats.segments_deduped.saturating_add(shape.segments());
        let src = address(offer.addr, &bx.lo[..n], offer_lo, offer_strides, elem)?;
        let dst = address(need.addr, &bx.lo[..n], &need.lo[..n], &need.strides[..n], elem)?;
        shape.emit(src, dst, out.routes.entry((offer.owner, need.receiver)).or_default(), &mut budget)?;
    }
    Ok(out)
}

/// Coalesces each route's segments (when enabled), orders them by source address, and orders the
/// routes by destination, then nearest source first, then source.
fn finish_routes(
    routes: BTreeMap<(Endpoint, Endpoint), Vec<Segment>>,
    options: &PlanOptions,
) -> Result<Vec<Route>> {
    let mut out: Vec<Route> = memory::with_capacity(routes.len(), "routes")?;
    for ((src, dst), mut segments) in routes {
        if options.coalesce {
            coalesce::coalesce(&mut segments)?;
        }
        segments.sort_unstable_by_key(|s| (s.src, s.dst));
        out.push(Route { src, dst, segments });
    }
    out.sort_unstable_by_key(|r| (r.dst, r.kind(), r.src));
    Ok(out)
}

/// Completes each receiver's counts from its routes and sums the scope's receivers' into the
/// plan's. Returns them and the scope's receivers' counts, ascending.
fn tally(
    routes: &[Route],
    mut receivers: Vec<(Endpoint, PlanStats)>,
    mut kept: Vec<(Endpoint, usize)>,
    merged: &Merged,
    replicas: &Replicas,
    scope: &Scope,
) -> (PlanStats, Vec<(Endpoint, PlanStats)>) {
    for route in routes {
        let at =
            receivers.binary_search_by_key(&route.dst, |(e, _)| *e).expect("every route ends at a receiver");
        let stats = &mut receivers[at].1;
        stats.routes += 1;
        let bytes =
            route.segments.iter().fold(0u64, |acc, s| acc.saturating_add(s.bytes().unwrap_or(u64::MAX)));
        let moved = match route.kind() {
            RouteKind::Local => &mut stats.bytes_local,
            RouteKind::Peer => &mut stats.bytes_peer,
            RouteKind::Remote => &mut stats.bytes_remote,
        };
        *moved = moved.saturating_add(bytes);
        for s in &route.segments {
            stats.add_segment(s);
        }
    }
    let mut total = PlanStats {
        offers_in: merged.offers.len() as u64,
        replica_sets: replicas.sets.len() as u64,
        ..PlanStats::default()
    };
    // Offers kept per receiver: distinct (receiver, offer) pairs, which sort by receiver as the
    // receivers do.
    kept.sort_unstable();
    kept.dedup();
    let mut pairs = kept.iter().peekable();
    for (endpoint, stats) in receivers.iter_mut() {
        stats.offers_in = total.offers_in;
        stats.replica_sets = total.replica_sets;
        while pairs.next_if(|(e, _)| e == endpoint).is_some() {
            stats.offers_kept += 1;
        }
    }
    receivers.retain(|(e, _)| scope.counts(*e));
    for (_, stats) in &receivers {
        total.add(stats);
    }
    // Distinct offers over the routes: reuse the pairs' memory for their offers.
    let mut offers: Vec<usize> = kept.into_iter().map(|(_, o)| o).collect();
    offers.sort_unstable();
    offers.dedup();
    total.offers_kept = offers.len() as u64;
    (total, receivers)
}

fn byte_strides(strides: &Dims, elem: u64) -> Dims {
    // Saturating: only dimensions with extent above 1 are used, and those were checked to fit.
    std::array::from_fn(|d| strides[d].saturating_mul(elem))
}

/// Address of element `at` of a box stored at `base` from its corner `corner` with element
/// `strides`; INVALID_ARGUMENT when it passes 2^64 (never for an element inside a checked box).
fn address(base: u64, at: &[u64], corner: &[u64], strides: &[u64], elem: u64) -> Result<u64> {
    let mut elements = 0u64;
    for d in 0..at.len() {
        let step = at[d].checked_sub(corner[d]).and_then(|i| i.checked_mul(strides[d]));
        elements = step.and_then(|s| elements.checked_add(s)).ok_or_else(|| overflow(base))?;
    }
    elements.checked_mul(elem).and_then(|o| base.checked_add(o)).ok_or_else(|| overflow(base))
}

fn overflow(base: u64) -> Error {
    Error::invalid_argument(format!(
        "an address of the box at {base:#x} runs past the end of the address space"
    ))
}
