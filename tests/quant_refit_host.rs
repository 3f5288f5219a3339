//! Quantized needs planned and executed on the host backend: a bf16 tensor offered in shards over two
//! simulated devices, received as FP8 codes and scales. Every code and scale is compared with the
//! reference quantizer run over the whole needed box gathered in one piece, so the plan's cutting of
//! the box into per-source jobs, the staged path, staged commit and the scale placement are all
//! checked against one quantization of each matrix.

#[path = "common/quant_cases.rs"]
mod quant_cases;

use quant_cases::{Aligned, Rng};
use refit::exec::{CommitMode, ExecOptions, Executor};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{
    self, wire, Endpoint, Offer, Plan, PlanOptions, QuantNeed, QuantPath, Region, SharedAmax, Table,
    TensorSpec,
};
use refit::quant::{Arithmetic, Fp8, Granularity, QuantJob, Quantization, SourceType};
use refit::transport::host::HostBackend;
use refit::transport::{Backend, Stream};
use refit::Status;

const SENTINEL: u8 = 0x5a;
/// The tensor: 2 matrices of 40 x 48 bf16.
const SHAPE: [u64; 3] = [2, 40, 48];

fn group() -> Group {
    Group::new(&[0, 1], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

fn bf16(x: f32) -> [u8; 2] {
    ((x.to_bits() >> 16) as u16).to_le_bytes()
}

/// The tensor's elements, row-major: random magnitudes over many binades, a zero block, and an
/// infinity and a NaN in the second matrix.
fn tensor_values(seed: u64) -> Vec<[u8; 2]> {
    let mut rng = Rng::new(seed);
    let count = SHAPE.iter().product::<u64>() as usize;
    let mut values: Vec<[u8; 2]> = (0..count)
        .map(|_| {
            let exponent = (rng.next() % 24) as i32 - 12;
            let mantissa = 1.0 + (rng.next() % 128) as f32 / 128.0;
            let sign = if rng.next() % 2 == 0 { 1.0 } else { -1.0 };
            bf16(sign * mantissa * 2f32.powi(exponent))
        })
        .collect();
    let at = |m: u64, r: u64, c: u64| ((m * SHAPE[1] + r) * SHAPE[2] + c) as usize;
    for r in 0..16 {
        for c in 0..16 {
            values[at(0, r, c)] = bf16(0.0);
        }
    }
    values[at(1, 3, 5)] = bf16(f32::INFINITY);
    values[at(1, 20, 40)] = bf16(f32::NAN);
    values
}

/// A shard of the tensor in its own buffer: `lo`/`ext` of the global shape, row-major.
struct Shard {
    lo: [u64; 3],
    ext: [u64; 3],
    memory: Aligned,
}

impl Shard {
    fn new(values: &[[u8; 2]], lo: [u64; 3], ext: [u64; 3]) -> Shard {
        let mut memory = Aligned::new((ext.iter().product::<u64>() * 2) as usize, 0);
        let mut i = 0;
        for m in lo[0]..lo[0] + ext[0] {
            for r in lo[1]..lo[1] + ext[1] {
                for c in lo[2]..lo[2] + ext[2] {
                    let v = values[((m * SHAPE[1] + r) * SHAPE[2] + c) as usize];
                    memory.bytes_mut()[i..i + 2].copy_from_slice(&v);
                    i += 2;
                }
            }
        }
        Shard { lo, ext, memory }
    }
}

/// What one quantized need receives: codes, scales and staging, each with its layout.
struct Received {
    lo: [u64; 3],
    ext: [u64; 3],
    quantization: Quantization,
    codes: Aligned,
    /// Code row pitch (bytes), a multiple of 16 above the columns.
    pitch: u64,
    scales: Aligned,
    grid: (u64, u64),
    staging: Option<Aligned>,
}

impl Received {
    fn new(lo: [u64; 3], ext: [u64; 3], quantization: Quantization, staging: bool) -> Received {
        let pitch = ext[2].next_multiple_of(16) + 16;
        let grid = quantization.scale_grid(ext[1], ext[2]);
        let scale_size = quantization.scale_kind().size();
        Received {
            lo,
            ext,
            quantization,
            codes: Aligned::new((ext[0] * ext[1] * pitch) as usize, SENTINEL),
            pitch,
            scales: Aligned::new((ext[0] * grid.0 * grid.1 * scale_size) as usize, SENTINEL),
            grid,
            staging: staging.then(|| Aligned::new((ext.iter().product::<u64>() * 2) as usize, SENTINEL)),
        }
    }

    fn need(&self, tensor: u32, receiver: Endpoint) -> QuantNeed {
        QuantNeed {
            tensor,
            receiver,
            addr: self.codes.addr(),
            region: Region { offset: self.lo.to_vec(), extent: self.ext.to_vec() },
            strides: vec![self.ext[1] * self.pitch, self.pitch, 1],
            quantization: self.quantization,
            source: SourceType::Bf16,
            scales: self.scales.addr(),
            scale_row_stride: self.grid.1,
            scale_matrix_stride: self.grid.0 * self.grid.1,
            staging: self.staging.as_ref().map_or(0, Aligned::addr),
        }
    }

    /// The reference: each matrix of the box gathered in one buffer and quantized by one job.
    fn expected(&self, values: &[[u8; 2]]) -> (Vec<u8>, Vec<u8>) {
        let whole = Shard::new(values, self.lo, self.ext);
        let mut codes = Aligned::new(self.codes.bytes().len(), SENTINEL);
        let mut scales = Aligned::new(self.scales.bytes().len(), SENTINEL);
        let scale_size = self.quantization.scale_kind().size();
        let jobs: Vec<QuantJob> = (0..self.ext[0])
            .map(|m| QuantJob {
                quantization: self.quantization,
                source: SourceType::Bf16,
                src: whole.memory.addr() + m * self.ext[1] * self.ext[2] * 2,
                rows: self.ext[1],
                cols: self.ext[2],
                src_stride: self.ext[2],
                dst: codes.addr() + m * self.ext[1] * self.pitch,
                dst_stride: self.pitch,
                scales: scales.addr() + m * self.grid.0 * self.grid.1 * scale_size,
                scale_stride: self.grid.1,
                amax_key: 0,
            })
            .collect();
        let backend = HostBackend::new(1).unwrap();
        // SAFETY: the buffers above outlive the call, which completes on return.
        unsafe { backend.quantize_batch(0, Stream::NULL, &jobs) }.unwrap();
        let _ = (&mut codes, &mut scales);
        (codes.bytes().to_vec(), scales.bytes().to_vec())
    }

    /// "codes" / "scales" for each output differing from the reference, with the first offset.
    fn differences(&self, values: &[[u8; 2]]) -> Vec<String> {
        let (codes, scales) = self.expected(values);
        let mut out = Vec::new();
        for (what, got, want) in
            [("codes", self.codes.bytes(), &codes), ("scales", self.scales.bytes(), &scales)]
        {
            if let Some(at) = got.iter().zip(want.iter()).position(|(a, b)| a != b) {
                out.push(format!(
                    "{what} differ first at byte {at}: {:#04x} instead of {:#04x}",
                    got[at], want[at]
                ));
            }
        }
        out
    }
}

fn spec() -> TensorSpec {
    TensorSpec { name: "w".into(), dtype: 7, elem_size: 2, shape: SHAPE.to_vec() }
}

fn offer(shard: &Shard, owner: Endpoint) -> Offer {
    Offer {
        tensor: 0,
        owner,
        addr: shard.memory.addr(),
        region: Region { offset: shard.lo.to_vec(), extent: shard.ext.to_vec() },
        strides: None,
        digest: None,
    }
}

const DEV0: Endpoint = Endpoint { process: 0, device: 0 };
const DEV1: Endpoint = Endpoint { process: 0, device: 1 };

/// Two shards of the whole tensor cut along `dim` at `at`, on devices 0 and 1.
fn halves(values: &[[u8; 2]], dim: usize, at: u64) -> Vec<(Shard, Endpoint)> {
    let (mut lo, mut ext) = ([0; 3], SHAPE);
    ext[dim] = at;
    let first = Shard::new(values, lo, ext);
    lo[dim] = at;
    ext[dim] = SHAPE[dim] - at;
    vec![(first, DEV0), (Shard::new(values, lo, ext), DEV1)]
}

fn table(shards: &[(Shard, Endpoint)], needs: &[(&Received, Endpoint)]) -> Table {
    Table {
        tensors: vec![spec()],
        offers: shards.iter().map(|(s, owner)| offer(s, *owner)).collect(),
        needs: vec![],
        quant_needs: needs.iter().map(|(r, e)| r.need(0, *e)).collect(),
        shared_amax: vec![],
    }
}

fn build(table: &Table) -> refit::Result<Plan> {
    plan::build(std::slice::from_ref(table), &PlanOptions::default())
}

/// One step of `plan` by a fresh executor of process 0: the run, then the commit when staged.
fn step(plan: &Plan, commit: CommitMode, verify: bool) {
    let group = group();
    let options = ExecOptions { commit, verify, ..ExecOptions::default() };
    let mut executor = Executor::new(&group, plan, 0, options).unwrap();
    // SAFETY: every address of the plan is a live buffer of the caller's.
    unsafe { executor.run(&group) }.unwrap();
    if commit == CommitMode::Staged {
        // SAFETY: as above.
        unsafe { executor.commit(&group) }.unwrap();
    }
}

fn execute(plan: &Plan, commit: CommitMode) -> refit::Result<()> {
    let group = group();
    let mut executor = Executor::new(&group, plan, 0, ExecOptions { commit, ..ExecOptions::default() })?;
    // SAFETY: every address of the plan is a live buffer of this test.
    let stats = unsafe { executor.run(&group) }?;
    // Codes and scales written into the live buffers: one byte per element and each grid's scales.
    let outputs: u64 = plan
        .quant_routes()
        .iter()
        .flat_map(|r| &r.jobs)
        .map(|j| {
            let (rows, cols) = j.quantization.scale_grid(j.rows, j.cols);
            j.elements() + rows * cols * j.quantization.scale_kind().size()
        })
        .sum();
    // The bf16 bytes routed into the needs' staging are installed bytes too (a need's like any).
    let staged = plan.stats().needed_bytes;
    if commit == CommitMode::Staged {
        // SAFETY: as above.
        let committed = unsafe { executor.commit(&group) }?;
        assert_eq!(
            stats.quantized_elements + committed.quantized_elements,
            plan.stats().quantized_elements,
            "every element is quantized once, by the run or the commit"
        );
        assert_eq!(stats.installed_bytes + committed.installed_bytes, outputs + staged);
    } else {
        assert_eq!(stats.quantized_elements, plan.stats().quantized_elements);
        assert_eq!(stats.installed_bytes, outputs + staged);
    }
    Ok(())
}

const BLOCK16: Granularity = Granularity::Block { rows: 16, cols: 16 };

fn quantizations() -> Vec<Quantization> {
    let mut out = Vec::new();
    for target in [Fp8::E4m3fn, Fp8::E5m2] {
        for granularity in [
            Granularity::Tensor,
            Granularity::Row,
            BLOCK16,
            Granularity::Block { rows: 128, cols: 128 },
            Granularity::Mx,
        ] {
            out.push(Quantization::new(target, granularity));
        }
    }
    out
}

/// Whether shards cut along `dim` at `at` keep every block of `q` whole (relative to row 0 / col 0).
fn keeps_blocks(q: &Quantization, dim: usize, at: u64) -> bool {
    let (block_rows, block_cols) = q.block_shape(SHAPE[1], SHAPE[2]);
    match dim {
        0 => true,
        1 => at % block_rows == 0,
        _ => at % block_cols == 0,
    }
}

#[test]
fn every_granularity_and_cut_matches_the_reference_direct_and_staged() {
    let values = tensor_values(11);
    let mut paths = std::collections::BTreeSet::new();
    for q in quantizations() {
        for (dim, at) in [(0, 1), (1, 32), (1, 20), (2, 32), (2, 8)] {
            for commit in [CommitMode::Direct, CommitMode::Staged] {
                let shards = halves(&values, dim, at);
                let mut received = Received::new([0; 3], SHAPE, q, true);
                let plan = build(&table(&shards, &[(&received, DEV0)])).unwrap();
                let direct = keeps_blocks(&q, dim, at);
                let want = if direct { QuantPath::Direct } else { QuantPath::Staged };
                assert!(plan.quant_routes().iter().all(|r| r.path == want), "{q:?} cut {dim}@{at}");
                paths.insert(format!("{want:?}"));
                let stats = plan.stats();
                let bytes = SHAPE.iter().product::<u64>() * 2;
                assert_eq!(stats.quantized_needs, 1);
                assert_eq!(stats.quantized_elements, bytes / 2);
                assert_eq!(
                    (stats.quantized_direct_bytes, stats.quantized_staged_bytes),
                    if direct { (bytes, 0) } else { (0, bytes) }
                );
                if direct {
                    // Each device quantizes its own shard, in place.
                    let runners: Vec<Endpoint> = plan.quant_routes().iter().map(|r| r.runner).collect();
                    assert_eq!(runners, vec![DEV0, DEV1]);
                }
                execute(&plan, commit).unwrap();
                let wrong = received.differences(&values);
                assert!(wrong.is_empty(), "{q:?} cut {dim}@{at} {commit:?}: {wrong:?}");
                received.codes.bytes_mut().fill(SENTINEL);
            }
        }
    }
    assert_eq!(paths.len(), 2, "both paths were taken");
}

#[test]
fn a_box_inside_the_tensor_counts_blocks_from_its_own_corner() {
    // Matrix 1, rows 16..40, columns 16..48; shards cut at row 32 = row 16 of the box, so 16 x 16
    // blocks stay whole and the box is quantized in place, by both devices.
    let values = tensor_values(12);
    let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
    let shards = halves(&values, 1, 32);
    let received = Received::new([1, 16, 16], [1, 24, 32], q, false);
    let plan = build(&table(&shards, &[(&received, DEV1)])).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Direct));
    assert_eq!(plan.quant_routes().len(), 2);
    execute(&plan, CommitMode::Direct).unwrap();
    assert!(received.differences(&values).is_empty(), "{:?}", received.differences(&values));
}

#[test]
fn a_staged_run_writes_nothing_live_before_the_commit() {
    let values = tensor_values(13);
    for (dim, at) in [(1, 32), (1, 20)] {
        let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
        let shards = halves(&values, dim, at);
        let received = Received::new([0; 3], SHAPE, q, true);
        let plan = build(&table(&shards, &[(&received, DEV0)])).unwrap();
        let group = group();
        let options = ExecOptions { commit: CommitMode::Staged, ..ExecOptions::default() };
        let mut executor = Executor::new(&group, &plan, 0, options).unwrap();
        // SAFETY: the plan's buffers are alive.
        unsafe { executor.run(&group) }.unwrap();
        assert!(
            received.codes.bytes().iter().all(|&b| b == SENTINEL),
            "cut {dim}@{at}: codes written by the run"
        );
        assert!(
            received.scales.bytes().iter().all(|&b| b == SENTINEL),
            "cut {dim}@{at}: scales written by the run"
        );
        // SAFETY: as above.
        unsafe { executor.commit(&group) }.unwrap();
        assert!(received.differences(&values).is_empty(), "cut {dim}@{at}");
    }
}

#[test]
fn two_receivers_on_two_devices_each_get_their_half() {
    // TP 2 over rows: device 0 receives rows 0..16, device 1 rows 16..40, from shards cut at 20
    // (device 0's half straddles the cut: staged; device 1's too).
    let values = tensor_values(14);
    let q = Quantization::new(Fp8::E5m2, Granularity::Row);
    let shards = halves(&values, 2, 24);
    let top = Received::new([0, 0, 0], [2, 16, 48], q, true);
    let bottom = Received::new([0, 16, 0], [2, 24, 48], q, true);
    let plan = build(&table(&shards, &[(&top, DEV0), (&bottom, DEV1)])).unwrap();
    assert_eq!(plan.stats().quantized_needs, 2);
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Staged));
    assert_eq!(plan.receiver_stats(DEV1).quantized_elements, 2 * 24 * 48);
    execute(&plan, CommitMode::Direct).unwrap();
    assert!(top.differences(&values).is_empty() && bottom.differences(&values).is_empty());
}

#[test]
fn replicas_in_other_processes_quantize_needs_in_turn() {
    // Two data-parallel trainers (processes 1 and 2) each offer the whole tensor; process 0 receives
    // each matrix as its own quantized need. The needs alternate between the trainers, each
    // quantizing its share where it is offered (the sender path); one receiving process's replica
    // would be preferred over both.
    let values = tensor_values(16);
    let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
    let whole = Shard::new(&values, [0; 3], SHAPE);
    let trainers = [Endpoint { process: 1, device: 0 }, Endpoint { process: 2, device: 0 }];
    let matrices: Vec<Received> =
        (0..SHAPE[0]).map(|m| Received::new([m, 0, 0], [1, SHAPE[1], SHAPE[2]], q, false)).collect();
    let needs: Vec<(&Received, Endpoint)> = matrices.iter().map(|r| (r, DEV0)).collect();
    let plan =
        build(&table(&[(whole, trainers[0]), (Shard::new(&values, [0; 3], SHAPE), trainers[1])], &needs))
            .unwrap();
    let runners: Vec<u32> = plan.quant_routes().iter().map(|r| r.runner.process).collect();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Sender));
    let expected: Vec<u32> = (0..SHAPE[0] as u32).map(|m| 1 + m % 2).collect();
    assert_eq!(runners, expected);
    // A replica in the receiver's own process takes every need in place.
    let local = Shard::new(&values, [0; 3], SHAPE);
    let shards = [(Shard::new(&values, [0; 3], SHAPE), trainers[0]), (local, DEV1)];
    let plan = build(&table(&shards, &needs)).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Direct && r.runner == DEV1));
}

fn fails<T>(result: refit::Result<T>, status: Status, words: &[&str]) {
    let Err(err) = result else { panic!("expected {status:?}, got success") };
    assert_eq!(err.status, status, "{}", err.message);
    for word in words {
        assert!(err.message.contains(word), "{:?} lacks {word:?}", err.message);
    }
}

#[test]
fn needs_that_cannot_be_met_are_refused_naming_the_tensor() {
    let values = tensor_values(15);
    let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
    // A block spans the shards and there is no staging.
    let shards = halves(&values, 1, 20);
    let received = Received::new([0; 3], SHAPE, q, false);
    fails(build(&table(&shards, &[(&received, DEV0)])), Status::Unsupported, &["'w'", "spans", "staging"]);
    // The sources are in another process, a block spans them, and there is no staging.
    let mut t = table(&shards, &[(&received, DEV0)]);
    t.offers.iter_mut().for_each(|o| o.owner.process = 1);
    fails(build(&t), Status::Unsupported, &["'w'", "spans", "staging"]);
    // The sources are in another process, which quantizes them (the sender path): an executor
    // without a communicator cannot carry the codes across.
    let mut t = table(&halves(&values, 1, 32), &[(&received, DEV0)]);
    t.offers.iter_mut().for_each(|o| o.owner.process = 1);
    let plan = build(&t).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Sender && r.runner.process == 1));
    assert_eq!(plan.stats().quantized_sent_bytes, SHAPE.iter().product::<u64>() * 2);
    let group = group();
    fails(
        Executor::new(&group, &plan, 0, ExecOptions::default()),
        Status::Unsupported,
        &["'w'", "communicator"],
    );
    // Elements of another size than the source type's.
    let mut t = table(&shards, &[(&received, DEV0)]);
    t.quant_needs[0].source = SourceType::F32;
    fails(build(&t), Status::InvalidArgument, &["'w'", "4"]);
    // Codes of a row not contiguous.
    let mut t = table(&shards, &[(&received, DEV0)]);
    t.quant_needs[0].strides[2] = 2;
    fails(build(&t), Status::InvalidArgument, &["'w'", "contiguous"]);
    // Scale grids that would overlap.
    let mut t = table(&shards, &[(&received, DEV0)]);
    t.quant_needs[0].scale_row_stride = 1;
    fails(build(&t), Status::InvalidArgument, &["'w'", "scale_row_stride"]);
    let mut t = table(&shards, &[(&received, DEV0)]);
    t.quant_needs[0].scale_matrix_stride = 2;
    fails(build(&t), Status::InvalidArgument, &["'w'", "scale_matrix_stride"]);
    // A bad block shape.
    let mut t = table(&shards, &[(&received, DEV0)]);
    t.quant_needs[0].quantization.granularity = Granularity::Block { rows: 16, cols: 12 };
    fails(build(&t), Status::InvalidArgument, &["'w'", "multiple of 8"]);
    // Misaligned staging.
    let staged = Received::new([0; 3], SHAPE, q, true);
    let mut t = table(&shards, &[(&staged, DEV0)]);
    t.quant_needs[0].staging += 2;
    fails(build(&t), Status::InvalidArgument, &["'w'", "staging"]);
}

#[test]
fn overlapping_codes_and_bad_memory_are_refused_at_creation_and_rebinds_of_quantized_memory_too() {
    let values = tensor_values(16);
    let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
    let shards = halves(&values, 1, 32);
    let a = Received::new([0, 0, 0], [1, 40, 48], q, false);
    let b = Received::new([1, 0, 0], [1, 40, 48], q, false);
    let mut t = table(&shards, &[(&a, DEV0), (&b, DEV0)]);
    t.quant_needs[1].addr = t.quant_needs[0].addr + 64;
    let plan = build(&t).unwrap();
    fails(Executor::new(&group(), &plan, 0, ExecOptions::default()), Status::Overlap, &["quantized"]);
    // Codes over a plain need's destination, and codes over the need's own staging.
    let mut t = table(&shards, &[(&a, DEV0)]);
    t.needs.push(plan::Need {
        tensor: 0,
        receiver: DEV0,
        addr: a.codes.addr() + 100,
        region: Region { offset: vec![0, 0, 0], extent: vec![1, 1, 8] },
        perm: None,
        strides: vec![8, 8, 1],
    });
    let plan = build(&t).unwrap();
    fails(
        Executor::new(&group(), &plan, 0, ExecOptions::default()),
        Status::Overlap,
        &["quantized", "destination"],
    );
    let staged = Received::new([0; 3], SHAPE, q, true);
    let mut t = table(&halves(&values, 1, 20), &[(&staged, DEV0)]);
    t.quant_needs[0].addr = t.quant_needs[0].staging + 64;
    let plan = build(&t).unwrap();
    fails(Executor::new(&group(), &plan, 0, ExecOptions::default()), Status::Overlap, &["staging"]);
    // Codes in the first page.
    let mut t = table(&shards, &[(&a, DEV0)]);
    t.quant_needs[0].addr = 64;
    let plan = build(&t).unwrap();
    fails(
        Executor::new(&group(), &plan, 0, ExecOptions::default()),
        Status::InvalidArgument,
        &["'w'", "codes"],
    );
    // A rebind of the codes would leave the jobs writing the old place: refused, nothing changed.
    let plan = build(&table(&shards, &[(&a, DEV0)])).unwrap();
    let group = group();
    let mut executor = Executor::new(&group, &plan, 0, ExecOptions::default()).unwrap();
    let moved = Aligned::new(a.codes.bytes().len(), 0);
    let err = executor.rebind(0, a.codes.addr(), moved.addr(), a.codes.bytes().len() as u64).unwrap_err();
    assert_eq!(err.status, Status::Unsupported, "{}", err.message);
    // SAFETY: the plan's buffers are alive.
    unsafe { executor.run(&group) }.unwrap();
    assert!(a.differences(&values).is_empty());
}

#[test]
fn tables_with_quantized_needs_survive_the_wire_and_plan_alike() {
    let values = tensor_values(17);
    let q = Quantization::new(Fp8::E5m2, Granularity::Mx);
    let shards = halves(&values, 1, 20);
    let received = Received::new([0; 3], SHAPE, q, true);
    let t = table(&shards, &[(&received, DEV0)]);
    let bytes = wire::encode(&t);
    assert_eq!(bytes[4], wire::VERSION_QUANTIZED);
    let back = wire::decode(&bytes).unwrap();
    assert_eq!(back, t);
    let (a, b) = (build(&t).unwrap(), build(&back).unwrap());
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_eq!(a.inputs_fingerprint(), b.inputs_fingerprint());
    // The quantized need is part of the inputs: another scale stride is another plan.
    let mut other = t.clone();
    other.quant_needs[0].scale_matrix_stride += 1;
    assert_ne!(build(&other).unwrap().inputs_fingerprint(), a.inputs_fingerprint());
    // The arithmetic travels with the need, and is part of the inputs too (a need with buffers of
    // its own: another granularity's scales would run past the MX need's).
    let row = Quantization::new(Fp8::E4m3fn, Granularity::Row).with(Arithmetic::DeepGemm);
    let row_received = Received::new([0; 3], SHAPE, row, true);
    let deepgemm = table(&shards, &[(&row_received, DEV0)]);
    let back = wire::decode(&wire::encode(&deepgemm)).unwrap();
    assert_eq!(back.quant_needs[0].quantization.arithmetic, Arithmetic::DeepGemm);
    let mut divide = deepgemm.clone();
    divide.quant_needs[0].quantization.arithmetic = Arithmetic::Divide;
    assert_ne!(build(&deepgemm).unwrap().inputs_fingerprint(), build(&divide).unwrap().inputs_fingerprint());
    // Without quantized needs the format is version 1, as before.
    let plain = Table { quant_needs: vec![], ..t };
    assert_eq!(wire::encode(&plain)[4], wire::VERSION);
}

/// A hook that flips a byte at `address` on the stream of the rank running the quantization, after
/// the jobs and before their verify.
fn corrupting(address: u64, rank: usize) -> refit::exec::Hook {
    std::sync::Arc::new(move |stage, group: &Group| {
        if stage == refit::exec::Stage::QuantVerify {
            let stream = refit::transport::host::host_stream(group.stream(rank)?)?;
            // SAFETY: the address is a byte of the test's memory, alive for the whole test.
            stream.enqueue(move || unsafe { *(address as usize as *mut u8) ^= 0x01 })?;
        }
        Ok(())
    })
}

#[test]
fn verify_checks_codes_and_scales_against_a_second_quantization() {
    let values = tensor_values(18);
    let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
    let code_bytes = SHAPE.iter().product::<u64>();
    let scale_bytes = SHAPE[0] * 3 * 3 * 4;
    for (dim, at) in [(1, 32), (1, 20)] {
        for commit in [CommitMode::Direct, CommitMode::Staged] {
            let shards = halves(&values, dim, at);
            let received = Received::new([0; 3], SHAPE, q, true);
            let plan = build(&table(&shards, &[(&received, DEV0)])).unwrap();
            let group = group();
            let options = ExecOptions { commit, verify: true, ..ExecOptions::default() };
            let mut executor = Executor::new(&group, &plan, 0, options).unwrap();
            // SAFETY: the plan's buffers are alive.
            let ran = unsafe { executor.run(&group) }.unwrap();
            let mut verified = ran.verified_bytes;
            if commit == CommitMode::Staged {
                // SAFETY: as above.
                let committed = unsafe { executor.commit(&group) }.unwrap();
                assert!(committed.verified);
                verified += committed.verified_bytes;
            }
            // Every code and scale was checked (a staged path's bf16 copies into staging are verified
            // as well, as any copy).
            assert!(ran.verified, "{commit:?} cut {at}");
            assert!(verified >= code_bytes + scale_bytes, "{commit:?} cut {at}: {verified}");
            assert!(received.differences(&values).is_empty());

            // A code flipped after its quantization is caught, naming the tensor; nothing is committed.
            let runner = if dim == 1 && at == 32 { 1 } else { 0 };
            // Direct path: device 1 quantizes rows 32.. into row 32 of the codes; staged: device 0 all.
            let flipped = received.codes.addr() + 32 * received.pitch + 5;
            let target = if commit == CommitMode::Staged && runner == 1 { None } else { Some(flipped) };
            let Some(address) = target else { continue };
            let options = ExecOptions {
                commit,
                verify: true,
                hook: Some(corrupting(address, runner)),
                ..ExecOptions::default()
            };
            let mut corrupted = Executor::new(&group, &plan, 0, options).unwrap();
            // SAFETY: as above.
            let outcome = unsafe { corrupted.run(&group) }.and_then(|_| unsafe { corrupted.commit(&group) });
            let err = outcome.unwrap_err();
            assert_eq!(err.status, refit::Status::VerifyMismatch, "{commit:?} cut {at}: {}", err.message);
            assert!(err.message.contains("'w'") && err.message.contains("codes"), "{}", err.message);
        }
    }
}

#[test]
fn hostile_quantized_needs_are_refused_not_a_panic() {
    let q = Quantization::new(Fp8::E4m3fn, BLOCK16);
    let need = |shape: Vec<u64>, extent: Vec<u64>, strides: Vec<u64>| Table {
        tensors: vec![TensorSpec { name: "h".into(), dtype: 0, elem_size: 2, shape: shape.clone() }],
        offers: vec![Offer {
            tensor: 0,
            owner: DEV0,
            addr: 1 << 40,
            region: Region { offset: vec![0; shape.len()], extent: shape.clone() },
            strides: None,
            digest: None,
        }],
        needs: vec![],
        quant_needs: vec![QuantNeed {
            tensor: 0,
            receiver: DEV0,
            addr: 1 << 41,
            region: Region { offset: vec![0; extent.len()], extent },
            strides,
            quantization: q,
            source: SourceType::Bf16,
            scales: 1 << 42,
            scale_row_stride: u64::MAX / 2,
            scale_matrix_stride: u64::MAX / 2,
            staging: 0,
        }],
        shared_amax: vec![],
    };
    let cases = [
        // More dimensions than a box may have.
        need(vec![1; 12], vec![1; 12], vec![1; 12]),
        // A shape whose element count overflows.
        need(vec![u64::MAX, u64::MAX, 16], vec![1, 16, 16], vec![256, 16, 1]),
        // Scale strides whose grids run past the address space.
        need(vec![4, 64, 64], vec![4, 64, 64], vec![4096, 64, 1]),
        // A stride count that differs from the dimensions.
        need(vec![64, 64], vec![64, 64], vec![64]),
    ];
    for table in cases {
        let err = build(&table).unwrap_err();
        assert!(
            matches!(err.status, Status::InvalidArgument | Status::TensorMismatch | Status::Unsupported),
            "{:?}: {}",
            err.status,
            err.message
        );
    }
    // Millions of one-row matrices: bounded by the planner's segment limit, refused rather than held.
    let mut many = need(vec![1 << 24, 1, 16], vec![1 << 24, 1, 16], vec![16, 16, 1]);
    many.quant_needs[0].scale_row_stride = 1;
    many.quant_needs[0].scale_matrix_stride = 1;
    let limits = refit::plan::Limits { max_segments: 1 << 20, ..refit::plan::Limits::default() };
    let err =
        plan::build_with_limits(std::slice::from_ref(&many), &PlanOptions::default(), &limits).unwrap_err();
    assert_eq!(err.status, Status::Unsupported, "{}", err.message);
    // As many per-tensor matrices as 2^40: each has a scale that others could share, and looking
    // for sharers is bounded by the same limit (found by fuzzing: it went through every matrix).
    let mut scalars = need(vec![1 << 40, 1, 16], vec![1 << 40, 1, 16], vec![16, 16, 1]);
    scalars.quant_needs[0].quantization = Quantization::new(Fp8::E4m3fn, Granularity::Tensor);
    scalars.quant_needs[0].scale_matrix_stride = 1;
    let err = plan::build_with_limits(std::slice::from_ref(&scalars), &PlanOptions::default(), &limits)
        .unwrap_err();
    assert_eq!(err.status, Status::Unsupported, "{}", err.message);
    assert!(err.message.contains("segment limit"), "{}", err.message);
}

/// A fused `qkv` received from three tensors q, k and v (32, 16 and 16 rows of 48 bf16) as
/// per-tensor FP8 with one scale: three needs naming the same scale.
struct Fused {
    values: Vec<[u8; 2]>,
    /// The parts' shards: (tensor, first row, rows, owner) each.
    parts: Vec<(u32, u64, u64, Endpoint)>,
    codes: Aligned,
    scale: Aligned,
    staging: Vec<Aligned>,
}

const PARTS: [(&str, u64, u64); 3] = [("q", 0, 32), ("k", 32, 16), ("v", 48, 16)];
const FUSED_COLS: u64 = 48;

impl Fused {
    /// `owners[t]`: where tensor t is offered, cut into rows at each of its `cuts`.
    fn new(seed: u64, owners: [Endpoint; 3], cuts: [Option<u64>; 3]) -> Fused {
        let mut rng = Rng::new(seed);
        // Each part's magnitudes its own (q's the smallest, v's the largest), so that no part alone
        // has the fused matrix's scale.
        let values = (0..64 * FUSED_COLS)
            .map(|i| {
                let part = if i < 32 * FUSED_COLS {
                    0
                } else if i < 48 * FUSED_COLS {
                    1
                } else {
                    2
                };
                let mantissa = 1.0 + (rng.next() % 128) as f32 / 128.0;
                let sign = if rng.next() % 2 == 0 { 1.0 } else { -1.0 };
                bf16(sign * mantissa * 2f32.powi(part * 3 - 4 + (rng.next() % 4) as i32))
            })
            .collect();
        let mut parts = Vec::new();
        for (t, &(_, _, rows)) in PARTS.iter().enumerate() {
            match cuts[t] {
                Some(at) => {
                    parts.extend([(t as u32, 0, at, owners[t]), (t as u32, at, rows - at, owners[t])])
                }
                None => parts.push((t as u32, 0, rows, owners[t])),
            }
        }
        Fused {
            values,
            parts,
            codes: Aligned::new((64 * FUSED_COLS) as usize, SENTINEL),
            scale: Aligned::new(4, SENTINEL),
            staging: PARTS
                .iter()
                .map(|&(_, _, rows)| Aligned::new((rows * FUSED_COLS * 2) as usize, 0))
                .collect(),
        }
    }

    /// Rows `lo .. lo + rows` of tensor `t`, in a buffer of their own.
    fn shard(&self, t: u32, lo: u64, rows: u64) -> Aligned {
        let first = PARTS[t as usize].1 + lo;
        let mut memory = Aligned::new((rows * FUSED_COLS * 2) as usize, 0);
        for (i, v) in self.values[(first * FUSED_COLS) as usize..((first + rows) * FUSED_COLS) as usize]
            .iter()
            .enumerate()
        {
            memory.bytes_mut()[2 * i..2 * i + 2].copy_from_slice(v);
        }
        memory
    }

    /// The table (and the shards it offers, to keep alive), each need with staging or not.
    fn table(&self, staging: bool, quantization: Quantization) -> (Table, Vec<Aligned>) {
        let tensors = PARTS
            .iter()
            .map(|&(name, _, rows)| TensorSpec {
                name: name.into(),
                dtype: 7,
                elem_size: 2,
                shape: vec![rows, FUSED_COLS],
            })
            .collect();
        let shards: Vec<Aligned> =
            self.parts.iter().map(|&(t, lo, rows, _)| self.shard(t, lo, rows)).collect();
        let offers = self
            .parts
            .iter()
            .zip(&shards)
            .map(|(&(tensor, lo, rows, owner), memory)| Offer {
                tensor,
                owner,
                addr: memory.addr(),
                region: Region { offset: vec![lo, 0], extent: vec![rows, FUSED_COLS] },
                strides: None,
                digest: None,
            })
            .collect();
        let quant_needs = PARTS
            .iter()
            .enumerate()
            .map(|(t, &(_, first, rows))| QuantNeed {
                tensor: t as u32,
                receiver: DEV0,
                addr: self.codes.addr() + first * FUSED_COLS,
                region: Region { offset: vec![0, 0], extent: vec![rows, FUSED_COLS] },
                strides: vec![FUSED_COLS, 1],
                quantization,
                source: SourceType::Bf16,
                scales: self.scale.addr(),
                scale_row_stride: 1,
                scale_matrix_stride: 1,
                staging: if staging { self.staging[t].addr() } else { 0 },
            })
            .collect();
        (Table { tensors, offers, needs: vec![], quant_needs, shared_amax: vec![] }, shards)
    }

    /// The reference: the whole fused matrix quantized by one per-tensor job.
    fn expected(&self, quantization: Quantization) -> (Vec<u8>, Vec<u8>) {
        let whole = self.shard(0, 0, 64);
        let (codes, scale) = (Aligned::new(self.codes.bytes().len(), SENTINEL), Aligned::new(4, SENTINEL));
        let job = QuantJob {
            quantization,
            source: SourceType::Bf16,
            src: whole.addr(),
            rows: 64,
            cols: FUSED_COLS,
            src_stride: FUSED_COLS,
            dst: codes.addr(),
            dst_stride: FUSED_COLS,
            scales: scale.addr(),
            scale_stride: 1,
            amax_key: 0,
        };
        // SAFETY: the buffers above outlive the call, which completes on return.
        unsafe { HostBackend::new(1).unwrap().quantize_batch(0, Stream::NULL, &[job]) }.unwrap();
        (codes.bytes().to_vec(), scale.bytes().to_vec())
    }
}

#[test]
fn per_tensor_needs_sharing_one_scale_get_the_amax_of_all_of_them() {
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::DeepGemm);
    // (owners, cuts, staging, path, exchanged): all on the receiver's device, in place, also with
    // one part cut into two offers (jobs of one batch sharing the scale); one part on another
    // device: all three staged on the receiver, or without staging each part in place on its own
    // device, the devices exchanging the amax.
    let layouts = [
        ([DEV0, DEV0, DEV0], [None, None, None], true, QuantPath::Direct, false),
        ([DEV0, DEV0, DEV0], [Some(8), None, None], true, QuantPath::Direct, false),
        ([DEV0, DEV1, DEV0], [None, None, None], true, QuantPath::Staged, false),
        ([DEV0, DEV1, DEV0], [None, None, None], false, QuantPath::Direct, true),
    ];
    for (seed, (owners, cuts, staging, path, exchanged)) in layouts.into_iter().enumerate() {
        for commit in [CommitMode::Direct, CommitMode::Staged] {
            for verify in [false, true] {
                let fused = Fused::new(seed as u64 + 40, owners, cuts);
                let (table, _shards) = fused.table(staging, q);
                let plan = build(&table).unwrap();
                let what = format!("{owners:?} {cuts:?} staging {staging} {commit:?} verify {verify}");
                assert!(plan.quant_routes().iter().all(|r| r.path == path), "{what}");
                assert_eq!(plan.amax_exchange().is_empty(), !exchanged, "{what}");
                let group = group();
                let options = ExecOptions { commit, verify, ..ExecOptions::default() };
                let mut executor = Executor::new(&group, &plan, 0, options).unwrap();
                // SAFETY: every address of the plan is a live buffer of this test.
                let ran = unsafe { executor.run(&group) }.unwrap();
                let mut quantized = ran.quantized_elements;
                if commit == CommitMode::Staged {
                    // SAFETY: as above.
                    quantized += unsafe { executor.commit(&group) }.unwrap().quantized_elements;
                }
                assert_eq!(quantized, 64 * FUSED_COLS, "{what}");
                let (codes, scale) = fused.expected(q);
                assert_eq!(fused.scale.bytes(), scale.as_slice(), "{what}: the shared scale");
                assert!(fused.codes.bytes() == codes.as_slice(), "{what}: codes");
                // Not vacuous: q alone would have another scale.
                let (alone, _) = fused.table(true, q);
                let mut only_q = alone.clone();
                only_q.quant_needs.truncate(1);
                only_q.quant_needs[0].scales = fused.staging[2].addr();
                let plan = build(&only_q).unwrap();
                let mut executor = Executor::new(&group, &plan, 0, ExecOptions::default()).unwrap();
                // SAFETY: as above (the scale lands in v's staging, unused here).
                unsafe { executor.run(&group) }.unwrap();
                assert_ne!(&fused.staging[2].bytes()[..4], scale.as_slice(), "{what}: q alone");
            }
        }
    }
}

#[test]
fn needs_sharing_a_scale_that_cannot_be_quantized_together_are_refused() {
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor);
    let fused = Fused::new(50, [DEV0, DEV1, DEV0], [None, None, None]);
    // One target and arithmetic, one receiving device.
    let (mut table, _shards) = fused.table(true, q);
    table.quant_needs[2].quantization = q.with(Arithmetic::VllmChannel);
    fails(
        build(&table),
        Status::InvalidArgument,
        &["'q'", "'k'", "'v'", "share a per-tensor amax", "quantization"],
    );
    let (mut table, _shards) = fused.table(true, q);
    table.quant_needs[1].receiver = DEV1;
    fails(build(&table), Status::InvalidArgument, &["receiving device"]);
    // A per-tensor scale inside a block need's grid is an overlap, found at creation.
    let (mut table, _shards) = fused.table(true, q);
    table.quant_needs[1].quantization = Quantization::new(Fp8::E4m3fn, BLOCK16);
    table.quant_needs[1].scale_row_stride = 3;
    table.quant_needs[1].scale_matrix_stride = 3;
    let plan = build(&table).unwrap();
    fails(Executor::new(&group(), &plan, 0, ExecOptions::default()), Status::Overlap, &["scales"]);
}

/// One per-tensor weight sharded by rows over two receiving devices, each with its own scale, the
/// two scales given one amax key (vLLM's per-tensor weights at TP 2, in one process): offered whole
/// on `owner`, and (with `cut`) in two offers on the two devices.
struct Sharded {
    values: Vec<u8>,
    whole: Aligned,
    halves: [Aligned; 2],
    codes: [Aligned; 2],
    scales: [Aligned; 2],
    staging: [Aligned; 2],
}

const SHARDED: (u64, u64) = (64, 48);
const AMAX_KEY: u64 = 0x51ab_cdef;

impl Sharded {
    fn new(seed: u64) -> Sharded {
        let (rows, cols) = SHARDED;
        let mut rng = Rng::new(seed);
        // The second half's magnitudes are larger: its amax alone is the weight's.
        let values: Vec<u8> = (0..rows * cols)
            .flat_map(|i| {
                let exponent = (rng.next() % 8) as i32 - 4 + if i >= rows * cols / 2 { 3 } else { 0 };
                let mantissa = 1.0 + (rng.next() % 128) as f32 / 128.0;
                let sign = if rng.next() % 2 == 0 { 1.0 } else { -1.0 };
                bf16(sign * mantissa * 2f32.powi(exponent))
            })
            .collect();
        let buffer = |bytes: &[u8]| {
            let mut memory = Aligned::new(bytes.len(), 0);
            memory.bytes_mut().copy_from_slice(bytes);
            memory
        };
        let half = values.len() / 2;
        Sharded {
            whole: buffer(&values),
            halves: [buffer(&values[..half]), buffer(&values[half..])],
            codes: [0, 1].map(|_| Aligned::new((rows / 2 * cols) as usize, SENTINEL)),
            scales: [0, 1].map(|_| Aligned::new(4, SENTINEL)),
            staging: [0, 1].map(|_| Aligned::new((rows / 2 * cols * 2) as usize, 0)),
            values,
        }
    }

    /// The table: offered whole on `owner` (or in halves on DEV0 and DEV1 when `cut`), one need per
    /// device for its half, each quantized as `quantizations` says, the scales keyed alike when
    /// `keyed`.
    fn table(&self, owner: Endpoint, cut: bool, quantizations: [Quantization; 2], keyed: bool) -> Table {
        let (rows, cols) = SHARDED;
        let offer = |addr: u64, owner: Endpoint, lo: u64, count: u64| Offer {
            tensor: 0,
            owner,
            addr,
            region: Region { offset: vec![lo, 0], extent: vec![count, cols] },
            strides: None,
            digest: None,
        };
        let offers = match cut {
            false => vec![offer(self.whole.addr(), owner, 0, rows)],
            true => vec![
                offer(self.halves[0].addr(), DEV0, 0, rows / 2),
                offer(self.halves[1].addr(), DEV1, rows / 2, rows / 2),
            ],
        };
        let quant_needs = [DEV0, DEV1]
            .iter()
            .enumerate()
            .map(|(k, &receiver)| QuantNeed {
                tensor: 0,
                receiver,
                addr: self.codes[k].addr(),
                region: Region { offset: vec![k as u64 * rows / 2, 0], extent: vec![rows / 2, cols] },
                strides: vec![cols, 1],
                quantization: quantizations[k],
                source: SourceType::Bf16,
                scales: self.scales[k].addr(),
                scale_row_stride: 1,
                scale_matrix_stride: 1,
                staging: self.staging[k].addr(),
            })
            .collect();
        let shared_amax = match keyed {
            true => (0..2)
                .map(|k| SharedAmax { process: 0, scale: self.scales[k].addr(), key: AMAX_KEY })
                .collect(),
            false => vec![],
        };
        Table {
            tensors: vec![TensorSpec { name: "w".into(), dtype: 7, elem_size: 2, shape: vec![rows, cols] }],
            offers,
            needs: vec![],
            quant_needs,
            shared_amax,
        }
    }
}

#[test]
fn per_tensor_shards_on_two_devices_sharing_an_amax_key_get_the_whole_weights_scale() {
    let (rows, cols) = SHARDED;
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::VllmTensor);
    for (seed, owner) in [DEV0, DEV1].into_iter().enumerate() {
        for commit in [CommitMode::Direct, CommitMode::Staged] {
            for verify in [false, true] {
                let what = format!("offered on {owner:?} {commit:?} verify {verify}");
                let sharded = Sharded::new(seed as u64 + 70);
                let plan = build(&sharded.table(owner, false, [q, q], true)).unwrap();
                let routes = plan.quant_routes();
                assert!(routes.iter().all(|r| r.path == QuantPath::Direct && r.runner == owner), "{what}");
                let (want_codes, want_scale) = quant_cases::reference_bf16(q, &sharded.values, rows, cols);
                let half = want_codes.len() / 2;
                step(&plan, commit, verify);
                for k in 0..2 {
                    assert_eq!(sharded.scales[k].bytes(), want_scale.as_slice(), "{what}: scale {k}");
                    let want = &want_codes[k * half..(k + 1) * half];
                    assert!(sharded.codes[k].bytes() == want, "{what}: codes of half {k}");
                }
            }
        }
    }
    // Not vacuous: without the key the first half takes its own amax.
    let sharded = Sharded::new(70);
    execute(&build(&sharded.table(DEV0, false, [q, q], false)).unwrap(), CommitMode::Direct).unwrap();
    let (_, whole_scale) = quant_cases::reference_bf16(q, &sharded.values, rows, cols);
    assert_ne!(sharded.scales[0].bytes(), whole_scale.as_slice(), "the first half alone");
    // The key survives the wire, and the plan is the same.
    let table = sharded.table(DEV1, false, [q, q], true);
    let decoded = wire::decode(&wire::encode(&table)).unwrap();
    assert_eq!(decoded, table);
    assert_eq!(wire::encode(&table)[4], wire::VERSION_SHARED_AMAX);
    assert_eq!(build(&decoded).unwrap().quant_routes(), build(&table).unwrap().quant_routes());
    let unkeyed = sharded.table(DEV1, false, [q, q], false);
    assert_eq!(wire::encode(&unkeyed)[4], wire::VERSION_QUANTIZED, "no key: written as before keys");
}

#[test]
fn shards_sharing_an_amax_across_devices_exchange_it_and_bad_keys_are_refused() {
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::VllmTensor);
    let sharded = Sharded::new(80);
    // Each half offered on its own receiver: no one device holds both (and staging on each receiver
    // would give each its own amax), so each device quantizes its half and the two exchange the
    // amax at every run: both scales are the whole weight's.
    let (rows, cols) = SHARDED;
    let plan = build(&sharded.table(DEV0, true, [q, q], true)).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Direct && r.runner == r.receiver));
    assert_eq!(plan.amax_exchange().keys.len(), 1);
    let (want_codes, want_scale) = quant_cases::reference_bf16(q, &sharded.values, rows, cols);
    for commit in [CommitMode::Direct, CommitMode::Staged] {
        for verify in [false, true] {
            let what = format!("offered in halves {commit:?} verify {verify}");
            for scale in &sharded.scales {
                // SAFETY: a 4-byte buffer of this test, no reference to it alive here.
                unsafe { std::ptr::write_bytes(scale.addr() as *mut u8, SENTINEL, 4) };
            }
            step(&plan, commit, verify);
            let half = want_codes.len() / 2;
            for k in 0..2 {
                assert_eq!(sharded.scales[k].bytes(), want_scale.as_slice(), "{what}: scale {k}");
                assert!(
                    sharded.codes[k].bytes() == &want_codes[k * half..(k + 1) * half],
                    "{what}: codes {k}"
                );
            }
        }
    }
    // Without the key, the same table plans: each half in place on its own device.
    let plan = build(&sharded.table(DEV0, true, [q, q], false)).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Direct && r.runner == r.receiver));
    // One target and arithmetic.
    fails(
        build(&sharded.table(DEV0, false, [q, q.with(Arithmetic::Divide)], true)),
        Status::InvalidArgument,
        &["'w'", "share a per-tensor amax", "quantization"],
    );
    // A key on a scale that no need writes.
    let mut table = sharded.table(DEV0, false, [q, q], true);
    table.shared_amax.push(SharedAmax { process: 0, scale: sharded.staging[0].addr(), key: 3 });
    fails(build(&table), Status::InvalidArgument, &["no quantized need", "key 3"]);
    // Two tables giving one scale two keys.
    let table = sharded.table(DEV0, false, [q, q], true);
    let mut other = Table::default();
    other.shared_amax.push(SharedAmax { process: 0, scale: sharded.scales[0].addr(), key: AMAX_KEY + 1 });
    fails(plan::build(&[table, other], &PlanOptions::default()), Status::InvalidArgument, &["two keys"]);
    // Key 0, and a second key for one scale, are refused as they are added.
    let mut builder = refit::plan::TableBuilder::new();
    let place = |key| SharedAmax { process: 0, scale: 0x1000, key };
    fails(builder.share_amax(place(0)), Status::InvalidArgument, &["key 0"]);
    builder.share_amax(place(5)).unwrap();
    builder.share_amax(place(5)).unwrap();
    fails(builder.share_amax(place(6)), Status::InvalidArgument, &["under key 5, not 6"]);
    assert_eq!(builder.table().shared_amax.len(), 1);
}

/// A row-parallel weight (quant_cases::RowShards: 100 x 200 bf16) received as three column shards
/// on two devices, per row, each with its own scales, all given one amax key (vLLM's per-channel
/// row-parallel weights at TP > 1): offered whole on one device, every row's scale is the whole
/// row's on every shard, under both commits and with verify. Offered in column shards on the
/// receivers themselves, no one device holds them: each quantizes its own and the devices exchange
/// the rows' amaxes, with the same results; so too offered in row halves (each need then on two
/// devices, in the same bands of rows). Offered in bands that differ between needs: refused, even
/// with staging.
#[test]
fn per_row_shards_sharing_an_amax_key_get_the_whole_rows_scales() {
    use quant_cases::RowShards;
    let shards = RowShards::new(90, Fp8::E4m3fn, Arithmetic::VllmChannel);
    let w = &shards.whole;
    let receivers = [DEV0, DEV1, DEV0];
    let outputs: Vec<(Aligned, Aligned, Aligned)> = (0..3)
        .map(|k| {
            let (codes, scales) = shards.lens(k);
            (Aligned::new(codes, SENTINEL), Aligned::new(scales, SENTINEL), Aligned::new(codes * 2, 0))
        })
        .collect();
    let table = |owners: &[(Endpoint, u64, u64)], keyed: bool| {
        let offers = owners
            .iter()
            .map(|&(owner, c0, width)| Offer {
                tensor: 0,
                owner,
                addr: w.data.addr() + c0 * 2,
                region: Region { offset: vec![0, c0], extent: vec![w.rows, width] },
                strides: Some(vec![w.src_stride, 1]),
                digest: None,
            })
            .collect();
        let quant_needs = (0..3)
            .map(|k| {
                let (c0, width) = shards.shards[k];
                QuantNeed {
                    tensor: 0,
                    receiver: receivers[k],
                    addr: outputs[k].0.addr(),
                    region: Region { offset: vec![0, c0], extent: vec![w.rows, width] },
                    strides: vec![width, 1],
                    quantization: w.quantization,
                    source: SourceType::Bf16,
                    scales: outputs[k].1.addr(),
                    scale_row_stride: 1,
                    scale_matrix_stride: 0,
                    staging: outputs[k].2.addr(),
                }
            })
            .collect();
        let shared_amax = match keyed {
            true => (0..3).map(|k| SharedAmax { process: 0, scale: outputs[k].1.addr(), key: 7 }).collect(),
            false => vec![],
        };
        Table {
            tensors: vec![TensorSpec {
                name: "o".into(),
                dtype: 7,
                elem_size: 2,
                shape: vec![w.rows, w.cols],
            }],
            offers,
            needs: vec![],
            quant_needs,
            shared_amax,
        }
    };
    let runs = |plan: &Plan, what: &str| {
        for commit in [CommitMode::Direct, CommitMode::Staged] {
            for verify in [false, true] {
                let what = format!("{what} {commit:?} verify {verify}");
                for (k, (codes, scales, _)) in outputs.iter().enumerate() {
                    let (codes_len, scales_len) = shards.lens(k);
                    // SAFETY: the buffers above, of these lengths (no reference to them is alive here).
                    unsafe {
                        std::ptr::write_bytes(codes.addr() as *mut u8, SENTINEL, codes_len);
                        std::ptr::write_bytes(scales.addr() as *mut u8, SENTINEL, scales_len);
                    }
                }
                step(plan, commit, verify);
                for (k, (codes, scales, _)) in outputs.iter().enumerate() {
                    shards.check(k, codes.bytes(), scales.bytes(), &what);
                }
            }
        }
    };
    let plan = build(&table(&[(DEV1, 0, w.cols)], true)).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Direct && r.runner == DEV1));
    assert!(plan.amax_exchange().is_empty(), "one device quantizes the set in one batch");
    runs(&plan, "offered whole");
    // Each shard offered on its own receiver's device: no one device holds the set, so each
    // quantizes its own in place, the two devices exchanging every row's amax at each run.
    let by_receiver: Vec<(Endpoint, u64, u64)> =
        (0..3).map(|k| (receivers[k], shards.shards[k].0, shards.shards[k].1)).collect();
    let plan = build(&table(&by_receiver, true)).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.runner == r.receiver && r.path == QuantPath::Direct));
    assert_eq!(plan.amax_exchange().keys.len(), 1);
    runs(&plan, "offered by column shard");
    // Offered in row halves on the two devices, each need's box lies on both, in the same two bands
    // of rows in every need: each band's jobs share its rows' amaxes under a key of its own,
    // exchanged between the devices.
    let mut by_rows = table(&by_receiver, true);
    let half = w.rows / 2;
    let offer = |owner: Endpoint, (r0, rows): (u64, u64), (c0, cols): (u64, u64)| Offer {
        tensor: 0,
        owner,
        addr: w.data.addr() + (r0 * w.src_stride + c0) * 2,
        region: Region { offset: vec![r0, c0], extent: vec![rows, cols] },
        strides: Some(vec![w.src_stride, 1]),
        digest: None,
    };
    by_rows.offers =
        vec![offer(DEV0, (0, half), (0, w.cols)), offer(DEV1, (half, w.rows - half), (0, w.cols))];
    let plan = build(&by_rows).unwrap();
    assert_eq!(plan.amax_exchange().keys.len(), 2, "one key per band of rows");
    runs(&plan, "offered in row halves");
    // Bands that differ between needs (each column shard's rows cut at another row): a row would
    // take its amax under two keys. Refused, even with staging.
    let mut skewed = table(&by_receiver, true);
    skewed.offers = (0..3)
        .flat_map(|k| {
            let (c0, width) = shards.shards[k];
            let cut = 30 + 10 * k as u64;
            [offer(DEV0, (0, cut), (c0, width)), offer(DEV1, (cut, w.rows - cut), (c0, width))]
        })
        .collect();
    fails(build(&skewed), Status::Unsupported, &["'o'", "bands of rows", "staging on each receiver"]);
    // Without the key, each shard's rows take their own amaxes, in place on their own device.
    let plan = build(&table(&by_receiver, false)).unwrap();
    assert!(plan.quant_routes().iter().all(|r| r.runner == r.receiver && r.path == QuantPath::Direct));
}

/// A per-tensor need of two matrices (experts 0 and 1, each its own scale) on device 0, and a need
/// of matrix 1 alone on device 1 whose scale shares an amax key with the first need's matrix 1: one
/// set of needs, but two of matrices. Matrix 0 keeps its own amax (its scale is not the set's), and
/// both copies of matrix 1's scale take matrix 1's.
#[test]
fn a_key_on_one_matrix_of_a_need_shares_that_matrixs_amax_only() {
    let values = tensor_values(21);
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor);
    let shards = [(Shard::new(&values, [0; 3], SHAPE), DEV0)];
    let both = Received::new([0; 3], SHAPE, q, false);
    let second = Received::new([1, 0, 0], [1, SHAPE[1], SHAPE[2]], q, false);
    let mut t = table(&shards, &[(&both, DEV0), (&second, DEV1)]);
    t.shared_amax = vec![
        SharedAmax { process: 0, scale: both.scales.addr() + 4, key: 9 },
        SharedAmax { process: 0, scale: second.scales.addr(), key: 9 },
    ];
    let plan = build(&t).unwrap();
    let keys: Vec<Vec<u64>> =
        plan.quant_routes().iter().map(|r| r.jobs.iter().map(|j| j.amax_key).collect()).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_ne!(keys[0][0], keys[0][1], "the need's two matrices take different keys: {keys:?}");
    assert!(keys[1] == [keys[0][1]], "matrix 1 shares its key with the other need: {keys:?}");
    for commit in [CommitMode::Direct, CommitMode::Staged] {
        execute(&plan, commit).unwrap();
        assert!(both.differences(&values).is_empty(), "{commit:?}: {:?}", both.differences(&values));
        assert!(second.differences(&values).is_empty(), "{commit:?}: {:?}", second.differences(&values));
    }
}

/// The halves of Sharded in two processes, each quantizing its own in place (a colocated trainer
/// and engine per process): their amax is exchanged between the processes, so an executor made
/// without a communicator is refused, naming what to do instead.
#[test]
fn an_exchange_between_processes_needs_an_executor_with_a_communicator() {
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::VllmTensor);
    let sharded = Sharded::new(81);
    let mut table = sharded.table(DEV0, true, [q, q], true);
    let other = Endpoint { process: 1, device: 0 };
    table.offers[1].owner = other;
    table.quant_needs[1].receiver = other;
    table.shared_amax[1].process = 1;
    let plan = build(&table).unwrap();
    assert_eq!(plan.amax_exchange().processes, vec![0, 1]);
    assert!(plan.quant_routes().iter().all(|r| r.amax_exchanged && r.path == QuantPath::Direct));
    fails(
        Executor::new(&group(), &plan, 0, ExecOptions::default()),
        Status::Unsupported,
        &["processes 0 and 1", "exchange", "refit_executor_create_across"],
    );
}
