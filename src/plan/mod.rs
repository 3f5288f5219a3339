//! Reshard planning: pure Rust, no CUDA. Merges every rank's shard table, keeps one owner per replica,
//! intersects needs with offers, and emits the fewest, largest strided copies.

pub mod table;

pub use table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};
