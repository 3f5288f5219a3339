//! The quantize kernel on a real GPU (run on the GPU machine with `--ignored --test-threads=1`):
//! every FP8 byte and every scale equal to the Rust reference (`quant::reference`), for every target,
//! granularity and source type in odd shapes, with zero blocks, infinities, NaNs, subnormals and
//! exact rounding ties; the hardware conversion (sm_89 and later) against the reference's for every
//! bf16 value in range; a whole mixed batch in one call; and `Backend::quantize_batch` through a CUDA
//! group, whose bad jobs are refused before the kernel loads.

#[path = "common/cuda.rs"]
mod cuda;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use cuda::{ok, Buffer, Stream};
use quant_cases::{standard_cases, Aligned, Case, SENTINEL};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::kernels::quantize::{layout, QuantizeKernel};
use refit::quant::{Fp8, Granularity, Quantization, SourceType};
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
    for (c, b) in cases.iter().zip(&buffers) {
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
            quantization: Quantization { target, granularity: Granularity::Tensor },
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
    let source = refit::kernels::quantize::SOURCE;
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
        assert!(text.contains("ld.global.v4.u32") || text.contains("ld.global.nc.v4.u32"), "16-byte loads");
        assert_eq!(text.contains("e4m3x2"), major >= 9, "the hardware conversion on sm_89 and later only");
        // Block mode issues a thread's cached loads before the first amax uses one: were a use
        // placed between two loads, each load would wait for the data of the one before it. (On
        // sm_90 the 16-bit amax is one max.u16x2 instruction, which marks the first use.)
        if major >= 9 {
            let first_use = text.find("max.u16x2").expect("the 16-bit amax as max.u16x2");
            let loads_before = text[..first_use].matches("ld.global.nc.v4.u32").count();
            assert!(
                loads_before as u64 >= refit::kernels::quantize::CACHE,
                "sm_{major}{minor}: {loads_before} 16-byte loads before the first amax, want {}",
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
        reserved: 0,
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
    let quantization =
        Quantization { target: Fp8::E4m3fn, granularity: Granularity::Block { rows: 128, cols: 128 } };
    refit::quant::reference::quantize(quantization, &source, &mut want_dst, cols, &mut want_scales, 2);
    assert!(dst.download() == want_dst, "the context no longer quantizes right");
    assert!(scales.download() == want_scales, "the context no longer writes the right scales");
    refit_group_destroy(group);
}
