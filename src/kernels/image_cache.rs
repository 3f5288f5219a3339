//! Compiled kernel images kept in the process, so that NVRTC compiles a kernel source once per
//! architecture and compiler rather than once per device: a process driving several devices of one
//! kind loads the first device's image on the others. Images are kept by their exact key (the source
//! text itself, the target, the compiler). Nothing is kept on disk: on the GPU host a process
//! compiling the quantize and batched-copy modules took no longer than one reading them from a disk
//! cache (docs/decisions.md, "Compiled images").

use crate::error::Result;
use crate::sync::lock;
use crate::transport::nvrtc::Output;
use std::sync::{Arc, Mutex};

/// What an image is compiled from: its source (named `file` in messages), target and compiler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Key<'a> {
    pub source: &'a str,
    pub file: &'a str,
    pub major: i32,
    pub minor: i32,
    pub output: Output,
    /// The compiler's version (and library): another compiler may compile the source differently.
    pub compiler: &'a str,
}

/// A key's image, once compiled.
type Slot = Arc<Mutex<Option<Arc<[u8]>>>>;

/// Images of this process, by key (owned copies of the keys' parts).
type Kept = Vec<((String, String, i32, i32, Output, String), Slot)>;

/// `key`'s image: kept from an earlier load in this process, else compiled by `compile` and kept
/// (a failed compile is not). Errors: `compile`'s.
pub(crate) fn image(key: &Key, compile: impl FnOnce() -> Result<Vec<u8>>) -> Result<Arc<[u8]>> {
    static KEPT: Mutex<Kept> = Mutex::new(Vec::new());
    let owned = (
        key.source.to_owned(),
        key.file.to_owned(),
        key.major,
        key.minor,
        key.output,
        key.compiler.to_owned(),
    );
    let slot: Slot = {
        let mut kept = lock(&KEPT);
        match kept.iter().find(|(k, _)| *k == owned) {
            Some((_, slot)) => slot.clone(),
            None => {
                let slot = Slot::default();
                kept.push((owned, slot.clone()));
                slot
            }
        }
    };
    // Held while compiling: another device's load of the same image waits for this one instead of
    // compiling it too (other images compile meanwhile).
    let mut slot = lock(&slot);
    if let Some(image) = slot.as_ref() {
        return Ok(image.clone());
    }
    let image: Arc<[u8]> = compile()?.into();
    *slot = Some(image.clone());
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, Status};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn key<'a>(source: &'a str, compiler: &'a str) -> Key<'a> {
        Key { source, file: "kernel.cu", major: 9, minor: 0, output: Output::Cubin, compiler }
    }

    /// `image` with a compile that counts its calls and returns `compiled`.
    fn load(key: &Key, compiled: &[u8], compiles: &AtomicU32) -> Vec<u8> {
        let compile = || {
            compiles.fetch_add(1, Ordering::SeqCst);
            Ok(compiled.to_vec())
        };
        image(key, compile).unwrap().to_vec()
    }

    // Each test uses sources of its own: the kept images are shared by the tests of this binary.

    #[test]
    fn an_image_is_compiled_once_per_exact_key() {
        let compiles = AtomicU32::new(0);
        let source = "// exact key test\n__global__ void k() {}";
        assert_eq!(load(&key(source, "NVRTC 13.0"), b"one", &compiles), b"one");
        assert_eq!(load(&key(source, "NVRTC 13.0"), b"two", &compiles), b"one");
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
        // Another compiler, target or source is another image.
        assert_eq!(load(&key(source, "NVRTC 13.1"), b"three", &compiles), b"three");
        let ampere = Key { major: 8, ..key(source, "NVRTC 13.0") };
        assert_eq!(load(&ampere, b"four", &compiles), b"four");
        let ptx = Key { output: Output::Ptx, ..key(source, "NVRTC 13.0") };
        assert_eq!(load(&ptx, b"five", &compiles), b"five");
        assert_eq!(load(&key("// exact key test, edited\n", "NVRTC 13.0"), b"six", &compiles), b"six");
        assert_eq!(compiles.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_failed_compile_is_returned_and_not_kept() {
        let k = key("// failing compile test\n", "NVRTC 13.0");
        let failed = image(&k, || Err(Error::new(Status::KernelLoadFailed, "syntax error")));
        assert_eq!(failed.unwrap_err().status, Status::KernelLoadFailed);
        let compiles = AtomicU32::new(0);
        assert_eq!(load(&k, b"fixed", &compiles), b"fixed");
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn devices_loading_one_image_at_once_compile_it_once() {
        let compiles = AtomicU32::new(0);
        let k = key("// concurrent loads test\n", "NVRTC 13.0");
        let images: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let loads: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let compile = || {
                            compiles.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            Ok(b"one image".to_vec())
                        };
                        image(&k, compile).unwrap().to_vec()
                    })
                })
                .collect();
            loads.into_iter().map(|load| load.join().unwrap()).collect()
        });
        assert!(images.iter().all(|image| image == b"one image"));
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
    }
}
