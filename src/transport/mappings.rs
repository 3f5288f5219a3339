//! The process's memory mappings as the kernel knows them. The host backend's "device memory" is
//! the caller's host memory, reached through raw addresses: checking a range against the mappings
//! turns an address that is no memory of the process (or memory it may not read, or write) into a
//! status, where the copy would have faulted.
//!
//! Each check asks the kernel afresh (a mapping may have gone since the last one): for the mapping at
//! an address through the PROCMAP_QUERY ioctl on `/proc/self/maps` (Linux 6.11 and later: about a
//! microsecond per mapping a range touches), else by reading the whole list, whose cost grows with
//! the mappings (about 0.9 ms for the 650 of a process that has loaded torch).

use std::fs::File;
use std::os::fd::AsRawFd;

/// One mapping: the bytes [start, end) and whether the process may read and write them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
}

/// The process's mappings at one moment, asked one address at a time or listed whole.
pub enum Mappings {
    /// `/proc/self/maps` open for PROCMAP_QUERY.
    Queried(File),
    /// Every mapping, in address order.
    Listed(Vec<Mapping>),
}

impl Mappings {
    /// This process's mappings, as the kernel answers now; None where the system lists none (no
    /// `/proc`) or lists them in a form this does not read.
    pub fn current() -> Option<Mappings> {
        let maps = File::open("/proc/self/maps").ok()?;
        if query(&maps, 0).is_ok() {
            return Some(Mappings::Queried(maps));
        }
        Mappings::listed()
    }

    /// This process's mappings, every one of them read now (what [`Mappings::current`] falls back
    /// to where the kernel takes no query).
    pub fn listed() -> Option<Mappings> {
        parse(&std::fs::read("/proc/self/maps").ok()?).map(Mappings::Listed)
    }

    /// The mapping that holds `at`, or None when `at` lies in no mapping.
    pub fn at(&self, at: u64) -> Option<Mapping> {
        match self {
            Mappings::Queried(maps) => query(maps, at).ok().flatten(),
            Mappings::Listed(list) => {
                // The first mapping that ends after `at`: `at` lies in it, or in the gap before it.
                let index = list.partition_point(|m| m.end <= at);
                list.get(index).copied().filter(|m| m.start <= at)
            }
        }
    }

    /// The first address of [addr, addr + len) that is not memory the process may read (and, when
    /// `written`, write), with why; None when every byte is. The range may run from one mapping into
    /// the next where they meet. `addr + len` must not overflow.
    pub fn first_wanting(&self, addr: u64, len: u64, written: bool) -> Option<(u64, &'static str)> {
        let end = addr + len;
        let mut at = addr;
        while at < end {
            let Some(mapping) = self.at(at) else {
                return Some((at, "is not mapped in this process"));
            };
            if !mapping.read {
                return Some((at, "is mapped without read permission"));
            }
            if written && !mapping.write {
                return Some((at, "is mapped read-only, and the call writes there"));
            }
            at = mapping.end;
        }
        None
    }
}

/// `struct procmap_query` of linux/fs.h (104 bytes), the fields this asks for and reads.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// _IOWR('f', 17, struct procmap_query).
const PROCMAP_QUERY: u64 = 0xC068_6611;
const PROCMAP_QUERY_VMA_READABLE: u64 = 0x01;
const PROCMAP_QUERY_VMA_WRITABLE: u64 = 0x02;

/// The mapping holding `at` (flags 0: only one that covers it), None when none does; Err when the
/// kernel does not answer the query (before Linux 6.11: ENOTTY).
fn query(maps: &File, at: u64) -> std::io::Result<Option<Mapping>> {
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: at,
        ..Default::default()
    };
    // SAFETY: an ioctl on a file this owns, with a struct of the size and layout the request names,
    // which the kernel reads and writes only within.
    let code = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &mut q as *mut ProcmapQuery) };
    if code == 0 {
        return Ok(Some(Mapping {
            start: q.vma_start,
            end: q.vma_end,
            read: q.vma_flags & PROCMAP_QUERY_VMA_READABLE != 0,
            write: q.vma_flags & PROCMAP_QUERY_VMA_WRITABLE != 0,
        }));
    }
    match std::io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        e => Err(e),
    }
}

/// The mappings of a `/proc/<pid>/maps` text (`start-end perms offset dev inode [path]` per line,
/// addresses in hex), in address order; None when a line does not have that form.
pub fn parse(text: &[u8]) -> Option<Vec<Mapping>> {
    let text = std::str::from_utf8(text).ok()?;
    let mut mappings = Vec::new();
    for line in text.lines().filter(|line| !line.is_empty()) {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let perms = fields.next()?.as_bytes();
        let mapping = Mapping {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            read: perms.first() == Some(&b'r'),
            write: perms.get(1) == Some(&b'w'),
        };
        if mapping.start >= mapping.end {
            return None;
        }
        mappings.push(mapping);
    }
    // The kernel lists them in order; a caller's text may not.
    mappings.sort_unstable_by_key(|m| m.start);
    Some(mappings)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &[u8] = b"\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/true
00651000-00652000 rw-p 00051000 08:02 173521      /usr/bin/true
00652000-00655000 rw-p 00000000 00:00 0           [heap]
7f0000000000-7f0000001000 ---p 00000000 00:00 0
7f0000001000-7f0000002000 r--p 00000000 00:00 0
";

    #[test]
    fn a_maps_text_is_read_in_address_order() {
        let mappings = parse(MAPS).unwrap();
        assert_eq!(mappings.len(), 5);
        assert_eq!(mappings[0], Mapping { start: 0x400000, end: 0x452000, read: true, write: false });
        assert_eq!(
            mappings[3],
            Mapping { start: 0x7f0000000000, end: 0x7f0000001000, read: false, write: false }
        );
        assert!(parse(b"not a mapping\n").is_none());
        assert!(parse(b"2000-1000 rw-p 0 0:0 0\n").is_none(), "an empty or reversed mapping");
        assert_eq!(parse(b"").unwrap(), Vec::new());
    }

    #[test]
    fn ranges_are_checked_for_mapping_and_permission() {
        let mappings = Mappings::Listed(parse(MAPS).unwrap());
        // Inside one mapping, and across two that meet (the data segment and the heap).
        assert_eq!(mappings.first_wanting(0x400010, 16, false), None);
        assert_eq!(mappings.first_wanting(0x651f00, 0x1000, true), None);
        // Running off the heap's end into nothing, and starting in the gap before a mapping.
        assert_eq!(
            mappings.first_wanting(0x654ff0, 32, true),
            Some((0x655000, "is not mapped in this process"))
        );
        assert_eq!(mappings.first_wanting(0x452000, 1, false).map(|w| w.0), Some(0x452000));
        assert_eq!(mappings.first_wanting(0x10, 1, false).map(|w| w.0), Some(0x10));
        assert_eq!(mappings.first_wanting(0xffff_ffff_0000, 1, false).map(|w| w.0), Some(0xffff_ffff_0000));
        // A guard page, and a read-only mapping read and written.
        assert_eq!(
            mappings.first_wanting(0x7f0000000800, 8, false).unwrap().1,
            "is mapped without read permission"
        );
        assert_eq!(mappings.first_wanting(0x7f0000001000, 8, false), None);
        let written = mappings.first_wanting(0x7f0000000ff0, 0x20, true).unwrap();
        assert_eq!(written.0, 0x7f0000000ff0, "the guard page comes first");
        assert!(mappings.first_wanting(0x400000, 8, true).unwrap().1.contains("read-only"));
        assert_eq!(mappings.first_wanting(0x400000, 0, true), None, "no bytes, nothing wanting");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_lists_its_own_memory_alike_both_ways() {
        let heap = vec![7u8; 1 << 20];
        let on_stack = [1u8; 64];
        static TEXT: &str = "a constant in the image";
        let (heap_at, stack_at, text_at) =
            (heap.as_ptr() as u64, on_stack.as_ptr() as u64, TEXT.as_ptr() as u64);
        let listed = Mappings::listed().expect("Linux lists the mappings in /proc/self/maps");
        let current = Mappings::current().expect("Linux lists the mappings in /proc/self/maps");
        for mappings in [&listed, &current] {
            assert_eq!(mappings.first_wanting(heap_at, heap.len() as u64, true), None);
            assert_eq!(mappings.first_wanting(stack_at, 64, true), None);
            assert_eq!(mappings.first_wanting(text_at, TEXT.len() as u64, false), None);
            assert!(mappings.first_wanting(text_at, TEXT.len() as u64, true).is_some());
            assert!(mappings.first_wanting(0x1000, 8, false).is_some());
        }
        // Where the kernel takes queries, they answer as the list does.
        for at in [heap_at, stack_at, text_at, 0x1000, u64::MAX - 4096] {
            let (a, b) = (listed.at(at), current.at(at));
            assert_eq!(a.map(|m| (m.read, m.write)), b.map(|m| (m.read, m.write)), "{at:#x}");
            assert!(b.is_none_or(|m| m.start <= at && at < m.end));
        }
    }
}
