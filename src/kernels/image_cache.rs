//! Compiled kernel images kept for the next load, so that NVRTC compiles a kernel source once per
//! architecture and compiler rather than once per device and process (the quantize kernel's module
//! takes NVRTC seconds; a process driving eight devices of one kind paid it eight times).
//!
//! - In the process: every image compiled, by its exact key (the source text itself, the target,
//!   the compiler), for the devices loaded after the first.
//! - On disk, between processes: one file per key in the cache directory (`REFIT_KERNEL_CACHE`, else
//!   `$XDG_CACHE_HOME/refit/kernels`, else `$HOME/.cache/refit/kernels`; `REFIT_KERNEL_CACHE=off`
//!   turns it off). A file holds its whole key and a checksum of its image, and is used only when
//!   both match: a file that is torn, altered or from another source or compiler is compiled over.
//!   Files are written whole under a temporary name and renamed into place, so processes may share
//!   the directory. The disk cache never fails a load: a directory that cannot be read or written
//!   costs the compile it would have saved, and says so in the log.

use crate::error::Result;
use crate::plan::digest::Fnv1a;
use crate::sync::lock;
use crate::transport::nvrtc::Output;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
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

const MAGIC: &[u8] = b"refit kernel image 1\n";

impl Key<'_> {
    /// The file's name in the cache directory: the source's name, the target and a digest of the
    /// whole key (which the file holds too, so a digest collision is caught on reading).
    fn file_name(&self) -> String {
        let stem = Path::new(self.file).file_stem().and_then(|s| s.to_str()).unwrap_or("kernel");
        let target = match self.output {
            Output::Cubin => "sm",
            Output::Ptx => "compute",
        };
        format!("{stem}-{target}_{}{}-{:016x}.bin", self.major, self.minor, self.digest())
    }

    fn digest(&self) -> u64 {
        let mut h = Fnv1a::new();
        for part in [self.source, self.file, self.compiler] {
            h.u64(part.len() as u64);
            h.bytes(part.as_bytes());
        }
        h.bytes(&self.major.to_le_bytes());
        h.bytes(&self.minor.to_le_bytes());
        h.bytes(&[self.output as u8]);
        h.finish()
    }

    /// The key as written in its file, before the image.
    fn header(&self) -> Vec<u8> {
        let mut header = MAGIC.to_vec();
        for part in [self.source, self.file, self.compiler] {
            header.extend_from_slice(&(part.len() as u64).to_le_bytes());
            header.extend_from_slice(part.as_bytes());
        }
        header.extend_from_slice(&self.major.to_le_bytes());
        header.extend_from_slice(&self.minor.to_le_bytes());
        header.push(self.output as u8);
        header
    }
}

fn checksum(image: &[u8]) -> u64 {
    let mut h = Fnv1a::new();
    h.bytes(image);
    h.finish()
}

/// A file's contents: the key's header, the image's length, the image, its checksum.
fn encode(key: &Key, image: &[u8]) -> Vec<u8> {
    let mut bytes = key.header();
    bytes.extend_from_slice(&(image.len() as u64).to_le_bytes());
    bytes.extend_from_slice(image);
    bytes.extend_from_slice(&checksum(image).to_le_bytes());
    bytes
}

/// The image in a file's contents, when they hold exactly `key`'s header, an image and its checksum.
fn decode(key: &Key, bytes: &[u8]) -> Option<Vec<u8>> {
    let rest = bytes.strip_prefix(key.header().as_slice())?;
    let (length, rest) = rest.split_first_chunk::<8>()?;
    let length = usize::try_from(u64::from_le_bytes(*length)).ok()?;
    let (image, sum) = (rest.get(..length)?, rest.get(length..)?);
    (sum == checksum(image).to_le_bytes()).then(|| image.to_vec())
}

/// The cache directory from the environment (see the module docs); None when off or unknown.
fn directory() -> Option<PathBuf> {
    directory_from(|name| std::env::var_os(name))
}

/// [`directory`] from the variables `var` gives.
fn directory_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let var = |name| var(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("REFIT_KERNEL_CACHE") {
        return (dir != "off" && dir != "0").then(|| PathBuf::from(dir));
    }
    var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .map(|base| base.join("refit").join("kernels"))
}

/// The image in `dir` for `key`, if a file there holds it whole.
fn read(dir: &Path, key: &Key) -> Option<Vec<u8>> {
    let path = dir.join(key.file_name());
    let bytes = std::fs::read(&path).ok()?;
    let image = decode(key, &bytes);
    if image.is_none() {
        log::warn!(
            "kernel cache: {} does not hold {}'s image whole; compiling it again",
            path.display(),
            key.file
        );
    }
    image
}

/// Writes `image` for `key` into `dir`: whole under a temporary name, then renamed into place.
fn write(dir: &Path, key: &Key, image: &[u8]) {
    let path = dir.join(key.file_name());
    let temporary = dir.join(format!(".{}.{}.tmp", key.file_name(), std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&temporary, encode(key, image)))
        .and_then(|()| std::fs::rename(&temporary, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temporary);
        log::info!("kernel cache: could not keep {}'s image in {}: {e}", key.file, dir.display());
    }
}

/// A key's image in this process, once loaded or compiled.
type Slot = Arc<Mutex<Option<Arc<[u8]>>>>;

/// Images of this process, by key (owned copies of the keys' parts).
type Kept = Vec<((String, String, i32, i32, Output, String), Slot)>;

/// `key`'s image: kept from an earlier load in this process, else from `dir` (None: no disk
/// cache), else compiled by `compile` and kept in both. Errors: `compile`'s.
pub(crate) fn image_in(
    dir: Option<&Path>,
    key: &Key,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Arc<[u8]>> {
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
    let image: Arc<[u8]> = match dir.and_then(|dir| read(dir, key)) {
        Some(image) => {
            log::debug!("kernel cache: {} for sm_{}{} read from disk", key.file, key.major, key.minor);
            image.into()
        }
        None => {
            let image = compile()?;
            if let Some(dir) = dir {
                write(dir, key, &image);
            }
            image.into()
        }
    };
    *slot = Some(image.clone());
    Ok(image)
}

/// [`image_in`] the directory the environment names.
pub(crate) fn image(key: &Key, compile: impl FnOnce() -> Result<Vec<u8>>) -> Result<Arc<[u8]>> {
    image_in(directory().as_deref(), key, compile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, Status};
    use std::cell::Cell;

    fn key<'a>(source: &'a str, compiler: &'a str) -> Key<'a> {
        Key { source, file: "kernel.cu", major: 9, minor: 0, output: Output::Cubin, compiler }
    }

    /// A fresh directory under the system's temporary one.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("refit-image-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// `image_in` with a compile that counts its calls and returns `image`.
    fn load(dir: Option<&Path>, key: &Key, image: &[u8], compiles: &Cell<u32>) -> Vec<u8> {
        let compile = || {
            compiles.set(compiles.get() + 1);
            Ok(image.to_vec())
        };
        image_in(dir, key, compile).unwrap().to_vec()
    }

    #[test]
    fn an_image_is_compiled_once_then_read_from_disk_by_its_exact_key() {
        let dir = scratch("exact");
        let compiles = Cell::new(0);
        // Distinct sources per test: the in-process cache is shared by the tests of this binary.
        let source = "// exact key test\n__global__ void k() {}";
        let first = load(Some(&dir), &key(source, "NVRTC 13.0 (a)"), b"image one", &compiles);
        assert_eq!((first.as_slice(), compiles.get()), (b"image one".as_slice(), 1));
        // Kept in the process: no compile, no read.
        assert_eq!(load(Some(&dir), &key(source, "NVRTC 13.0 (a)"), b"other", &compiles), b"image one");
        assert_eq!(compiles.get(), 1);
        // Another process (an empty in-process cache) reads the file.
        let k = key(source, "NVRTC 13.0 (a)");
        assert_eq!(read(&dir, &k).as_deref(), Some(b"image one".as_slice()));
        // Another compiler or target is another key, compiled and kept beside it.
        assert_eq!(load(Some(&dir), &key(source, "NVRTC 13.1 (b)"), b"image two", &compiles), b"image two");
        assert_eq!(compiles.get(), 2);
        assert_eq!(read(&dir, &k).as_deref(), Some(b"image one".as_slice()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_torn_altered_or_foreign_file_is_not_used() {
        let dir = scratch("damaged");
        let k = key("// damaged file test\n", "NVRTC 13.0");
        write(&dir, &k, b"the image");
        let path = dir.join(k.file_name());
        let whole = std::fs::read(&path).unwrap();
        assert_eq!(read(&dir, &k).as_deref(), Some(b"the image".as_slice()));
        // Torn: cut anywhere.
        for cut in [0, MAGIC.len(), whole.len() / 2, whole.len() - 1] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            assert_eq!(read(&dir, &k), None, "cut at {cut}");
        }
        // Altered: any one byte of the image or its checksum.
        for at in [whole.len() - 9, whole.len() - 12, whole.len() - 1] {
            let mut bad = whole.clone();
            bad[at] ^= 0x40;
            std::fs::write(&path, &bad).unwrap();
            assert_eq!(read(&dir, &k), None, "byte {at} altered");
        }
        // Foreign: another key's file under this key's name (as a digest collision would put it).
        std::fs::write(&path, encode(&key("// another source\n", "NVRTC 13.0"), b"the image")).unwrap();
        assert_eq!(read(&dir, &k), None);
        // A damaged file is compiled over.
        let compiles = Cell::new(0);
        assert_eq!(load(Some(&dir), &k, b"compiled again", &compiles), b"compiled again");
        assert_eq!(compiles.get(), 1);
        assert_eq!(read(&dir, &k).as_deref(), Some(b"compiled again".as_slice()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_that_cannot_be_written_costs_only_the_compile() {
        // A regular file where the directory should be: nothing can be created under it.
        let blocked = scratch("blocked");
        std::fs::write(&blocked, b"not a directory").unwrap();
        let compiles = Cell::new(0);
        let k = key("// unwritable directory test\n", "NVRTC 13.0");
        assert_eq!(load(Some(&blocked.join("kernels")), &k, b"image", &compiles), b"image");
        assert_eq!(compiles.get(), 1);
        let _ = std::fs::remove_file(&blocked);
        // Without a disk cache the process still keeps the image.
        let k = key("// no disk cache test\n", "NVRTC 13.0");
        assert_eq!(load(None, &k, b"image", &compiles), b"image");
        assert_eq!(load(None, &k, b"other", &compiles), b"image");
        assert_eq!(compiles.get(), 2);
    }

    #[test]
    fn a_failed_compile_is_returned_and_not_kept() {
        let k = key("// failing compile test\n", "NVRTC 13.0");
        let failed = image_in(None, &k, || Err(Error::new(Status::KernelLoadFailed, "syntax error")));
        assert_eq!(failed.unwrap_err().status, Status::KernelLoadFailed);
        let compiles = Cell::new(0);
        assert_eq!(load(None, &k, b"fixed", &compiles), b"fixed");
        assert_eq!(compiles.get(), 1);
    }

    #[test]
    fn devices_loading_one_image_at_once_compile_it_once() {
        use std::sync::atomic::{AtomicU32, Ordering};
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
                        image_in(None, &k, compile).unwrap().to_vec()
                    })
                })
                .collect();
            loads.into_iter().map(|load| load.join().unwrap()).collect()
        });
        assert!(images.iter().all(|image| image == b"one image"));
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_directory_comes_from_the_environment() {
        let from = |vars: &[(&str, &str)]| {
            directory_from(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| OsString::from(v)))
        };
        let all = [("REFIT_KERNEL_CACHE", "/some/where"), ("XDG_CACHE_HOME", "/xdg"), ("HOME", "/home/u")];
        assert_eq!(from(&all), Some(PathBuf::from("/some/where")));
        assert_eq!(from(&[("REFIT_KERNEL_CACHE", "off"), all[1], all[2]]), None);
        assert_eq!(from(&[("REFIT_KERNEL_CACHE", "0")]), None);
        assert_eq!(
            from(&[("REFIT_KERNEL_CACHE", ""), all[1], all[2]]),
            Some(PathBuf::from("/xdg/refit/kernels"))
        );
        assert_eq!(from(&all[2..]), Some(PathBuf::from("/home/u/.cache/refit/kernels")));
        assert_eq!(from(&[]), None);
    }
}
