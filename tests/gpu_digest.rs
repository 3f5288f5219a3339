//! The digest and verify kernels on a real GPU (run on the GPU machine with `--ignored
//! --test-threads=1`): digests of device memory equal `gf64::digest` of the same bytes read back, at
//! many lengths and alignments up to 256 MiB; `Backend::digest` through a CUDA group; verify by
//! compare, by check against a recording copy's digests, and by check against digests recorded from
//! the sources alone (those that travel between processes) finds one corrupted device byte in its
//! segment, and nothing in a correct copy. Digests of many ranges in one launch equal the one-range
//! digest of each, byte for byte, for every size from 0 bytes (at any address, the last included) to
//! 256 MiB, at unaligned starts, one huge among thousands of tiny, and 10^4 ranges of 16 KiB.

#[path = "common/cuda.rs"]
mod cuda;
#[path = "common/random_batch.rs"]
mod random_batch;

use cuda::{ok, on, Buffer, Stream};
use cudarc::driver::sys;
use random_batch::{first_difference, random_batch, rebase, reference, Rng, Shape};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::kernels::digest::{ByteRange, DigestKernel};
use refit::kernels::gf64;
use refit::transport::driver::check;
use refit::transport::verify::PreparedVerify;

const POISON: u8 = 0xCD;

fn cuda_group() -> Group {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    ok("a CUDA group", Group::new(&[0], GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }))
}

/// Writes one byte of device memory (synchronously).
fn poke(device: i32, addr: u64, value: u8) {
    on(device, || {
        ok("cuMemsetD8", check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(addr, value, 1) }));
        ok("cuCtxSynchronize", check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }));
    });
}

#[test]
#[ignore = "needs a GPU"]
fn digests_of_device_memory_equal_the_host_digest() {
    let kernel = ok("loading the digest kernel", DigestKernel::for_device(0));
    println!("digest kernel: {}", kernel.build);
    let stream = Stream::new(0);
    let mut rng = Rng::new(5);
    let size = (256 << 20) + 64;
    let mut host = vec![0u8; size];
    rng.fill(&mut host);
    let buffer = Buffer::new(0, size);
    buffer.upload(&host);
    let mut cases: Vec<(usize, usize)> = Vec::new();
    for len in [0usize, 1, 15, 16, 17, 511, 512, 513, 4096, 65_537, 1 << 20, (1 << 24) + 3] {
        for offset in [0usize, 1, 8, 13] {
            cases.push((offset, len));
        }
    }
    cases.push((0, 256 << 20));
    cases.push((7, (256 << 20) - 100));
    for (offset, len) in cases {
        let got = ok("digest", unsafe { kernel.digest(stream.raw, buffer.ptr + offset as u64, len as u64) });
        let want = gf64::digest(&host[offset..offset + len]);
        assert_eq!(got, want, "{len} bytes at offset {offset}: {got:#x} != {want:#x}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_group_digest_changes_with_one_device_byte() {
    let group = cuda_group();
    let mut host = vec![0u8; 1 << 20];
    Rng::new(9).fill(&mut host);
    let buffer = Buffer::new(0, host.len());
    buffer.upload(&host);
    let stream = group.stream(0).unwrap();
    let digest = |addr, len| {
        ok("digest", unsafe { group.backend().digest(group.device(0).unwrap(), stream, addr, len) })
    };
    let before = digest(buffer.ptr + 3, 1_000_000);
    assert_eq!(before, gf64::digest(&host[3..1_000_003]));
    poke(0, buffer.ptr + 500_000, host[500_000] ^ 1);
    assert_ne!(digest(buffer.ptr + 3, 1_000_000), before, "a flipped device bit went unnoticed");
    let err = unsafe { group.backend().digest(group.device(0).unwrap(), stream, 0, 8) }.unwrap_err();
    assert_eq!(err.status, refit::Status::InvalidArgument);
}

/// Copies a random batch with a recording copy, verifies it both ways, then corrupts one destination
/// byte and expects both verifies to name its segment.
fn verify_case(seed: u64, shape: Shape) {
    let group = cuda_group();
    let mut rng = Rng::new(seed);
    let batch = random_batch(&mut rng, shape);
    let mut host_src = vec![0u8; batch.src_len];
    rng.fill(&mut host_src);
    let src = Buffer::new(0, batch.src_len);
    src.upload(&host_src);
    let dst = Buffer::new(0, batch.dst_len);
    dst.fill(POISON);
    let segments = rebase(&batch.segments, src.ptr, dst.ptr);
    let stream = group.stream(0).unwrap();
    let sync = || group.backend().sync_stream(0, stream).unwrap();

    let copy = ok("prepare copy", group.backend().prepare_recording_batch(0, &segments, true));
    let check_verify = ok("verify for the copy", PreparedVerify::for_copy(copy.as_ref()));
    let compare_verify = ok(
        "verify by compare",
        PreparedVerify::new(group.backend().as_ref(), group.device(0).unwrap(), &segments),
    );
    ok("copy", unsafe { copy.launch(stream) });
    ok("check", unsafe { check_verify.launch(stream) });
    ok("compare", unsafe { compare_verify.launch(stream) });
    sync();
    let mut want = vec![POISON; batch.dst_len];
    reference(&batch.segments, &host_src, &mut want);
    if let Some((at, g, w)) = first_difference(&dst.download(), &want) {
        panic!("seed {seed}: the recording copy wrote byte {at} = {g:#x}, expected {w:#x}");
    }
    assert_eq!(ok("outcome", check_verify.outcome()), None, "seed {seed}: false alarm (check)");
    assert_eq!(ok("outcome", compare_verify.outcome()), None, "seed {seed}: false alarm (compare)");
    // The digests that travel between processes: taken from the sources alone, checked against the
    // destinations alone (as a receiver does with a sender's digests).
    let record = ok("prepare record", group.backend().prepare_digest_record(0, &segments));
    let travelled = ok("prepare digest check", group.backend().prepare_digest_check(0, &segments));
    ok("record", unsafe { record.launch(stream) });
    sync();
    let digests = ok("digests", record.digests());
    assert!(!digests.is_empty(), "seed {seed}: one digest per tile");
    let short = travelled.expect(&digests[1..]).unwrap_err();
    assert_eq!(short.status, refit::Status::InvalidArgument, "seed {seed}: {}", short.message);
    ok("expect", travelled.expect(&digests));
    ok("digest check", unsafe { travelled.launch(stream) });
    sync();
    assert_eq!(ok("outcome", travelled.outcome()), None, "seed {seed}: false alarm (travelled digests)");

    // One corrupted destination byte, in a segment chosen at random.
    let nonempty: Vec<usize> = (0..segments.len()).filter(|&i| segments[i].runs() > 0).collect();
    let index = nonempty[rng.range(0, nonempty.len() as u64 - 1) as usize];
    let mut runs = Vec::new();
    segments[index].for_each_run(|_, d, len| runs.push((d, len)));
    let (run_dst, len) = runs[rng.range(0, runs.len() as u64 - 1) as usize];
    let at = run_dst + rng.range(0, len - 1);
    poke(0, at, want[(at - dst.ptr) as usize] ^ 0x10);
    ok("check", unsafe { check_verify.launch(stream) });
    ok("compare", unsafe { compare_verify.launch(stream) });
    ok("digest check", unsafe { travelled.launch(stream) });
    sync();
    assert_eq!(ok("outcome", check_verify.outcome()), Some(index), "seed {seed}: check");
    assert_eq!(ok("outcome", compare_verify.outcome()), Some(index), "seed {seed}: compare");
    assert_eq!(ok("outcome", travelled.outcome()), Some(index), "seed {seed}: travelled digests");
    assert_eq!(check_verify.outcome().unwrap_err().status, refit::Status::InvalidState, "reset");
}

#[test]
#[ignore = "needs a GPU"]
fn verify_finds_one_corrupted_device_byte() {
    for (seed, misaligned) in [(1u64, false), (2, true), (3, true)] {
        let shape =
            Shape { segments: 200, max_len: 1 << 20, strided_percent: 30, misaligned, src_len: 8 << 20 };
        verify_case(seed, shape);
    }
    let small =
        Shape { segments: 3000, max_len: 4096, strided_percent: 40, misaligned: true, src_len: 4 << 20 };
    verify_case(4, small);
}

/// Each range's digest from one many-range launch against the one-range kernel's digest of it, and
/// the host's digest of the bytes (the first 500 ranges of a case: the host is slow at 10 GiB).
fn check_many(
    kernel: &DigestKernel,
    stream: &Stream,
    host: &[u8],
    base: u64,
    spans: &[(u64, u64)],
    what: &str,
) {
    let ranges: Vec<ByteRange> = spans.iter().map(|&(at, len)| ByteRange { addr: base + at, len }).collect();
    let got = ok("digest_many", unsafe { kernel.digest_many(stream.raw, &ranges) });
    assert_eq!(got.len(), ranges.len(), "{what}");
    for (i, (&(at, len), &digest)) in spans.iter().zip(&got).enumerate() {
        let alone = ok("digest", unsafe { kernel.digest(stream.raw, base + at, len) });
        assert_eq!(
            digest, alone,
            "{what}: range {i} ({len} bytes at offset {at}): many {digest:#x} != one {alone:#x}"
        );
        if i < 500 {
            let want = gf64::digest(&host[at as usize..(at + len) as usize]);
            assert_eq!(digest, want, "{what}: range {i} ({len} bytes at offset {at}) against the host");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn many_ranges_in_one_launch_equal_each_ranges_own_digest() {
    let kernel = ok("loading the digest kernel", DigestKernel::for_device(0));
    let stream = Stream::new(0);
    let mut rng = Rng::new(17);
    let size = (256 << 20) + 4096;
    let mut host = vec![0u8; size];
    rng.fill(&mut host);
    let buffer = Buffer::new(0, size);
    buffer.upload(&host);

    // Every size class at every interesting alignment, 0 bytes included.
    let mut spans = Vec::new();
    for len in [0u64, 1, 15, 16, 17, 511, 512, 513, 4095, 4096, 65_537, 1 << 20, (1 << 24) + 3] {
        for offset in [0u64, 1, 8, 13] {
            spans.push((offset + 4096 * (spans.len() as u64 % 7), len));
        }
    }
    check_many(&kernel, &stream, &host, buffer.ptr, &spans, "sizes");
    // One huge range (256 MiB at an odd offset) among 5000 tiny ones, overlapping it.
    let mut spans = vec![(7u64, (256u64 << 20) - 100)];
    for _ in 0..5000 {
        spans.push((rng.range(0, 256 << 20), rng.range(0, 64)));
    }
    check_many(&kernel, &stream, &host, buffer.ptr, &spans, "one huge, many tiny");
    // 10^4 ranges of 16 KiB + 3 at odd offsets (the bench's 10^4 x 1 MiB, smaller: this test also runs
    // under compute-sanitizer).
    let spans: Vec<(u64, u64)> = (0..10_000u64).map(|k| (k * 26_003 % (255 << 20), (16 << 10) + 3)).collect();
    check_many(&kernel, &stream, &host, buffer.ptr, &spans, "10^4 x 16 KiB");
    // No ranges: nothing queued, an empty result.
    assert!(ok("no ranges", unsafe { kernel.digest_many(stream.raw, &[]) }).is_empty());
}

#[test]
#[ignore = "needs a GPU"]
fn zero_bytes_digest_to_one_anywhere_on_the_gpu() {
    // Issue 26, 6: 0 bytes at the last address (and at unmapped ones) read nothing and digest to 1.
    let kernel = ok("loading the digest kernel", DigestKernel::for_device(0));
    let stream = Stream::new(0);
    for addr in [u64::MAX, u64::MAX - 15, 16, 0x1234_5678_9abd] {
        assert_eq!(ok("digest", unsafe { kernel.digest(stream.raw, addr, 0) }), 1, "{addr:#x}");
    }
    let ranges: Vec<ByteRange> = [u64::MAX, 3, 0].iter().map(|&addr| ByteRange { addr, len: 0 }).collect();
    assert_eq!(ok("digest_many", unsafe { kernel.digest_many(stream.raw, &ranges) }), [1, 1, 1]);
    // The context is still healthy: nothing faulted.
    stream.sync();
}

#[test]
#[ignore = "needs a GPU"]
fn a_cuda_group_digests_many_ranges_and_refuses_bad_ones() {
    let group = cuda_group();
    let mut host = vec![0u8; 1 << 20];
    Rng::new(19).fill(&mut host);
    let buffer = Buffer::new(0, host.len());
    buffer.upload(&host);
    let stream = group.stream(0).unwrap();
    let device = group.device(0).unwrap();
    let ranges = [ByteRange { addr: buffer.ptr + 3, len: 1000 }, ByteRange { addr: buffer.ptr, len: 0 }];
    let got = ok("digest_many", unsafe { group.backend().digest_many(device, stream, &ranges) });
    assert_eq!(got, [gf64::digest(&host[3..1003]), 1]);
    for (bad, words) in [
        (ByteRange { addr: 0, len: 8 }, "range 1: address is 0"),
        (ByteRange { addr: u64::MAX - 4, len: 8 }, "past the end"),
    ] {
        let err = unsafe { group.backend().digest_many(device, stream, &[ranges[0], bad]) }.unwrap_err();
        assert_eq!(err.status, refit::Status::InvalidArgument, "{bad:?}");
        assert!(err.message.contains(words), "{bad:?}: {}", err.message);
    }
    let err = unsafe { group.backend().digest_many(7, stream, &ranges) }.unwrap_err();
    assert_eq!(err.status, refit::Status::InvalidDevice);
}
