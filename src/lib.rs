//! refit moves tensors between GPUs for frameworks written in other languages, behind a stable C ABI
//! (`include/refit.h`). It offers stream-scoped group execution, allgather (NCCL or peer copies), and
//! a reshard plan/execute API over raw device pointers the caller owns.
//!
//! # Layers
//!
//! Each layer imports only the layers below it:
//!
//! ```text
//! ffi          the C ABI and nothing else: argument checks, conversion, one panic boundary
//!   exec       executing a reshard plan on a group: descriptors built once, arms, stage times
//!   across     one plan over a communicator between processes: tables gathered, each process
//!              builds its share, every process agrees before any byte moves
//!   allgather  allgather over a group (peer pushes, NCCL, host staging), keeping its own per-group
//!              state, and over a communicator between processes
//!   plan       pure Rust, no CUDA: tables, merge and owners, boxes, coalescing, coverage, stats, wire
//! group        devices, one non-blocking stream each, scopes, rank threads, barrier; knows no
//!              collective and no plan (the layers above keep their state in its extension slot)
//! transport    every way bytes cross devices and processes: the Backend interface (CUDA, host
//!              simulation) with its copies and batched copies, NCCL communicators and their
//!              send/recv, communicators between processes (NCCL, or the host simulation over Unix
//!              sockets), CUDA IPC and staged exchanges between processes, and the run-time
//!              loaders side by side (driver: libcuda; nccl: libnccl; nvrtc: libnvrtc)
//! kernels      the batched copy kernel's CUDA source, its launch and its rendezvous flags, built
//!              on the transport's driver and NVRTC loader (the backends launch it; it never
//!              calls a backend)
//! ```
//!
//! `quant` (pure Rust, no CUDA: the FP8 encodings, quantization jobs and their checks, and the
//! reference quantizer that the host backend runs and the `kernels` quantize kernel equals bit for
//! bit) sits beside `plan`, below `transport`.
//!
//! Beside them, used by every layer: `segment` (the unit of copying and its checks), `error`
//! (statuses and the error type), `sync` (locking) and `logging`. Realistic refit tables for the
//! demo, benches and tests come from the development crate in `workloads/`, no part of the library.
//!
//! # Vocabulary
//!
//! A *process* is one OS process taking part in a refit (a plan endpoint's process index). A *rank*
//! is a member of a group (`usize`, one device of this process) or of a communicator. A *device* is
//! a CUDA ordinal within a process (`i32`, as CUDA's; the host backend's simulated devices too).

pub mod across;
pub mod allgather;
pub mod error;
pub mod exec;
pub mod ffi;
pub mod group;
mod ids;
pub mod kernels;
pub mod logging;
pub mod plan;
pub mod quant;
pub mod segment;
mod sync;
pub mod transport;

pub use error::{Error, Result, Status};
pub use segment::Segment;
