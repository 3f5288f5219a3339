//! Helpers shared by the GPU tests (tests/gpu_*.rs): device buffers, byte patterns, and a hand-written
//! PTX spin kernel to put deliberately slow work on a stream. Every driver call is checked and a
//! failure panics with the call's name and CUresult.
#![allow(dead_code)]

use cudarc::driver::sys::{self, CUresult};
use refit::transport::cuda::{cuda_backend, CudaBackend};
use refit::transport::driver::error_name;
use refit::transport::{Backend, Stream};
use std::sync::Arc;

pub fn ck(call: &str, result: CUresult) {
    assert!(result == CUresult::CUDA_SUCCESS, "{call} failed: {}", error_name(result));
}

/// The CUDA backend; a GPU test that finds no GPU fails (it is never counted as passing).
pub fn cuda() -> Arc<CudaBackend> {
    // Never enable NVLink SHARP / multicast, whatever started us.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    cuda_backend().unwrap_or_else(|e| panic!("GPU test without a usable GPU: {e}"))
}

/// Group sizes to test: 1, 2 when the machine has two GPUs, and every GPU when it has more.
pub fn group_sizes() -> Vec<usize> {
    let count = cuda().device_count();
    let mut sizes = vec![1];
    if count >= 2 {
        sizes.push(2);
    } else {
        println!("note: one GPU: multi-GPU cases not run");
    }
    if count > 2 {
        sizes.push(count);
    }
    sizes
}

pub struct DeviceBuffer {
    pub device: i32,
    pub ptr: u64,
    pub len: usize,
}

impl DeviceBuffer {
    pub fn new(device: i32, len: usize) -> DeviceBuffer {
        let ptr = cuda().alloc(device, len).unwrap_or_else(|e| panic!("alloc {len} on {device}: {e}"));
        DeviceBuffer { device, ptr, len }
    }

    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len);
        if bytes.is_empty() {
            return;
        }
        unsafe { cuda().write(self.device, self.ptr + offset as u64, bytes) }.unwrap();
    }

    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        unsafe { cuda().read(self.device, self.ptr, &mut out) }.unwrap();
        out
    }

    pub fn poison(&self) {
        let backend = cuda();
        backend.bind(self.device).unwrap();
        ck("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(self.ptr, 0xAB, self.len) });
        ck("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = unsafe { cuda().free(self.device, self.ptr) };
    }
}

/// Deterministic bytes that depend on rank and call (xorshift).
pub fn pattern(rank: usize, call: usize, len: usize) -> Vec<u8> {
    let mut x =
        (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (call as u64 + 1).wrapping_mul(0xBF58_476D);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A one-thread kernel that spins on %globaltimer for `spin_ns`, then stores a u32 at `out`.
const SPIN_PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

.visible .entry spin_then_store(
    .param .u64 param_spin_ns,
    .param .u64 param_out,
    .param .u32 param_value
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<8>;
    .reg .b32 %r<2>;

    ld.param.u64 %rd1, [param_spin_ns];
    ld.param.u64 %rd2, [param_out];
    ld.param.u32 %r1, [param_value];
    mov.u64 %rd3, %globaltimer;
SPIN:
    mov.u64 %rd4, %globaltimer;
    sub.u64 %rd5, %rd4, %rd3;
    setp.lt.u64 %p1, %rd5, %rd1;
    @%p1 bra SPIN;
    cvta.to.global.u64 %rd6, %rd2;
    st.global.u32 [%rd6], %r1;
    membar.sys;
    ret;
}
"#;

pub struct SpinKernel {
    device: i32,
    function: sys::CUfunction,
}

// SAFETY: a CUfunction handle may be launched from any thread.
unsafe impl Send for SpinKernel {}
unsafe impl Sync for SpinKernel {}

impl SpinKernel {
    /// Loads the kernel into `device`'s primary context (binds it on this thread).
    pub fn load(device: i32) -> SpinKernel {
        let backend = cuda();
        backend.bind(device).unwrap();
        let source = std::ffi::CString::new(SPIN_PTX).unwrap();
        let mut module: sys::CUmodule = std::ptr::null_mut();
        ck("cuModuleLoadData(spin PTX)", unsafe {
            sys::cuModuleLoadData(&mut module, source.as_ptr().cast())
        });
        let mut function: sys::CUfunction = std::ptr::null_mut();
        ck("cuModuleGetFunction(spin_then_store)", unsafe {
            sys::cuModuleGetFunction(&mut function, module, c"spin_then_store".as_ptr())
        });
        SpinKernel { device, function }
    }

    /// Queues the kernel on `stream` (NULL: the legacy default stream of the device).
    pub fn launch(&self, stream: Stream, spin_ms: u64, out: u64, value: u32) {
        cuda().bind(self.device).unwrap();
        let mut spin_ns: u64 = spin_ms * 1_000_000;
        let mut out = out;
        let mut value = value;
        let mut params: [*mut std::ffi::c_void; 3] = [
            (&mut spin_ns as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
            (&mut value as *mut u32).cast(),
        ];
        ck("cuLaunchKernel(spin_then_store)", unsafe {
            sys::cuLaunchKernel(
                self.function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream.0 as usize as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        });
    }
}

/// cuStreamQuery: true when all work on the stream has finished.
pub fn stream_idle(device: i32, stream: Stream) -> bool {
    cuda().bind(device).unwrap();
    let result = unsafe { sys::cuStreamQuery(stream.0 as usize as sys::CUstream) };
    if result == CUresult::CUDA_ERROR_NOT_READY {
        return false;
    }
    ck("cuStreamQuery", result);
    true
}

/// A caller-side non-blocking stream on `device`.
pub fn caller_stream(device: i32) -> Stream {
    cuda().create_stream(device).unwrap()
}

/// The device of `rank` in the groups the GPU tests build, which put rank r on device r.
pub fn device_of(rank: usize) -> i32 {
    i32::try_from(rank).expect("a rank of a group on this machine's devices")
}
