//! What a plan costs and what it saved: counts of offers, bytes and ranges at each stage of planning,
//! for the whole plan and per receiver.
//!
//! [`PlanStats`] is defined once, here, for Rust and C alike: the C ABI hands it out as
//! `refit_plan_stats` (cbindgen reads this file), so adding a count means adding a field below and
//! saying in [`PlanStats::add`] how receivers' counts combine (the compiler asks for it).

use crate::segment::Segment;

/// Buckets of the range-size histogram: bucket `i` counts segments whose payload is in
/// `[2^i, 2^(i+1))` bytes (bucket 0 also holds 1-byte segments). C: REFIT_PLAN_SIZE_BUCKETS.
///
/// cbindgen:ignore
pub const SIZE_BUCKETS: usize = 64;

/// Counts of a plan or of one receiver's part of it. Before a call that fills it, C callers set
/// `size` to sizeof(refit_plan_stats). "Ranges" are contiguous runs; "segments" are strided
/// refit_segments (what executors move).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanStats {
    /// sizeof(refit_plan_stats) as the caller knows it (Rust: always the full size).
    pub size: usize,
    /// Offers in all tables (for a receiver: the same, the input is shared).
    pub offers_in: u64,
    /// Offers chosen to serve at least one range (for a receiver: one of its ranges).
    pub offers_kept: u64,
    /// Distinct boxes offered (replica sets).
    pub replica_sets: u64,
    /// Needs planned.
    pub needs: u64,
    /// Bytes the needs ask for, which is also the bytes the plan moves.
    pub needed_bytes: u64,
    /// Contiguous runs if every replica offer overlapping a need were read.
    pub ranges_all_replicas: u64,
    /// Bytes read if every replica offer overlapping a need were read.
    pub bytes_all_replicas: u64,
    /// bytes_all_replicas - needed_bytes: bytes that one owner per replica saves.
    pub duplicate_bytes_dropped: u64,
    /// Contiguous runs with one owner per replica set, before coalescing.
    pub ranges_deduped: u64,
    /// Strided segments with one owner per replica set, before coalescing.
    pub segments_deduped: u64,
    /// Strided segments in the plan (after coalescing, when enabled).
    pub ranges_coalesced: u64,
    /// Contiguous runs the plan's segments stand for.
    pub flat_runs_coalesced: u64,
    /// Bytes whose source is the receiving device.
    pub bytes_local: u64,
    /// Bytes from another device of the same process (NVLink peer copies).
    pub bytes_peer: u64,
    /// Bytes from another process.
    pub bytes_remote: u64,
    /// (source, destination) endpoint pairs.
    pub routes: u64,
    /// Segments by payload: bucket i counts payloads in [2^i, 2^(i+1)) bytes (bucket 0 also 1 byte).
    pub size_histogram: [u64; 64],
    /// Wall time of the build, nanoseconds (a receiver's stats carry the whole build's time).
    pub build_ns: u64,
    /// Quantized needs (refit_table_add_quantized_need) planned; they are not counted in `needs`.
    pub quantized_needs: u64,
    /// Elements the quantized needs quantize to FP8.
    pub quantized_elements: u64,
    /// Source bytes quantized in place, where they are offered in the receiver's process (the
    /// direct path: only the FP8 codes and scales travel).
    pub quantized_direct_bytes: u64,
    /// Source bytes routed into the receivers' staging and quantized there (the staged path; the
    /// routes count them too, as the needs of the staging buffers).
    pub quantized_staged_bytes: u64,
    /// Source bytes quantized in place by the processes that offer them, for a receiver in another
    /// process (the sender path: only the FP8 codes and scales cross between the processes).
    pub quantized_sent_bytes: u64,
}

const _: () = assert!(SIZE_BUCKETS == 64, "size_histogram is written with a literal length for cbindgen");

impl Default for PlanStats {
    fn default() -> PlanStats {
        PlanStats {
            size: std::mem::size_of::<PlanStats>(),
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
            quantized_needs: 0,
            quantized_elements: 0,
            quantized_direct_bytes: 0,
            quantized_staged_bytes: 0,
            quantized_sent_bytes: 0,
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
        self.flat_runs_coalesced = self.flat_runs_coalesced.saturating_add(s.runs());
        self.size_histogram[Self::bucket(bytes)] += 1;
    }

    /// Adds the counts of one receiver's part to a whole plan's. Inputs shared by every receiver,
    /// the offers kept (counted over the whole plan) and time are not added.
    pub(crate) fn add(&mut self, part: &PlanStats) {
        // Every field named, so that a new field does not compile until it is decided here.
        let PlanStats {
            size: _,
            offers_in: _,
            offers_kept: _,
            replica_sets: _,
            needs,
            needed_bytes,
            ranges_all_replicas,
            bytes_all_replicas,
            duplicate_bytes_dropped,
            ranges_deduped,
            segments_deduped,
            ranges_coalesced,
            flat_runs_coalesced,
            bytes_local,
            bytes_peer,
            bytes_remote,
            routes,
            size_histogram,
            build_ns: _,
            quantized_needs: _,
            quantized_elements: _,
            quantized_direct_bytes: _,
            quantized_staged_bytes: _,
            quantized_sent_bytes: _,
        } = part;
        // The quantized counts are added by `quantized::tally`, to receivers and plan alike.
        let sums = [
            (&mut self.needs, needs),
            (&mut self.needed_bytes, needed_bytes),
            (&mut self.ranges_all_replicas, ranges_all_replicas),
            (&mut self.bytes_all_replicas, bytes_all_replicas),
            (&mut self.duplicate_bytes_dropped, duplicate_bytes_dropped),
            (&mut self.ranges_deduped, ranges_deduped),
            (&mut self.segments_deduped, segments_deduped),
            (&mut self.ranges_coalesced, ranges_coalesced),
            (&mut self.flat_runs_coalesced, flat_runs_coalesced),
            (&mut self.bytes_local, bytes_local),
            (&mut self.bytes_peer, bytes_peer),
            (&mut self.bytes_remote, bytes_remote),
            (&mut self.routes, routes),
        ];
        for (total, value) in sums {
            *total = total.saturating_add(*value);
        }
        for (a, b) in self.size_histogram.iter_mut().zip(size_histogram) {
            *a = a.saturating_add(*b);
        }
    }
}
