//! Reshard planning: pure Rust, no CUDA. Merges every rank's shard table, keeps one owner per replica,
//! intersects needs with offers, and emits the fewest, largest strided copies.
//!
//! Stages, one module each, run in this order by `planner`: `merge` (tables into a canonical,
//! validated catalog), `coverage` (destinations written twice; later, needed bytes nobody offers),
//! `owners` (replica sets, digests, disjoint pieces of overlapping offers, owner policy), `boxes`
//! (box arithmetic), `layout` (one box into strided segments), `coalesce` (segments across boxes and
//! tensors), `stats`; and [`wire`], the binary encoding ranks exchange tables in.

mod boxes;
mod coalesce;
mod coverage;
mod destinations;
mod layout;
mod merge;
mod owners;
mod planner;
mod stats;
pub mod table;
pub mod wire;

pub use destinations::{Destinations, Located};
pub use planner::{build, build_from, build_with_limits, Limits};
pub use stats::{PlanStats, SIZE_BUCKETS};
pub use table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};

use crate::segment::Segment;

/// Which replica serves a replica set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerPolicy {
    /// The replica of the lowest (rank, device), whatever order tables arrive in.
    First,
    /// A replica on the receiver's own device, else one in the receiver's process (NVLink peer),
    /// else the lowest (rank, device).
    Local,
    /// Spread bytes over replicas so that the busiest source serves as little as possible: a greedy
    /// over (replica set, receiver) demands in decreasing size, each to the least-loaded replica.
    Balanced,
}

/// How to plan. The default is `Local` (it never moves a byte further than `First` would) with
/// coalescing on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    pub policy: OwnerPolicy,
    /// Join segments across boxes and tensors (off only for A/B checks).
    pub coalesce: bool,
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions { policy: OwnerPolicy::Local, coalesce: true }
    }
}

/// How far a route's bytes travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteKind {
    /// Same rank and device.
    Local = 0,
    /// Same rank, another device.
    Peer = 1,
    /// Another rank.
    Remote = 2,
}

/// Every segment from one source endpoint to one destination endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub src: Endpoint,
    pub dst: Endpoint,
    /// Sorted by source address, then destination address.
    pub segments: Vec<Segment>,
}

impl Route {
    pub fn kind(&self) -> RouteKind {
        match owners::distance(self.src, self.dst) {
            0 => RouteKind::Local,
            1 => RouteKind::Peer,
            _ => RouteKind::Remote,
        }
    }
}

/// A built plan: immutable, shareable between threads.
#[derive(Clone, Debug)]
pub struct Plan {
    routes: Vec<Route>,
    stats: PlanStats,
    receivers: Vec<(Endpoint, PlanStats)>,
    fingerprint: u64,
    destinations: Destinations,
}

impl Plan {
    /// Routes ordered by destination endpoint, then nearest source first (local, peer, remote),
    /// then source endpoint.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// Counts for the whole plan.
    pub fn stats(&self) -> &PlanStats {
        &self.stats
    }

    /// Counts for one receiver's needs and the routes into it (all zero except the shared inputs
    /// for an endpoint that needs nothing).
    pub fn receiver_stats(&self, receiver: Endpoint) -> PlanStats {
        match self.receivers.binary_search_by_key(&receiver, |(e, _)| *e) {
            Ok(i) => self.receivers[i].1.clone(),
            Err(_) => PlanStats {
                offers_in: self.stats.offers_in,
                replica_sets: self.stats.replica_sets,
                build_ns: self.stats.build_ns,
                ..PlanStats::default()
            },
        }
    }

    /// Endpoints that receive something, ascending.
    pub fn receivers(&self) -> impl Iterator<Item = Endpoint> + '_ {
        self.receivers.iter().map(|(e, _)| *e)
    }

    /// A 64-bit digest of the routes and their segments (FNV-1a over little-endian fields): equal
    /// for the same inputs in any order, in any process, on any build of this version.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Where every need lands: names the tensor, box and element of a destination byte.
    pub fn destinations(&self) -> &Destinations {
        &self.destinations
    }
}

/// FNV-1a over the routes, field by field.
fn fingerprint_of(routes: &[Route]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(routes.len() as u64);
    for r in routes {
        for v in [r.src.rank, r.src.device, r.dst.rank, r.dst.device] {
            eat(v.into());
        }
        eat(r.segments.len() as u64);
        for s in &r.segments {
            for v in [s.src, s.dst, s.len, s.count[0], s.count[1], s.src_stride[0], s.src_stride[1]] {
                eat(v);
            }
            eat(s.dst_stride[0]);
            eat(s.dst_stride[1]);
        }
    }
    h
}
