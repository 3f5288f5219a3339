//! The quantizing copy on the host backend (`Backend::quantize_batch`: the reference run by a host
//! stream's worker) and the checks every backend applies to jobs before any byte is written: bad
//! block shapes, strides, alignment, addresses, overlapping destinations and scales.

#[path = "common/quant_cases.rs"]
mod quant_cases;

use quant_cases::{case, outputs_and_jobs, standard_cases, Aligned, Case, Rng, SENTINEL};
use refit::quant::{check_jobs, Fp8, Granularity, QuantJob, SourceType};
use refit::transport::host::HostBackend;
use refit::transport::{Backend, Stream};
use refit::Status;

fn run(backend: &HostBackend, cases: &[Case]) -> refit::Result<Vec<(Aligned, Aligned)>> {
    let (outputs, jobs) = outputs_and_jobs(cases);
    // SAFETY: every job names the buffers above, alive for the call (which completes on return).
    unsafe { backend.quantize_batch(0, Stream::NULL, &jobs) }?;
    Ok(outputs)
}

#[test]
fn the_host_backend_writes_the_references_bytes_for_a_whole_batch() {
    let backend = HostBackend::new(1).unwrap();
    let cases = standard_cases(3, false);
    let outputs = run(&backend, &cases).unwrap();
    for (c, (dst, scales)) in cases.iter().zip(&outputs) {
        let (want_dst, want_scales) = c.expected();
        assert!(dst.bytes() == want_dst.as_slice(), "{}: destination differs", c.name);
        assert!(scales.bytes() == want_scales.as_slice(), "{}: scales differ", c.name);
        // Not vacuous: a case with elements writes codes and scales over the sentinel.
        assert!(c.rows * c.cols == 0 || want_scales.iter().any(|&b| b != SENTINEL), "{}", c.name);
    }
}

#[test]
fn known_block_values() {
    // One 2 x 8 bf16 block with amax 448: scale 1, codes the elements' own.
    let mut rng = Rng::new(1);
    let mut c = case(
        &mut rng,
        "known",
        Fp8::E4m3fn,
        Granularity::Block { rows: 2, cols: 8 },
        SourceType::Bf16,
        2,
        8,
        0,
    );
    let values = [448.0f32, -448.0, 1.0, 1.0625, 2f32.powi(-9), 2f32.powi(-10), -0.0, 0.0];
    for (i, x) in values.iter().chain(values.iter()).enumerate() {
        let at = i * 2;
        c.data.bytes_mut()[at..at + 2].copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
    }
    let backend = HostBackend::new(1).unwrap();
    let outputs = run(&backend, std::slice::from_ref(&c)).unwrap();
    let (dst, scales) = (&outputs[0].0, &outputs[0].1);
    assert_eq!(f32::from_le_bytes(scales.bytes()[..4].try_into().unwrap()), 1.0);
    assert_eq!(&dst.bytes()[..8], &[0x7e, 0xfe, 0x38, 0x38, 0x01, 0x00, 0x80, 0x00]);

    // MX: amax 3.0 -> e = 1 - 8 = -7, byte 120; elements divided by 2^-7.
    let mut mx = case(&mut rng, "mx", Fp8::E4m3fn, Granularity::Mx, SourceType::F32, 1, 32, 0);
    for i in 0..32 {
        let x = if i == 0 { 3.0f32 } else { 0.5 };
        mx.data.bytes_mut()[i * 4..i * 4 + 4].copy_from_slice(&x.to_le_bytes());
    }
    let outputs = run(&backend, std::slice::from_ref(&mx)).unwrap();
    assert_eq!(outputs[0].1.bytes()[0], 120);
    assert_eq!(outputs[0].0.bytes()[0], Fp8::E4m3fn.encode(384.0));
    assert_eq!(outputs[0].0.bytes()[1], Fp8::E4m3fn.encode(64.0));
}

fn base_job() -> QuantJob {
    QuantJob {
        quantization: refit::quant::Quantization::new(
            Fp8::E4m3fn,
            Granularity::Block { rows: 128, cols: 128 },
        ),
        source: SourceType::Bf16,
        src: 0x10000,
        rows: 256,
        cols: 256,
        src_stride: 256,
        dst: 0x100000,
        dst_stride: 256,
        scales: 0x200000,
        scale_stride: 2,
        amax_key: 0,
    }
}

fn refused(jobs: &[QuantJob], status: Status, words: &[&str]) {
    let err = check_jobs(jobs).expect_err("the jobs should be refused");
    assert_eq!(err.status, status, "{}", err.message);
    for word in words {
        assert!(err.message.contains(word), "`{}` lacks `{word}`", err.message);
    }
}

#[test]
fn bad_jobs_are_refused_with_what_is_wrong() {
    assert!(check_jobs(&[base_job()]).is_ok());
    let with = |f: &dyn Fn(&mut QuantJob)| {
        let mut j = base_job();
        f(&mut j);
        j
    };
    let block = |rows, cols| {
        with(&move |j: &mut QuantJob| j.quantization.granularity = Granularity::Block { rows, cols })
    };
    refused(&[block(0, 128)], Status::InvalidArgument, &["jobs[0]", "block shape is 0 x 128"]);
    refused(&[block(128, 0)], Status::InvalidArgument, &["block shape is 128 x 0"]);
    refused(&[block(128, 12)], Status::InvalidArgument, &["block columns are 12", "multiple of 8"]);
    refused(&[block(1 << 20, 1024)], Status::InvalidArgument, &["more than"]);
    refused(
        &[with(&|j| j.src_stride = 255)],
        Status::InvalidArgument,
        &["src_row_stride 255 is below cols 256"],
    );
    refused(&[with(&|j| j.dst_stride = 100)], Status::InvalidArgument, &["dst_row_stride 100"]);
    refused(&[with(&|j| j.scale_stride = 1)], Status::InvalidArgument, &["scale_row_stride 1", "2 scales"]);
    refused(&[with(&|j| j.cols = (1 << 32) - 15)], Status::InvalidArgument, &["x 4294967281 is too large"]);
    refused(&[with(&|j| j.rows = 1 << 39)], Status::InvalidArgument, &["549755813888 x 256 is too large"]);
    refused(&[with(&|j| j.src = 0)], Status::InvalidArgument, &["src is 0"]);
    refused(&[with(&|j| j.scales = 0)], Status::InvalidArgument, &["scales is 0"]);
    refused(&[with(&|j| j.src = 0x10008)], Status::InvalidArgument, &["misaligned source rows"]);
    refused(&[with(&|j| j.src_stride = 260)], Status::InvalidArgument, &["misaligned source rows"]);
    refused(&[with(&|j| j.dst = 0x100004)], Status::InvalidArgument, &["misaligned destination rows"]);
    refused(&[with(&|j| j.scales = 0x200002)], Status::InvalidArgument, &["scales 0x200002"]);
    refused(&[with(&|j| j.src = u64::MAX - 0xffff)], Status::InvalidArgument, &["source runs past the end"]);
    // Overlaps: the scales inside the destination; two jobs writing the same rows; a job writing
    // its own rows twice cannot happen (strides are at least a row), but two jobs' scale grids can.
    refused(
        &[with(&|j| j.scales = 0x100100)],
        Status::Overlap,
        &["jobs[0]'s destination and jobs[0]'s scales overlap"],
    );
    let second = with(&|j| {
        j.dst += 128 * 256;
        j.scales = 0x300000;
    });
    refused(
        &[base_job(), second],
        Status::Overlap,
        &["jobs[0]'s destination and jobs[1]'s destination overlap"],
    );
    let scales_shared = with(&|j| j.dst = 0x400000);
    refused(
        &[base_job(), scales_shared],
        Status::Overlap,
        &["jobs[0]'s scales and jobs[1]'s scales overlap"],
    );
    // Column halves of one matrix interleave without overlapping: accepted.
    let left = with(&|j| j.cols = 128);
    let right = with(&|j| {
        j.cols = 128;
        j.dst += 128;
        j.scales = 0x300000;
        j.scale_stride = 1;
    });
    assert!(check_jobs(&[left, right]).is_ok());
    // Empty jobs are never checked beyond their block shape, nor their strides multiplied (the
    // fuzzer's input: a scale stride whose bytes overflow, on a job of no rows).
    assert!(check_jobs(&[with(&|j| {
        j.rows = 0;
        j.src = 0;
    })])
    .is_ok());
    let no_columns = with(&|j| {
        j.cols = 0;
        j.scale_stride = u64::MAX;
        j.dst_stride = u64::MAX;
    });
    assert!(check_jobs(&[no_columns, base_job()]).is_ok());
}

#[test]
fn refused_jobs_write_nothing() {
    let backend = HostBackend::new(1).unwrap();
    let mut rng = Rng::new(4);
    let good = case(&mut rng, "good", Fp8::E4m3fn, Granularity::Row, SourceType::Bf16, 4, 16, 0);
    let dst = Aligned::new(good.dst_len(), SENTINEL);
    let scales = Aligned::new(good.scale_len(), SENTINEL);
    let mut bad = good.job(good.data.addr(), dst.addr(), scales.addr());
    bad.dst_stride = 3;
    let jobs = [good.job(good.data.addr(), dst.addr(), scales.addr()), bad];
    // SAFETY: the first job names the buffers above; the second is refused before anything runs.
    let err = unsafe { backend.quantize_batch(0, Stream::NULL, &jobs) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("jobs[1]"), "{}", err.message);
    assert!(dst.bytes().iter().chain(scales.bytes()).all(|&b| b == SENTINEL));
}

/// A prepared batch (`Backend::prepare_quantize`, what executors hold) writes what `quantize_batch`
/// writes, at every launch: the second launch over a poisoned output writes it again. Jobs that
/// `quantize_batch` refuses are refused at preparation, with the same status.
#[test]
fn a_prepared_batch_writes_the_references_bytes_at_every_launch() {
    let backend = HostBackend::new(1).unwrap();
    let cases = standard_cases(4, false);
    let (mut outputs, jobs) = outputs_and_jobs(&cases);
    let prepared = backend.prepare_quantize(0, &jobs).unwrap();
    for launch in 0..2 {
        for (dst, scales) in &mut outputs {
            dst.bytes_mut().fill(SENTINEL);
            scales.bytes_mut().fill(SENTINEL);
        }
        // SAFETY: every job names the buffers above, alive for the call (which completes on return).
        unsafe { prepared.launch(Stream::NULL) }.unwrap();
        for (c, (dst, scales)) in cases.iter().zip(&outputs) {
            let (want_dst, want_scales) = c.expected();
            assert!(dst.bytes() == want_dst.as_slice(), "launch {launch}, {}: destination differs", c.name);
            assert!(scales.bytes() == want_scales.as_slice(), "launch {launch}, {}: scales differ", c.name);
        }
    }
    let mut overlapping = base_job();
    overlapping.scales = overlapping.dst;
    let err = backend.prepare_quantize(0, &[overlapping]).err().expect("overlapping outputs are refused");
    assert_eq!(err.status, check_jobs(&[overlapping]).unwrap_err().status, "{}", err.message);
    assert_eq!(backend.prepare_quantize(3, &jobs).err().map(|e| e.status), Some(Status::InvalidDevice));
}

/// Per-tensor jobs naming one scale share it: the amax of all their elements, every code from it,
/// for each target and arithmetic; jobs sharing a scale but quantizing differently are refused, and
/// a per-tensor scale inside another granularity's grid is an overlap as before.
#[test]
fn per_tensor_jobs_naming_one_scale_share_its_amax() {
    use quant_cases::{check_shared, shared_scale_cases};
    use refit::quant::Arithmetic;
    let backend = HostBackend::new(1).unwrap();
    for (seed, target, arithmetic) in [
        (1, Fp8::E4m3fn, Arithmetic::Divide),
        (2, Fp8::E5m2, Arithmetic::DeepGemm),
        (3, Fp8::E4m3fn, Arithmetic::DeepGemmUe8m0),
        (4, Fp8::E4m3fn, Arithmetic::VllmTensor),
    ] {
        let cases = shared_scale_cases(seed, target, arithmetic);
        let codes: Vec<Aligned> = cases.iter().map(|c| Aligned::new(c.dst_len(), SENTINEL)).collect();
        let scale = Aligned::new(4, SENTINEL);
        let jobs: Vec<QuantJob> =
            cases.iter().zip(&codes).map(|(c, d)| c.job(c.data.addr(), d.addr(), scale.addr())).collect();
        // SAFETY: the jobs name the buffers above, alive for the call.
        unsafe { backend.quantize_batch(0, Stream::NULL, &jobs) }.unwrap();
        let codes: Vec<Vec<u8>> = codes.iter().map(|d| d.bytes().to_vec()).collect();
        check_shared(&cases, &codes, scale.bytes(), &format!("host, {target:?} {arithmetic:?}"));

        // Two scales joined through an amax key take the same value.
        let (keyed_codes, a, b) = (
            cases.iter().map(|c| Aligned::new(c.dst_len(), SENTINEL)).collect::<Vec<_>>(),
            Aligned::new(4, SENTINEL),
            Aligned::new(4, SENTINEL),
        );
        let mut keyed: Vec<QuantJob> =
            cases.iter().zip(&keyed_codes).map(|(c, d)| c.job(c.data.addr(), d.addr(), 0)).collect();
        quant_cases::key_jobs(&mut keyed, a.addr(), b.addr());
        // SAFETY: the jobs name the buffers above, alive for the call.
        unsafe { backend.quantize_batch(0, Stream::NULL, &keyed) }.unwrap();
        let got: Vec<Vec<u8>> = keyed_codes.iter().map(|d| d.bytes().to_vec()).collect();
        for scale in [&a, &b] {
            check_shared(&cases, &got, scale.bytes(), &format!("host, keyed, {target:?} {arithmetic:?}"));
        }
        let mut differing = keyed.clone();
        differing[2].quantization = differing[2].quantization.with(Arithmetic::VllmChannel);
        refused(&differing, Status::InvalidArgument, &["jobs[2]", "per-tensor amax (amax key"]);

        let mut differing = jobs.clone();
        differing[2].quantization = differing[2].quantization.with(Arithmetic::VllmChannel);
        refused(&differing, Status::InvalidArgument, &["jobs[2]", "shares jobs[0]'s per-tensor scale"]);
        let mut block = jobs.clone();
        block[1].quantization.granularity = Granularity::Block { rows: 8, cols: 8 };
        refused(&block, Status::Overlap, &["scales overlap"]);
    }
}

/// A row-parallel weight's column shards quantized per row by three jobs with their own codes and
/// scales, one amax key: every row's scale is the whole row's, on every shard, for each target and
/// arithmetic; jobs sharing per-row amaxes with other rows or another quantization are refused.
#[test]
fn per_row_jobs_sharing_an_amax_key_take_each_whole_rows_amax() {
    use quant_cases::RowShards;
    use refit::quant::Arithmetic;
    let backend = HostBackend::new(1).unwrap();
    for (seed, target, arithmetic) in [
        (1, Fp8::E4m3fn, Arithmetic::VllmChannel),
        (2, Fp8::E5m2, Arithmetic::Divide),
        (3, Fp8::E4m3fn, Arithmetic::DeepGemm),
    ] {
        let shards = RowShards::new(seed, target, arithmetic);
        let outputs = shards.outputs();
        let src = shards.whole.data.addr();
        let jobs: Vec<QuantJob> =
            outputs.iter().enumerate().map(|(k, (d, s))| shards.job(k, src, d.addr(), s.addr())).collect();
        // SAFETY: the jobs name the buffers above, alive for the call.
        unsafe { backend.quantize_batch(0, Stream::NULL, &jobs) }.unwrap();
        for (k, (codes, scales)) in outputs.iter().enumerate() {
            shards.check(k, codes.bytes(), scales.bytes(), &format!("host, {target:?} {arithmetic:?}"));
        }
        let mut fewer_rows = jobs.clone();
        fewer_rows[1].rows -= 1;
        refused(&fewer_rows, Status::InvalidArgument, &["jobs[1]", "per-row amaxes", "99 rows, not 100"]);
        let mut other = jobs.clone();
        other[2].quantization = other[2].quantization.with(Arithmetic::VllmTensor);
        refused(&other, Status::InvalidArgument, &["jobs[2]", "per-row amaxes (amax key", "quantization"]);
    }
}
