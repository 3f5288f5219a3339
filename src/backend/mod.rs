//! Where bytes move. Backends know devices, streams, events and copies; they know nothing of plans.

pub mod dynlib;
pub mod host_copy;
