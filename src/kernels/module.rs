//! Compiling a kernel source for one device and loading it into the device's primary context: shared
//! by every kernel of the library (the batched copy, the digest, the quantizing copy), with the one
//! launch call they all make.

use super::image_cache::{self, Key};
use crate::error::{Error, Result, Status};
use crate::transport::driver::{self, check, CurrentContext};
use crate::transport::nvrtc::{self, Output};
use cudarc::driver::sys;

/// A module loaded into a device's primary context (retained for the life of the process, like the
/// module: kernels are loaded once per device and kept).
pub(crate) struct Loaded {
    pub context: sys::CUcontext,
    pub module: sys::CUmodule,
    /// Streaming multiprocessors on the device.
    pub sms: u32,
    /// How the module was built, for logs and bench output.
    pub build: String,
}

/// Compiles `source` (named `file` in compiler messages) for `device`'s exact architecture and loads
/// it: the CUBIN first, the PTX for the driver to JIT when the CUBIN does not load (an NVRTC newer
/// than the driver). Each image is compiled once per architecture and compiler, then kept for the
/// process's other devices ([`image_cache`]). Errors: CudaUnavailable, InvalidDevice,
/// NvrtcUnavailable, KernelLoadFailed (with NVRTC's log or the driver's errors), CudaError.
pub(crate) fn load(device: i32, source: &str, file: &str) -> Result<Loaded> {
    use sys::CUdevice_attribute as A;
    driver::device_handle(device)?;
    let major = driver::attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = driver::attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sms = driver::attribute(device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
    let context = driver::primary_context(device)?;
    // SAFETY: just retained.
    let _current = unsafe { CurrentContext::enter(context) }?;
    let context_msg = |e: Error| e.context(format!("loading {file} on device {device}"));
    let compiler = nvrtc::version().map_err(context_msg)?;
    let compiled = |output| {
        let key = Key { source, file, major, minor, output, compiler: &compiler };
        image_cache::image(&key, || nvrtc::compile(source, file, major, minor, output, &[]).map(|c| c.image))
            .map_err(context_msg)
    };
    let cubin = compiled(Output::Cubin)?;
    let (module, build) = match load_image(&cubin) {
        Ok(module) => (module, format!("CUBIN sm_{major}{minor}")),
        Err(cubin_err) => {
            log::warn!(
                "{file}: CUBIN for sm_{major}{minor} did not load ({}), trying PTX",
                cubin_err.message
            );
            let ptx = compiled(Output::Ptx)?;
            let module = load_image(&ptx).map_err(|ptx_err| {
                Error::new(
                    Status::KernelLoadFailed,
                    format!(
                        "{file}: device {device} (sm_{major}{minor}) loads neither the CUBIN ({}) nor the PTX ({})",
                        cubin_err.message, ptx_err.message
                    ),
                )
            })?;
            (module, format!("PTX compute_{major}{minor} (JIT)"))
        }
    };
    Ok(Loaded { context, module, sms, build: format!("{build}, {compiler}, {sms} SMs") })
}

/// A kernel of a loaded module, by name.
pub(crate) fn function(module: sys::CUmodule, name: &std::ffi::CStr) -> Result<sys::CUfunction> {
    let mut function = std::ptr::null_mut();
    // SAFETY: live module, NUL-terminated name.
    check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut function, module, name.as_ptr()) })
        .map_err(|e| Error::new(Status::KernelLoadFailed, e.message))?;
    Ok(function)
}

/// Queues `function` over a one-dimensional grid of `blocks` blocks of `threads` threads on `stream`,
/// without dynamic shared memory. The caller has the function's context current.
///
/// # Safety
/// `params` points at one value per parameter of `function`, of its types (the driver reads as many
/// as the function has), alive for the call; `stream` is NULL or a live stream of the function's
/// context; the memory the parameters name stays valid until the launch has run.
pub(crate) unsafe fn launch(
    function: sys::CUfunction,
    blocks: u32,
    threads: u32,
    stream: sys::CUstream,
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    // SAFETY: the caller's promises; no extra-parameter buffer.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            function,
            blocks,
            1,
            1,
            threads,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

impl Loaded {
    /// Asks the driver to give `function`'s (of this module) SMs the most shared memory, and the
    /// least L1, it can: a kernel whose blocks each keep a large shared array (the quantize kernel's
    /// cache of a tile) holds more blocks per SM so. A hint the driver may override.
    pub(crate) fn prefer_shared_memory(&self, function: sys::CUfunction) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        // SAFETY: a live function of this context's module; a plain attribute value.
        check("cuFuncSetAttribute", unsafe {
            sys::cuFuncSetAttribute(
                function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                sys::CUshared_carveout::CU_SHAREDMEM_CARVEOUT_MAX_SHARED as i32,
            )
        })
        .map_err(|e| Error::new(Status::KernelLoadFailed, e.message))
    }

    /// Blocks of `threads` threads of `function` (from this module) that fit on one SM at once.
    /// The occupancy query needs the module's context current on the calling thread, which
    /// [`load`] no longer holds once it returns.
    pub(crate) fn blocks_per_sm(&self, function: sys::CUfunction, threads: u32) -> Result<u32> {
        // SAFETY: the context is retained for the life of the process.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        let mut per_sm = 0;
        // SAFETY: live function of this context's module.
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, function, threads as i32, 0)
        })?;
        Ok(per_sm.max(1) as u32)
    }
}

fn load_image(image: &[u8]) -> Result<sys::CUmodule> {
    let mut module = std::ptr::null_mut();
    // SAFETY: a CUBIN image or NUL-terminated PTX that outlives the call.
    check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) })?;
    Ok(module)
}
