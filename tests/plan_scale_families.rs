//! The planner on full-size refits of latent-attention MoE models, laid out by the `refit-workloads`
//! development crate: DeepSeek-V3 from Megatron TP2 x EP8 to vLLM TP8, and Kimi-K2 from Megatron
//! TP8 x EP16 x PP4 (64 ranks) to vLLM TP8 with expert parallelism. Exact bytes per receiver against
//! the models' dimensions, replica deduplication, and segment counts. Counts only: build time is
//! the planner benchmark's to measure.

use refit::plan::{build, OwnerPolicy, PlanOptions};
use refit_workloads::{Arch, ArchSpec, Attention, Packing, Workload};

const BF16: u64 = 2;
const F32: u64 = 4;

/// What one vLLM TP rank needs of `arch`, from its dimensions alone: the latent attention's
/// down-projections and norms whole, its up-projections and `o_proj` split, dense and shared-expert
/// MLPs split, the router and its FP32 bias whole, the vocabulary split (both models' vocabularies
/// are multiples of 64 * tp), and the routed experts either split over TP or `experts / tp` whole.
fn needed_bytes_per_receiver(arch: &Arch, tp: u64, expert_parallel: bool) -> u64 {
    let Attention::Mla(m) = arch.attention else { unreachable!("latent attention") };
    let moe = arch.moe.expect("a MoE model");
    let (h, q_lora) = (arch.hidden, m.q_lora_rank.expect("compressed queries"));
    let whole = (q_lora + m.kv_lora_rank + m.qk_rope_head_dim) * h + q_lora + m.kv_lora_rank + 2 * h;
    let split = m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * q_lora
        + m.heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        + h * m.heads * m.v_head_dim;
    let attention = whole + split / tp;
    let dense = 3 * arch.ffn * h / tp;
    let experts =
        if expert_parallel { moe.experts / tp * 3 * moe.ffn * h } else { moe.experts * 3 * moe.ffn * h / tp };
    let moe_layer = moe.experts * h + 3 * moe.shared * moe.ffn * h / tp + experts;
    let moe_layers = arch.layers - moe.dense_layers;
    BF16 * (arch.layers * attention
        + moe.dense_layers * dense
        + moe_layers * moe_layer
        + 2 * arch.vocab * h / tp
        + h)
        + F32 * moe_layers * moe.experts
}

fn check(spec: &ArchSpec, policy: OwnerPolicy, segments_target: u64) {
    let w = Workload::generate(spec).unwrap();
    let tables = w.tables(&w.fake_bases()).unwrap();
    let plan = build(&tables, &PlanOptions { policy, coalesce: true }).unwrap();
    let s = plan.stats();
    println!(
        "{} {policy:?}: {} offers, {} needs: all replicas {} bytes, deduped {} ranges, coalesced {} segments",
        spec.model.name, s.offers_in, s.needs, s.bytes_all_replicas, s.ranges_deduped, s.ranges_coalesced,
    );
    let tp = spec.receivers.tp;
    let expected = needed_bytes_per_receiver(&spec.model, tp, spec.receivers.expert_parallel.is_some());
    assert_eq!(w.need_bytes().len() as u64, tp);
    for receiver in w.need_bytes().keys() {
        let rs = plan.receiver_stats(*receiver);
        assert_eq!(rs.needed_bytes, expected, "{receiver:?}");
        assert_eq!(rs.bytes_remote, rs.needed_bytes, "exactly the needed bytes move");
        assert!(rs.bytes_all_replicas > rs.needed_bytes, "replicated offers are deduplicated");
        assert!(
            rs.ranges_coalesced <= segments_target,
            "{receiver:?}: {} segments > {segments_target}",
            rs.ranges_coalesced
        );
    }
}

#[test]
fn deepseek_v3_tp2_ep8_to_tp8() {
    // About 890 segments per receiver measured with separate publisher allocations, 1,660 with
    // packed ones (whose reverse order puts consecutive layers at descending addresses).
    check(&ArchSpec::deepseek_v3_tp2_ep8_to_tp8(Packing::Packed), OwnerPolicy::Local, 1_900);
}

#[test]
fn kimi_k2_pp4_to_tp8_with_expert_parallelism() {
    // About 1,040 segments per receiver measured.
    check(&ArchSpec::kimi_k2_pp4_to_tp8_ep(Packing::Packed), OwnerPolicy::Balanced, 1_200);
}
