//! Wakes the node's thread when a data plane completes something.
//!
//! A non-blocking socket pair: the plane's worker threads write a byte, the node's thread polls
//! the read end together with the control channel's sockets, so it sleeps until there is work
//! (no interval polling) and drains the pipe when it wakes.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use kvpeer_net::shm::Wake;

/// The read end, owned by the node's thread.
#[derive(Debug)]
pub struct WakePipe {
    read: UnixStream,
    write: Arc<UnixStream>,
}

impl WakePipe {
    /// A new pipe.
    pub fn new() -> std::io::Result<Self> {
        let (read, write) = UnixStream::pair()?;
        read.set_nonblocking(true)?;
        write.set_nonblocking(true)?;
        Ok(WakePipe {
            read,
            write: Arc::new(write),
        })
    }

    /// The hook to hand to data planes.
    pub fn hook(&self) -> Wake {
        let write = self.write.clone();
        Arc::new(move || {
            // A full pipe already means "wake up": dropping this byte loses nothing.
            let _ = (&*write).write(&[1]);
        })
    }

    /// Another handle on the write end (for a signal handler to write to).
    pub fn writer(&self) -> std::io::Result<UnixStream> {
        self.write.try_clone()
    }

    /// The descriptor to poll.
    pub fn fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    /// Empties the pipe after waking.
    pub fn drain(&self) {
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
