//! Runs the Python tests (stdlib unittest, no extra packages): the binding's, against the library
//! this `cargo test` just built, and the benches' harness arithmetic.

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

/// The benches' own Python arithmetic (benches/tests), which sets figures of record; no GPU needed.
#[test]
fn bench_harness_tests_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s", "benches/tests"])
        .current_dir(root)
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stderr}");
    assert!(output.status.success(), "bench harness tests failed:\n{stderr}");
    assert!(!stderr.contains("Ran 0 tests"), "no bench harness test ran");
}
