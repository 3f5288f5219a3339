//! The planner on a Qwen3-30B-A3B refit at full scale (Megatron EP8 publishers with data-parallel
//! replicas of the dense weights -> vLLM TP2 receivers with fused qkv / gate_up and stacked experts,
//! laid out by the `refit-workloads` development crate): exact bytes, replica deduplication, and
//! coalescing that reaches the range-count targets. Counts only: build time is measured by the planner benchmark.

use refit::plan::{build, Endpoint, OwnerPolicy, PlanOptions};
use refit_workloads::{Packing, Spec, Workload};

const LAYERS: u64 = 48;
const HIDDEN: u64 = 2048;
const HEAD: u64 = 128;
const Q_HEADS: u64 = 32;
const KV_HEADS: u64 = 4;
const EXPERTS: u64 = 128;
const FFN: u64 = 768;
const VOCAB: u64 = 151_936;
const TP: u64 = 2;
const BF16: u64 = 2;
/// Receivers are the ranks after the eight publishers.
const FIRST_RECEIVER: u32 = 8;

/// What one TP2 receiver holds, from the model's dimensions alone (independent of the generator).
fn needed_bytes_per_receiver() -> u64 {
    let dense = 2 * HIDDEN
        + 2 * HEAD
        + EXPERTS * HIDDEN
        + (Q_HEADS * HEAD + 2 * KV_HEADS * HEAD) * HIDDEN / TP
        + HIDDEN * Q_HEADS * HEAD / TP;
    let experts = EXPERTS * 3 * FFN * HIDDEN / TP;
    (2 * VOCAB * HIDDEN / TP + HIDDEN + LAYERS * (dense + experts)) * BF16
}

fn check(layout: Packing, ranges_target: u64) {
    let workload = Workload::generate(&Spec::qwen3_ep8_to_tp2(layout)).unwrap();
    let tables = workload.tables(&workload.fake_bases()).unwrap();
    for policy in [OwnerPolicy::First, OwnerPolicy::Balanced] {
        let plan = build(&tables, &PlanOptions { policy, coalesce: true }).unwrap();
        let s = plan.stats();
        println!(
            "{layout:?} {policy:?}: {} offers, {} needs: all replicas {} ranges / {} bytes, deduped {} ranges, \
             coalesced {} segments ({} runs)",
            s.offers_in,
            s.needs,
            s.ranges_all_replicas,
            s.bytes_all_replicas,
            s.ranges_deduped,
            s.ranges_coalesced,
            s.flat_runs_coalesced,
        );
        for r in 0..TP as u32 {
            let rs = plan.receiver_stats(Endpoint { process: FIRST_RECEIVER + r, device: 0 });
            assert_eq!(rs.needed_bytes, needed_bytes_per_receiver());
            assert_eq!(rs.bytes_remote, rs.needed_bytes, "exactly the needed bytes move");
            assert!(rs.bytes_all_replicas > rs.needed_bytes);
            assert!(
                rs.ranges_coalesced <= ranges_target,
                "receiver {r}: {} segments > {ranges_target}",
                rs.ranges_coalesced
            );
        }
    }
}

#[test]
fn qwen3_separate_allocations_meet_the_range_target() {
    check(Packing::Separate, 13_000);
}

#[test]
fn qwen3_packed_publisher_buffers_meet_the_range_target() {
    check(Packing::Packed, 1_500);
}
