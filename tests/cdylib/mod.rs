//! The shared library the C, C++ and Python tests load. `cargo test` builds the crate only as an rlib
//! for its test binaries, so the cdylib is built here, by cargo, into the same target directory and
//! profile as the running test (a no-op when it is up to date).
//!
//! The library's SONAME is `librefit.so.<abi>` (build.rs), so a program linked with `-lrefit` asks the
//! loader for that name: a symlink beside the library provides it, as an installed package's does.

use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile>, the directory holding this test binary's `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}

/// Path of a freshly built `librefit.so`.
pub fn librefit() -> PathBuf {
    let profile = profile_dir();
    let target = profile.parent().expect("target directory");
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["build", "--lib", "--quiet"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CARGO_TARGET_DIR", target);
    if profile.file_name().is_some_and(|name| name == "release") {
        cargo.arg("--release");
    }
    let status = cargo.status().expect("cargo runs");
    assert!(status.success(), "cargo build --lib failed");
    let lib = profile.join("librefit.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    link_soname(&profile);
    lib
}

/// target/<profile>/librefit.so.<abi> -> librefit.so, made once (tests running at once may race to make
/// it; whoever loses finds it there).
fn link_soname(profile: &Path) {
    let soname = profile.join(env!("REFIT_SONAME"));
    if std::fs::symlink_metadata(&soname).is_err() {
        if let Err(err) = std::os::unix::fs::symlink("librefit.so", &soname) {
            assert!(soname.exists(), "cannot link {}: {err}", soname.display());
        }
    }
}
