//! Whether the memory a batch of segments names can be used by a copy, checked once when the copy
//! is prepared (an executor's creation, a prepared batch) so that a bad address is a status, never
//! a crash or a dead CUDA context at the first run. [`Backend::inaccessible`] answers for ranges;
//! this module turns segments into ranges: first each side's extent (first to last byte), and only
//! where an extent is refused, its runs one by one (a strided segment may join buffers that lie at
//! regular distances, with memory that is no buffer between them).

use super::{Backend, MemoryRange, Refusal};
use crate::error::{try_vec, Result};
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
            ranges.push(MemoryRange { device, addr, len, peers });
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

/// The host backend's rule: no range in the first page, none past the end of the address space.
pub(crate) fn host_inaccessible(ranges: &[MemoryRange]) -> Vec<Refusal> {
    const FIRST_PAGE: u64 = 4096;
    let mut refused = Vec::new();
    for (index, range) in ranges.iter().enumerate().filter(|(_, r)| r.len > 0) {
        if range.addr < FIRST_PAGE {
            let why = "lies in the first page of the address space (below 4096), where no memory is".into();
            refused.push(Refusal { index, at: range.addr, why });
        } else if range.addr.checked_add(range.len).is_none() {
            let why = "runs past the end of the 64-bit address space".into();
            refused.push(Refusal { index, at: range.addr, why });
        }
    }
    refused
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::host::HostBackend;

    #[test]
    fn host_ranges_in_the_first_page_or_wrapping_are_refused() {
        let range = |addr, len| MemoryRange { device: 0, addr, len, peers: false };
        let refused = host_inaccessible(&[
            range(0x10, 8),
            range(0x1000, 8),
            range(u64::MAX - 4, 8),
            range(0, 0),
            range(0xfff, 1),
        ]);
        let indices: Vec<usize> = refused.iter().map(|r| r.index).collect();
        assert_eq!(indices, vec![0, 2, 4]);
        assert!(refused[0].why.contains("first page"));
        assert!(refused[1].why.contains("past the end"));
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
    }
}
