//! Reshard planning: shard tables (built entry by entry or decoded from bytes), their wire
//! encoding, plans built from them, and reading a plan's stats, routes and segments.
//!
//! Thread-safety: a `refit_table` is used by one thread at a time (calls that only read it, such as
//! encode and plan build, may share it between threads when none modifies it). A `refit_plan` is
//! immutable once built and may be read from any number of threads at once.

use super::handles::{destroy, live, publish};
use super::{boundary, c_str, in_use, options_in, out, sized_out, slice, OptionsStruct};
use crate::bail;
use crate::error::{try_vec, Error, Result};
use crate::plan::{
    self, Endpoint, Need, Offer, OwnerPolicy, Plan, PlanOptions, PlanStats, Region, TableBuilder, TensorSpec,
};
use crate::segment::Segment;
use crate::sync::{try_read, try_write};
use std::ffi::c_char;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Most dimensions a tensor may have.
pub const REFIT_MAX_DIMS: u32 = 8;
/// Owner policy: the replica of the lowest (process, device) serves each replica set.
pub const REFIT_POLICY_FIRST: u32 = 0;
/// Owner policy: a replica on the receiver's device, else in its process (NVLink peer), else the first.
pub const REFIT_POLICY_LOCAL: u32 = 1;
/// Owner policy: spread bytes over replicas so that the busiest source serves as little as possible.
pub const REFIT_POLICY_BALANCED: u32 = 2;
/// Route kind: source and destination in the same process, on the same device.
pub const REFIT_ROUTE_LOCAL: u32 = 0;
/// Route kind: same process, another device (a peer copy).
pub const REFIT_ROUTE_PEER: u32 = 1;
/// Route kind: another process.
pub const REFIT_ROUTE_REMOTE: u32 = 2;
/// refit_quant_route_info.path: the need's sources quantized where they are offered, in the
/// receiver's process.
pub const REFIT_PATH_IN_PLACE: u32 = 1;
/// refit_quant_route_info.path: the need's elements routed into its staging, quantized there.
pub const REFIT_PATH_STAGED: u32 = 2;
/// refit_quant_route_info.path: the need's sources quantized where they are offered, in another
/// process (the runner's, the sender), whose codes and scales then cross to the receiver.
pub const REFIT_PATH_SENDER: u32 = 3;
/// Buckets of refit_plan_stats.size_histogram.
pub const REFIT_PLAN_SIZE_BUCKETS: u32 = 64;

/// One process's shard table: tensors, offers (what it publishes), needs (what it receives). Host
/// memory only; no table call touches a device or a stream. Wherever the plan API takes or gives a
/// `rank`, it is a *process* index: a number the caller gives each OS process taking part in a
/// refit (not a device, and not a member of a group); `device` is a CUDA ordinal in that process.
///
/// Thread-safety: calls that change a table (refit_table_add_*) need it to themselves; calls that only
/// read it (refit_table_encoded_size, refit_table_encode, refit_plan_build, refit_plan_build_share,
/// refit_plan_build_across) may share it between threads while nothing changes it. A call that
/// breaks this returns INVALID_STATE and does nothing. Different tables are independent.
pub struct refit_table {
    /// Changes need it to themselves, reads may overlap: a call that breaks that is INVALID_STATE.
    table: RwLock<TableBuilder>,
}

/// A built reshard plan. Immutable: every reader may be called from any number of threads at once.
pub struct refit_plan {
    pub(crate) plan: Plan,
}

impl refit_table {
    fn new(table: TableBuilder) -> refit_table {
        refit_table { table: RwLock::new(table) }
    }

    /// The table for reading, while no call changes it (also for exports of other areas that read
    /// one, src/ffi/comm.rs).
    pub(crate) fn read(&self) -> Result<RwLockReadGuard<'_, TableBuilder>> {
        try_read(&self.table).ok_or_else(|| in_use("table"))
    }

    /// The table for a change, while no other call uses it.
    pub(crate) fn write(&self) -> Result<RwLockWriteGuard<'_, TableBuilder>> {
        try_write(&self.table).ok_or_else(|| in_use("table"))
    }
}

impl refit_plan {
    /// A plan built elsewhere (src/ffi/comm.rs), as a handle.
    pub(crate) fn new(plan: Plan) -> refit_plan {
        refit_plan { plan }
    }
}

/// Options of refit_plan_build. Fill with refit_plan_options_init, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_plan_options {
    /// sizeof(refit_plan_options) as the caller knows it (set by refit_plan_options_init).
    pub size: usize,
    /// REFIT_POLICY_FIRST, REFIT_POLICY_LOCAL (default) or REFIT_POLICY_BALANCED.
    pub policy: u32,
    /// 1: join segments across boxes and tensors (default); 0: do not (only for A/B checks). Any
    /// other value is INVALID_ARGUMENT.
    pub coalesce: u8,
}

/// One route of a plan: every segment from one source endpoint to one destination endpoint.
/// Before the call set `size` to sizeof(refit_route_info).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_route_info {
    /// sizeof(refit_route_info) as the caller knows it.
    pub size: usize,
    /// Source process index (as passed to refit_table_add_offer's `rank`).
    pub src_rank: u32,
    /// Source device ordinal within that process.
    pub src_device: u32,
    /// Destination process index (as passed to refit_table_add_need's `rank`).
    pub dst_rank: u32,
    /// Destination device ordinal within that process.
    pub dst_device: u32,
    /// REFIT_ROUTE_LOCAL, REFIT_ROUTE_PEER or REFIT_ROUTE_REMOTE.
    pub kind: u32,
    /// Number of segments.
    pub segment_count: usize,
    /// The segments, sorted by source address; owned by the plan, valid until refit_plan_destroy.
    pub segments: *const Segment,
}

/// The quantization one device runs for one quantized need (refit_table_add_quantized_need): which
/// path the need took, and what the device quantizes. A need quantized in place from offers on
/// several devices has one of these per device. Before the call set `size` to
/// sizeof(refit_quant_route_info).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_quant_route_info {
    /// sizeof(refit_quant_route_info) as the caller knows it.
    pub size: usize,
    /// The tensor's name, NUL-terminated; owned by the plan, valid until refit_plan_destroy.
    pub tensor: *const c_char,
    /// The receiving process index and device ordinal.
    pub receiver_rank: u32,
    pub receiver_device: u32,
    /// The device whose stream runs the quantization: a source's (in place, in the receiver's
    /// process; sender, in another process) or the receiver's (staged).
    pub runner_rank: u32,
    pub runner_device: u32,
    /// REFIT_PATH_IN_PLACE, REFIT_PATH_STAGED or REFIT_PATH_SENDER.
    pub path: u32,
    /// 1 when the jobs share an amax with jobs of other devices, which the executors exchange at
    /// every run (refit_table_share_amax); else 0.
    pub amax_exchanged: u32,
    /// The need's number among the plan's quantized needs (ordered by receiver, tensor, box): the
    /// routes of one need share it.
    pub need: u64,
    /// Matrices (or pieces of them) quantized.
    pub jobs: u64,
    /// Elements quantized.
    pub elements: u64,
    /// Source bytes read: in place, from the offers; staged, from the need's staging.
    pub source_bytes: u64,
}

/// Creates an empty table in `*table`. Thread-safe. Errors: NULL_ARGUMENT when `table` is NULL.
#[no_mangle]
pub extern "C" fn refit_table_create(table: *mut *mut refit_table) -> crate::Status {
    boundary("refit_table_create", || {
        let slot = out(table, "table")?;
        slot.write(publish(refit_table::new(TableBuilder::new())));
        Ok(())
    })
}

/// Releases a table. NULL is accepted. Plans built from it are unaffected. Refused while another
/// thread's call uses the table (see "Handles" at the top of this header).
#[no_mangle]
pub extern "C" fn refit_table_destroy(table: *mut refit_table) {
    destroy(table, "refit_table_destroy")
}

/// Adds a tensor: `name` (NUL-terminated UTF-8), a caller-defined `dtype` code, `elem_size` bytes per
/// element, and its global `shape` of `ndim` dimensions. Writes its index in this table to `*index`.
/// Adding a name again returns the same index when the description agrees. Names are found by
/// hashing: adding n tensors costs O(n).
///
/// Changes the table (see refit_table for threads: INVALID_STATE while another thread's call
/// uses it). Errors: NULL_ARGUMENT (table, name, index; shape when
/// ndim > 0), INVALID_ARGUMENT (empty or
/// non-UTF-8 name, elem_size 0, ndim > REFIT_MAX_DIMS, size over 2^64 bytes), TENSOR_MISMATCH (the
/// name was added with another dtype, element size or shape; the message names both).
///
/// # Safety
/// `shape` points to `ndim` values.
#[no_mangle]
pub unsafe extern "C" fn refit_table_add_tensor(
    table: *mut refit_table,
    name: *const c_char,
    dtype: u32,
    elem_size: u32,
    shape: *const u64,
    ndim: usize,
    index: *mut u32,
) -> crate::Status {
    boundary("refit_table_add_tensor", || {
        let table = live(table, "table")?;
        let slot = out(index, "index")?;
        let name = c_str(name, "name")?;
        let shape = dims(shape, ndim, "shape")?;
        let spec = TensorSpec { name: name.to_string(), dtype, elem_size, shape };
        slot.write(table.write()?.add_tensor(spec)?);
        Ok(())
    })
}

/// Adds an offer: process `rank`'s device `device` holds the box `offset`/`extent` (`ndim` values each,
/// global coordinates) of tensor `tensor` (an index from refit_table_add_tensor) at device address
/// `addr`, laid out with element `strides` (NULL: row-major over `extent`), with an optional
/// `digest` of its bytes (NULL: none). Offers of the same box are replicas.
///
/// Changes the table (see refit_table for threads: INVALID_STATE while another thread's call
/// uses it). Errors: NULL_ARGUMENT (table; offset/extent when ndim > 0),
/// INVALID_ARGUMENT (unknown tensor index, ndim above REFIT_MAX_DIMS, addresses past 2^64),
/// TENSOR_MISMATCH (ndim differing from the tensor's, box outside
/// the tensor).
///
/// # Safety
/// Non-NULL arrays hold `ndim` values; `digest` is NULL or readable.
#[no_mangle]
pub unsafe extern "C" fn refit_table_add_offer(
    table: *mut refit_table,
    tensor: u32,
    rank: u32,
    device: u32,
    addr: u64,
    offset: *const u64,
    extent: *const u64,
    strides: *const u64,
    ndim: usize,
    digest: *const u64,
) -> crate::Status {
    boundary("refit_table_add_offer", || {
        let table = live(table, "table")?;
        let region = Region { offset: dims(offset, ndim, "offset")?, extent: dims(extent, ndim, "extent")? };
        let strides = if strides.is_null() { None } else { Some(dims(strides, ndim, "strides")?) };
        let digest = digest.as_ref().copied();
        let owner = Endpoint { process: rank, device };
        table.write()?.add_offer(Offer { tensor, owner, addr, region, strides, digest })?;
        Ok(())
    })
}

/// Adds a need: process `rank`'s device `device` wants the box `offset`/`extent` (`ndim` values each,
/// global coordinates) of tensor `tensor` written at device address `addr` with destination element
/// `strides` (one per destination dimension). Destination dimension d is tensor dimension `perm[d]`
/// (`perm` NULL: the identity), so a transposed destination is a permutation. Several needs may
/// write disjoint parts of one buffer (fused parameters).
///
/// Changes the table (see refit_table for threads: INVALID_STATE while another thread's call
/// uses it). Errors: NULL_ARGUMENT (table, strides; offset/extent when
/// ndim > 0), INVALID_ARGUMENT (unknown tensor index, ndim above REFIT_MAX_DIMS, perm not a
/// permutation, addresses past 2^64), TENSOR_MISMATCH (ndim differing from the tensor's, box outside
/// the tensor). Overlapping destinations are found when the plan is built.
///
/// # Safety
/// Non-NULL arrays hold `ndim` values.
#[no_mangle]
pub unsafe extern "C" fn refit_table_add_need(
    table: *mut refit_table,
    tensor: u32,
    rank: u32,
    device: u32,
    addr: u64,
    offset: *const u64,
    extent: *const u64,
    perm: *const u32,
    strides: *const u64,
    ndim: usize,
) -> crate::Status {
    boundary("refit_table_add_need", || {
        let table = live(table, "table")?;
        if strides.is_null() {
            return Err(Error::new(crate::Status::NullArgument, "strides is NULL"));
        }
        let region = Region { offset: dims(offset, ndim, "offset")?, extent: dims(extent, ndim, "extent")? };
        let strides = dims(strides, ndim, "strides")?;
        let perm = if perm.is_null() { None } else { Some(slice(perm, ndim, "perm")?.to_vec()) };
        let receiver = Endpoint { process: rank, device };
        table.write()?.add_need(Need { tensor, receiver, addr, region, perm, strides })?;
        Ok(())
    })
}

/// Writes to `*size` the bytes refit_table_encode needs for this table. Reads the table (see
/// refit_table for sharing it between threads). Errors: NULL_ARGUMENT (table, size).
///
/// # Safety
/// `size` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_table_encoded_size(
    table: *const refit_table,
    size: *mut usize,
) -> crate::Status {
    boundary("refit_table_encoded_size", || {
        let table = live(table, "table")?;
        let slot = out(size, "size")?;
        slot.write(plan::wire::encode(table.read()?.table()).len());
        Ok(())
    })
}

/// Encodes the table (versioned, checksummed; see refit_table_decode) into `buffer` of `capacity`
/// bytes and writes the length used to `*written`. The encoding is the same on every platform. Reads
/// the table (see refit_table for sharing it between threads).
///
/// Errors: NULL_ARGUMENT (table, written; buffer when capacity > 0), BUFFER_TOO_SMALL (capacity
/// below refit_table_encoded_size; the message gives the size), INVALID_STATE (another thread is
/// changing the table).
///
/// # Safety
/// `buffer` is writable for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn refit_table_encode(
    table: *const refit_table,
    buffer: *mut u8,
    capacity: usize,
    written: *mut usize,
) -> crate::Status {
    boundary("refit_table_encode", || {
        let table = live(table, "table")?;
        let slot = out(written, "written")?;
        if buffer.is_null() && capacity > 0 {
            return Err(Error::new(
                crate::Status::NullArgument,
                format!("buffer is NULL but capacity is {capacity}"),
            ));
        }
        let bytes = plan::wire::encode(table.read()?.table());
        if capacity < bytes.len() {
            bail!(
                crate::Status::BufferTooSmall,
                "the encoded table takes {} bytes; capacity is {capacity}",
                bytes.len()
            );
        }
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer, bytes.len());
        slot.write(bytes.len());
        Ok(())
    })
}

/// Decodes `len` bytes written by refit_table_encode (in any process) into a new table in `*table`.
/// Untrusted bytes are safe: truncated, corrupted or hostile input returns a status. Thread-safe.
///
/// Errors: NULL_ARGUMENT (table; bytes when len > 0), DECODE_ERROR (not a table, checksum mismatch,
/// truncated, malformed; the message says where), VERSION_MISMATCH (another format version).
///
/// # Safety
/// `bytes` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn refit_table_decode(
    bytes: *const u8,
    len: usize,
    table: *mut *mut refit_table,
) -> crate::Status {
    boundary("refit_table_decode", || {
        let slot = out(table, "table")?;
        let bytes = slice(bytes, len, "bytes")?;
        let decoded = plan::wire::decode(bytes)?;
        slot.write(publish(refit_table::new(TableBuilder::from(decoded))));
        Ok(())
    })
}

/// Fills `*options` with the defaults: size set, policy REFIT_POLICY_LOCAL, coalescing on.
/// Thread-safe. Errors: NULL_ARGUMENT.
#[no_mangle]
pub extern "C" fn refit_plan_options_init(options: *mut refit_plan_options) -> crate::Status {
    boundary("refit_plan_options_init", || {
        let slot = out(options, "options")?;
        slot.write(refit_plan_options {
            size: std::mem::size_of::<refit_plan_options>(),
            policy: REFIT_POLICY_LOCAL,
            coalesce: 1,
        });
        Ok(())
    })
}

/// Builds the plan that moves every byte the tables' needs ask for exactly once, from one owner per
/// replica set, as the fewest strided segments; writes it to `*plan`. `tables` holds `count` tables
/// (every process's, in any order: the plan is the same). `options` NULL means the defaults. Runs on
/// the calling thread; touches no device.
///
/// Errors: NULL_ARGUMENT (plan; tables when count > 0; a NULL entry), INVALID_STATE (another thread
/// is changing one of the tables), INVALID_ARGUMENT (options.size, policy or coalesce out of range;
/// bad entries of decoded tables), TENSOR_MISMATCH (a tensor described differently by two tables:
/// the message names it and both values), REPLICA_MISMATCH (replicas
/// with different digests), COVERAGE_GAP (the message names the first region no offer covers),
/// OVERLAP (two destination bytes written twice), OUT_OF_MEMORY (the plan does not fit in memory,
/// or needs more segments than the planner's limit), UNSUPPORTED (pathological tables beyond the
/// planner's other limits: pieces of overlapping offers, runs compared for overlaps, box tests; the
/// message names the limit). Planning costs about O(n log n) in the tables' entries plus the
/// segments it produces; the limits cut pathological overlaps off early.
///
/// # Safety
/// `tables` points to `count` readable entries (each checked as a table handle).
#[no_mangle]
pub unsafe extern "C" fn refit_plan_build(
    tables: *const *const refit_table,
    count: usize,
    options: *const refit_plan_options,
    plan: *mut *mut refit_plan,
) -> crate::Status {
    boundary("refit_plan_build", || {
        let slot = out(plan, "plan")?;
        let options = plan_options(options)?;
        let built = with_tables(tables, count, |borrowed| {
            plan::build_from(borrowed, &options, &plan::Limits::default())
        })?;
        slot.write(publish(refit_plan { plan: built }));
        Ok(())
    })
}

/// Builds the share of the plan that process `process` takes part in, from every process's table
/// (`tables` holds `count` tables, in any order): every route from or to one of its endpoints,
/// exactly the routes refit_plan_build would give it, and the counts of its own receivers. Every
/// process that builds its share from the same tables and options gets routes that fit together
/// into one plan (owners are a function of all tables and the options). Every table is read, but
/// the work beyond reading them grows with this process's own needs and offers (with
/// REFIT_POLICY_BALANCED, with every need). Writes the share to `*plan`; read it with the plan
/// calls (refit_plan_get_stats counts this process's receivers; refit_plan_fingerprint digests
/// this share's routes; refit_plan_inputs_fingerprint is equal in every process given the same
/// tables and options: compare it before any byte moves). A share executes only for its own
/// process (refit_executor_create refuses it for another). Runs on the calling thread; touches no
/// device. Thread-safety: as refit_plan_build.
///
/// Errors: as refit_plan_build, except that COVERAGE_GAP and OVERLAP are reported for this
/// process's needs only (each process checks its own; a failure on any process must stop all).
///
/// # Safety
/// `tables` points to `count` readable entries (each checked as a table handle).
#[no_mangle]
pub unsafe extern "C" fn refit_plan_build_share(
    tables: *const *const refit_table,
    count: usize,
    process: u32,
    options: *const refit_plan_options,
    plan: *mut *mut refit_plan,
) -> crate::Status {
    boundary("refit_plan_build_share", || {
        let slot = out(plan, "plan")?;
        let options = plan_options(options)?;
        let built = with_tables(tables, count, |borrowed| {
            plan::build_share(borrowed, process, &options, &plan::Limits::default())
        })?;
        slot.write(publish(refit_plan { plan: built }));
        Ok(())
    })
}

/// Releases a plan. NULL is accepted. Segment pointers read from it become invalid. Executors made
/// from it are unaffected. Refused while another thread's call uses the plan (see "Handles" at the
/// top of this header).
#[no_mangle]
pub extern "C" fn refit_plan_destroy(plan: *mut refit_plan) {
    destroy(plan, "refit_plan_destroy")
}

/// Writes the whole plan's counts to `*stats`; set stats->size to sizeof(refit_plan_stats) first.
/// Thread-safe. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (stats->size).
///
/// # Safety
/// `stats` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_get_stats(
    plan: *const refit_plan,
    stats: *mut PlanStats,
) -> crate::Status {
    boundary("refit_plan_get_stats", || {
        let plan = live(plan, "plan")?;
        write_stats(plan.plan.stats(), stats)
    })
}

/// Writes the counts of receiver (process `rank`, `device`)'s needs and the routes into it to `*stats`
/// (zero but the shared input counts when that endpoint needs nothing, or when a share's process is
/// not `rank`); set stats->size first.
/// Thread-safe. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (stats->size).
///
/// # Safety
/// `stats` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_get_receiver_stats(
    plan: *const refit_plan,
    rank: u32,
    device: u32,
    stats: *mut PlanStats,
) -> crate::Status {
    boundary("refit_plan_get_receiver_stats", || {
        let plan = live(plan, "plan")?;
        write_stats(&plan.plan.receiver_stats(Endpoint { process: rank, device }), stats)
    })
}

/// Writes the plan's fingerprint, a digest of its routes, to `*fingerprint`: equal for the same
/// tables in any order, in any process; processes compare it to agree on one plan (a share's
/// covers its own routes: compare refit_plan_inputs_fingerprint across shares). Thread-safe.
/// Errors: NULL_ARGUMENT.
///
/// # Safety
/// The output is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_fingerprint(
    plan: *const refit_plan,
    fingerprint: *mut u64,
) -> crate::Status {
    boundary("refit_plan_fingerprint", || {
        let plan = live(plan, "plan")?;
        out(fingerprint, "fingerprint")?.write(plan.plan.fingerprint());
        Ok(())
    })
}

/// Writes to `*fingerprint` a digest of everything the plan was built from: every table's content
/// (in any order, entries in any order), the options and the planner's limits. Equal for a plan
/// and every process's share built from the same inputs, in any process; processes compare it to
/// agree on their inputs. Thread-safe. Errors: NULL_ARGUMENT.
///
/// # Safety
/// The output is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_inputs_fingerprint(
    plan: *const refit_plan,
    fingerprint: *mut u64,
) -> crate::Status {
    boundary("refit_plan_inputs_fingerprint", || {
        let plan = live(plan, "plan")?;
        out(fingerprint, "fingerprint")?.write(plan.plan.inputs_fingerprint());
        Ok(())
    })
}

/// Writes the number of routes to `*count`. Routes are ordered by destination endpoint, then local,
/// peer, remote, then source endpoint. Thread-safe. Errors: NULL_ARGUMENT.
///
/// # Safety
/// The output is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_route_count(plan: *const refit_plan, count: *mut usize) -> crate::Status {
    boundary("refit_plan_route_count", || {
        let plan = live(plan, "plan")?;
        out(count, "count")?.write(plan.plan.routes().len());
        Ok(())
    })
}

/// Writes route `index` (0 <= index < route count) to `*route`, including a pointer to its segments
/// valid until the plan is destroyed; set route->size to sizeof(refit_route_info) first. A segment
/// copies `len` bytes, repeated count[0] times then count[1] times with the given byte strides.
/// Thread-safe. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (route->size), NOT_FOUND (index out of range).
///
/// # Safety
/// `route` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_route(
    plan: *const refit_plan,
    index: usize,
    route: *mut refit_route_info,
) -> crate::Status {
    boundary("refit_plan_route", || {
        let plan = live(plan, "plan")?;
        let slot = sized_out(route, "route")?;
        let r = nth(plan.plan.routes(), index, "route")?;
        slot.write(refit_route_info {
            size: std::mem::size_of::<refit_route_info>(),
            src_rank: r.src.process,
            src_device: r.src.device,
            dst_rank: r.dst.process,
            dst_device: r.dst.device,
            kind: r.kind() as u32,
            segment_count: r.segments.len(),
            segments: r.segments.as_ptr(),
        });
        Ok(())
    })
}

/// Writes the number of quantized routes (refit_quant_route_info) to `*count`: one per (quantized
/// need, device quantizing it), ordered by receiver, tensor and box, then device. A share holds its
/// process's receivers'. Thread-safe. Errors: NULL_ARGUMENT.
///
/// # Safety
/// The output is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_quant_route_count(
    plan: *const refit_plan,
    count: *mut usize,
) -> crate::Status {
    boundary("refit_plan_quant_route_count", || {
        let plan = live(plan, "plan")?;
        out(count, "count")?.write(plan.plan.quant_routes().len());
        Ok(())
    })
}

/// Writes quantized route `index` (0 <= index < refit_plan_quant_route_count) to `*route`: which path
/// its need took and what its device quantizes. Set route->size to sizeof(refit_quant_route_info)
/// first. Thread-safe. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (route->size), NOT_FOUND (index out of
/// range).
///
/// # Safety
/// `route` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_quant_route(
    plan: *const refit_plan,
    index: usize,
    route: *mut refit_quant_route_info,
) -> crate::Status {
    boundary("refit_plan_quant_route", || {
        let plan = live(plan, "plan")?;
        let slot = sized_out(route, "route")?;
        let r = nth(plan.plan.quant_routes(), index, "quantized route")?;
        slot.write(refit_quant_route_info {
            size: std::mem::size_of::<refit_quant_route_info>(),
            tensor: r.tensor.as_ptr(),
            receiver_rank: r.receiver.process,
            receiver_device: r.receiver.device,
            runner_rank: r.runner.process,
            runner_device: r.runner.device,
            path: match r.path {
                plan::QuantPath::Direct => REFIT_PATH_IN_PLACE,
                plan::QuantPath::Staged => REFIT_PATH_STAGED,
                plan::QuantPath::Sender => REFIT_PATH_SENDER,
            },
            amax_exchanged: u32::from(r.amax_exchanged),
            need: r.need as u64,
            jobs: r.jobs.len() as u64,
            elements: r.elements(),
            source_bytes: r.source_bytes(),
        });
        Ok(())
    })
}

/// Item `index` of a plan's list of `what`s, or NOT_FOUND saying how many there are.
fn nth<'a, T>(items: &'a [T], index: usize, what: &str) -> Result<&'a T> {
    items.get(index).ok_or_else(|| {
        Error::new(
            crate::Status::NotFound,
            format!("{what} {index} but the plan has {} {what}s", items.len()),
        )
    })
}

/// `body` over the tables of a caller's array of `count` table pointers, each held for reading
/// meanwhile (a table that another thread is changing is INVALID_STATE).
///
/// # Safety
/// `tables` points to `count` readable entries (each checked as a table handle).
unsafe fn with_tables<R>(
    tables: *const *const refit_table,
    count: usize,
    body: impl FnOnce(&[&plan::Table]) -> Result<R>,
) -> Result<R> {
    let pointers = slice(tables, count, "tables")?;
    let mut handles = try_vec(pointers.len(), "the table list")?;
    for (i, &t) in pointers.iter().enumerate() {
        handles.push(live(t, &format!("tables[{i}]"))?);
    }
    let mut held = try_vec(handles.len(), "the table list")?;
    for handle in &handles {
        held.push(handle.read()?);
    }
    let borrowed: Vec<&plan::Table> = held.iter().map(|t| t.table()).collect();
    body(&borrowed)
}

/// A caller array of dimensions, at most REFIT_MAX_DIMS long.
unsafe fn dims(ptr: *const u64, ndim: usize, what: &str) -> Result<Vec<u64>> {
    if ndim > plan::MAX_DIMS {
        bail!(crate::Status::InvalidArgument, "ndim is {ndim}; at most {} dimensions", plan::MAX_DIMS);
    }
    Ok(slice(ptr, ndim, what)?.to_vec())
}

impl OptionsStruct for refit_plan_options {}

pub(crate) unsafe fn plan_options(options: *const refit_plan_options) -> Result<PlanOptions> {
    let Some(options) = options_in(options, "options")? else {
        return Ok(PlanOptions::default());
    };
    let policy = match options.policy {
        REFIT_POLICY_FIRST => OwnerPolicy::First,
        REFIT_POLICY_LOCAL => OwnerPolicy::Local,
        REFIT_POLICY_BALANCED => OwnerPolicy::Balanced,
        other => bail!(
            crate::Status::InvalidArgument,
            "options.policy is {other}; expected REFIT_POLICY_FIRST, _LOCAL or _BALANCED"
        ),
    };
    let coalesce = match options.coalesce {
        0 => false,
        1 => true,
        other => bail!(crate::Status::InvalidArgument, "options.coalesce is {other}; expected 0 or 1"),
    };
    Ok(PlanOptions { policy, coalesce })
}

unsafe fn write_stats(s: &PlanStats, stats: *mut PlanStats) -> Result<()> {
    sized_out(stats, "stats")?.write(PlanStats { size: std::mem::size_of::<PlanStats>(), ..*s });
    Ok(())
}

/// How a quantized need (refit_table_add_quantized_need) is quantized and where its scales and
/// staging are. `arithmetic` (REFIT_ARITHMETIC_*, 0 the default) says how fp32 scales and quotients
/// are computed, as refit_quantize_job's.
///
/// The need's box is a stack of matrices: its last two dimensions are rows and columns (a
/// 1-dimensional box is one row) and the dimensions before them number the matrices, row-major;
/// each matrix is quantized on its own, its blocks counted from its first element. Matrix m's scale
/// grid (ceil(rows / R) x ceil(cols / C) scales for blocks of R x C, as refit_quantize_job's) lies
/// at `scales + m * scale_matrix_stride` scales, `scale_row_stride` scales from one grid row to the
/// next. `staging` (0: none) is a buffer on the receiving device holding the box's source elements
/// row-major, 16-byte aligned with rows a multiple of 16 bytes: where the elements land to be
/// quantized when they cannot be quantized where they are offered.
///
/// A per-tensor or per-row scale is that of the box's matrix or row, not of the whole tensor's, but
/// for per-tensor needs of one process naming the same scale (a matrix's `scales + m *
/// scale_matrix_stride`): those share it, computed from the amax of all their matrices (a fused QKV
/// weight with one scale, whose q, k and v are separate tensors: three needs, one scale). They must
/// be received on one device with one target and arithmetic (INVALID_ARGUMENT at planning, naming
/// them). They are quantized in place when all of them can be, from one device: of the receiver's
/// process, else of one sending process (which quantizes them in one batch and sends the codes and
/// the one scale); otherwise every one of them is staged, and without staging each is quantized in
/// place on its own device with the amax exchanged between the devices (refit_table_share_amax
/// says how; a need none of this can meet: UNSUPPORTED naming the tensor and the needs it shares
/// its scale with). A per-tensor need of one matrix may take it from several offers, whose jobs
/// share its scale. Per-tensor scales on several
/// receivers that hold one value (a weight's shards, each receiver with its own copy of the scale:
/// vLLM 0.33's per-tensor weights of a tensor-parallel layer) share their amax through a key
/// (refit_table_share_amax), and so do per-row scales of a weight's column shards (vLLM 0.33's
/// online per-channel weights of a row-parallel layer, whose rows take their amax across the
/// tensor-parallel ranks). Blocks (128 x 128 inside a shard) and MXFP8 groups need neither.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_need_quantization {
    pub quantization: super::quantize::refit_quantization,
    pub source_type: u32,
    pub arithmetic: u32,
    pub scales: u64,
    pub scale_row_stride: u64,
    pub scale_matrix_stride: u64,
    pub staging: u64,
}

/// Adds a quantized need: process `rank`'s device `device` wants the box `offset`/`extent` of tensor
/// `tensor` (elements of `quantization->source_type`) as FP8 codes at `addr`, code strides `strides`
/// in bytes (the last 1), and scales, quantized as refit_quantize_batch quantizes (the arithmetic is
/// documented there). See refit_need_quantization for the matrices, scales and staging.
///
/// Planning picks one of three paths per need (refit_plan_quant_route says which each took, and
/// refit_plan_stats counts each):
/// - in place: offers in the receiver's process tile the box so that every quantization block lies
///   inside one offer, with contiguous rows. The device holding each offer quantizes it straight
///   into the need's codes and scales (one byte per element reaches the receiver, not two).
/// - sender: offers tile the box that way, but some are in other processes. Each such process
///   quantizes its pieces where they are offered, and only the codes and scales cross to the
///   receiver (one byte per element, not two): through CUDA IPC its kernel writes them into the
///   receiver's memory itself; otherwise (staging over the communicator) it quantizes into a buffer
///   its executor allocates (as many bytes as those codes and scales, beside staging_limit) and
///   they cross as the routes between processes do. Of replicas offered by several processes, needs
///   take them in turn. Pieces offered in the receiver's process stay in place.
/// - staged: otherwise (a block spans offers, offers overlap without being replicas). The elements
///   are routed into `staging` like any need, then quantized there by the receiving device.
///   Planning fails with UNSUPPORTED, naming the tensor and why, when the need has no staging.
///
/// An executor quantizes sender pieces at the start of each run, before the routes between
/// processes carry their codes and scales (refit_run_stats.quantized_elements counts them in the
/// sender's run; the receiver's staged commit installs them with the other bytes from other
/// processes). It quantizes in place within the step's copies (on CUDA, in the same launch as the
/// device's batched copy where the step has one and nothing is verified; else right after the
/// copies) and staged needs after the copies (direct commit: all within the run). Under staged
/// commit nothing live is written before the commit: in-place codes and scales are quantized into
/// staging at the run and installed at the commit; staged needs are quantized at the commit, from
/// their staging once the commit has filled it. That staging is device memory the executor
/// allocates, as many bytes as the in-place codes and scales, beside staging_limit.
/// refit_run_stats.quantized_elements counts what each call quantized. With
/// refit_executor_options.verify, each job is quantized a second time into scratch (as many bytes
/// as its codes and scales, also beside staging_limit; refit_executor_info.quantization_bytes sums
/// these buffers, the sender's included) and its codes and scales compared with that
/// on the device (VERIFY_MISMATCH names the tensor; refit_run_stats.verified_bytes counts them).
/// refit_executor_create refuses codes or scales that share a byte with another quantized need's
/// (OVERLAP; but for per-tensor needs sharing one scale, above), memory that is not the device's (INVALID_ARGUMENT, as for every address of a plan),
/// and an in-place path from a device that cannot write the receiver's memory (UNSUPPORTED: no
/// peer access; give the need staging).
/// refit_executor_rebind of a range that quantized needs read or write is UNSUPPORTED and changes
/// nothing.
///
/// Changes the table (see refit_table for threads). Errors: NULL_ARGUMENT (table, strides,
/// quantization; offset/extent when ndim > 0), INVALID_ARGUMENT (unknown tensor index, ndim above
/// REFIT_MAX_DIMS, an unknown target, granularity or source type, REFIT_QUANT_NONE, a bad block
/// shape, an unknown arithmetic or one MXFP8 does not take, an element size other than the source type's, a last stride other than
/// 1, scale strides that make grids overlap, misaligned staging, ranges past 2^64),
/// TENSOR_MISMATCH (ndim differing from the tensor's, box outside the tensor).
///
/// # Safety
/// Non-NULL arrays hold `ndim` values; `quantization` is NULL or readable.
#[no_mangle]
pub unsafe extern "C" fn refit_table_add_quantized_need(
    table: *mut refit_table,
    tensor: u32,
    rank: u32,
    device: u32,
    addr: u64,
    offset: *const u64,
    extent: *const u64,
    strides: *const u64,
    ndim: usize,
    quantization: *const refit_need_quantization,
) -> crate::Status {
    boundary("refit_table_add_quantized_need", || {
        let table = live(table, "table")?;
        if strides.is_null() {
            return Err(Error::new(crate::Status::NullArgument, "strides is NULL"));
        }
        let Some(q) = quantization.as_ref().copied() else {
            return Err(Error::new(crate::Status::NullArgument, "quantization is NULL"));
        };
        let region = Region { offset: dims(offset, ndim, "offset")?, extent: dims(extent, ndim, "extent")? };
        let strides = dims(strides, ndim, "strides")?;
        let kind = super::quantize::quantization(
            "quantization->quantization",
            &q.quantization,
            "quantization->arithmetic",
            q.arithmetic,
        )?;
        let source = super::quantize::source_type("quantization->source_type", q.source_type)?;
        table.write()?.add_quant_need(plan::QuantNeed {
            tensor,
            receiver: Endpoint { process: rank, device },
            addr,
            region,
            strides,
            quantization: kind,
            source,
            scales: q.scales,
            scale_row_stride: q.scale_row_stride,
            scale_matrix_stride: q.scale_matrix_stride,
            staging: q.staging,
        })?;
        Ok(())
    })
}

/// Gives the scales starting at `scale` of process `rank` the amax key `key` (nonzero): a
/// per-tensor scale (a quantized need's `scales + m * scale_matrix_stride` scales), or the per-row
/// scales of a 2-dimensional per-row need (its `scales`). Every per-tensor scale that any process's
/// table gives the same key takes one value, computed from the amax of all the quantized needs that
/// write any of those scales; per-row needs given one key (which must hold the same rows of their
/// tensors) take each row's amax over all of them, each writing its own scales. This is how one
/// weight's shards on several receivers share their scales, each receiver holding its own copy:
/// vLLM 0.33's per-tensor weights of a tensor-parallel layer (its amax reduced across the ranks),
/// and its per-channel weights of a row-parallel layer (each row's amax reduced across the ranks);
/// each rank calls this for its scales with a key all ranks derive from the layer's name. Needs
/// naming one per-tensor scale in one process share it without a key. A key only one need takes
/// changes nothing: every need sharing a key must be in the tables a plan is built from.
///
/// Such needs are quantized in place only. Where one device holds the pieces of all of them (one
/// offer per quantization block, as refit_table_add_quantized_need's in place and sender paths
/// take; per row, one offer per need), in a process that receives all of them (in place) or none
/// (the sender path), it quantizes them in one batch and sends each receiver its codes and its
/// scales. Otherwise, where they are received on one device and each has staging, they are staged
/// there. Otherwise, where each can be quantized in place on its own (a per-tensor need from any
/// offers holding its matrix; per-row needs from offers that cut every need's rows into the same
/// bands), each is, on the devices holding its pieces (a tensor-parallel trainer's shards), and
/// those devices agree on the amax (per row, each row's) at every run:
/// each reduces its jobs' elements (the quantizing kernel's first phase alone, waited for), the
/// executors exchange what they found through their communicator (a collective of every process of
/// the executor's communicator, at the start of refit_executor_run: the run waits for the caller's
/// work on the sources there), and every job quantizes with the maximum (refit_plan_stats and
/// refit_run_stats count these needs as any). Such a plan's executors need a communicator where
/// those devices lie in several processes (refit_executor_create_across; refit_executor_create
/// refuses with UNSUPPORTED). Otherwise planning fails with UNSUPPORTED naming the tensor (staging
/// on each receiver would give each its own amax). Planning also refuses
/// (INVALID_ARGUMENT) needs sharing an amax that quantize differently, per-row needs sharing a key
/// over other rows or with more than one matrix, a scale given two keys by different tables, and a
/// key on a place where no quantized need with elements writes a per-tensor scale or starts its
/// per-row scales.
///
/// Changes the table (see refit_table for threads). Giving a scale the key it has is accepted.
/// Errors: NULL_ARGUMENT (table), INVALID_ARGUMENT (key 0, scale 0, a scale this table already gave
/// another key).
#[no_mangle]
pub extern "C" fn refit_table_share_amax(
    table: *mut refit_table,
    rank: u32,
    scale: u64,
    key: u64,
) -> crate::Status {
    boundary("refit_table_share_amax", || {
        let table = live(table, "table")?;
        table.write()?.share_amax(plan::SharedAmax { process: rank, scale, key })?;
        Ok(())
    })
}
