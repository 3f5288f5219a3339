//! The batched copy kernel on real GPUs (run on the GPU machine with `--ignored --test-threads=1`).
//! Every case: random source bytes, a poisoned destination, one copy, and the whole destination
//! buffer compared byte-exact with `reference` (a byte loop over the segment definition on the host),
//! so bytes that must not be written are checked as well. Peer cases need 2 GPUs and fail otherwise
//! (`--skip peer` on a one-GPU machine).

#[path = "common/cuda.rs"]
mod cuda;
#[path = "common/random_batch.rs"]
mod random_batch;

use cuda::{enable_peer, ok, on, Buffer, Stream};
use cudarc::driver::sys;
use random_batch::{first_difference, random_batch, rebase, reference, Batch, Rng, Shape};
use refit::kernels::{copy_segments, PreparedBatch};
use refit::transport::driver::check;
use refit::{Segment, Status};

const POISON: u8 = 0xCD;

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

/// Buffers of one case: the source (random bytes) and the poisoned destination, on any devices.
struct Case {
    batch: Batch,
    host_src: Vec<u8>,
    src: Buffer,
    dst: Buffer,
    segments: Vec<Segment>,
}

impl Case {
    fn new(rng: &mut Rng, batch: Batch, src_device: i32, dst_device: i32) -> Case {
        let mut host_src = vec![0u8; batch.src_len];
        rng.fill(&mut host_src);
        let src = Buffer::new(src_device, batch.src_len);
        src.upload(&host_src);
        let dst = Buffer::new(dst_device, batch.dst_len);
        dst.fill(POISON);
        let segments = rebase(&batch.segments, src.ptr, dst.ptr);
        Case { batch, host_src, src, dst, segments }
    }

    fn expected(&self) -> Vec<u8> {
        let mut want = vec![POISON; self.batch.dst_len];
        reference(&self.batch.segments, &self.host_src, &mut want);
        want
    }

    /// New random source bytes and a fresh poison, for repeated launches.
    fn refresh(&mut self, rng: &mut Rng) {
        rng.fill(&mut self.host_src);
        self.src.upload(&self.host_src);
        self.dst.fill(POISON);
    }

    fn verify(&self, what: &str) {
        let got = self.dst.download();
        if let Some((at, g, w)) = first_difference(&got, &self.expected()) {
            let owner = self.batch.segments.iter().position(|s| {
                let end = s.dst + random_batch::extent(s.len, s.count, s.dst_stride);
                (s.dst..end).contains(&(at as u64))
            });
            panic!("{what}: destination byte {at} is {g:#x}, expected {w:#x} (inside segment {owner:?})");
        }
    }
}

fn one_copy(seed: u64, shape: Shape, devices: (i32, i32, i32), checked: bool) {
    let (kernel_device, src_device, dst_device) = devices;
    let mut rng = Rng::new(seed);
    let batch = random_batch(&mut rng, shape);
    let case = Case::new(&mut rng, batch, src_device, dst_device);
    let stream = Stream::new(kernel_device);
    ok("copy_segments", copy(kernel_device, stream.raw, &case.segments, checked));
    stream.sync();
    case.verify(&format!("seed {seed} {shape:?} devices {devices:?}"));
}

fn shapes() -> Vec<Shape> {
    let mut list = Vec::new();
    for misaligned in [false, true] {
        list.push(Shape {
            segments: 60,
            max_len: 1 << 20,
            strided_percent: 30,
            misaligned,
            src_len: 3 << 20,
        });
        list.push(Shape { segments: 5000, max_len: 4096, strided_percent: 20, misaligned, src_len: 1 << 20 });
        list.push(Shape {
            segments: 300,
            max_len: 65536,
            strided_percent: 100,
            misaligned,
            src_len: 4 << 20,
        });
    }
    list
}

#[test]
#[ignore = "needs a GPU"]
fn random_batches_on_one_gpu() {
    for (k, shape) in shapes().into_iter().enumerate() {
        for seed in 0..3 {
            one_copy(1000 * k as u64 + seed, shape, (0, 0, 0), seed % 2 == 0);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn every_size_class_at_every_skew() {
    // Lengths around every boundary of the kernel (vector widths, warp width, tile size), with
    // source/destination offsets 0..16 apart so every access width is taken.
    let lengths = [
        1u64,
        2,
        3,
        7,
        15,
        16,
        17,
        31,
        32,
        33,
        255,
        256,
        257,
        511,
        512,
        513,
        767,
        768,
        4095,
        4096,
        4097,
        8191,
        8192,
        8193,
        65536 + 3,
        1 << 20,
        (16 << 20) + 5,
    ];
    let mut rng = Rng::new(77);
    for skew in 0..17u64 {
        let mut segments = Vec::new();
        let mut cursor = 0u64;
        let mut src_at = 0u64;
        for &len in &lengths {
            let dst = cursor + (skew * 7) % 16;
            let src = src_at + skew % 16;
            segments.push(Segment::contiguous(src, dst, len));
            cursor = dst + len + 32;
            src_at = src + len + 16;
        }
        let batch = Batch { segments, src_len: src_at as usize + 32, dst_len: cursor as usize };
        let case = Case::new(&mut rng, batch, 0, 0);
        let stream = Stream::new(0);
        ok("copy_segments", copy(0, stream.raw, &case.segments, true));
        stream.sync();
        case.verify(&format!("skew {skew}"));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn zero_length_segments_and_empty_batches() {
    let mut rng = Rng::new(5);
    let segments = vec![
        Segment::contiguous(0, 0, 0),
        Segment::contiguous(16, 0, 100),
        Segment { count: [0, 4], ..Segment::contiguous(200, 300, 9) },
        Segment::contiguous(0, 0, 0),
    ];
    let case = Case::new(&mut rng, Batch { segments, src_len: 512, dst_len: 512 }, 0, 0);
    // Only the second segment carries bytes; the launch must skip the others (and write nothing else).
    let stream = Stream::new(0);
    ok("copy_segments", copy(0, stream.raw, &case.segments, true));
    ok("empty batch", copy(0, stream.raw, &[], true));
    let empty = ok("prepare empty", PreparedBatch::new(0, &[Segment::contiguous(0, 0, 0)], true));
    ok("launch empty", launch(&empty, stream.raw));
    stream.sync();
    case.verify("zero-length segments");
}

#[test]
#[ignore = "needs a GPU"]
fn tensor_parallel_column_split() {
    // 2,048 rows of 1,536 bytes, split into two column halves of 768 bytes (and gathered back).
    let mut rng = Rng::new(9);
    let rows = 2048u64;
    let split = vec![
        Segment { src: 0, dst: 0, len: 768, count: [rows, 1], src_stride: [1536, 0], dst_stride: [768, 0] },
        Segment {
            src: 768,
            dst: rows * 768,
            len: 768,
            count: [rows, 1],
            src_stride: [1536, 0],
            dst_stride: [768, 0],
        },
    ];
    let case = Case::new(
        &mut rng,
        Batch { segments: split, src_len: (rows * 1536) as usize, dst_len: (rows * 1536) as usize },
        0,
        0,
    );
    let stream = Stream::new(0);
    ok("copy_segments", copy(0, stream.raw, &case.segments, true));
    stream.sync();
    case.verify("column split");
    let gather = vec![
        Segment { src: 0, dst: 0, len: 768, count: [rows, 1], src_stride: [768, 0], dst_stride: [1536, 0] },
        Segment {
            src: rows * 768,
            dst: 768,
            len: 768,
            count: [rows, 1],
            src_stride: [768, 0],
            dst_stride: [1536, 0],
        },
    ];
    let case = Case::new(
        &mut rng,
        Batch { segments: gather, src_len: (rows * 1536) as usize, dst_len: (rows * 1536) as usize },
        0,
        0,
    );
    ok("copy_segments", copy(0, stream.raw, &case.segments, true));
    stream.sync();
    case.verify("column gather");
}

#[test]
#[ignore = "needs a GPU"]
fn default_stream_is_accepted() {
    let mut rng = Rng::new(12);
    let shape =
        Shape { segments: 100, max_len: 65536, strided_percent: 30, misaligned: true, src_len: 1 << 20 };
    let batch = random_batch(&mut rng, shape);
    let case = Case::new(&mut rng, batch, 0, 0);
    ok("copy_segments", copy(0, std::ptr::null_mut(), &case.segments, false));
    cuda::sync_device(0);
    case.verify("legacy default stream");
}

#[test]
#[ignore = "needs a GPU"]
fn prepared_batch_launched_100_times() {
    let mut rng = Rng::new(13);
    let shape =
        Shape { segments: 2000, max_len: 65536, strided_percent: 30, misaligned: true, src_len: 2 << 20 };
    let batch = random_batch(&mut rng, shape);
    let mut case = Case::new(&mut rng, batch, 0, 0);
    let prepared = ok("PreparedBatch::new", PreparedBatch::new(0, &case.segments, true));
    assert_eq!(prepared.bytes(), random_batch::payload(&case.segments));
    let stream = Stream::new(0);
    for round in 0..100 {
        // New bytes every launch: the batch must read the sources at launch time.
        case.refresh(&mut rng);
        ok("launch", launch(&prepared, stream.raw));
        stream.sync();
        case.verify(&format!("launch {round}"));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn every_lane_group_width_and_tile_size() {
    let mut rng = Rng::new(18);
    for (k, shape) in shapes().into_iter().enumerate() {
        let batch = random_batch(&mut rng, shape);
        let mut case = Case::new(&mut rng, batch, 0, 0);
        let stream = Stream::new(0);
        for (tile_shift, lanes) in [(13, 8), (13, 16), (13, 32), (10, 8), (16, 32), (12, 16)] {
            let prepared =
                ok("PreparedBatch::tuned", PreparedBatch::tuned(0, &case.segments, true, tile_shift, lanes));
            case.refresh(&mut rng);
            ok("launch", launch(&prepared, stream.raw));
            stream.sync();
            case.verify(&format!("shape {k}, tile 2^{tile_shift}, {lanes} lanes per tile"));
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn batches_limited_to_few_blocks_copy_everything() {
    let mut rng = Rng::new(23);
    for (k, shape) in shapes().into_iter().enumerate() {
        let batch = random_batch(&mut rng, shape);
        let mut case = Case::new(&mut rng, batch, 0, 0);
        let stream = Stream::new(0);
        for blocks in [1, 3, 48] {
            let mut prepared = ok("PreparedBatch::new", PreparedBatch::new(0, &case.segments, true));
            let (_, full_grid, _) = prepared.geometry();
            prepared.limit_blocks(blocks);
            assert_eq!(
                prepared.geometry().1,
                full_grid.min(blocks),
                "shape {k}: grid after limit_blocks({blocks})"
            );
            case.refresh(&mut rng);
            ok("launch", launch(&prepared, stream.raw));
            stream.sync();
            case.verify(&format!("shape {k}, limited to {blocks} blocks"));
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn prepared_batch_in_a_cuda_graph() {
    let mut rng = Rng::new(14);
    let shape =
        Shape { segments: 3000, max_len: 16384, strided_percent: 30, misaligned: true, src_len: 2 << 20 };
    let batch = random_batch(&mut rng, shape);
    let mut case = Case::new(&mut rng, batch, 0, 0);
    let prepared = ok("PreparedBatch::new", PreparedBatch::new(0, &case.segments, false));
    let stream = Stream::new(0);
    let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
    on(0, || {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        ok(
            "cuStreamBeginCapture",
            check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(stream.raw, mode) }),
        );
        let launched = launch(&prepared, stream.raw);
        let ended = check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream.raw, &mut graph) });
        ok("launch under capture", launched);
        ok("cuStreamEndCapture", ended);
        ok(
            "cuGraphInstantiate",
            check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }),
        );
    });
    for replay in 0..5 {
        case.refresh(&mut rng);
        on(0, || {
            ok("cuGraphLaunch", check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, stream.raw) }))
        });
        stream.sync();
        case.verify(&format!("graph replay {replay}"));
    }
    on(0, || unsafe {
        ok("cuGraphExecDestroy", check("cuGraphExecDestroy", sys::cuGraphExecDestroy(exec)));
        ok("cuGraphDestroy", check("cuGraphDestroy", sys::cuGraphDestroy(graph)));
    });
}

#[test]
#[ignore = "needs a GPU"]
fn one_shot_and_prepared_install_identical_bytes() {
    let mut rng = Rng::new(15);
    let shape =
        Shape { segments: 500, max_len: 1 << 20, strided_percent: 40, misaligned: true, src_len: 3 << 20 };
    let batch = random_batch(&mut rng, shape);
    let case = Case::new(&mut rng, batch, 0, 0);
    let stream = Stream::new(0);
    ok("copy_segments", copy(0, stream.raw, &case.segments, true));
    stream.sync();
    let one_shot = case.dst.download();
    case.dst.fill(POISON);
    let prepared = ok("PreparedBatch::new", PreparedBatch::new(0, &case.segments, true));
    ok("launch", launch(&prepared, stream.raw));
    stream.sync();
    assert!(one_shot == case.dst.download(), "one-shot and prepared results differ");
    case.verify("prepared");
}

/// One-shot calls upload their descriptors into reusable slots (`kernels::upload`): queued back to
/// back behind a long copy, more calls are in flight than there are slots (the rest allocate their
/// tables), one table is larger than a slot, and a second round reuses the slots the first left
/// idle. Every call must copy by its own descriptors.
#[test]
#[ignore = "needs a GPU"]
fn one_shot_calls_in_flight_at_once_each_read_their_own_descriptors() {
    let mut rng = Rng::new(16);
    let small =
        Shape { segments: 40, max_len: 65536, strided_percent: 30, misaligned: true, src_len: 1 << 20 };
    // About 100,000 descriptors: a table above the largest slot.
    let large =
        Shape { segments: 100_000, max_len: 512, strided_percent: 10, misaligned: true, src_len: 8 << 20 };
    let calls = 3 * refit::kernels::UPLOAD_SLOTS;
    let mut cases: Vec<Case> = (0..calls)
        .map(|k| {
            let shape = if k == calls - 1 { large } else { small };
            let batch = random_batch(&mut rng, shape);
            Case::new(&mut rng, batch, 0, 0)
        })
        .collect();
    let stream = Stream::new(0);
    let busy = (Buffer::new(0, 1 << 30), Buffer::new(0, 1 << 30));
    for round in 0..2 {
        // About 4 ms of copying ahead of the calls, so that they queue while it runs.
        stream.occupy(&busy.0, &busy.1, 8);
        for case in &cases {
            ok("copy_segments", copy(0, stream.raw, &case.segments, round == 1));
        }
        stream.sync();
        for (k, case) in cases.iter_mut().enumerate() {
            case.verify(&format!("round {round}, call {k}"));
            case.refresh(&mut rng);
        }
    }
}

/// A one-shot copy on a stream under graph capture is refused (its descriptors' memory is reused
/// by later calls), queuing nothing: the capture goes on and ends with an empty graph.
#[test]
#[ignore = "needs a GPU"]
fn a_one_shot_copy_under_graph_capture_is_refused_and_the_capture_goes_on() {
    let mut rng = Rng::new(17);
    let shape =
        Shape { segments: 20, max_len: 4096, strided_percent: 0, misaligned: false, src_len: 1 << 20 };
    let batch = random_batch(&mut rng, shape);
    let case = Case::new(&mut rng, batch, 0, 0);
    let stream = Stream::new(0);
    let mut graph = std::ptr::null_mut();
    on(0, || {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        ok(
            "cuStreamBeginCapture",
            check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(stream.raw, mode) }),
        );
        let refused = copy(0, stream.raw, &case.segments, false);
        let ended = check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream.raw, &mut graph) });
        let err = refused.expect_err("a one-shot copy under graph capture");
        assert_eq!(err.status, Status::Unsupported, "{err}");
        ok("cuStreamEndCapture after the refusal", ended);
        let mut nodes = 0usize;
        ok(
            "cuGraphGetNodes",
            check("cuGraphGetNodes", unsafe {
                sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes)
            }),
        );
        assert_eq!(nodes, 0, "the refused call queued work into the graph");
        ok("cuGraphDestroy", check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) }));
    });
    ok("copy_segments", copy(0, stream.raw, &case.segments, false));
    stream.sync();
    case.verify("the same copy after the capture");
}

fn two_gpus() {
    let n = cuda::device_count();
    assert!(n >= 2, "peer tests need 2 GPUs, found {n} (gpu/run.sh skips *_two_gpus on one GPU)");
    enable_peer(0, 1);
    enable_peer(1, 0);
}

#[test]
#[ignore = "needs a GPU"]
fn peer_source_pulled_by_the_destination_gpu_two_gpus() {
    two_gpus();
    for (k, shape) in shapes().into_iter().enumerate() {
        one_copy(5000 + k as u64, shape, (0, 1, 0), true);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn peer_destination_pushed_by_the_source_gpu_two_gpus() {
    two_gpus();
    for (k, shape) in shapes().into_iter().enumerate() {
        one_copy(6000 + k as u64, shape, (0, 0, 1), false);
    }
    // And a prepared batch on device 1 writing into device 0.
    let mut rng = Rng::new(6100);
    let shape =
        Shape { segments: 1000, max_len: 65536, strided_percent: 30, misaligned: true, src_len: 2 << 20 };
    let batch = random_batch(&mut rng, shape);
    let mut case = Case::new(&mut rng, batch, 1, 0);
    let prepared = ok("PreparedBatch::new", PreparedBatch::new(1, &case.segments, true));
    let stream = Stream::new(1);
    for round in 0..3 {
        case.refresh(&mut rng);
        ok("launch", launch(&prepared, stream.raw));
        stream.sync();
        case.verify(&format!("peer prepared launch {round}"));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn errors_are_statuses_and_copy_nothing() {
    let mut rng = Rng::new(16);
    let batch = Batch {
        segments: vec![Segment::contiguous(0, 0, 64), Segment::contiguous(64, 32, 64)],
        src_len: 256,
        dst_len: 256,
    };
    let case = Case::new(&mut rng, batch, 0, 0);
    let stream = Stream::new(0);
    let err = copy(0, stream.raw, &case.segments, true).unwrap_err();
    assert_eq!(err.status, Status::Overlap, "{err}");
    let err = PreparedBatch::new(0, &case.segments, true).err().expect("overlap");
    assert_eq!(err.status, Status::Overlap, "{err}");
    stream.sync();
    assert!(case.dst.download().iter().all(|&b| b == POISON), "a rejected batch copies nothing");

    let count = cuda::device_count();
    let err = copy(count, stream.raw, &case.segments[..1], false).unwrap_err();
    assert_eq!(err.status, Status::InvalidDevice, "{err}");
    let err = PreparedBatch::new(-1, &case.segments[..1], false).err().expect("bad device");
    assert_eq!(err.status, Status::InvalidDevice, "{err}");
    let bad = Segment::contiguous(0, case.dst.ptr, 8);
    assert_eq!(copy(0, stream.raw, &[bad], false).unwrap_err().status, Status::InvalidArgument);
}

#[test]
#[ignore = "needs a GPU"]
fn group_rank_copy_on_the_cuda_backend() {
    use refit::group::{BackendChoice, Group, GroupOptions};
    let devices: Vec<i32> = if cuda::device_count() >= 2 { vec![0, 1] } else { vec![0] };
    let group = ok(
        "Group::new",
        Group::new(&devices, GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 }),
    );
    let rank = devices.len() - 1;
    let device = devices[rank];
    let stream = ok("group stream", group.stream(rank));
    let mut rng = Rng::new(17);
    let shape =
        Shape { segments: 400, max_len: 65536, strided_percent: 30, misaligned: true, src_len: 2 << 20 };
    let batch = random_batch(&mut rng, shape);
    let mut case = Case::new(&mut rng, batch, device, device);
    // SAFETY: live buffers of this rank's device and the group's own stream.
    let backend = group.backend();
    ok("copy_batch", unsafe { backend.copy_batch(device, stream, &case.segments, true) });
    ok("sync", group.backend().sync_stream(device, stream));
    case.verify("group rank one-shot");
    let prepared = ok("prepare_batch", backend.prepare_batch(device, &case.segments, true));
    for round in 0..3 {
        case.refresh(&mut rng);
        // SAFETY: as above.
        ok("launch", unsafe { prepared.launch(stream) });
        ok("sync", group.backend().sync_stream(device, stream));
        case.verify(&format!("group rank prepared launch {round}"));
    }
}

/// A CUDA group of device 0 made through the C API.
fn c_group() -> *mut refit::ffi::group::refit_group {
    use refit::ffi::group::{refit_group_create, refit_group_options_init, REFIT_BACKEND_CUDA};
    let mut options = std::mem::MaybeUninit::uninit();
    assert_eq!(refit_group_options_init(options.as_mut_ptr()), Status::Success);
    // SAFETY: initialized by the call above.
    let mut options = unsafe { options.assume_init() };
    options.backend = REFIT_BACKEND_CUDA;
    let mut group = std::ptr::null_mut();
    assert_eq!(refit_group_create([0].as_ptr(), 1, &options, &mut group), Status::Success);
    group
}

fn c_error() -> String {
    // SAFETY: the library's thread-local message, NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr(refit::ffi::status::refit_last_error_message()) }
        .to_string_lossy()
        .into()
}

/// refit_copy_batch and refit_copy_batch_prepare refuse, before anything reaches the device,
/// segments whose memory is not the device's: host malloc memory on either side, freed memory, an
/// address nothing is mapped at, a range past its allocation's end. The context stays usable: a
/// good batch afterwards copies byte-exact.
#[test]
#[ignore = "needs a GPU"]
fn the_c_api_refuses_memory_that_is_not_the_devices() {
    use refit::ffi::copy::{refit_copy_batch, refit_copy_batch_destroy, refit_copy_batch_prepare};
    const MIB: usize = 1 << 20;
    let group = c_group();
    let (src, dst) = (Buffer::new(0, MIB), Buffer::new(0, MIB));
    let mut host = vec![0u8; MIB];
    let freed = Buffer::new(0, MIB).ptr; // freed when the temporary drops
    let cases = [
        (
            "host source",
            Segment::contiguous(host.as_mut_ptr() as u64, dst.ptr, 4096),
            "segment 0: its source",
        ),
        ("host destination", Segment::contiguous(src.ptr, host.as_mut_ptr() as u64, 4096), "its destination"),
        ("freed source", Segment::contiguous(freed, dst.ptr, 4096), "no memory CUDA knows"),
        ("unmapped source", Segment::contiguous(0x7f00_0000_0000, dst.ptr, 4096), "no memory CUDA knows"),
        (
            "past the end",
            Segment::contiguous(src.ptr, dst.ptr, 64 * MIB as u64),
            "past the end of its allocation",
        ),
    ];
    dst.fill(POISON);
    for (what, segment, words) in cases {
        let status = refit_copy_batch(group, 0, std::ptr::null_mut(), &segment, 1, 0);
        assert_eq!(status, Status::InvalidArgument, "{what}: {}", c_error());
        assert!(c_error().contains(words), "{what}: {words:?} missing from {}", c_error());
        let mut batch = std::ptr::null_mut();
        let status = refit_copy_batch_prepare(group, 0, &segment, 1, 0, &mut batch);
        assert_eq!(status, Status::InvalidArgument, "{what} (prepared): {}", c_error());
        assert!(batch.is_null());
    }
    assert!(dst.download().iter().all(|&b| b == POISON), "a refused batch wrote");
    let bytes: Vec<u8> = (0..MIB).map(|i| (i * 13 + 1) as u8).collect();
    src.upload(&bytes);
    let good = Segment::contiguous(src.ptr, dst.ptr, MIB as u64);
    assert_eq!(
        refit_copy_batch(group, 0, std::ptr::null_mut(), &good, 1, 0),
        Status::Success,
        "{}",
        c_error()
    );
    on(0, || ok("cuCtxSynchronize", check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })));
    assert_eq!(dst.download(), bytes, "the context no longer copies right");
    let mut batch = std::ptr::null_mut();
    assert_eq!(refit_copy_batch_prepare(group, 0, &good, 1, 0, &mut batch), Status::Success);
    refit_copy_batch_destroy(batch);
    refit::ffi::group::refit_group_destroy(group);
}
