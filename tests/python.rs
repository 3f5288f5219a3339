//! Runs the Python binding's tests (stdlib unittest, no extra packages) against the library this
//! `cargo test` just built.

mod cdylib;

use std::path::Path;
use std::process::Command;

#[test]
fn python_binding_tests_pass() {
    let lib = cdylib::librefit();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s", "python/tests"])
        .current_dir(root)
        .env("REFIT_LIBRARY", &lib)
        .env("PYTHONPATH", root.join("python"))
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stderr}");
    assert!(output.status.success(), "python tests failed:\n{stderr}");
    assert!(!stderr.contains("Ran 0 tests"), "no Python test ran");
}
