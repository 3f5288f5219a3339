//! Reshard planning: pure Rust, no CUDA. Merges every process's shard table, keeps one owner per
//! replica, intersects needs with offers, and emits the fewest, largest strided copies.
//!
//! Inputs: [`table`] (what each process offers and needs, and the checks of each entry), built
//! entry by entry with [`builder`] or decoded with [`wire`] (the binary encoding processes
//! exchange tables in); [`options`] (policy and limits).
//!
//! Stages, run in this order by [`planner`], one module each: `merge` (tables into one canonical,
//! checked form), `scope` (what the build covers: the whole plan, or one process's share of it,
//! every route from or to that process), `coverage` (destinations written twice; later, needed bytes nobody offers),
//! `replicas` (replica sets, digests, disjoint pieces of overlapping offers), `owners` (the
//! replica that serves each receiver, by policy), `shape` (one box into strided segments),
//! `coalesce` (segments across boxes and tensors), then counts in [`stats`]. Output: [`routes`].
//!
//! Helpers: `boxes` (box arithmetic), `box_index` (finding the boxes that meet a box), `memory`
//! (fallible allocation: a plan too large for memory is OUT_OF_MEMORY, never an abort), `digest`
//! (the FNV-1a every process computes alike).

mod box_index;
mod boxes;
pub mod builder;
mod coalesce;
mod coverage;
mod destinations;
mod digest;
mod memory;
mod merge;
pub mod options;
mod owners;
pub mod planner;
pub mod quantized;
mod replicas;
pub mod routes;
mod scope;
mod shape;
pub mod stats;
pub mod table;
pub mod wire;

pub use builder::TableBuilder;
pub use destinations::{Destinations, Located};
pub use options::{Limits, OwnerPolicy, PlanOptions};
pub use planner::{build, build_from, build_share, build_with_limits};
pub use quantized::{AmaxExchange, QuantNeed, QuantPath, QuantRoute, SharedAmax};
pub use routes::{Plan, Route, RouteKind};
pub use stats::{PlanStats, SIZE_BUCKETS};
pub use table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};
