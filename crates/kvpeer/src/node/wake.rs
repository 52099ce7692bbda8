//! Wakes the node's thread when a data plane completes something.
//!
//! A non-blocking pipe: the plane's worker threads (and API calls, and signals) write a byte,
//! the node's thread polls the read end together with the control channel's sockets, so it
//! sleeps until there is work (no interval polling) and drains the pipe when it wakes. A pipe
//! rather than a socket pair: a byte written to a pipe costs about half as much CPU (no socket
//! buffer to allocate), and every API call writes one.
//!
//! The hook ([`WakePipe::hook`]) writes its byte only while the node's thread may be asleep:
//! while that thread is awake (between [`WakePipe::awake`] and [`WakePipe::prepare_sleep`]) it
//! only raises a flag, which `prepare_sleep` reads, so the thread steps again instead of
//! sleeping. A plane that completes a copy inline, on the node's own thread, then costs no
//! `write`, no wake-up and no `read`s of the pipe, at most a poll with no timeout (the
//! producer's system calls per request of 64 keys on the shm plane: 11 before, 7–8 now,
//! docs/benchmarks.md). The flag and the "asleep" mark are each stored before the other is read
//! (sequentially consistent), so at least one side sees the other: news is never lost between
//! the thread's last look and its sleep.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

use nix::fcntl::OFlag;

use kvpeer_net::data::shm::Wake;

/// The read end, owned by the node's thread.
#[derive(Debug)]
pub(crate) struct WakePipe {
    read: File,
    write: Arc<File>,
    flags: Arc<Flags>,
}

/// What the hook and the node's thread tell each other.
#[derive(Debug)]
struct Flags {
    /// A hook ran since the node's thread last prepared to sleep.
    news: AtomicBool,
    /// The node's thread may be asleep on the pipe (true until its first wait: the safe side).
    sleeping: AtomicBool,
}

impl WakePipe {
    /// A new pipe.
    pub(crate) fn new() -> std::io::Result<Self> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        Ok(WakePipe {
            read: File::from(read),
            write: Arc::new(File::from(write)),
            flags: Arc::new(Flags {
                news: AtomicBool::new(false),
                sleeping: AtomicBool::new(true),
            }),
        })
    }

    /// The hook to hand to data planes (callable from any thread).
    pub(crate) fn hook(&self) -> Wake {
        let write = self.write.clone();
        let flags = self.flags.clone();
        Arc::new(move || {
            flags.news.store(true, SeqCst);
            if flags.sleeping.load(SeqCst) {
                // A full pipe already means "wake up": dropping this byte loses nothing.
                let _ = (&*write).write(&[1]);
            }
        })
    }

    /// The node's thread is about to sleep on the pipe (or to hand it to a caller that will):
    /// from now on the hook writes. Returns whether a hook ran while it was awake; then it must
    /// step again before sleeping.
    pub(crate) fn prepare_sleep(&self) -> bool {
        self.flags.sleeping.store(true, SeqCst);
        self.flags.news.swap(false, SeqCst)
    }

    /// The node's thread woke and steps before it sleeps again: the hook only raises the flag.
    pub(crate) fn awake(&self) {
        self.flags.sleeping.store(false, SeqCst);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes waiting in the pipe (read and counted, non-blocking).
    fn bytes_in(pipe: &WakePipe) -> usize {
        let mut buf = [0u8; 256];
        let mut n = 0;
        while let Ok(k) = (&pipe.read).read(&mut buf) {
            if k == 0 {
                break;
            }
            n += k;
        }
        n
    }

    #[test]
    fn the_hook_writes_only_while_the_thread_may_sleep() {
        let pipe = WakePipe::new().unwrap();
        let hook = pipe.hook();
        // Before the first wait the thread counts as asleep: every hook writes.
        hook();
        assert_eq!(bytes_in(&pipe), 1);
        assert!(pipe.prepare_sleep(), "that news is reported too");
        // Awake: the hook raises the flag and writes nothing; the thread does not sleep on it.
        pipe.awake();
        hook();
        hook();
        assert_eq!(bytes_in(&pipe), 0, "no system call while awake");
        assert!(pipe.prepare_sleep(), "news seen before sleeping");
        assert!(!pipe.prepare_sleep(), "seen once");
        // Asleep: a hook from another thread writes its byte, which wakes the poll.
        std::thread::scope(|s| {
            s.spawn(|| hook());
        });
        assert_eq!(bytes_in(&pipe), 1);
    }

    /// The race the flags close: a hook on another thread while the node's thread goes from
    /// awake to asleep is either seen by `prepare_sleep` or writes a byte, never neither.
    #[test]
    fn news_is_never_lost_between_the_last_look_and_the_sleep() {
        let pipe = WakePipe::new().unwrap();
        let hook = pipe.hook();
        let start = std::sync::Barrier::new(2);
        for _ in 0..2_000 {
            // A clean start: no news left from the last round, the thread awake, the pipe empty.
            pipe.prepare_sleep();
            pipe.awake();
            let _ = bytes_in(&pipe);
            let seen = std::thread::scope(|s| {
                s.spawn(|| {
                    start.wait();
                    hook()
                });
                start.wait();
                pipe.prepare_sleep()
            });
            // The hook has run (the scope joined it): it either raised the flag before the
            // thread looked, or wrote a byte.
            let woke = bytes_in(&pipe) > 0;
            assert!(
                seen || woke,
                "news neither seen nor written: the thread would sleep on it"
            );
        }
    }
}
