//! Regenerates `include/refit.h` from `src/ffi` (plus the shared status, segment and log types) with
//! cbindgen. The header is checked in; CI rebuilds
//! it and fails when the checked-in copy differs (`git diff --exit-code include/refit.h`).
//!
//! Also gives the shared library its SONAME, `librefit.so.<REFIT_ABI_VERSION>`, so programs linked
//! against it record the ABI they were built for (as `libnccl.so.2` does) and an incompatible ABI is a
//! different file; `packaging/install.sh` installs the symlinks that name resolves through.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    set_soname(&crate_dir);
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    write_status_table(&crate_dir, &out_dir);
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    // Only the C ABI's own files (src/ffi/mod.rs brings its submodules), plus the types the ABI shares
    // with the core: statuses, segments, plan and run stats, the log callback. Constants and types elsewhere
    // in the crate never leak into the header.
    let mut builder = cbindgen::Builder::new().with_config(config);
    for source in [
        "src/ffi/mod.rs",
        "src/error.rs",
        "src/segment.rs",
        "src/plan/stats.rs",
        "src/exec/stats.rs",
        "src/logging.rs",
    ] {
        builder = builder.with_src(crate_dir.join(source));
    }
    let bindings = match builder.generate() {
        Ok(bindings) => bindings,
        Err(err) => {
            // A syntax error elsewhere in the crate makes cbindgen fail too; let rustc report it.
            println!("cargo:warning=cbindgen could not regenerate include/refit.h: {err}");
            return;
        }
    };
    bindings.write_to_file(crate_dir.join("include/refit.h"));
}

/// `-Wl,-soname,librefit.so.<abi>` for the cdylib on ELF targets, with the ABI version read from the one
/// place it is defined (`REFIT_ABI_VERSION` in src/ffi), so the two cannot disagree.
fn set_soname(crate_dir: &Path) {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if !matches!(os.as_str(), "linux" | "android" | "freebsd" | "netbsd" | "openbsd" | "dragonfly") {
        return;
    }
    let abi = abi_version(&crate_dir.join("src/ffi"))
        .unwrap_or_else(|| panic!("build.rs: no `pub const REFIT_ABI_VERSION: u32 = N;` under src/ffi"));
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,librefit.so.{abi}");
    println!("cargo:rustc-env=REFIT_SONAME=librefit.so.{abi}");
}

/// The value of `pub const REFIT_ABI_VERSION: u32 = N;` in any file under `dir`.
fn abi_version(dir: &Path) -> Option<u32> {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).ok()?.filter_map(|e| Some(e.ok()?.path())).collect();
    entries.sort();
    entries.into_iter().find_map(|path| {
        if path.is_dir() {
            return abi_version(&path);
        }
        let text = std::fs::read_to_string(&path).ok()?;
        text.lines().find_map(|line| {
            let value = line.trim().strip_prefix("pub const REFIT_ABI_VERSION: u32 =")?;
            value.trim().strip_suffix(';')?.trim().parse().ok()
        })
    })
}

/// The `Status` enum in src/error.rs is the one list of statuses: cbindgen reads it for the header,
/// and this writes what Rust derives from it (`status_table.rs`, included by src/error.rs): every
/// status in code order and each one's C name, the name cbindgen gives the enumerator.
fn write_status_table(crate_dir: &Path, out_dir: &Path) {
    let source = std::fs::read_to_string(crate_dir.join("src/error.rs")).expect("src/error.rs reads");
    let body = source
        .split_once("pub enum Status {")
        .and_then(|(_, rest)| rest.split_once("\n}"))
        .map(|(body, _)| body)
        .expect("src/error.rs declares `pub enum Status { ... }`");
    let mut variants = Vec::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("//")) {
        let parsed = line.strip_suffix(',').and_then(|l| l.split_once(" = "));
        let Some((name, code)) = parsed else {
            panic!("src/error.rs, enum Status: `{line}` is not `Variant = code,`");
        };
        let code: usize = code.parse().unwrap_or_else(|_| panic!("enum Status: {name} has code `{code}`"));
        // Codes are indices into the table: dense from 0 and in order (appended, never renumbered).
        assert_eq!(code, variants.len(), "enum Status: {name} = {code} breaks the order 0, 1, 2, ...");
        variants.push(name.to_string());
    }
    let all: Vec<String> = variants.iter().map(|v| format!("Status::{v}")).collect();
    let names: Vec<String> = variants
        .iter()
        .map(|v| format!("Status::{v} => c\"REFIT_STATUS_{}\",", screaming_snake(v)))
        .collect();
    let table = format!(
        "// Generated by build.rs from enum Status in src/error.rs.\n\
         impl Status {{\n\
         /// Every status, in code order (the code is the index).\n\
         const ALL: [Status; {count}] = [{all}];\n\n\
         /// The name C callers see, as a NUL-terminated static string.\n\
         pub fn name(self) -> &'static std::ffi::CStr {{\n\
         match self {{\n{names}\n}}\n}}\n}}\n",
        count = variants.len(),
        all = all.join(", "),
        names = names.join("\n"),
    );
    std::fs::write(out_dir.join("status_table.rs"), table).expect("OUT_DIR is writable");
}

/// `InvalidArgument` -> `INVALID_ARGUMENT`, as cbindgen renames enumerators.
fn screaming_snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}
