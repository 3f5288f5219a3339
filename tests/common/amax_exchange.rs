//! A tensor-parallel trainer's weights quantized for engines whose scales take amaxes across their
//! ranks, so that no one trainer device sees every element a scale depends on: the trainers exchange
//! their amaxes at every run (`plan::AmaxExchange`). Run on the host backend
//! (tests/quant_across_host.rs) and on one GPU (tests/gpu_quant.rs) over any memory ([`Memory`]).
//!
//! Two trainer processes (ranks 0 and 1) each offer a column half of two R x C bf16 weights; two
//! engine processes (ranks 2 and 3) receive them as FP8:
//! - "tensor", per tensor (vLLM's online per-tensor arithmetic): engine e gets row half e, and its
//!   copy of the one scale shares an amax key with the other engine's, so each engine's box takes
//!   pieces from both trainers and the scale is the whole weight's.
//! - "rows", per row with a key (a row-parallel layer, whose rows' amaxes vLLM reduces across the
//!   ranks): engine e gets column half e (trainer e's), and each row's amax is the whole row's.
//!
//! The largest magnitudes lie where no single trainer or engine would find them alone (checked), and
//! they move between the two steps of every case, so a stale amax fails too. Every code and scale is
//! compared with the reference quantizer run over the whole weight, under direct and staged commit,
//! with and without verify.
#![allow(dead_code)]

use super::quant_cases::reference_bf16;
use refit::across::build_plan;
use refit::exec::{CommitMode, ExecOptions, Executor};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{
    Endpoint, Offer, PlanOptions, QuantNeed, QuantPath, Region, SharedAmax, Table, TensorSpec,
};
use refit::quant::{Arithmetic, Fp8, Granularity, Quantization, SourceType};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use std::sync::Arc;
use std::time::Duration;

/// Memory of the backend under test, on device 0.
pub trait Memory {
    fn new(len: usize) -> Self;
    fn addr(&self) -> u64;
    fn write(&mut self, bytes: &[u8]);
    fn read(&self) -> Vec<u8>;
}

pub const PROCESSES: usize = 4;
const TRAINERS: usize = 2;
const ROWS: u64 = 256;
const COLS: u64 = 512;
const TENSOR_KEY: u64 = 0x7e57_0001;
const ROWS_KEY: u64 = 0x7e57_0002;
const SENTINEL: u8 = 0x5a;

fn per_tensor() -> Quantization {
    Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::VllmTensor)
}

fn per_row() -> Quantization {
    Quantization::new(Fp8::E4m3fn, Granularity::Row)
}

/// Element (r, c) of the weight at step `step`: rows alternate which column half holds their
/// largest magnitudes (as the step says), and a few rows at one end of one half are larger still.
fn element(r: u64, c: u64, step: u64) -> [u8; 2] {
    let h = (r * 7919 + c * 104_729 + step * 15_485_863).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    let left = c < COLS / 2;
    let wide = ((r % 2 == 0) == left) ^ (step % 2 == 1);
    let peak = if step % 2 == 0 { r >= ROWS - 4 && !left } else { r < 4 && left };
    let exponent = 118 + 6 * u64::from(wide) + 4 * u64::from(peak) + (h & 3);
    (((h & 0x8000) | (exponent << 7) | ((h >> 4) & 0x7f)) as u16).to_le_bytes()
}

fn weight(step: u64) -> Vec<u8> {
    (0..ROWS).flat_map(|r| (0..COLS).flat_map(move |c| element(r, c, step))).collect()
}

/// Row-major bytes of `bytes` (rows of `row_bytes`) from rows `rows` and byte columns `cols`.
fn cut(bytes: &[u8], row_bytes: u64, rows: std::ops::Range<u64>, cols: std::ops::Range<u64>) -> Vec<u8> {
    rows.flat_map(|r| &bytes[(r * row_bytes + cols.start) as usize..(r * row_bytes + cols.end) as usize])
        .copied()
        .collect()
}

fn spec(name: &str) -> TensorSpec {
    TensorSpec { name: name.into(), dtype: 1, elem_size: 2, shape: vec![ROWS, COLS] }
}

/// One engine's outputs: the per-tensor box's codes and scale, the per-row box's codes and scales.
struct Outputs<M> {
    tensor_codes: M,
    tensor_scale: M,
    rows_codes: M,
    rows_scales: M,
}

/// What engine `engine` must hold after a step over `bf16`.
fn expected(engine: u64, bf16: &[u8]) -> [Vec<u8>; 4] {
    let (half_rows, half_cols) = (ROWS / 2, COLS / 2);
    let (tensor_codes, tensor_scale) = reference_bf16(per_tensor(), bf16, ROWS, COLS);
    let (rows_codes, rows_scales) = reference_bf16(per_row(), bf16, ROWS, COLS);
    [
        cut(&tensor_codes, COLS, engine * half_rows..(engine + 1) * half_rows, 0..COLS),
        tensor_scale,
        cut(&rows_codes, COLS, 0..ROWS, engine * half_cols..(engine + 1) * half_cols),
        rows_scales,
    ]
}

/// The body of one process (`rank` of [`PROCESSES`]) on `backend`, through CUDA IPC or host
/// staging between the processes as `ipc` says.
pub fn trainers_exchange_amaxes<M: Memory>(
    rank: usize,
    size: usize,
    id: &CommId,
    backend: BackendChoice,
    ipc: bool,
) {
    assert_eq!(size, PROCESSES);
    let group = Group::new(&[0], GroupOptions { backend, host_devices: 0 }).unwrap();
    let options = CommOptions { timeout: Duration::from_secs(60), ipc, ..CommOptions::default() };
    let comm = Arc::new(Communicator::create(id, size, rank, 0, options).unwrap());
    let here = Endpoint { process: rank as u32, device: 0 };
    let names = ["tensor", "rows"];
    let (half_rows, half_cols) = (ROWS / 2, COLS / 2);
    let mut table = Table { tensors: names.map(spec).to_vec(), ..Table::default() };
    let (mut sources, mut outputs): (Option<M>, Option<Outputs<M>>) = (None, None);
    let engine = rank.checked_sub(TRAINERS).map(|e| e as u64);
    match engine {
        None => {
            // Trainer `rank`: its column half of the weight, one buffer offered as both tensors.
            let source = M::new((ROWS * half_cols * 2) as usize);
            for tensor in 0..2 {
                table.offers.push(Offer {
                    tensor,
                    owner: here,
                    addr: source.addr(),
                    region: Region {
                        offset: vec![0, rank as u64 * half_cols],
                        extent: vec![ROWS, half_cols],
                    },
                    strides: None,
                    digest: None,
                });
            }
            sources = Some(source);
        }
        Some(e) => {
            let out = Outputs {
                tensor_codes: M::new((half_rows * COLS) as usize),
                tensor_scale: M::new(4),
                rows_codes: M::new((ROWS * half_cols) as usize),
                rows_scales: M::new((ROWS * 4) as usize),
            };
            let need =
                |tensor: u32, addr: u64, region: Region, cols: u64, quantization, scales: u64| QuantNeed {
                    tensor,
                    receiver: here,
                    addr,
                    region,
                    strides: vec![cols, 1],
                    quantization,
                    source: SourceType::Bf16,
                    scales,
                    scale_row_stride: 1,
                    scale_matrix_stride: 1,
                    staging: 0,
                };
            let tensor_box = Region { offset: vec![e * half_rows, 0], extent: vec![half_rows, COLS] };
            let rows_box = Region { offset: vec![0, e * half_cols], extent: vec![ROWS, half_cols] };
            table.quant_needs = vec![
                need(0, out.tensor_codes.addr(), tensor_box, COLS, per_tensor(), out.tensor_scale.addr()),
                need(1, out.rows_codes.addr(), rows_box, half_cols, per_row(), out.rows_scales.addr()),
            ];
            table.shared_amax = vec![
                SharedAmax { process: rank as u32, scale: out.tensor_scale.addr(), key: TENSOR_KEY },
                SharedAmax { process: rank as u32, scale: out.rows_scales.addr(), key: ROWS_KEY },
            ];
            outputs = Some(out);
        }
    }
    let share = build_plan(&comm, &table, &PlanOptions::default()).unwrap();
    assert_eq!(share.amax_exchange().keys.len(), 2, "rank {rank}: both sets exchange their amaxes");
    assert_eq!(share.amax_exchange().processes, vec![0, 1], "rank {rank}: the trainers quantize");
    for route in share.quant_routes() {
        assert_eq!(route.path, QuantPath::Sender, "rank {rank}: {route:?}");
    }
    if engine == Some(0) {
        // The checks can fail: neither engine's boxes nor either trainer's halves alone give the
        // whole weight's scales.
        let bf16 = weight(0);
        let mine = cut(&bf16, COLS * 2, 0..half_rows, 0..COLS * 2);
        assert_ne!(reference_bf16(per_tensor(), &mine, half_rows, COLS).1, expected(0, &bf16)[1]);
        let left = cut(&bf16, COLS * 2, 0..ROWS, 0..half_cols * 2);
        assert_ne!(reference_bf16(per_row(), &left, ROWS, half_cols).1, expected(0, &bf16)[3]);
    }
    let cases = [
        (CommitMode::Direct, false),
        (CommitMode::Staged, false),
        (CommitMode::Direct, true),
        (CommitMode::Staged, true),
    ];
    for (commit, verify) in cases {
        let options = ExecOptions { commit, verify, ..ExecOptions::default() };
        let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
        for step in 0..2 {
            let at = format!("rank {rank} ipc {ipc} {commit:?} verify {verify} step {step}");
            let bf16 = weight(step);
            if let Some(source) = sources.as_mut() {
                let col_bytes = rank as u64 * half_cols * 2;
                source.write(&cut(&bf16, COLS * 2, 0..ROWS, col_bytes..col_bytes + half_cols * 2));
            }
            if let Some(out) = outputs.as_mut() {
                for m in
                    [&mut out.tensor_codes, &mut out.tensor_scale, &mut out.rows_codes, &mut out.rows_scales]
                {
                    let len = m.read().len();
                    m.write(&vec![SENTINEL; len]);
                }
            }
            comm.allgather_bytes(b"ready").unwrap();
            // SAFETY: every address of the share is a buffer above (or a peer's, alive until the
            // meeting below); the calls complete on return (no scope is open).
            let ran = unsafe { executor.run(&group) }.unwrap();
            if commit == CommitMode::Staged {
                comm.allgather_bytes(b"ran").unwrap();
                // SAFETY: as above.
                unsafe { executor.commit(&group) }.unwrap();
            }
            if engine.is_none() {
                // Each trainer quantizes its column half of both weights.
                assert_eq!(ran.quantized_elements, 2 * ROWS * half_cols, "{at}");
            }
            if let (Some(e), Some(out)) = (engine, outputs.as_ref()) {
                let want = expected(e, &bf16);
                let got = [&out.tensor_codes, &out.tensor_scale, &out.rows_codes, &out.rows_scales]
                    .map(|m| m.read());
                for (what, (got, want)) in
                    ["per-tensor codes", "the per-tensor scale", "per-row codes", "per-row scales"]
                        .iter()
                        .zip(got.iter().zip(&want))
                {
                    assert!(got == want, "{at}: {what} differ from the reference over the whole weight");
                }
            }
            comm.allgather_bytes(b"checked").unwrap();
        }
    }
}
