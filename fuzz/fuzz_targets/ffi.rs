//! The C ABI driven by arbitrary bytes, as a hostile C caller would drive it on the host backend:
//! each input is a sequence of calls on a small pool of handles (tables, plans, groups, executors,
//! prepared copies; quantized needs and quantizing copies among the calls), with arguments mostly
//! small and sometimes extreme, and with handles that are live, destroyed, of another type, NULL or
//! made up. Every address the caller names lies in one arena, and calls that would move bytes run
//! only when every byte they name does: the library writes where the caller says, so a caller
//! naming memory it does not own is the caller's bug, not one this target looks for.
//!
//! Never a crash (the target is built with AddressSanitizer), never REFIT_STATUS_INTERNAL_ERROR (a
//! panic the boundary caught: a bug), and every failure leaves a message.
#![no_main]

#[path = "bytes.rs"]
mod bytes;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use refit::ffi::copy::{
    refit_copy_batch, refit_copy_batch_destroy, refit_copy_batch_launch, refit_copy_batch_prepare,
    refit_prepared_copy,
};
use refit::ffi::digest::refit_digest;
use refit::ffi::exec::{
    refit_executor, refit_executor_commit, refit_executor_create, refit_executor_destroy,
    refit_executor_options, refit_executor_options_init, refit_executor_rebind, refit_executor_run,
    refit_executor_stats,
};
use refit::ffi::group::{
    refit_group, refit_group_create, refit_group_destroy, refit_group_enter, refit_group_exit,
    refit_group_options, refit_group_options_init, refit_group_size, REFIT_BACKEND_HOST,
};
use refit::ffi::plan::{
    refit_need_quantization, refit_plan, refit_plan_build, refit_plan_build_share, refit_plan_destroy,
    refit_plan_fingerprint, refit_plan_options, refit_plan_options_init, refit_plan_quant_route,
    refit_plan_quant_route_count, refit_plan_route, refit_plan_route_count, refit_quant_route_info,
    refit_route_info, refit_table, refit_table_add_need, refit_table_add_offer, refit_table_add_quantized_need,
    refit_table_add_tensor, refit_table_create, refit_table_decode, refit_table_destroy, refit_table_encode,
    refit_table_share_amax,
};
use refit::ffi::quantize::{refit_quantization, refit_quantize_batch, refit_quantize_job};
use refit::ffi::status::refit_last_error_message;
use refit::{Segment, Status};
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::ptr::{null, null_mut};

/// Bytes of the arena every caller address lies in.
const ARENA: u64 = 1 << 16;

/// The handles of one input, and the values of those it destroyed.
#[derive(Default)]
struct Pool {
    tables: Vec<*mut refit_table>,
    plans: Vec<*mut refit_plan>,
    groups: Vec<*mut refit_group>,
    /// With whether every byte its plan names lies in the arena (only those run).
    executors: Vec<(*mut refit_executor, bool)>,
    batches: Vec<*mut refit_prepared_copy>,
    destroyed: Vec<usize>,
    /// By table: what its quantized needs and offers may make a quantizing job touch.
    facts: HashMap<usize, TableFacts>,
    /// Plans whose quantizing jobs may touch memory outside the arena (their executors never run).
    wild: HashSet<usize>,
}

/// What a table's entries may make a quantizing job touch. The library's plan does not say where
/// its jobs read and write (refit_quant_route_info gives counts), so the caller's own entries
/// decide: any quantized need with any offer or quantized need not inside the arena, in the tables
/// of one plan, keeps that plan's executors from running.
#[derive(Clone, Copy, Default)]
struct TableFacts {
    quantized: bool,
    outside: bool,
}

impl Pool {
    fn every_live(&self) -> Vec<usize> {
        let mut all: Vec<usize> = self.tables.iter().map(|&h| h as usize).collect();
        all.extend(self.plans.iter().map(|&h| h as usize));
        all.extend(self.groups.iter().map(|&h| h as usize));
        all.extend(self.executors.iter().map(|&(h, _)| h as usize));
        all.extend(self.batches.iter().map(|&h| h as usize));
        all
    }

    /// A handle for an argument of type `T`: mostly one of `live`, else NULL, a destroyed one, one of
    /// another type, or a made-up value.
    fn pick<T>(&self, input: &mut Bytes, live: &[*mut T], arena: u64) -> *mut T {
        let choice = input.byte();
        let value = match choice {
            0..=199 if !live.is_empty() => live[usize::from(choice) % live.len()] as usize,
            200..=209 => 0,
            210..=229 if !self.destroyed.is_empty() => {
                self.destroyed[usize::from(choice) % self.destroyed.len()]
            }
            230..=249 if !self.every_live().is_empty() => {
                let all = self.every_live();
                all[usize::from(choice) % all.len()]
            }
            _ => [16, arena as usize, usize::MAX & !15][usize::from(choice) % 3],
        };
        value as *mut T
    }
}

/// The status of a call: never INTERNAL_ERROR, and a failure has a message.
fn check(status: Status) -> Status {
    // SAFETY: the library returns a NUL-terminated string valid until this thread's next call.
    let message = unsafe { CStr::from_ptr(refit_last_error_message()) }.to_string_lossy().into_owned();
    assert_ne!(status, Status::InternalError, "a panic reached the boundary: {message}");
    if status != Status::Success {
        assert!(!message.is_empty(), "{status:?} without a message");
    }
    status
}

/// Whether every byte `segment` reads and writes lies in [base, base + ARENA).
fn in_arena(segment: &Segment, base: u64) -> bool {
    let side = |first: u64, strides: [u64; 2]| -> bool {
        if segment.len == 0 || segment.count[0] == 0 || segment.count[1] == 0 {
            return true;
        }
        let last = (segment.count[0] - 1)
            .checked_mul(strides[0])
            .zip((segment.count[1] - 1).checked_mul(strides[1]))
            .and_then(|(a, b)| a.checked_add(b))
            .and_then(|span| span.checked_add(segment.len - 1))
            .and_then(|span| first.checked_add(span));
        first >= base && last.is_some_and(|last| last < base + ARENA)
    };
    side(segment.src, segment.src_stride) && side(segment.dst, segment.dst_stride)
}

/// Whether `segment` carries bytes from or to the first page, where the library refuses every
/// address (a batch or an executor naming one is INVALID_ARGUMENT before any byte moves).
fn in_first_page(segment: &Segment) -> bool {
    segment.len > 0 && segment.count[0] > 0 && segment.count[1] > 0 && (segment.src < 4096 || segment.dst < 4096)
}

/// Whether every segment of every route of `plan` lies in the arena (false when it cannot be read).
fn plan_in_arena(plan: *mut refit_plan, base: u64) -> bool {
    plan_all(plan, |s| in_arena(s, base))
}

/// Whether every segment of every route of `plan` satisfies `good` (false when it cannot be read).
fn plan_all(plan: *mut refit_plan, good: impl Fn(&Segment) -> bool) -> bool {
    let mut count = 0;
    // SAFETY: a valid output slot.
    if unsafe { refit_plan_route_count(plan, &mut count) } != Status::Success {
        return false;
    }
    (0..count).all(|i| {
        // SAFETY: zeroed plain data; the library fills it, its segments valid until the plan goes.
        let mut route: refit_route_info = unsafe { std::mem::zeroed() };
        route.size = std::mem::size_of::<refit_route_info>();
        // SAFETY: a valid output slot.
        if unsafe { refit_plan_route(plan, i, &mut route) } != Status::Success {
            return false;
        }
        // SAFETY: `segment_count` segments, owned by the live plan.
        let segments = unsafe { std::slice::from_raw_parts(route.segments, route.segment_count) };
        segments.iter().all(&good)
    })
}

fn segment(input: &mut Bytes, base: u64) -> Segment {
    let address = |input: &mut Bytes| match input.byte() % 16 {
        0 => 0,
        _ => base + input.small(256) * 64 + input.small(64),
    };
    let (src, dst) = (address(input), address(input));
    Segment {
        src,
        dst,
        len: input.value(512),
        count: [input.value(8), input.value(4)],
        src_stride: [input.value(1024), input.value(8192)],
        dst_stride: [input.value(1024), input.value(8192)],
    }
}

fn executor_options(input: &mut Bytes) -> refit_executor_options {
    // SAFETY: plain data, filled by the library.
    let mut options: refit_executor_options = unsafe { std::mem::zeroed() };
    check(refit_executor_options_init(&mut options));
    options.arm = input.value(4) as u32;
    options.sm_budget = input.value(3) as u32;
    options.verify = input.byte() % 2 == 0;
    options.commit = input.value(3) as u32;
    options.staging_limit = [0, 4096, 5000, 1 << 20, 1][usize::from(input.byte() % 5)];
    options
}

/// Runs one call chosen by the next byte.
fn step(input: &mut Bytes, pool: &mut Pool, base: u64) {
    let op = input.byte() % 20;
    match op {
        0 => {
            let mut table = null_mut();
            // SAFETY: a valid output slot.
            if check(refit_table_create(&mut table)) == Status::Success {
                pool.tables.push(table);
            }
        }
        1 => {
            let table = pool.pick(input, &pool.tables, base);
            let ndim = (input.byte() % 4) as usize;
            let shape: Vec<u64> = (0..ndim).map(|_| input.value(9)).collect();
            let name = [c"w", c"v", c"", c"layers.0.mlp"][usize::from(input.byte() % 4)];
            let elem_size = [1, 2, 4, 0, 3][usize::from(input.byte() % 5)];
            let mut index = 0;
            // SAFETY: `shape` holds `ndim` values; valid output slot.
            check(unsafe {
                refit_table_add_tensor(table, name.as_ptr(), 7, elem_size, shape.as_ptr(), ndim, &mut index)
            });
        }
        2 | 3 => {
            let table = pool.pick(input, &pool.tables, base);
            let (tensor, rank, device) = (input.value(3) as u32, input.value(2) as u32, input.value(3) as u32);
            let addr = if input.byte() % 16 == 0 { 0 } else { base + input.small(128) * 256 };
            let ndim = (input.byte() % 4) as usize;
            let (offset, extent, strides) = (input.list(ndim, 4), input.list(ndim, 9), input.list(ndim, 64));
            let with_strides = input.byte() % 2 == 0;
            let strides_ptr = if with_strides { strides.as_ptr() } else { null() };
            // SAFETY: every array holds `ndim` values.
            if op == 2 {
                let digest = input.value(2);
                let digest_ptr = if input.byte() % 2 == 0 { &digest as *const u64 } else { null() };
                // Dense offers are row-major over their box; elements are at most 4 bytes.
                let dense = dense_strides(&extent);
                let inside = within(base, addr, &extent, if with_strides { &strides } else { &dense }, 4);
                let added = check(unsafe {
                    refit_table_add_offer(
                        table,
                        tensor,
                        rank,
                        device,
                        addr,
                        offset.as_ptr(),
                        extent.as_ptr(),
                        strides_ptr,
                        ndim,
                        digest_ptr,
                    )
                });
                if added == Status::Success && !inside {
                    pool.facts.entry(table as usize).or_default().outside = true;
                }
            } else {
                let perm: Vec<u32> = (0..ndim as u32).map(|d| (d + u32::from(input.byte() % 2)) % ndim as u32).collect();
                let perm_ptr = if input.byte() % 2 == 0 { perm.as_ptr() } else { null() };
                check(unsafe {
                    refit_table_add_need(
                        table,
                        tensor,
                        rank,
                        device,
                        addr,
                        offset.as_ptr(),
                        extent.as_ptr(),
                        perm_ptr,
                        strides_ptr,
                        ndim,
                    )
                });
            }
        }
        4 | 5 => {
            let count = usize::from(input.byte() % 3);
            let tables: Vec<*const refit_table> =
                (0..count).map(|_| pool.pick(input, &pool.tables, base) as *const refit_table).collect();
            // SAFETY: plain data, filled by the library.
            let mut options: refit_plan_options = unsafe { std::mem::zeroed() };
            check(refit_plan_options_init(&mut options));
            options.policy = input.value(4) as u32;
            options.coalesce = input.value(3) as u8;
            let mut plan = null_mut();
            // SAFETY: `tables` holds `count` entries; valid options and output slot.
            let status = check(unsafe {
                if op == 4 {
                    refit_plan_build(tables.as_ptr(), count, &options, &mut plan)
                } else {
                    refit_plan_build_share(tables.as_ptr(), count, input.value(3) as u32, &options, &mut plan)
                }
            });
            if status == Status::Success {
                let facts = tables.iter().map(|&t| pool.facts.get(&(t as usize)).copied().unwrap_or_default());
                let (quantized, outside) = facts.fold((false, false), |(q, o), f| (q || f.quantized, o || f.outside));
                if quantized && outside {
                    pool.wild.insert(plan as usize);
                }
                pool.plans.push(plan);
            }
        }
        6 => {
            let plan = pool.pick(input, &pool.plans, base);
            let mut fingerprint = 0;
            // SAFETY: a valid output slot.
            check(unsafe { refit_plan_fingerprint(plan, &mut fingerprint) });
            plan_in_arena(plan, base);
            let mut count = 0;
            // SAFETY: valid output slots; `route.size` says how much to fill.
            if unsafe { refit_plan_quant_route_count(plan, &mut count) } == Status::Success {
                for i in 0..count + 1 {
                    let mut route: refit_quant_route_info = unsafe { std::mem::zeroed() };
                    let full = std::mem::size_of::<refit_quant_route_info>();
                    route.size = full - 8 * usize::from(input.byte() % 2);
                    // A size other than the struct's is refused (INVALID_ARGUMENT), as an index past the count is.
                    let fits = route.size == full;
                    let status = check(unsafe { refit_plan_quant_route(plan, i, &mut route) });
                    assert_eq!(status == Status::Success, i < count && fits, "quantized route {i} of {count}, fitting size {fits}");
                }
            }
        }
        7 => {
            let table = pool.pick(input, &pool.tables, base);
            let mut buffer = vec![0u8; input.value(4096) as usize % 4097];
            let mut written = 0;
            // SAFETY: `buffer` holds its length in bytes.
            let status = check(unsafe { refit_table_encode(table, buffer.as_mut_ptr(), buffer.len(), &mut written) });
            if status == Status::Success {
                let encoded = buffer[..written].to_vec();
                // Flip one byte now and then: decoding must refuse it or yield a table.
                if input.byte() % 2 == 0 && written > 0 {
                    let at = usize::from(input.byte()) % written;
                    buffer[at] ^= 1 << (input.byte() % 8);
                }
                let mut decoded = null_mut();
                // SAFETY: `written` readable bytes; valid output slot.
                if check(unsafe { refit_table_decode(buffer.as_ptr(), written, &mut decoded) }) == Status::Success {
                    // A flipped byte may have moved an address anywhere.
                    let mut facts = pool.facts.get(&(table as usize)).copied().unwrap_or_default();
                    facts.outside |= buffer[..written] != encoded[..];
                    facts.quantized = true;
                    pool.facts.insert(decoded as usize, facts);
                    pool.tables.push(decoded);
                }
            }
        }
        8 => {
            let devices = [0i32, 1];
            let n = 1 + usize::from(input.byte() % 2);
            // SAFETY: plain data, filled by the library.
            let mut options: refit_group_options = unsafe { std::mem::zeroed() };
            check(refit_group_options_init(&mut options));
            options.backend = REFIT_BACKEND_HOST;
            let mut group = null_mut();
            if check(refit_group_create(devices.as_ptr(), n, &options, &mut group)) == Status::Success {
                pool.groups.push(group);
            }
        }
        9 => {
            let plan = pool.pick(input, &pool.plans, base);
            let group = pool.pick(input, &pool.groups, base);
            let options = executor_options(input);
            let mut executor = null_mut();
            let status = check(refit_executor_create(plan, group, input.value(3) as u32, &options, &mut executor));
            if status == Status::Success {
                // The executor checked every address once: none of its plan's is in the first page.
                assert!(plan_all(plan, |s| !in_first_page(s)), "an executor was made over the first page");
                pool.executors.push((executor, plan_in_arena(plan, base) && !pool.wild.contains(&(plan as usize))));
            }
        }
        10 | 11 => {
            let group = pool.pick(input, &pool.groups, base);
            let Some(&(executor, runnable)) = pool.executors.get(usize::from(input.byte()) % pool.executors.len().max(1))
            else {
                return;
            };
            if runnable {
                let run = if op == 10 { refit_executor_run } else { refit_executor_commit };
                check(run(executor, group, null_mut()));
            }
        }
        12 => {
            let executor = pool.pick(input, &pool.executors.iter().map(|&(e, _)| e).collect::<Vec<_>>(), base);
            // Moving bytes within the arena keeps every later run inside it.
            let length = input.value(4096);
            let (old, new) = (base + input.small(256) * 256, base + input.small(256) * 256);
            if new.saturating_add(length) <= base + ARENA {
                check(refit_executor_rebind(executor, input.value(3) as u32, old, new, length));
            }
        }
        13 => {
            let executor = pool.pick(input, &pool.executors.iter().map(|&(e, _)| e).collect::<Vec<_>>(), base);
            // SAFETY: plain data.
            let mut stats = unsafe { std::mem::zeroed() };
            check(refit_executor_stats(executor, &mut stats));
        }
        14 => {
            let group = pool.pick(input, &pool.groups, base);
            let segments: Vec<Segment> = (0..input.byte() % 4).map(|_| segment(input, base)).collect();
            // A segment in the first page makes the library refuse the whole batch before any copy.
            let refused = segments.iter().any(in_first_page);
            let safe = refused || segments.iter().all(|s| in_arena(s, base) || s.src == 0 || s.dst == 0);
            if !safe {
                return;
            }
            let (rank, flags) = (input.value(3) as u32, input.value(3) as u32);
            if input.byte() % 2 == 0 {
                let status = check(refit_copy_batch(group, rank, null_mut(), segments.as_ptr(), segments.len(), flags));
                assert!(!(refused && status == Status::Success), "a batch over the first page copied");
            } else {
                let mut batch = null_mut();
                let status =
                    check(refit_copy_batch_prepare(group, rank, segments.as_ptr(), segments.len(), flags, &mut batch));
                assert!(!(refused && status == Status::Success), "a batch over the first page was prepared");
                if status == Status::Success {
                    check(refit_copy_batch_launch(batch, null_mut()));
                    pool.batches.push(batch);
                }
            }
        }
        15 => {
            let group = pool.pick(input, &pool.groups, base);
            let (offset, len) = (input.small(256) * 256, input.small(256) * 64);
            let addr = if input.byte() % 8 == 0 { 0 } else { base + offset };
            if addr == 0 || offset + len <= ARENA {
                let mut digest = 0;
                check(refit_digest(group, input.value(3) as u32, addr, len, null_mut(), &mut digest));
            }
        }
        16 => {
            let group = pool.pick(input, &pool.groups, base);
            let mut size = 0;
            check(refit_group_size(group, &mut size));
            if input.byte() % 2 == 0 {
                check(refit_group_enter(group, null()));
            } else {
                check(refit_group_exit(group, input.value(3) as u32));
            }
        }
        17 => add_quantized_need(input, pool, base),
        18 => quantize_batch(input, pool, base),
        _ => destroy_one(input, pool, base),
    }
}

/// Row-major element strides of a box of extents `extent`.
fn dense_strides(extent: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; extent.len()];
    let mut step = 1u64;
    for d in (0..extent.len()).rev() {
        strides[d] = step;
        step = step.saturating_mul(extent[d]);
    }
    strides
}

/// Whether every element of the box of `extent` at `addr` (element strides `strides`, `size`-byte
/// elements) lies in the arena; an empty box touches nothing.
fn within(base: u64, addr: u64, extent: &[u64], strides: &[u64], size: u64) -> bool {
    if extent.contains(&0) {
        return true;
    }
    let last = extent.iter().zip(strides).try_fold(0u64, |sum, (&e, &s)| (e - 1).checked_mul(s)?.checked_add(sum));
    let end = last.and_then(|l| l.checked_add(1)?.checked_mul(size)?.checked_add(addr));
    addr >= base && end.is_some_and(|end| end <= base + ARENA)
}

/// A quantization of every kind, mostly valid.
fn quantization(input: &mut Bytes) -> refit_quantization {
    let granularity = input.value(6) as u32;
    let (block_rows, block_cols) = match granularity {
        3 => [(1, 8), (2, 16), (128, 128), (input.value(5) as u32, input.value(20) as u32)][usize::from(input.byte() % 4)],
        _ if input.byte() % 8 == 0 => (1, 8),
        _ => (0, 0),
    };
    refit_quantization { target: (input.value(3) as u32).wrapping_add(1), granularity, block_rows, block_cols }
}

/// Adds a quantized need to a table, its codes, scales and staging mostly in the arena.
fn add_quantized_need(input: &mut Bytes, pool: &mut Pool, base: u64) {
    let table = pool.pick(input, &pool.tables, base);
    let (tensor, rank, device) = (input.value(3) as u32, input.value(2) as u32, input.value(3) as u32);
    let addr = if input.byte() % 16 == 0 { 0 } else { base + input.small(128) * 256 };
    let ndim = (input.byte() % 4) as usize;
    let (offset, extent) = (input.list(ndim, 4), input.list(ndim, 9));
    let strides = if input.byte() % 4 == 0 { input.list(ndim, 64) } else { dense_strides(&extent) };
    let place = |input: &mut Bytes, align: u64| match input.byte() % 16 {
        0 => 0,
        1 => input.value(64),
        _ => base + input.small(256) * 256 + input.small(16) * align,
    };
    let need = refit_need_quantization {
        quantization: quantization(input),
        source_type: input.value(4) as u32,
        arithmetic: input.value(5) as u32,
        scales: place(input, 4),
        scale_row_stride: input.value(8),
        scale_matrix_stride: input.value(64),
        staging: if input.byte() % 2 == 0 { 0 } else { place(input, 16) },
    };
    // Where the need may write: its codes, its scale grids (at most one scale per element and
    // per row, matrix strides apart) and its staging (at most 4 bytes per element).
    let (rows, cols) = match ndim {
        0 => (1, 1),
        1 => (1, extent[0]),
        _ => (extent[ndim - 2], extent[ndim - 1]),
    };
    let matrices = extent[..ndim.saturating_sub(2)].iter().fold(1u64, |m, &e| m.saturating_mul(e));
    let grid = [matrices, rows, cols];
    let grid_strides = [need.scale_matrix_stride, need.scale_row_stride, 1];
    let volume = extent.iter().fold(1u64, |v, &e| v.saturating_mul(e));
    let inside = within(base, addr, &extent, &strides, 1)
        && within(base, need.scales, &grid, &grid_strides, 4)
        && (need.staging == 0 || within(base, need.staging, &[volume], &[1], 4));
    let quantization = if input.byte() % 16 == 0 { null() } else { &need as *const refit_need_quantization };
    let strides_ptr = if input.byte() % 16 == 0 { null() } else { strides.as_ptr() };
    // SAFETY: every array holds `ndim` values; `quantization` NULL or readable.
    let status = check(unsafe {
        refit_table_add_quantized_need(
            table,
            tensor,
            rank,
            device,
            addr,
            offset.as_ptr(),
            extent.as_ptr(),
            strides_ptr,
            ndim,
            quantization,
        )
    });
    if status == Status::Success {
        let facts = pool.facts.entry(table as usize).or_default();
        facts.quantized = true;
        facts.outside |= !inside;
    }
    // An amax key on this need's scale (or on an address in the arena), key 0 sometimes (refused).
    if input.byte() % 2 == 0 {
        let scale = if input.byte() % 4 == 0 { base + input.small(256) * 4 } else { need.scales };
        check(refit_table_share_amax(table, rank, scale, input.value(2)));
    }
}

/// A quantizing copy of up to three jobs over the arena (some sharing a scale), run only when every
/// byte they name is in the arena.
fn quantize_batch(input: &mut Bytes, pool: &mut Pool, base: u64) {
    let group = pool.pick(input, &pool.groups, base);
    let shared = base + input.small(64) * 4;
    let jobs: Vec<refit_quantize_job> = (0..input.byte() % 4)
        .map(|_| {
            let (rows, cols) = (input.value(9), input.value(5).saturating_mul(8).saturating_add(input.value(2)));
            let row = cols.checked_next_multiple_of(8).unwrap_or(u64::MAX);
            let at = |input: &mut Bytes, align: u64| base + input.small(256) * 256 + input.small(16) * align;
            refit_quantize_job {
                quantization: quantization(input),
                source_type: (input.value(3) as u32).wrapping_add(1),
                arithmetic: input.value(5) as u32,
                src: at(input, 16),
                rows,
                cols,
                src_row_stride: row.saturating_add(input.value(3).saturating_mul(8)),
                dst: at(input, 8),
                dst_row_stride: row,
                scales: if input.byte() % 3 == 0 { shared } else { at(input, 4) },
                scale_row_stride: input.value(8),
            }
        })
        .collect();
    let inside = jobs.iter().all(|j| {
        // Sources read whole 16-byte vectors: up to 15 bytes past a row's end (4-byte elements).
        within(base, j.src, &[j.rows, j.cols.saturating_add(4)], &[j.src_row_stride, 1], 4)
            && within(base, j.dst, &[j.rows, j.cols], &[j.dst_row_stride, 1], 1)
            && within(base, j.scales, &[j.rows, j.cols], &[j.scale_row_stride, 1], 4)
    });
    if inside {
        let flags = u32::from(input.byte() % 8 == 0);
        // SAFETY: `jobs` holds its length; every byte it names is the arena's.
        check(refit_quantize_batch(group, input.value(3) as u32, null_mut(), jobs.as_ptr(), jobs.len(), flags));
    }
}

/// Destroys a handle picked like any argument: live, or destroyed already, or of another type, or
/// made up (those release nothing).
fn destroy_one(input: &mut Bytes, pool: &mut Pool, base: u64) {
    /// Forgets `handle` if it was live in `live` (a destroy of any other value released nothing).
    fn forget<T>(live: &mut Vec<T>, destroyed: &mut Vec<usize>, handle: usize, value: impl Fn(&T) -> usize) {
        let before = live.len();
        live.retain(|h| value(h) != handle);
        if live.len() < before {
            destroyed.push(handle);
        }
    }
    match input.byte() % 5 {
        0 => {
            let h = pool.pick(input, &pool.tables, base);
            refit_table_destroy(h);
            forget(&mut pool.tables, &mut pool.destroyed, h as usize, |&t| t as usize);
        }
        1 => {
            let h = pool.pick(input, &pool.plans, base);
            refit_plan_destroy(h);
            forget(&mut pool.plans, &mut pool.destroyed, h as usize, |&p| p as usize);
        }
        2 => {
            let h = pool.pick(input, &pool.groups, base);
            refit_group_destroy(h);
            forget(&mut pool.groups, &mut pool.destroyed, h as usize, |&g| g as usize);
        }
        3 => {
            let live: Vec<_> = pool.executors.iter().map(|&(e, _)| e).collect();
            let h = pool.pick(input, &live, base);
            refit_executor_destroy(h);
            forget(&mut pool.executors, &mut pool.destroyed, h as usize, |&(e, _)| e as usize);
        }
        _ => {
            let h = pool.pick(input, &pool.batches, base);
            refit_copy_batch_destroy(h);
            forget(&mut pool.batches, &mut pool.destroyed, h as usize, |&b| b as usize);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // Refusals are logged (a destroy cannot return a status); millions of them are noise here.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| std::env::set_var("REFIT_LOG", "off"));
    let mut arena = vec![0u8; ARENA as usize];
    let base = arena.as_mut_ptr() as u64;
    let mut input = Bytes(data);
    let mut pool = Pool::default();
    for _ in 0..64 {
        if input.0.is_empty() {
            break;
        }
        step(&mut input, &mut pool, base);
    }
    // Everything still live goes, executors before what they ran on.
    for (executor, _) in pool.executors.drain(..) {
        refit_executor_destroy(executor);
    }
    for batch in pool.batches.drain(..) {
        refit_copy_batch_destroy(batch);
    }
    for plan in pool.plans.drain(..) {
        refit_plan_destroy(plan);
    }
    for table in pool.tables.drain(..) {
        refit_table_destroy(table);
    }
    for group in pool.groups.drain(..) {
        refit_group_destroy(group);
    }
    drop(arena);
});
