//! The digest of device memory: one range (`refit_digest`), or many in one pass (`refit_digest_many`).

// Pointers from C are checked for NULL and dereferenced inside the boundary: the exported functions are
// `extern "C"` entry points, not Rust APIs to mark unsafe.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::handles::live;
use super::{boundary, out, slice};
use crate::error::{Error, Result, Status};
use crate::ffi::group::refit_group;
use crate::group::Group;
use crate::kernels::digest::{check_range, check_ranges};
use crate::transport::access::check_buffers;
use crate::transport::{ByteRange, MemoryRange, Stream};
use std::ffi::c_void;

/// INVALID_ARGUMENT naming the first of `ranges` that is not memory `device` reads (on CUDA its own
/// or a peer's it accesses directly; on the host backend readable memory of the process): a digest
/// over anything else would fault.
fn check_readable(
    group: &Group,
    device: i32,
    ranges: &[ByteRange],
    name: impl Fn(usize) -> String,
) -> Result<()> {
    let ranges: Vec<MemoryRange> = ranges
        .iter()
        .map(|r| MemoryRange { device, addr: r.addr, len: r.len, peers: true, written: false })
        .collect();
    check_buffers(group.backend().as_ref(), &ranges, name)
}

/// Computes the refit digest of the `len` bytes at device address `addr` on `rank`'s device, on
/// `stream` (a stream of that device; NULL: its legacy default stream), and writes it to `*digest`.
/// Publishers pass it to refit_table_add_offer, so that replicas of a box are compared without
/// reading weights back to the host.
///
/// The digest: read the bytes as a polynomial over GF(2) whose coefficient of x^k is bit k%8 of byte
/// k/8, add x^(8 len) (a 1 bit just past the last byte), and reduce modulo
/// g(x) = x^64 + 0x41aa24523c3d140f (bit i: x^i); bit i of the result is the coefficient of x^i. It is
/// a CRC with a primitive polynomial: the same bytes give the same digest at any address and
/// alignment, and of two buffers of the same length, the digests always differ when they differ by a
/// single flipped bit, by two flipped bits, by any change within 64 consecutive bits (one 8-byte word
/// at any offset), or by two swapped 8-byte words that differ, at any offsets; and when one has extra
/// trailing zero bytes. Any other difference goes unnoticed only if g divides it: about one chance in
/// 2^64 for corruption. It is not cryptographic: digests can be forged on purpose. The digest of 0
/// bytes is 1, at any address (the last one, UINT64_MAX, included), and nothing is read for it.
///
/// Stream ordering: queued on `stream` after the work queued on it before; the call waits for that
/// stream to reach it (CUDA: one kernel, one 8-byte copy, cuStreamSynchronize) and then returns, so the
/// bytes may be changed once it has returned. On the GPU it reads at memory bandwidth, in one pass of
/// aligned 16-byte loads (so up to 15 bytes around the range, in the 16-byte blocks that hold its
/// first and last bytes, are read and ignored; nothing for 0 bytes); the first call on a device
/// compiles the kernel.
///
/// Thread-safety: may be called from any thread, concurrently with other calls.
///
/// Errors: NULL_ARGUMENT (group, digest), INVALID_ARGUMENT (rank not below the group size; with len >
/// 0: addr 0, len above 2^60, a range running past the end of the 64-bit address space or into its
/// last 16 bytes, or memory the device cannot read, checked as refit_copy_batch checks a source: on
/// CUDA every byte in a live allocation of the device or of a peer it accesses directly, on the host
/// backend in readable memory the process has mapped; on the host backend a stream that is not a
/// host stream or is another simulated device's), NVRTC_UNAVAILABLE / KERNEL_LOAD_FAILED (the kernel
/// could not be compiled or loaded at first use on the device), CUDA_ERROR (e.g. a stream of another
/// device). `*digest` is written only on success.
#[no_mangle]
pub extern "C" fn refit_digest(
    group: *const refit_group,
    rank: u32,
    addr: u64,
    len: u64,
    stream: *mut c_void,
    digest: *mut u64,
) -> crate::error::Status {
    boundary("refit_digest", || {
        let slot = out(digest, "digest")?;
        let handle = live(group, "group")?;
        let group = &handle.group;
        let device = group.device(rank as usize)?;
        check_range(addr, len)?;
        check_readable(group, device, &[ByteRange { addr, len }], |_| "the range".into())?;
        // SAFETY: the range was checked to be memory the device reads; the stream is the caller's.
        let value = unsafe { group.backend().digest(device, Stream::from_ptr(stream), addr, len) }?;
        slot.write(value);
        Ok(())
    })
}

/// Computes the refit digest (as refit_digest defines it) of each of `count` byte ranges on `rank`'s
/// device, all in one pass, on `stream` (a stream of that device; NULL: its legacy default stream),
/// and writes the digest of the `lens[i]` bytes at device address `addrs[i]` to `digests[i]`: each
/// equals what refit_digest gives for that range. For publishers that digest every shard they offer.
/// Ranges may overlap, repeat, and have any length and alignment; 0 bytes digest to 1 at any address.
/// Every call first checks that the ranges are memory the device reads (host work per range and per
/// allocation touched, as refit_copy_batch's check).
///
/// Stream ordering: queued on `stream` after the work queued on it before; the call waits for that
/// stream to reach it and returns, so the bytes may be changed once it has returned. CUDA: the list
/// of ranges is uploaded, and one kernel launch digests every range, its work split evenly over all
/// the ranges' bytes whatever their sizes; then one copy of the digests back and
/// cuStreamSynchronize. Reads as refit_digest does (up to 15 bytes around each range, in the aligned
/// 16-byte blocks holding its first and last bytes; nothing for a range of 0 bytes).
///
/// `count` 0: SUCCESS once the group and rank are checked; nothing is read, queued or written, and
/// the three lists may be NULL.
///
/// Thread-safety: may be called from any thread, concurrently with other calls.
///
/// Errors: NULL_ARGUMENT (group; addrs, lens or digests NULL with `count` > 0), INVALID_ARGUMENT
/// (rank not below the group size; a range with address 0 and a nonzero length, longer than 2^60
/// bytes, running past the end of the 64-bit address space, or over memory the device cannot read
/// (as refit_digest checks it), named by its index; more than 2^32 - 1 ranges; on the host backend
/// a stream that is not a host stream or is another simulated device's), NVRTC_UNAVAILABLE /
/// KERNEL_LOAD_FAILED (as refit_digest), CUDA_ERROR (e.g. a stream of another device). `digests`
/// is written only on success.
#[no_mangle]
pub extern "C" fn refit_digest_many(
    group: *const refit_group,
    rank: u32,
    addrs: *const u64,
    lens: *const u64,
    count: usize,
    stream: *mut c_void,
    digests: *mut u64,
) -> crate::error::Status {
    boundary("refit_digest_many", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        let device = group.device(rank as usize)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's promise: `count` readable entries in each list.
        let (addrs, lens) = unsafe { (slice(addrs, count, "addrs")?, slice(lens, count, "lens")?) };
        if digests.is_null() {
            return Err(Error::new(Status::NullArgument, format!("digests is NULL but count is {count}")));
        }
        let ranges: Vec<ByteRange> =
            addrs.iter().zip(lens).map(|(&addr, &len)| ByteRange { addr, len }).collect();
        check_ranges(&ranges)?;
        check_readable(group, device, &ranges, |i| format!("range {i}"))?;
        // SAFETY: the ranges were checked to be memory the device reads; the stream is the caller's.
        let values = unsafe { group.backend().digest_many(device, Stream::from_ptr(stream), &ranges) }?;
        // SAFETY: `digests` holds `count` writable words (the caller's promise); one value per range.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), digests, count) };
        Ok(())
    })
}
