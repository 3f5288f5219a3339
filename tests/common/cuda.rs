//! Small CUDA driver helpers for the GPU tests and benches (tests/gpu_copy.rs, benches/gpu_copy.rs):
//! device buffers, streams, events, peer access. Every CUresult is checked; a failure panics with
//! the call's name and the error, which is what a test or bench should do.

#![allow(dead_code)]

use cudarc::driver::sys;
use refit::transport::driver::{self, check, CurrentContext};

/// Panics with a clear message on any error.
pub fn ok<T>(what: &str, result: refit::Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e}"))
}

pub fn device_count() -> i32 {
    ok("counting CUDA devices", driver::device_count())
}

pub fn context(device: i32) -> sys::CUcontext {
    ok("retaining the primary context", driver::primary_context(device))
}

/// Runs `f` with `device`'s primary context current.
pub fn on<T>(device: i32, f: impl FnOnce() -> T) -> T {
    // SAFETY: a retained primary context.
    let _current = ok("cuCtxPushCurrent", unsafe { CurrentContext::enter(context(device)) });
    f()
}

/// Device memory owned by the test.
pub struct Buffer {
    pub device: i32,
    pub ptr: u64,
    pub len: usize,
}

impl Buffer {
    pub fn new(device: i32, len: usize) -> Buffer {
        let mut ptr = 0;
        on(device, || {
            ok("cuMemAlloc", check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) }))
        });
        Buffer { device, ptr, len }
    }

    pub fn upload(&self, bytes: &[u8]) {
        assert!(bytes.len() <= self.len);
        on(self.device, || {
            ok(
                "cuMemcpyHtoD",
                check("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(self.ptr, bytes.as_ptr().cast(), bytes.len())
                }),
            );
            // From pageable memory the call may return before the DMA lands, and on the legacy stream,
            // which the non-blocking streams under test do not wait for: finish it here.
            ok("cuCtxSynchronize", check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }));
        });
    }

    pub fn download(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; self.len];
        on(self.device, || {
            ok(
                "cuMemcpyDtoH",
                check("cuMemcpyDtoH", unsafe {
                    sys::cuMemcpyDtoH_v2(bytes.as_mut_ptr().cast(), self.ptr, self.len)
                }),
            )
        });
        bytes
    }

    pub fn fill(&self, byte: u8) {
        on(self.device, || {
            ok("cuMemsetD8", check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(self.ptr, byte, self.len) }));
            // cuMemsetD8 is asynchronous for device memory, on the legacy stream (see upload).
            ok("cuCtxSynchronize", check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }));
        });
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        on(self.device, || ok("cuMemFree", check("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) })));
    }
}

/// A non-blocking stream of one device.
pub struct Stream {
    pub device: i32,
    pub raw: sys::CUstream,
}

impl Stream {
    pub fn new(device: i32) -> Stream {
        let mut raw = std::ptr::null_mut();
        on(device, || {
            ok(
                "cuStreamCreate",
                check("cuStreamCreate", unsafe {
                    sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
                }),
            )
        });
        Stream { device, raw }
    }

    pub fn sync(&self) {
        on(self.device, || {
            ok(
                "cuStreamSynchronize",
                check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.raw) }),
            )
        });
    }

    /// Queues `times` copies of `from` into `to` (buffers of one length), so that work queued
    /// after them waits while the host goes on (about 0.5 ms per GiB on an H200).
    pub fn occupy(&self, from: &Buffer, to: &Buffer, times: usize) {
        assert_eq!(from.len, to.len);
        for _ in 0..times {
            on(self.device, || {
                ok(
                    "cuMemcpyDtoDAsync",
                    check("cuMemcpyDtoDAsync", unsafe {
                        sys::cuMemcpyDtoDAsync_v2(to.ptr, from.ptr, from.len, self.raw)
                    }),
                )
            });
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        on(self.device, || {
            ok("cuStreamDestroy", check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(self.raw) }))
        });
    }
}

/// Synchronizes the device's whole primary context (default-stream work included).
pub fn sync_device(device: i32) {
    on(device, || ok("cuCtxSynchronize", check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })));
}

/// Lets `from`'s context access `to`'s memory (idempotent).
pub fn enable_peer(from: i32, to: i32) {
    let mut can = 0;
    let (a, b) = (ok("device", driver::device_handle(from)), ok("device", driver::device_handle(to)));
    ok(
        "cuDeviceCanAccessPeer",
        check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }),
    );
    assert!(can == 1, "device {from} cannot access device {to}'s memory");
    let peer = context(to);
    on(from, || {
        let code = unsafe { sys::cuCtxEnablePeerAccess(peer, 0) };
        if code != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            ok("cuCtxEnablePeerAccess", check("cuCtxEnablePeerAccess", code));
        }
    });
}

/// A pair of events timing work on one stream.
pub struct Timer {
    device: i32,
    start: sys::CUevent,
    stop: sys::CUevent,
}

impl Timer {
    pub fn new(device: i32) -> Timer {
        let (mut start, mut stop) = (std::ptr::null_mut(), std::ptr::null_mut());
        on(device, || {
            let flags = sys::CUevent_flags::CU_EVENT_DEFAULT as u32;
            ok("cuEventCreate", check("cuEventCreate", unsafe { sys::cuEventCreate(&mut start, flags) }));
            ok("cuEventCreate", check("cuEventCreate", unsafe { sys::cuEventCreate(&mut stop, flags) }));
        });
        Timer { device, start, stop }
    }

    pub fn start(&self, stream: &Stream) {
        on(self.device, || {
            ok("cuEventRecord", check("cuEventRecord", unsafe { sys::cuEventRecord(self.start, stream.raw) }))
        });
    }

    /// Records the stop event, waits for it, and returns the elapsed milliseconds.
    pub fn stop(&self, stream: &Stream) -> f64 {
        on(self.device, || {
            ok("cuEventRecord", check("cuEventRecord", unsafe { sys::cuEventRecord(self.stop, stream.raw) }));
            ok(
                "cuEventSynchronize",
                check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.stop) }),
            );
            let mut ms = 0f32;
            ok(
                "cuEventElapsedTime",
                check("cuEventElapsedTime", unsafe {
                    sys::cuEventElapsedTime_v2(&mut ms, self.start, self.stop)
                }),
            );
            ms as f64
        })
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        on(self.device, || unsafe {
            sys::cuEventDestroy_v2(self.start);
            sys::cuEventDestroy_v2(self.stop);
        });
    }
}
