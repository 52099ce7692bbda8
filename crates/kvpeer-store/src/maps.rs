//! Which file this process has mapped at an address: `/proc/self/maps`, read to learn whether an
//! engine's memory is a shared-memory object (vLLM maps its primary tier from
//! `/dev/shm/vllm_offload_<engine>.mmap`), so the `shm` plane can serve it
//! ([`crate::Pool::adopt_shm`]).
//!
//! Linux's format, one mapping per line: `start-end perms offset dev inode path`, addresses and
//! offset in hex, `dev` as `major:minor` in hex, `perms` ending in `s` for a shared mapping.

use std::path::PathBuf;

/// A run of this process's mappings of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMapping {
    /// The file's path as the kernel names it.
    pub path: PathBuf,
    /// Its inode.
    pub inode: u64,
    /// Offset in the file of the queried address.
    pub offset: u64,
}

/// The file mapped shared and writable over all of `[addr, addr + len)`, contiguously (one
/// file, file offsets following addresses; the kernel may list a mapping as several lines),
/// or `None` (anonymous memory, a private mapping, a gap, another file partway).
pub fn shared_file_at(addr: u64, len: u64) -> Option<FileMapping> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    covering(&maps, addr, len)
}

/// [`shared_file_at`] over the text of a maps file.
fn covering(maps: &str, addr: u64, len: u64) -> Option<FileMapping> {
    let end = addr.checked_add(len)?;
    let mut found: Option<FileMapping> = None;
    let mut next = addr;
    for line in maps.lines() {
        let Some(m) = parse(line) else { continue };
        if m.end <= next || m.start > next {
            continue;
        }
        // This line holds `next`: it must continue the same file, shared and writable.
        if !m.shared_writable || m.inode == 0 {
            return None;
        }
        let offset_at_next = m.offset.checked_add(next - m.start)?;
        match &found {
            None => {
                found = Some(FileMapping {
                    path: PathBuf::from(m.path),
                    inode: m.inode,
                    offset: offset_at_next,
                })
            }
            Some(f) => {
                if f.inode != m.inode || f.offset.checked_add(next - addr)? != offset_at_next {
                    return None;
                }
            }
        }
        next = m.end;
        if next >= end {
            return found;
        }
    }
    None
}

struct Line<'a> {
    start: u64,
    end: u64,
    shared_writable: bool,
    offset: u64,
    inode: u64,
    path: &'a str,
}

fn parse(line: &str) -> Option<Line<'_>> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let _dev = fields.next()?;
    let inode = fields.next()?.parse().ok()?;
    let path = fields.next().unwrap_or("").trim_start();
    let (start, end) = range.split_once('-')?;
    Some(Line {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        shared_writable: perms.len() == 4 && perms.as_bytes()[1] == b'w' && perms.ends_with('s'),
        offset,
        inode,
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
7f0000000000-7f0000010000 rw-s 00000000 00:19 4242                       /dev/shm/vllm_offload_a.mmap
7f0000010000-7f0000020000 rw-s 00010000 00:19 4242                       /dev/shm/vllm_offload_a.mmap
7f0000020000-7f0000030000 rw-p 00000000 00:00 0 
7f0000030000-7f0000040000 rw-s 00000000 00:19 5151                       /dev/shm/other
7f0000040000-7f0000050000 r--s 00000000 00:19 6161                       /dev/shm/readonly
";

    #[test]
    fn a_shared_file_over_several_lines_is_found_with_its_offset() {
        let m = covering(MAPS, 0x7f0000000000, 0x20000).unwrap();
        assert_eq!(m.path, PathBuf::from("/dev/shm/vllm_offload_a.mmap"));
        assert_eq!((m.inode, m.offset), (4242, 0));
        let inside = covering(MAPS, 0x7f0000008000, 0x10000).unwrap();
        assert_eq!(inside.offset, 0x8000);
    }

    #[test]
    fn anonymous_private_read_only_gaps_and_mixed_files_are_not() {
        assert_eq!(
            covering(MAPS, 0x7f0000020000, 0x1000),
            None,
            "anonymous, private"
        );
        assert_eq!(
            covering(MAPS, 0x7f0000018000, 0x10000),
            None,
            "runs into anonymous memory"
        );
        assert_eq!(covering(MAPS, 0x7f0000040000, 0x1000), None, "read-only");
        assert_eq!(
            covering(MAPS, 0x7f0000060000, 0x1000),
            None,
            "nothing mapped"
        );
        assert_eq!(
            covering(MAPS, 0x7f0000000000, 0x50000),
            None,
            "several files"
        );
    }

    #[test]
    fn this_process_sees_its_own_shared_mapping() {
        let file = tempfile_in_dev_shm();
        file.set_len(8192).unwrap();
        // SAFETY: a file of this test only, mapped and dropped here.
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        let addr = map.as_ptr() as u64;
        let m = shared_file_at(addr, 8192).unwrap();
        assert!(m
            .path
            .to_string_lossy()
            .starts_with("/dev/shm/kvpeer-maps-test"));
        assert_eq!(m.offset, 0);
        assert_eq!(
            shared_file_at(addr, 8192 * 1024),
            None,
            "longer than the mapping"
        );
    }

    fn tempfile_in_dev_shm() -> std::fs::File {
        let path = format!("/dev/shm/kvpeer-maps-test-{}", std::process::id());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }
}
