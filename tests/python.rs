//! Runs the Python tests (stdlib unittest, no extra packages): the binding's, against the library
//! this `cargo test` just built, and the benches' harness arithmetic.

mod cdylib;

use std::path::Path;
use std::process::Command;

/// Runs `python3 -m unittest discover` over `dir` (from the repository root) with `env` set, and
/// fails unless it passes with at least one test run.
fn unittest_discover(dir: &str, env: &[(&str, &Path)]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s", dir])
        .current_dir(root)
        .envs(env.iter().copied())
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stderr}");
    assert!(output.status.success(), "python tests in {dir} failed:\n{stderr}");
    assert!(!stderr.contains("Ran 0 tests"), "no Python test ran in {dir}");
}

#[test]
fn python_binding_tests_pass() {
    let lib = cdylib::librefit();
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    unittest_discover("python/tests", &[("REFIT_LIBRARY", lib.as_ref()), ("PYTHONPATH", &python)]);
}

/// The benches' own Python arithmetic, which sets figures of record; no GPU needed.
#[test]
fn bench_harness_tests_pass() {
    unittest_discover("benches/tests", &[]);
}
