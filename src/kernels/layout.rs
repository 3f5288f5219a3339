//! The device-side form of a batch: one [`DeviceSegment`] per non-empty segment, each knowing where its
//! tiles start, and the tiling rule the kernel relies on. Pure Rust (no CUDA), so it is tested in CI.
//!
//! Tiling: a run longer than a tile is cut into `ceil(len / TILE)` tiles; shorter runs are grouped,
//! up to `TILE / len` (at most `BatchLayout::MAX_RUNS_PER_TILE`) whole runs per tile. Every tile is one warp's
//! unit of work, so no warp ever walks a large segment alone and tiny runs do not pile onto one warp.

use crate::error::{try_vec, Error, Result};
use crate::segment::Segment;

// The tiling constants are associated with `BatchLayout` rather than free `pub const`s: cbindgen would
// otherwise copy them into the C header.

/// One segment as the kernel reads it. Must match `struct Desc` in `batched_copy.cu`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceSegment {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub count0: u64,
    pub src_stride0: u64,
    pub dst_stride0: u64,
    pub src_stride1: u64,
    pub dst_stride1: u64,
    /// count0 * count1.
    pub runs: u64,
    /// Index of this segment's first tile in the batch.
    pub tile_first: u64,
    /// Tiles per run (runs longer than a tile), else 1.
    pub run_tiles: u64,
    /// Whole runs per tile (runs no longer than a tile), else 1.
    pub tile_runs: u64,
}

const _: () = assert!(std::mem::size_of::<DeviceSegment>() == 96);

/// A batch laid out for the kernel: the descriptors of the non-empty segments followed by a sentinel
/// whose `tile_first` is the total tile count.
#[derive(Clone, Debug, Default)]
pub struct BatchLayout {
    pub descriptors: Vec<DeviceSegment>,
    pub tiles: u64,
    /// Payload bytes of the whole batch.
    pub bytes: u64,
    /// log2 of this layout's tile size; the kernel is launched with it.
    pub tile_shift: u32,
    /// log2 of the lanes that copy one tile (3, 4 or 5: 8, 16 or 32 lanes), from the average tile
    /// size (see [`BatchLayout::lanes_shift_for`]); the kernel is launched with it.
    pub group_shift: u32,
}

impl BatchLayout {
    /// log2 of the smallest and largest tile sizes [`BatchLayout::new`] picks (8 KiB and 64 KiB).
    pub(crate) const AUTO_TILE_SHIFTS: std::ops::RangeInclusive<u32> = 13..=16;
    /// log2 of the tiles [`BatchLayout::new`] aims to cut a batch into (2^15: about ten per warp of
    /// an H200's persistent grid).
    const AUTO_TILES_SHIFT: u32 = 15;
    /// Tile sizes a layout accepts (log2 bytes): 1 KiB .. 1 MiB. Pieces stay below 2^32 bytes, which
    /// the kernel's 32-bit piece arithmetic relies on.
    pub(crate) const TILE_SHIFTS: std::ops::RangeInclusive<u32> = 10..=20;
    /// Short runs are copied one after the other by a warp; this caps how many one tile takes.
    pub(crate) const MAX_RUNS_PER_TILE: u64 = 32;

    /// Lanes per tile for a batch of `tiles` tiles carrying `bytes`: small tiles are latency-bound, so
    /// a warp copies several at once (8 lanes each up to 512 B on average, 16 up to 2 KiB), which puts
    /// more memory round trips in flight; larger tiles use the whole warp.
    pub fn lanes_shift_for(bytes: u64, tiles: u64) -> u32 {
        let average = bytes / tiles.max(1);
        if average <= 512 {
            3
        } else if average <= 2048 {
            4
        } else {
            5
        }
    }

    /// log2 of the tile size [`BatchLayout::new`] picks for a batch of `bytes`: the largest tile
    /// from 8 KiB to 64 KiB that still cuts the batch into about 2^15 tiles. Every tile costs a fixed
    /// setup (its descriptor, its place in the segment; in the verifying modes a digest), which 8 KiB
    /// tiles pay often enough to slow a large batch, the check most (docs/decisions.md, "Tiles of
    /// 8 KiB on every batch"); a smaller batch needs the smaller tiles to keep every warp busy to the
    /// end.
    pub fn tile_shift_for(bytes: u64) -> u32 {
        (bytes >> BatchLayout::AUTO_TILES_SHIFT)
            .max(1)
            .ilog2()
            .clamp(*BatchLayout::AUTO_TILE_SHIFTS.start(), *BatchLayout::AUTO_TILE_SHIFTS.end())
    }

    /// log2 of the smallest tile size [`BatchLayout::new`] picks (for tests and benches).
    pub const fn default_tile_shift() -> u32 {
        *BatchLayout::AUTO_TILE_SHIFTS.start()
    }

    /// Segments that carry bytes (the sentinel excluded).
    pub fn segments(&self) -> u64 {
        self.descriptors.len().saturating_sub(1) as u64
    }

    /// Lays out `segments` (already validated: see [`super::check::validate`]) with the tile size
    /// [`BatchLayout::tile_shift_for`] picks for their bytes. Empty segments are dropped. Fails only if
    /// the tile count overflows, which validated input cannot make happen.
    pub fn new(segments: &[Segment]) -> Result<BatchLayout> {
        let bytes = segments.iter().fold(0u64, |sum, s| sum.saturating_add(s.bytes().unwrap_or(u64::MAX)));
        BatchLayout::with_tile_shift(segments, BatchLayout::tile_shift_for(bytes))
    }

    /// As [`BatchLayout::new`] with tiles of `2^tile_shift` bytes (a tuning knob; InvalidArgument outside
    /// 10..=20, i.e. 1 KiB to 1 MiB).
    pub fn with_tile_shift(segments: &[Segment], tile_shift: u32) -> Result<BatchLayout> {
        if !BatchLayout::TILE_SHIFTS.contains(&tile_shift) {
            return Err(Error::invalid_argument(format!(
                "tile shift {tile_shift} is outside {:?}",
                BatchLayout::TILE_SHIFTS
            )));
        }
        let tile_bytes = 1u64 << tile_shift;
        let mut descriptors = try_vec(segments.len().saturating_add(1), "the batch's descriptors")?;
        let mut tiles: u64 = 0;
        let mut bytes: u64 = 0;
        for segment in segments {
            let runs = segment.runs();
            if runs == 0 {
                continue;
            }
            let len = segment.len;
            let (run_tiles, tile_runs, segment_tiles) = if len > tile_bytes {
                let run_tiles = len.div_ceil(tile_bytes);
                (run_tiles, 1, runs.checked_mul(run_tiles))
            } else {
                let tile_runs = (tile_bytes / len).clamp(1, BatchLayout::MAX_RUNS_PER_TILE);
                (1, tile_runs, Some(runs.div_ceil(tile_runs)))
            };
            let tile_first = tiles;
            tiles = segment_tiles
                .and_then(|n| tiles.checked_add(n))
                .ok_or_else(|| Error::invalid_argument("the batch has too many tiles to count"))?;
            bytes = segment
                .bytes()
                .and_then(|b| bytes.checked_add(b))
                .ok_or_else(|| Error::invalid_argument("the batch's payload bytes overflow 64 bits"))?;
            descriptors.push(DeviceSegment {
                src: segment.src,
                dst: segment.dst,
                len,
                count0: segment.count[0],
                src_stride0: segment.src_stride[0],
                dst_stride0: segment.dst_stride[0],
                src_stride1: segment.src_stride[1],
                dst_stride1: segment.dst_stride[1],
                runs,
                tile_first,
                run_tiles,
                tile_runs,
            });
        }
        descriptors.push(DeviceSegment { tile_first: tiles, ..DeviceSegment::default() });
        let group_shift = BatchLayout::lanes_shift_for(bytes, tiles);
        Ok(BatchLayout { descriptors, tiles, bytes, tile_shift, group_shift })
    }

    /// The descriptors as raw bytes, for upload.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: DeviceSegment is repr(C), 96 bytes of u64 fields with no padding.
        unsafe {
            std::slice::from_raw_parts(
                self.descriptors.as_ptr().cast::<u8>(),
                std::mem::size_of_val(self.descriptors.as_slice()),
            )
        }
    }

    /// Calls `f(src, dst, len)` for every piece of tile `tile`, exactly as the kernel splits it.
    /// Used by tests to prove that the tiles cover every byte once; the kernel does the same walk.
    pub fn for_each_piece_of_tile(&self, tile: u64, mut f: impl FnMut(u64, u64, u64)) {
        let real = &self.descriptors[..self.descriptors.len() - 1];
        let index = real.partition_point(|d| d.tile_first <= tile) - 1;
        let d = &real[index];
        let local = tile - d.tile_first;
        let address = |base: u64, stride0: u64, stride1: u64, run: u64| {
            base.wrapping_add((run / d.count0).wrapping_mul(stride1))
                .wrapping_add((run % d.count0).wrapping_mul(stride0))
        };
        if d.run_tiles > 1 || d.runs == 1 {
            let per = d.run_tiles;
            let (run, part) = (local / per, local % per);
            let offset = part << self.tile_shift;
            let n = (d.len - offset).min(1 << self.tile_shift);
            f(
                address(d.src, d.src_stride0, d.src_stride1, run) + offset,
                address(d.dst, d.dst_stride0, d.dst_stride1, run) + offset,
                n,
            );
        } else {
            let first = local * d.tile_runs;
            let last = (first + d.tile_runs).min(d.runs);
            for run in first..last {
                f(
                    address(d.src, d.src_stride0, d.src_stride1, run),
                    address(d.dst, d.dst_stride0, d.dst_stride1, run),
                    d.len,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile size of every batch below 512 MiB.
    const TILE: u64 = 1 << BatchLayout::default_tile_shift();

    fn strided(len: u64, count: [u64; 2], src_stride: [u64; 2], dst_stride: [u64; 2]) -> Segment {
        Segment { src: 1 << 40, dst: 1 << 41, len, count, src_stride, dst_stride }
    }

    /// Every run's bytes, listed by walking the tiles, equals what Segment::for_each_run lists.
    fn pieces_cover_runs(segments: &[Segment]) {
        for shift in [BatchLayout::default_tile_shift(), 10, 16] {
            pieces_cover_runs_with(segments, shift);
        }
    }

    fn pieces_cover_runs_with(segments: &[Segment], shift: u32) {
        let layout = BatchLayout::with_tile_shift(segments, shift).unwrap();
        let mut from_tiles = Vec::new();
        for tile in 0..layout.tiles {
            layout.for_each_piece_of_tile(tile, |s, d, n| {
                assert!(n > 0 && n <= (1u64 << shift).max(segments.iter().map(|s| s.len).max().unwrap()));
                for b in 0..n {
                    from_tiles.push((s + b, d + b));
                }
            });
        }
        let mut from_runs = Vec::new();
        for segment in segments {
            segment.for_each_run(|s, d, n| {
                for b in 0..n {
                    from_runs.push((s + b, d + b));
                }
            });
        }
        assert_eq!(from_tiles, from_runs);
    }

    #[test]
    fn tiles_cover_every_byte_once_in_order() {
        pieces_cover_runs(&[Segment::contiguous(100, 5000, 3 * TILE + 7)]);
        pieces_cover_runs(&[Segment::contiguous(100, 5000, TILE)]);
        pieces_cover_runs(&[strided(768, [40, 1], [1536, 0], [768, 0])]);
        pieces_cover_runs(&[strided(TILE + 1, [3, 2], [TILE + 9, 100_000], [TILE + 1, 50_000])]);
        pieces_cover_runs(&[strided(1, [70, 3], [2, 200], [1, 70])]);
        pieces_cover_runs(&[
            Segment::contiguous(1, 2, 0),
            strided(5, [0, 3], [5, 5], [5, 5]),
            Segment::contiguous(1, 2, 3),
            strided(300, [7, 5], [300, 2100], [400, 2800]),
        ]);
    }

    #[test]
    fn empty_segments_are_dropped_and_sentinel_counts_tiles() {
        let layout =
            BatchLayout::new(&[Segment::contiguous(1, 2, 0), Segment::contiguous(1, 2, 2 * TILE)]).unwrap();
        assert_eq!(layout.segments(), 1);
        assert_eq!(layout.tiles, 2);
        assert_eq!(layout.bytes, 2 * TILE);
        assert_eq!(layout.descriptors.last().unwrap().tile_first, 2);
        assert_eq!(layout.as_bytes().len(), 2 * 96);
        let empty = BatchLayout::new(&[]).unwrap();
        assert_eq!((empty.tiles, empty.segments()), (0, 0));
    }

    #[test]
    fn tile_sizes_outside_the_supported_range_are_refused() {
        let one = [Segment::contiguous(1, 2, 3)];
        for shift in [0, 9, 21, 64] {
            let err = BatchLayout::with_tile_shift(&one, shift).unwrap_err();
            assert_eq!(err.status, crate::error::Status::InvalidArgument, "{shift}");
        }
        assert_eq!(BatchLayout::with_tile_shift(&one, 20).unwrap().tile_shift, 20);
    }

    #[test]
    fn small_tiles_get_narrow_lane_groups() {
        assert_eq!(BatchLayout::lanes_shift_for(256 << 20, 1 << 20), 3); // 256 B segments: 8 lanes
        assert_eq!(BatchLayout::lanes_shift_for(1 << 30, 1 << 20), 4); // 1 KiB average: 16 lanes
        assert_eq!(BatchLayout::lanes_shift_for(1 << 30, (1 << 30) / 4096), 5); // 4 KiB: the whole warp
        assert_eq!(BatchLayout::lanes_shift_for(0, 0), 3);
        let layout = BatchLayout::new(&[Segment::contiguous(1, 2, 1 << 20)]).unwrap();
        assert_eq!(layout.group_shift, 5);
    }

    #[test]
    fn large_batches_get_larger_tiles() {
        assert_eq!(BatchLayout::tile_shift_for(0), 13);
        assert_eq!(BatchLayout::tile_shift_for(256 << 20), 13); // 256 MiB: 2^15 tiles of 8 KiB
        assert_eq!(BatchLayout::tile_shift_for(1 << 30), 15); // 1 GiB: 32 KiB
        assert_eq!(BatchLayout::tile_shift_for(61 << 30), 16); // the demo's step: the cap, 64 KiB
        assert_eq!(BatchLayout::tile_shift_for(u64::MAX), 16);
        let big = [strided(1 << 20, [4096, 1], [1 << 20, 0], [1 << 20, 0])]; // 4 GiB
        let layout = BatchLayout::new(&big).unwrap();
        assert_eq!((layout.tile_shift, layout.tiles), (16, 4096 * 16));
    }

    #[test]
    fn short_runs_are_grouped_but_capped() {
        let layout = BatchLayout::new(&[strided(1, [1000, 1], [1, 0], [1, 0])]).unwrap();
        assert_eq!(layout.descriptors[0].tile_runs, BatchLayout::MAX_RUNS_PER_TILE);
        assert_eq!(layout.tiles, 1000u64.div_ceil(BatchLayout::MAX_RUNS_PER_TILE));
        let rows = BatchLayout::new(&[strided(768, [2048, 1], [1536, 0], [768, 0])]).unwrap();
        assert_eq!(rows.descriptors[0].tile_runs, TILE / 768);
    }
}
