//! CUDA IPC: a process opens the device memory of another process on the same node, so that its
//! batched copy kernel writes straight into the other's buffers (over NVLink, or within one GPU), with
//! no staging and no NCCL.
//!
//! The owner of the memory [`export`]s the allocations that cover the ranges routes touch:
//! - memory from `cudaMalloc`/`cuMemAlloc` (legacy IPC capable, as the driver reports) as a legacy
//!   IPC handle of the whole allocation (`cuIpcGetMemHandle`);
//! - memory mapped from `cuMemCreate` allocations (what torch's expandable segments use) chunk by
//!   chunk: each chunk's allocation handle (`cuMemRetainAllocationHandle`) exported as a POSIX file
//!   descriptor (`cuMemExportToShareableHandle`), which only works for allocations created with
//!   that handle type requested; adjacent chunks form one share, mapped contiguously by the peer.
//!
//! The descriptors travel beside the encoded shares over a Unix socket (SCM_RIGHTS, see
//! [`super::mesh::Mesh::send_fds`]). The peer [`Opened::open`]s them (`cuIpcOpenMemHandle`, or
//! `cuMemImportFromShareableHandle` + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`) and
//! translates the owner's addresses into its own. Where the shares cannot be made or opened
//! (memory from a stream-ordered pool, a container without the needed permissions), the error says
//! why: callers fall back to NCCL and say so once.
//!
//! The host backend simulates this for CI: a share is the owner's process id and address range, and
//! the writer copies with `process_vm_writev` (where the kernel lets one process of the same user
//! write another's memory; where it does not, opening fails like an IPC handle that cannot be opened).

use super::comm::Communicator;
use super::driver::{check, primary_context, CurrentContext};
use super::{BackendKind, PreparedCheck, PreparedCopy, Stream};
use crate::bail;
use crate::error::{try_reserve, try_vec, Error, Result, Status};
use crate::kernels::verify::VerifyBatch;
use crate::segment::check::validate;
use crate::segment::{Segment, Side};
use crate::sync::lock;
use cudarc::driver::sys::{self, CUresult};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// One range of the owner's address space that a peer can open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Share {
    /// A `cudaMalloc` allocation: its legacy IPC handle.
    Legacy { base: u64, size: u64, handle: [u8; 64] },
    /// Adjacent chunks of `cuMemCreate` memory, `chunks` bytes each from `base`; one file descriptor
    /// per chunk travels beside the encoding, in order.
    Vmm { base: u64, chunks: Vec<u64> },
    /// Host backend: `size` bytes at `base` in process `pid`.
    Host { pid: u32, base: u64, size: u64 },
}

impl Share {
    fn range(&self) -> (u64, u64) {
        match self {
            Share::Legacy { base, size, .. } | Share::Host { base, size, .. } => (*base, *size),
            Share::Vmm { base, chunks } => (*base, chunks.iter().sum()),
        }
    }

    fn fds(&self) -> usize {
        match self {
            Share::Vmm { chunks, .. } => chunks.len(),
            _ => 0,
        }
    }
}

/// What [`export`] made: the shares, and the descriptors of their VMM chunks (to pass with
/// SCM_RIGHTS; closed here when dropped).
#[derive(Debug)]
pub struct Exported {
    pub shares: Vec<Share>,
    pub fds: Vec<OwnedFd>,
}

const LEGACY: u8 = 1;
const VMM: u8 = 2;
const HOST: u8 = 3;

/// The shares as bytes (the descriptors travel separately).
pub fn encode(shares: &[Share]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(shares.len() as u64).to_le_bytes());
    for share in shares {
        match share {
            Share::Legacy { base, size, handle } => {
                out.push(LEGACY);
                out.extend_from_slice(&base.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(handle);
            }
            Share::Vmm { base, chunks } => {
                out.push(VMM);
                out.extend_from_slice(&base.to_le_bytes());
                out.extend_from_slice(&(chunks.len() as u64).to_le_bytes());
                for chunk in chunks {
                    out.extend_from_slice(&chunk.to_le_bytes());
                }
            }
            Share::Host { pid, base, size } => {
                out.push(HOST);
                out.extend_from_slice(&u64::from(*pid).to_le_bytes());
                out.extend_from_slice(&base.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
            }
        }
    }
    out
}

/// Decodes [`encode`]'s bytes (from another process: checked, never trusted).
pub fn decode(bytes: &[u8]) -> Result<Vec<Share>> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| Error::new(Status::DecodeError, format!("IPC shares truncated at byte {at}")))?;
        let out = &bytes[at..end];
        at = end;
        Ok(out)
    };
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let count = word(take(8)?);
    let mut shares = Vec::new();
    for _ in 0..count {
        let kind = take(1)?[0];
        let share = match kind {
            LEGACY => {
                let (base, size) = (word(take(8)?), word(take(8)?));
                Share::Legacy { base, size, handle: take(64)?.try_into().expect("64 bytes") }
            }
            VMM => {
                let base = word(take(8)?);
                let n = word(take(8)?);
                let mut chunks = Vec::new();
                for _ in 0..n {
                    chunks.push(word(take(8)?));
                }
                Share::Vmm { base, chunks }
            }
            HOST => {
                let pid = u32::try_from(word(take(8)?))
                    .map_err(|_| Error::new(Status::DecodeError, "a process id above 2^32"))?;
                Share::Host { pid, base: word(take(8)?), size: word(take(8)?) }
            }
            other => bail!(Status::DecodeError, "IPC share kind {other} is unknown"),
        };
        let (base, size) = share.range();
        if size == 0 || base.checked_add(size).is_none() {
            bail!(Status::DecodeError, "an IPC share of {size} bytes at {base:#x}");
        }
        shares.push(share);
    }
    if at != bytes.len() {
        bail!(Status::DecodeError, "{} bytes follow the IPC shares", bytes.len() - at);
    }
    Ok(shares)
}

/// The address ranges `(address, length)` merged where they overlap or touch, ascending, empty ones
/// dropped.
fn merged(ranges: &[(u64, u64)]) -> Result<Vec<(u64, u64)>> {
    let mut sorted = try_vec(ranges.len(), "the ranges to share")?;
    sorted.extend(ranges.iter().copied().filter(|&(_, len)| len > 0));
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (addr, len) in sorted {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| Error::invalid_argument(format!("range at {addr:#x} of {len} bytes overflows")))?;
        match out.last_mut() {
            Some((_, last_end)) if addr <= *last_end => *last_end = (*last_end).max(end),
            _ => out.push((addr, end)),
        }
    }
    Ok(out.into_iter().map(|(a, e)| (a, e - a)).collect())
}

/// Shares covering every byte of `ranges` (device memory of CUDA device `device`). Errors:
/// UNSUPPORTED (memory that is neither legacy IPC capable nor VMM memory exportable as a POSIX file
/// descriptor, e.g. from a stream-ordered pool), CUDA_ERROR, INVALID_ARGUMENT (a range that
/// overflows).
pub fn export(device: i32, ranges: &[(u64, u64)]) -> Result<Exported> {
    let context = primary_context(device)?;
    // SAFETY: a retained primary context.
    let _current = unsafe { CurrentContext::enter(context) }?;
    let mut exported = Exported { shares: Vec::new(), fds: Vec::new() };
    let mut seen = HashSet::new();
    // The ranges ascend, so the allocation found last answers for every range it holds: one driver
    // query per allocation, not per range.
    let mut last = (0u64, 0u64);
    for (addr, len) in merged(ranges)? {
        let end = addr + len;
        let mut at = addr;
        while at < end {
            if at >= last.0 && at - last.0 < last.1 {
                at = last.0 + last.1;
                continue;
            }
            let (base, size) = allocation_range(at)?;
            last = (base, size);
            if seen.insert(base) {
                if legacy_capable(at)? {
                    exported.shares.push(Share::Legacy { base, size, handle: legacy_handle(base)? });
                } else {
                    exported.fds.push(vmm_descriptor(at, device)?);
                    match exported.shares.last_mut() {
                        Some(Share::Vmm { base: first, chunks })
                            if *first + chunks.iter().sum::<u64>() == base =>
                        {
                            chunks.push(size)
                        }
                        _ => exported.shares.push(Share::Vmm { base, chunks: vec![size] }),
                    }
                }
            }
            at = base + size;
        }
    }
    Ok(exported)
}

/// The allocation (for VMM memory: the mapped chunk) containing `addr`.
fn allocation_range(addr: u64) -> Result<(u64, u64)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid output slots.
    check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) })
        .map_err(|e| e.context(format!("address {addr:#x} is not device memory of this context")))?;
    if size == 0 || addr < base || addr - base >= size as u64 {
        bail!(Status::CudaError, "cuMemGetAddressRange gave {size} bytes at {base:#x} for {addr:#x}");
    }
    Ok((base, size as u64))
}

fn legacy_capable(addr: u64) -> Result<bool> {
    let mut capable: u32 = 0;
    // SAFETY: the attribute is a 32-bit flag written to a valid slot.
    check("cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)", unsafe {
        sys::cuPointerGetAttribute(
            (&mut capable as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            addr,
        )
    })?;
    Ok(capable != 0)
}

fn legacy_handle(base: u64) -> Result<[u8; 64]> {
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: valid output slot; `base` is an allocation's base.
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, base) })?;
    Ok(handle.reserved.map(|c| c as u8))
}

/// The chunk at `addr` exported as a POSIX file descriptor.
fn vmm_descriptor(addr: u64, device: i32) -> Result<OwnedFd> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid output slot; fails cleanly for memory that is not VMM-mapped.
    let retained = check("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut handle, addr as usize as *mut std::ffi::c_void)
    });
    if let Err(err) = retained {
        bail!(
            Status::Unsupported,
            "memory at {addr:#x} on device {device} can be shared neither by a legacy IPC handle nor as \
             cuMemCreate memory ({}): memory from a stream-ordered pool cannot be opened by another process",
            err.message
        );
    }
    let mut fd: libc::c_int = -1;
    // SAFETY: a retained handle; the descriptor is written to `fd`.
    let exported = check("cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut libc::c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    });
    // SAFETY: the reference cuMemRetainAllocationHandle took.
    unsafe { sys::cuMemRelease(handle) };
    exported.map_err(|e| {
        Error::new(
            Status::Unsupported,
            format!(
                "cuMemCreate memory at {addr:#x} cannot be exported as a file descriptor (allocate it with \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested): {}",
                e.message
            ),
        )
    })?;
    // SAFETY: a fresh descriptor the driver gave us.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Shares covering `ranges` of this process's host memory (the host backend's stand-in for IPC).
pub fn export_host(ranges: &[(u64, u64)]) -> Result<Exported> {
    let pid = std::process::id();
    let shares = merged(ranges)?.into_iter().map(|(base, size)| Share::Host { pid, base, size }).collect();
    Ok(Exported { shares, fds: Vec::new() })
}

/// One opened share: the owner's range and where it lies in this process.
#[derive(Debug)]
struct Mapping {
    remote: u64,
    size: u64,
    local: u64,
    kind: MappingKind,
}

#[derive(Debug)]
enum MappingKind {
    Legacy,
    /// Each chunk's (offset in the mapping, bytes, imported handle), in order.
    Vmm {
        chunks: Vec<(u64, u64, sys::CUmemGenericAllocationHandle)>,
    },
    Host {
        pid: u32,
    },
}

/// Another process's shares, opened in this one on CUDA device `device` (or the host backend):
/// translates the owner's addresses into this process's. Dropping it closes every share.
#[derive(Debug)]
pub struct Opened {
    device: i32,
    context: usize,
    mappings: Vec<Mapping>,
}

impl Opened {
    /// Opens `shares` with their descriptors `fds` (one per VMM chunk, in order) on `device` (for
    /// host shares, `device` is not used). Errors: INVALID_ARGUMENT (descriptors that do not match the
    /// shares), UNSUPPORTED (a share this process may not open: the message says why), CUDA_ERROR.
    pub fn open(device: i32, shares: &[Share], fds: Vec<OwnedFd>) -> Result<Opened> {
        let wanted: usize = shares.iter().map(Share::fds).sum();
        if wanted != fds.len() {
            bail!(Status::InvalidArgument, "{} file descriptors for shares that need {wanted}", fds.len());
        }
        let host = shares.iter().all(|s| matches!(s, Share::Host { .. }));
        let context = if host || shares.is_empty() { 0 } else { primary_context(device)? as usize };
        let mut opened = Opened { device, context, mappings: Vec::new() };
        // SAFETY: a retained primary context (or none for host shares).
        let _current = if context != 0 {
            Some(unsafe { CurrentContext::enter(context as sys::CUcontext) }?)
        } else {
            None
        };
        let mut fds = fds.into_iter();
        for share in shares {
            let mapping = match share {
                Share::Legacy { base, size, handle } => open_legacy(*base, *size, handle)?,
                Share::Vmm { base, chunks } => {
                    let chunk_fds: Vec<OwnedFd> = fds.by_ref().take(chunks.len()).collect();
                    open_vmm(device, *base, chunks, chunk_fds)?
                }
                Share::Host { pid, base, size } => open_host(*pid, *base, *size)?,
            };
            opened.mappings.push(mapping);
        }
        opened.mappings.sort_by_key(|m| m.remote);
        Ok(opened)
    }

    /// Where the owner's `len` bytes at `addr` lie in this process (all in one share).
    pub fn translate(&self, addr: u64, len: u64) -> Result<u64> {
        let i = self.mappings.partition_point(|m| m.remote <= addr);
        let mapping = i
            .checked_sub(1)
            .map(|i| &self.mappings[i])
            .filter(|m| addr.checked_add(len).is_some_and(|end| end <= m.remote + m.size));
        match mapping {
            Some(m) => Ok(m.local + (addr - m.remote)),
            None => bail!(
                Status::NotFound,
                "the peer shared no range holding {len} bytes at {addr:#x} (a route writes there)"
            ),
        }
    }

    /// `segment` with its destination translated (every byte it writes must lie in one share).
    pub fn translate_destination(&self, segment: &Segment) -> Result<Segment> {
        let span = footprint(segment)?;
        Ok(Segment { dst: self.translate(segment.dst, span)?, ..*segment })
    }

    /// `segments` cut where their destinations cross from one share into another, each piece with
    /// the index of the segment it came from. The owner's buffers may be separate allocations that
    /// happen to lie side by side or at a regular distance, which a planner merges into one run or
    /// one strided segment, while the peer maps each allocation wherever its driver puts it: such a
    /// segment is cut into its rows, a row that still crosses into its runs, and a run where a share
    /// ends. Errors: NOT_FOUND (a byte in no share).
    fn fitted(&self, segments: &[Segment]) -> Result<(Vec<Segment>, Vec<usize>)> {
        let (mut pieces, mut origins) =
            (Vec::with_capacity(segments.len()), Vec::with_capacity(segments.len()));
        let fits = |s: &Segment| footprint(s).is_ok_and(|span| self.translate(s.dst, span).is_ok());
        for (index, s) in segments.iter().enumerate() {
            if fits(s) {
                try_reserve(&mut pieces, 1, WRITE_PIECES)?;
                pieces.push(*s);
            } else {
                for row in s.rows() {
                    if fits(&row) {
                        try_reserve(&mut pieces, 1, WRITE_PIECES)?;
                        pieces.push(row);
                        continue;
                    }
                    let mut runs = try_vec(row.runs() as usize, "the runs of a write into a peer")?;
                    row.for_each_run(|src, dst, len| runs.push((src, dst, len)));
                    for (src, dst, len) in runs {
                        self.cut_run(src, dst, len, &mut pieces)?;
                    }
                }
            }
            let more = pieces.len() - origins.len();
            try_reserve(&mut origins, more, WRITE_PIECES)?;
            origins.resize(pieces.len(), index);
        }
        Ok((pieces, origins))
    }

    /// The run of `len` bytes from `src` to the owner's `dst`, as contiguous pieces that each lie in
    /// one share.
    fn cut_run(&self, mut src: u64, mut dst: u64, mut len: u64, pieces: &mut Vec<Segment>) -> Result<()> {
        while len > 0 {
            let i = self.mappings.partition_point(|m| m.remote <= dst);
            let Some(m) = i.checked_sub(1).map(|i| &self.mappings[i]).filter(|m| dst - m.remote < m.size)
            else {
                bail!(
                    Status::NotFound,
                    "the peer shared no range holding the byte at {dst:#x} (a route writes there)"
                );
            };
            let piece = len.min(m.remote + m.size - dst);
            try_reserve(pieces, 1, WRITE_PIECES)?;
            pieces.push(Segment::contiguous(src, dst, piece));
            (src, dst, len) = (src + piece, dst + piece, len - piece);
        }
        Ok(())
    }

    /// A batch writing `segments` (sources in this process, destinations in the owner's address
    /// space), launched on streams of this process's device (host backend: host streams). With
    /// `recording`, its launches also record digests of the sources they read, so that
    /// [`PreparedCopy::verify_destinations`] checks the destinations (through the opened memory)
    /// without reading the sources again; on the host backend that check compares both sides. A
    /// segment that crosses shares is cut ([`Opened::fitted`]); the check's outcome still names the
    /// index in `segments`.
    pub fn prepare_writes(
        self: &Arc<Self>,
        segments: &[Segment],
        recording: bool,
    ) -> Result<Box<dyn PreparedCopy>> {
        validate(segments)?;
        let (pieces, origins) = self.fitted(segments)?;
        let origins: Arc<[usize]> = origins.into();
        if let Some(pid) = self.host_pid() {
            return Ok(Box::new(HostWrites {
                opened: Arc::clone(self),
                pid,
                segments: pieces.into(),
                origins,
            }));
        }
        let translated = pieces.iter().map(|s| self.translate_destination(s)).collect::<Result<Vec<_>>>()?;
        let batch = if recording {
            crate::kernels::PreparedBatch::recording_digests(self.device, &translated, false)?
        } else {
            crate::kernels::PreparedBatch::new(self.device, &translated, false)?
        };
        Ok(Box::new(DeviceWrites { _opened: Arc::clone(self), batch, origins }))
    }

    fn host_pid(&self) -> Option<u32> {
        self.mappings.iter().find_map(|m| match m.kind {
            MappingKind::Host { pid } => Some(pid),
            _ => None,
        })
    }
}

/// What the pieces of writes into a peer are called when they do not fit in memory.
const WRITE_PIECES: &str = "the pieces of writes into a peer";

/// Bytes from a segment's first destination byte to one past its last.
fn footprint(s: &Segment) -> Result<u64> {
    s.span(Side::Destination)
        .ok_or_else(|| Error::invalid_argument(format!("segment {s:?} spans more than 2^64 bytes")))
}

fn open_legacy(base: u64, size: u64, handle: &[u8; 64]) -> Result<Mapping> {
    let handle = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut local = 0;
    // SAFETY: valid output slot; the handle came from the owner (the driver checks it).
    let opened = check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut local,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    });
    opened.map_err(|e| {
        Error::new(Status::Unsupported, format!("cannot open the peer's IPC handle: {}", e.message))
    })?;
    Ok(Mapping { remote: base, size, local, kind: MappingKind::Legacy })
}

fn open_vmm(device: i32, base: u64, chunks: &[u64], fds: Vec<OwnedFd>) -> Result<Mapping> {
    let total: u64 = chunks.iter().sum();
    let mut local = 0;
    // SAFETY: valid output slot.
    check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut local, total as usize, 0, 0, 0) })?;
    let mut mapping =
        Mapping { remote: base, size: total, local, kind: MappingKind::Vmm { chunks: Vec::new() } };
    let mut offset = 0;
    for (&chunk, fd) in chunks.iter().zip(fds) {
        match map_chunk(fd, local + offset, chunk) {
            Ok(handle) => {
                if let MappingKind::Vmm { chunks } = &mut mapping.kind {
                    chunks.push((offset, chunk, handle));
                }
                offset += chunk;
            }
            Err(err) => {
                release(&mapping);
                return Err(err);
            }
        }
    }
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the whole range is mapped.
    if let Err(err) =
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(local, total as usize, &access, 1) })
    {
        release(&mapping);
        return Err(err);
    }
    Ok(mapping)
}

/// Imports the chunk `fd` names and maps its `bytes` at `at` (inside a reservation); its handle.
fn map_chunk(fd: OwnedFd, at: u64, bytes: u64) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let raw = fd.into_raw_fd();
    // SAFETY: the descriptor the owner passed; the driver takes what it needs from it.
    let imported = check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            raw as usize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    });
    // SAFETY: ours; the imported handle holds its own reference to the memory.
    unsafe { libc::close(raw) };
    imported.map_err(|e| {
        Error::new(Status::Unsupported, format!("cannot import the peer's memory: {}", e.message))
    })?;
    // SAFETY: inside the caller's reservation; the handle covers `bytes` from its start.
    let mapped = check("cuMemMap", unsafe { sys::cuMemMap(at, bytes as usize, 0, handle, 0) });
    if let Err(err) = mapped {
        // SAFETY: imported above, mapped nowhere.
        unsafe { sys::cuMemRelease(handle) };
        return Err(err);
    }
    Ok(handle)
}

/// Checks that this process may read and write process `pid`'s memory (one byte read at `base`).
fn open_host(pid: u32, base: u64, size: u64) -> Result<Mapping> {
    let mut byte = 0u8;
    let local = iovec(&mut byte as *mut u8 as u64, 1);
    let remote = iovec(base, 1);
    // SAFETY: reads one byte into `byte`.
    let read = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if read != 1 {
        let err = std::io::Error::last_os_error();
        bail!(
            Status::Unsupported,
            "cannot open process {pid}'s memory ({err}): the kernel refuses cross-process access"
        );
    }
    Ok(Mapping { remote: base, size, local: base, kind: MappingKind::Host { pid } })
}

/// Closes what one `open_*` made: the legacy handle, or every mapped chunk, its handle and the
/// reservation. The caller has the device's context current.
fn release(mapping: &Mapping) {
    // SAFETY: what open_* made, used no more.
    let results = unsafe {
        match &mapping.kind {
            MappingKind::Legacy => vec![sys::cuIpcCloseMemHandle(mapping.local)],
            MappingKind::Vmm { chunks } => {
                let mut results: Vec<CUresult> = chunks
                    .iter()
                    .flat_map(|&(offset, bytes, handle)| {
                        [sys::cuMemUnmap(mapping.local + offset, bytes as usize), sys::cuMemRelease(handle)]
                    })
                    .collect();
                results.push(sys::cuMemAddressFree(mapping.local, mapping.size as usize));
                results
            }
            MappingKind::Host { .. } => Vec::new(),
        }
    };
    if let Some(&failed) = results.iter().find(|&&r| r != CUresult::CUDA_SUCCESS) {
        log::warn!("closing a peer's memory at {:#x}: {}", mapping.local, super::driver::error_name(failed));
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        // SAFETY: a retained primary context, when any share was a device one.
        let _current =
            (self.context != 0).then(|| unsafe { CurrentContext::enter(self.context as sys::CUcontext) });
        for mapping in &self.mappings {
            release(mapping);
        }
    }
}

/// Writes into an opened device share with the batched kernel.
struct DeviceWrites {
    _opened: Arc<Opened>,
    batch: crate::kernels::PreparedBatch,
    /// For each segment of the batch, the index of the caller's segment it is a piece of.
    origins: Arc<[usize]>,
}

impl PreparedCopy for DeviceWrites {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        self.batch.launch(stream.0 as usize as sys::CUstream)
    }

    fn verify_destinations(&self) -> Result<Box<dyn PreparedCheck>> {
        Ok(Box::new(DeviceCheck {
            _opened: Arc::clone(&self._opened),
            check: VerifyBatch::check(&self.batch)?,
            origins: Arc::clone(&self.origins),
        }))
    }
}

/// The verify of device writes into opened memory (holding the memory open while it may run).
struct DeviceCheck {
    _opened: Arc<Opened>,
    check: VerifyBatch,
    origins: Arc<[usize]>,
}

impl PreparedCheck for DeviceCheck {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        self.check.launch(stream.0 as usize as sys::CUstream)
    }

    fn outcome(&self) -> Result<Option<usize>> {
        Ok(self.check.outcome()?.map(|piece| self.origins[piece]))
    }
}

/// Writes into another process's host memory, queued on a host stream (the host backend's IPC).
struct HostWrites {
    opened: Arc<Opened>,
    pid: u32,
    segments: Arc<[Segment]>,
    origins: Arc<[usize]>,
}

impl PreparedCopy for HostWrites {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let worker = super::host::host_stream(stream)?;
        let (pid, segments, opened) = (self.pid, Arc::clone(&self.segments), Arc::clone(&self.opened));
        let (result, done) = std::sync::mpsc::channel();
        worker.enqueue(move || {
            let _keep = opened;
            // SAFETY: the caller promises the sources stay valid until the queued work has run.
            let _ = result.send(unsafe { write_host_runs(pid, &segments) });
        })?;
        worker.synchronize()?;
        done.recv().unwrap_or_else(|_| Err(Error::new(Status::InternalError, "a host write was dropped")))
    }

    fn verify_destinations(&self) -> Result<Box<dyn PreparedCheck>> {
        Ok(Box::new(HostWritesCheck {
            opened: Arc::clone(&self.opened),
            pid: self.pid,
            segments: Arc::clone(&self.segments),
            origins: Arc::clone(&self.origins),
            outcome: Arc::new(Mutex::new(None)),
        }))
    }
}

/// Compares what [`HostWrites`] wrote into another process with the sources, byte by byte, reading
/// the destinations back with `process_vm_readv`.
struct HostWritesCheck {
    opened: Arc<Opened>,
    pid: u32,
    segments: Arc<[Segment]>,
    origins: Arc<[usize]>,
    /// The last launch's outcome: Ok(first differing segment), taken by `outcome`.
    outcome: Arc<Mutex<Option<Result<Option<usize>>>>>,
}

impl PreparedCheck for HostWritesCheck {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let worker = super::host::host_stream(stream)?;
        let (pid, segments, opened, outcome) =
            (self.pid, Arc::clone(&self.segments), Arc::clone(&self.opened), Arc::clone(&self.outcome));
        worker.enqueue(move || {
            let _keep = opened;
            // SAFETY: the caller promises the sources stay readable until the queued work has run.
            let found = unsafe { compare_host_runs(pid, &segments) };
            *lock(&outcome) = Some(found);
        })
    }

    fn outcome(&self) -> Result<Option<usize>> {
        let found = lock(&self.outcome)
            .take()
            .unwrap_or_else(|| Err(Error::invalid_state("no verify launch has completed")))?;
        Ok(found.map(|piece| self.origins[piece]))
    }
}

/// The first segment whose bytes in process `pid` differ from the local sources.
///
/// # Safety
/// Every source run is readable memory of this process.
unsafe fn compare_host_runs(pid: u32, segments: &[Segment]) -> Result<Option<usize>> {
    let mut theirs = Vec::new();
    for (index, s) in segments.iter().enumerate() {
        let mut failed = None;
        let mut differs = false;
        s.for_each_run(|src, dst, len| {
            if failed.is_some() || differs {
                return;
            }
            theirs.resize(len as usize, 0u8);
            let local = iovec(theirs.as_mut_ptr() as u64, len);
            let remote = iovec(dst, len);
            // SAFETY: reads into `theirs`, which holds `len` bytes.
            let read = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
            if read < 0 || read as u64 != len {
                let err = std::io::Error::last_os_error();
                failed = Some(Error::new(
                    Status::Aborted,
                    format!("reading process {pid}'s memory failed ({err})"),
                ));
                return;
            }
            // SAFETY: the caller's promise on the sources.
            let ours = unsafe { std::slice::from_raw_parts(src as usize as *const u8, len as usize) };
            differs = ours != theirs.as_slice();
        });
        if let Some(err) = failed {
            return Err(err);
        }
        if differs {
            return Ok(Some(index));
        }
    }
    Ok(None)
}

/// Every run of `segments` written into process `pid` with `process_vm_writev`, batched.
///
/// # Safety
/// Every source run is readable memory of this process.
unsafe fn write_host_runs(pid: u32, segments: &[Segment]) -> Result<()> {
    let mut batch = VmBatch::new(pid);
    for s in segments {
        let mut failed = None;
        s.for_each_run(|src, dst, len| {
            if failed.is_none() {
                // SAFETY: the caller's promise on the sources.
                failed = unsafe { batch.push(src, dst, len) }.err();
            }
        });
        if let Some(err) = failed {
            return Err(err);
        }
    }
    // SAFETY: as above.
    unsafe { batch.flush() }
}

/// Runs to write into another process, sent with as few `process_vm_writev` calls as the kernel
/// allows: it moves at most about 2 GiB per call and may move less than asked, so each call carries a
/// bounded batch and what it did not move is sent again.
struct VmBatch {
    pid: u32,
    /// (local address, remote address, bytes), each at most `MAX_RUN`.
    runs: std::collections::VecDeque<(u64, u64, u64)>,
    bytes: u64,
}

impl VmBatch {
    const MAX_RUNS: usize = 512;
    const MAX_RUN: u64 = 256 << 20;
    const MAX_BYTES: u64 = 1 << 30;

    fn new(pid: u32) -> VmBatch {
        VmBatch { pid, runs: std::collections::VecDeque::new(), bytes: 0 }
    }

    /// Queues a run (cut into pieces of at most `MAX_RUN`), sending the batch when it is full.
    ///
    /// # Safety
    /// The local run is readable until the batch is flushed.
    unsafe fn push(&mut self, src: u64, dst: u64, len: u64) -> Result<()> {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(Self::MAX_RUN);
            self.runs.push_back((src + at, dst + at, n));
            self.bytes += n;
            at += n;
            if self.runs.len() == Self::MAX_RUNS || self.bytes >= Self::MAX_BYTES {
                // SAFETY: the caller's promise.
                unsafe { self.flush() }?;
            }
        }
        Ok(())
    }

    /// Sends every queued run.
    ///
    /// # Safety
    /// As for `push`.
    unsafe fn flush(&mut self) -> Result<()> {
        while !self.runs.is_empty() {
            let local: Vec<libc::iovec> = self.runs.iter().map(|&(l, _, n)| iovec(l, n)).collect();
            let remote: Vec<libc::iovec> = self.runs.iter().map(|&(_, r, n)| iovec(r, n)).collect();
            // SAFETY: iovecs of readable local memory and the peer's shared ranges.
            let wrote = unsafe {
                libc::process_vm_writev(
                    self.pid as libc::pid_t,
                    local.as_ptr(),
                    local.len() as _,
                    remote.as_ptr(),
                    remote.len() as _,
                    0,
                )
            };
            if wrote <= 0 {
                let err = std::io::Error::last_os_error();
                bail!(
                    Status::Aborted,
                    "writing {} bytes into process {} failed ({err}): it exited?",
                    self.bytes,
                    self.pid
                );
            }
            // Drop what was written; a run written in part keeps its rest.
            let mut left = wrote as u64;
            while left > 0 {
                let front = self.runs.front_mut().expect("the kernel wrote no more than asked");
                let n = left.min(front.2);
                front.0 += n;
                front.1 += n;
                front.2 -= n;
                self.bytes -= n;
                left -= n;
                if front.2 == 0 {
                    self.runs.pop_front();
                }
            }
        }
        Ok(())
    }
}

/// `len` bytes at `addr`, as `process_vm_readv` / `process_vm_writev` take them.
fn iovec(addr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: len as usize }
}

/// The raw descriptors of `exported`, for [`super::mesh::Mesh::send_fds`].
pub fn raw_fds(exported: &Exported) -> Vec<i32> {
    exported.fds.iter().map(|fd| fd.as_raw_fd()).collect()
}

/// Which pairs write through IPC, as every rank agreed in [`connect`]; the others take staging.
pub struct Peers {
    /// The memory of each owner this rank writes into through IPC.
    pub opened: HashMap<usize, Arc<Opened>>,
    /// The ranks that write into this rank's memory through IPC.
    pub writers: HashSet<usize>,
    /// Why each owner this rank writes into is not in `opened` (it takes staging): another machine,
    /// IPC off, the owner's memory could not be shared (the owner's error), or not opened here.
    pub not_opened: BTreeMap<usize, String>,
}

/// Sets up IPC between the ranks of `comm` (a collective call: every rank makes it): each rank shares
/// `mine` (the ranges of its memory that `writers` write into; device memory of `device`, or host
/// memory when `kind` is the host backend) with its writers on this machine, and opens the shares
/// of `owners` (the ranks it writes into) that are on this machine. Then every rank learns which
/// pairs succeeded: a pair uses IPC only when the writer opened the owner's shares. Pairs on two
/// machines are left to staging; a pair on one machine that could not (memory that cannot be shared
/// or opened) is too, and the first time a rank falls back it logs a warning with every such pair's
/// reason; [`Peers::not_opened`] says why for each owner not opened. The two lists must agree across ranks (w writes into o on w's `owners` exactly when on o's `writers`).
///
/// Errors: the communicator's (TIMEOUT, ABORTED), DECODE_ERROR (a peer's bytes), CUDA_ERROR.
pub fn connect(
    comm: &Communicator,
    kind: BackendKind,
    device: i32,
    mine: &[(u64, u64)],
    writers: &[usize],
    owners: &[usize],
) -> Result<Peers> {
    let node = comm.node_mesh()?;
    let local_writers: Vec<usize> =
        writers.iter().copied().filter(|&w| node.holds(w) && w != comm.rank()).collect();
    let enabled = comm.options().ipc;
    // A rank with nothing to share (or whose memory cannot be shared, or with IPC disabled) still
    // takes part in every exchange below.
    let exported = if !enabled {
        Err(Error::unsupported("CUDA IPC is disabled by the communicator's options"))
    } else if local_writers.is_empty() || mine.is_empty() {
        Ok(Exported { shares: Vec::new(), fds: Vec::new() })
    } else if kind == BackendKind::Host {
        export_host(mine)
    } else {
        export(device, mine)
    };
    let (shares, why_not) = match exported {
        Ok(exported) => (exported, None),
        Err(err) => (Exported { shares: Vec::new(), fds: Vec::new() }, Some(err)),
    };
    // A rank that could not share sends its reason instead of shares, for its writers' messages.
    let mut record = vec![u8::from(why_not.is_none())];
    match &why_not {
        None => record.extend_from_slice(&encode(&shares.shares)),
        Some(err) => record.extend_from_slice(err.message.as_bytes()),
    }
    let all = comm.allgather_bytes(&record)?;
    let timeout = comm.options().timeout;
    for &writer in &local_writers {
        node.send_fds(writer, &raw_fds(&shares), timeout)?;
    }
    let mut opened = HashMap::new();
    let mut not_opened = BTreeMap::new();
    // Pairs on one machine that fall back (the warning's reasons), as opposed to pairs across
    // machines, for which staging is the way.
    let mut failures = Vec::new();
    for &owner in owners.iter().filter(|&&o| o != comm.rank()) {
        if !node.holds(owner) {
            not_opened.insert(owner, format!("rank {owner} is on another machine"));
            continue;
        }
        let fds = node.recv_fds(owner, timeout)?;
        let record = &all[owner];
        if !enabled {
            not_opened.insert(owner, "CUDA IPC is disabled by the communicator's options".to_string());
            continue;
        }
        // Any failure here is this pair's fallback, never an early return: the others are about to
        // meet in the verdicts' allgather below.
        let result = match record.split_first() {
            Some((1, shares)) => {
                decode(shares).and_then(|shares| Opened::open(device, &shares, fds)).map_err(|err| {
                    format!("rank {owner}'s memory cannot be opened by rank {}: {}", comm.rank(), err.message)
                })
            }
            _ => Err(format!(
                "rank {owner} could not share its memory: {}",
                String::from_utf8_lossy(record.get(1..).unwrap_or_default())
            )),
        };
        match result {
            Ok(o) => {
                opened.insert(owner, Arc::new(o));
            }
            Err(reason) => {
                failures.push(reason.clone());
                not_opened.insert(owner, reason);
            }
        }
    }
    if let Some(err) = why_not.filter(|_| enabled && !local_writers.is_empty()) {
        failures.push(format!("rank {}'s memory cannot be shared: {}", comm.rank(), err.message));
    }
    // Every rank learns which of its writers opened its memory.
    let mut opened_owners: Vec<u8> = Vec::new();
    for owner in opened.keys() {
        opened_owners.extend_from_slice(&(*owner as u64).to_le_bytes());
    }
    let verdicts = comm.allgather_bytes(&opened_owners)?;
    let mut ipc_writers = HashSet::new();
    for (writer, bytes) in verdicts.iter().enumerate() {
        if bytes
            .chunks_exact(8)
            .any(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) == comm.rank() as u64)
        {
            ipc_writers.insert(writer);
        }
    }
    if !enabled {
        log::info!("rank {}: CUDA IPC is off (communicator options): every pair takes staging", comm.rank());
    } else if !failures.is_empty() {
        warn_once(&format!(
            "rank {}: {} of its pairs of processes on this machine take NCCL (staging) instead of CUDA \
             IPC: {}",
            comm.rank(),
            failures.len(),
            failures.join("; ")
        ));
    }
    Ok(Peers { opened, writers: ipc_writers, not_opened })
}

/// Logs `message` as a warning the first time this process falls back from IPC.
fn warn_once(message: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| log::warn!("{message}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_round_trip_and_hostile_bytes_are_refused() {
        let shares = vec![
            Share::Legacy { base: 0x7000_0000, size: 4096, handle: [7; 64] },
            Share::Vmm { base: 0x9000_0000, chunks: vec![2 << 20, 2 << 20] },
            Share::Host { pid: 42, base: 0x1000, size: 10 },
        ];
        let bytes = encode(&shares);
        assert_eq!(decode(&bytes).unwrap(), shares);
        for cut in 0..bytes.len() {
            assert_eq!(decode(&bytes[..cut]).unwrap_err().status, Status::DecodeError, "cut at {cut}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert_eq!(decode(&extra).unwrap_err().status, Status::DecodeError);
        let mut wrong = bytes;
        wrong[8] = 9;
        assert_eq!(decode(&wrong).unwrap_err().status, Status::DecodeError);
        let empty = encode(&[Share::Host { pid: 1, base: 5, size: 0 }]);
        assert_eq!(decode(&empty).unwrap_err().status, Status::DecodeError);
    }

    /// Host shares of process 1: (owner's address, size, address here) each.
    fn host_shares(shares: [(u64, u64, u64); 2]) -> Opened {
        let mappings = shares
            .iter()
            .map(|&(remote, size, local)| Mapping { remote, size, local, kind: MappingKind::Host { pid: 1 } })
            .collect();
        Opened { device: 0, context: 0, mappings }
    }

    #[test]
    fn ranges_merge_where_they_touch() {
        let m = merged(&[(100, 10), (0, 0), (105, 20), (125, 5), (200, 1)]).unwrap();
        assert_eq!(m, vec![(100, 30), (200, 1)]);
        assert_eq!(merged(&[(u64::MAX, 2)]).unwrap_err().status, Status::InvalidArgument);
    }

    #[test]
    fn segments_crossing_shares_are_cut_at_rows_then_runs() {
        let opened = host_shares([(1000, 100, 5000), (1200, 100, 9000)]);
        // A segment whose two rows lie in two shares is cut into its rows.
        let rows =
            Segment { src: 1, dst: 1000, len: 4, count: [2, 2], src_stride: [4, 8], dst_stride: [10, 200] };
        let fits = Segment::contiguous(2, 1010, 20);
        let (pieces, origins) = opened.fitted(&[fits, rows]).unwrap();
        assert_eq!(pieces, [fits, rows.rows().next().unwrap(), rows.rows().nth(1).unwrap()]);
        assert_eq!(origins, [0, 1, 1]);
        // A row whose runs lie in two shares is cut into its runs.
        let across =
            Segment { src: 1, dst: 1090, len: 4, count: [2, 1], src_stride: [4, 0], dst_stride: [110, 0] };
        let (pieces, origins) = opened.fitted(&[across]).unwrap();
        assert_eq!(pieces, [Segment::contiguous(1, 1090, 4), Segment::contiguous(5, 1200, 4)]);
        assert_eq!(origins, [0, 0]);
        // A byte in no share is refused.
        let outside = Segment { dst_stride: [300, 0], ..across };
        assert_eq!(opened.fitted(&[outside]).unwrap_err().status, Status::NotFound);
        // A run over two shares that touch is cut where the first ends; over a gap, refused.
        let touching = host_shares([(1000, 100, 5000), (1100, 100, 9000)]);
        let (pieces, origins) = touching.fitted(&[Segment::contiguous(7, 1050, 120)]).unwrap();
        assert_eq!(pieces, [Segment::contiguous(7, 1050, 50), Segment::contiguous(57, 1100, 70)]);
        assert_eq!(origins, [0, 0]);
        let over_gap = Segment::contiguous(7, 1050, 151);
        assert_eq!(touching.fitted(&[over_gap]).unwrap_err().status, Status::NotFound);
    }

    #[test]
    fn addresses_translate_within_one_share_only() {
        let opened = host_shares([(1000, 100, 5000), (2000, 50, 9000)]);
        assert_eq!(opened.translate(1000, 100).unwrap(), 5000);
        assert_eq!(opened.translate(2010, 40).unwrap(), 9010);
        for (addr, len) in [(999, 1), (1050, 51), (1100, 1), (2040, 11), (3000, 0)] {
            assert_eq!(opened.translate(addr, len).unwrap_err().status, Status::NotFound, "{addr} {len}");
        }
        // A strided segment's whole footprint must lie in one share.
        let s =
            Segment { src: 1, dst: 1000, len: 10, count: [3, 2], src_stride: [10, 30], dst_stride: [20, 40] };
        assert_eq!(footprint(&s).unwrap(), 20 * 2 + 40 + 10);
        assert_eq!(opened.translate_destination(&s).unwrap().dst, 5000);
        let too_far = Segment { dst_stride: [40, 40], ..s };
        assert_eq!(opened.translate_destination(&too_far).unwrap_err().status, Status::NotFound);
    }
}
