//! Batched copy bench (issue 4): payload GB/s of our kernel beside the alternatives, measured in the
//! same run on the same buffers: `cuMemcpyBatchAsync`, one `cuMemcpyAsync` per segment, and one large
//! device-to-device copy of the same total (the ceiling). Same GPU and GPU0 -> GPU1, segment sizes
//! 256 B .. 16 MiB, and the tensor-parallel column split. Also the host time to launch a prepared
//! batch of 1,000,000 segments. `torch._foreach_copy_` is measured by benches/copy_peer.py.
//!
//! Times are CUDA-event medians after warm-up. The two host-API columns are timed over the first
//! `API_CAP` segments only (issuing millions of calls would take minutes) and reported as GB/s of
//! the bytes they copied. Prints markdown tables; writes $REFIT_BENCH_RESULTS/gpu_copy.json.

#[path = "copy_support/mod.rs"]
mod copy_support;
#[path = "../tests/common/cuda.rs"]
mod cuda;
#[path = "../tests/common/random_batch.rs"]
mod random_batch;

use copy_support::{column_split, gbps, median, randomize, time_ms, MIB};
use cuda::{enable_peer, ok, on, Buffer, Stream};
use cudarc::driver::sys;
use random_batch::Rng;
use refit::kernels::layout::BatchLayout;
use refit::kernels::{copy_segments, BatchedCopy, PreparedBatch};
use refit::transport::cuda::cuda_backend;
use refit::transport::driver::check;
use refit::transport::Backend;
use refit::Segment;
use std::time::Instant;

const API_CAP: usize = 16384;

/// The kernel entry points with the test's promise kept: every segment names live buffers of this
/// program and every stream is a live stream of the right device (or NULL).
fn copy(device: i32, stream: sys::CUstream, segments: &[Segment], checked: bool) -> refit::Result<()> {
    // SAFETY: see above.
    unsafe { copy_segments(device, stream, segments, checked) }
}

fn launch(batch: &PreparedBatch, stream: sys::CUstream) -> refit::Result<()> {
    // SAFETY: see above.
    unsafe { batch.launch(stream) }
}

struct Row {
    case: String,
    path: &'static str,
    segments: usize,
    bytes: u64,
    ours: f64,
    ours_one_shot: f64,
    batch_api: f64,
    per_segment: f64,
    ceiling: f64,
}

fn read(device: i32, address: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    on(device, || {
        ok(
            "cuMemcpyDtoH",
            check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(bytes.as_mut_ptr().cast(), address, len) }),
        )
    });
    bytes
}

/// Spot-checks that every sampled run of the destination equals its source run.
fn verify(segments: &[Segment], src_device: i32, dst_device: i32, rng: &mut Rng) {
    for k in 0..48 {
        let s = &segments[if k == 0 { 0 } else { rng.range(0, segments.len() as u64 - 1) as usize }];
        let run = rng.range(0, s.count[0] * s.count[1] - 1);
        let (i, j) = (run % s.count[0], run / s.count[0]);
        let src = s.src + j * s.src_stride[1] + i * s.src_stride[0];
        let dst = s.dst + j * s.dst_stride[1] + i * s.dst_stride[0];
        let n = s.len.min(MIB) as usize;
        assert!(
            read(src_device, src, n) == read(dst_device, dst, n),
            "copy check failed at segment {s:?} run {run}"
        );
    }
}

/// `n` segments of `size` bytes: sources in order, destinations in a shuffled order.
fn scattered(src: u64, dst: u64, size: u64, n: u64, rng: &mut Rng) -> Vec<Segment> {
    let mut slots: Vec<u64> = (0..n).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.range(0, i as u64) as usize);
    }
    (0..n).map(|k| Segment::contiguous(src + k * size, dst + slots[k as usize] * size, size)).collect()
}

/// Every contiguous run (for the host-API columns), up to `cap`.
fn runs(segments: &[Segment], cap: usize) -> Vec<(u64, u64, u64)> {
    let mut list = Vec::new();
    for s in segments {
        s.for_each_run(|a, b, n| list.push((a, b, n)));
        if list.len() >= cap {
            break;
        }
    }
    list.truncate(cap);
    list
}

fn memcpy_batch(runs: &[(u64, u64, u64)], dst_device: i32, stream: &Stream) -> refit::Result<()> {
    let mut srcs: Vec<u64> = runs.iter().map(|r| r.0).collect();
    let mut dsts: Vec<u64> = runs.iter().map(|r| r.1).collect();
    let mut sizes: Vec<usize> = runs.iter().map(|r| r.2 as usize).collect();
    let location = |id| sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id };
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: location(stream.device),
        dstLocHint: location(dst_device),
        flags: 0,
    }];
    let mut index = [0usize];
    check("cuMemcpyBatchAsync", unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            runs.len(),
            attrs.as_mut_ptr(),
            index.as_mut_ptr(),
            1,
            stream.raw,
        )
    })
}

fn memcpy_each(runs: &[(u64, u64, u64)], stream: &Stream) -> refit::Result<()> {
    for &(src, dst, n) in runs {
        check("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst, src, n as usize, stream.raw) })?;
    }
    Ok(())
}

/// Times a peer column, or reports NaN (printed, null in JSON) when its first call fails, so that one
/// failing API does not lose the rest of the run.
fn time_or_nan(name: &str, stream: &Stream, reps: usize, mut work: impl FnMut() -> refit::Result<()>) -> f64 {
    if let Err(err) = work() {
        println!("{name} failed, column left empty: {err}");
        return f64::NAN;
    }
    time_ms(stream, 0, reps, || ok(name, work()))
}

fn measure(
    case: &str,
    path: &'static str,
    segments: &[Segment],
    src: &Buffer,
    dst: &Buffer,
    rng: &mut Rng,
) -> Row {
    let device = src.device; // the kernel runs on the source GPU (pushes to a peer destination)
    let stream = Stream::new(device);
    let bytes: u64 = segments.iter().map(|s| s.bytes().unwrap()).sum();
    let prepared = ok("PreparedBatch::new", PreparedBatch::new(device, segments, false));
    let reps = if bytes >= 512 * MIB { 10 } else { 20 };
    let ours_ms = time_ms(&stream, 3, reps, || ok("launch", launch(&prepared, stream.raw)));
    on(device, || ok("sync", check("sync", unsafe { sys::cuStreamSynchronize(stream.raw) })));
    verify(segments, src.device, dst.device, rng);
    let one_shot_ms =
        time_ms(&stream, 1, 3, || ok("copy_segments", copy(device, stream.raw, segments, false)));
    let api_runs = runs(segments, API_CAP);
    let api_bytes: u64 = api_runs.iter().map(|r| r.2).sum();
    let batch_ms = on(device, || {
        time_or_nan("cuMemcpyBatchAsync", &stream, 3, || memcpy_batch(&api_runs, dst.device, &stream))
    });
    let each_ms = on(device, || time_or_nan("cuMemcpyAsync", &stream, 3, || memcpy_each(&api_runs, &stream)));
    let ceiling_ms = on(device, || {
        time_ms(&stream, 2, reps, || {
            ok(
                "cuMemcpyAsync",
                check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(dst.ptr, src.ptr, bytes as usize, stream.raw)
                }),
            )
        })
    });
    let row = Row {
        case: case.to_string(),
        path,
        segments: segments.len(),
        bytes,
        ours: gbps(bytes, ours_ms),
        ours_one_shot: gbps(bytes, one_shot_ms),
        batch_api: gbps(api_bytes, batch_ms),
        per_segment: gbps(api_bytes, each_ms),
        ceiling: gbps(bytes, ceiling_ms),
    };
    println!(
        "| {} | {} | {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0}% |",
        row.case,
        row.path,
        row.segments,
        row.bytes / MIB,
        row.ours,
        row.ours_one_shot,
        row.batch_api,
        row.per_segment,
        row.ceiling,
        100.0 * row.ours / row.ceiling
    );
    row
}

fn main() {
    let devices = cuda::device_count();
    let kernel = ok("loading the kernel", BatchedCopy::for_device(0));
    println!("batched copy kernel: {}", kernel.build);
    let mut rng = Rng::new(2026);
    let src = Buffer::new(0, (1 << 30) + (512 * MIB as usize));
    randomize(&src, &mut rng);
    let dst0 = Buffer::new(0, 1 << 30);
    let dst1 = if devices >= 2 {
        enable_peer(0, 1);
        enable_peer(1, 0);
        Some(Buffer::new(1, 1 << 30))
    } else {
        println!("one GPU: the GPU0 -> GPU1 rows are not measured");
        None
    };

    println!("\n| case | path | segments | MiB | ours GB/s | ours one-shot GB/s | cuMemcpyBatchAsync GB/s | cuMemcpyAsync each GB/s | one large copy GB/s | ours / ceiling |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let sizes = [256u64, 512, 4096, 64 << 10, MIB, 16 * MIB];
    for (dst, path) in [(Some(&dst0), "GPU0"), (dst1.as_ref(), "GPU0->GPU1")] {
        let Some(dst) = dst else { continue };
        for &size in &sizes {
            let total = if size <= 512 { 256 * MIB } else { 1 << 30 };
            let segments = scattered(src.ptr, dst.ptr, size, total / size, &mut rng);
            rows.push(measure(&format!("{size} B"), path, &segments, &src, dst, &mut rng));
        }
        let split = column_split(src.ptr, dst.ptr);
        rows.push(measure("column split 2048x768 of 1536", path, &split, &src, dst, &mut rng));
    }

    // Tile-size sweep on one GPU (prediction: flat within noise from 8 KiB up for large segments;
    // small tiles cost more per byte; the default is 8 KiB = 2^13).
    let shifts = [11u32, 12, 13, 14, 15, 16];
    println!(
        "\n| tile sweep, GPU0, GB/s | {} |",
        shifts.map(|s| format!("{} KiB", (1u64 << s) >> 10)).join(" | ")
    );
    println!("|---|{}", "---|".repeat(shifts.len()));
    let mut sweep = Vec::new();
    let sweep_stream = Stream::new(0);
    for (name, segments) in [
        ("512 B", scattered(src.ptr, dst0.ptr, 512, 256 * MIB / 512, &mut rng)),
        ("4096 B", scattered(src.ptr, dst0.ptr, 4096, (1 << 30) / 4096, &mut rng)),
        ("65536 B", scattered(src.ptr, dst0.ptr, 65536, (1 << 30) / 65536, &mut rng)),
        ("1048576 B", scattered(src.ptr, dst0.ptr, MIB, 1024, &mut rng)),
        ("column split", column_split(src.ptr, dst0.ptr)),
    ] {
        let bytes: u64 = segments.iter().map(|s| s.bytes().unwrap()).sum();
        let mut cells = Vec::new();
        for &shift in &shifts {
            let prepared = ok("with_tile_shift", PreparedBatch::tuned(0, &segments, false, shift, 0));
            let ms = time_ms(&sweep_stream, 2, 10, || ok("launch", launch(&prepared, sweep_stream.raw)));
            cells.push(format!("{:.0}", gbps(bytes, ms)));
            sweep.push(format!(
                "    {{\"case\": \"{name}\", \"tile_bytes\": {}, \"ours\": {:.2}}}",
                1u64 << shift,
                gbps(bytes, ms)
            ));
        }
        println!("| {name} | {} |", cells.join(" | "));
    }

    // Lanes per tile (prediction: 8 or 16 lanes beat 32 for 256 B and 512 B segments, by up to 2x, since
    // more round trips are in flight per warp; no difference from 4 KiB up).
    println!("\n| lanes per tile, GPU0, GB/s | 8 | 16 | 32 | auto |");
    println!("|---|---|---|---|---|");
    for (name, segments) in [
        ("256 B", scattered(src.ptr, dst0.ptr, 256, 256 * MIB / 256, &mut rng)),
        ("512 B", scattered(src.ptr, dst0.ptr, 512, 256 * MIB / 512, &mut rng)),
        ("4096 B", scattered(src.ptr, dst0.ptr, 4096, (1 << 30) / 4096, &mut rng)),
        ("column split", column_split(src.ptr, dst0.ptr)),
    ] {
        let bytes: u64 = segments.iter().map(|s| s.bytes().unwrap()).sum();
        let mut cells = Vec::new();
        for lanes in [8u32, 16, 32, 0] {
            let shift = BatchLayout::default_tile_shift();
            let prepared = ok("tuned", PreparedBatch::tuned(0, &segments, false, shift, lanes));
            let ms = time_ms(&sweep_stream, 2, 10, || ok("launch", launch(&prepared, sweep_stream.raw)));
            cells.push(format!("{:.0}", gbps(bytes, ms)));
            sweep.push(format!(
                "    {{\"case\": \"{name}\", \"tile_bytes\": {}, \"lanes_per_tile\": {}, \"ours\": {:.2}}}",
                1u64 << shift,
                if lanes == 0 { prepared.geometry().2 } else { lanes },
                gbps(bytes, ms)
            ));
        }
        println!("| {name} | {} |", cells.join(" | "));
    }

    // Host time to launch a prepared batch of 1,000,000 segments (256 B each).
    let stream = Stream::new(0);
    let million = scattered(src.ptr, dst0.ptr, 256, 1_000_000, &mut rng);
    let prepared = ok("PreparedBatch::new", PreparedBatch::new(0, &million, false));
    let mut host_us = Vec::new();
    for _ in 0..60 {
        let start = Instant::now();
        ok("launch", launch(&prepared, stream.raw));
        host_us.push(start.elapsed().as_secs_f64() * 1e6);
    }
    stream.sync();
    let launch_us = median(host_us[10..].to_vec());
    println!("\n| prepared batch | segments | host launch us (median) | target us |");
    println!("|---|---|---|---|");
    println!("| 256 B x 1,000,000 | {} | {launch_us:.2} | 10 |", prepared.segments());

    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).expect("results directory");
    let device = cuda_backend().map(|b| b.device_name(0)).unwrap_or_else(|e| panic!("needs a GPU: {e}"));
    let mut json =
        format!("{{\n  \"bench\": \"gpu_copy\",\n  \"device\": \"{device}\",\n  \"gpus\": {devices},\n");
    json +=
        &format!("  \"kernel\": \"{}\",\n  \"host_launch_us_1m_segments\": {launch_us:.3},\n", kernel.build);
    json += "  \"units\": \"GB/s of payload (1e9 bytes/s)\",\n  \"rows\": [\n";
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"case\": \"{}\", \"path\": \"{}\", \"segments\": {}, \"bytes\": {}, \"ours\": {:.2}, \
                 \"ours_one_shot\": {:.2}, \"cuMemcpyBatchAsync\": {:.3}, \"cuMemcpyAsync_each\": {:.3}, \
                 \"one_large_copy\": {:.2}}}",
                r.case, r.path, r.segments, r.bytes, r.ours, r.ours_one_shot, r.batch_api, r.per_segment, r.ceiling
            )
        })
        .collect();
    json += &items.join(",\n").replace("NaN", "null");
    json += "\n  ],\n  \"tile_sweep\": [\n";
    json += &sweep.join(",\n");
    json += "\n  ]\n}\n";
    let path = format!("{dir}/gpu_copy.json");
    std::fs::write(&path, json).expect("writing results");
    println!("\nwrote {path}");
}
