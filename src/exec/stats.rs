//! What one run or commit did and where its time went.

use super::options::Method;

/// Stats of one [`super::Executor::run`] or [`super::Executor::commit`]. Arrays are indexed by
/// `RouteKind as usize` (local, peer, remote).
///
/// Host time: `prepare_ns + enqueue_ns + wait_ns` account for `wall_ns` (what is left is the call's
/// own bookkeeping). Device time per stage, from stamps on the streams, is the longest rank's, summed
/// over slices; the stages of a rank may overlap (local and peer copies run side by side), so
/// `device_ns`, the longest rank's span from its first stage's start to its last stage's end, is what
/// they add up to on the device. Device times are filled when the call waited for the device
/// (`device_timed`); otherwise [`super::Executor::stats`] waits and fills them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// No descriptor had to be rebuilt for this call (false after a rebind touched the verify stage's).
    pub descriptors_reused: bool,
    /// The device times below are filled.
    pub device_timed: bool,
    /// This call checked the copied bytes against their sources, and every byte matched.
    pub verified: bool,
    /// Slices the step ran in (1 unless staged above the staging limit); 0 for a commit.
    pub slices: u32,
    /// How each route kind's copies from the sources were moved (None: this call moved none).
    pub methods: [Option<Method>; 3],
    /// Payload bytes and segments copied from the sources by this call, per route kind.
    pub bytes: [u64; 3],
    pub segments: [u64; 3],
    /// Bytes this call wrote into live buffers (a direct run: all; staged: what it installed).
    pub installed_bytes: u64,
    /// Bytes this call compared with their sources.
    pub verified_bytes: u64,
    pub wall_ns: u64,
    /// Host time rebuilding descriptors (0 when reused).
    pub prepare_ns: u64,
    /// Host time ordering the streams and queueing every stage.
    pub enqueue_ns: u64,
    /// Host time blocked on the device (a call outside a scope, verify outcomes, slices).
    pub wait_ns: u64,
    pub local_ns: u64,
    pub peer_ns: u64,
    pub verify_ns: u64,
    /// The installs from staging into the live buffers.
    pub commit_ns: u64,
    pub device_ns: u64,
}

impl RunStats {
    /// Host time the stats attribute to a phase.
    pub fn attributed_ns(&self) -> u64 {
        self.prepare_ns + self.enqueue_ns + self.wait_ns
    }

    /// One line for the log.
    pub fn summary(&self, call: &str) -> String {
        let method = |m: Option<Method>| match m {
            Some(Method::Kernel) => "kernel",
            Some(Method::CopyEngine) => "copy engine",
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
        format!(
            "refit {call}: {} B local ({} segments, {}), {} B peer ({} segments, {}), {} B installed, {} B \
             verified{}, {} slice(s), descriptors {}; host {:.1} us (prepare {:.1}, enqueue {:.1}, wait {:.1}); \
             {device}",
            self.bytes[0],
            self.segments[0],
            method(self.methods[0]),
            self.bytes[1],
            self.segments[1],
            method(self.methods[1]),
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
