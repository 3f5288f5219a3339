//! What allgather keeps per group for its per-rank calls and its NCCL path: the slots where ranks
//! publish their arguments, and the NCCL communicators. Held in the group's extension slot
//! (`Group::extension`), like the peer method's own state (`super::peer`): created at the first
//! allgather on a group, dropped with the group after its streams have drained.

use crate::error::{Error, Result};
use crate::group::Group;
use crate::transport::nccl::Communicators;
use std::sync::{Arc, Mutex, OnceLock};

/// What one rank published for the per-rank allgather in flight.
#[derive(Clone, Debug, Default)]
pub(crate) struct Published {
    pub send: u64,
    pub recv: u64,
    pub counts: Vec<usize>,
    pub algorithm: u32,
}

pub(crate) struct AllgatherState {
    devices: Vec<i32>,
    /// `slots[parity][rank]`: alternating by barrier crossing so a rank one call ahead never
    /// overwrites what a slower rank is still reading (see `super::allgather_rank`).
    pub slots: [Vec<Mutex<Published>>; 2],
    /// NCCL communicators, created on first use from the group's devices; a failed creation is kept
    /// and returned by every later call.
    nccl: OnceLock<std::result::Result<Communicators, Error>>,
}

/// The group's allgather state, created at the first call on the group.
pub(crate) fn state(group: &Group) -> Result<Arc<AllgatherState>> {
    group.extension(|group| {
        let n = group.size();
        Ok(AllgatherState {
            devices: group.devices().to_vec(),
            slots: [(0..n).map(|_| Mutex::default()).collect(), (0..n).map(|_| Mutex::default()).collect()],
            nccl: OnceLock::new(),
        })
    })
}

impl AllgatherState {
    /// The NCCL communicators, created on first use.
    pub fn communicators(&self) -> Result<&Communicators> {
        self.nccl.get_or_init(|| Communicators::create(&self.devices)).as_ref().map_err(Clone::clone)
    }
}
