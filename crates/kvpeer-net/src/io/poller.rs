//! The one wait every socket driver of a thread shares: epoll, edge-triggered, with a timeout
//! in nanoseconds.
//!
//! A driver registers each descriptor once, for input, output and hang-up together, under a
//! [`Token`] it chooses; [`Poller::wait`] then hands back only the tokens whose descriptor
//! changed, so a wake costs what is ready, not what is open (the `ppoll(2)` this replaces
//! rebuilt and scanned the list of every socket on every wake). Edge-triggered means an event
//! says "something changed": the driver keeps, per socket, whether it may read and write, and
//! clears that only when a read or write stops short (`io::sockio` reports it), as epoll(7)
//! describes. Interest is never modified after registration, so a socket costs no system call
//! when its wish to write comes and goes.
//!
//! The timeout is `epoll_pwait2(2)`'s, in nanoseconds, so a deadline (a load's 1 ms timeout, a
//! heartbeat) is met within the kernel's timer slack; on a kernel without it (before 5.11) the
//! timeout is rounded up to the next millisecond for `epoll_wait(2)`, never down.
//!
//! Owned by one thread. Closing a descriptor removes it from the set (no other copy of it is
//! made), so drivers deregister nothing.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::errno::Errno;
use nix::libc;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};

/// Which socket an event is for: chosen by the driver that registered it.
pub(crate) type Token = u64;

/// What changed on one registered descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    /// The token it was registered with.
    pub(crate) token: Token,
    /// Input arrived (or a connection waits to be accepted, or the peer ended its stream).
    pub(crate) readable: bool,
    /// The socket takes bytes again (or a connect finished).
    pub(crate) writable: bool,
    /// The peer hung up or the socket failed: whatever it still holds is read, then it ends.
    pub(crate) closed: bool,
}

/// An epoll set.
#[derive(Debug)]
pub(crate) struct Poller {
    epoll: Epoll,
    events: Vec<EpollEvent>,
}

/// Whether `epoll_pwait2` is missing (ENOSYS once): the millisecond wait is used from then on.
static NO_PWAIT2: AtomicBool = AtomicBool::new(false);

impl Poller {
    /// An empty set.
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Poller {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?,
            events: vec![EpollEvent::empty(); 256],
        })
    }

    /// The epoll set's own descriptor: readable while a registered one has news, so a set can
    /// be waited on inside another wait (`events::wait_all`).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.0.as_fd()
    }

    /// Watches `fd` for input, output and hang-up, edge-triggered, as `token`.
    pub(crate) fn add(&self, fd: BorrowedFd<'_>, token: Token) -> std::io::Result<()> {
        let flags = EpollFlags::EPOLLIN
            | EpollFlags::EPOLLOUT
            | EpollFlags::EPOLLRDHUP
            | EpollFlags::EPOLLET;
        self.epoll.add(fd, EpollEvent::new(flags, token))?;
        Ok(())
    }

    /// Watches `fd` (a listener, a pipe) for input only, edge-triggered, as `token`.
    pub(crate) fn add_input(&self, fd: BorrowedFd<'_>, token: Token) -> std::io::Result<()> {
        let flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLET;
        self.epoll.add(fd, EpollEvent::new(flags, token))?;
        Ok(())
    }

    /// Sleeps until a registered descriptor changes or `timeout` passes (at most a day), and
    /// appends what changed to `out`. A signal's interruption returns nothing, as a timeout.
    pub(crate) fn wait(&mut self, timeout: Duration, out: &mut Vec<Ready>) -> std::io::Result<()> {
        let timeout = timeout.min(Duration::from_secs(86_400));
        let n = match self.wait_raw(timeout) {
            Ok(n) => n,
            Err(Errno::EINTR) => 0,
            Err(e) => return Err(e.into()),
        };
        let got = self.events.get(..n).unwrap_or_default();
        out.extend(got.iter().map(|e| {
            let flags = e.events();
            Ready {
                token: e.data(),
                readable: flags.intersects(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP),
                writable: flags.contains(EpollFlags::EPOLLOUT),
                closed: flags.intersects(EpollFlags::EPOLLHUP | EpollFlags::EPOLLERR),
            }
        }));
        if n == self.events.len() && n < 64 * 1024 {
            // A full batch: more may be waiting; the next wait takes a larger one.
            self.events.resize(n * 2, EpollEvent::empty());
        }
        Ok(())
    }

    fn wait_raw(&mut self, timeout: Duration) -> Result<usize, Errno> {
        let fd = self.epoll.0.as_fd().as_raw_fd();
        let max = libc::c_int::try_from(self.events.len()).unwrap_or(libc::c_int::MAX);
        let events = self.events.as_mut_ptr().cast::<libc::epoll_event>();
        if !NO_PWAIT2.load(Ordering::Relaxed) {
            let spec = libc::timespec {
                tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
            };
            // SAFETY: `events` points to `max` writable `epoll_event`s (EpollEvent is a
            // transparent wrapper of one), `spec` lives across the call, and a null signal mask
            // means none is changed; the kernel writes at most `max` entries.
            let n = unsafe { libc::epoll_pwait2(fd, events, max, &spec, std::ptr::null()) };
            match Errno::result(n) {
                Ok(n) => return Ok(usize::try_from(n).unwrap_or(0)),
                Err(Errno::ENOSYS) => NO_PWAIT2.store(true, Ordering::Relaxed),
                Err(e) => return Err(e),
            }
        }
        // Rounded up: a deadline is never met early, at worst a millisecond late.
        let ms = timeout.as_nanos().div_ceil(1_000_000);
        let ms = libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX);
        // SAFETY: as above, with a timeout in milliseconds and no signal mask.
        let n = unsafe { libc::epoll_wait(fd, events, max, ms) };
        Errno::result(n).map(|n| usize::try_from(n).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    #[test]
    fn reports_only_what_changed_and_each_change_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut poller = Poller::new().unwrap();
        poller.add_input(listener.as_fd(), 1).unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let mut out = Vec::new();
        poller.wait(Duration::from_secs(5), &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert!(out[0].token == 1 && out[0].readable);
        let (mut server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        poller.add(server.as_fd(), 2).unwrap();
        out.clear();
        poller.wait(Duration::from_secs(5), &mut out).unwrap();
        // A fresh socket is writable: one edge.
        assert_eq!(out.iter().map(|r| r.token).collect::<Vec<_>>(), vec![2]);
        assert!(out[0].writable && !out[0].readable);
        out.clear();
        // Nothing changed: the wait times out with nothing, after about the timeout.
        let t = Instant::now();
        poller.wait(Duration::from_millis(30), &mut out).unwrap();
        assert!(out.is_empty(), "{out:?}");
        assert!(t.elapsed() >= Duration::from_millis(30));
        client.write_all(b"hello").unwrap();
        poller.wait(Duration::from_secs(5), &mut out).unwrap();
        assert!(
            out.len() == 1 && out[0].token == 2 && out[0].readable,
            "{out:?}"
        );
        let mut buf = [0u8; 16];
        assert_eq!(server.read(&mut buf).unwrap(), 5);
        drop(client);
        out.clear();
        poller.wait(Duration::from_secs(5), &mut out).unwrap();
        assert!(out.len() == 1 && out[0].readable, "the hang-up: {out:?}");
        assert_eq!(server.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn a_short_timeout_is_met_in_microseconds_not_rounded_to_milliseconds() {
        let mut poller = Poller::new().unwrap();
        let mut out = Vec::new();
        // Many 200 µs waits: with a millisecond timeout each would take at least 1 ms.
        let t = Instant::now();
        for _ in 0..20 {
            poller.wait(Duration::from_micros(200), &mut out).unwrap();
        }
        let each = t.elapsed() / 20;
        assert!(each >= Duration::from_micros(200), "{each:?}");
        if !NO_PWAIT2.load(Ordering::Relaxed) {
            assert!(each < Duration::from_micros(900), "{each:?}");
        }
    }
}
