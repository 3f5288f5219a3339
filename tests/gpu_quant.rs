//! The quantize kernel on a real GPU (run on the GPU machine with `--ignored --test-threads=1`):
//! every FP8 byte and every scale equal to the Rust reference (`quant::reference`), for every target,
//! granularity and source type in odd shapes, with zero blocks, infinities, NaNs, subnormals and
//! exact rounding ties; the hardware conversion (sm_89 and later) against the reference's for every
//! bf16 value in range; a whole mixed batch in one call; `Backend::quantize_batch` through a CUDA
//! group, whose bad jobs are refused before the kernel loads; quantized needs through an executor;
//! and two processes on one GPU refitting each other with every quantized path
//! (tests/common/quant_across.rs), the sender's codes and scales written through CUDA IPC.

#[path = "common/amax_exchange.rs"]
mod amax_exchange;
#[path = "common/cuda.rs"]
mod cuda;
#[path = "common/processes.rs"]
mod processes;
#[path = "common/quant_across.rs"]
mod quant_across;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use cuda::{ok, Buffer, Stream};
use cudarc::driver::sys;
use quant_cases::{standard_cases, Aligned, Case, SENTINEL};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::kernels::quantize::{layout, QuantizeKernel};
use refit::quant::{Fp8, Granularity, Quantization, SourceType};
use refit::transport::driver::check;
use refit::transport::Stream as BackendStream;
use refit::Status;

/// The cases' buffers on device 0.
struct OnDevice {
    src: Buffer,
    dst: Buffer,
    scales: Buffer,
}

fn upload(case: &Case) -> OnDevice {
    let src = Buffer::new(0, case.src_len().max(16));
    src.upload(case.data.bytes());
    let dst = Buffer::new(0, case.dst_len().max(1));
    dst.fill(SENTINEL);
    let scales = Buffer::new(0, case.scale_len().max(1));
    scales.fill(SENTINEL);
    OnDevice { src, dst, scales }
}

/// Quantizes `cases` as one batch on the GPU and compares every byte with the reference.
fn check_on_gpu(cases: &[Case]) {
    let kernel = ok("loading the quantize kernel", QuantizeKernel::for_device(0));
    let stream = Stream::new(0);
    let buffers: Vec<OnDevice> = cases.iter().map(upload).collect();
    let jobs: Vec<_> =
        cases.iter().zip(&buffers).map(|(c, b)| c.job(b.src.ptr, b.dst.ptr, b.scales.ptr)).collect();
    let l = ok("layout", layout(&jobs));
    // SAFETY: the jobs name the buffers above, alive until after the synchronization.
    ok("enqueue", unsafe { kernel.enqueue(stream.raw, &l) });
    stream.sync();
    compare_with_reference(cases, &buffers);
}

/// Every code and scale of `cases`, quantized into `buffers`, against the reference.
fn compare_with_reference(cases: &[Case], buffers: &[OnDevice]) {
    for (c, b) in cases.iter().zip(buffers) {
        let (want_dst, want_scales) = c.expected();
        let (dst, scales) = (b.dst.download(), b.scales.download());
        if let Some(at) = (0..want_scales.len()).find(|&i| scales[i] != want_scales[i]) {
            panic!(
                "{}: scale byte {at}: GPU {:#04x}, reference {:#04x}",
                c.name, scales[at], want_scales[at]
            );
        }
        if let Some(at) = (0..want_dst.len()).find(|&i| dst[i] != want_dst[i]) {
            let (row, col) = (at as u64 / c.dst_stride, at as u64 % c.dst_stride);
            panic!(
                "{}: element ({row}, {col}): GPU {:#04x}, reference {:#04x}",
                c.name, dst[at], want_dst[at]
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn every_case_matches_the_reference_one_job_at_a_time() {
    println!("quantize kernel: {}", ok("load", QuantizeKernel::for_device(0)).build);
    for case in standard_cases(21, true) {
        check_on_gpu(std::slice::from_ref(&case));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn every_case_matches_the_reference_in_one_batch() {
    check_on_gpu(&standard_cases(22, true));
}

/// Each case a one-shot batch of its own, queued back to back behind a long copy without waiting:
/// more batches in flight than upload slots (`kernels::upload`; the rest allocate their tables), per
/// tensor ones zeroing their amax words after the table, and a second round reusing the slots. Then
/// a stream under graph capture is refused, and the capture goes on.
#[test]
#[ignore = "needs a GPU"]
fn one_shot_batches_in_flight_at_once_each_read_their_own_table() {
    let kernel = ok("loading the quantize kernel", QuantizeKernel::for_device(0));
    let stream = Stream::new(0);
    let cases = standard_cases(23, true);
    assert!(cases.len() > refit::kernels::UPLOAD_SLOTS, "{} cases", cases.len());
    let busy = (Buffer::new(0, 1 << 30), Buffer::new(0, 1 << 30));
    for round in 0..2 {
        let buffers: Vec<OnDevice> = cases.iter().map(upload).collect();
        let layouts: Vec<_> = cases
            .iter()
            .zip(&buffers)
            .map(|(c, b)| ok("layout", layout(&[c.job(b.src.ptr, b.dst.ptr, b.scales.ptr)])))
            .collect();
        // About 4 ms of copying ahead of the batches, so that they queue while it runs.
        stream.occupy(&busy.0, &busy.1, 8);
        for l in &layouts {
            // SAFETY: the jobs name the buffers above, alive until after the synchronization.
            ok("enqueue", unsafe { kernel.enqueue(stream.raw, l) });
        }
        stream.sync();
        compare_with_reference(&cases, &buffers);
        println!(
            "round {round}: {} one-shot batches queued at once, every code and scale as the reference",
            cases.len()
        );
    }
    let buffers = upload(&cases[0]);
    let l = ok("layout", layout(&[cases[0].job(buffers.src.ptr, buffers.dst.ptr, buffers.scales.ptr)]));
    let mut graph = std::ptr::null_mut();
    cuda::on(0, || {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        ok(
            "cuStreamBeginCapture",
            check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(stream.raw, mode) }),
        );
        // SAFETY: as above.
        let refused = unsafe { kernel.enqueue(stream.raw, &l) };
        let ended = check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream.raw, &mut graph) });
        let err = refused.expect_err("a one-shot batch under graph capture");
        assert_eq!(err.status, Status::Unsupported, "{err}");
        assert!(err.message.contains("CUDA graph"), "{err}");
        ok("cuStreamEndCapture after the refusal", ended);
        ok("cuGraphDestroy", check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) }));
    });
}

#[test]
#[ignore = "needs a GPU"]
fn the_cast_of_every_bf16_value_in_range_matches_the_reference() {
    for target in [Fp8::E4m3fn, Fp8::E5m2] {
        // Per tensor with amax FP8_MAX: scale 1, so every code is the cast of the element itself.
        let mut values: Vec<u16> = vec![(target.max().to_bits() >> 16) as u16];
        values.extend((0..=u16::MAX).filter(|&b| {
            let x = f32::from_bits(u32::from(b) << 16);
            x.is_finite() && x.abs() <= target.max()
        }));
        let cols = 64u64;
        values.resize(values.len().next_multiple_of(cols as usize), 0);
        let rows = values.len() as u64 / cols;
        let mut data = Aligned::new(values.len() * 2, 0);
        for (i, v) in values.iter().enumerate() {
            data.bytes_mut()[i * 2..i * 2 + 2].copy_from_slice(&v.to_le_bytes());
        }
        let case = Case {
            name: format!("every bf16 in range, {target:?}"),
            quantization: Quantization::new(target, Granularity::Tensor),
            source: SourceType::Bf16,
            rows,
            cols,
            src_stride: cols,
            dst_stride: cols,
            scale_stride: 1,
            data,
        };
        let (_, scales) = case.expected();
        assert_eq!(f32::from_le_bytes(scales[..4].try_into().unwrap()), 1.0);
        check_on_gpu(std::slice::from_ref(&case));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_cuda_group_quantizes_through_the_backend_and_refuses_bad_jobs() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    let group =
        ok("a CUDA group", Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }));
    let cases = standard_cases(23, false);
    let case = &cases[14];
    let b = upload(case);
    let job = case.job(b.src.ptr, b.dst.ptr, b.scales.ptr);
    let backend = group.backend();
    // SAFETY: the job names the buffers above; the stream is synchronized before they are read.
    ok("quantize_batch", unsafe { backend.quantize_batch(0, BackendStream::NULL, &[job]) });
    ok("sync", backend.sync_stream(0, BackendStream::NULL));
    let (want_dst, want_scales) = case.expected();
    assert!(b.dst.download() == want_dst, "{}", case.name);
    assert!(b.scales.download() == want_scales, "{}", case.name);
    let mut bad = job;
    bad.src += 2;
    // SAFETY: refused before anything is queued.
    let err = unsafe { backend.quantize_batch(0, BackendStream::NULL, &[bad]) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("misaligned source rows"), "{}", err.message);
}

/// Also a dev aid without a GPU: `REFIT_NVRTC_LIBRARY=/path/to/libnvrtc.so.13 cargo test --test
/// gpu_quant compiles -- --ignored --nocapture` compiles the kernel for sm_90 and sm_80 (the
/// hardware FP8 conversion and the integer one) and prints ptxas's report.
#[test]
#[ignore = "needs libnvrtc (set REFIT_NVRTC_LIBRARY) or a GPU"]
fn the_kernel_compiles_for_hopper_and_ampere() {
    use refit::transport::nvrtc::{self, Output};
    let source = refit::kernels::quantize::module_source();
    let source = source.as_str();
    for (major, minor) in [(9, 0), (8, 0)] {
        let cubin =
            ok("CUBIN", nvrtc::compile(source, "quantize.cu", major, minor, Output::Cubin, &["-Xptxas=-v"]));
        println!("sm_{major}{minor}: CUBIN {} bytes\n{}", cubin.image.len(), cubin.log);
        assert!(cubin.image.starts_with(b"\x7fELF"));
        let ptx = ok("PTX", nvrtc::compile(source, "quantize.cu", major, minor, Output::Ptx, &[]));
        let text = String::from_utf8_lossy(&ptx.image);
        if let Ok(path) = std::env::var("REFIT_QUANT_PTX") {
            std::fs::write(format!("{path}.sm{major}{minor}.ptx"), text.as_bytes()).unwrap();
        }
        assert!(text.contains(".entry refit_quantize("), "PTX names the kernel");
        assert!(text.contains(".entry refit_quantize_narrow("), "PTX names the narrow entry point");
        assert!(text.contains(".entry refit_quantize_rows("), "PTX names the shared rows' entry point");
        assert!(text.contains(".entry refit_quantize_amax("), "PTX names per-tensor jobs' first phase");
        assert!(text.contains(".entry refit_copy_quantize("), "PTX names the entry point that also copies");
        assert!(text.contains("ld.global.v4.u32") || text.contains("ld.global.nc.v4.u32"), "16-byte loads");
        assert_eq!(text.contains("e4m3x2"), major >= 9, "the hardware conversion on sm_89 and later only");
        // Block mode issues a thread's cached loads before the first amax uses one: were a use
        // placed between two loads, each load would wait for the data of the one before it. The wide
        // entry point's arrive in shared memory without registers (cp.async). (On sm_90 the 16-bit
        // amax is one max.u16x2 instruction, which marks the first use.)
        if major >= 9 {
            let entry = text.find(".entry refit_quantize(").expect("the wide entry point");
            let first_use = entry + text[entry..].find("max.u16x2").expect("the 16-bit amax as max.u16x2");
            let loads_before = text[entry..first_use].matches("cp.async.cg.shared.global").count();
            assert!(
                loads_before as u64 >= refit::kernels::quantize::CACHE,
                "sm_{major}{minor}: {loads_before} 16-byte loads into shared memory before the first amax, want {}",
                refit::kernels::quantize::CACHE
            );
        }
    }
}

/// refit_quantize_batch refuses, before the kernel runs, jobs whose memory is not the device's (a
/// source in host malloc memory, an unmapped destination, scales running past their allocation),
/// naming the job and region; the context stays usable: a good job afterwards quantizes right.
#[test]
#[ignore = "needs a GPU"]
fn the_c_api_refuses_jobs_over_memory_that_is_not_the_devices() {
    use refit::ffi::group::{
        refit_group_create, refit_group_destroy, refit_group_options_init, REFIT_BACKEND_CUDA,
    };
    use refit::ffi::quantize::*;
    use refit::ffi::status::refit_last_error_message;
    let message = || {
        // SAFETY: the library's thread-local message, NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned()
    };
    let mut options = std::mem::MaybeUninit::uninit();
    assert_eq!(refit_group_options_init(options.as_mut_ptr()), Status::Success);
    // SAFETY: initialized by the call above.
    let mut options = unsafe { options.assume_init() };
    options.backend = REFIT_BACKEND_CUDA;
    let mut group = std::ptr::null_mut();
    assert_eq!(refit_group_create([0].as_ptr(), 1, &options, &mut group), Status::Success);

    let (rows, cols) = (256u64, 256u64);
    let bytes: Vec<u8> =
        (0..rows * cols).flat_map(|i| (((i % 251) as u16) << 4 | 0x3c00).to_le_bytes()).collect();
    let src = Buffer::new(0, bytes.len());
    src.upload(&bytes);
    let dst = Buffer::new(0, (rows * cols) as usize);
    let scales = Buffer::new(0, 4 * 4);
    let good = refit_quantize_job {
        quantization: refit_quantization {
            target: REFIT_FP8_E4M3FN,
            granularity: REFIT_QUANT_BLOCK,
            block_rows: 128,
            block_cols: 128,
        },
        source_type: REFIT_SOURCE_BF16,
        arithmetic: 0,
        src: src.ptr,
        rows,
        cols,
        src_row_stride: cols,
        dst: dst.ptr,
        dst_row_stride: cols,
        scales: scales.ptr,
        scale_row_stride: 2,
    };
    let host = vec![0u8; bytes.len()];
    let cases = [
        ("host source", refit_quantize_job { src: host.as_ptr() as u64, ..good }, "jobs[0]: its source"),
        (
            "unmapped destination",
            refit_quantize_job { dst: 0x7f00_0000_0000, ..good },
            "jobs[0]: its destination",
        ),
        (
            "scales past their allocation",
            refit_quantize_job { scale_row_stride: 1 << 20, ..good },
            "jobs[0]: its scales",
        ),
    ];
    for (what, job, words) in cases {
        let status = refit_quantize_batch(group, 0, std::ptr::null_mut(), &job, 1, 0);
        assert_eq!(status, Status::InvalidArgument, "{what}: {}", message());
        assert!(message().contains(words), "{what}: {words:?} missing from {}", message());
    }
    dst.fill(SENTINEL);
    assert_eq!(
        refit_quantize_batch(group, 0, std::ptr::null_mut(), &good, 1, 0),
        Status::Success,
        "{}",
        message()
    );
    cuda::sync_device(0);
    let (mut want_dst, mut want_scales) = (vec![SENTINEL; dst.len], vec![SENTINEL; scales.len]);
    let source = refit::quant::reference::SourceMatrix {
        bytes: &bytes,
        source: SourceType::Bf16,
        rows,
        cols,
        stride: cols,
    };
    let quantization = Quantization::new(Fp8::E4m3fn, Granularity::Block { rows: 128, cols: 128 });
    refit::quant::reference::quantize(quantization, &source, &mut want_dst, cols, &mut want_scales, 2);
    assert!(dst.download() == want_dst, "the context no longer quantizes right");
    assert!(scales.download() == want_scales, "the context no longer writes the right scales");
    refit_group_destroy(group);
}

/// A quantized need through a plan and an executor on one GPU: a 2 x 256 x 384 bf16 tensor in two
/// shards on device 0, received as codes and scales, compared byte for byte with the host reference
/// over each whole matrix. Shards cut on a block boundary are quantized in place; cut inside a block,
/// the elements go through the need's staging; both under direct and staged commit. A plain need of
/// another tensor beside it gives the step a copy launch, which carries the in-place quantization
/// when nothing is verified (`kernels/copy_quantize.cu`); its bytes are checked too.
#[test]
#[ignore = "needs a GPU"]
fn quantized_needs_through_an_executor_match_the_reference() {
    use refit::exec::{CommitMode, ExecOptions, Executor};
    use refit::plan::{
        self, Endpoint, Need, Offer, PlanOptions, QuantNeed, QuantPath, Region, Table, TensorSpec,
    };
    use refit::quant::QuantJob;
    use refit::transport::host::HostBackend;
    use refit::transport::Backend;

    const SHAPE: [u64; 3] = [2, 256, 384];
    let count = SHAPE.iter().product::<u64>() as usize;
    let mut rng = quant_cases::Rng::new(31);
    let values: Vec<u16> = (0..count)
        .map(|i| match i % 9973 {
            0 => 0x7f80,  // +inf
            17 => 0x7fc0, // NaN
            _ => (((rng.next() % 40 + 100) << 7) | (rng.next() % 128) | ((rng.next() % 2) << 15)) as u16,
        })
        .collect();
    let box_bytes = |lo: [u64; 3], ext: [u64; 3]| -> Vec<u8> {
        let mut out = Vec::with_capacity((ext.iter().product::<u64>() * 2) as usize);
        for m in lo[0]..lo[0] + ext[0] {
            for r in lo[1]..lo[1] + ext[1] {
                for c in lo[2]..lo[2] + ext[2] {
                    out.extend_from_slice(
                        &values[((m * SHAPE[1] + r) * SHAPE[2] + c) as usize].to_le_bytes(),
                    );
                }
            }
        }
        out
    };
    let group =
        ok("a CUDA group", Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }));
    let here = Endpoint { process: 0, device: 0 };
    let block = Quantization::new(Fp8::E4m3fn, Granularity::Block { rows: 128, cols: 128 });
    let cases = [
        ("block, rows cut at 128", block, 1, 128, QuantPath::Direct),
        ("block, rows cut at 100", block, 1, 100, QuantPath::Staged),
        ("mx, rows cut at 100", Quantization::new(Fp8::E5m2, Granularity::Mx), 1, 100, QuantPath::Direct),
        (
            "row, columns cut at 200",
            Quantization::new(Fp8::E4m3fn, Granularity::Row),
            2,
            200,
            QuantPath::Staged,
        ),
        (
            "tensor, matrices cut at 1",
            Quantization::new(Fp8::E4m3fn, Granularity::Tensor),
            0,
            1,
            QuantPath::Direct,
        ),
    ];
    for (name, q, dim, at, path) in cases {
        for (commit, verify) in [
            (CommitMode::Direct, false),
            (CommitMode::Staged, false),
            (CommitMode::Direct, true),
            (CommitMode::Staged, true),
        ] {
            let (mut lo2, mut ext1, mut ext2) = ([0u64; 3], SHAPE, SHAPE);
            ext1[dim] = at;
            lo2[dim] = at;
            ext2[dim] = SHAPE[dim] - at;
            let shards: Vec<(Buffer, [u64; 3], [u64; 3])> = [([0u64; 3], ext1), (lo2, ext2)]
                .into_iter()
                .map(|(lo, ext)| {
                    let bytes = box_bytes(lo, ext);
                    let buffer = Buffer::new(0, bytes.len());
                    buffer.upload(&bytes);
                    (buffer, lo, ext)
                })
                .collect();
            let (rows, cols) = (SHAPE[1], SHAPE[2]);
            let (grid_rows, grid_cols) = q.scale_grid(rows, cols);
            let scale_size = q.scale_kind().size();
            let codes = Buffer::new(0, count);
            codes.fill(SENTINEL);
            let scales = Buffer::new(0, (SHAPE[0] * grid_rows * grid_cols * scale_size) as usize);
            scales.fill(SENTINEL);
            let staging = Buffer::new(0, count * 2);
            // The plain tensor: 3 x 1000 x 700 bytes, every byte its index's low bits.
            const PLAIN: [u64; 3] = [3, 1000, 700];
            let plain_bytes: Vec<u8> =
                (0..PLAIN.iter().product::<u64>()).map(|i| (i * 7 + i / 251) as u8).collect();
            let (plain_src, plain_dst) =
                (Buffer::new(0, plain_bytes.len()), Buffer::new(0, plain_bytes.len()));
            plain_src.upload(&plain_bytes);
            plain_dst.fill(SENTINEL);
            let plain_region = || Region { offset: vec![0; 3], extent: PLAIN.to_vec() };
            let mut offers: Vec<Offer> = shards
                .iter()
                .map(|(b, lo, ext)| Offer {
                    tensor: 0,
                    owner: here,
                    addr: b.ptr,
                    region: Region { offset: lo.to_vec(), extent: ext.to_vec() },
                    strides: None,
                    digest: None,
                })
                .collect();
            offers.push(Offer {
                tensor: 1,
                owner: here,
                addr: plain_src.ptr,
                region: plain_region(),
                strides: None,
                digest: None,
            });
            let table = Table {
                tensors: vec![
                    TensorSpec { name: "w".into(), dtype: 1, elem_size: 2, shape: SHAPE.to_vec() },
                    TensorSpec { name: "plain".into(), dtype: 0, elem_size: 1, shape: PLAIN.to_vec() },
                ],
                offers,
                needs: vec![Need {
                    tensor: 1,
                    receiver: here,
                    addr: plain_dst.ptr,
                    region: plain_region(),
                    perm: None,
                    strides: vec![PLAIN[1] * PLAIN[2], PLAIN[2], 1],
                }],
                quant_needs: vec![QuantNeed {
                    tensor: 0,
                    receiver: here,
                    addr: codes.ptr,
                    region: Region { offset: vec![0; 3], extent: SHAPE.to_vec() },
                    strides: vec![rows * cols, cols, 1],
                    quantization: q,
                    source: SourceType::Bf16,
                    scales: scales.ptr,
                    scale_row_stride: grid_cols,
                    scale_matrix_stride: grid_rows * grid_cols,
                    staging: staging.ptr,
                }],
                shared_amax: vec![],
            };
            let plan = ok("plan", plan::build(&[table], &PlanOptions::default()));
            assert!(plan.quant_routes().iter().all(|r| r.path == path), "{name}");
            let options = ExecOptions { commit, verify, ..ExecOptions::default() };
            let mut executor = ok("executor", Executor::new(&group, &plan, 0, options));
            // SAFETY: every address of the plan is a buffer above, alive until the checks below; the
            // calls complete on return (no scope is open).
            let ran = ok("run", unsafe { executor.run(&group) });
            assert_eq!(ran.verified, verify, "{name} {commit:?}");
            if commit == CommitMode::Staged {
                assert!(
                    codes.download().iter().all(|&b| b == SENTINEL),
                    "{name}: a staged run wrote live codes"
                );
                assert!(
                    plain_dst.download().iter().all(|&b| b == SENTINEL),
                    "{name}: a staged run wrote a live need"
                );
                // SAFETY: as above.
                let committed = ok("commit", unsafe { executor.commit(&group) });
                assert_eq!(committed.verified, verify, "{name} {commit:?}");
            }
            // The reference: each whole matrix quantized by the host backend.
            let whole = Aligned::new(count * 2, 0);
            let mut whole = whole;
            whole.bytes_mut().copy_from_slice(&box_bytes([0; 3], SHAPE));
            let want_codes = Aligned::new(count, SENTINEL);
            let want_scales = Aligned::new(scales.len, SENTINEL);
            let jobs: Vec<QuantJob> = (0..SHAPE[0])
                .map(|m| QuantJob {
                    quantization: q,
                    source: SourceType::Bf16,
                    src: whole.addr() + m * rows * cols * 2,
                    rows,
                    cols,
                    src_stride: cols,
                    dst: want_codes.addr() + m * rows * cols,
                    dst_stride: cols,
                    scales: want_scales.addr() + m * grid_rows * grid_cols * scale_size,
                    scale_stride: grid_cols,
                    amax_key: 0,
                })
                .collect();
            let host = HostBackend::new(1).unwrap();
            // SAFETY: host buffers alive for the call, which completes on return.
            unsafe { host.quantize_batch(0, BackendStream::NULL, &jobs) }.unwrap();
            assert!(plain_dst.download() == plain_bytes, "{name} {commit:?}: the plain need's bytes");
            let (got_codes, got_scales) = (codes.download(), scales.download());
            if let Some(at) = (0..count).find(|&i| got_codes[i] != want_codes.bytes()[i]) {
                panic!(
                    "{name} {commit:?}: code {at}: GPU {:#04x}, reference {:#04x}",
                    got_codes[at],
                    want_codes.bytes()[at]
                );
            }
            if let Some(at) = (0..got_scales.len()).find(|&i| got_scales[i] != want_scales.bytes()[i]) {
                panic!(
                    "{name} {commit:?}: scale byte {at}: GPU {:#04x}, reference {:#04x}",
                    got_scales[at],
                    want_scales.bytes()[at]
                );
            }
        }
    }
}

/// Per-tensor jobs naming one scale, among every other granularity in one batch, on the GPU: one
/// amax over all of them (several thread blocks each), the scale written once, every code from it.
#[test]
#[ignore = "needs a GPU"]
fn per_tensor_jobs_naming_one_scale_share_it_on_the_gpu() {
    use quant_cases::{check_shared, shared_scale_cases};
    use refit::quant::Arithmetic;
    let kernel = ok("loading the quantize kernel", QuantizeKernel::for_device(0));
    for (seed, target, arithmetic) in [
        (5, Fp8::E4m3fn, Arithmetic::DeepGemm),
        (6, Fp8::E5m2, Arithmetic::Divide),
        (7, Fp8::E4m3fn, Arithmetic::VllmChannel),
        (8, Fp8::E4m3fn, Arithmetic::VllmTensor),
    ] {
        let others = standard_cases(seed, false);
        let shared = shared_scale_cases(seed, target, arithmetic);
        let other_buffers: Vec<OnDevice> = others.iter().map(upload).collect();
        let shared_buffers: Vec<OnDevice> = shared.iter().map(upload).collect();
        let scale = Buffer::new(0, 4);
        scale.fill(SENTINEL);
        let mut jobs: Vec<_> = others
            .iter()
            .zip(&other_buffers)
            .map(|(c, b)| c.job(b.src.ptr, b.dst.ptr, b.scales.ptr))
            .collect();
        let at = jobs.len() / 2;
        for (i, (c, b)) in shared.iter().zip(&shared_buffers).enumerate() {
            jobs.insert(at + 2 * i, c.job(b.src.ptr, b.dst.ptr, scale.ptr));
        }
        let stream = Stream::new(0);
        let l = ok("layout", layout(&jobs));
        // SAFETY: the jobs name the buffers above, alive until after the synchronization.
        ok("enqueue", unsafe { kernel.enqueue(stream.raw, &l) });
        stream.sync();
        let codes: Vec<Vec<u8>> = shared_buffers.iter().map(|b| b.dst.download()).collect();
        check_shared(&shared, &codes, &scale.download(), &format!("GPU, {target:?} {arithmetic:?}"));
        // Two scales joined through an amax key: both take the one amax.
        let (a, b) = (Buffer::new(0, 4), Buffer::new(0, 4));
        a.fill(SENTINEL);
        b.fill(SENTINEL);
        let keyed_buffers: Vec<OnDevice> = shared.iter().map(upload).collect();
        let mut keyed: Vec<_> =
            shared.iter().zip(&keyed_buffers).map(|(c, k)| c.job(k.src.ptr, k.dst.ptr, 0)).collect();
        quant_cases::key_jobs(&mut keyed, a.ptr, b.ptr);
        let l = ok("layout", layout(&keyed));
        // SAFETY: the jobs name the buffers above, alive until after the synchronization.
        ok("enqueue", unsafe { kernel.enqueue(stream.raw, &l) });
        stream.sync();
        let codes: Vec<Vec<u8>> = keyed_buffers.iter().map(|k| k.dst.download()).collect();
        for scale in [&a, &b] {
            check_shared(
                &shared,
                &codes,
                &scale.download(),
                &format!("GPU, keyed, {target:?} {arithmetic:?}"),
            );
        }
        for (c, b) in others.iter().zip(&other_buffers) {
            let (want_dst, want_scales) = c.expected();
            assert!(b.dst.download() == want_dst && b.scales.download() == want_scales, "{}", c.name);
        }
    }
}

/// A plain need of bytes beside quantized ones on GPU 0, so that their in-place jobs ride its copy
/// launch: its source filled with a pattern, its destination with SENTINEL.
struct PlainNeed {
    bytes: Vec<u8>,
    src: Buffer,
    dst: Buffer,
}

impl PlainNeed {
    fn new(len: u64, step: u64) -> PlainNeed {
        let bytes: Vec<u8> = (0..len).map(|i| (i * step + i / 251) as u8).collect();
        let (src, dst) = (Buffer::new(0, bytes.len()), Buffer::new(0, bytes.len()));
        src.upload(&bytes);
        dst.fill(SENTINEL);
        PlainNeed { bytes, src, dst }
    }

    fn spec(&self) -> refit::plan::TensorSpec {
        let shape = vec![self.bytes.len() as u64];
        refit::plan::TensorSpec { name: "plain".into(), dtype: 0, elem_size: 1, shape }
    }

    fn region(&self) -> refit::plan::Region {
        refit::plan::Region { offset: vec![0], extent: vec![self.bytes.len() as u64] }
    }

    fn offer(&self, tensor: u32, owner: refit::plan::Endpoint) -> refit::plan::Offer {
        let (addr, region) = (self.src.ptr, self.region());
        refit::plan::Offer { tensor, owner, addr, region, strides: None, digest: None }
    }

    fn need(&self, tensor: u32, receiver: refit::plan::Endpoint) -> refit::plan::Need {
        let (addr, region) = (self.dst.ptr, self.region());
        refit::plan::Need { tensor, receiver, addr, region, perm: None, strides: vec![1] }
    }

    /// Panics unless the destination holds the source's bytes.
    fn check(&self, name: &str) {
        assert!(self.dst.download() == self.bytes, "{name}: the plain need's bytes");
    }
}

/// A fused QKV received as per-tensor FP8 with one scale from three tensors q, k and v (256, 128
/// and 128 rows of 384 bf16) through an executor on one GPU, beside a plain need (so that the jobs
/// in place ride its copy launch): in place, also when q is offered in two pieces (two jobs of one
/// batch naming the scale); direct and staged commit, with and without verify. The codes and the scale equal the host reference's
/// quantization of the whole fused matrix.
#[test]
#[ignore = "needs a GPU"]
fn per_tensor_needs_sharing_one_scale_through_an_executor_match_the_reference() {
    use refit::exec::{CommitMode, ExecOptions, Executor};
    use refit::plan::{self, Endpoint, Offer, PlanOptions, QuantNeed, QuantPath, Region, Table, TensorSpec};
    use refit::quant::Arithmetic;

    const COLS: u64 = 384;
    const PARTS: [(&str, u64, u64); 3] = [("q", 0, 256), ("k", 256, 128), ("v", 384, 128)];
    const ROWS: u64 = 512;
    let mut rng = quant_cases::Rng::new(77);
    // Each part's magnitudes its own, so that no part alone has the fused scale.
    let values: Vec<u8> = (0..ROWS * COLS)
        .flat_map(|i| {
            let part = (i / COLS >= 256) as u64 + (i / COLS >= 384) as u64;
            let exponent = 110 + 3 * part + rng.next() % 4;
            (((exponent << 7) | (rng.next() % 128) | ((rng.next() % 2) << 15)) as u16).to_le_bytes()
        })
        .collect();
    let rows_of = |first: u64, rows: u64| {
        values[(first * COLS * 2) as usize..((first + rows) * COLS * 2) as usize].to_vec()
    };
    let group =
        ok("a CUDA group", Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }));
    let here = Endpoint { process: 0, device: 0 };
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::DeepGemm);
    // The reference: the whole fused matrix quantized at once.
    let (want_codes, want_scale) = quant_cases::reference_bf16(q, &values, ROWS, COLS);
    for (q_cut, path) in [(None, QuantPath::Direct), (Some(100u64), QuantPath::Direct)] {
        for (commit, verify) in [
            (CommitMode::Direct, false),
            (CommitMode::Staged, false),
            (CommitMode::Direct, true),
            (CommitMode::Staged, true),
        ] {
            let name = format!("q cut {q_cut:?}, {commit:?}, verify {verify}");
            // The parts' shards: (tensor, first row within it, rows).
            let mut pieces: Vec<(u32, u64, u64)> = vec![(1, 0, 128), (2, 0, 128)];
            match q_cut {
                Some(at) => pieces.extend([(0, 0, at), (0, at, 256 - at)]),
                None => pieces.push((0, 0, 256)),
            }
            let shards: Vec<Buffer> = pieces
                .iter()
                .map(|&(t, lo, rows)| {
                    let buffer = Buffer::new(0, (rows * COLS * 2) as usize);
                    buffer.upload(&rows_of(PARTS[t as usize].1 + lo, rows));
                    buffer
                })
                .collect();
            let codes = Buffer::new(0, (ROWS * COLS) as usize);
            codes.fill(SENTINEL);
            let scale = Buffer::new(0, 4);
            scale.fill(SENTINEL);
            let staging: Vec<Buffer> =
                PARTS.iter().map(|p| Buffer::new(0, (p.2 * COLS * 2) as usize)).collect();
            let plain = PlainNeed::new(3 << 20, 7);
            let mut tensors: Vec<TensorSpec> = PARTS
                .iter()
                .map(|p| TensorSpec { name: p.0.into(), dtype: 1, elem_size: 2, shape: vec![p.2, COLS] })
                .collect();
            tensors.push(plain.spec());
            let mut offers: Vec<Offer> = pieces
                .iter()
                .zip(&shards)
                .map(|(&(tensor, lo, rows), b)| Offer {
                    tensor,
                    owner: here,
                    addr: b.ptr,
                    region: Region { offset: vec![lo, 0], extent: vec![rows, COLS] },
                    strides: None,
                    digest: None,
                })
                .collect();
            offers.push(plain.offer(3, here));
            let quant_needs = PARTS
                .iter()
                .enumerate()
                .map(|(t, &(_, first, rows))| QuantNeed {
                    tensor: t as u32,
                    receiver: here,
                    addr: codes.ptr + first * COLS,
                    region: Region { offset: vec![0, 0], extent: vec![rows, COLS] },
                    strides: vec![COLS, 1],
                    quantization: q,
                    source: SourceType::Bf16,
                    scales: scale.ptr,
                    scale_row_stride: 1,
                    scale_matrix_stride: 1,
                    staging: staging[t].ptr,
                })
                .collect();
            let needs = vec![plain.need(3, here)];
            let table = Table { tensors, offers, needs, quant_needs, shared_amax: vec![] };
            let plan = ok("plan", plan::build(&[table], &PlanOptions::default()));
            assert!(plan.quant_routes().iter().all(|r| r.path == path), "{name}");
            let options = ExecOptions { commit, verify, ..ExecOptions::default() };
            let mut executor = ok("executor", Executor::new(&group, &plan, 0, options));
            // SAFETY: every address of the plan is a buffer above, alive until the checks below.
            let ran = ok("run", unsafe { executor.run(&group) });
            let mut quantized = ran.quantized_elements;
            if commit == CommitMode::Staged {
                assert!(scale.download() == [SENTINEL; 4], "{name}: a staged run wrote the live scale");
                // SAFETY: as above.
                quantized += ok("commit", unsafe { executor.commit(&group) }).quantized_elements;
            }
            assert_eq!(quantized, ROWS * COLS, "{name}");
            plain.check(&name);
            assert_eq!(scale.download(), want_scale, "{name}: the shared scale");
            let got = codes.download();
            if let Some(at) = (0..got.len()).find(|&i| got[i] != want_codes[i]) {
                panic!("{name}: code {at}: GPU {:#04x}, reference {:#04x}", got[at], want_codes[at]);
            }
        }
    }
}

/// A row-parallel weight's column shards received per row with one amax key through an executor on
/// one GPU, beside a plain need (so that the shared rows' second phase follows the launch that
/// copies), offered whole: both of RowShards' geometries, direct and staged commit, with and without
/// verify. Every row's scale is the whole row's on every shard, the codes too.
#[test]
#[ignore = "needs a GPU"]
fn per_row_needs_sharing_an_amax_key_through_an_executor_match_the_reference() {
    use quant_cases::RowShards;
    use refit::exec::{CommitMode, ExecOptions, Executor};
    use refit::plan::{
        self, Endpoint, Offer, PlanOptions, QuantNeed, QuantPath, Region, SharedAmax, Table, TensorSpec,
    };
    use refit::quant::Arithmetic;

    let group =
        ok("a CUDA group", Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }));
    let here = Endpoint { process: 0, device: 0 };
    for shards in [
        RowShards::new(21, Fp8::E4m3fn, Arithmetic::VllmChannel),
        RowShards::wide(22, Fp8::E4m3fn, Arithmetic::Divide),
    ] {
        let w = &shards.whole;
        let src = Buffer::new(0, w.src_len());
        src.upload(w.data.bytes());
        let outputs: Vec<(Buffer, Buffer, Buffer)> = (0..shards.shards.len())
            .map(|k| {
                let (codes, scales) = shards.lens(k);
                (Buffer::new(0, codes), Buffer::new(0, scales), Buffer::new(0, codes * 2))
            })
            .collect();
        let plain = PlainNeed::new(1 << 20, 13);
        let quant_needs = (0..shards.shards.len())
            .map(|k| {
                let (c0, width) = shards.shards[k];
                QuantNeed {
                    tensor: 0,
                    receiver: here,
                    addr: outputs[k].0.ptr,
                    region: Region { offset: vec![0, c0], extent: vec![w.rows, width] },
                    strides: vec![width, 1],
                    quantization: w.quantization,
                    source: SourceType::Bf16,
                    scales: outputs[k].1.ptr,
                    scale_row_stride: 1,
                    scale_matrix_stride: 0,
                    staging: outputs[k].2.ptr,
                }
            })
            .collect();
        let table = Table {
            tensors: vec![
                TensorSpec { name: "o".into(), dtype: 7, elem_size: 2, shape: vec![w.rows, w.cols] },
                plain.spec(),
            ],
            offers: vec![
                Offer {
                    tensor: 0,
                    owner: here,
                    addr: src.ptr,
                    region: Region { offset: vec![0, 0], extent: vec![w.rows, w.cols] },
                    strides: Some(vec![w.src_stride, 1]),
                    digest: None,
                },
                plain.offer(1, here),
            ],
            needs: vec![plain.need(1, here)],
            quant_needs,
            shared_amax: outputs.iter().map(|o| SharedAmax { process: 0, scale: o.1.ptr, key: 7 }).collect(),
        };
        let plan = ok("plan", plan::build(&[table], &PlanOptions::default()));
        assert!(plan.quant_routes().iter().all(|r| r.path == QuantPath::Direct));
        for commit in [CommitMode::Direct, CommitMode::Staged] {
            for verify in [false, true] {
                let name = format!("{} columns, {commit:?}, verify {verify}", w.cols);
                for (codes, scales, _) in &outputs {
                    codes.fill(SENTINEL);
                    scales.fill(SENTINEL);
                }
                plain.dst.fill(SENTINEL);
                let options = ExecOptions { commit, verify, ..ExecOptions::default() };
                let mut executor = ok("executor", Executor::new(&group, &plan, 0, options));
                // SAFETY: every address of the plan is a buffer above, alive until the checks below.
                let ran = ok("run", unsafe { executor.run(&group) });
                let mut quantized = ran.quantized_elements;
                if commit == CommitMode::Staged {
                    // SAFETY: as above.
                    quantized += ok("commit", unsafe { executor.commit(&group) }).quantized_elements;
                }
                assert_eq!(quantized, w.rows * w.cols, "{name}");
                plain.check(&name);
                for (k, (codes, scales, _)) in outputs.iter().enumerate() {
                    shards.check(k, &codes.download(), &scales.download(), &name);
                }
            }
        }
    }
}

/// Two processes on GPU 0 (a host-backend communicator for the control plane: NCCL puts no two
/// ranks on one GPU, so every byte between them goes through CUDA IPC), each offering part of a
/// 1024 x 768 bf16 matrix and receiving quantized needs that take every path: in place, quantized
/// by the other process (whose kernel writes the codes and scales into this one's memory: only
/// they cross, not the bf16), and staged. Direct and staged
/// commit, with and without verify, twice each; every code and scale against the reference, the
/// bytes from the other process and the elements quantized against what the shapes say.
#[test]
#[ignore = "needs a GPU"]
fn quantized_needs_across_two_processes_on_one_gpu_match_the_reference() {
    use processes::{in_processes, End};
    use quant_across::Across;
    use refit::across::build_plan;
    use refit::exec::{CommitMode, ExecOptions, Executor};
    use refit::plan::{Endpoint, PlanOptions, Table};
    use refit::transport::comm::{CommOptions, Communicator};
    use refit::transport::BackendKind;
    use std::sync::Arc;
    use std::time::Duration;

    let test = "quantized_needs_across_two_processes_on_one_gpu_match_the_reference";
    in_processes(test, BackendKind::Host, &[End::Done; 2], |rank, size, id| {
        let across = Across::new(1024, 768, 640, 512, (128, 128), (256, 128));
        let options = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
        let comm = Arc::new(Communicator::create(id, size, rank, 0, options).unwrap());
        let group = ok(
            "a CUDA group",
            Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }),
        );
        let here = Endpoint { process: rank as u32, device: 0 };
        let (lo, rows) = across.offered(rank);
        let source = Buffer::new(0, (rows * across.cols * 2) as usize);
        source.upload(&across.rows_of(lo, rows));
        let wanted = across.wanted(rank);
        let buffers: Vec<(Buffer, Buffer, Buffer)> = wanted
            .iter()
            .map(|w| {
                let (codes, scales, staging) = across.sizes(w);
                (Buffer::new(0, codes), Buffer::new(0, scales), Buffer::new(0, staging.max(16)))
            })
            .collect();
        let needs = wanted.iter().zip(&buffers).map(|(w, (codes, scales, staging))| {
            across.need(w, here, codes.ptr, scales.ptr, if w.staging { staging.ptr } else { 0 })
        });
        let table = Table {
            tensors: vec![across.spec()],
            offers: vec![across.offer(here, source.ptr)],
            needs: vec![],
            quant_needs: needs.collect(),
            shared_amax: vec![],
        };
        let share = ok("a share", build_plan(&comm, &table, &PlanOptions::default()));
        let mut planned: Vec<_> =
            share.quant_routes().iter().map(|r| (r.receiver.process, r.runner.process, r.path)).collect();
        planned.sort();
        assert_eq!(planned, across.paths(rank), "rank {rank}");
        assert_eq!(share.stats().quantized_sent_bytes, across.sent_bf16(rank), "rank {rank}");
        let references: Vec<_> = wanted.iter().map(|w| across.reference(w)).collect();
        let cases = [(CommitMode::Direct, false), (CommitMode::Staged, false), (CommitMode::Staged, true)];
        for (commit, verify) in cases {
            let options = ExecOptions { commit, verify, ..ExecOptions::default() };
            let mut executor =
                ok("an executor", Executor::new_across(&group, &share, Arc::clone(&comm), options));
            // Through CUDA IPC the quantizing kernel writes the other process's codes and scales
            // itself (its live buffers, or its landing under staged commit).
            let straight = executor.remote_totals().unwrap().quantized_straight_bytes;
            assert_eq!(straight, across.quantized_crossing(1 - rank), "rank {rank} {commit:?}");
            for step in 0..2 {
                let at = format!("rank {rank} {commit:?} verify {verify} step {step}");
                for (codes, scales, _) in &buffers {
                    codes.fill(SENTINEL);
                    scales.fill(SENTINEL);
                }
                comm.allgather_bytes(b"poisoned").unwrap();
                // SAFETY: every address of the share is a buffer above (or the peer's, alive until
                // the meeting below); the calls complete on return (no scope is open).
                let ran = ok("run", unsafe { executor.run(&group) });
                let mut elements = ran.quantized_elements;
                if commit == CommitMode::Staged {
                    comm.allgather_bytes(b"ran").unwrap();
                    for (codes, scales, _) in &buffers {
                        let untouched =
                            codes.download().into_iter().chain(scales.download()).all(|b| b == SENTINEL);
                        assert!(untouched, "{at}: a staged run wrote live codes");
                    }
                    // SAFETY: as above.
                    elements += ok("commit", unsafe { executor.commit(&group) }).quantized_elements;
                }
                comm.allgather_bytes(b"installed").unwrap();
                assert_eq!(elements, across.quantized(rank), "{at}");
                assert_eq!(ran.remote_received_bytes, across.crossing(rank), "{at}");
                assert_eq!((ran.remote_wire_bytes, ran.verified), (0, verify), "{at}");
                for (k, ((codes, scales, _), (want_codes, want_scales))) in
                    buffers.iter().zip(&references).enumerate()
                {
                    let (got_codes, got_scales) = (codes.download(), scales.download());
                    if let Some(i) = (0..want_codes.len()).find(|&i| got_codes[i] != want_codes[i]) {
                        panic!(
                            "{at}: need {k}'s code {i}: GPU {:#04x}, reference {:#04x}",
                            got_codes[i], want_codes[i]
                        );
                    }
                    if let Some(i) = (0..want_scales.len()).find(|&i| got_scales[i] != want_scales[i]) {
                        panic!(
                            "{at}: need {k}'s scale byte {i}: GPU {:#04x}, reference {:#04x}",
                            got_scales[i], want_scales[i]
                        );
                    }
                }
                comm.allgather_bytes(b"checked").unwrap();
            }
        }
    });
}

/// A row-parallel weight's column shards as per-row jobs sharing each row's amax through one key, on
/// the GPU: two phases, every row's scale the whole row's on every shard (the codes too), for each
/// target and arithmetic, in each of RowShards' geometries (bf16 and f32).
#[test]
#[ignore = "needs a GPU"]
fn per_row_jobs_sharing_an_amax_key_take_each_whole_rows_amax_on_the_gpu() {
    use quant_cases::RowShards;
    use refit::quant::Arithmetic;
    let kernel = ok("loading the quantize kernel", QuantizeKernel::for_device(0));
    for (seed, target, arithmetic) in [
        (11, Fp8::E4m3fn, Arithmetic::VllmChannel),
        (12, Fp8::E5m2, Arithmetic::Divide),
        (13, Fp8::E4m3fn, Arithmetic::DeepGemm),
    ] {
        for shards in [
            RowShards::new(seed, target, arithmetic),
            RowShards::wide(seed + 10, target, arithmetic),
            RowShards::f32(seed + 20, target, arithmetic),
        ] {
            let src = Buffer::new(0, shards.whole.src_len());
            src.upload(shards.whole.data.bytes());
            let outputs: Vec<(Buffer, Buffer)> = (0..shards.shards.len())
                .map(|k| {
                    let (codes, scales) = shards.lens(k);
                    let (d, s) = (Buffer::new(0, codes), Buffer::new(0, scales));
                    d.fill(SENTINEL);
                    s.fill(SENTINEL);
                    (d, s)
                })
                .collect();
            let jobs: Vec<_> =
                outputs.iter().enumerate().map(|(k, (d, s))| shards.job(k, src.ptr, d.ptr, s.ptr)).collect();
            let stream = Stream::new(0);
            let l = ok("layout", layout(&jobs));
            // SAFETY: the jobs name the buffers above, alive until after the synchronization.
            ok("enqueue", unsafe { kernel.enqueue(stream.raw, &l) });
            stream.sync();
            for (k, (d, s)) in outputs.iter().enumerate() {
                shards.check(k, &d.download(), &s.download(), &format!("GPU, {target:?} {arithmetic:?}"));
            }
        }
    }
}

impl amax_exchange::Memory for Buffer {
    fn new(len: usize) -> Buffer {
        Buffer::new(0, len)
    }

    fn addr(&self) -> u64 {
        self.ptr
    }

    fn write(&mut self, bytes: &[u8]) {
        self.upload(bytes);
    }

    fn read(&self) -> Vec<u8> {
        self.download()
    }
}

/// tests/common/amax_exchange.rs on GPU 0: two trainer processes, each holding a column half of two
/// weights, quantize them for two engine processes whose scales take amaxes across both (per tensor,
/// and per row of a row-parallel weight): the trainers exchange their amaxes at every run (phase 1
/// alone on the GPU, read back, exchanged, then seeded into the quantizing launches). Codes and
/// scales cross through CUDA IPC (a host-backend communicator for the control plane).
#[test]
#[ignore = "needs a GPU"]
fn trainers_on_one_gpu_exchange_amaxes_and_match_the_reference() {
    use processes::{in_processes, End};
    use refit::transport::BackendKind;

    in_processes(
        "trainers_on_one_gpu_exchange_amaxes_and_match_the_reference",
        BackendKind::Host,
        &[End::Done; amax_exchange::PROCESSES],
        |rank, size, id| {
            amax_exchange::trainers_exchange_amaxes::<Buffer>(rank, size, id, BackendChoice::Cuda, true)
        },
    );
}
