//! Digest and verify bench (issue 15, integrity; issue 26, many ranges). Three tables, every figure
//! from the same run:
//!
//! 1. The digest kernel's read GB/s at 1 MiB .. 1 GiB (16-byte aligned, and 3 bytes off), beside two
//!    peers reading the same bytes: a plain read-and-XOR kernel (16-byte loads, grid-stride, no
//!    arithmetic: what any one-pass reduction can reach) and `cuMemcpyDtoDAsync` (bytes copied / time).
//!    Target: >= 3,500 GB/s read on one H200.
//! 2. Digests of many ranges: 10^4 ranges of 1 MiB (distinct memory) in one `digest_many` launch
//!    (event-timed, and as the whole synchronous call: upload, launch, digests back), beside the
//!    same ranges as 10^4 synchronous one-range calls (the peer: what a publisher did before), and
//!    the 1 GiB one-range rate of table 1. Target: the launch's rate >= 0.9 of the 1 GiB rate.
//! 3. Verify against the batched copy of the same segments: the plain copy, the copy that records
//!    source tile digests (what it costs the copy), the check of the destinations against them, and
//!    the byte compare; then what a step with verify costs against a step without:
//!    (recording copy + check) / copy - 1, and (copy + compare) / copy - 1. Target: <= 60%.
//!
//! Times are CUDA-event medians after warm-up (wall-clock medians for synchronous calls). Prints markdown tables; writes
//! $REFIT_BENCH_RESULTS/gpu_digest.json.

#[path = "copy_support/mod.rs"]
mod copy_support;
#[path = "../tests/common/cuda.rs"]
mod cuda;
#[path = "../tests/common/random_batch.rs"]
mod random_batch;

use copy_support::{column_split, gbps, median, randomize, time_ms, MIB};
use cuda::{ok, on, Buffer, Stream};
use cudarc::driver::sys;
use random_batch::Rng;
use refit::kernels::digest::{ByteRange, DigestKernel};
use refit::kernels::gf64;
use refit::kernels::verify::VerifyBatch;
use refit::kernels::PreparedBatch;
use refit::transport::driver::{self, check};
use refit::transport::nvrtc::{self, Output};
use refit::Segment;
use std::ffi::c_void;
use std::time::Instant;

/// The peer: every thread XORs its 16-byte vectors (four in flight), one atomic per warp.
const READ_XOR: &str = r#"
typedef unsigned long long u64;
struct __align__(16) V { u64 a, b; };
extern "C" __global__ void __launch_bounds__(256) read_xor(const V* p, u64 n, u64* out) {
    u64 x = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        V v0 = p[i], v1 = p[i + stride], v2 = p[i + 2 * stride], v3 = p[i + 3 * stride];
        x ^= v0.a ^ v0.b ^ v1.a ^ v1.b ^ v2.a ^ v2.b ^ v3.a ^ v3.b;
    }
    for (; i < n; i += stride) x ^= p[i].a ^ p[i].b;
    for (int o = 16; o > 0; o /= 2) x ^= __shfl_xor_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0 && x != 0) atomicXor(out, x);
}
"#;

struct ReadXor {
    function: sys::CUfunction,
    blocks: u32,
}

impl ReadXor {
    fn load() -> ReadXor {
        use sys::CUdevice_attribute as A;
        let major = ok("attribute", driver::attribute(0, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR));
        let minor = ok("attribute", driver::attribute(0, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR));
        let sms = ok("attribute", driver::attribute(0, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT));
        let cubin = ok(
            "compiling the peer",
            nvrtc::compile(READ_XOR, "read_xor.cu", major, minor, Output::Cubin, &[]),
        );
        on(0, || {
            let mut module = std::ptr::null_mut();
            ok(
                "cuModuleLoadData",
                check("cuModuleLoadData", unsafe {
                    sys::cuModuleLoadData(&mut module, cubin.image.as_ptr().cast())
                }),
            );
            let mut function = std::ptr::null_mut();
            ok(
                "cuModuleGetFunction",
                check("cuModuleGetFunction", unsafe {
                    sys::cuModuleGetFunction(&mut function, module, c"read_xor".as_ptr())
                }),
            );
            ReadXor { function, blocks: sms as u32 * 8 }
        })
    }

    fn launch(&self, stream: &Stream, addr: u64, len: u64, out: u64) {
        let (mut p, mut n, mut o) = (addr, len / 16, out);
        let mut params: [*mut c_void; 3] =
            [(&mut p as *mut u64).cast(), (&mut n as *mut u64).cast(), (&mut o as *mut u64).cast()];
        on(0, || {
            ok(
                "cuLaunchKernel",
                check("cuLaunchKernel", unsafe {
                    sys::cuLaunchKernel(
                        self.function,
                        self.blocks,
                        1,
                        1,
                        256,
                        1,
                        1,
                        0,
                        stream.raw,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                }),
            )
        });
    }
}

fn memcpy(stream: &Stream, dst: u64, src: u64, len: u64) {
    on(0, || {
        ok(
            "cuMemcpyDtoDAsync",
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, stream.raw)
            }),
        )
    });
}

struct DigestRow {
    size: u64,
    offset: u64,
    digest: f64,
    read_xor: f64,
    memcpy: f64,
}

/// 10^4 ranges of 1 MiB: one launch against 10^4 one-range calls.
struct ManyRow {
    ranges: u64,
    range_bytes: u64,
    /// The launch alone (descriptors uploaded before), CUDA-event median.
    launch_ms: f64,
    /// The synchronous call: upload, launch, digests back, stream synchronize (wall median).
    call_ms: f64,
    /// 10^4 synchronous one-range calls (wall, median of 3 sweeps).
    single_calls_ms: f64,
}

impl ManyRow {
    fn bytes(&self) -> u64 {
        self.ranges * self.range_bytes
    }
}

/// Table 2: the digests of `RANGES` ranges of 1 MiB of distinct memory, in one launch and one by one.
fn measure_many(kernel: &DigestKernel, stream: &Stream, rng: &mut Rng) -> ManyRow {
    const RANGES: u64 = 10_000;
    let buffer = Buffer::new(0, (RANGES * MIB) as usize);
    randomize(&buffer, rng);
    let ranges: Vec<ByteRange> =
        (0..RANGES).map(|k| ByteRange { addr: buffer.ptr + k * MIB, len: MIB }).collect();
    // Correct before timed: a few ranges against the one-range kernel.
    let all = ok("digest_many", unsafe { kernel.digest_many(stream.raw, &ranges) });
    for k in [0, 1, RANGES / 2, RANGES - 1] {
        let one = ok("digest", unsafe { kernel.digest(stream.raw, ranges[k as usize].addr, MIB) });
        assert_eq!(all[k as usize], one, "range {k}: digest_many disagrees with digest");
    }
    let layout = ok("layout", kernel.many_layout(&ranges));
    let descriptors = Buffer::new(0, std::mem::size_of_val(layout.descriptors.as_slice()));
    // SAFETY: RangeDescriptor is plain old data.
    descriptors.upload(unsafe {
        std::slice::from_raw_parts(layout.descriptors.as_ptr().cast::<u8>(), descriptors.len)
    });
    let out = Buffer::new(0, 8 * RANGES as usize);
    // SAFETY: the descriptors name `buffer`, `out` holds one word per range, the stream is live.
    let launch_ms = time_ms(stream, 3, 15, || {
        ok("enqueue_many", unsafe { kernel.enqueue_many(stream.raw, &layout, descriptors.ptr, out.ptr) })
    });
    let wall_ms = |f: &mut dyn FnMut()| {
        let start = Instant::now();
        f();
        start.elapsed().as_secs_f64() * 1e3
    };
    let call_ms = median(
        (0..15)
            .map(|_| {
                wall_ms(&mut || drop(ok("digest_many", unsafe { kernel.digest_many(stream.raw, &ranges) })))
            })
            .collect(),
    );
    let single_calls_ms = median(
        (0..3)
            .map(|_| {
                wall_ms(&mut || {
                    for range in &ranges {
                        ok("digest", unsafe { kernel.digest(stream.raw, range.addr, range.len) });
                    }
                })
            })
            .collect(),
    );
    ManyRow { ranges: RANGES, range_bytes: MIB, launch_ms, call_ms, single_calls_ms }
}

struct VerifyRow {
    case: String,
    segments: usize,
    bytes: u64,
    copy_ms: f64,
    recording_ms: f64,
    check_ms: f64,
    compare_ms: f64,
}

impl VerifyRow {
    fn fused_overhead(&self) -> f64 {
        (self.recording_ms + self.check_ms) / self.copy_ms - 1.0
    }
    fn compare_overhead(&self) -> f64 {
        (self.copy_ms + self.compare_ms) / self.copy_ms - 1.0
    }
}

fn contiguous_split(src: u64, dst: u64, total: u64, size: u64) -> Vec<Segment> {
    (0..total / size).map(|k| Segment::contiguous(src + k * size, dst + k * size, size)).collect()
}

fn measure_verify(case: &str, segments: Vec<Segment>, stream: &Stream) -> VerifyRow {
    let bytes: u64 = segments.iter().map(|s| s.bytes().unwrap()).sum();
    let plain = ok("prepare", PreparedBatch::new(0, &segments, false));
    let recording = ok("prepare recording", PreparedBatch::recording_digests(0, &segments, false));
    let checker = ok("verify check", VerifyBatch::check(&recording));
    let comparer = ok("verify compare", VerifyBatch::compare(0, &segments));
    // SAFETY (all launches below): the segments name live buffers of this program; the stream is live.
    let copy_ms = time_ms(stream, 3, 15, || ok("copy", unsafe { plain.launch(stream.raw) }));
    let recording_ms =
        time_ms(stream, 3, 15, || ok("recording copy", unsafe { recording.launch(stream.raw) }));
    let check_ms = time_ms(stream, 3, 15, || ok("check", unsafe { checker.launch(stream.raw) }));
    stream.sync();
    assert_eq!(ok("check outcome", checker.outcome()), None, "{case}: the check found a difference");
    let compare_ms = time_ms(stream, 3, 15, || ok("compare", unsafe { comparer.launch(stream.raw) }));
    stream.sync();
    assert_eq!(ok("compare outcome", comparer.outcome()), None, "{case}: the compare found a difference");
    let row = VerifyRow {
        case: case.to_string(),
        segments: segments.len(),
        bytes,
        copy_ms,
        recording_ms,
        check_ms,
        compare_ms,
    };
    println!(
        "| {} | {} | {} | {:.1} | {:+.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% |",
        row.case,
        row.segments,
        row.bytes / MIB,
        gbps(row.bytes, row.copy_ms),
        100.0 * (row.recording_ms / row.copy_ms - 1.0),
        100.0 * row.check_ms / row.copy_ms,
        100.0 * row.compare_ms / row.copy_ms,
        100.0 * row.fused_overhead(),
        100.0 * row.compare_overhead(),
    );
    row
}

fn main() {
    let kernel = ok("loading the digest kernel", DigestKernel::for_device(0));
    println!("digest kernel: {}", kernel.build);
    let peer = ReadXor::load();
    let stream = Stream::new(0);
    let mut rng = Rng::new(15);
    let src = Buffer::new(0, (1 << 30) + 4096);
    randomize(&src, &mut rng);
    let dst = Buffer::new(0, (1 << 30) + 4096);
    let out = Buffer::new(0, 8);

    // A spot check that the timed kernel digests right: 1 MiB + 5 at offset 3 against the host.
    let mut host = vec![0u8; (MIB + 5) as usize];
    on(0, || {
        ok(
            "cuMemcpyDtoH",
            check("cuMemcpyDtoH", unsafe {
                sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), src.ptr + 3, host.len())
            }),
        )
    });
    let device_digest = ok("digest", unsafe { kernel.digest(stream.raw, src.ptr + 3, MIB + 5) });
    assert_eq!(device_digest, gf64::digest(&host), "the digest kernel disagrees with the host");

    println!("\n| MiB | offset | digest read GB/s | read-XOR kernel GB/s | cuMemcpyDtoD GB/s (payload) | digest / read-XOR |");
    println!("|---|---|---|---|---|---|");
    let mut digest_rows = Vec::new();
    for size in [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 << 30] {
        for offset in [0u64, 3] {
            if offset != 0 && size < 64 * MIB {
                continue;
            }
            let reps = if size >= 256 * MIB { 10 } else { 30 };
            let addr = src.ptr + offset;
            // SAFETY: the range lies in `src`, `out` is a device word, the stream is live.
            let digest_ms = time_ms(&stream, 3, reps, || {
                ok("digest", unsafe { kernel.enqueue(stream.raw, addr, size, out.ptr) })
            });
            let xor_ms = time_ms(&stream, 3, reps, || peer.launch(&stream, src.ptr, size, out.ptr));
            let memcpy_ms = time_ms(&stream, 3, reps, || memcpy(&stream, dst.ptr, src.ptr, size));
            let row = DigestRow {
                size,
                offset,
                digest: gbps(size, digest_ms),
                read_xor: gbps(size, xor_ms),
                memcpy: gbps(size, memcpy_ms),
            };
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.3} |",
                size / MIB,
                offset,
                row.digest,
                row.read_xor,
                row.memcpy,
                row.digest / row.read_xor
            );
            digest_rows.push(row);
        }
    }

    // Host time of the synchronous call (kernel, 8-byte copy back, stream synchronize) at 1 MiB.
    let host_us = median(
        (0..50)
            .map(|_| {
                let start = Instant::now();
                ok("digest", unsafe { kernel.digest(stream.raw, src.ptr, MIB) });
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    );
    println!("\nsynchronous digest of 1 MiB: {host_us:.1} us wall time (median)");

    let many = measure_many(&kernel, &stream, &mut rng);
    let one_gib =
        digest_rows.iter().find(|r| r.size == 1 << 30 && r.offset == 0).map_or(f64::NAN, |r| r.digest);
    let launch_gbps = gbps(many.bytes(), many.launch_ms);
    println!("\n| 10^4 ranges of 1 MiB | ms | GB/s | / 1 GiB one-range rate ({one_gib:.0} GB/s) |");
    println!("|---|---|---|---|");
    println!(
        "| one launch (digest_many's kernel) | {:.3} | {launch_gbps:.0} | {:.3} |",
        many.launch_ms,
        launch_gbps / one_gib
    );
    let call_gbps = gbps(many.bytes(), many.call_ms);
    println!(
        "| one synchronous digest_many call | {:.3} | {call_gbps:.0} | {:.3} |",
        many.call_ms,
        call_gbps / one_gib
    );
    let single_gbps = gbps(many.bytes(), many.single_calls_ms);
    println!(
        "| peer: 10^4 synchronous digest calls | {:.3} | {single_gbps:.0} | {:.3} |",
        many.single_calls_ms,
        single_gbps / one_gib
    );

    println!("\n| case | segments | MiB | copy GB/s | recording copy vs copy | check / copy | compare / copy | copy+digests+check vs copy | copy+compare vs copy |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut verify_rows = Vec::new();
    for (size, total) in [(MIB, 1 << 30), (64 << 10, 1 << 30), (4096, 256 * MIB), (512, 64 * MIB)] {
        let name =
            if size >= MIB { format!("{} MiB", size / MIB) } else { format!("{} KiB", size as f64 / 1024.0) };
        verify_rows.push(measure_verify(&name, contiguous_split(src.ptr, dst.ptr, total, size), &stream));
    }
    verify_rows.push(measure_verify("column split", column_split(src.ptr, dst.ptr), &stream));

    let dir = std::env::var("REFIT_BENCH_RESULTS").unwrap_or_else(|_| "benches/results".to_string());
    std::fs::create_dir_all(&dir).expect("results directory");
    let digest_items: Vec<String> = digest_rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"bytes\": {}, \"offset\": {}, \"digest_gbps\": {:.1}, \"read_xor_gbps\": {:.1}, \"memcpy_dtod_gbps\": {:.1}}}",
                r.size, r.offset, r.digest, r.read_xor, r.memcpy
            )
        })
        .collect();
    let verify_items: Vec<String> = verify_rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"case\": \"{}\", \"segments\": {}, \"bytes\": {}, \"copy_ms\": {:.4}, \"recording_copy_ms\": {:.4}, \"check_ms\": {:.4}, \"compare_ms\": {:.4}, \"fused_overhead\": {:.4}, \"compare_overhead\": {:.4}}}",
                r.case, r.segments, r.bytes, r.copy_ms, r.recording_ms, r.check_ms, r.compare_ms, r.fused_overhead(), r.compare_overhead()
            )
        })
        .collect();
    let many_item = format!(
        "{{\"ranges\": {}, \"range_bytes\": {}, \"launch_ms\": {:.4}, \"launch_gbps\": {:.1}, \"call_ms\": {:.4}, \"call_gbps\": {:.1}, \"single_calls_ms\": {:.4}, \"single_calls_gbps\": {:.1}, \"one_range_1gib_gbps\": {:.1}, \"launch_vs_1gib\": {:.4}, \"call_vs_1gib\": {:.4}}}",
        many.ranges,
        many.range_bytes,
        many.launch_ms,
        launch_gbps,
        many.call_ms,
        call_gbps,
        many.single_calls_ms,
        single_gbps,
        one_gib,
        launch_gbps / one_gib,
        call_gbps / one_gib
    );
    let json = format!(
        "{{\n  \"bench\": \"gpu_digest\",\n  \"kernel\": \"{}\",\n  \"units\": \"GB/s (1e9 bytes/s) of bytes read; overheads as fractions of the plain copy's time\",\n  \"sync_digest_1mib_us\": {:.1},\n  \"digest\": [\n{}\n  ],\n  \"many_ranges\": [\n    {}\n  ],\n  \"verify\": [\n{}\n  ]\n}}\n",
        kernel.build,
        host_us,
        digest_items.join(",\n"),
        many_item,
        verify_items.join(",\n")
    );
    let path = format!("{dir}/gpu_digest.json");
    std::fs::write(&path, json).expect("writing results");
    println!("\nwrote {path}");
}
