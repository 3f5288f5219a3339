//! Allgather over a communicator between processes: the group allgather's semantics (blocks in rank
//! order, equal or uneven counts, in place) for the ranks of a [`Communicator`], each in its own
//! process. Equal counts are one `ncclAllGather`; uneven ones are grouped sends and receives of
//! exactly each rank's block (no padding) plus the copy of this rank's own block.

use super::call::{buffer_name, check_rank_buffers, layout, rank_memory};
use crate::bail;
use crate::error::{Result, Status};
use crate::segment::Segment;
use crate::transport::access::check_buffers_of;
use crate::transport::comm::{Agreement, Communicator};
use crate::transport::mesh::Message;
use crate::transport::Stream;

/// This rank's part of an allgather: `counts[rank]` bytes at `send` go to every rank, and `recv`
/// (sum(counts) bytes) receives rank p's block at `counts[0] + ... + counts[p-1]`. Queued on `stream`
/// (a stream of the communicator's device); every rank must make the same call with the same counts.
///
/// Errors: INVALID_ARGUMENT (counts not one per rank, overflowing sizes), NULL_ARGUMENT (a NULL buffer
/// with bytes to move), OVERLAP (send overlaps recv other than in place), and the communicator's.
///
/// # Safety
/// `send` and `recv` are memory of the communicator's device (host memory on the host backend) for
/// their sizes, until the queued work has run.
pub unsafe fn allgather(
    comm: &Communicator,
    send: u64,
    recv: u64,
    counts: &[usize],
    stream: Stream,
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    if counts.len() != size {
        bail!(Status::InvalidArgument, "{} counts for a communicator of {size} ranks", counts.len());
    }
    let layout = layout(counts)?;
    check_rank_buffers(rank, send, recv, counts[rank] as u64, &layout)?;
    let memory = rank_memory(comm.device(), send, recv, counts[rank] as u64, layout.total);
    check_buffers_of(comm.kind(), &memory, |i| buffer_name(i, rank))?;
    comm.check()?;
    // Ranks compare their counts before any byte moves (the host backend; NCCL's calls must match):
    // so even calls that move nothing take part.
    let tag = counts
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &c| (h ^ c as u64).wrapping_mul(0x0000_0100_0000_01b3));
    let agreement = Agreement { digest: tag, what: "counts", mine: shown(counts) };
    if counts.windows(2).all(|w| w[0] == w[1]) {
        return comm.all_gather(send, recv, counts[rank] as u64, &agreement, stream);
    }
    let mine = counts[rank] as u64;
    let others = || (0..size).filter(|&p| p != rank);
    let sends: Vec<Message> =
        others().filter(|_| mine > 0).map(|p| Message { peer: p, addr: send, len: mine }).collect();
    let recvs: Vec<Message> = others()
        .filter(|&p| counts[p] > 0)
        .map(|p| Message { peer: p, addr: recv + layout.offsets[p], len: counts[p] as u64 })
        .collect();
    let own = recv + layout.offsets[rank];
    let local: Vec<Segment> =
        if mine == 0 || send == own { Vec::new() } else { vec![Segment::contiguous(send, own, mine)] };
    comm.transfer_agreed(&sends, &recvs, &local, tag, &agreement, stream)
}

/// `counts` for a message: all of them, or the first few of many.
fn shown(counts: &[usize]) -> String {
    const SHOWN: usize = 8;
    if counts.len() <= SHOWN {
        format!("{counts:?}")
    } else {
        format!("{:?} and {} more", &counts[..SHOWN], counts.len() - SHOWN)
    }
}
