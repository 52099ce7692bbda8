//! Opening a pool's POSIX shared-memory object by name (as `shm_open`, without the leading
//! `/`), for the planes that map the local pool or a peer's.

use std::fs::File;

use nix::fcntl::OFlag;
use nix::sys::mman::shm_open;
use nix::sys::stat::Mode;

/// Opens the existing object `name`, read-only or read-write.
pub(crate) fn open(name: &str, writable: bool) -> Result<File, String> {
    let flags = if writable {
        OFlag::O_RDWR
    } else {
        OFlag::O_RDONLY
    };
    let fd =
        shm_open(format!("/{name}").as_str(), flags, Mode::empty()).map_err(|e| e.to_string())?;
    Ok(File::from(fd))
}
