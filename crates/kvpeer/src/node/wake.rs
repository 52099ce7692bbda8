//! Wakes the node's thread when a data plane completes something.
//!
//! A non-blocking pipe: the plane's worker threads (and API calls, and signals) write a byte,
//! the node's thread polls the read end together with the control channel's sockets, so it
//! sleeps until there is work (no interval polling) and drains the pipe when it wakes. A pipe
//! rather than a socket pair: a byte written to a pipe costs about half as much CPU (no socket
//! buffer to allocate), and every API call writes one.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use nix::fcntl::OFlag;

use kvpeer_net::data::shm::Wake;

/// The read end, owned by the node's thread.
#[derive(Debug)]
pub(crate) struct WakePipe {
    read: File,
    write: Arc<File>,
}

impl WakePipe {
    /// A new pipe.
    pub(crate) fn new() -> std::io::Result<Self> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        Ok(WakePipe {
            read: File::from(read),
            write: Arc::new(File::from(write)),
        })
    }

    /// The hook to hand to data planes.
    pub(crate) fn hook(&self) -> Wake {
        let write = self.write.clone();
        Arc::new(move || {
            // A full pipe already means "wake up": dropping this byte loses nothing.
            let _ = (&*write).write(&[1]);
        })
    }

    /// Another handle on the write end (for a signal handler to write to).
    pub(crate) fn writer(&self) -> std::io::Result<File> {
        self.write.try_clone()
    }

    /// The descriptor to poll.
    pub(crate) fn fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    /// Empties the pipe after waking.
    pub(crate) fn drain(&self) {
        let mut buf = [0u8; 256];
        loop {
            match (&self.read).read(&mut buf) {
                Ok(n) if n > 0 => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                _ => return,
            }
        }
    }
}
