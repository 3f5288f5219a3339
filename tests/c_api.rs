//! Builds every C (C11) and C++ (C++17) program in `cpp_tests/` against `include/refit.h`, links it to
//! the freshly built `librefit.so`, and runs it. `REFIT_CPP_TEST_WRAPPER` (e.g. "valgrind
//! --error-exitcode=1") runs each program under a checker; CI sets it once.

mod cdylib;

use std::path::{Path, PathBuf};
use std::process::Command;

fn compile(source: &Path, output: &Path, lib_dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let is_cpp = source.extension().is_some_and(|e| e == "cpp");
    let (compiler, standard) = if is_cpp { ("g++", "-std=c++17") } else { ("cc", "-std=c11") };
    let status = Command::new(compiler)
        .args([standard, "-Wall", "-Wextra", "-Werror", "-pedantic", "-g", "-O1", "-pthread"])
        .arg(format!("-I{}", root.join("include").display()))
        .arg(format!("-I{}", root.join("cpp_tests").display()))
        .arg(source)
        .arg("-o")
        .arg(output)
        .arg(format!("-L{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lrefit")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {compiler}: {e}"));
    assert!(status.success(), "{} did not compile", source.display());
}

fn run(program: &Path) -> String {
    let wrapper = std::env::var("REFIT_CPP_TEST_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    let mut command = match words.next() {
        Some(tool) => {
            let mut c = Command::new(tool);
            c.args(words).arg(program);
            c
        }
        None => Command::new(program),
    };
    let output = command.output().unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{} failed ({}):\n{stdout}\n{}",
        program.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn headers_compile_on_their_own() {
    let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/refit.h");
    for (compiler, language, standard) in [("cc", "c", "-std=c11"), ("g++", "c++", "-std=c++17")] {
        let status = Command::new(compiler)
            .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic", standard, "-x", language])
            .arg(&header)
            .status()
            .expect("compiler runs");
        assert!(status.success(), "include/refit.h does not compile as {language}");
    }
    let wrapper = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/refit.hpp");
    let status = Command::new("g++")
        .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic", "-std=c++17", "-x", "c++"])
        .arg(&wrapper)
        .status()
        .expect("compiler runs");
    assert!(status.success(), "include/refit.hpp does not compile on its own as C++17");
    // Before C++17 it stops with its own message rather than a cascade of errors.
    let output = Command::new("g++")
        .args(["-fsyntax-only", "-std=c++14", "-x", "c++"])
        .arg(&wrapper)
        .output()
        .expect("compiler runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("refit.hpp needs C++17"), "{stderr}");
}

#[test]
fn c_and_cpp_programs_pass() {
    let lib_dir = cdylib::librefit().parent().expect("library directory").to_path_buf();
    let out_dir = lib_dir.join("cpp_tests");
    std::fs::create_dir_all(&out_dir).unwrap();
    let mut sources: Vec<PathBuf> =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("cpp_tests"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "c" || e == "cpp"))
            .collect();
    sources.sort();
    assert!(!sources.is_empty());
    for source in &sources {
        let program = out_dir.join(source.file_stem().unwrap());
        compile(source, &program, &lib_dir);
        let stdout = run(&program);
        println!("{}: {}", source.display(), stdout.lines().last().unwrap_or(""));
    }
}
