//! The device group on real GPUs (run on the GPU machine: `gpu_group --ignored --test-threads=1`):
//! streams are non-blocking, not the null stream, per device and stable; work queued earlier on the
//! caller's stream (a deliberately slow kernel) is seen after enter; ASYNC exit orders the caller's
//! stream without a host sync; run() releases ranks when one fails. Handles 1 or 2 GPUs.
// Rank-indexed parallel arrays (devices, streams, events, buffers) read clearer by index.
#![allow(clippy::needless_range_loop)]

mod gpu_common;

use cudarc::driver::sys;
use gpu_common::{caller_stream, ck, cuda, device_of, group_sizes, stream_idle, DeviceBuffer, SpinKernel};
use refit::allgather::{allgather_rank, Algorithm};
use refit::group::{BackendChoice, ExitMode, Group, GroupOptions};
use refit::segment::Segment;
use refit::transport::{Backend, Stream};
use refit::{Error, Status};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SPIN_MS: u64 = 300;

fn gpu_group(size: usize) -> Group {
    let devices: Vec<i32> = (0..size as i32).collect();
    Group::new(&devices, GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 })
        .unwrap_or_else(|e| panic!("group of {size} GPUs: {e}"))
}

fn copy_on(group: &Group, rank: usize, stream: Stream, from: u64, to: u64, len: usize) {
    unsafe {
        group.backend().copy_segments(
            group.device(rank).unwrap(),
            stream,
            &[Segment::contiguous(from, to, len as u64)],
        )
    }
    .unwrap();
}

fn read_u32(buffer: &DeviceBuffer) -> u32 {
    u32::from_le_bytes(buffer.read()[..4].try_into().unwrap())
}

#[test]
#[ignore = "needs a GPU"]
fn streams_are_non_blocking_per_device_not_null_and_the_same_across_calls() {
    for size in group_sizes() {
        let group = gpu_group(size);
        let first: Vec<Stream> = (0..size).map(|r| group.stream(r).unwrap()).collect();
        for (rank, &stream) in first.iter().enumerate() {
            assert_ne!(stream, Stream::NULL, "rank {rank} uses the null stream");
            assert!(first[..rank].iter().all(|&s| s != stream), "rank {rank} shares a stream");
            let raw = stream.0 as usize as sys::CUstream;
            let mut flags = 0u32;
            ck("cuStreamGetFlags", unsafe { sys::cuStreamGetFlags(raw, &mut flags) });
            assert_eq!(
                flags & sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                "rank {rank}'s stream is blocking (flags {flags:#x})"
            );
            let mut device = -1;
            ck("cuStreamGetDevice", unsafe { sys::cuStreamGetDevice(raw, &mut device) });
            let mut expected = -1;
            ck("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut expected, group.device(rank).unwrap()) });
            assert_eq!(device, expected, "rank {rank}'s stream is not on its device");
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            ck("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(raw, &mut ctx) });
            assert_eq!(ctx, cuda().context(group.device(rank).unwrap()).unwrap(), "not the primary context");
        }
        // The same streams across scopes, runs and queries.
        for _ in 0..3 {
            group.enter(None).unwrap();
            group.exit(ExitMode::Sync).unwrap();
        }
        let seen = Mutex::new(vec![Stream::NULL; size]);
        group
            .run(&|rank, stream| {
                // The rank's device is current on its thread.
                let mut device = -1;
                ck("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut device) });
                let mut expected = -1;
                ck("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut expected, group.device(rank).unwrap()) });
                if device != expected {
                    return Err(Error::invalid_state(format!(
                        "rank {rank} runs with device {device} current"
                    )));
                }
                seen.lock().unwrap()[rank] = stream;
                Ok(())
            })
            .unwrap();
        assert_eq!(seen.into_inner().unwrap(), first);
        assert_eq!((0..size).map(|r| group.stream(r).unwrap()).collect::<Vec<_>>(), first);
        println!("G={size}: streams {first:x?} non-blocking, per device, stable");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn work_queued_earlier_on_the_caller_stream_is_seen_after_enter() {
    for size in group_sizes() {
        let group = gpu_group(size);
        let kernels: Vec<SpinKernel> = (0..size).map(|r| SpinKernel::load(device_of(r))).collect();
        for use_null in [true, false] {
            let callers: Vec<Stream> = (0..size)
                .map(|r| if use_null { Stream::NULL } else { caller_stream(device_of(r)) })
                .collect();
            let inputs: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), 4)).collect();
            let outputs: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), 4)).collect();
            for r in 0..size {
                inputs[r].write(0, &0u32.to_le_bytes());
                outputs[r].poison();
                // Slow producer on the caller's stream: the marker appears only after SPIN_MS.
                kernels[r].launch(callers[r], SPIN_MS, inputs[r].ptr, 0xC0FFEE00 + r as u32);
            }
            group.enter(Some(&callers)).unwrap();
            for r in 0..size {
                copy_on(&group, r, group.stream(r).unwrap(), inputs[r].ptr, outputs[r].ptr, 4);
            }
            group.exit(ExitMode::Sync).unwrap();
            for r in 0..size {
                assert_eq!(
                    read_u32(&outputs[r]),
                    0xC0FFEE00 + r as u32,
                    "G={size} rank {r} ({} caller stream): the group ran before the caller's kernel",
                    if use_null { "legacy null" } else { "non-blocking" }
                );
            }
            if !use_null {
                for (r, s) in callers.iter().enumerate() {
                    cuda().destroy_stream(device_of(r), *s);
                }
            }
        }
        // Control: without enter, the group's non-blocking stream does not wait for the null stream's
        // slow kernel, so the copy reads the old value. (This is what makes the check above meaningful.)
        let input = DeviceBuffer::new(0, 4);
        let output = DeviceBuffer::new(0, 4);
        input.write(0, &7u32.to_le_bytes());
        kernels[0].launch(Stream::NULL, SPIN_MS, input.ptr, 0xBAD);
        copy_on(&group, 0, group.stream(0).unwrap(), input.ptr, output.ptr, 4);
        cuda().sync_stream(0, group.stream(0).unwrap()).unwrap();
        assert!(
            !stream_idle(0, Stream::NULL),
            "the group's stream waited for the legacy stream's slow kernel: it is not non-blocking"
        );
        assert_eq!(read_u32(&output), 7, "the group's stream waited for the legacy stream: it is blocking");
        println!("G={size}: enter orders after caller streams (null and non-blocking); control confirms");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn async_exit_orders_the_caller_stream_without_a_host_sync() {
    for size in group_sizes() {
        let group = gpu_group(size);
        let kernels: Vec<SpinKernel> = (0..size).map(|r| SpinKernel::load(device_of(r))).collect();
        let callers: Vec<Stream> = (0..size).map(|r| caller_stream(device_of(r))).collect();
        let results: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), 4)).collect();
        let copies: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), 4)).collect();
        for r in 0..size {
            results[r].write(0, &0u32.to_le_bytes());
            copies[r].poison();
        }
        group.enter(Some(&callers)).unwrap();
        for r in 0..size {
            kernels[r].launch(group.stream(r).unwrap(), SPIN_MS, results[r].ptr, 0xA5A50000 + r as u32);
        }
        let started = Instant::now();
        group.exit(ExitMode::Async).unwrap();
        let exit_time = started.elapsed();
        for r in 0..size {
            assert!(
                !stream_idle(device_of(r), group.stream(r).unwrap()),
                "G={size}: exit waited for rank {r}'s work"
            );
            // The caller's next work: must see the group's result although nobody synchronized.
            unsafe {
                cuda()
                    .copy_segments(
                        device_of(r),
                        callers[r],
                        &[Segment::contiguous(results[r].ptr, copies[r].ptr, 4)],
                    )
                    .unwrap()
            };
        }
        assert!(exit_time < Duration::from_millis(SPIN_MS / 2), "ASYNC exit blocked for {exit_time:?}");
        for r in 0..size {
            cuda().sync_stream(device_of(r), callers[r]).unwrap();
            assert_eq!(
                read_u32(&copies[r]),
                0xA5A50000 + r as u32,
                "G={size} rank {r}: caller stream not ordered"
            );
            cuda().destroy_stream(device_of(r), callers[r]);
        }
        println!("G={size}: ASYNC exit returned in {exit_time:?} and ordered the caller streams");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn each_gpu_runs_its_work_on_its_own_stream_concurrently() {
    let sizes = group_sizes();
    let size = *sizes.last().unwrap();
    if size < 2 {
        println!("one GPU: nothing to overlap; checked per-device streams in the other tests");
        return;
    }
    let group = gpu_group(size);
    let kernels: Vec<SpinKernel> = (0..size).map(|r| SpinKernel::load(device_of(r))).collect();
    let marks: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), 4)).collect();
    let started = Instant::now();
    group
        .run(&|rank, stream| {
            kernels[rank].launch(stream, SPIN_MS, marks[rank].ptr, rank as u32 + 1);
            Ok(())
        })
        .unwrap();
    let elapsed = started.elapsed();
    for r in 0..size {
        assert_eq!(read_u32(&marks[r]), r as u32 + 1);
    }
    // Serialized work would take size x SPIN_MS; concurrent work about SPIN_MS. Wide margin on purpose.
    assert!(
        elapsed < Duration::from_millis(SPIN_MS * 3 / 2),
        "{size} ranks x {SPIN_MS} ms took {elapsed:?}: the GPUs did not run concurrently"
    );
    println!("G={size}: {size} x {SPIN_MS} ms kernels on their own streams took {elapsed:?}");
}

#[test]
#[ignore = "needs a GPU"]
fn peer_access_is_reported_for_every_pair() {
    for size in group_sizes() {
        let group = gpu_group(size);
        for a in 0..size {
            for b in 0..size {
                let expected = a == b || cuda().can_access_peer(device_of(a), device_of(b)).unwrap();
                assert_eq!(group.peer_access(a, b).unwrap(), expected, "pair {a},{b}");
            }
        }
        println!("G={size}: all pairs direct: {}", group.all_peers_direct());
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_failing_rank_releases_the_others_and_the_group_stays_usable() {
    let size = *group_sizes().last().unwrap();
    let group = gpu_group(size);
    let len = 1 << 16;
    let sends: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), len)).collect();
    let recvs: Vec<DeviceBuffer> = (0..size).map(|r| DeviceBuffer::new(device_of(r), len * size)).collect();
    let blocks: Vec<Vec<u8>> = (0..size).map(|r| gpu_common::pattern(r, 0, len)).collect();
    for r in 0..size {
        sends[r].write(0, &blocks[r]);
        recvs[r].poison();
    }
    let counts = vec![len; size];
    let failing = size - 1;
    let statuses = Mutex::new(Vec::new());
    let err = group
        .run(&|rank, _| {
            if rank == failing {
                std::thread::sleep(Duration::from_millis(20));
                return Err(Error::new(Status::CallbackFailed, "deliberate failure"));
            }
            let got = unsafe {
                allgather_rank(&group, rank, sends[rank].ptr, recvs[rank].ptr, &counts, Algorithm::Peer)
            };
            statuses.lock().unwrap().push(got.as_ref().err().map(|e| e.status));
            got.map(|_| ())
        })
        .unwrap_err();
    assert_eq!(err.status, Status::CallbackFailed);
    assert!(statuses.into_inner().unwrap().iter().all(|s| *s == Some(Status::Aborted)));
    group
        .run(&|rank, _| unsafe {
            allgather_rank(&group, rank, sends[rank].ptr, recvs[rank].ptr, &counts, Algorithm::Peer)
                .map(|_| ())
        })
        .unwrap();
    let expected: Vec<u8> = blocks.concat();
    for (r, recv) in recvs.iter().enumerate() {
        assert!(recv.read() == expected, "rank {r} wrong after recovery");
    }
}
