//! The processes of a communicator that share a machine, joined by a Unix-socket mesh of their own:
//! what CUDA IPC needs beside NCCL (VMM handles are file descriptors, which only a Unix socket can
//! pass). Processes are on one machine for this purpose when they share the kernel (its boot id) and
//! the network namespace (abstract socket names are per namespace): two containers on one host with
//! separate namespaces count as two machines, and their routes take NCCL.

use super::super::mesh::{Deadline, Mesh, MeshKey, KEY_BYTES};
use super::Communicator;
use crate::error::{Error, Result, Status};
use std::os::fd::{OwnedFd, RawFd};
use std::time::Duration;

/// This process's machine: a digest of the kernel's boot id and the network namespace's inode.
fn machine() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let namespace =
        std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{}|{namespace}", boot.trim())
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The communicator ranks on this machine, in rank order, and a mesh between them.
pub struct NodeMesh {
    mesh: Mesh,
    /// The communicator rank of each mesh index.
    ranks: Vec<usize>,
}

impl NodeMesh {
    /// Every rank makes this call (a collective): machines and mesh names are gathered, and the
    /// ranks of each machine join one mesh, named by the key of their lowest rank (keys travel over
    /// the communicator, whose ranks were admitted with its id's secret).
    pub(super) fn join(comm: &Communicator, timeout: Duration) -> Result<NodeMesh> {
        let key = MeshKey::random()?;
        let mut mine = machine().to_le_bytes().to_vec();
        mine.extend_from_slice(key.bytes());
        let all = comm.allgather_bytes(&mine)?;
        let parse = |rank: usize| -> Result<(u64, MeshKey)> {
            let bytes = &all[rank];
            if bytes.len() != 8 + KEY_BYTES {
                return Err(Error::new(
                    Status::DecodeError,
                    format!("rank {rank} sent a machine record of {} bytes", bytes.len()),
                ));
            }
            Ok((
                u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
                MeshKey::from_bytes(bytes[8..].try_into().expect("key bytes")),
            ))
        };
        let here = machine();
        let mut ranks = Vec::new();
        let mut shared_key = None;
        for rank in 0..comm.size() {
            let (machine, key) = parse(rank)?;
            if machine == here {
                shared_key.get_or_insert(key);
                ranks.push(rank);
            }
        }
        let index = ranks.iter().position(|&r| r == comm.rank()).expect("this rank is on this machine");
        let key = shared_key.expect("this rank is on this machine");
        let mesh = Mesh::connect(&key, index, ranks.len(), Deadline::after(timeout))?;
        Ok(NodeMesh { mesh, ranks })
    }

    /// The communicator ranks on this machine, this one included, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Whether communicator rank `rank` is on this machine.
    pub fn holds(&self, rank: usize) -> bool {
        self.ranks.binary_search(&rank).is_ok()
    }

    fn index(&self, rank: usize) -> Result<usize> {
        self.ranks.binary_search(&rank).map_err(|_| {
            Error::invalid_argument(format!(
                "rank {rank} is not on this machine (ranks here: {:?})",
                self.ranks
            ))
        })
    }

    /// Passes descriptors to communicator rank `rank` on this machine (see `Mesh::send_fds`).
    pub fn send_fds(&self, rank: usize, fds: &[RawFd], timeout: Duration) -> Result<()> {
        self.mesh.send_fds(self.index(rank)?, fds, Deadline::after(timeout))
    }

    /// Receives the descriptors communicator rank `rank` passes with [`NodeMesh::send_fds`].
    pub fn recv_fds(&self, rank: usize, timeout: Duration) -> Result<Vec<OwnedFd>> {
        self.mesh.recv_fds(self.index(rank)?, Deadline::after(timeout))
    }

    pub(super) fn shutdown(&self) {
        self.mesh.shutdown();
    }
}
