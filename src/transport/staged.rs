//! Strided bytes between processes through bounded staging: the way between processes that cannot
//! open each other's memory (another node; IPC unavailable). The sender packs its strided segments
//! for each peer into staging with the batched copy, the pair exchanges them with grouped sends and
//! receives over a [`Communicator`], and the receiver unpacks them into place with the batched copy.
//! Exactly the segments' bytes cross the wire (no padding, no whole shards).
//!
//! Both sides of a pair derive the same layout from the same segments (the plan's route, which both
//! processes' shares hold): the segments are cut into pieces of at most the pair's chunk size, in
//! order, and the pieces grouped greedily into chunks; chunk i of every pair travels in step i. The
//! chunk size is what each process's staging budget allows for its own flows, the smaller of the
//! pair's (agreed in [`StagedExchange::prepare`], a collective call). Staging is two slots, so
//! that step i+1 packs while step i is on the wire, and step i unpacks while step i+1 packs:
//! `copy` stream `pack(i+1) .. unpack(i)` against `comm` stream `transfer(i)`, ordered by events.

use super::comm::Communicator;
use super::mesh::Message;
use super::{Backend, BackendKind, Event, PreparedCopy, Stream};
use crate::bail;
use crate::error::{Error, Result, Status};
use crate::segment::Segment;
use std::sync::Arc;

/// One direction of one pair: the segments this rank sends to `peer` (their sources are local) or
/// receives from `peer` (their destinations are local), in the route's order, which both sides share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    pub peer: usize,
    pub segments: Vec<Segment>,
}

/// Smallest chunk, whatever the budget: below it per-step costs dominate.
const MIN_CHUNK: u64 = 64 << 10;
/// Chunks start at this alignment in a slot (the kernel copies aligned tiles fastest); pieces
/// inside a chunk are packed tight, so the wire carries no padding.
const CHUNK_ALIGN: u64 = 256;

/// `s` cut into pieces of at most `max` bytes, in the order of its bytes (inner level fastest):
/// whole outer repetitions where they fit, else whole runs, else parts of a run.
pub fn split(s: &Segment, max: u64) -> Vec<Segment> {
    let Some(bytes) = s.bytes() else { return vec![*s] };
    if bytes == 0 {
        return Vec::new();
    }
    if bytes <= max {
        return vec![*s];
    }
    let mut pieces = Vec::new();
    let row = s.len * s.count[0];
    if row <= max {
        let per = max / row;
        let mut j = 0;
        while j < s.count[1] {
            let n = per.min(s.count[1] - j);
            pieces.push(Segment {
                src: s.src + j * s.src_stride[1],
                dst: s.dst + j * s.dst_stride[1],
                count: [s.count[0], n],
                ..*s
            });
            j += n;
        }
        return pieces;
    }
    for j in 0..s.count[1] {
        let (src_row, dst_row) = (s.src + j * s.src_stride[1], s.dst + j * s.dst_stride[1]);
        if s.len <= max {
            let per = max / s.len;
            let mut i = 0;
            while i < s.count[0] {
                let n = per.min(s.count[0] - i);
                pieces.push(Segment {
                    src: src_row + i * s.src_stride[0],
                    dst: dst_row + i * s.dst_stride[0],
                    len: s.len,
                    count: [n, 1],
                    src_stride: [s.src_stride[0], 0],
                    dst_stride: [s.dst_stride[0], 0],
                });
                i += n;
            }
            continue;
        }
        for i in 0..s.count[0] {
            let (src, dst) = (src_row + i * s.src_stride[0], dst_row + i * s.dst_stride[0]);
            let mut at = 0;
            while at < s.len {
                let n = max.min(s.len - at);
                pieces.push(Segment::contiguous(src + at, dst + at, n));
                at += n;
            }
        }
    }
    pieces
}

/// Pieces of one flow grouped into chunks of at most `chunk` bytes each: (pieces, bytes) per chunk.
fn chunks(flow: &Flow, chunk: u64) -> Vec<(Vec<Segment>, u64)> {
    let mut out: Vec<(Vec<Segment>, u64)> = Vec::new();
    for piece in flow.segments.iter().flat_map(|s| split(s, chunk)) {
        let bytes = piece.bytes().unwrap_or(0);
        match out.last_mut() {
            Some((pieces, total)) if *total + bytes <= chunk => {
                pieces.push(piece);
                *total += bytes;
            }
            _ => out.push((vec![piece], bytes)),
        }
    }
    out
}

/// The copies of one step on one side (pack or unpack), prepared once.
enum Copies {
    /// The batched copy kernel, descriptors on the device (CUDA).
    Prepared(Box<dyn PreparedCopy>),
    /// Queued on the stream at each run (host backend: a prepared host batch would wait for it).
    Queued(Vec<Segment>),
}

struct Step {
    sends: Vec<Message>,
    recvs: Vec<Message>,
    pack: Copies,
    unpack: Copies,
}

/// Counts of one exchange (for the executor's stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagedStats {
    /// Payload bytes this rank sends per run: the sum of its send flows' segment bytes.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub steps: u64,
    /// Device bytes of staging (two slots).
    pub staging_bytes: u64,
}

/// A prepared exchange of flows over a communicator, run any number of times.
pub struct StagedExchange {
    backend: Arc<dyn Backend>,
    device: i32,
    staging: u64,
    steps: Vec<Step>,
    copy: Stream,
    comm_stream: Stream,
    packed: [Event; 2],
    moved: [Event; 2],
    begin: Event,
    done: Event,
    stats: StagedStats,
}

impl StagedExchange {
    /// Lays out `sends` and `recvs` (at most one flow per peer and direction) for `comm` and
    /// allocates the staging on `device` of `backend` (the communicator's device). A collective call:
    /// every rank of `comm` makes it (with its own flows, possibly none), in the same order as its
    /// other calls, to agree on chunk sizes. `staging_bytes` bounds this rank's staging.
    ///
    /// Errors: INVALID_ARGUMENT (a peer that is not another rank, two flows for one peer and
    /// direction), OUT_OF_MEMORY, the communicator's.
    pub fn prepare(
        comm: &Communicator,
        backend: Arc<dyn Backend>,
        device: i32,
        sends: &[Flow],
        recvs: &[Flow],
        staging_bytes: u64,
    ) -> Result<StagedExchange> {
        for flows in [sends, recvs] {
            let mut peers: Vec<usize> = flows.iter().map(|f| f.peer).collect();
            peers.sort_unstable();
            if let Some(w) = peers.windows(2).find(|w| w[0] == w[1]) {
                bail!(Status::InvalidArgument, "two flows with rank {} in one direction", w[0]);
            }
            if let Some(f) = flows.iter().find(|f| f.peer >= comm.size() || f.peer == comm.rank()) {
                bail!(
                    Status::InvalidArgument,
                    "a flow with rank {}, not another rank of {}",
                    f.peer,
                    comm.size()
                );
            }
        }
        let flows = (sends.len() + recvs.len()).max(1) as u64;
        let mine = (staging_bytes / (2 * flows) / CHUNK_ALIGN * CHUNK_ALIGN).max(MIN_CHUNK);
        let all = comm.allgather_bytes(&mine.to_le_bytes())?;
        let chunk_of = |peer: usize| -> Result<u64> {
            let theirs = all[peer].as_slice().try_into().map(u64::from_le_bytes).map_err(|_| {
                Error::new(
                    Status::DecodeError,
                    format!("rank {peer} announced a chunk size of {} bytes", all[peer].len()),
                )
            })?;
            Ok(mine.min(theirs).max(MIN_CHUNK))
        };
        let send_chunks =
            sends.iter().map(|f| Ok((f.peer, chunks(f, chunk_of(f.peer)?)))).collect::<Result<Vec<_>>>()?;
        let recv_chunks =
            recvs.iter().map(|f| Ok((f.peer, chunks(f, chunk_of(f.peer)?)))).collect::<Result<Vec<_>>>()?;
        let steps = send_chunks.iter().chain(&recv_chunks).map(|(_, c)| c.len()).max().unwrap_or(0);
        // One slot holds any step's chunks, each aligned.
        let slot = (0..steps)
            .map(|i| {
                send_chunks
                    .iter()
                    .chain(&recv_chunks)
                    .filter_map(|(_, c)| c.get(i))
                    .map(|(_, bytes)| bytes.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        let mut exchange = StagedExchange {
            device,
            staging: 0,
            steps: Vec::with_capacity(steps),
            copy: backend.create_stream(device)?,
            comm_stream: Stream::NULL,
            packed: [Event(0); 2],
            moved: [Event(0); 2],
            begin: Event(0),
            done: Event(0),
            stats: StagedStats {
                bytes_sent: send_chunks.iter().flat_map(|(_, c)| c).map(|(_, b)| b).sum(),
                bytes_received: recv_chunks.iter().flat_map(|(_, c)| c).map(|(_, b)| b).sum(),
                steps: steps as u64,
                staging_bytes: 2 * slot,
            },
            backend,
        };
        exchange.comm_stream = exchange.backend.create_stream(device)?;
        for slot in 0..2 {
            exchange.packed[slot] = exchange.backend.create_event(device)?;
            exchange.moved[slot] = exchange.backend.create_event(device)?;
        }
        exchange.begin = exchange.backend.create_event(device)?;
        exchange.done = exchange.backend.create_event(device)?;
        if steps == 0 {
            return Ok(exchange);
        }
        let bytes =
            usize::try_from(2 * slot).map_err(|_| Error::new(Status::OutOfMemory, "staging too large"))?;
        exchange.staging = exchange.backend.alloc(device, bytes)?;
        for i in 0..steps {
            let base = exchange.staging + (i as u64 % 2) * slot;
            let mut at = 0u64;
            let (mut sends, mut recvs, mut pack, mut unpack) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (peer, chunks) in &send_chunks {
                let Some((pieces, bytes)) = chunks.get(i) else { continue };
                sends.push(Message { peer: *peer, addr: base + at, len: *bytes });
                let mut off = base + at;
                for p in pieces {
                    pack.push(Segment { dst: off, dst_stride: [p.len, p.len * p.count[0]], ..*p });
                    off += p.bytes().unwrap_or(0);
                }
                at += bytes.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
            }
            for (peer, chunks) in &recv_chunks {
                let Some((pieces, bytes)) = chunks.get(i) else { continue };
                recvs.push(Message { peer: *peer, addr: base + at, len: *bytes });
                let mut off = base + at;
                for p in pieces {
                    unpack.push(Segment { src: off, src_stride: [p.len, p.len * p.count[0]], ..*p });
                    off += p.bytes().unwrap_or(0);
                }
                at += bytes.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
            }
            let pack = exchange.copies(pack)?;
            let unpack = exchange.copies(unpack)?;
            exchange.steps.push(Step { sends, recvs, pack, unpack });
        }
        Ok(exchange)
    }

    fn copies(&self, segments: Vec<Segment>) -> Result<Copies> {
        Ok(match self.backend.kind() {
            BackendKind::Cuda => {
                Copies::Prepared(self.backend.prepare_batch(self.device, &segments, false)?)
            }
            BackendKind::Host => Copies::Queued(segments),
        })
    }

    pub fn stats(&self) -> StagedStats {
        self.stats
    }

    /// # Safety
    /// The copies' memory (sources, destinations, staging) is live until the work has run.
    unsafe fn launch(&self, copies: &Copies) -> Result<()> {
        match copies {
            Copies::Prepared(batch) => batch.launch(self.copy),
            Copies::Queued(segments) if segments.is_empty() => Ok(()),
            Copies::Queued(segments) => self.backend.copy_segments(self.device, self.copy, segments),
        }
    }

    /// Queues one run on `stream` (a stream of the device): the exchange starts after the work
    /// queued on `stream` so far, and work queued on it afterwards sees every received byte and may
    /// overwrite every sent one. Every peer of a flow runs its exchange too (as its matching
    /// communicator call, in the same order). A failure on the wire fails the communicator.
    ///
    /// # Safety
    /// Every flow's sources and destinations are live device memory (host memory on the host
    /// backend) until the queued work has run.
    pub unsafe fn run(&self, comm: &Communicator, stream: Stream) -> Result<()> {
        let b = &self.backend;
        b.record(self.device, self.begin, stream)?;
        b.wait(self.device, self.copy, self.begin)?;
        b.wait(self.device, self.comm_stream, self.begin)?;
        if let Some(first) = self.steps.first() {
            self.launch(&first.pack)?;
        }
        for (i, step) in self.steps.iter().enumerate() {
            let slot = i % 2;
            b.record(self.device, self.packed[slot], self.copy)?;
            b.wait(self.device, self.comm_stream, self.packed[slot])?;
            // Step i+1 packs into the other slot while step i is on the wire; that slot's previous
            // step (i-1) has been unpacked already, in this stream's order.
            if let Some(next) = self.steps.get(i + 1) {
                self.launch(&next.pack)?;
            }
            comm.transfer(&step.sends, &step.recvs, &[], step_tag(i), self.comm_stream)?;
            b.record(self.device, self.moved[slot], self.comm_stream)?;
            b.wait(self.device, self.copy, self.moved[slot])?;
            self.launch(&step.unpack)?;
        }
        // The last unpack comes after the last step on the wire, so the copy stream stands for both.
        b.record(self.device, self.done, self.copy)?;
        b.wait(self.device, stream, self.done)
    }
}

fn step_tag(i: usize) -> u64 {
    0x7374_6167_0000_0000 ^ i as u64
}

impl Drop for StagedExchange {
    fn drop(&mut self) {
        let b = &self.backend;
        let _ = b.sync_stream(self.device, self.copy);
        let _ = b.sync_stream(self.device, self.comm_stream);
        if self.staging != 0 {
            // SAFETY: ours; both streams that used it are idle.
            if let Err(err) = unsafe { b.free(self.device, self.staging) } {
                log::warn!("freeing staging: {err}");
            }
        }
        for event in [self.packed[0], self.packed[1], self.moved[0], self.moved[1], self.begin, self.done] {
            if event.0 != 0 {
                b.destroy_event(self.device, event);
            }
        }
        b.destroy_stream(self.device, self.copy);
        if self.comm_stream != Stream::NULL {
            b.destroy_stream(self.device, self.comm_stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte of `s` as (source address, destination address), in order.
    fn bytes_of(segments: &[Segment]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for s in segments {
            s.for_each_run(|src, dst, len| out.extend((0..len).map(|b| (src + b, dst + b))));
        }
        out
    }

    #[test]
    fn splitting_keeps_every_byte_in_order_and_bounds_each_piece() {
        let segments = [
            Segment {
                src: 1000,
                dst: 90_000,
                len: 7,
                count: [5, 3],
                src_stride: [9, 50],
                dst_stride: [7, 35],
            },
            Segment {
                src: 5000,
                dst: 70_000,
                len: 100,
                count: [3, 2],
                src_stride: [100, 300],
                dst_stride: [200, 1000],
            },
            Segment::contiguous(8000, 60_000, 250),
        ];
        for s in &segments {
            for max in [1, 6, 7, 20, 35, 36, 99, 100, 101, 105, 210, 300, 1000] {
                let pieces = split(s, max);
                assert!(pieces.iter().all(|p| p.bytes().unwrap() <= max), "{s:?} max {max}: {pieces:?}");
                assert_eq!(bytes_of(&pieces), bytes_of(&[*s]), "{s:?} max {max}");
            }
        }
        assert!(split(&Segment::contiguous(1, 2, 0), 10).is_empty());
    }

    #[test]
    fn chunks_hold_at_most_the_chunk_size_and_every_piece_in_order() {
        let flow = Flow {
            peer: 1,
            segments: vec![
                Segment::contiguous(0, 1 << 20, 300),
                Segment {
                    src: 4096,
                    dst: 2 << 20,
                    len: 64,
                    count: [10, 1],
                    src_stride: [128, 0],
                    dst_stride: [64, 0],
                },
                Segment::contiguous(9000, 3 << 20, 1000),
            ],
        };
        let grouped = chunks(&flow, 512);
        for (pieces, bytes) in &grouped {
            assert!(*bytes <= 512 && *bytes == pieces.iter().map(|p| p.bytes().unwrap()).sum::<u64>());
        }
        let all: Vec<Segment> = grouped.iter().flat_map(|(p, _)| p.clone()).collect();
        assert_eq!(bytes_of(&all), bytes_of(&flow.segments));
        assert_eq!(grouped.iter().map(|(_, b)| b).sum::<u64>(), 300 + 640 + 1000);
    }
}
