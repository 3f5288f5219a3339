//! The batched copy kernel: any number of [`Segment`](crate::segment::Segment)s copied in one launch,
//! near memory bandwidth for every segment size.
//!
//! - `batched_copy.cu`: the CUDA C source, compiled at first use per device by NVRTC ([`nvrtc`]).
//! - [`layout`]: how a batch is laid out for the kernel (descriptors, tiles); pure Rust.
//! - [`check`]: validation and the checked mode's destination-overlap test; pure Rust, shared with the
//!   host backend (`backend::host_copy`).
//! - [`batched_copy`]: the per-device kernel cache, one-shot [`copy_segments`] and [`PreparedBatch`].
//! - [`gf64`]: the refit digest in pure Rust (its definition, the host implementation, the
//!   digest kernel's constants).
//! - [`rendezvous`]: the device-memory flags through which a group's synchronized launches meet.

pub mod batched_copy;
pub mod check;
pub mod gf64;
pub mod layout;
pub mod nvrtc;
pub mod rendezvous;

pub use batched_copy::{copy_segments, BatchedCopy, PreparedBatch};
