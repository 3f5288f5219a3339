//! Quantizing copy bench (issue 29): a 1 GiB bf16 matrix (65536 x 8192) quantized to FP8 e4m3 by
//! refit's kernel (128 x 128 blocks, and per row, MXFP8 and per tensor), beside a plain device copy
//! of the same bf16 bytes in the same run (`cuMemcpyDtoDAsync`). The memory bound of a quantizing
//! copy moves 3 bytes per element (2 read, 1 written) against the copy's 4, so at the copy's rate it
//! takes 3/4 of the copy's time; the figure of merit is that bound over our time (target >= 0.8).
//! Per tensor the whole tensor's amax precedes its first code, so the source is read twice: 5 bytes
//! per element, 5/4 of the copy's time, and that row is judged against its own bound.
//! torch's eager and compiled quantizers are timed beside ours by benches/quant_peer.py.
//!
//! Every call is timed as a caller sees it (descriptor upload, launches, frees), as CUDA-event medians
//! after warm-up. First rows of the output are checked against the Rust reference. Prints a markdown
//! table; writes $REFIT_BENCH_RESULTS/gpu_quant.json.

#[path = "copy_support/mod.rs"]
#[allow(dead_code)]
mod copy_support;
#[path = "../tests/common/cuda.rs"]
mod cuda;
#[path = "../tests/common/random_batch.rs"]
mod random_batch;

use copy_support::{gbps, time_ms};
use cuda::{ok, on, Buffer, Stream};
use cudarc::driver::sys;
use random_batch::Rng;
use refit::kernels::quantize::{layout, QuantizeKernel};
use refit::quant::reference::{quantize, SourceMatrix};
use refit::quant::{Fp8, Granularity, QuantJob, Quantization, SourceType};
use refit::transport::driver::check;

const ROWS: u64 = 65536;
const COLS: u64 = 8192;

/// Fills `buffer` with finite bf16 values over 16 binades (a 64 MiB random pattern, repeated).
fn fill_bf16(buffer: &Buffer, rng: &mut Rng) {
    let block = 64usize << 20;
    let mut bytes = vec![0u8; block];
    for pair in bytes.chunks_exact_mut(2) {
        let r = rng.next();
        let bits = ((r & 0x8000) | ((118 + (r >> 16) % 16) << 7) | ((r >> 24) & 0x7f)) as u16;
        pair.copy_from_slice(&bits.to_le_bytes());
    }
    let mut at = 0;
    while at < buffer.len {
        let n = block.min(buffer.len - at);
        on(0, || {
            ok(
                "cuMemcpyHtoD",
                check("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(buffer.ptr + at as u64, bytes.as_ptr().cast(), n)
                }),
            )
        });
        at += n;
    }
}

fn download(ptr: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    on(0, || {
        ok(
            "cuMemcpyDtoH",
            check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(bytes.as_mut_ptr().cast(), ptr, len) }),
        )
    });
    bytes
}

struct Row {
    name: &'static str,
    ms: f64,
    bytes_per_element: u64,
}

impl Row {
    /// The least time this granularity can take: its bytes at the plain copy's rate (4 B/element).
    fn bound_ms(&self, copy_ms: f64) -> f64 {
        copy_ms * self.bytes_per_element as f64 / 4.0
    }
}

fn main() {
    let kernel = ok("loading the quantize kernel", QuantizeKernel::for_device(0));
    println!("quantize kernel: {}", kernel.build);
    let stream = Stream::new(0);
    let mut rng = Rng::new(29);
    let elements = ROWS * COLS;
    let src = Buffer::new(0, (elements * 2) as usize);
    fill_bf16(&src, &mut rng);
    let copy_dst = Buffer::new(0, (elements * 2) as usize);
    let dst = Buffer::new(0, elements as usize);
    let scales = Buffer::new(0, (ROWS * COLS.div_ceil(32)) as usize * 4);

    let copy_ms = time_ms(&stream, 3, 20, || {
        on(0, || {
            ok(
                "cuMemcpyDtoDAsync",
                check("cuMemcpyDtoDAsync", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(copy_dst.ptr, src.ptr, (elements * 2) as usize, stream.raw)
                }),
            )
        })
    });
    let copy_rate = gbps(elements * 4, copy_ms); // bytes read + written per second
    let bound_ms = copy_ms * 3.0 / 4.0;

    let job = |granularity: Granularity| {
        let q = Quantization::new(Fp8::E4m3fn, granularity);
        let (_, grid_cols) = q.scale_grid(ROWS, COLS);
        QuantJob {
            quantization: q,
            source: SourceType::Bf16,
            src: src.ptr,
            rows: ROWS,
            cols: COLS,
            src_stride: COLS,
            dst: dst.ptr,
            dst_stride: COLS,
            scales: scales.ptr,
            scale_stride: grid_cols,
            amax_key: 0,
        }
    };
    let mut rows = Vec::new();
    for (name, granularity) in [
        ("block 128x128", Granularity::Block { rows: 128, cols: 128 }),
        ("per row", Granularity::Row),
        ("MXFP8", Granularity::Mx),
        ("per tensor (2 launches)", Granularity::Tensor),
    ] {
        let jobs = [job(granularity)];
        let l = ok("layout", layout(&jobs));
        let ms = time_ms(&stream, 3, 20, || ok("quantize", unsafe { kernel.enqueue(stream.raw, &l) }));
        // The first 128 rows against the reference.
        stream.sync();
        let q = jobs[0].quantization;
        let (_, grid_cols) = q.scale_grid(ROWS, COLS);
        let check_rows = 128u64;
        let source = download(src.ptr, (check_rows * COLS * 2) as usize);
        let got = download(dst.ptr, (check_rows * COLS) as usize);
        let scale_rows = q.scale_grid(check_rows, COLS).0;
        let scale_bytes = (scale_rows * grid_cols * q.scale_kind().size()) as usize;
        let got_scales = download(scales.ptr, scale_bytes);
        if granularity != Granularity::Tensor {
            let matrix = SourceMatrix {
                bytes: &source,
                source: SourceType::Bf16,
                rows: check_rows,
                cols: COLS,
                stride: COLS,
            };
            let (mut want, mut want_scales) = (vec![0u8; got.len()], vec![0u8; scale_bytes]);
            quantize(q, &matrix, &mut want, COLS, &mut want_scales, grid_cols);
            assert!(
                got == want && got_scales == want_scales,
                "{name}: the GPU's bytes differ from the reference"
            );
        }
        // Bytes each element moves at the least: per tensor reads its source twice (amax, codes).
        let bytes_per_element = if granularity == Granularity::Tensor { 5 } else { 3 };
        rows.push(Row { name, ms, bytes_per_element });
    }

    // The same tensor as three jobs sharing one per-tensor scale (a fused QKV's q, k and v: half, a
    // quarter and a quarter of the rows): one amax over all three, so the same codes and scale as
    // the one per-tensor job above (which ran last), compared whole.
    let (one_job_codes, one_job_scale) = (download(dst.ptr, elements as usize), download(scales.ptr, 4));
    ok(
        "clearing the codes",
        on(0, || check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dst.ptr, 0, elements as usize) })),
    );
    let whole = job(Granularity::Tensor);
    let parts: Vec<QuantJob> = [(0, ROWS / 2), (ROWS / 2, ROWS / 4), (3 * ROWS / 4, ROWS / 4)]
        .into_iter()
        .map(|(first, rows)| QuantJob {
            src: src.ptr + first * COLS * 2,
            dst: dst.ptr + first * COLS,
            rows,
            ..whole
        })
        .collect();
    let l = ok("layout", layout(&parts));
    let ms = time_ms(&stream, 3, 20, || ok("quantize", unsafe { kernel.enqueue(stream.raw, &l) }));
    stream.sync();
    assert!(
        download(dst.ptr, elements as usize) == one_job_codes && download(scales.ptr, 4) == one_job_scale,
        "three jobs sharing one scale differ from the one per-tensor job"
    );
    rows.push(Row { name: "per tensor, 3 jobs sharing one scale", ms, bytes_per_element: 5 });

    // The same tensor as two column halves quantized per row by two jobs with their own scales,
    // sharing each row's amax through one key (a row-parallel weight on two receivers): two phases,
    // the same codes as one per-row job over whole rows, and both halves' scales its scales.
    let per_row = job(Granularity::Row);
    let one_row_job = [per_row];
    let l = ok("layout", layout(&one_row_job));
    ok("quantize", unsafe { kernel.enqueue(stream.raw, &l) });
    stream.sync();
    let (whole_rows_codes, whole_rows_scales) =
        (download(dst.ptr, elements as usize), download(scales.ptr, (ROWS * 4) as usize));
    ok(
        "clearing the codes",
        on(0, || check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dst.ptr, 0, elements as usize) })),
    );
    let halves: Vec<QuantJob> = (0..2u64)
        .map(|k| QuantJob {
            src: src.ptr + k * COLS,
            cols: COLS / 2,
            dst: dst.ptr + k * COLS / 2,
            scales: scales.ptr + k * ROWS * 4,
            scale_stride: 1,
            amax_key: 1,
            ..per_row
        })
        .collect();
    let l = ok("layout", layout(&halves));
    let ms = time_ms(&stream, 3, 20, || ok("quantize", unsafe { kernel.enqueue(stream.raw, &l) }));
    stream.sync();
    assert!(
        download(dst.ptr, elements as usize) == whole_rows_codes,
        "two halves sharing row amaxes: codes differ"
    );
    for k in 0..2 {
        let got = download(scales.ptr + k * ROWS * 4, (ROWS * 4) as usize);
        assert!(got == whole_rows_scales, "two halves sharing row amaxes: half {k}'s scales differ");
    }
    rows.push(Row {
        name: "per row, 2 column halves sharing each row's amax (2 launches)",
        ms,
        bytes_per_element: 5,
    });

    let executor_rows = through_executor(&src, &dst, &scales, &stream);

    println!("\n1 GiB bf16 ({ROWS} x {COLS}) to e4m3; plain copy {copy_ms:.3} ms ({copy_rate:.0} GB/s moved); memory bound of a quantizing copy {bound_ms:.3} ms\n");
    println!(
        "| granularity | ms | B/element at least | GB/s moved | bound ms | bound / ours (target >= 0.8) |"
    );
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.3} | {} | {:.0} | {:.3} | {:.2} |",
            r.name,
            r.ms,
            r.bytes_per_element,
            gbps(elements * r.bytes_per_element, r.ms),
            r.bound_ms(copy_ms),
            r.bound_ms(copy_ms) / r.ms
        );
    }

    println!("\nThe same tensor as a quantized need through a plan and an executor, host wall time per run (queued and waited for):\n");
    println!("| path | ms | B/element at least | bound ms | bound / ours |");
    println!("|---|---|---|---|---|");
    for r in &executor_rows {
        println!(
            "| {} | {:.3} | {} | {:.3} | {:.2} |",
            r.name,
            r.ms,
            r.bytes_per_element,
            r.bound_ms(copy_ms),
            r.bound_ms(copy_ms) / r.ms
        );
    }

    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).expect("results directory");
    let row_json = |r: &Row| {
        format!(
            "    {{\"path\": \"{}\", \"ms\": {:.4}, \"bytes_per_element\": {}, \"memory_bound_ms\": {:.4}, \"of_memory_bound\": {:.3}}}",
            r.name,
            r.ms,
            r.bytes_per_element,
            r.bound_ms(copy_ms),
            r.bound_ms(copy_ms) / r.ms
        )
    };
    let executor_items: Vec<String> = executor_rows.iter().map(row_json).collect();
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"granularity\": \"{}\", \"ms\": {:.4}, \"bytes_per_element\": {}, \"gbps_moved\": {:.1}, \"memory_bound_ms\": {:.4}, \"of_memory_bound\": {:.3}}}",
                r.name,
                r.ms,
                r.bytes_per_element,
                gbps(elements * r.bytes_per_element, r.ms),
                r.bound_ms(copy_ms),
                r.bound_ms(copy_ms) / r.ms
            )
        })
        .collect();
    let json = format!(
        "{{\n  \"bench\": \"gpu_quant\",\n  \"kernel\": \"{}\",\n  \"shape\": [{ROWS}, {COLS}],\n  \"source\": \"bf16\",\n  \"target\": \"e4m3fn\",\n  \"copy_ms\": {copy_ms:.4},\n  \"memory_bound_ms\": {bound_ms:.4},\n  \"units\": \"ms per call (CUDA-event medians); GB/s of bytes moved; of_memory_bound = bound / ours\",\n  \"quantize\": [\n{}\n  ],\n  \"through_executor\": [\n{}\n  ]\n}}\n",
        kernel.build,
        items.join(",\n"),
        executor_items.join(",\n")
    );
    let path = format!("{dir}/gpu_quant.json");
    std::fs::write(&path, json).expect("writing results");
    println!("\nwrote {path}");
}

/// The bench's tensor as one quantized need of a plan whose two offers are its row halves: in 128 x 128
/// blocks cut on a block boundary (quantized in place, 3 B/element), and cut inside a block (routed
/// into staging, then quantized there: 4 + 3 B/element); per row and MXFP8 in place; per tensor in
/// place from one offer (its amax read first: 5 B/element). Then a step with a plain 256 MiB need
/// beside the in-place 128 x 128 one (1 B/element more), whose copy launch carries the quantization
/// (`kernels/copy_quantize.cu`), and that plain need alone. Each run's host wall time, median of 20
/// after 3 warm-ups; the codes' and scales' first rows are checked against the reference (but per
/// tensor's, whose scale comes from the whole tensor: tests/gpu_quant.rs checks that granularity).
fn through_executor(src: &Buffer, dst: &Buffer, scales: &Buffer, stream: &Stream) -> Vec<Row> {
    use refit::group::{BackendChoice, Group, GroupOptions};
    use refit::plan::{Endpoint, Need, Offer, QuantNeed, Region, Table, TensorSpec};

    let group =
        ok("a CUDA group", Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }));
    let here = Endpoint { process: 0, device: 0 };
    let block = Granularity::Block { rows: 128, cols: 128 };
    let staging = Buffer::new(0, (ROWS * COLS * 2) as usize);
    const PLAIN: u64 = 256 << 20;
    let (plain_src, plain_dst) = (Buffer::new(0, PLAIN as usize), Buffer::new(0, PLAIN as usize));
    let plain = |tensor: u32| {
        let region = Region { offset: vec![0], extent: vec![PLAIN] };
        let offer = Offer {
            tensor,
            owner: here,
            addr: plain_src.ptr,
            region: region.clone(),
            strides: None,
            digest: None,
        };
        (offer, Need { tensor, receiver: here, addr: plain_dst.ptr, region, perm: None, strides: vec![1] })
    };
    let mut out = Vec::new();
    let cases = [
        ("in place (offers cut at row 32768)", block, Some(ROWS / 2), false, 3),
        ("staged (offers cut at row 32700)", block, Some(32700), false, 7),
        ("in place, per row (offers cut at row 32768)", Granularity::Row, Some(ROWS / 2), false, 3),
        ("in place, MXFP8 (offers cut at row 32768)", Granularity::Mx, Some(ROWS / 2), false, 3),
        ("in place, per tensor (one offer)", Granularity::Tensor, Some(ROWS), false, 5),
        ("in place, and a 256 MiB plain need in the same launch", block, Some(ROWS / 2), true, 4),
        ("the 256 MiB plain need alone", block, None, true, 1),
    ];
    for (name, granularity, cut, with_plain, bytes_per_element) in cases {
        let q = Quantization::new(Fp8::E4m3fn, granularity);
        let (grid_rows, grid_cols) = q.scale_grid(ROWS, COLS);
        let offer = |lo: u64, rows: u64| Offer {
            tensor: 0,
            owner: here,
            addr: src.ptr + lo * COLS * 2,
            region: Region { offset: vec![lo, 0], extent: vec![rows, COLS] },
            strides: None,
            digest: None,
        };
        let mut table = Table {
            tensors: vec![TensorSpec { name: "w".into(), dtype: 1, elem_size: 2, shape: vec![ROWS, COLS] }],
            offers: vec![],
            needs: vec![],
            quant_needs: vec![],
            shared_amax: Vec::new(),
        };
        if with_plain {
            table.tensors.push(TensorSpec {
                name: "plain".into(),
                dtype: 0,
                elem_size: 1,
                shape: vec![PLAIN],
            });
            let (offer, need) = plain(1);
            table.offers.push(offer);
            table.needs.push(need);
        }
        let Some(cut) = cut else {
            out.push(Row { name, ms: step_ms(&group, &table), bytes_per_element });
            continue;
        };
        table.offers.push(offer(0, cut));
        if cut < ROWS {
            table.offers.push(offer(cut, ROWS - cut));
        }
        table.quant_needs.push(QuantNeed {
            tensor: 0,
            receiver: here,
            addr: dst.ptr,
            region: Region { offset: vec![0, 0], extent: vec![ROWS, COLS] },
            strides: vec![COLS, 1],
            quantization: q,
            source: SourceType::Bf16,
            scales: scales.ptr,
            scale_row_stride: grid_cols,
            scale_matrix_stride: grid_rows * grid_cols,
            staging: staging.ptr,
        });
        let ms = step_ms(&group, &table);
        stream.sync();
        if granularity == Granularity::Tensor {
            out.push(Row { name, ms, bytes_per_element });
            continue;
        }
        let check_rows = 128u64;
        let source = download(src.ptr, (check_rows * COLS * 2) as usize);
        let got = download(dst.ptr, (check_rows * COLS) as usize);
        let scale_rows = q.scale_grid(check_rows, COLS).0;
        let got_scales = download(scales.ptr, (scale_rows * grid_cols * q.scale_kind().size()) as usize);
        let matrix = SourceMatrix {
            bytes: &source,
            source: SourceType::Bf16,
            rows: check_rows,
            cols: COLS,
            stride: COLS,
        };
        let (mut want, mut want_scales) = (vec![0u8; got.len()], vec![0u8; got_scales.len()]);
        quantize(q, &matrix, &mut want, COLS, &mut want_scales, grid_cols);
        assert!(
            got == want && got_scales == want_scales,
            "{name}: the executor's codes differ from the reference"
        );
        out.push(Row { name, ms, bytes_per_element });
    }
    out
}

/// The host wall time of one executor run of `table`'s plan, median of 20 after 3 warm-ups.
fn step_ms(group: &refit::group::Group, table: &refit::plan::Table) -> f64 {
    use refit::exec::{ExecOptions, Executor};
    use refit::plan::{self, PlanOptions};
    use std::time::Instant;

    let plan = ok("plan", plan::build(std::slice::from_ref(table), &PlanOptions::default()));
    let mut executor = ok("executor", Executor::new(group, &plan, 0, ExecOptions::default()));
    let mut times = Vec::new();
    for i in 0..23 {
        let started = Instant::now();
        // SAFETY: the plan names the bench's buffers, alive throughout; the run completes on return.
        ok("run", unsafe { executor.run(group) });
        if i >= 3 {
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    copy_support::median(times)
}
