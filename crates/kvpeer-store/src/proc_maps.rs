//! Which file this process has mapped at an address: `/proc/self/maps`, read to learn whether an
//! engine's memory is a shared-memory object (vLLM maps its primary tier from
//! `/dev/shm/vllm_offload_<engine>.mmap`), so the `shm` plane can serve it
//! ([`crate::Pool::adopt_shm`]).
//!
//! Linux's format, one mapping per line: `start-end perms offset dev inode path`, addresses and
//! offset in hex, `dev` as `major:minor` in hex, `perms` ending in `s` for a shared mapping.
//!
//! Also what the kernel reports about the memory of one mapping (`/proc/self/smaps`:
//! [`usage_at`]), to check that a pool got the pages it asked for (transparent huge pages).

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

/// What `/proc/<pid>/smaps` reports about one mapping.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MappingUsage {
    /// The mapped file's path (empty for anonymous memory).
    pub path: String,
    /// The file's inode (0 for anonymous memory).
    pub inode: u64,
    /// A shared mapping (`perms` ending in `s`), not a private one.
    pub shared: bool,
    /// Resident kB.
    pub rss_kb: u64,
    /// kB of anonymous memory in transparent huge pages.
    pub anon_huge_kb: u64,
    /// kB of shared memory (shmem, `/dev/shm`) in huge pages.
    pub shmem_huge_kb: u64,
    /// The kernel's two-letter flags (`VmFlags`): `hg` advised for huge pages (`MADV_HUGEPAGE`),
    /// `nh` advised against them, `lo` locked, `sh` shared.
    pub vm_flags: Vec<String>,
}

impl MappingUsage {
    /// Whether the kernel lists `flag` (e.g. `"hg"`) in the mapping's `VmFlags`.
    pub fn has_flag(&self, flag: &str) -> bool {
        self.vm_flags.iter().any(|f| f == flag)
    }

    /// Whether this mapping, advised for huge pages and populated, has what the kernel's
    /// transparent-huge-page mode (`mode`, from [`thp_mode`]; `None`: no THP in the kernel)
    /// gives such memory: the advice recorded (`hg`) whenever THP is built in, and memory in
    /// 2 MiB pages when the mode is `madvise` or `always`. `Err` says what is missing.
    pub fn check_huge_pages(&self, mode: Option<&str>) -> Result<(), String> {
        let Some(mode) = mode else {
            return Ok(());
        };
        if !self.has_flag("hg") {
            return Err(format!(
                "not advised for huge pages (VmFlags {:?})",
                self.vm_flags
            ));
        }
        if (mode == "madvise" || mode == "always") && self.anon_huge_kb < 2048 {
            return Err(format!(
                "THP is {mode} but no huge page backs it (AnonHugePages {} kB of {} kB \
                 resident)",
                self.anon_huge_kb, self.rss_kb
            ));
        }
        Ok(())
    }
}

/// The mode `/sys/kernel/mm/transparent_hugepage/enabled` selects (`madvise` of
/// `always [madvise] never`); `None` on a kernel without transparent huge pages.
pub fn thp_mode() -> Option<String> {
    let modes = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let start = modes.find('[')?;
    let end = modes[start..].find(']')?;
    modes.get(start + 1..start + end).map(str::to_owned)
}

/// The mapping of this process that holds `addr`, as `/proc/self/smaps` reports it; `None` when
/// no mapping holds it (or the file cannot be read).
pub fn usage_at(addr: u64) -> Option<MappingUsage> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    usage_in(&smaps, addr)
}

/// [`usage_at`] over the text of a smaps file.
fn usage_in(smaps: &str, addr: u64) -> Option<MappingUsage> {
    let mut found: Option<MappingUsage> = None;
    for line in smaps.lines() {
        if let Some(m) = parse(line) {
            if found.is_some() {
                break;
            }
            if m.start <= addr && addr < m.end {
                found = Some(MappingUsage {
                    path: m.path.trim_end().to_owned(),
                    inode: m.inode,
                    shared: m.shared,
                    ..MappingUsage::default()
                });
            }
            continue;
        }
        let Some(usage) = found.as_mut() else {
            continue;
        };
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let kb = || {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0)
        };
        match key {
            "Rss" => usage.rss_kb = kb(),
            "AnonHugePages" => usage.anon_huge_kb = kb(),
            "ShmemPmdMapped" => usage.shmem_huge_kb = kb(),
            "VmFlags" => usage.vm_flags = value.split_whitespace().map(str::to_owned).collect(),
            _ => {}
        }
    }
    found
}

struct Line<'a> {
    start: u64,
    end: u64,
    shared_writable: bool,
    shared: bool,
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
        shared: perms.len() == 4 && perms.ends_with('s'),
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

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0 
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      4096 kB
ShmemPmdMapped:        0 kB
VmFlags: rd wr mr mw me ac sd hg 
7f0000400000-7f0000410000 rw-s 00000000 00:19 4242                       /dev/shm/pool
Rss:                  64 kB
AnonHugePages:         0 kB
VmFlags: rd wr sh mr mw me ms sd 
";

    #[test]
    fn smaps_gives_the_usage_of_the_mapping_holding_an_address() {
        let anon = usage_in(SMAPS, 0x7f0000001000).unwrap();
        assert_eq!(
            anon,
            MappingUsage {
                path: String::new(),
                inode: 0,
                shared: false,
                rss_kb: 4096,
                anon_huge_kb: 4096,
                shmem_huge_kb: 0,
                vm_flags: "rd wr mr mw me ac sd hg"
                    .split(' ')
                    .map(str::to_owned)
                    .collect(),
            }
        );
        assert!(anon.has_flag("hg") && !anon.has_flag("sh"));
        let shm = usage_in(SMAPS, 0x7f0000400000).unwrap();
        assert_eq!(
            (shm.path.as_str(), shm.inode, shm.shared),
            ("/dev/shm/pool", 4242, true)
        );
        assert_eq!((shm.rss_kb, shm.anon_huge_kb), (64, 0));
        assert!(!shm.has_flag("hg"));
        assert_eq!(
            usage_in(SMAPS, 0x7f0000410000),
            None,
            "past the last mapping"
        );
    }

    #[test]
    fn huge_pages_are_checked_against_the_kernels_mode() {
        let advised = usage_in(SMAPS, 0x7f0000001000).unwrap();
        let plain = usage_in(SMAPS, 0x7f0000400000).unwrap();
        let small = MappingUsage {
            anon_huge_kb: 0,
            ..advised.clone()
        };
        for mode in ["madvise", "always"] {
            assert_eq!(advised.check_huge_pages(Some(mode)), Ok(()));
            assert!(
                small.check_huge_pages(Some(mode)).is_err(),
                "{mode}: no huge page"
            );
            assert!(
                plain.check_huge_pages(Some(mode)).is_err(),
                "{mode}: not advised"
            );
        }
        assert_eq!(
            small.check_huge_pages(Some("never")),
            Ok(()),
            "never: advice only"
        );
        assert!(plain.check_huge_pages(Some("never")).is_err());
        assert_eq!(plain.check_huge_pages(None), Ok(()), "no THP in the kernel");
    }

    #[test]
    fn this_process_own_memory_is_found_in_smaps() {
        let v = vec![1u8; 1 << 20];
        let u = usage_at(v.as_ptr() as u64).unwrap();
        assert!(!u.shared && u.rss_kb > 0, "{u:?}");
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
