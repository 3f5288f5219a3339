//! What planning returns: routes of segments between endpoints, counts, and a fingerprint.

use super::stats::PlanStats;
use super::table::Endpoint;
use crate::segment::Segment;

/// How far a route's bytes travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteKind {
    /// Same process and device.
    Local = 0,
    /// Same process, another device.
    Peer = 1,
    /// Another process.
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
        match self.src.distance(self.dst) {
            0 => RouteKind::Local,
            1 => RouteKind::Peer,
            _ => RouteKind::Remote,
        }
    }
}

/// A built plan: immutable, shareable between threads.
#[derive(Clone, Debug)]
pub struct Plan {
    pub(crate) routes: Vec<Route>,
    pub(crate) stats: PlanStats,
    /// Sorted by endpoint.
    pub(crate) receivers: Vec<(Endpoint, PlanStats)>,
    pub(crate) fingerprint: u64,
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
            Ok(i) => self.receivers[i].1,
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
}

/// FNV-1a over the routes, field by field.
pub(crate) fn fingerprint_of(routes: &[Route]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(routes.len() as u64);
    for r in routes {
        for v in [r.src.process, r.src.device, r.dst.process, r.dst.device] {
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
