//! The planner on tables shaped by arbitrary bytes: small tensors, offers (replicas, overlaps,
//! strides, digests) and needs (permutations, strides, shared buffers) with values that are mostly
//! small and sometimes extreme. Never a panic; a plan that builds moves exactly the needed bytes,
//! each destination byte once, the same with and without coalescing, under every policy.
#![no_main]

#[path = "bytes.rs"]
mod bytes;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use refit::plan::{
    build_with_limits, Endpoint, Limits, Need, Offer, OwnerPolicy, PlanOptions, Region, Table, TensorSpec,
};
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
    t
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
