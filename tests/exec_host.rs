//! The reshard executor on the host backend: a colocated EP2 -> TP2 refit of a small MoE model over
//! two simulated devices, with both arms, in an implicit scope and inside a caller's scope. Every
//! needed element of every receiver is compared with the value of the tensor element it stands for.

use refit::exec::{Arm, Executor};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::plan::{self, PlanOptions};
use refit_workloads::{element_value, Model, Moe, Packing, Role, Spec, Workload};

const POISON: u8 = 0xa5;

/// Small enough to run in CI, large enough that every kind of slice (column splits, row splits,
/// whole experts, the vocabulary split) spans many strided rows.
fn small_moe() -> Model {
    Model {
        name: "small-moe".into(),
        layers: 2,
        hidden: 64,
        heads: 8,
        kv_heads: 4,
        head_dim: 8,
        qk_norm: true,
        ffn: 0,
        moe: Some(Moe { experts: 4, ffn: 48 }),
        vocab: 101,
        elem_size: 2,
        dtype: 2,
    }
}

fn host_group() -> Group {
    Group::new(&[0, 1], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

/// Every receiver element that differs from the value it stands for, as "buffer: element".
fn wrong_elements(w: &Workload, memory: &[Vec<u8>]) -> Vec<String> {
    let mut wrong = Vec::new();
    for n in &w.needs {
        let bytes = &memory[n.buffer as usize];
        w.for_each_element(n, |at, global| {
            let at = at as usize;
            let got = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
            if u64::from(got) != element_value(n.tensor, global) & 0xffff {
                wrong.push(format!("{}: element {global}", w.buffers[n.buffer as usize].name));
            }
        });
    }
    wrong
}

fn refit_with(layout: Packing, arm: Arm, scoped: bool) -> Vec<Vec<u8>> {
    let spec = Spec::qwen3_colocated_ep2_tp2(layout).with_model(small_moe());
    let w = Workload::generate(&spec).unwrap();
    let mut memory: Vec<Vec<u8>> = w.buffers.iter().map(|b| vec![POISON; b.bytes as usize]).collect();
    w.fill_offers(&mut memory.iter_mut().map(|m| m.as_mut_slice()).collect::<Vec<_>>());
    let bases: Vec<u64> = memory.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
    let plan = plan::build(&w.tables(&bases).unwrap(), &PlanOptions::default()).unwrap();
    assert!(plan.stats().bytes_peer > 0 && plan.stats().bytes_local > 0, "both routes exercised");
    let group = host_group();
    let mut executor = Executor::new();
    for step in 0..3 {
        // Poison the receivers again so that every step must install every byte.
        for (b, buffer) in w.buffers.iter().enumerate() {
            if buffer.role == Role::Receiver {
                memory[b].fill(POISON);
            }
        }
        if scoped {
            group.enter(None).unwrap();
        }
        // SAFETY: every address in the plan lies in `memory`, alive until the scope's exit.
        let times = unsafe { executor.execute(&group, &plan, 0, arm) }.unwrap();
        assert_eq!(times.cached, step > 0, "descriptors are built once and reused");
        if scoped {
            group.exit(ExitMode::Sync).unwrap();
        }
        let wrong = wrong_elements(&w, &memory);
        assert!(
            wrong.is_empty(),
            "{layout:?} {arm:?} step {step}: {} wrong, first {}",
            wrong.len(),
            wrong[0]
        );
    }
    memory
}

#[test]
fn both_arms_install_every_element_in_both_publisher_layouts() {
    for layout in [Packing::Separate, Packing::Packed] {
        let batched = refit_with(layout, Arm::Batched, false);
        let per_run = refit_with(layout, Arm::PerRun, true);
        // Receivers hold identical bytes (publisher buffers too: nothing writes them).
        assert!(batched == per_run, "{layout:?}: the arms installed different bytes");
    }
}
