//! Whether this host has room for a pool, asked before a byte of it is allocated.
//!
//! A pool is allocated whole and touched at start (pre-faulted, so a first transfer does not
//! pay for page faults). A pool larger than the host can hold then takes the host down: a
//! 32 GiB pool on a 24 GiB machine filled `/dev/shm` in seconds and the kernel's OOM killer
//! took unrelated processes with it. So the node asks first, and refuses with the sizes:
//!
//! * memory: `MemAvailable` of `/proc/meminfo` (what the kernel says can be allocated without
//!   swapping), and the cgroup's own limit where one is set, as a container's is (cgroup v2:
//!   `memory.max` less `memory.current`; cgroup v1: the least of `memory.limit_in_bytes` and
//!   `memory.stat`'s `hierarchical_memory_limit`, less `memory.usage_in_bytes`). Without it a
//!   container limited below its pool is killed by the kernel in the middle of the allocation;
//! * a shared-memory pool also needs the free space of the file system under `/dev/shm`
//!   (`statvfs`): tmpfs is sized apart from memory, often at half of it, and a container's is
//!   its own, 64 MiB unless it is given more.
//!
//! A pool may take at most [`SHARE_PERCENT`] of the least of those, so the host keeps room for
//! everything else; whatever cannot be read counts as no limit (a host without `/proc` is not
//! refused). Called from the node's builder, on its caller's thread, before the pool exists.

use std::path::Path;

/// The part of what is free a pool may take, in percent.
pub const SHARE_PERCENT: u64 = 90;

/// What a pool's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// A POSIX shared-memory object in `/dev/shm` (memory, and the tmpfs's space).
    SharedMemory,
    /// Private anonymous memory.
    Private,
}

/// What this host has free, as read now; `None` where it could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Room {
    /// `MemAvailable`, in bytes.
    pub memory_available: Option<u64>,
    /// The cgroup's limit less its use, in bytes (`None`: no limit, or none readable).
    pub cgroup_free: Option<u64>,
    /// Free bytes of the file system under `/dev/shm`.
    pub shm_free: Option<u64>,
    /// Whether this process runs in a container (the `container` environment variable that
    /// podman, systemd-nspawn and LXC set, as systemd reads it; podman's `/run/.containerenv`,
    /// which a read-only container's tmpfs on `/run` hides; Docker's `/.dockerenv`): its
    /// `/dev/shm` and its memory limit are then the container's, set by options of the engine
    /// that started it, which the refusal names.
    pub in_container: bool,
}

/// Why a pool does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a pool of {} ({num_blocks} blocks of {block_len} bytes) does not fit this host: {what} has {} free, \
     and a pool may take at most {SHARE_PERCENT}% of it ({}); lower num_blocks (--blocks) or block_len, \
     or free memory first{hint}",
    human(*bytes),
    human(*free),
    human(*free / 100 * SHARE_PERCENT)
)]
pub struct NoRoom {
    /// The pool's bytes.
    pub bytes: u64,
    /// Its blocks.
    pub num_blocks: u64,
    /// Its block length.
    pub block_len: u64,
    /// What is short: `memory (MemAvailable)`, `the cgroup's memory limit`, `/dev/shm`.
    pub what: &'static str,
    /// What that has free.
    pub free: u64,
    /// In a container, what gives it more (`""` elsewhere).
    pub hint: &'static str,
}

/// Bytes as a reader reads them (GiB, MiB, KiB, with one decimal).
pub fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            return format!("{:.1} {unit}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

impl Room {
    /// This host's room now.
    pub fn of_this_host() -> Room {
        Room {
            memory_available: meminfo_available(&read("/proc/meminfo")),
            cgroup_free: cgroup_free(Path::new("/sys/fs/cgroup"), &read("/proc/self/cgroup")),
            shm_free: shm_free(Path::new("/dev/shm")),
            in_container: std::env::var_os("container").is_some_and(|v| !v.is_empty())
                || Path::new("/run/.containerenv").exists()
                || Path::new("/.dockerenv").exists(),
        }
    }

    /// Whether a pool of `num_blocks × block_len` bytes (`bytes`, its whole mapping) on
    /// `backing` fits.
    pub fn check(
        &self,
        bytes: u64,
        num_blocks: u64,
        block_len: u64,
        backing: Backing,
    ) -> Result<(), NoRoom> {
        let mut limits = vec![
            ("memory (MemAvailable)", self.memory_available),
            ("the cgroup's memory limit", self.cgroup_free),
        ];
        if backing == Backing::SharedMemory {
            limits.push(("/dev/shm", self.shm_free));
        }
        for (what, free) in limits {
            let Some(free) = free else { continue };
            if bytes > free / 100 * SHARE_PERCENT {
                let hint = match (self.in_container, what) {
                    (false, _) | (true, "memory (MemAvailable)") => "",
                    (true, "/dev/shm") => {
                        " (this container's /dev/shm is its own: start it with a larger \
                         --shm-size)"
                    }
                    (true, _) => {
                        " (this container's memory limit: start it with a larger --memory)"
                    }
                };
                return Err(NoRoom {
                    bytes,
                    num_blocks,
                    block_len,
                    what,
                    free,
                    hint,
                });
            }
        }
        Ok(())
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn meminfo_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => kib.checked_mul(1024),
        Some(_) => None,
    }
}

/// The memory limit less the use of this process's cgroup, from `/proc/self/cgroup`'s text,
/// with the cgroup file systems under `root`: cgroup v2 (`0::/path`) where its files are there,
/// else cgroup v1 (`N:...memory...:/path`); `None` without a limit or where neither is readable.
fn cgroup_free(root: &Path, self_cgroup: &str) -> Option<u64> {
    cgroup_v2_free(root, self_cgroup).or_else(|| cgroup_v1_free(&root.join("memory"), self_cgroup))
}

/// cgroup v2: `memory.max` less `memory.current` of the group `0::/path` names.
fn cgroup_v2_free(root: &Path, self_cgroup: &str) -> Option<u64> {
    let path = self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim_start_matches('/');
    let dir = root.join(path);
    let max: u64 = read_number(&dir.join("memory.max"))?;
    let current: u64 = read_number(&dir.join("memory.current"))?;
    Some(max.saturating_sub(current))
}

/// Limits at or above this are cgroup v1's "no limit" (the largest page-aligned `i64`).
const CGROUP_V1_UNLIMITED: u64 = 1 << 62;

/// cgroup v1, under the memory controller's mount `memory_root`: the group's directory as
/// `/proc/self/cgroup` names it, or, where that path is not there (a container sees its own
/// group mounted at the root, while the file names the host's path), the root itself. The limit
/// is the least of the group's own and `hierarchical_memory_limit` (an ancestor's may be lower).
fn cgroup_v1_free(memory_root: &Path, self_cgroup: &str) -> Option<u64> {
    let path = self_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let _id = parts.next()?;
        let controllers = parts.next()?;
        let path = parts.next()?;
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| path.trim_start_matches('/'))
    })?;
    let named = memory_root.join(path);
    let dir = if named.join("memory.limit_in_bytes").exists() {
        named
    } else {
        memory_root.to_path_buf()
    };
    let own = read_number(&dir.join("memory.limit_in_bytes"))?;
    let hierarchical = std::fs::read_to_string(dir.join("memory.stat"))
        .ok()
        .and_then(|stat| {
            stat.lines()
                .find_map(|l| l.strip_prefix("hierarchical_memory_limit "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(u64::MAX);
    let limit = own.min(hierarchical);
    if limit >= CGROUP_V1_UNLIMITED {
        return None;
    }
    let usage = read_number(&dir.join("memory.usage_in_bytes"))?;
    Some(limit.saturating_sub(usage))
}

/// A file holding one decimal number (`None`: unreadable, or not a number, as `max` is).
fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Free bytes of the file system at `dir` (for an unprivileged user: `f_bavail`).
fn shm_free(dir: &Path) -> Option<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).ok()?;
    (stat.blocks_available() as u64).checked_mul(stat.fragment_size() as u64)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_pool_fits_within_ninety_percent_of_the_least_free_and_is_refused_naming_it() {
        let room = Room {
            memory_available: Some(20 * GIB),
            cgroup_free: None,
            shm_free: Some(12 * GIB),
            in_container: false,
        };
        assert!(room.check(GIB, 16384, 65536, Backing::SharedMemory).is_ok());
        // 32 GiB (the doc example that took a 24 GiB machine down): refused by memory first.
        let e = room
            .check(32 * GIB, 524_288, 65536, Backing::SharedMemory)
            .unwrap_err();
        assert_eq!(e.what, "memory (MemAvailable)");
        assert_eq!(
            e.to_string(),
            "a pool of 32.0 GiB (524288 blocks of 65536 bytes) does not fit this host: memory \
             (MemAvailable) has 20.0 GiB free, and a pool may take at most 90% of it (18.0 \
             GiB); lower num_blocks (--blocks) or block_len, or free memory first"
        );
        // 15 GiB: memory has room, /dev/shm has not; private memory has.
        let e = room
            .check(15 * GIB, 245_760, 65536, Backing::SharedMemory)
            .unwrap_err();
        assert_eq!(e.what, "/dev/shm");
        assert!(room
            .check(15 * GIB, 245_760, 65536, Backing::Private)
            .is_ok());
        // A container's limit below the host's memory.
        let boxed = Room {
            cgroup_free: Some(4 * GIB),
            ..room
        };
        let e = boxed
            .check(8 * GIB, 1, 8 * GIB, Backing::Private)
            .unwrap_err();
        assert_eq!(e.what, "the cgroup's memory limit");
        // What cannot be read limits nothing.
        assert!(Room::default()
            .check(u64::MAX, 1, u64::MAX, Backing::SharedMemory)
            .is_ok());
    }

    #[test]
    fn the_hosts_figures_are_read_as_the_kernel_writes_them() {
        let meminfo =
            "MemTotal:       24586332 kB\nMemFree:         1234 kB\nMemAvailable:   20971520 kB\n";
        assert_eq!(meminfo_available(meminfo), Some(20 * GIB));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        assert_eq!(meminfo_available("MemAvailable: lots kB\n"), None);
        assert_eq!(human(1536 << 20), "1.5 GiB");
        assert_eq!(human(512), "512 B");

        let root = std::env::temp_dir().join(format!("kvpeer-room-{}", std::process::id()));
        let group = root.join("machine.slice/engine.scope");
        std::fs::create_dir_all(&group).unwrap();
        std::fs::write(group.join("memory.max"), "8589934592\n").unwrap();
        std::fs::write(group.join("memory.current"), "1073741824\n").unwrap();
        let self_cgroup = "0::/machine.slice/engine.scope\n";
        assert_eq!(cgroup_free(&root, self_cgroup), Some(7 * GIB));
        std::fs::write(group.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_free(&root, self_cgroup), None, "no limit");
        assert_eq!(
            cgroup_free(&root, "1:memory:/old\n"),
            None,
            "nothing under v1's mount"
        );
        std::fs::remove_dir_all(&root).unwrap();

        // This host: something is read, and /dev/shm has a size.
        let here = Room::of_this_host();
        assert!(here.memory_available.is_some_and(|m| m > 0), "{here:?}");
        assert!(here.shm_free.is_some(), "{here:?}");
    }

    #[test]
    fn a_cgroup_v1_limit_is_read_where_the_group_is_named_or_mounted_at_the_root() {
        let root = std::env::temp_dir().join(format!("kvpeer-room-v1-{}", std::process::id()));
        let memory = root.join("memory");
        let write = |dir: &Path, limit: u64, usage: u64, hierarchical: u64| {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join("memory.limit_in_bytes"), format!("{limit}\n")).unwrap();
            std::fs::write(dir.join("memory.usage_in_bytes"), format!("{usage}\n")).unwrap();
            std::fs::write(
                dir.join("memory.stat"),
                format!("cache 0\nhierarchical_memory_limit {hierarchical}\nrss 1\n"),
            )
            .unwrap();
        };
        // On the host: the group /proc/self/cgroup names (the controller among others).
        let group = memory.join("system.slice/engine.service");
        write(&group, 8 * GIB, GIB, 9_223_372_036_854_771_712);
        let host_view = "5:cpu,memory:/system.slice/engine.service\n0::/system.slice\n";
        assert_eq!(cgroup_free(&root, host_view), Some(7 * GIB));
        // An ancestor's limit below the group's own.
        write(&group, 8 * GIB, GIB, 4 * GIB);
        assert_eq!(cgroup_free(&root, host_view), Some(3 * GIB));
        std::fs::remove_dir_all(&memory).unwrap();

        // In a container (podman on cgroup v1, as seen here): /proc/self/cgroup names the
        // host's path, the container's own group is mounted at the controller's root.
        write(&memory, 256 << 20, 1 << 20, 256 << 20);
        let container_view = "4:memory:/libpod_parent/libpod-0123\n0::/libpod_parent/libpod-0123\n";
        assert_eq!(cgroup_free(&root, container_view), Some(255 << 20));
        // No limit: the largest page-aligned i64.
        write(
            &memory,
            9_223_372_036_854_771_712,
            GIB,
            9_223_372_036_854_771_712,
        );
        assert_eq!(cgroup_free(&root, container_view), None);
        // v2's files win where they are there.
        let v2 = root.join("libpod_parent/libpod-0123");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "2147483648\n").unwrap();
        std::fs::write(v2.join("memory.current"), "1073741824\n").unwrap();
        assert_eq!(cgroup_free(&root, container_view), Some(GIB));
        assert_eq!(
            cgroup_free(&root, "9:name=systemd:/\n"),
            None,
            "no memory controller"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn in_a_container_the_refusal_names_the_option_that_gives_it_more() {
        let room = Room {
            memory_available: Some(20 * GIB),
            cgroup_free: Some(GIB),
            shm_free: Some(64 << 20),
            in_container: true,
        };
        let shm = room
            .check(128 << 20, 64, 2 << 20, Backing::SharedMemory)
            .unwrap_err();
        assert_eq!(shm.what, "/dev/shm");
        assert!(
            shm.to_string().ends_with(
                "or free memory first (this container's /dev/shm is its own: start it with a \
                 larger --shm-size)"
            ),
            "{shm}"
        );
        let limit = room
            .check(2 * GIB, 1024, 2 << 20, Backing::Private)
            .unwrap_err();
        assert!(
            limit
                .to_string()
                .ends_with("start it with a larger --memory)"),
            "{limit}"
        );
        let outside = Room {
            in_container: false,
            ..room
        };
        let plain = outside
            .check(2 * GIB, 1024, 2 << 20, Backing::Private)
            .unwrap_err();
        assert!(
            plain.to_string().ends_with("or free memory first"),
            "{plain}"
        );
    }
}
