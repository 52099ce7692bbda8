//! The non-blocking socket steps every ZMTP driver takes (the control channel's outbound side,
//! the KV event stream's sockets): start a connect, see whether it finished, read what is
//! there, write what a connection has to send. Each returns as soon as the socket would block;
//! none sleeps. Called on the thread that owns the socket. A failure is a [`LinkLoss`]: the
//! cause a lost connection carries up to the user. A control connection may run over TLS
//! (`tls/`): then its reads and writes go through its rustls session, with the same meaning
//! (`tls::read`, `tls::write`), and what rustls holds is written with what the connection has.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use kvpeer_core::{LinkLoss, SendFailure};
use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage};
use tracing::warn;

/// Something with bytes for the socket (a ZMTP connection implements it, in
/// `zmtp/connection.rs`: this module knows sockets, not protocols).
pub(crate) trait Outgoing {
    /// Bytes to write now.
    fn transmit(&self) -> &[u8];
    /// `n` bytes of them were written.
    fn advance(&mut self, n: usize);
}

/// Starts a non-blocking connect to `addr`: the socket (connecting, or connected already),
/// `Err(Some(cause))` when the connect failed at once, `Err(None)` when no socket could be
/// made (out of descriptors: try again later).
pub(crate) fn start_connect(addr: SocketAddr) -> Result<TcpStream, Option<LinkLoss>> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = match socket::socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) {
        Ok(fd) => fd,
        Err(e) => {
            if let Some(suppressed) = crate::admit_warning("cannot make a socket") {
                warn!(error = %e, suppressed, "cannot make a socket; retrying");
            }
            return Err(None);
        }
    };
    match socket::connect(fd.as_raw_fd(), &SockaddrStorage::from(addr)) {
        Ok(()) | Err(Errno::EINPROGRESS) | Err(Errno::EINTR) => Ok(TcpStream::from(fd)),
        Err(e) => Err(Some(LinkLoss::of_connect(addr, &std::io::Error::from(e)))),
    }
}

/// Whether the connect `stream` started (to `addr`) is done: `Ok(true)` connected (no-delay
/// set), `Ok(false)` not yet, `Err` with the reason it failed.
pub(crate) fn connect_done(stream: &TcpStream, addr: SocketAddr) -> Result<bool, LinkLoss> {
    match stream.take_error() {
        Ok(Some(e)) | Err(e) => Err(LinkLoss::of_connect(addr, &e)),
        Ok(None) => match stream.peer_addr() {
            Ok(_) => {
                let _ = stream.set_nodelay(true);
                Ok(true)
            }
            Err(e) if e.kind() == ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(LinkLoss::of_connect(addr, &e)),
        },
    }
}

/// How a read of a socket ended, for an edge-triggered poll: whether the socket may still hold
/// input (so its driver must come back to it without a new event) or was read until it had
/// none (a short read, or one that would block: epoll(7)'s two signs of a drained stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadEnd {
    /// Nothing more to read until the next event.
    Drained,
    /// Stopped early (the budget, or the reader holds enough): more may wait.
    More,
}

/// Reads what `stream` has (through `tls`, its TLS session, when it has one), up to about
/// `budget` bytes, handing each read to `on_bytes`; stops when the socket would block (or, in
/// clear, a short read shows it drained for now; over TLS only the socket's own `WouldBlock`
/// does, as rustls hands out what it decrypted so far), or after a read for
/// which `on_bytes` says `false` (the reader holds all it should this round; what else came
/// waits in the socket, and so does its end of stream). End of stream or an error is the
/// reason the connection ends.
pub(crate) fn read_while(
    stream: &mut TcpStream,
    tls: Option<&mut rustls::Connection>,
    budget: usize,
    mut on_bytes: impl FnMut(&[u8]) -> Result<bool, LinkLoss>,
) -> Result<ReadEnd, LinkLoss> {
    let mut chunk = [0u8; 16 * 1024];
    let mut budget = budget;
    if let Some(tls) = tls {
        // Over TLS a short plaintext read says nothing of the socket (rustls hands out what it
        // decrypted so far): the socket's own `WouldBlock`, or its short read with nothing left
        // decrypted (`read_noting_drain`), ends the read as drained.
        loop {
            let (n, drained) = match crate::tls::read_noting_drain(stream, tls, &mut chunk) {
                Ok((0, _)) => return Err(LinkLoss::ClosedByPeer),
                Ok(read) => read,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(ReadEnd::Drained),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::InvalidData => {
                    return Err(LinkLoss::Tls(e.to_string().into()))
                }
                Err(e) => return Err(LinkLoss::Socket(e.kind())),
            };
            if !on_bytes(&chunk[..n])? {
                return Ok(ReadEnd::More);
            }
            if drained {
                // The socket's last read was short and nothing decrypted is left.
                return Ok(ReadEnd::Drained);
            }
            budget = budget.saturating_sub(n);
            if budget == 0 {
                return Ok(ReadEnd::More);
            }
        }
    }
    loop {
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Err(LinkLoss::ClosedByPeer),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(ReadEnd::Drained),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(LinkLoss::Socket(e.kind())),
        };
        if !on_bytes(&chunk[..n])? {
            return Ok(ReadEnd::More);
        }
        if n < chunk.len() {
            // A short read drained the socket for now; anything that comes later is a new
            // edge of the poll.
            return Ok(ReadEnd::Drained);
        }
        budget = budget.saturating_sub(n);
        if budget == 0 {
            return Ok(ReadEnd::More);
        }
    }
}

/// What a write of a connection's bytes did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wrote {
    /// Some bytes went.
    pub(crate) any: bool,
    /// The socket took no more (it would block): the next edge of the poll says when it does.
    pub(crate) blocked: bool,
    /// How many bytes went.
    pub(crate) bytes: usize,
}

impl Wrote {
    /// `bytes` went; the socket took no more when `blocked`.
    fn of(bytes: usize, blocked: bool) -> Wrote {
        Wrote {
            any: bytes > 0,
            blocked,
            bytes,
        }
    }
}

/// Writes what `conn` has for `stream` until the socket would block or nothing is left.
pub(crate) fn write_available(
    stream: &mut TcpStream,
    tls: Option<&mut rustls::Connection>,
    conn: &mut impl Outgoing,
) -> Result<Wrote, LinkLoss> {
    write_up_to(stream, tls, conn, usize::MAX)
}

/// Writes what `conn` has for `stream` until the socket would block, nothing is left, or
/// `limit` bytes went (the rest waits for the caller's next turn).
pub(crate) fn write_up_to(
    stream: &mut TcpStream,
    tls: Option<&mut rustls::Connection>,
    conn: &mut impl Outgoing,
    limit: usize,
) -> Result<Wrote, LinkLoss> {
    if let Some(tls) = tls {
        return write_tls_up_to(stream, tls, conn, limit);
    }
    let mut written = 0usize;
    loop {
        let bytes = conn.transmit();
        let room = limit - written;
        if bytes.is_empty() || room == 0 {
            return Ok(Wrote::of(written, false));
        }
        match stream.write(&bytes[..bytes.len().min(room)]) {
            Ok(0) => return Err(LinkLoss::SendFailed(SendFailure::NoBytesTaken)),
            Ok(n) => {
                conn.advance(n);
                written += n;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Wrote::of(written, true)),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(LinkLoss::Socket(e.kind())),
        }
    }
}

/// [`write_up_to`] over TLS: the connection's bytes are encrypted as the socket takes them;
/// during the handshake only the handshake's own messages go (the connection's wait, and
/// the socket is not called full: the read that ends the handshake comes back to write).
fn write_tls_up_to(
    stream: &mut TcpStream,
    tls: &mut rustls::Connection,
    conn: &mut impl Outgoing,
    limit: usize,
) -> Result<Wrote, LinkLoss> {
    if tls.is_handshaking() {
        return tls_flushed(stream, tls, 0);
    }
    let mut written = 0usize;
    loop {
        let bytes = conn.transmit();
        let room = limit - written;
        if bytes.is_empty() || room == 0 {
            // What rustls holds of them goes too (records the socket did not take yet).
            return tls_flushed(stream, tls, written);
        }
        match crate::tls::write(stream, tls, &bytes[..bytes.len().min(room)]) {
            Ok(n) => {
                conn.advance(n);
                written += n;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Wrote::of(written, true)),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(LinkLoss::Socket(e.kind())),
        }
    }
}

/// What rustls holds goes to the socket as far as it takes it; `written` of the connection's
/// bytes went before.
fn tls_flushed(
    stream: &TcpStream,
    tls: &mut rustls::Connection,
    written: usize,
) -> Result<Wrote, LinkLoss> {
    match crate::tls::flush(stream, tls) {
        Ok(()) => Ok(Wrote::of(written, false)),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(Wrote::of(written, true)),
        Err(e) => Err(LinkLoss::Socket(e.kind())),
    }
}

/// Up to `buf.len()` bytes waiting on `stream`, not taken from it (`MSG_PEEK`): how many came
/// (0 while none did), `Err` when the peer closed before all did or the socket failed. How a
/// listener that speaks both tells a TLS client (0x16) from a plaintext ZMTP peer (0xFF), and a
/// dialer that wants TLS reads the listener's offer.
pub(crate) fn peek_up_to(stream: &TcpStream, buf: &mut [u8]) -> Result<usize, LinkLoss> {
    loop {
        return match stream.peek(buf) {
            Ok(0) => Err(LinkLoss::ClosedByPeer),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Err(LinkLoss::Socket(e.kind())),
        };
    }
}

/// Takes `n` bytes that [`peek_up_to`] saw waiting from `stream` (at most 64).
pub(crate) fn discard_peeked(stream: &mut TcpStream, n: usize) -> Result<(), LinkLoss> {
    let mut buf = [0u8; 64];
    let mut left = n.min(buf.len());
    while left > 0 {
        match stream.read(&mut buf[..left]) {
            Ok(0) => return Err(LinkLoss::ClosedByPeer),
            Ok(k) => left -= k,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(LinkLoss::Socket(e.kind())),
        }
    }
    Ok(())
}

/// Writes all of `bytes`, the first a fresh connection sends, to `stream` at once. A socket
/// that has sent nothing takes a few KiB; one that does not is failed, never left half written.
pub(crate) fn write_opening(stream: &mut TcpStream, bytes: &[u8]) -> Result<(), LinkLoss> {
    loop {
        return match stream.write(bytes) {
            Ok(n) if n == bytes.len() => Ok(()),
            Ok(_) => Err(LinkLoss::Socket(ErrorKind::WriteZero)),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Err(LinkLoss::Socket(e.kind())),
        };
    }
}

/// One `accept` on a non-blocking listener.
pub(crate) enum Accepted {
    /// A connection, made non-blocking with no-delay, and its source address.
    Stream(TcpStream, std::net::IpAddr),
    /// Nothing waits.
    None,
    /// `accept` (or making the socket non-blocking) failed: out of descriptors, most likely.
    Failed(std::io::Error),
}

/// Accepts one waiting connection from `listener`.
pub(crate) fn accept(listener: &TcpListener) -> Accepted {
    loop {
        return match listener.accept() {
            Ok((stream, addr)) => match stream.set_nonblocking(true) {
                Ok(()) => {
                    let _ = stream.set_nodelay(true);
                    Accepted::Stream(stream, addr.ip().to_canonical())
                }
                Err(e) => Accepted::Failed(e),
            },
            Err(e) if e.kind() == ErrorKind::WouldBlock => Accepted::None,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Accepted::Failed(e),
        };
    }
}

/// The kernel's `TCP_INFO` of `stream`, with how many of its bytes the kernel wrote (an older
/// kernel writes fewer fields; the rest stay zero).
fn tcp_info(stream: &TcpStream) -> Option<(nix::libc::tcp_info, usize)> {
    let mut info = std::mem::MaybeUninit::<nix::libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<nix::libc::tcp_info>() as nix::libc::socklen_t;
    // SAFETY: `info` is a zeroed `tcp_info` we own and `len` its size; the kernel writes at most
    // `len` bytes into it and sets `len` to what it wrote. Every field is a plain integer, so
    // any bytes (and the zeroes past what an older kernel writes) are a valid value.
    let rc = unsafe {
        nix::libc::getsockopt(
            stream.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: zero-initialised and partly written by the kernel: a valid `tcp_info`.
    let info = unsafe { info.assume_init() };
    Some((info, usize::try_from(len).unwrap_or(0)))
}

/// While the peer's host holds its receive window shut (our bytes wait to leave, our kernel
/// probes the window at spaced-out times), how long ago its last segment came; `None` when the
/// window is open (or the kernel does not say). A host answering window probes is up.
pub(crate) fn window_shut_since(stream: &TcpStream) -> Option<std::time::Duration> {
    let (info, wrote) = tcp_info(stream)?;
    let end = std::mem::offset_of!(nix::libc::tcp_info, tcpi_snd_wnd) + 4;
    let shut = (wrote >= end && info.tcpi_snd_wnd == 0) || info.tcpi_probes > 0;
    shut.then(|| std::time::Duration::from_millis(u64::from(info.tcpi_last_ack_recv)))
}

/// Segments the peer's host has sent us on `stream` so far (`TCP_INFO`'s `tcpi_segs_in`,
/// Linux 4.2 on): every segment counts, a bare ACK too, so a count that moved means the host's
/// kernel is up. `None` when the kernel does not say.
pub(crate) fn segments_in(stream: &TcpStream) -> Option<u32> {
    let (info, wrote) = tcp_info(stream)?;
    let end = std::mem::offset_of!(nix::libc::tcp_info, tcpi_segs_in) + 4;
    (wrote >= end).then_some(info.tcpi_segs_in)
}
