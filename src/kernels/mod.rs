//! The library's CUDA kernels and what they need on the host: the batched copy (any number of
//! [`Segment`](crate::segment::Segment)s copied in one launch, near memory bandwidth for every segment
//! size) and the digest (a CRC-style 64-bit digest of device memory at memory speed).
//!
//! - `batched_copy.cu`: the CUDA C source, compiled at first use per device by NVRTC
//!   (`transport::nvrtc`), once per architecture and compiler (`image_cache`: kept for the process's
//!   other devices).
//! - [`layout`]: how a batch is laid out for the kernel (descriptors, tiles); pure Rust. Segments are
//!   checked before (`segment::check`, shared with the host backend's copy).
//! - [`batched_copy`]: the per-device kernel cache, one-shot [`copy_segments`] and [`PreparedBatch`].
//! - `digest.cu` and [`digest`]: the digest kernel and its launch.
//! - [`gf64`]: the refit digest in pure Rust (its definition, the host implementation, the
//!   digest kernel's constants).
//! - [`verify`]: verifying copies (compare both sides, or check destinations against the source digests a
//!   prepared batch records).
//! - `quantize.cu` and [`quantize`]: the quantizing copy (bf16 to FP8 with scales, `crate::quant`).
//! - [`rendezvous`]: the device-memory flags through which a group's synchronized launches meet.
//! - `device_memory`: device allocations and page-locked host memory owned by the kernels' host code.
//! - `upload`: the reusable slots one-shot launches upload their tables into.
//!
//! The transport's backends launch these; the kernels use only the transport's driver and loader
//! files (`transport::driver`, `transport::nvrtc`), never the backends.

pub mod batched_copy;
pub(crate) mod device_memory;
pub mod digest;
pub mod gf64;
pub(crate) mod image_cache;
pub mod layout;
pub(crate) mod module;
pub mod quantize;
pub mod rendezvous;
pub(crate) mod upload;
pub mod verify;

pub use batched_copy::{copy_segments, BatchedCopy, PreparedBatch};
/// Upload slots per device and kernel for one-shot calls (tests queue more calls than this).
pub use upload::MAX_SLOTS as UPLOAD_SLOTS;
