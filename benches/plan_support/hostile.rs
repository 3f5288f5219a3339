//! Planning cost on the sizes that were quadratic before (issue 14 item 10) and on overlaps the
//! limits must reject early: the same tables as tests/plan_hostile.rs, timed in a release build.

use refit::plan::{self, Endpoint, Need, Offer, PlanOptions, Region, Table, TableBuilder, TensorSpec};
use std::fmt::Write as _;
use std::time::Instant;

const COUNT: u64 = 40_000;

fn at(process: u32) -> Endpoint {
    Endpoint { process, device: 0 }
}

fn region(offset: &[u64], extent: &[u64]) -> Region {
    Region { offset: offset.to_vec(), extent: extent.to_vec() }
}

fn spec(name: &str, shape: &[u64]) -> TensorSpec {
    TensorSpec { name: name.into(), dtype: 0, elem_size: 2, shape: shape.to_vec() }
}

/// `COUNT` one-element offers of a 1-D tensor at scattered addresses.
fn one_element_offers() -> Table {
    let offers = (0..COUNT)
        .map(|i| Offer {
            tensor: 0,
            owner: at(0),
            addr: 0x100_0000 + 8 * ((i * 7919) % COUNT),
            region: region(&[i], &[1]),
            strides: None,
            digest: None,
        })
        .collect();
    Table {
        tensors: vec![spec("x", &[COUNT])],
        offers,
        needs: Vec::new(),
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    }
}

fn need(element: u64, extent: u64, receiver: u32, addr: u64) -> Need {
    Need {
        tensor: 0,
        receiver: at(receiver),
        addr,
        region: region(&[element], &[extent]),
        perm: None,
        strides: vec![1],
    }
}

/// Even columns of a square tensor offered whole by process 0, every row by process 1 (see
/// tests/plan_hostile.rs): about side^2 / 2 pieces.
fn combs(side: u64) -> Table {
    let mut offers = Vec::new();
    for j in (0..side).step_by(2) {
        offers.push(Offer {
            tensor: 0,
            owner: at(0),
            addr: 0x10_0000 + j * side,
            region: region(&[0, j], &[side, 1]),
            strides: Some(vec![1, side]),
            digest: None,
        });
    }
    for i in 0..side {
        offers.push(Offer {
            tensor: 0,
            owner: at(1),
            addr: 0x8000_0000 + i * side,
            region: region(&[i, 0], &[1, side]),
            strides: None,
            digest: None,
        });
    }
    Table {
        tensors: vec![spec("w", &[side, side])],
        offers,
        needs: Vec::new(),
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    }
}

/// Times `f` `samples` times; returns the minimum in milliseconds and the last result.
fn best_of<T>(samples: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..samples.max(1) {
        let started = Instant::now();
        last = Some(f());
        best = best.min(started.elapsed().as_secs_f64() * 1e3);
    }
    (best, last.expect("at least one sample"))
}

/// The table of timings and its JSON.
pub fn run(samples: usize, out: &mut String) -> String {
    let _ = writeln!(out, "\n### Hostile sizes (issue 14 item 10): build ms, minimum of {samples}\n");
    let _ = writeln!(out, "| case | outcome | ms | before the fix (issue 14) |");
    let _ = writeln!(out, "| --- | --- | ---: | --- |");
    let mut rows = Vec::new();
    let mut row = |out: &mut String, name: &str, outcome: String, ms: f64, before: &str| {
        let _ = writeln!(out, "| {name} | {outcome} | {ms:.1} | {before} |");
        rows.push(format!("{{\"case\": \"{name}\", \"outcome\": \"{outcome}\", \"ms\": {ms:.3}}}"));
    };
    let options = PlanOptions::default();

    let mut one = one_element_offers();
    one.needs.push(need(0, COUNT, 1, 0x900_0000));
    let (ms, plan) = best_of(samples, || plan::build(std::slice::from_ref(&one), &options));
    let outcome = plan.map_or_else(|e| e.to_string(), |p| format!("{} segments", p.stats().ranges_coalesced));
    row(out, "40,000 one-element offers, one need", outcome, ms, "9.7 s");

    let mut many = one_element_offers();
    many.needs =
        (0..COUNT).map(|i| need((i * 104_729) % COUNT, 1, 1 + (i % 3) as u32, 0x900_0000 + 2 * i)).collect();
    let (ms, plan) = best_of(samples, || plan::build(std::slice::from_ref(&many), &options));
    let outcome = plan.map_or_else(|e| e.to_string(), |p| format!("{} segments", p.stats().ranges_coalesced));
    row(out, "40,000 one-element offers x 40,000 needs", outcome, ms, "35 s");

    let names: Vec<String> =
        (0..80_000).map(|i| format!("model.layers.{}.mlp.experts.{}.w", i / 384, i % 384)).collect();
    let (ms, count) = best_of(samples, || {
        let mut builder = TableBuilder::new();
        for name in &names {
            builder.add_tensor(spec(name, &[4, 4])).expect("adds");
        }
        builder.into_table().tensors.len()
    });
    row(out, "80,000 tensors added by name", format!("{count} tensors"), ms, "11.7 s");

    let big = combs(2048);
    let (ms, plan) = best_of(samples, || plan::build(std::slice::from_ref(&big), &options));
    let outcome = plan.map_or_else(|e| e.to_string(), |_| "planned".into());
    row(
        out,
        "2,048 columns x 2,048 rows overlapping (2 million pieces)",
        outcome,
        ms,
        "UNSUPPORTED after 11 s",
    );
    format!("[{}]", rows.join(", "))
}
