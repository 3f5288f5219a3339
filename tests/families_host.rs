//! The planner and the executor on the host backend for the model families beyond Qwen3 and Llama
//! (`refit-workloads`' [`Arch`]): DeepSeek-V3-style latent attention with leading dense layers,
//! shared experts and an FP32 router bias, from Megatron tensor-parallel, expert-parallel and
//! pipeline-parallel publishers to vLLM tensor-parallel receivers (with and without expert
//! parallelism), plus tied embeddings and vocabularies vLLM and Megatron pad differently. Every
//! endpoint is a simulated device of one process; every receiver element is compared with the value
//! of the tensor element it stands for (`element_value`, computed independently of the copy).

use refit::exec::{Arm, CommitMode, ExecOptions, Executor};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{self, build_share, wire, Endpoint, Limits, Plan, PlanOptions};
use refit_workloads::{
    devices, element_value, Arch, ArchSpec, Attention, ExpertPlacement, Experts, MegatronRanks, Mla, Model,
    Packing, Role, VllmRanks, Workload,
};

const POISON: u8 = 0xa5;

/// DeepSeek-V3's structure at a size the host copies in milliseconds: 4 layers (the first dense),
/// 4 latent-attention heads with compressed queries, 8 routed and 2 shared experts, a router bias,
/// and a vocabulary of 300 rows (vLLM pads it to 320, Megatron TP2 to 512).
fn tiny_deepseek() -> Arch {
    Arch {
        name: "tiny-deepseek".into(),
        layers: 4,
        hidden: 32,
        attention: Attention::Mla(Mla {
            heads: 4,
            q_lora_rank: Some(24),
            kv_lora_rank: 16,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 4,
            v_head_dim: 8,
        }),
        ffn: 48,
        moe: Some(Experts { experts: 8, ffn: 16, shared: 2, dense_layers: 1, router_bias: true }),
        vocab: 300,
        tied_embeddings: false,
        elem_size: 2,
        dtype: Arch::DTYPE_BF16,
    }
}

/// Megatron publishers on devices `0..ranks`.
fn megatron(ranks: u32, tp: u64, ep: u64, pp: u64) -> MegatronRanks {
    MegatronRanks::new(devices(0, 0, ranks), tp, ep).with_pp(pp)
}

/// vLLM receivers on devices `first..first + ranks`, `ranks / tp` data-parallel replicas.
fn vllm(first: u32, ranks: u32, tp: u64) -> VllmRanks {
    VllmRanks { tp, ..VllmRanks::tp(devices(0, first, ranks)) }
}

/// The workload in host memory: publishers filled, receivers poisoned, and its plan.
struct Refit {
    w: Workload<ArchSpec>,
    memory: Vec<Vec<u8>>,
    plan: Plan,
    devices: Vec<i32>,
}

impl Refit {
    fn new(spec: &ArchSpec) -> Refit {
        let w = Workload::generate(spec).unwrap();
        let mut memory: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![POISON; b.bytes as usize]).collect();
        w.fill_offers(&mut memory.iter_mut().map(|m| m.as_mut_slice()).collect::<Vec<_>>());
        let bases: Vec<u64> = memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
        let plan = plan::build(&w.tables(&bases).unwrap(), &PlanOptions::default()).unwrap();
        let highest = w.buffers.iter().map(|b| b.endpoint.device).max().unwrap();
        Refit { w, memory, plan, devices: (0..=highest as i32).collect() }
    }

    fn group(&self) -> Group {
        Group::new(&self.devices, GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
    }

    fn poison_receivers(&mut self) {
        for (m, b) in self.memory.iter_mut().zip(&self.w.buffers) {
            if b.role == Role::Receiver {
                m.fill(POISON);
            }
        }
    }

    /// Calls `f(need, byte offset in its buffer, global index in its tensor)` for every needed
    /// element, walking each box here rather than through the workload's own walk.
    fn for_each_needed(&self, mut f: impl FnMut(&refit_workloads::Placed, usize, u64)) {
        for n in &self.w.needs {
            let spec = &self.w.catalog.tensors[n.tensor as usize];
            let extent = &n.region.extent;
            for k in 0..extent.iter().product::<u64>() {
                let (mut rest, mut global) = (k, 0);
                for d in 0..extent.len() {
                    let inner: u64 = extent[d + 1..].iter().product();
                    global = global * spec.shape[d] + n.region.offset[d] + rest / inner;
                    rest %= inner;
                }
                f(n, n.offset as usize + k as usize * spec.elem_size as usize, global);
            }
        }
    }

    /// The bytes element `global` of tensor `tensor` must hold.
    fn expected(&self, tensor: u32, global: u64) -> Vec<u8> {
        let es = self.w.catalog.tensors[tensor as usize].elem_size as usize;
        element_value(tensor, global).to_le_bytes()[..es].to_vec()
    }

    /// Every receiver element that differs from the value it stands for, as "buffer: tensor element".
    fn wrong_elements(&self) -> Vec<String> {
        let mut wrong = Vec::new();
        self.for_each_needed(|n, at, global| {
            let want = self.expected(n.tensor, global);
            if self.memory[n.buffer as usize][at..at + want.len()] != want[..] {
                let tensor = &self.w.catalog.tensors[n.tensor as usize].name;
                wrong.push(format!("{}: {tensor} element {global}", self.w.buffers[n.buffer as usize].name));
            }
        });
        wrong
    }

    fn needed_elements(&self) -> usize {
        self.w.needs.iter().map(|n| n.region.extent.iter().product::<u64>() as usize).sum()
    }

    /// Runs the plan with `options` (and commits when staged), then checks every element twice: with
    /// this file's walk and with the workload's check.
    fn run_and_check(&mut self, options: ExecOptions, what: &str) {
        self.poison_receivers();
        let group = self.group();
        let staged = options.commit == CommitMode::Staged;
        let mut executor = Executor::new(&group, &self.plan, 0, options).unwrap();
        // SAFETY: every address in the plan lies in `self.memory`, alive and not moved while the
        // executor runs; the run and commit wait for their copies before returning outside a scope.
        unsafe { executor.run(&group) }.unwrap();
        if staged {
            // SAFETY: as above.
            unsafe { executor.commit(&group) }.unwrap();
        }
        let wrong = self.wrong_elements();
        assert!(wrong.is_empty(), "{what}: {} wrong, first {}", wrong.len(), wrong[0]);
        let views: Vec<&[u8]> = self.memory.iter().map(|m| m.as_slice()).collect();
        assert_eq!(self.w.check_needs(&views), Ok(self.needed_elements() as u64), "{what}");
    }
}

/// Every arm the executor has: batched kernel, copy engine, staged commit with digests verified.
fn every_arm(spec: &ArchSpec, what: &str) {
    let mut refit = Refit::new(spec);
    for (arm, commit, verify) in [
        (Arm::Kernel, CommitMode::Direct, false),
        (Arm::CopyEngine, CommitMode::Direct, false),
        (Arm::Auto, CommitMode::Staged, true),
    ] {
        let options = ExecOptions { arm, commit, verify, ..ExecOptions::default() };
        refit.run_and_check(options, &format!("{what}: {arm:?} {commit:?}"));
    }
}

#[test]
fn deepseek_tp_publishers_to_tp_receivers() {
    // Megatron TP2 x DP2 (every expert on every rank, expert-TP 1) to vLLM TP4.
    every_arm(&ArchSpec::new(tiny_deepseek(), megatron(4, 2, 1, 1), vllm(4, 4, 4)), "TP2 x DP2 -> TP4");
    // Packed publisher buffers (the router bias stays a buffer of its own) to packed receivers.
    let mut packed = ArchSpec::new(tiny_deepseek(), megatron(2, 2, 1, 1), vllm(2, 2, 2));
    packed.publisher_layout = Packing::Packed;
    packed.receiver_layout = Packing::Packed;
    packed.digests = true;
    every_arm(&packed, "packed TP2 -> TP2");
}

#[test]
fn deepseek_ep_publishers_to_tp_receivers() {
    every_arm(&ArchSpec::new(tiny_deepseek(), megatron(4, 1, 4, 1), vllm(4, 2, 2)), "EP4 -> TP2");
    let mut per_expert = ArchSpec::new(tiny_deepseek(), megatron(4, 2, 4, 1), vllm(4, 4, 4));
    per_expert.publishers.grouped_experts = false;
    every_arm(&per_expert, "TP2 x EP4, a weight per expert -> TP4");
}

#[test]
fn deepseek_pipeline_stages_to_tp_receivers() {
    // Two stages of TP2 x EP2 (layers 0-1 and 2-3), then an uneven split (1 + 3 layers).
    every_arm(&ArchSpec::new(tiny_deepseek(), megatron(8, 2, 2, 2), vllm(8, 2, 2)), "PP2 x TP2 x EP2 -> TP2");
    let uneven = MegatronRanks { first_stage_layers: Some(1), ..megatron(4, 2, 1, 2) };
    every_arm(&ArchSpec::new(tiny_deepseek(), uneven, vllm(4, 4, 4)), "PP2 (1 + 3) x TP2 -> TP4");
}

#[test]
fn deepseek_to_expert_parallel_receivers() {
    // vLLM TP2 x DP2 with expert parallelism over all four: two whole experts each.
    let spec = ArchSpec::new(tiny_deepseek(), megatron(4, 2, 2, 1), vllm(4, 4, 2).with_expert_parallel());
    every_arm(&spec, "TP2 x EP2 -> TP2 x DP2, EP4");
    // Colocated: publishers and receivers on the same four devices, experts placed round robin on
    // the receivers, so most come from another device.
    let mut receivers = vllm(0, 4, 4);
    receivers.expert_parallel = Some(ExpertPlacement::RoundRobin);
    let colocated = ArchSpec::new(tiny_deepseek(), megatron(4, 1, 4, 1), receivers);
    let refit = Refit::new(&colocated);
    assert!(refit.plan.stats().bytes_local > 0 && refit.plan.stats().bytes_peer > 0);
    every_arm(&colocated, "colocated EP4 -> TP4 with EP4");
}

#[test]
fn tied_embeddings_and_padded_vocabularies() {
    // Latent attention with queries from the hidden state, tied embeddings, and GPT-2's vocabulary
    // (50,257 rows: Megatron TP2 pads it to 50,432, vLLM TP2 to 50,304): the last Megatron stage's
    // output layer is a second replica of the embedding.
    let mut lite = tiny_deepseek().with_tied_embeddings().with_vocab(50_257);
    if let Attention::Mla(m) = &mut lite.attention {
        m.q_lora_rank = None;
    }
    every_arm(&ArchSpec::new(lite, megatron(4, 2, 1, 2), vllm(4, 2, 2)), "tied, PP2 x TP2 -> TP2");
    // A grouped-query model with tied embeddings (Llama-3.2-1B style) to TP4: 300 rows padded to
    // 320 leave the last rank 60 real rows.
    let gqa = Model {
        name: "tiny-tied".into(),
        layers: 2,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        qk_norm: false,
        ffn: 64,
        moe: None,
        vocab: 300,
        elem_size: 2,
        dtype: 2,
    };
    let spec = ArchSpec::new(Arch::from(&gqa).with_tied_embeddings(), megatron(2, 2, 1, 1), vllm(2, 4, 4));
    every_arm(&spec, "tied GQA TP2 -> TP4");
}

/// The checks read the installed bytes: with nothing run every needed element is wrong, and one
/// flipped receiver byte is one wrong element, named.
#[test]
fn the_checks_fail_on_wrong_bytes() {
    let mut refit = Refit::new(&ArchSpec::new(tiny_deepseek(), megatron(4, 1, 4, 1), vllm(4, 2, 2)));
    refit.poison_receivers();
    // Every element is wrong but those whose value happens to be the poison.
    let mut poison_valued = 0;
    refit.for_each_needed(|n, _, global| {
        poison_valued += usize::from(refit.expected(n.tensor, global).iter().all(|&b| b == POISON))
    });
    assert_eq!(refit.wrong_elements().len() + poison_valued, refit.needed_elements());
    refit.run_and_check(ExecOptions::default(), "EP4 -> TP2");
    let victim = refit
        .w
        .needs
        .iter()
        .find(|n| {
            refit.w.catalog.tensors[n.tensor as usize].name == "model.layers.1.self_attn.kv_b_proj.weight"
        })
        .unwrap()
        .clone();
    refit.memory[victim.buffer as usize][victim.offset as usize + 1] ^= 0x01;
    let wrong = refit.wrong_elements();
    assert_eq!(wrong.len(), 1);
    assert!(
        wrong[0].ends_with(&format!("kv_b_proj.weight element {}", victim.region.offset[0] * 16)),
        "{wrong:?}"
    );
    let views: Vec<&[u8]> = refit.memory.iter().map(|m| m.as_slice()).collect();
    assert!(refit.w.check_needs(&views).unwrap_err().contains("kv_b_proj.weight"));
}

/// Across processes: every publisher and receiver its own process, tables exchanged encoded; each
/// process's share of the plan is exactly the whole plan's routes from or to it.
#[test]
fn each_process_plans_its_share_of_a_deepseek_refit() {
    let publishers = MegatronRanks::new(refit_workloads::endpoints(0, 8), 2, 2).with_pp(2);
    let spec = ArchSpec::new(
        tiny_deepseek(),
        publishers,
        VllmRanks::tp(refit_workloads::endpoints(8, 2)).with_expert_parallel(),
    );
    let w = Workload::generate(&spec).unwrap();
    let tables = w.tables(&w.fake_bases()).unwrap();
    let decoded: Vec<_> = tables.iter().map(|t| wire::decode(&wire::encode(t)).unwrap()).collect();
    let refs: Vec<&_> = decoded.iter().collect();
    let options = PlanOptions::default();
    let whole = plan::build(&tables, &options).unwrap();
    for process in 0..10 {
        let share = build_share(&refs, process, &options, &Limits::default()).unwrap();
        let touches = |e: Endpoint| e.process == process;
        let expected: Vec<_> = whole.routes().iter().filter(|r| touches(r.src) || touches(r.dst)).collect();
        assert_eq!(share.routes().iter().collect::<Vec<_>>(), expected, "process {process}");
        assert_eq!(share.inputs_fingerprint(), whole.inputs_fingerprint());
    }
}
