//! The digest of device memory for one rank of a device group: the digest kernel
//! (`kernels::digest`) on the CUDA backend, the same digest computed by the host
//! (`kernels::gf64::digest`) on the host backend. This is what the C API's `refit_digest` calls.

use crate::error::{Error, Result};
use crate::group::Group;
use crate::kernels::digest::{check_range, DigestKernel};
use crate::kernels::gf64;
use crate::transport::host::host_stream;
use crate::transport::{BackendKind, Stream};
use std::sync::{Arc, Mutex};

/// The digest (see `kernels::gf64`) of the `len` bytes at `addr`, computed on `stream` (a stream of
/// `rank`'s device; `Stream::NULL` for its legacy default stream) after the work queued on it before,
/// and returned once the stream has reached it: the call waits for the stream.
///
/// Errors: InvalidArgument (rank out of range, a zero address with a nonzero length, a range past the
/// end of the address space, on the host backend a stream that is not a host stream), those of
/// `DigestKernel::for_device` (NvrtcUnavailable, KernelLoadFailed), CudaError.
///
/// # Safety
/// `addr .. addr + len` must be memory of the rank's device (host memory on the host backend) that
/// stays readable until the call returns, and `stream` a live stream of that device.
pub unsafe fn digest(group: &Group, rank: usize, stream: Stream, addr: u64, len: u64) -> Result<u64> {
    let device = group.device(rank)?;
    check_range(addr, len)?;
    match group.backend_kind() {
        BackendKind::Cuda => DigestKernel::for_device(device)?.digest(stream.as_ptr().cast(), addr, len),
        BackendKind::Host => {
            if len > isize::MAX as u64 {
                return Err(Error::invalid_argument(format!("{len} bytes do not fit in host memory")));
            }
            let backend = group.backend();
            let stream = if stream == Stream::NULL { backend.null_stream(device) } else { stream };
            let queue = host_stream(stream)?;
            let result = Arc::new(Mutex::new(None));
            let slot = Arc::clone(&result);
            queue.enqueue(move || {
                // SAFETY: the caller keeps the range readable until the call returns, which waits for
                // this work below.
                let bytes = match len {
                    0 => &[][..],
                    _ => unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) },
                };
                *crate::sync::lock(&slot) = Some(gf64::digest(bytes));
            })?;
            queue.synchronize()?;
            let value = crate::sync::lock(&result).take();
            value.ok_or_else(|| Error::invalid_state("the host stream stopped before it ran the digest"))
        }
    }
}
