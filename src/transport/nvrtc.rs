//! NVRTC, loaded at run time: just the calls needed to compile one source for one architecture.
//! Compiling needs no GPU (the architecture is a parameter), so the kernel source can be checked on a
//! machine with only libnvrtc.

use super::dynlib::Library;
use crate::error::{Error, Result, Status};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

type Program = *mut c_void;
type NvrtcResult = c_int;

type CreateProgram = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult;
type DestroyProgram = unsafe extern "C" fn(*mut Program) -> NvrtcResult;
type GetSize = unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult;
type GetBytes = unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult;
type GetErrorString = unsafe extern "C" fn(NvrtcResult) -> *const c_char;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;

struct Api {
    library: Library,
    create: CreateProgram,
    compile: CompileProgram,
    destroy: DestroyProgram,
    log_size: GetSize,
    log: GetBytes,
    cubin_size: GetSize,
    cubin: GetBytes,
    ptx_size: GetSize,
    ptx: GetBytes,
    error_string: GetErrorString,
    version: Version,
}

/// Where NVRTC is looked for when `REFIT_NVRTC_LIBRARY` is unset.
fn candidates() -> Vec<String> {
    let names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];
    let mut list: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut dirs = Vec::new();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        if !home.is_empty() {
            dirs.push(format!("{home}/lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".to_string());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".to_string());
    for dir in dirs {
        list.extend(names.iter().map(|n| format!("{dir}/{n}")));
    }
    list
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, Error>> = OnceLock::new();
    API.get_or_init(|| {
        let names = candidates();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let library = Library::open_first("REFIT_NVRTC_LIBRARY", &refs, Status::NvrtcUnavailable)?;
        let u = Status::NvrtcUnavailable;
        // SAFETY: each type above matches the documented nvrtc.h signature of the symbol named.
        unsafe {
            Ok(Api {
                create: library.symbol(c"nvrtcCreateProgram", u)?,
                compile: library.symbol(c"nvrtcCompileProgram", u)?,
                destroy: library.symbol(c"nvrtcDestroyProgram", u)?,
                log_size: library.symbol(c"nvrtcGetProgramLogSize", u)?,
                log: library.symbol(c"nvrtcGetProgramLog", u)?,
                cubin_size: library.symbol(c"nvrtcGetCUBINSize", u)?,
                cubin: library.symbol(c"nvrtcGetCUBIN", u)?,
                ptx_size: library.symbol(c"nvrtcGetPTXSize", u)?,
                ptx: library.symbol(c"nvrtcGetPTX", u)?,
                error_string: library.symbol(c"nvrtcGetErrorString", u)?,
                version: library.symbol(c"nvrtcVersion", u)?,
                library,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
    .inspect(|api| preload_builtins(api))
}

/// NVRTC dlopens `libnvrtc-builtins.so.MAJOR.MINOR` by name at compile time, which fails when NVRTC
/// was found by full path outside the loader's search path (a CUDA or pip install not in
/// LD_LIBRARY_PATH). Loading the builtins from NVRTC's own directory first makes that lookup succeed
/// (the loader matches the already-loaded soname). Failure here is not an error: NVRTC may still find
/// them itself, and if not, compiling reports it.
fn preload_builtins(api: &Api) {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid output slots.
        unsafe { (api.version)(&mut major, &mut minor) };
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: any address inside the library; dladdr fills `info` or returns 0.
        let found = unsafe { libc::dladdr(api.create as *const c_void, &mut info) };
        if found == 0 || info.dli_fname.is_null() {
            return;
        }
        // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
        let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
        let Some(dir) = std::path::Path::new(&path).parent() else { return };
        let builtins = dir.join(format!("libnvrtc-builtins.so.{major}.{minor}"));
        let Ok(c_path) = CString::new(builtins.to_string_lossy().into_owned()) else { return };
        // SAFETY: dlopen of a path; the handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            log::debug!("{} not preloaded", builtins.display());
        } else {
            log::info!("preloaded {}", builtins.display());
        }
    });
}

/// What to produce: machine code for `sm_XY`, or PTX for `compute_XY` (which the driver JIT-compiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Cubin,
    Ptx,
}

/// A compiled image plus the compiler's log (register use etc. when `-Xptxas -v` was asked for).
#[derive(Clone, Debug)]
pub struct Compiled {
    /// CUBIN bytes, or NUL-terminated PTX text.
    pub image: Vec<u8>,
    pub log: String,
}

/// "major.minor" of the loaded NVRTC and the path it came from.
pub fn version() -> Result<String> {
    let api = api()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid output slots.
    unsafe { (api.version)(&mut major, &mut minor) };
    Ok(format!("NVRTC {major}.{minor} ({})", api.library.path()))
}

struct ProgramGuard<'a>(&'a Api, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by this API and is destroyed once.
        unsafe { (self.0.destroy)(&mut self.1) };
    }
}

fn fail(api: &Api, what: &str, code: NvrtcResult) -> Error {
    // SAFETY: nvrtcGetErrorString returns a static string for any code.
    let text = unsafe { CStr::from_ptr((api.error_string)(code)) }.to_string_lossy();
    Error::new(Status::KernelLoadFailed, format!("{what} failed: {text} ({code})"))
}

/// Compiles `source` (named `name` in messages) for compute capability `major.minor`.
/// `extra` options are appended (e.g. "-Xptxas=-v"). Errors: NvrtcUnavailable when libnvrtc cannot be
/// loaded; KernelLoadFailed with the compiler's log when compilation fails.
pub fn compile(
    source: &str,
    name: &str,
    major: i32,
    minor: i32,
    output: Output,
    extra: &[&str],
) -> Result<Compiled> {
    let api = api()?;
    let c_source = CString::new(source).map_err(|_| Error::invalid_argument("kernel source has a NUL"))?;
    let c_name = CString::new(name).map_err(|_| Error::invalid_argument("kernel name has a NUL"))?;
    let arch = match output {
        Output::Cubin => format!("--gpu-architecture=sm_{major}{minor}"),
        Output::Ptx => format!("--gpu-architecture=compute_{major}{minor}"),
    };
    let mut options: Vec<CString> = vec![CString::new(arch).expect("no NUL"), c"--std=c++17".into()];
    for option in extra {
        options.push(CString::new(*option).map_err(|_| Error::invalid_argument("option has a NUL"))?);
    }
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();

    let mut program: Program = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; no headers.
    let code = unsafe {
        (api.create)(&mut program, c_source.as_ptr(), c_name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    if code != 0 {
        return Err(fail(api, "nvrtcCreateProgram", code));
    }
    let guard = ProgramGuard(api, program);
    // SAFETY: the program is live; options outlive the call.
    let compiled = unsafe { (api.compile)(guard.1, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
    let log = read(api, guard.1, api.log_size, api.log).unwrap_or_default();
    let log = String::from_utf8_lossy(&log).trim_end_matches('\0').trim().to_string();
    if compiled != 0 {
        let err = fail(api, &format!("compiling {name} for sm_{major}{minor}"), compiled);
        return Err(Error::new(err.status, format!("{}; NVRTC log:\n{log}", err.message)));
    }
    let image = match output {
        Output::Cubin => read(api, guard.1, api.cubin_size, api.cubin)?,
        Output::Ptx => read(api, guard.1, api.ptx_size, api.ptx)?,
    };
    Ok(Compiled { image, log })
}

fn read(api: &Api, program: Program, size: GetSize, get: GetBytes) -> Result<Vec<u8>> {
    let mut n = 0usize;
    // SAFETY: live program, valid output slot.
    let code = unsafe { size(program, &mut n) };
    if code != 0 {
        return Err(fail(api, "reading the compiler output size", code));
    }
    let mut bytes = vec![0u8; n];
    // SAFETY: the buffer has the size NVRTC reported.
    let code = unsafe { get(program, bytes.as_mut_ptr().cast()) };
    if code != 0 {
        return Err(fail(api, "reading the compiler output", code));
    }
    Ok(bytes)
}
