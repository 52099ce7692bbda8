//! Opening a peer's POSIX shared-memory pool object by name (as `shm_open`, without the leading
//! `/`), for the shm plane, which proves it is the peer's before mapping it. The node's own pool
//! is opened and mapped only by its owner in kvpeer-store.

use std::fs::File;

use nix::fcntl::OFlag;
use nix::sys::mman::shm_open;
use nix::sys::stat::Mode;

/// Opens the existing object `name` read-write.
pub(crate) fn open(name: &str) -> Result<File, nix::Error> {
    let fd = shm_open(format!("/{name}").as_str(), OFlag::O_RDWR, Mode::empty())?;
    Ok(File::from(fd))
}
