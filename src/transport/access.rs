//! Whether the memory a batch of segments names can be used by a copy, checked once when the copy
//! is prepared (an executor's creation, a prepared batch) so that a bad address is a status, never
//! a crash or a dead CUDA context at the first run. [`Backend::inaccessible`] answers for ranges;
//! this module turns segments into ranges: first each side's extent (first to last byte), and only
//! where an extent is refused, its runs one by one (a strided segment may join buffers that lie at
//! regular distances, with memory that is no buffer between them).

use super::cuda::cuda_backend;
use super::mappings::Mappings;
use super::{Backend, BackendKind, MemoryRange, Refusal};
use crate::error::{try_vec, Error, Result};
use crate::segment::{Segment, Side};

/// The devices whose memory a segment's source and destination must be (None: that side is not
/// checked here, e.g. another process's memory).
pub type Owners = (Option<i32>, Option<i32>);

/// A side of a segment that cannot be used: the segment's index in the list checked, the side, and
/// the backend's refusal of the range (its `index` is meaningless here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unusable {
    pub segment: usize,
    pub side: Side,
    pub range: (u64, u64),
    pub refusal: Refusal,
}

/// The first segment side (by segment index) of `segments` whose bytes are not usable memory of
/// the device `owners` names for it (`peers`: or of a device that one accesses directly), or
/// None. Segments must have passed `segment::check::validate` (no extent past 2^64). OutOfMemory
/// when the list of ranges cannot be allocated.
pub fn first_unusable(
    backend: &dyn Backend,
    segments: &[Segment],
    owners: impl Fn(usize) -> Owners,
    peers: bool,
) -> Result<Option<Unusable>> {
    let n = segments.len().saturating_mul(2);
    let mut ranges: Vec<MemoryRange> = try_vec(n, "the ranges whose memory is checked")?;
    let mut sides: Vec<(usize, Side)> = try_vec(n, "the ranges whose memory is checked")?;
    for (i, segment) in segments.iter().enumerate() {
        if segment.runs() == 0 {
            continue;
        }
        let (source, destination) = owners(i);
        for (side, device) in [(Side::Source, source), (Side::Destination, destination)] {
            let Some(device) = device else { continue };
            let (addr, len) = (segment.address(side), segment.span(side).unwrap_or(u64::MAX));
            ranges.push(MemoryRange { device, addr, len, peers, written: side == Side::Destination });
            sides.push((i, side));
        }
    }
    let mut found: Option<Unusable> = None;
    for refusal in backend.inaccessible(&ranges)? {
        let (segment, side) = sides[refusal.index];
        if found.as_ref().is_some_and(|f| f.segment <= segment) {
            continue;
        }
        let range = (ranges[refusal.index].addr, ranges[refusal.index].len);
        // The extent may cover gaps between the runs: only a run that is refused refuses the side.
        let refused = if segments[segment].runs() > 1 {
            runs_refused(backend, &segments[segment], side, ranges[refusal.index])?
        } else {
            Some((range, refusal))
        };
        if let Some((range, refusal)) = refused {
            found = Some(Unusable { segment, side, range, refusal });
        }
    }
    Ok(found)
}

/// INVALID_ARGUMENT naming the first of `ranges` (by index) that `backend` refuses
/// ([`Backend::inaccessible`]); `name(i)` is what range i is to the caller (an argument's name).
/// For calls that read or write buffers rather than segments: allgathers, digests.
pub fn check_buffers(
    backend: &dyn Backend,
    ranges: &[MemoryRange],
    name: impl Fn(usize) -> String,
) -> Result<()> {
    refuse_first(ranges, backend.inaccessible(ranges)?, name)
}

/// [`check_buffers`] for a backend known by its kind only (a communicator's): the host rule, or
/// the process's CUDA backend.
pub fn check_buffers_of(
    kind: BackendKind,
    ranges: &[MemoryRange],
    name: impl Fn(usize) -> String,
) -> Result<()> {
    let refusals = match kind {
        BackendKind::Host => host_inaccessible(ranges),
        BackendKind::Cuda => cuda_backend()?.inaccessible(ranges)?,
    };
    refuse_first(ranges, refusals, name)
}

fn refuse_first(
    ranges: &[MemoryRange],
    refusals: Vec<Refusal>,
    name: impl Fn(usize) -> String,
) -> Result<()> {
    let Some(refusal) = refusals.into_iter().min_by_key(|r| r.index) else { return Ok(()) };
    let range = &ranges[refusal.index];
    Err(Error::invalid_argument(format!(
        "{} [{:#x}, +{:#x}) is not memory device {} can use: {:#x} {}",
        name(refusal.index),
        range.addr,
        range.len,
        range.device,
        refusal.at,
        refusal.why
    )))
}

/// The first run of `segment` on `side` that is refused (runs that abut are one range), if any.
fn runs_refused(
    backend: &dyn Backend,
    segment: &Segment,
    side: Side,
    like: MemoryRange,
) -> Result<Option<((u64, u64), Refusal)>> {
    let mut runs: Vec<MemoryRange> = Vec::new();
    segment.for_each_run(|src, dst, len| {
        let addr = if side == Side::Source { src } else { dst };
        match runs.last_mut() {
            Some(last) if last.addr + last.len == addr => last.len += len,
            _ => runs.push(MemoryRange { addr, len, ..like }),
        }
    });
    let refused = backend.inaccessible(&runs)?.into_iter().next();
    Ok(refused.map(|r| ((runs[r.index].addr, runs[r.index].len), r)))
}

/// The host backend's rule: no range past the end of the address space or in the first page, and
/// every byte within the process's mappings, readable, and writable where the range is written
/// ([`Mappings`], asked once per call; where the system lists no mappings, the first two tests only).
pub(crate) fn host_inaccessible(ranges: &[MemoryRange]) -> Vec<Refusal> {
    const FIRST_PAGE: u64 = 4096;
    let mut mappings = None;
    let mut refused = Vec::new();
    for (index, range) in ranges.iter().enumerate().filter(|(_, r)| r.len > 0) {
        let (at, why) = if range.addr.checked_add(range.len).is_none() {
            (range.addr, "runs past the end of the 64-bit address space".to_string())
        } else if range.addr < FIRST_PAGE {
            (
                range.addr,
                "lies in the first page of the address space (below 4096), where no memory is".into(),
            )
        } else {
            let listed = mappings.get_or_insert_with(Mappings::current);
            match listed.as_ref().and_then(|m| m.first_wanting(range.addr, range.len, range.written)) {
                None => continue,
                Some((at, why)) => (at, why.to_string()),
            }
        };
        refused.push(Refusal { index, at, why });
    }
    refused
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::host::HostBackend;

    /// Three pages of fresh anonymous memory whose middle one is a guard page (no access), and whose
    /// last one is read-only: memory the host rule must tell apart from what it accepts.
    struct GuardedPages {
        base: u64,
        page: u64,
    }

    impl GuardedPages {
        fn new() -> GuardedPages {
            // SAFETY: a fresh private anonymous mapping, changed and unmapped only by this value.
            unsafe {
                let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
                let rw = libc::PROT_READ | libc::PROT_WRITE;
                let base = libc::mmap(
                    std::ptr::null_mut(),
                    3 * page,
                    rw,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(base, libc::MAP_FAILED);
                assert_eq!(libc::mprotect(base.cast::<u8>().add(page).cast(), page, libc::PROT_NONE), 0);
                assert_eq!(libc::mprotect(base.cast::<u8>().add(2 * page).cast(), page, libc::PROT_READ), 0);
                GuardedPages { base: base as u64, page: page as u64 }
            }
        }
    }

    impl Drop for GuardedPages {
        fn drop(&mut self) {
            // SAFETY: the mapping made in new(), not used after this.
            unsafe { libc::munmap(self.base as *mut libc::c_void, 3 * self.page as usize) };
        }
    }

    #[test]
    fn host_ranges_outside_readable_or_writable_mappings_are_refused() {
        let pages = GuardedPages::new();
        let (p, page) = (pages.base, pages.page);
        let range = |addr, len, written| MemoryRange { device: 0, addr, len, peers: false, written };
        let ranges = [
            range(0x10, 8, false),
            range(p, page, true),
            range(u64::MAX - 4, 8, false),
            range(0, 0, true),
            range(0xfff, 1, false),
            range(p + page - 8, 16, false),
            range(p + 2 * page, 64, false),
            range(p + 2 * page, 64, true),
            range(p + page, 0, true),
        ];
        let refused = host_inaccessible(&ranges);
        let indices: Vec<usize> = refused.iter().map(|r| r.index).collect();
        assert_eq!(indices, vec![0, 2, 4, 5, 7], "{refused:?}");
        assert!(refused[0].why.contains("first page"));
        assert!(refused[1].why.contains("past the end"));
        assert_eq!(refused[3].at, p + page, "the first byte of the guard page");
        assert!(refused[3].why.contains("without read permission"), "{}", refused[3].why);
        assert!(refused[4].why.contains("read-only"), "{}", refused[4].why);
        // Memory unmapped since: what a freed buffer is.
        drop(pages);
        let refused = host_inaccessible(&[range(p, 8, false)]);
        assert!(refused[0].why.contains("not mapped"), "{refused:?}");
    }

    #[test]
    fn the_first_unusable_side_is_named_by_segment_and_side() {
        let backend = HostBackend::new(2).unwrap();
        let memory = [0u8; 64];
        let good = memory.as_ptr() as u64;
        let segments = [
            Segment::contiguous(good, good + 32, 16),
            Segment::contiguous(good, 0x40, 16),
            Segment::contiguous(0x40, good, 16),
            Segment::contiguous(0x40, 0x80, 0),
        ];
        let both = |_| (Some(0), Some(1));
        let found = first_unusable(&backend, &segments, both, false).unwrap().unwrap();
        assert_eq!((found.segment, found.side, found.range), (1, Side::Destination, (0x40, 16)));
        assert_eq!(
            first_unusable(&backend, &segments[2..3], both, false).unwrap().unwrap().side,
            Side::Source
        );
        // Unchecked sides and empty segments pass.
        let unchecked = |i| if i == 1 { (None, None) } else { (Some(0), Some(0)) };
        let kept = [segments[0], segments[2], segments[3]];
        assert_eq!(first_unusable(&backend, &kept, unchecked, false).unwrap(), None);
        // A strided segment whose extent is refused is judged by its runs: the first refused run
        // is reported, not the extent.
        let strided = Segment {
            count: [2, 1],
            src_stride: [0x2000, 0],
            dst_stride: [16, 0],
            ..Segment::contiguous(0x800, good, 16)
        };
        let found = first_unusable(&backend, &[strided], both, false).unwrap().unwrap();
        assert_eq!((found.side, found.range), (Side::Source, (0x800, 16)));
        // Runs on either side of a guard page pass; a run into it does not. A read-only page may
        // be read, not written.
        let pages = GuardedPages::new();
        let (p, page) = (pages.base, pages.page);
        let around = Segment { src_stride: [2 * page, 0], ..Segment::contiguous(p, good, 16) };
        let around = Segment { count: [2, 1], dst_stride: [16, 0], ..around };
        assert_eq!(first_unusable(&backend, &[around], both, false).unwrap(), None);
        let into = Segment::contiguous(p + page - 8, good, 16);
        let found = first_unusable(&backend, &[into], both, false).unwrap().unwrap();
        assert_eq!((found.side, found.refusal.at), (Side::Source, p + page));
        let from_read_only = Segment::contiguous(p + 2 * page, good, 16);
        assert_eq!(first_unusable(&backend, &[from_read_only], both, false).unwrap(), None);
        let into_read_only = Segment::contiguous(good, p + 2 * page, 16);
        let found = first_unusable(&backend, &[into_read_only], both, false).unwrap().unwrap();
        assert_eq!(found.side, Side::Destination);
        assert!(found.refusal.why.contains("read-only"), "{}", found.refusal.why);
    }
}
