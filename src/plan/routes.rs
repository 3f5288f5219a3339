//! What planning returns: routes of segments between endpoints, counts, and a fingerprint.

use super::destinations::Destinations;
use super::digest::Fnv1a;
use super::quantized::{AmaxExchange, QuantRoute};
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

/// A built plan, or one process's share of one: immutable, shareable between threads.
#[derive(Clone, Debug)]
pub struct Plan {
    pub(crate) routes: Vec<Route>,
    pub(crate) stats: PlanStats,
    /// Sorted by endpoint.
    pub(crate) receivers: Vec<(Endpoint, PlanStats)>,
    pub(crate) fingerprint: u64,
    pub(crate) inputs: u64,
    /// Wall time of each planning stage, nanoseconds, in order.
    pub(crate) stages: Vec<(&'static str, u64)>,
    /// Where the needs of the receivers it covers land.
    pub(crate) destinations: Destinations,
    /// The process whose share this is (None: the whole plan).
    pub(crate) share: Option<u32>,
    /// The quantization jobs of quantized needs (of its process's receivers, for a share), sorted by
    /// receiver, tensor and runner.
    pub(crate) quant: Vec<QuantRoute>,
    /// The amaxes the devices quantizing sets of needs sharing one exchange at every run (the same
    /// in every process's plan).
    pub(crate) amax_exchange: AmaxExchange,
}

impl Plan {
    /// Routes ordered by destination endpoint, then nearest source first (local, peer, remote),
    /// then source endpoint.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// Counts for the whole plan (a share: for its process's receivers, and the offers kept by
    /// its routes).
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

    /// Endpoints that receive something, ascending (a share: its process's).
    pub fn receivers(&self) -> impl Iterator<Item = Endpoint> + '_ {
        self.receivers.iter().map(|(e, _)| *e)
    }

    /// A 64-bit digest of the routes and their segments (FNV-1a over little-endian fields): equal
    /// for the same inputs in any order, in any process, on any build of this version. A share's
    /// covers its own routes.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// A 64-bit digest of everything the plan was built from: every table's content (in any order),
    /// the options and the limits. Equal in every process that planned (a share or the whole plan)
    /// from the same inputs: processes compare it before any byte moves.
    pub fn inputs_fingerprint(&self) -> u64 {
        self.inputs
    }

    /// Wall time of each planning stage in nanoseconds, in the order they ran ("merge", "scope",
    /// "destinations", "replicas", "intersect", "owners", "lay out", "coalesce", "tally"); they
    /// add up to `stats().build_ns`.
    pub fn stage_ns(&self) -> &[(&'static str, u64)] {
        &self.stages
    }

    /// Where the needs of its receivers land: names the tensor, box and element of a destination
    /// byte (a verify mismatch reports them).
    pub fn destinations(&self) -> &Destinations {
        &self.destinations
    }

    /// The process this plan is the share of (`plan::build_share`), or None for a whole plan. A
    /// share holds only the routes its process takes part in, so it can drive no other process.
    pub fn share_of(&self) -> Option<u32> {
        self.share
    }

    /// The quantization each quantized need takes after the routes have moved their bytes: which
    /// device runs which jobs, reading the sources in place or the need's staging.
    pub fn quant_routes(&self) -> &[QuantRoute] {
        &self.quant
    }

    /// The amaxes exchanged at every run between the devices quantizing sets of needs that share
    /// one ([`AmaxExchange`]; empty: none).
    pub fn amax_exchange(&self) -> &AmaxExchange {
        &self.amax_exchange
    }
}

/// FNV-1a over the routes, field by field.
pub(crate) fn fingerprint_of(routes: &[Route], quant: &[QuantRoute]) -> u64 {
    let mut h = Fnv1a::new();
    for q in quant {
        for v in [q.receiver.process, q.receiver.device, q.runner.process, q.runner.device, q.path as u32] {
            h.u64(v.into());
        }
        h.u64(q.jobs.len() as u64);
        for j in &q.jobs {
            for v in j.quantization.codes() {
                h.u64(v.into());
            }
            h.u64(j.source.code().into());
            for v in [j.src, j.rows, j.cols, j.src_stride, j.dst, j.dst_stride, j.scales, j.scale_stride] {
                h.u64(v);
            }
        }
    }
    h.u64(routes.len() as u64);
    for r in routes {
        for v in [r.src.process, r.src.device, r.dst.process, r.dst.device] {
            h.u64(v.into());
        }
        h.u64(r.segments.len() as u64);
        for s in &r.segments {
            for v in [s.src, s.dst, s.len, s.count[0], s.count[1], s.src_stride[0], s.src_stride[1]] {
                h.u64(v);
            }
            h.u64(s.dst_stride[0]);
            h.u64(s.dst_stride[1]);
        }
    }
    h.finish()
}
