//! Reshard planning: shard tables (built entry by entry or decoded from bytes), their wire
//! encoding, plans built from them, and reading a plan's stats, routes and segments.
//!
//! Thread-safety: a `refit_table` is used by one thread at a time (calls that only read it, such as
//! encode and plan build, may share it between threads when none modifies it). A `refit_plan` is
//! immutable once built and may be read from any number of threads at once.

use super::{arg, arg_mut, boundary, c_str, check_struct_size, destroy, out, sized_out, slice};
use crate::bail;
use crate::error::{Error, Result};
use crate::plan::{self, Endpoint, Need, Offer, OwnerPolicy, Plan, PlanOptions, Region, Table, TensorSpec};
use crate::segment::Segment;
use std::ffi::c_char;

/// Most dimensions a tensor may have.
pub const REFIT_MAX_DIMS: u32 = 8;
/// Owner policy: the replica of the lowest (rank, device) serves each replica set.
pub const REFIT_POLICY_FIRST: u32 = 0;
/// Owner policy: a replica on the receiver's device, else in its process (NVLink peer), else the first.
pub const REFIT_POLICY_LOCAL: u32 = 1;
/// Owner policy: spread bytes over replicas so that the busiest source serves as little as possible.
pub const REFIT_POLICY_BALANCED: u32 = 2;
/// Route kind: source and destination on the same rank and device.
pub const REFIT_ROUTE_LOCAL: u32 = 0;
/// Route kind: same rank, another device (a peer copy).
pub const REFIT_ROUTE_PEER: u32 = 1;
/// Route kind: another rank.
pub const REFIT_ROUTE_REMOTE: u32 = 2;
/// Buckets of refit_plan_stats.size_histogram.
pub const REFIT_PLAN_SIZE_BUCKETS: u32 = 64;

/// One rank's shard table: tensors, offers (what it publishes), needs (what it receives). Host memory
/// only; no table call touches a device or a stream.
///
/// Thread-safety: calls that change a table (refit_table_add_*) need it to themselves; calls that only
/// read it (refit_table_encoded_size, refit_table_encode, refit_plan_build) may share it between
/// threads while nothing changes it. Different tables are independent.
pub struct refit_table {
    table: Table,
}

/// A built reshard plan. Immutable: every reader may be called from any number of threads at once.
pub struct refit_plan {
    plan: Plan,
}

impl refit_table {
    /// The table, for exports of other areas that read one (src/ffi/comm.rs).
    pub(crate) fn table(&self) -> &Table {
        &self.table
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
    /// Join segments across boxes and tensors (default true; false only for A/B checks).
    pub coalesce: bool,
}

/// Counts of a plan or of one receiver's part of it. Before the call set `size` to
/// sizeof(refit_plan_stats). "Ranges" are contiguous runs; "segments" are strided refit_segments.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_plan_stats {
    /// sizeof(refit_plan_stats) as the caller knows it.
    pub size: usize,
    /// Offers in all tables.
    pub offers_in: u64,
    /// Offers chosen to serve at least one range.
    pub offers_kept: u64,
    /// Distinct boxes offered (replica sets).
    pub replica_sets: u64,
    /// Needs planned.
    pub needs: u64,
    /// Bytes the needs ask for, which is also the bytes the plan moves.
    pub needed_bytes: u64,
    /// Contiguous runs if every replica offer overlapping a need were read.
    pub ranges_all_replicas: u64,
    /// Bytes read if every replica offer overlapping a need were read.
    pub bytes_all_replicas: u64,
    /// bytes_all_replicas - needed_bytes.
    pub duplicate_bytes_dropped: u64,
    /// Contiguous runs with one owner per replica set, before coalescing.
    pub ranges_deduped: u64,
    /// Strided segments with one owner per replica set, before coalescing.
    pub segments_deduped: u64,
    /// Strided segments in the plan.
    pub ranges_coalesced: u64,
    /// Contiguous runs the plan's segments stand for.
    pub flat_runs_coalesced: u64,
    /// Bytes whose source is the receiving device.
    pub bytes_local: u64,
    /// Bytes from another device of the same rank.
    pub bytes_peer: u64,
    /// Bytes from another rank.
    pub bytes_remote: u64,
    /// (source, destination) endpoint pairs.
    pub routes: u64,
    /// Segments by payload: bucket i counts payloads in [2^i, 2^(i+1)) bytes (bucket 0 also 1 byte).
    pub size_histogram: [u64; 64],
    /// Wall time of the build, nanoseconds.
    pub build_ns: u64,
}

/// One route of a plan: every segment from one source endpoint to one destination endpoint.
/// Before the call set `size` to sizeof(refit_route_info).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_route_info {
    /// sizeof(refit_route_info) as the caller knows it.
    pub size: usize,
    pub src_rank: u32,
    pub src_device: u32,
    pub dst_rank: u32,
    pub dst_device: u32,
    /// REFIT_ROUTE_LOCAL, REFIT_ROUTE_PEER or REFIT_ROUTE_REMOTE.
    pub kind: u32,
    /// Number of segments.
    pub segment_count: usize,
    /// The segments, sorted by source address; owned by the plan, valid until refit_plan_destroy.
    pub segments: *const Segment,
}

/// Creates an empty table in `*table`. Thread-safe. Errors: NULL_ARGUMENT when `table` is NULL.
#[no_mangle]
pub extern "C" fn refit_table_create(table: *mut *mut refit_table) -> crate::Status {
    boundary("refit_table_create", || {
        let slot = out(table, "table")?;
        slot.write(Box::into_raw(Box::new(refit_table { table: Table::default() })));
        Ok(())
    })
}

/// Releases a table. NULL is accepted. Plans built from it are unaffected.
///
/// # Safety
/// `table` is NULL or a live table from refit_table_create / refit_table_decode, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn refit_table_destroy(table: *mut refit_table) {
    destroy(table, "refit_table_destroy")
}

/// Adds a tensor: `name` (NUL-terminated UTF-8), a caller-defined `dtype` code, `elem_size` bytes per
/// element, and its global `shape` of `ndim` dimensions. Writes its index in this table to `*index`.
/// Adding a name again returns the same index when the description agrees.
///
/// Not thread-safe for the same table. Errors: NULL_ARGUMENT (table, name, index; shape when
/// ndim > 0), INVALID_ARGUMENT (empty or
/// non-UTF-8 name, elem_size 0, ndim > REFIT_MAX_DIMS, size over 2^64 bytes), TENSOR_MISMATCH (the
/// name was added with another dtype, element size or shape; the message names both).
///
/// # Safety
/// `table` is a live table; `shape` points to `ndim` values.
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
        let table = arg_mut(table, "table")?;
        let slot = out(index, "index")?;
        let name = c_str(name, "name")?;
        let shape = dims(shape, ndim, "shape")?;
        let spec = TensorSpec { name: name.to_string(), dtype, elem_size, shape };
        slot.write(table.table.add_tensor(spec)?);
        Ok(())
    })
}

/// Adds an offer: this rank (`rank`, `device`) holds the box `offset`/`extent` (`ndim` values each,
/// global coordinates) of tensor `tensor` (an index from refit_table_add_tensor) at device address
/// `addr`, laid out with element `strides` (NULL: row-major over `extent`), with an optional
/// `digest` of its bytes (NULL: none). Offers of the same box are replicas.
///
/// Not thread-safe for the same table. Errors: NULL_ARGUMENT (table; offset/extent when ndim > 0),
/// INVALID_ARGUMENT (unknown tensor index, ndim above REFIT_MAX_DIMS, addresses past 2^64),
/// TENSOR_MISMATCH (ndim differing from the tensor's, box outside
/// the tensor).
///
/// # Safety
/// `table` is a live table; non-NULL arrays hold `ndim` values; `digest` is NULL or readable.
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
        let table = arg_mut(table, "table")?;
        let region = Region { offset: dims(offset, ndim, "offset")?, extent: dims(extent, ndim, "extent")? };
        let strides = if strides.is_null() { None } else { Some(dims(strides, ndim, "strides")?) };
        let digest = digest.as_ref().copied();
        let owner = Endpoint { rank, device };
        table.table.add_offer(Offer { tensor, owner, addr, region, strides, digest })
    })
}

/// Adds a need: receiver (`rank`, `device`) wants the box `offset`/`extent` (`ndim` values each,
/// global coordinates) of tensor `tensor` written at device address `addr` with destination element
/// `strides` (one per destination dimension). Destination dimension d is tensor dimension `perm[d]`
/// (`perm` NULL: the identity), so a transposed destination is a permutation. Several needs may
/// write disjoint parts of one buffer (fused parameters).
///
/// Not thread-safe for the same table. Errors: NULL_ARGUMENT (table, strides; offset/extent when
/// ndim > 0), INVALID_ARGUMENT (unknown tensor index, ndim above REFIT_MAX_DIMS, perm not a
/// permutation, addresses past 2^64), TENSOR_MISMATCH (ndim differing from the tensor's, box outside
/// the tensor). Overlapping destinations are found when the plan is built.
///
/// # Safety
/// `table` is a live table; non-NULL arrays hold `ndim` values.
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
        let table = arg_mut(table, "table")?;
        if strides.is_null() {
            return Err(Error::new(crate::Status::NullArgument, "strides is NULL"));
        }
        let region = Region { offset: dims(offset, ndim, "offset")?, extent: dims(extent, ndim, "extent")? };
        let strides = dims(strides, ndim, "strides")?;
        let perm = if perm.is_null() { None } else { Some(slice(perm, ndim, "perm")?.to_vec()) };
        let receiver = Endpoint { rank, device };
        table.table.add_need(Need { tensor, receiver, addr, region, perm, strides })
    })
}

/// Writes to `*size` the bytes refit_table_encode needs for this table. Reads the table (see
/// refit_table for sharing it between threads). Errors: NULL_ARGUMENT (table, size).
///
/// # Safety
/// `table` is a live table.
#[no_mangle]
pub unsafe extern "C" fn refit_table_encoded_size(
    table: *const refit_table,
    size: *mut usize,
) -> crate::Status {
    boundary("refit_table_encoded_size", || {
        let table = arg(table, "table")?;
        let slot = out(size, "size")?;
        slot.write(plan::wire::encode(&table.table).len());
        Ok(())
    })
}

/// Encodes the table (versioned, checksummed; see refit_table_decode) into `buffer` of `capacity`
/// bytes and writes the length used to `*written`. The encoding is the same on every platform. Reads
/// the table (see refit_table for sharing it between threads).
///
/// Errors: NULL_ARGUMENT (table, written; buffer when capacity > 0), BUFFER_TOO_SMALL (capacity
/// below refit_table_encoded_size; the message gives the size).
///
/// # Safety
/// `table` is a live table; `buffer` is writable for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn refit_table_encode(
    table: *const refit_table,
    buffer: *mut u8,
    capacity: usize,
    written: *mut usize,
) -> crate::Status {
    boundary("refit_table_encode", || {
        let table = arg(table, "table")?;
        let slot = out(written, "written")?;
        let bytes = plan::wire::encode(&table.table);
        if capacity < bytes.len() {
            bail!(
                crate::Status::BufferTooSmall,
                "the encoded table takes {} bytes; capacity is {capacity}",
                bytes.len()
            );
        }
        if buffer.is_null() {
            return Err(Error::new(crate::Status::NullArgument, "buffer is NULL"));
        }
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer, bytes.len());
        slot.write(bytes.len());
        Ok(())
    })
}

/// Decodes `len` bytes written by refit_table_encode (on any rank) into a new table in `*table`.
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
        slot.write(Box::into_raw(Box::new(refit_table { table: decoded })));
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
            coalesce: true,
        });
        Ok(())
    })
}

/// Builds the plan that moves every byte the tables' needs ask for exactly once, from one owner per
/// replica set, as the fewest strided segments; writes it to `*plan`. `tables` holds `count` tables
/// (every rank's, in any order: the plan is the same). `options` NULL means the defaults. Runs on
/// the calling thread; touches no device.
///
/// Errors: NULL_ARGUMENT (plan; tables when count > 0; a NULL entry), INVALID_ARGUMENT (options.size
/// or policy out of range; bad entries of decoded tables), TENSOR_MISMATCH (a tensor described
/// differently by two tables: the message names it and both values), REPLICA_MISMATCH (replicas
/// with different digests), COVERAGE_GAP (the message names the first region no offer covers),
/// OVERLAP (two destination bytes written twice), OUT_OF_MEMORY / UNSUPPORTED (pathological tables
/// beyond the planner's limits).
///
/// # Safety
/// `tables` points to `count` live tables not modified during the call.
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
        let pointers = slice(tables, count, "tables")?;
        let mut borrowed = Vec::with_capacity(pointers.len());
        for (i, &t) in pointers.iter().enumerate() {
            borrowed.push(&arg(t, &format!("tables[{i}]"))?.table);
        }
        let built = plan::build_from(&borrowed, &options, &plan::Limits::default())?;
        slot.write(Box::into_raw(Box::new(refit_plan { plan: built })));
        Ok(())
    })
}

/// Releases a plan. NULL is accepted. Segment pointers read from it become invalid.
///
/// # Safety
/// `plan` is NULL or a live plan, not used afterwards by any thread.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_destroy(plan: *mut refit_plan) {
    destroy(plan, "refit_plan_destroy")
}

/// Writes the whole plan's counts to `*stats`; set stats->size to sizeof(refit_plan_stats) first.
/// Thread-safe. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (stats->size).
///
/// # Safety
/// `plan` is a live plan; `stats` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_get_stats(
    plan: *const refit_plan,
    stats: *mut refit_plan_stats,
) -> crate::Status {
    boundary("refit_plan_get_stats", || {
        let plan = arg(plan, "plan")?;
        write_stats(plan.plan.stats(), stats)
    })
}

/// Writes the counts of receiver (`rank`, `device`)'s needs and the routes into it to `*stats` (zero
/// but the shared input counts when that endpoint needs nothing); set stats->size first.
/// Thread-safe. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (stats->size).
///
/// # Safety
/// `plan` is a live plan; `stats` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_get_receiver_stats(
    plan: *const refit_plan,
    rank: u32,
    device: u32,
    stats: *mut refit_plan_stats,
) -> crate::Status {
    boundary("refit_plan_get_receiver_stats", || {
        let plan = arg(plan, "plan")?;
        write_stats(&plan.plan.receiver_stats(Endpoint { rank, device }), stats)
    })
}

/// Writes the plan's fingerprint to `*fingerprint`: equal for the same tables in any order, in any
/// process; ranks compare it to agree on one plan. Thread-safe. Errors: NULL_ARGUMENT.
///
/// # Safety
/// `plan` is a live plan.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_fingerprint(
    plan: *const refit_plan,
    fingerprint: *mut u64,
) -> crate::Status {
    boundary("refit_plan_fingerprint", || {
        let plan = arg(plan, "plan")?;
        out(fingerprint, "fingerprint")?.write(plan.plan.fingerprint());
        Ok(())
    })
}

/// Writes the number of routes to `*count`. Routes are ordered by destination endpoint, then local,
/// peer, remote, then source endpoint. Thread-safe. Errors: NULL_ARGUMENT.
///
/// # Safety
/// `plan` is a live plan.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_route_count(plan: *const refit_plan, count: *mut usize) -> crate::Status {
    boundary("refit_plan_route_count", || {
        let plan = arg(plan, "plan")?;
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
/// `plan` is a live plan; `route` is writable.
#[no_mangle]
pub unsafe extern "C" fn refit_plan_route(
    plan: *const refit_plan,
    index: usize,
    route: *mut refit_route_info,
) -> crate::Status {
    boundary("refit_plan_route", || {
        let plan = arg(plan, "plan")?;
        let slot = sized_out(route, "route")?;
        let routes = plan.plan.routes();
        let r = routes.get(index).ok_or_else(|| {
            Error::new(
                crate::Status::NotFound,
                format!("route {index} but the plan has {} routes", routes.len()),
            )
        })?;
        slot.write(refit_route_info {
            size: std::mem::size_of::<refit_route_info>(),
            src_rank: r.src.rank,
            src_device: r.src.device,
            dst_rank: r.dst.rank,
            dst_device: r.dst.device,
            kind: r.kind() as u32,
            segment_count: r.segments.len(),
            segments: r.segments.as_ptr(),
        });
        Ok(())
    })
}

/// A caller array of dimensions, at most REFIT_MAX_DIMS long.
unsafe fn dims(ptr: *const u64, ndim: usize, what: &str) -> Result<Vec<u64>> {
    if ndim > plan::MAX_DIMS {
        bail!(crate::Status::InvalidArgument, "ndim is {ndim}; at most {} dimensions", plan::MAX_DIMS);
    }
    Ok(slice(ptr, ndim, what)?.to_vec())
}

pub(crate) unsafe fn plan_options(options: *const refit_plan_options) -> Result<PlanOptions> {
    let Some(options) = options.as_ref() else {
        return Ok(PlanOptions::default());
    };
    let full = std::mem::size_of::<refit_plan_options>();
    check_struct_size(options.size, full, full, "options")?;
    let policy = match options.policy {
        REFIT_POLICY_FIRST => OwnerPolicy::First,
        REFIT_POLICY_LOCAL => OwnerPolicy::Local,
        REFIT_POLICY_BALANCED => OwnerPolicy::Balanced,
        other => bail!(
            crate::Status::InvalidArgument,
            "options.policy is {other}; expected REFIT_POLICY_FIRST, _LOCAL or _BALANCED"
        ),
    };
    Ok(PlanOptions { policy, coalesce: options.coalesce })
}

unsafe fn write_stats(s: &plan::PlanStats, stats: *mut refit_plan_stats) -> Result<()> {
    let slot = sized_out(stats, "stats")?;
    slot.write(refit_plan_stats {
        size: std::mem::size_of::<refit_plan_stats>(),
        offers_in: s.offers_in,
        offers_kept: s.offers_kept,
        replica_sets: s.replica_sets,
        needs: s.needs,
        needed_bytes: s.needed_bytes,
        ranges_all_replicas: s.ranges_all_replicas,
        bytes_all_replicas: s.bytes_all_replicas,
        duplicate_bytes_dropped: s.duplicate_bytes_dropped,
        ranges_deduped: s.ranges_deduped,
        segments_deduped: s.segments_deduped,
        ranges_coalesced: s.ranges_coalesced,
        flat_runs_coalesced: s.flat_runs_coalesced,
        bytes_local: s.bytes_local,
        bytes_peer: s.bytes_peer,
        bytes_remote: s.bytes_remote,
        routes: s.routes,
        size_histogram: s.size_histogram,
        build_ns: s.build_ns,
    });
    Ok(())
}
