//! The peer allgather on real GPUs when refit's copy kernel cannot be built (libnvrtc missing; run on
//! the GPU machine: `gpu_allgather_without_nvrtc --ignored`). Its own test binary, because the kernel,
//! once loaded, stays loaded for the process: here `REFIT_NVRTC_LIBRARY` names a file that does not
//! exist before anything loads it. Every block must then move with the copy engine, byte-exact, at
//! sizes where the kernel would otherwise run.

mod gpu_common;

use gpu_common::{cuda, device_of, group_sizes, pattern, DeviceBuffer};
use refit::allgather::peer::{kernels_run, method_for, PeerMethod};
use refit::allgather::{allgather, Algorithm};
use refit::error::Status;
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::kernels::BatchedCopy;

#[test]
#[ignore = "needs a GPU"]
fn peer_allgather_without_the_kernel_uses_the_copy_engine() {
    std::env::set_var("REFIT_NVRTC_LIBRARY", "/nonexistent/libnvrtc.so");
    cuda();
    let err = BatchedCopy::for_device(0).err().expect("the kernel must not build without libnvrtc");
    assert_eq!(err.status, Status::NvrtcUnavailable, "{err}");

    for size in group_sizes() {
        let devices: Vec<i32> = (0..size as i32).collect();
        let group = Group::new(&devices, GroupOptions { backend: BackendChoice::Cuda, host_devices: 0 })
            .unwrap_or_else(|e| panic!("group of {size} GPUs: {e}"));
        assert!(!kernels_run(&group).unwrap(), "G={size}: the kernel reported as running");
        // 64 KiB per rank is kernel pushes' size; 32 MiB + 5 has an own-block kernel copy.
        for block in [64 << 10, (32 << 20) + 5] {
            assert_eq!(method_for(&group, block as u64).unwrap(), PeerMethod::CopyEnginePushes, "G={size}");
            for in_place in [false, true] {
                let blocks: Vec<Vec<u8>> = (0..size).map(|r| pattern(r, block, block)).collect();
                let sends: Vec<DeviceBuffer> =
                    (0..size).map(|r| DeviceBuffer::new(device_of(r), block)).collect();
                let recvs: Vec<DeviceBuffer> =
                    (0..size).map(|r| DeviceBuffer::new(device_of(r), size * block)).collect();
                let mut send_ptrs = Vec::new();
                for r in 0..size {
                    recvs[r].poison();
                    if in_place {
                        recvs[r].write(r * block, &blocks[r]);
                        send_ptrs.push(recvs[r].ptr + (r * block) as u64);
                    } else {
                        sends[r].write(0, &blocks[r]);
                        send_ptrs.push(sends[r].ptr);
                    }
                }
                let recv_ptrs: Vec<u64> = recvs.iter().map(|b| b.ptr).collect();
                let counts = vec![block; size];
                let ran = unsafe { allgather(&group, &send_ptrs, &recv_ptrs, &counts, Algorithm::Peer) }
                    .unwrap_or_else(|e| panic!("G={size} block {block} in place {in_place}: {e}"));
                assert_eq!(ran, Algorithm::Peer);
                let expected = blocks.concat();
                for (r, recv) in recvs.iter().enumerate() {
                    let got = recv.read();
                    let first = got.iter().zip(&expected).position(|(a, b)| a != b);
                    assert!(
                        first.is_none(),
                        "G={size} block {block} in place {in_place}: rank {r} differs at byte {first:?}"
                    );
                }
            }
        }
    }
}
