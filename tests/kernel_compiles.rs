//! Dev aid, not a CI test: compiles the kernels (batched copy, digest, quantize) with NVRTC for sm_90 without a GPU and
//! prints ptxas's resource report. Run with libnvrtc available, e.g.
//! `REFIT_NVRTC_LIBRARY=/path/to/libnvrtc.so.13 cargo test --test kernel_compiles -- --ignored --nocapture`.

use refit::kernels::batched_copy::compile_for;
use refit::transport::nvrtc::{self, Output};

#[test]
#[ignore = "needs libnvrtc (set REFIT_NVRTC_LIBRARY)"]
fn kernel_source_compiles_for_hopper() {
    println!("{}", nvrtc::version().expect("libnvrtc loads"));
    let cubin = compile_for(9, 0, Output::Cubin, &["-Xptxas=-v"]).expect("CUBIN for sm_90");
    println!("CUBIN {} bytes\n{}", cubin.image.len(), cubin.log);
    assert!(cubin.image.starts_with(b"\x7fELF"), "a CUBIN is an ELF image");
    let ptx = compile_for(9, 0, Output::Ptx, &[]).expect("PTX for compute_90");
    let text = String::from_utf8_lossy(&ptx.image);
    assert!(text.contains(".entry refit_batched_copy("), "PTX names the kernel");
    assert!(text.contains(".entry refit_batched_copy_synced("), "PTX names the group-synchronized kernel");
    for entry in ["refit_batched_copy_digest", "refit_batched_check", "refit_batched_compare"] {
        assert!(text.contains(&format!(".entry {entry}(")), "PTX names {entry}");
    }
    // 16-byte accesses must be there for the co-aligned path.
    assert!(text.contains("ld.global.v2.u64") || text.contains("ld.global.v4.u32"), "vector loads");
}

#[test]
#[ignore = "needs libnvrtc (set REFIT_NVRTC_LIBRARY)"]
fn digest_kernel_compiles_for_hopper() {
    let source = refit::kernels::digest::SOURCE;
    let cubin =
        nvrtc::compile(source, "digest.cu", 9, 0, Output::Cubin, &["-Xptxas=-v"]).expect("CUBIN for sm_90");
    println!("CUBIN {} bytes\n{}", cubin.image.len(), cubin.log);
    let ptx = nvrtc::compile(source, "digest.cu", 9, 0, Output::Ptx, &[]).expect("PTX for compute_90");
    let text = String::from_utf8_lossy(&ptx.image);
    assert!(text.contains(".entry refit_digest("), "PTX names the kernel");
    assert!(text.contains(".entry refit_digest_many("), "PTX names the many-range kernel");
    assert!(text.contains("ld.global.v2.u64") || text.contains("ld.global.nc.v2.u64"), "16-byte loads");
}

#[test]
#[ignore = "needs libnvrtc (set REFIT_NVRTC_LIBRARY)"]
fn quantize_module_compiles_for_hopper() {
    let source = refit::kernels::quantize::module_source();
    let cubin = nvrtc::compile(&source, "copy_quantize.cu", 9, 0, Output::Cubin, &["-Xptxas=-v"])
        .expect("CUBIN for sm_90");
    println!("CUBIN {} bytes\n{}", cubin.image.len(), cubin.log);
    // To compare two builds' code: REFIT_QUANT_CUBIN=path writes the image there.
    if let Ok(path) = std::env::var("REFIT_QUANT_CUBIN") {
        std::fs::write(path, &cubin.image).expect("writing the CUBIN");
    }
    let ptx =
        nvrtc::compile(&source, "copy_quantize.cu", 9, 0, Output::Ptx, &[]).expect("PTX for compute_90");
    let text = String::from_utf8_lossy(&ptx.image);
    for entry in [
        "refit_quantize",
        "refit_quantize_narrow",
        "refit_quantize_rows",
        "refit_quantize_amax",
        "refit_copy_quantize",
    ] {
        assert!(text.contains(&format!(".entry {entry}(")), "PTX names {entry}");
    }
}
