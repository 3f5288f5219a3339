//! `Backend::digest_many` on the host backend: each range's digest equals `Backend::digest` of that
//! range and `gf64::digest` of its bytes, for many sizes (0 bytes included, at any address), unaligned
//! starts, one huge range among many tiny ones; it runs in stream order; no ranges is an empty result;
//! a bad range is refused by index and nothing is returned.

#[path = "common/random_batch.rs"]
mod random_batch;

use random_batch::Rng;
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::kernels::gf64;
use refit::transport::host::{create_host_stream, destroy_host_stream, host_stream};
use refit::transport::{ByteRange, Stream};
use refit::Status;

fn group() -> Group {
    Group::new(&[0, 1], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

#[test]
fn each_range_digests_as_it_does_alone() {
    let group = group();
    let device = group.device(1).unwrap();
    let mut rng = Rng::new(31);
    let mut bytes = vec![0u8; (8 << 20) + 64];
    rng.fill(&mut bytes);
    let base = bytes.as_ptr() as u64;
    // One huge range (8 MiB at an odd offset), every length 0..600 at offsets 0..15, and 5000 tiny
    // ranges anywhere, overlapping; 0 bytes at the last address and at 0.
    let mut spans: Vec<(u64, u64)> = vec![(base + 3, 8 << 20), (u64::MAX, 0), (0, 0)];
    for len in 0..600u64 {
        spans.push((base + len % 16, len));
    }
    for _ in 0..5000 {
        spans.push((base + rng.range(0, 8 << 20), rng.range(0, 20)));
    }
    let ranges: Vec<ByteRange> = spans.iter().map(|&(addr, len)| ByteRange { addr, len }).collect();
    let stream = group.stream(1).unwrap();
    // SAFETY: every range with bytes lies in `bytes`, alive for the call.
    let got = unsafe { group.backend().digest_many(device, stream, &ranges) }.unwrap();
    assert_eq!(got.len(), ranges.len());
    for (i, (range, digest)) in ranges.iter().zip(&got).enumerate() {
        let want = match range.len {
            0 => 1,
            len => gf64::digest(&bytes[(range.addr - base) as usize..(range.addr - base + len) as usize]),
        };
        assert_eq!(*digest, want, "range {i}: {range:?}");
        if i < 700 {
            // SAFETY: as above.
            let alone =
                unsafe { group.backend().digest(device, Stream::NULL, range.addr, range.len) }.unwrap();
            assert_eq!(*digest, alone, "range {i}: {range:?}");
        }
    }
}

#[test]
fn digests_follow_the_work_queued_before_them_on_the_stream() {
    let group = group();
    let device = group.device(0).unwrap();
    let caller = create_host_stream().unwrap();
    let bytes = std::sync::Arc::new(std::sync::Mutex::new(vec![7u8; 4096]));
    let addr = bytes.lock().unwrap().as_ptr() as u64;
    let before = gf64::digest(&[7u8; 100]);
    // Work queued before the call changes the bytes; the digests must see the change.
    let queue = host_stream(caller).unwrap();
    let shared = std::sync::Arc::clone(&bytes);
    queue
        .enqueue(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            shared.lock().unwrap()[10] = 8;
        })
        .unwrap();
    let ranges = [ByteRange { addr, len: 100 }, ByteRange { addr: addr + 50, len: 10 }];
    // SAFETY: both ranges lie in `bytes`.
    let got = unsafe { group.backend().digest_many(device, caller, &ranges) }.unwrap();
    let mut changed = [7u8; 100];
    changed[10] = 8;
    assert_eq!(got, [gf64::digest(&changed), gf64::digest(&[7u8; 10])]);
    assert_ne!(got[0], before);
    destroy_host_stream(caller).unwrap();
}

#[test]
fn no_ranges_and_bad_ranges() {
    let group = group();
    let device = group.device(0).unwrap();
    // SAFETY: no memory is named.
    assert!(unsafe { group.backend().digest_many(device, Stream::NULL, &[]) }.unwrap().is_empty());
    let bytes = [1u8; 64];
    let good = ByteRange { addr: bytes.as_ptr() as u64, len: 64 };
    for (bad, words) in [
        (ByteRange { addr: 0, len: 8 }, "range 1: address is 0"),
        (ByteRange { addr: u64::MAX - 4, len: 8 }, "range 1: range of 8 bytes"),
        (ByteRange { addr: 4096, len: 1 << 61 }, "longer than 2^60"),
    ] {
        // SAFETY: refused before any byte is read.
        let err = unsafe { group.backend().digest_many(device, Stream::NULL, &[good, bad]) }.unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{bad:?}");
        assert!(err.message.contains(words), "{bad:?}: {}", err.message);
    }
    // SAFETY: as above.
    let err = unsafe { group.backend().digest_many(5, Stream::NULL, &[good]) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidDevice);
    // SAFETY: as above.
    let err = unsafe { group.backend().digest_many(device, Stream(0x3039), &[good]) }.unwrap_err();
    assert!(err.message.contains("not a host stream"), "{}", err.message);
}
