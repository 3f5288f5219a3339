//! What the executor benches that run on a GPU or, with REFIT_BENCH_HOST=1, on the host backend share
//! (gpu_refit, gpu_sweep): the device they run on, its memory through the transport and its group
//! through the C ABI, and the check of a C call's status.

use refit::ffi::group::*;
use refit::ffi::status::refit_last_error_message;
use refit::transport::cuda::cuda_backend;
use refit::transport::host::HostBackend;
use refit::transport::Backend;
use refit::Status;
use std::ffi::CStr;
use std::sync::Arc;

/// Panics with the library's message unless `status` is SUCCESS (a bench stops at its first failure).
pub fn ok(status: Status, call: &str) {
    if status != Status::Success {
        // SAFETY: the library's NUL-terminated message.
        let message = unsafe { CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned();
        panic!("{call}: {} ({message})", status.name().to_string_lossy());
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The bench's device 0: memory through the transport, the group through the C ABI. Each bench adds
/// the fills and reads it needs.
pub struct Machine {
    pub backend: Arc<dyn Backend>,
    pub group: *mut refit_group,
    pub on_gpu: bool,
}

impl Machine {
    /// CUDA device 0, or the host backend when REFIT_BENCH_HOST is set; `bench` names the bench in
    /// the message when there is neither.
    pub fn new(bench: &str) -> Machine {
        let host = std::env::var_os("REFIT_BENCH_HOST").is_some();
        let backend: Arc<dyn Backend> = if host {
            Arc::new(HostBackend::new(1).expect("host backend"))
        } else {
            cuda_backend().unwrap_or_else(|e| panic!("{bench} needs a GPU (or REFIT_BENCH_HOST=1): {e}"))
        };
        // SAFETY: all-zero is a valid options struct; init fills it.
        let mut options: refit_group_options = unsafe { std::mem::zeroed() };
        ok(refit_group_options_init(&mut options), "refit_group_options_init");
        options.backend = if host { REFIT_BACKEND_HOST } else { REFIT_BACKEND_CUDA };
        let mut group = std::ptr::null_mut();
        ok(refit_group_create([0i32].as_ptr(), 1, &options, &mut group), "refit_group_create");
        Machine { backend, group, on_gpu: !host }
    }

    pub fn alloc(&self, bytes: u64) -> u64 {
        self.backend.alloc(0, bytes as usize).unwrap_or_else(|e| panic!("allocating {bytes} bytes: {e}"))
    }

    pub fn free(&self, ptr: u64) {
        // SAFETY: from alloc; the caller has drained the work using it.
        unsafe { self.backend.free(0, ptr) }.expect("free");
    }
}
