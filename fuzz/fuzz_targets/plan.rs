//! The planner on tables shaped by arbitrary bytes: small tensors, offers (replicas, overlaps,
//! strides, digests), needs (permutations, strides, shared buffers) and quantized needs (every
//! granularity, target, arithmetic and source type, odd blocks, shared scales, with and without
//! staging) with values that are mostly small and sometimes extreme. Never a panic; a plan that
//! builds moves exactly the needed bytes, each destination byte once, the same with and without
//! coalescing, under every policy; its quantization jobs write every code and scale of every
//! quantized need exactly once per need that names it, on the path each route says.
#![no_main]

#[path = "bytes.rs"]
mod bytes;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use refit::plan::{
    build_with_limits, Endpoint, Limits, Need, Offer, OwnerPolicy, Plan, PlanOptions, QuantNeed, QuantPath, Region,
    SharedAmax, Table, TensorSpec,
};
use refit::quant::{Arithmetic, Fp8, Granularity, Quantization, SourceType};
use refit::Status;

fn table(input: &mut Bytes) -> Table {
    let mut t = Table::default();
    for i in 0..1 + input.byte() % 3 {
        let ndim = (input.byte() % 4) as usize;
        let shape = (0..ndim).map(|_| input.value(6).saturating_add(1)).collect();
        let elem_size = [1, 2, 4, 3][(input.byte() % 4) as usize];
        t.tensors.push(TensorSpec { name: format!("t{i}"), dtype: 0, elem_size, shape });
    }
    let ntensors = t.tensors.len() as u8;
    for _ in 0..input.byte() % 8 {
        let tensor = u32::from(input.byte() % ntensors);
        let n = t.tensors[tensor as usize].shape.len();
        let region = Region { offset: input.list(n, 4), extent: input.list(n, 6) };
        let strides = (input.byte() % 3 == 0).then(|| input.list(n, 40));
        let digest = (input.byte() % 2 == 0).then(|| u64::from(input.byte() % 2));
        let owner = Endpoint { process: u32::from(input.byte() % 3), device: u32::from(input.byte() % 2) };
        let addr = input.value(16).saturating_add(1).saturating_mul(4096);
        t.offers.push(Offer { tensor, owner, addr, region, strides, digest });
    }
    for _ in 0..input.byte() % 8 {
        let tensor = u32::from(input.byte() % ntensors);
        let n = t.tensors[tensor as usize].shape.len();
        let region = Region { offset: input.list(n, 4), extent: input.list(n, 6) };
        let perm = (input.byte() % 3 == 0).then(|| {
            let mut p: Vec<u32> = (0..n as u32).collect();
            p.rotate_left(n.min(1));
            p
        });
        let receiver = Endpoint { process: u32::from(input.byte() % 3), device: u32::from(input.byte() % 2) };
        let addr = input.value(16).saturating_add(1).saturating_mul(4096).saturating_add(input.value(64));
        t.needs.push(Need { tensor, receiver, addr, region, perm, strides: input.list(n, 40) });
    }
    for _ in 0..input.byte() % 4 {
        let q = quant_need(input, &t.tensors);
        t.quant_needs.push(q);
    }
    // Amax keys, mostly on a quantized need's scale (of any table: keys join across tables), some
    // elsewhere, some 0 (refused).
    for _ in 0..input.byte() % 3 {
        let scale = match t.quant_needs.get(usize::from(input.byte() % 4)) {
            Some(q) if input.byte() % 4 != 0 => q.scales,
            _ => input.value(4).saturating_add(0x100).saturating_mul(4096),
        };
        let process = u32::from(input.byte() % 3);
        t.shared_amax.push(SharedAmax { process, scale, key: u64::from(input.byte() % 3) });
    }
    t
}

/// A quantized need of one of `tensors`: mostly row-major codes (last stride 1) over a box, scales
/// in their own page (sometimes another need's: shared), a quantization of every kind.
fn quant_need(input: &mut Bytes, tensors: &[TensorSpec]) -> QuantNeed {
    let tensor = u32::from(input.byte()) % tensors.len() as u32;
    let n = tensors[tensor as usize].shape.len();
    let region = Region { offset: input.list(n, 4), extent: input.list(n, 6) };
    let mut strides = vec![0u64; n];
    let mut step = 1u64;
    for d in (0..n).rev() {
        strides[d] = step;
        step = step.saturating_mul(region.extent[d].max(1));
    }
    if input.byte() % 4 == 0 {
        strides = input.list(n, 40);
    }
    let granularity = match input.byte() % 6 {
        0 => Granularity::Tensor,
        1 => Granularity::Row,
        2 => Granularity::Mx,
        3 => Granularity::Block { rows: 128, cols: 128 },
        4 => Granularity::Block { rows: 1 + input.small(3) as u32, cols: 8 * (1 + input.small(2) as u32) },
        _ => Granularity::Block { rows: input.value(4) as u32, cols: input.value(17) as u32 },
    };
    let arithmetic = [
        Arithmetic::Divide,
        Arithmetic::DeepGemm,
        Arithmetic::VllmChannel,
        Arithmetic::DeepGemmUe8m0,
        Arithmetic::VllmTensor,
    ][usize::from(input.byte() % 5)];
    let target = if input.byte() % 2 == 0 { Fp8::E4m3fn } else { Fp8::E5m2 };
    QuantNeed {
        tensor,
        receiver: Endpoint { process: u32::from(input.byte() % 3), device: u32::from(input.byte() % 2) },
        addr: input.value(16).saturating_add(1).saturating_mul(4096).saturating_add(input.value(64)),
        region,
        strides,
        quantization: Quantization { target, granularity, arithmetic },
        source: [SourceType::Bf16, SourceType::F16, SourceType::F32][usize::from(input.byte() % 3)],
        scales: input.value(4).saturating_add(0x100).saturating_mul(4096).saturating_add(input.value(8).saturating_mul(4)),
        scale_row_stride: input.value(8),
        scale_matrix_stride: input.value(64),
        staging: match input.byte() % 3 {
            0 => 0,
            _ => input.value(16).saturating_add(0x200).saturating_mul(4096).saturating_add(input.value(4).saturating_mul(16)),
        },
    }
}

/// Elements of `region`'s box (1 for a 0-dimensional one).
fn volume(region: &Region) -> u64 {
    region.extent.iter().fold(1u64, |v, &e| v.saturating_mul(e))
}

/// Calls `f` with every index of the box of extents `ext`, last dimension fastest.
fn for_each_index(ext: &[u64], mut f: impl FnMut(&[u64])) {
    if ext.contains(&0) {
        return;
    }
    let mut at = vec![0u64; ext.len()];
    loop {
        f(&at);
        let Some(d) = (0..ext.len()).rev().find(|&d| at[d] + 1 < ext[d]) else { return };
        at[d] += 1;
        at[d + 1..].iter_mut().for_each(|i| *i = 0);
    }
}

/// Byte addresses, by receiver, that the quantized needs of `tables` say their codes and scales
/// take: codes one per element, scales one per scale of each matrix's grid.
fn quant_places(tables: &[Table]) -> (Vec<(Endpoint, u64)>, Vec<(Endpoint, u64)>) {
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for q in tables.iter().flat_map(|t| &t.quant_needs) {
        let n = q.region.extent.len();
        for_each_index(&q.region.extent, |at| {
            let offset = (0..n).fold(0u64, |sum, d| sum + at[d] * q.strides[d]);
            codes.push((q.receiver, q.addr + offset));
        });
        let (rows, cols) = match n {
            0 => (1, 1),
            1 => (1, q.region.extent[0]),
            _ => (q.region.extent[n - 2], q.region.extent[n - 1]),
        };
        let matrices = volume(&q.region) / (rows * cols).max(1);
        let (grid_rows, grid_cols) = q.quantization.scale_grid(rows, cols);
        let size = q.quantization.scale_kind().size();
        if volume(&q.region) == 0 {
            continue;
        }
        for m in 0..matrices {
            for_each_index(&[grid_rows, grid_cols], |g| {
                let index = m * q.scale_matrix_stride + g[0] * q.scale_row_stride + g[1];
                scales.push((q.receiver, q.scales + index * size));
            });
        }
    }
    (codes, scales)
}

/// What the plan's quantization jobs write, as [`quant_places`] lists it, after checking that each
/// route's path agrees with where it runs.
fn quant_writes(plan: &Plan) -> (Vec<(Endpoint, u64)>, Vec<(Endpoint, u64)>) {
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for route in plan.quant_routes() {
        match route.path {
            QuantPath::Direct => assert_eq!(route.runner.process, route.receiver.process, "direct across processes"),
            QuantPath::Sender => assert_ne!(route.runner.process, route.receiver.process, "sent within a process"),
            QuantPath::Staged => assert_eq!(route.runner, route.receiver, "staged elsewhere than the receiver"),
        }
        for job in &route.jobs {
            for_each_index(&[job.rows, job.cols], |at| codes.push((route.receiver, job.dst + at[0] * job.dst_stride + at[1])));
            let (grid_rows, grid_cols) = job.quantization.scale_grid(job.rows, job.cols);
            let size = job.quantization.scale_kind().size();
            for_each_index(&[grid_rows, grid_cols], |g| {
                scales.push((route.receiver, job.scales + (g[0] * job.scale_stride + g[1]) * size));
            });
        }
    }
    (codes, scales)
}

fuzz_target!(|data: &[u8]| {
    let mut input = Bytes(data);
    let tables = vec![table(&mut input), table(&mut input)];
    let limits = Limits {
        max_segments: 1 << 16,
        max_pieces: 1 << 12,
        max_overlap_runs: 1 << 16,
        max_box_tests: 1 << 20,
    };
    // Whether a table is valid never depends on the options; only the segment limit may.
    let mut first: Option<Result<(), Status>> = None;
    for policy in [OwnerPolicy::First, OwnerPolicy::Local, OwnerPolicy::Balanced] {
        for coalesce in [true, false] {
            let result = build_with_limits(&tables, &PlanOptions { policy, coalesce }, &limits);
            let status = result.as_ref().map(|_| ()).map_err(|e| e.status);
            if status != Err(Status::OutOfMemory) {
                assert_eq!(*first.get_or_insert(status), status, "{policy:?} coalesce={coalesce}");
            }
            let Ok(plan) = result else {
                continue;
            };
            check_quantized(&tables, &plan);
            // Expand the plan into its runs when that stays small (one segment may stand for
            // billions of runs), and check every destination byte is written once.
            let runs = plan
                .routes()
                .iter()
                .flat_map(|r| &r.segments)
                .fold(0u64, |acc, s| acc.saturating_add(s.runs()));
            if runs > 1 << 20 || plan.stats().needed_bytes == u64::MAX {
                continue;
            }
            let mut written = Vec::with_capacity(runs as usize);
            for route in plan.routes() {
                for s in &route.segments {
                    s.for_each_run(|_, dst, len| written.push((route.dst, dst, len)));
                }
            }
            let moved: u128 = written.iter().map(|w| u128::from(w.2)).sum();
            assert_eq!(moved, u128::from(plan.stats().needed_bytes));
            written.sort_unstable();
            for pair in written.windows(2) {
                assert!(pair[0].0 != pair[1].0 || pair[0].1 + pair[0].2 <= pair[1].1, "a byte written twice");
            }
        }
    }
});

/// Every code and scale of the quantized needs written once per need naming it (a shared per-tensor
/// scale once per sharing need), nothing else; the plan counts every element quantized.
fn check_quantized(tables: &[Table], plan: &Plan) {
    let elements: u64 = tables.iter().flat_map(|t| &t.quant_needs).map(|q| volume(&q.region)).sum();
    assert_eq!(plan.stats().quantized_elements, elements, "elements quantized");
    if elements > 1 << 16 {
        return;
    }
    let (mut wanted_codes, mut wanted_scales) = quant_places(tables);
    let (mut codes, mut scales) = quant_writes(plan);
    for list in [&mut wanted_codes, &mut wanted_scales, &mut codes, &mut scales] {
        list.sort_unstable();
    }
    assert!(codes == wanted_codes, "codes written are not the needs' codes");
    assert!(scales == wanted_scales, "scales written are not the needs' scales");
    // Jobs sharing an amax key run in one batch: one runner, all sent or none.
    let mut batches: std::collections::HashMap<u64, (Endpoint, bool)> = std::collections::HashMap::new();
    for route in plan.quant_routes() {
        for job in route.jobs.iter().filter(|j| j.amax_key != 0) {
            let batch = (route.runner, route.path == QuantPath::Sender);
            assert_eq!(*batches.entry(job.amax_key).or_insert(batch), batch, "an amax key's jobs in two batches");
        }
    }
}
