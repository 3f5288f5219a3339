//! What one run or commit did and where its time went.
//!
//! [`RunStats`] is defined once, here, for Rust and C alike: the C ABI hands it out as
//! `refit_run_stats` (cbindgen reads this file).

use super::options::Method;
use crate::plan::RouteKind;

/// What one run or commit did, and where its time went. Before a call that fills it, C callers set
/// `size` to sizeof(refit_run_stats). Arrays are indexed by REFIT_ROUTE_LOCAL, _PEER, _REMOTE.
///
/// Host time: prepare_ns + enqueue_ns + wait_ns account for wall_ns (the rest is the call's own
/// bookkeeping). Device time per stage comes from stamps on the streams: the longest rank's, summed
/// over slices. A rank's local and peer copies run side by side, so device_ns (the longest rank's span
/// from its first stage's start to its last stage's end) is what the stages amount to on the device.
/// Device times are filled only when the call waited for the device (device_timed);
/// refit_executor_stats waits and fills them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunStats {
    /// sizeof(refit_run_stats) as the caller knows it (Rust: always the full size).
    pub size: usize,
    /// No descriptor was rebuilt for this call (false after a rebind touched a verify's).
    pub descriptors_reused: bool,
    /// The device times below are filled.
    pub device_timed: bool,
    /// A run: it read the check of every byte it copied (a staged run inside a scope leaves its last
    /// slice's to the commit), and all matched. A commit: the bytes it installed were checked (by
    /// the run, or by the commit when the run left it) and all matched. Never true when
    /// verified_bytes is 0.
    pub verified: bool,
    /// Slices the step ran in (1 unless staged above staging_limit); 0 for a commit.
    pub slices: u32,
    /// How the copies of each route kind moved: REFIT_ARM_KERNEL, _COPY_ENGINE, _SPLIT, or _NONE
    /// (this call moved none of that kind).
    pub arm: [u32; 3],
    /// Payload bytes copied from the sources by this call, per route kind.
    pub bytes: [u64; 3],
    /// Segments copied from the sources by this call, per route kind.
    pub segments: [u64; 3],
    /// Bytes this call wrote into live buffers (a direct run: all; staged: what it installed), FP8
    /// codes and scales of quantized needs included.
    pub installed_bytes: u64,
    /// A run: bytes whose check it read and found matching their sources. A commit: the installed
    /// bytes that were checked so.
    pub verified_bytes: u64,
    /// The whole call, on the host.
    pub wall_ns: u64,
    /// Host time rebuilding descriptors (0 when reused: descriptors are built at create, and rebuilt
    /// only by the first run after a rebind that touched a verify's).
    pub prepare_ns: u64,
    /// Host time ordering the streams and queueing every stage, and the call's own checks.
    pub enqueue_ns: u64,
    /// Host time blocked on the device (outside a scope; verify outcomes; slices).
    pub wait_ns: u64,
    /// Device time of the copies within a device.
    pub local_ns: u64,
    /// Device time of the copies between devices (NVLink).
    pub peer_ns: u64,
    /// Device time of the verify stage.
    pub verify_ns: u64,
    /// Device time of the installs from staging into the live buffers.
    pub commit_ns: u64,
    /// Device time of the whole call (see above).
    pub device_ns: u64,
    /// Payload bytes this process received from other processes (an executor made with a
    /// communicator; bytes[REFIT_ROUTE_REMOTE] counts those it sent).
    pub remote_received_bytes: u64,
    /// Of the bytes sent to other processes: written straight into their memory through CUDA IPC.
    pub remote_ipc_bytes: u64,
    /// Of the bytes sent to other processes: packed and sent through staging over the communicator
    /// (NCCL), the bytes on the wire.
    pub remote_wire_bytes: u64,
    /// Other processes this one exchanges bytes with through CUDA IPC, and through staging.
    pub remote_ipc_peers: u32,
    pub remote_staged_peers: u32,
    /// Elements this call quantized to FP8 (quantized needs): a direct run all of them; a staged
    /// run those quantized from their sources in place (into staging, installed by the commit); a
    /// commit those quantized from the needs' staging buffers.
    pub quantized_elements: u64,
}

impl Default for RunStats {
    fn default() -> RunStats {
        RunStats {
            size: std::mem::size_of::<RunStats>(),
            descriptors_reused: false,
            device_timed: false,
            verified: false,
            slices: 0,
            arm: [Method::code(None); 3],
            bytes: [0; 3],
            segments: [0; 3],
            installed_bytes: 0,
            verified_bytes: 0,
            wall_ns: 0,
            prepare_ns: 0,
            enqueue_ns: 0,
            wait_ns: 0,
            local_ns: 0,
            peer_ns: 0,
            verify_ns: 0,
            commit_ns: 0,
            device_ns: 0,
            remote_received_bytes: 0,
            remote_ipc_bytes: 0,
            remote_wire_bytes: 0,
            remote_ipc_peers: 0,
            remote_staged_peers: 0,
            quantized_elements: 0,
        }
    }
}

impl RunStats {
    /// How the copies of route kind `kind` moved (None: this call moved none of that kind).
    pub fn method(&self, kind: RouteKind) -> Option<Method> {
        Method::from_code(self.arm[kind as usize])
    }

    /// Host time the stats attribute to a phase.
    pub fn attributed_ns(&self) -> u64 {
        self.prepare_ns + self.enqueue_ns + self.wait_ns
    }

    /// One line for the log.
    pub fn summary(&self, call: &str) -> String {
        let method = |kind| match self.method(kind) {
            Some(Method::Kernel) => "kernel",
            Some(Method::CopyEngine) => "copy engine",
            Some(Method::Split) => "copy engine and kernel",
            None => "-",
        };
        let us = |ns: u64| ns as f64 / 1e3;
        let device = if self.device_timed {
            format!(
                "device {:.1} us (local {:.1}, peer {:.1}, verify {:.1}, commit {:.1})",
                us(self.device_ns),
                us(self.local_ns),
                us(self.peer_ns),
                us(self.verify_ns),
                us(self.commit_ns)
            )
        } else {
            "device times pending".to_string()
        };
        let remote = if self.bytes[2] + self.remote_received_bytes > 0 {
            format!(
                "{} B sent to other processes ({} through IPC to {} peer(s), {} on the wire to {}), {} B \
                 received, ",
                self.bytes[2],
                self.remote_ipc_bytes,
                self.remote_ipc_peers,
                self.remote_wire_bytes,
                self.remote_staged_peers,
                self.remote_received_bytes
            )
        } else {
            String::new()
        };
        format!(
            "refit {call}: {} B local ({} segments, {}), {} B peer ({} segments, {}), {remote}{} B installed, \
             {} B verified{}, {} slice(s), descriptors {}; host {:.1} us (prepare {:.1}, enqueue {:.1}, wait \
             {:.1}); {device}",
            self.bytes[0],
            self.segments[0],
            method(RouteKind::Local),
            self.bytes[1],
            self.segments[1],
            method(RouteKind::Peer),
            self.installed_bytes,
            self.verified_bytes,
            if self.verified { " (all matched)" } else { "" },
            self.slices,
            if self.descriptors_reused { "reused" } else { "rebuilt" },
            us(self.wall_ns),
            us(self.prepare_ns),
            us(self.enqueue_ns),
            us(self.wait_ns),
        )
    }
}
