//! What a plan costs and what it saved: counts of offers, bytes and ranges at each stage of planning,
//! for the whole plan and per receiver.

use crate::segment::Segment;

/// Buckets of the range-size histogram: bucket `i` counts segments whose payload is in
/// `[2^i, 2^(i+1))` bytes (bucket 0 also holds 1-byte segments).
///
/// cbindgen:ignore
pub const SIZE_BUCKETS: usize = 64;

/// Counts for a whole plan or one receiver's part of it. "Ranges" are contiguous runs unless named
/// segments (strided boxes of up to three levels, what executors move).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanStats {
    /// Offers in all tables (for a receiver: the same, the input is shared).
    pub offers_in: u64,
    /// Offers chosen as the owner of at least one range (for a receiver: of one of its ranges).
    pub offers_kept: u64,
    /// Distinct boxes offered (replica sets).
    pub replica_sets: u64,
    /// Needs planned.
    pub needs: u64,
    /// Bytes the needs ask for; also the bytes the plan moves.
    pub needed_bytes: u64,
    /// Contiguous runs if every replica offer overlapping a need were read (the seed's "before").
    pub ranges_all_replicas: u64,
    /// Bytes read if every replica offer overlapping a need were read.
    pub bytes_all_replicas: u64,
    /// `bytes_all_replicas - needed_bytes`: bytes that one owner per replica saves.
    pub duplicate_bytes_dropped: u64,
    /// Contiguous runs with one owner per replica set, before coalescing.
    pub ranges_deduped: u64,
    /// Strided segments with one owner per replica set, before coalescing.
    pub segments_deduped: u64,
    /// Strided segments in the plan (after coalescing, when enabled).
    pub ranges_coalesced: u64,
    /// Contiguous runs the plan's segments stand for.
    pub flat_runs_coalesced: u64,
    /// Bytes whose source is on the receiving device.
    pub bytes_local: u64,
    /// Bytes from another device of the same process (NVLink peer copies).
    pub bytes_peer: u64,
    /// Bytes from another process.
    pub bytes_remote: u64,
    /// Routes ((source, destination) endpoint pairs) in the plan.
    pub routes: u64,
    /// Segments by payload size, power-of-two buckets (see [`SIZE_BUCKETS`]).
    pub size_histogram: [u64; SIZE_BUCKETS],
    /// Wall time of `build`, nanoseconds (a receiver's stats carry the whole build's time).
    pub build_ns: u64,
}

impl Default for PlanStats {
    fn default() -> PlanStats {
        PlanStats {
            offers_in: 0,
            offers_kept: 0,
            replica_sets: 0,
            needs: 0,
            needed_bytes: 0,
            ranges_all_replicas: 0,
            bytes_all_replicas: 0,
            duplicate_bytes_dropped: 0,
            ranges_deduped: 0,
            segments_deduped: 0,
            ranges_coalesced: 0,
            flat_runs_coalesced: 0,
            bytes_local: 0,
            bytes_peer: 0,
            bytes_remote: 0,
            routes: 0,
            size_histogram: [0; SIZE_BUCKETS],
            build_ns: 0,
        }
    }
}

impl PlanStats {
    /// The histogram bucket of a segment of `bytes` payload.
    pub fn bucket(bytes: u64) -> usize {
        (63 - bytes.max(1).leading_zeros()) as usize
    }

    /// Counts one final segment.
    pub(crate) fn add_segment(&mut self, s: &Segment) {
        let bytes = s.bytes().unwrap_or(u64::MAX);
        self.ranges_coalesced += 1;
        self.flat_runs_coalesced += s.runs();
        self.size_histogram[Self::bucket(bytes)] += 1;
    }

    /// Adds the additive counts of `other` (everything but inputs and time).
    pub(crate) fn add(&mut self, other: &PlanStats) {
        self.needs += other.needs;
        self.needed_bytes += other.needed_bytes;
        self.ranges_all_replicas += other.ranges_all_replicas;
        self.bytes_all_replicas += other.bytes_all_replicas;
        self.duplicate_bytes_dropped += other.duplicate_bytes_dropped;
        self.ranges_deduped += other.ranges_deduped;
        self.segments_deduped += other.segments_deduped;
        self.ranges_coalesced += other.ranges_coalesced;
        self.flat_runs_coalesced += other.flat_runs_coalesced;
        self.bytes_local += other.bytes_local;
        self.bytes_peer += other.bytes_peer;
        self.bytes_remote += other.bytes_remote;
        self.routes += other.routes;
        for (a, b) in self.size_histogram.iter_mut().zip(&other.size_histogram) {
            *a += b;
        }
    }
}
