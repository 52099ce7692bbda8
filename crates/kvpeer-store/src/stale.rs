//! Shared-memory objects of nodes that are gone: told apart from a live node's, and removed.
//!
//! A node killed with SIGKILL (or a crash, or an OOM kill) leaves its pool's object in
//! `/dev/shm` (`kvpeer-<tag>-<pid>`, gigabytes of memory) and its fence words
//! (`<name>.fence`). A node restarted in a container is PID 1 again and meets its own old
//! object: "File exists". Two containers sharing `/dev/shm` both run PID 1.
//!
//! How a live node's object is told from a dead one's: the node holds an exclusive `flock` on
//! its object for as long as the pool lives ([`crate::Pool::shm`]); the kernel drops it with
//! the process, however it ends. An object nobody holds the lock of, owned by this user, is a
//! dead node's. The lock works across PID namespaces (two containers sharing `/dev/shm` share
//! the file), where a PID check would not. For the scan at start ([`remove_stale_objects`]),
//! the name's PID must also be gone in this namespace, so a live node of a kvpeer release
//! from before the lock (it holds none) on this host's PID space is never touched.
//!
//! Called on the thread that builds a node, before its pool is made; nothing here blocks (the
//! lock is only tried).

use std::fs::File;
use std::os::unix::fs::MetadataExt;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;

/// Where POSIX shared-memory objects live.
const SHM_DIR: &str = "/dev/shm";

/// Whether the object `/name` is a dead node's: it exists, this user owns it, and nobody
/// holds its lock. Such an object is removed (with its fence words) and `true` returned.
pub fn remove_if_stale(name: &str) -> bool {
    let path = format!("/{name}");
    let Ok(fd) = shm_open(path.as_str(), OFlag::O_RDONLY, Mode::empty()) else {
        return false;
    };
    let file = File::from(fd);
    let ours = file
        .metadata()
        .is_ok_and(|m| m.uid() == nix::unistd::geteuid().as_raw());
    if !ours {
        return false;
    }
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(_held) => {
            // Nobody holds it: its node is gone. Unlinked while we hold the lock, so a node
            // starting under the same name meanwhile makes a new object, never this one.
            let _ = shm_unlink(path.as_str());
            let _ = shm_unlink(format!("/{}", crate::fence::object_name(name)).as_str());
            true
        }
        Err((_, Errno::EWOULDBLOCK)) => false,
        Err(_) => false,
    }
}

/// The PID a node's default object name carries (`kvpeer-<tag>-<pid>`), if it has that form.
fn default_name_pid(name: &str) -> Option<i32> {
    let rest = name.strip_prefix("kvpeer-")?;
    if rest.contains('.') {
        return None; // `<name>.fence`: goes with its pool
    }
    let (_, pid) = rest.rsplit_once('-')?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok().filter(|p| *p > 0)
}

/// Whether process `pid` exists in this PID namespace (one we may not signal exists too).
fn alive(pid: i32) -> bool {
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    )
}

/// Removes the objects of kvpeer nodes that are gone: default names (`kvpeer-<tag>-<pid>`)
/// whose PID is gone and whose lock nobody holds ([`remove_if_stale`]). Returns their names.
pub fn remove_stale_objects() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = default_name_pid(&name) else {
            continue;
        };
        if !alive(pid) && remove_if_stale(&name) {
            removed.push(name);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// An object `/name` as a node killed with SIGKILL leaves it: there, and nobody's lock.
    fn leave_unlocked(name: &str) {
        let fd = shm_open(
            format!("/{name}").as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .unwrap();
        drop(fd);
    }

    #[test]
    fn default_names_give_their_pid_and_nothing_else_does() {
        assert_eq!(default_name_pid("kvpeer-serve-1234"), Some(1234));
        assert_eq!(default_name_pid("kvpeer-my-tag-7"), Some(7));
        assert_eq!(default_name_pid("kvpeer-serve-1234.fence"), None);
        assert_eq!(default_name_pid("kvpeer-serve-"), None);
        assert_eq!(default_name_pid("kvpeer-serve-12a"), None);
        assert_eq!(default_name_pid("kvpeer-serve-0"), None);
        assert_eq!(default_name_pid("vllm-kv-1234"), None);
        assert_eq!(default_name_pid("kvpeer-serve-99999999999999"), None);
    }

    #[test]
    fn an_object_whose_lock_is_held_stays_and_one_whose_holder_is_gone_is_removed() {
        let name = format!("kvpeer-stale-test-{}", std::process::id());
        let pool = crate::Pool::shm(&name, 2, 4096, false).unwrap();
        assert!(
            !remove_if_stale(&name),
            "a live pool's object is never removed"
        );
        assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        // Left behind as a killed node leaves it: the name stays, the lock goes with the
        // pool (here: forget the pool's unlink by making the object again, unlocked).
        drop(pool);
        leave_unlocked(&name);
        assert!(remove_if_stale(&name));
        assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        assert!(!remove_if_stale(&name), "nothing left to remove");
    }

    #[test]
    fn a_new_pool_takes_the_name_of_a_dead_nodes_object() {
        let name = format!("kvpeer-reuse-test-{}", std::process::id());
        leave_unlocked(&name);
        let pool = crate::Pool::shm(&name, 2, 4096, false).unwrap();
        // A second live pool under the name is refused, saying so.
        let e = crate::Pool::shm(&name, 2, 4096, false).unwrap_err();
        assert!(e.to_string().contains("a live node holds it"), "{e}");
        drop(pool);
        assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
    }
}
