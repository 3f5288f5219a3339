//! The Python layout rules (python/refit/integrations) and the Rust generator (workloads/src) describe
//! the same Megatron and vLLM parameters: for small Qwen3-MoE and Llama shapes, every parameter's name,
//! size and pieces (tensor, byte offset, box) from `Megatron::params` / `Vllm::params` are printed as
//! JSON lines and compared with `megatron_layouts` / `vllm_layouts` by python/tests/compare_workloads.py.
//! The shapes keep to what both cover: the vocabulary splits evenly (both sides pad it as Megatron and
//! vLLM do, so an even split checks the common case), query groups split over TP, expert TP 1.

mod cdylib;

use refit::plan::Endpoint;
use refit_workloads::{CheckpointTensors, Megatron, Model, Moe, Param, Vllm};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn model(moe: bool) -> Model {
    let mut m = Model::qwen3_30b_a3b().with_layers(2);
    m.hidden = 16;
    m.heads = 4;
    m.kv_heads = 2;
    m.head_dim = 4;
    m.vocab = 512;
    if moe {
        m.moe = Some(Moe { experts: 4, ffn: 8 });
    } else {
        m.name = "llama".into();
        m.qk_norm = false;
        m.moe = None;
        m.ffn = 24;
    }
    m
}

fn endpoints(n: u32) -> Vec<Endpoint> {
    (0..n).map(|process| Endpoint { process, device: 0 }).collect()
}

fn json_line(side: &str, case: &str, catalog: &CheckpointTensors, m: &Model, p: &Param) -> String {
    let pieces: Vec<String> = p
        .pieces
        .iter()
        .map(|piece| {
            format!(
                "[\"{}\",{},{:?},{:?}]",
                catalog.tensors[piece.tensor as usize].name,
                piece.offset,
                piece.region.offset,
                piece.region.extent
            )
        })
        .collect();
    format!(
        "{{\"case\":\"{case}\",\"side\":\"{side}\",\"rank\":{},\"name\":\"{}\",\"bytes\":{},\"elem_size\":{},\"pieces\":[{}]}}",
        p.endpoint.process,
        p.name,
        p.bytes,
        m.elem_size,
        pieces.join(",")
    )
}

#[test]
fn python_layouts_match_the_rust_generator() {
    let lib = cdylib::librefit();
    let mut lines = Vec::new();
    // (case, model, Megatron ranks, tp, ep, grouped experts, vLLM TP size); the Python side rebuilds
    // the same ranks from the case name.
    let cases = [("moe_tp1_ep4_grouped", true, 4, 1, 4, true, 2), ("moe_tp2_ep2", true, 4, 2, 2, false, 2)];
    let dense = [("dense_tp2_dp2", false, 4, 2, 1, true, 2), ("dense_tp1", false, 1, 1, 1, true, 1)];
    for (case, moe, ranks, tp, ep, grouped, vllm_tp) in cases.into_iter().chain(dense) {
        let m = model(moe);
        let catalog = CheckpointTensors::new(&m);
        let publishers = Megatron { endpoints: endpoints(ranks), tp, ep, grouped_experts: grouped };
        for p in publishers.params(&m, &catalog).expect("valid Megatron spec") {
            lines.push(json_line("megatron", case, &catalog, &m, &p));
        }
        let receivers = Vllm { endpoints: endpoints(vllm_tp) };
        for p in receivers.params(&m, &catalog).expect("valid vLLM spec") {
            lines.push(json_line("vllm", case, &catalog, &m, &p));
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new("python3")
        .arg(root.join("python/tests/compare_workloads.py"))
        .env("REFIT_LIBRARY", &lib)
        .env("PYTHONPATH", root.join("python"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child.stdin.take().unwrap().write_all(lines.join("\n").as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains(&format!("{} parameters match", lines.len())), "{stdout}");
}

/// The demo's receiver tables (examples/demo.rs: Qwen3-30B-A3B at full width, one layer as on a host
/// without a GPU, vLLM TP 2) as JSON lines: checked here for covering every parameter byte of each
/// rank once per checkpoint element, and written to $REFIT_DEMO_TABLES when set, where the
/// real-framework suite (python/tests/frameworks/test_demo_tables.py) compares them with what the
/// recorder gives from vLLM 0.33's own model class and loader for the same shapes.
#[test]
fn demo_receiver_tables() {
    let m = Model::qwen3_30b_a3b().with_layers(1);
    let catalog = CheckpointTensors::new(&m);
    let receivers = Vllm { endpoints: endpoints(2) };
    let params = receivers.params(&m, &catalog).expect("the demo's vLLM spec is valid");
    let mut lines = Vec::new();
    for p in &params {
        let covered: u64 = p
            .pieces
            .iter()
            .map(|piece| piece.region.extent.iter().product::<u64>() * u64::from(m.elem_size))
            .sum();
        // The demo's vocabulary splits evenly over TP 2 without padding: every byte is covered once.
        assert_eq!(covered, p.bytes, "{} on rank {}", p.name, p.endpoint.process);
        lines.push(json_line("vllm", "demo", &catalog, &m, p));
    }
    let checkpoint_bytes: u64 =
        catalog.tensors.iter().map(|t| t.shape.iter().product::<u64>() * u64::from(m.elem_size)).sum();
    let received: u64 = params.iter().map(|p| p.bytes).sum();
    assert!(
        received >= checkpoint_bytes,
        "{received} bytes received for a {checkpoint_bytes}-byte checkpoint"
    );
    if let Some(path) = std::env::var_os("REFIT_DEMO_TABLES") {
        std::fs::write(path, lines.join("\n")).expect("REFIT_DEMO_TABLES is writable");
    }
}
