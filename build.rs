//! Regenerates `include/refit.h` from `src/ffi` (plus the shared status, segment and log types) with
//! cbindgen. The header is checked in; CI rebuilds
//! it and fails when the checked-in copy differs (`git diff --exit-code include/refit.h`).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    // Only the C ABI's own files (src/ffi/mod.rs brings its submodules), plus the types the ABI shares
    // with the core: statuses, segments, plan stats, the log callback. Constants and types elsewhere
    // in the crate never leak into the header.
    let mut builder = cbindgen::Builder::new().with_config(config);
    for source in ["src/ffi/mod.rs", "src/error.rs", "src/segment.rs", "src/plan/stats.rs", "src/logging.rs"]
    {
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
