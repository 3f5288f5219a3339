//! refit moves tensors between GPUs for frameworks written in other languages, behind a stable C ABI
//! (`include/refit.h`). It offers stream-scoped group execution, allgather (NCCL or peer copies), and
//! a reshard plan/execute API over raw device pointers the caller owns.
//!
//! Layers, each knowing only the ones below it: `plan` is pure Rust and knows no CUDA; `transport` moves
//! bytes and knows no plans; `across` builds one plan over a communicator between processes (the
//! planner's tables exchanged over the transport's communicators); `ffi` converts and checks, and holds
//! no logic.

pub mod across;
pub mod allgather;
pub mod error;
pub mod exec;
pub mod ffi;
pub mod group;
pub mod kernels;
pub mod logging;
pub mod plan;
pub mod segment;
pub mod transport;

pub use error::{Error, Result, Status};
pub use segment::Segment;
