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
    // Only the C ABI's own files: constants and types elsewhere in the crate never leak into the header.
    let mut builder = cbindgen::Builder::new().with_config(config);
    let mut sources: Vec<PathBuf> = std::fs::read_dir(crate_dir.join("src/ffi"))
        .expect("src/ffi exists")
        .map(|entry| entry.expect("readable src/ffi").path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .collect();
    // The types the ABI shares with the core: statuses, segments, the log callback.
    sources.extend(["src/error.rs", "src/segment.rs", "src/logging.rs"].map(|f| crate_dir.join(f)));
    sources.sort();
    for source in sources {
        builder = builder.with_src(source);
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
