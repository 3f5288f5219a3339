//! One allgather call's arguments, checked: every rank's buffers, its count, and where each block
//! lands in a receive buffer (see the module docs of `allgather` for the layout).

use crate::bail;
use crate::error::{Error, Result, Status};
use crate::group::Group;
use crate::segment::Segment;
use crate::transport::MemoryRange;

/// Block offsets and total size, after checking every argument against the group.
pub(super) struct BlockLayout {
    pub offsets: Vec<u64>,
    pub total: u64,
}

/// One whole-group allgather's arguments, checked: every rank's buffers and where each block lands.
pub(super) struct Gather<'a> {
    pub send: &'a [u64],
    pub recv: &'a [u64],
    pub counts: &'a [usize],
    pub layout: BlockLayout,
}

impl Gather<'_> {
    pub fn ranks(&self) -> usize {
        self.counts.len()
    }

    /// Rank `owner`'s block copied into rank `receiver`'s slot for it; None when the block is empty
    /// or already there (in place).
    pub fn block_into(&self, owner: usize, receiver: usize) -> Option<Segment> {
        let dst = self.recv[receiver] + self.layout.offsets[owner];
        let len = self.counts[owner] as u64;
        (len > 0 && self.send[owner] != dst).then(|| Segment::contiguous(self.send[owner], dst, len))
    }
}

pub(super) fn layout(counts: &[usize]) -> Result<BlockLayout> {
    let mut offsets = Vec::with_capacity(counts.len());
    let mut total: u64 = 0;
    for (p, &count) in counts.iter().enumerate() {
        offsets.push(total);
        total = total
            .checked_add(count as u64)
            .ok_or_else(|| Error::invalid_argument(format!("counts overflow at counts[{p}]")))?;
    }
    Ok(BlockLayout { offsets, total })
}

pub(super) fn ranges_overlap(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

fn end_fits(start: u64, len: u64, what: &str) -> Result<()> {
    start
        .checked_add(len)
        .map(|_| ())
        .ok_or_else(|| Error::invalid_argument(format!("{what} + its size overflows")))
}

pub(super) fn check_rank_buffers(
    rank: usize,
    send: u64,
    recv: u64,
    count: u64,
    layout: &BlockLayout,
) -> Result<()> {
    if count > 0 && send == 0 {
        bail!(Status::NullArgument, "send[{rank}] is NULL but counts[{rank}] is {count}");
    }
    if layout.total > 0 && recv == 0 {
        bail!(Status::NullArgument, "recv[{rank}] is NULL but the gathered size is {}", layout.total);
    }
    end_fits(send, count, &format!("send[{rank}]"))?;
    end_fits(recv, layout.total, &format!("recv[{rank}]"))?;
    let own_slot = recv + layout.offsets[rank];
    if send != own_slot && ranges_overlap(send, count, recv, layout.total) {
        bail!(
            Status::Overlap,
            "send[{rank}] overlaps recv[{rank}] but is not rank {rank}'s slot (recv[{rank}] + {}): \
             in place means exactly that address",
            layout.offsets[rank]
        );
    }
    Ok(())
}

/// A rank's buffers as the memory its device must be able to use: the send buffer read (`count`
/// bytes), the receive buffer written (`total`). Peers' memory is accepted where the device
/// reaches it directly (a rank's own buffers are usually its device's).
pub(super) fn rank_memory(device: i32, send: u64, recv: u64, count: u64, total: u64) -> [MemoryRange; 2] {
    [
        MemoryRange { device, addr: send, len: count, peers: true, written: false },
        MemoryRange { device, addr: recv, len: total, peers: true, written: true },
    ]
}

/// The name of range `index` of [`rank_memory`]'s ranges laid end to end, rank after rank from
/// `first_rank`.
pub(super) fn buffer_name(index: usize, first_rank: usize) -> String {
    let side = if index % 2 == 0 { "send" } else { "recv" };
    format!("{side}[{}]", first_rank + index / 2)
}

pub(super) fn check_counts(group: &Group, counts: &[usize]) -> Result<BlockLayout> {
    if counts.len() != group.size() {
        bail!(Status::InvalidArgument, "{} counts for a group of {}", counts.len(), group.size());
    }
    layout(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_offsets_and_overflow() {
        let l = layout(&[3, 0, 5]).unwrap();
        assert_eq!((l.offsets, l.total), (vec![0, 3, 3], 8));
        assert_eq!(layout(&[usize::MAX, 2]).err().unwrap().status, Status::InvalidArgument);
    }
}
