//! Verify and digest on the host backend: `PreparedVerify` (byte compare, and the check against the
//! digests a recording copy made) finds a corrupted byte at the right segment index, runs in stream
//! order (queued, not complete on return), resets after each outcome; `Backend::digest` agrees with
//! `gf64::digest`; bad inputs get their status.

use refit::group::{BackendChoice, Group, GroupOptions};
use refit::kernels::gf64;
use refit::transport::host::host_stream;
use refit::transport::verify::PreparedVerify;
use refit::transport::Stream;
use refit::{Segment, Status};
use std::time::Duration;

fn group() -> Group {
    Group::new(&[0, 1], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap()
}

/// Sources and destinations of a small batch: contiguous, misaligned, strided (a column split), and
/// an empty segment in the middle, so reported indices are the caller's.
struct Case {
    src: Vec<u8>,
    dst: Vec<u8>,
    segments: Vec<Segment>,
}

impl Case {
    fn new() -> Case {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 31 + 7) as u8).collect();
        let mut case = Case { src, dst: vec![0xCD; 4096], segments: Vec::new() };
        let (s, d) = (case.src.as_ptr() as u64, case.dst.as_mut_ptr() as u64);
        case.segments = vec![
            Segment::contiguous(s, d, 100),
            Segment::contiguous(s + 3, d + 205, 77),
            Segment::contiguous(0, 0, 0),
            Segment {
                src: s + 1000,
                dst: d + 1000,
                len: 24,
                count: [20, 1],
                src_stride: [48, 0],
                dst_stride: [24, 0],
            },
        ];
        case
    }

    /// A destination byte of segment `index` (its first run's byte `k`).
    fn dst_byte(&mut self, index: usize, k: u64) -> &mut u8 {
        let offset = self.segments[index].dst - self.dst.as_ptr() as u64 + k;
        &mut self.dst[offset as usize]
    }
}

fn synced_outcome(group: &Group, verify: &PreparedVerify) -> Option<usize> {
    group.backend().sync_stream(0, group.stream(0).unwrap()).unwrap();
    verify.outcome().unwrap()
}

#[test]
fn compare_finds_a_corrupted_byte_at_its_segment() {
    let group = group();
    let mut case = Case::new();
    let copy = group.backend().prepare_batch(0, &case.segments, true).unwrap();
    let stream = group.stream(0).unwrap();
    unsafe { copy.launch(stream) }.unwrap();
    let verify =
        PreparedVerify::new(group.backend().as_ref(), group.device(0).unwrap(), &case.segments).unwrap();
    unsafe { verify.launch(stream) }.unwrap();
    assert_eq!(synced_outcome(&group, &verify), None);
    for (index, k) in [(3usize, 30u64), (1, 76), (0, 0)] {
        *case.dst_byte(index, k) ^= 1;
        unsafe { verify.launch(stream) }.unwrap();
        assert_eq!(synced_outcome(&group, &verify), Some(index), "segment {index} byte {k}");
        *case.dst_byte(index, k) ^= 1;
    }
    // Two bad segments: the first is reported.
    *case.dst_byte(3, 0) ^= 0x40;
    *case.dst_byte(1, 5) ^= 0x40;
    unsafe { verify.launch(stream) }.unwrap();
    assert_eq!(synced_outcome(&group, &verify), Some(1));
}

#[test]
fn check_against_the_copys_digests_finds_a_corrupted_byte() {
    let group = group();
    let mut case = Case::new();
    let stream = group.stream(1).unwrap();
    let copy = group.backend().prepare_recording_batch(1, &case.segments, false).unwrap();
    let verify = PreparedVerify::for_copy(copy.as_ref()).unwrap();
    unsafe { copy.launch(stream) }.unwrap();
    unsafe { verify.launch(stream) }.unwrap();
    group.backend().sync_stream(1, stream).unwrap();
    assert_eq!(verify.outcome().unwrap(), None);
    *case.dst_byte(3, 200) ^= 0x08; // a byte of a later row of the strided segment
    unsafe { verify.launch(stream) }.unwrap();
    group.backend().sync_stream(1, stream).unwrap();
    assert_eq!(verify.outcome().unwrap(), Some(3));
    // A copy that records nothing cannot be checked.
    let plain = group.backend().prepare_batch(1, &case.segments, false).unwrap();
    let err = PreparedVerify::for_copy(plain.as_ref()).err().unwrap();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("prepare_recording_batch"), "{}", err.message);
}

#[test]
fn the_launch_is_queued_in_stream_order_and_the_outcome_resets() {
    let group = group();
    let mut case = Case::new();
    let stream = group.stream(0).unwrap();
    unsafe { group.backend().prepare_batch(0, &case.segments, false).unwrap().launch(stream) }.unwrap();
    let verify =
        PreparedVerify::new(group.backend().as_ref(), group.device(0).unwrap(), &case.segments).unwrap();
    assert_eq!(verify.outcome().unwrap_err().status, Status::InvalidState, "no launch yet");
    // Work queued before the verify corrupts a byte after a while: the verify must run after it.
    let target = case.dst_byte(0, 50) as *mut u8 as usize;
    host_stream(stream)
        .unwrap()
        .enqueue(move || {
            std::thread::sleep(Duration::from_millis(100));
            // SAFETY: `case.dst` outlives the synchronization below.
            unsafe { *(target as *mut u8) ^= 0x20 };
        })
        .unwrap();
    unsafe { verify.launch(stream) }.unwrap();
    assert_eq!(
        verify.outcome().unwrap_err().status,
        Status::InvalidState,
        "complete before its stream ran it"
    );
    assert_eq!(synced_outcome(&group, &verify), Some(0));
    assert_eq!(verify.outcome().unwrap_err().status, Status::InvalidState, "the outcome resets");
}

#[test]
fn bad_segments_and_streams_are_refused() {
    let group = group();
    let case = Case::new();
    let null = Segment::contiguous(0, case.dst.as_ptr() as u64, 8);
    assert_eq!(
        PreparedVerify::new(group.backend().as_ref(), group.device(0).unwrap(), &[null])
            .err()
            .unwrap()
            .status,
        Status::InvalidArgument
    );
    // A device the backend does not have.
    assert_eq!(
        PreparedVerify::new(group.backend().as_ref(), 64, &case.segments).err().unwrap().status,
        Status::InvalidDevice
    );
    let verify =
        PreparedVerify::new(group.backend().as_ref(), group.device(0).unwrap(), &case.segments).unwrap();
    let err = unsafe { verify.launch(Stream(0x3039)) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
}

#[test]
fn digest_on_the_host_backend_is_the_reference_digest() {
    let group = group();
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 1) as u8).collect();
    for (offset, len) in [(0usize, 0usize), (0, 1000), (3, 500), (9, 17)] {
        let addr = bytes.as_ptr() as u64 + offset as u64;
        let got = unsafe { group.backend().digest(group.device(1).unwrap(), Stream::NULL, addr, len as u64) }
            .unwrap();
        assert_eq!(got, gf64::digest(&bytes[offset..offset + len]));
    }
    let err = unsafe { group.backend().digest(group.device(0).unwrap(), Stream::NULL, 0, 4) }.unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
}
