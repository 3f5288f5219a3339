//! Builds a kernel source as host C++ (tests/emulate/*.cpp over tests/emulate/runtime.hpp) into a
//! shared library next to the test binary, and loads it. Shared by the emulated kernel tests.

#![allow(dead_code)]

use refit::transport::dynlib::Library;
use refit::Status;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Compiles `tests/emulate/{name}.cpp` and returns the symbol `symbol` of type `T` from it. The library
/// stays loaded for the life of the test process.
///
/// # Safety
/// `T` must be the `extern "C"` function type of `symbol` in that file.
pub unsafe fn load<T: Copy>(name: &str, symbol: &std::ffi::CStr) -> T {
    // Tests of one binary run on several threads: one builds each library while the others wait,
    // so that none loads a file another is still writing.
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let exe = std::env::current_exe().expect("test binary path");
    let out = exe.parent().expect("deps dir").join(format!("refit_emulated_{name}.so"));
    if !built.iter().any(|b| b == name) {
        build(&root, name, &out);
        built.push(name.to_string());
    }
    let path = out.to_str().expect("UTF-8 path");
    let library = Library::open_first("REFIT_TEST_UNSET_VARIABLE", &[path], Status::Unsupported).unwrap();
    // SAFETY: the caller's promise on T.
    let function = unsafe { library.symbol::<T>(symbol, Status::Unsupported) }.unwrap();
    std::mem::forget(library); // the handle is never closed: the function must stay valid
    function
}

/// Compiles `tests/emulate/{name}.cpp` into the shared library `out`.
fn build(root: &Path, name: &str, out: &Path) {
    let status = Command::new("g++")
        .args(["-std=c++17", "-O2", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Werror"])
        .args(["-Wno-unknown-pragmas", "-fPIC", "-shared"])
        .arg(root.join(format!("tests/emulate/{name}.cpp")))
        .arg("-o")
        .arg(out)
        .status()
        .expect("cannot run g++");
    assert!(status.success(), "tests/emulate/{name}.cpp does not build as host C++");
}
