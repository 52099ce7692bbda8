//! Plaintext in and out of a rustls connection over a non-blocking socket, with the same
//! meaning as `read(2)` and `write(2)` on the socket itself, so a state machine that reads and
//! writes a plain socket reads and writes a TLS one the same way: `Ok(0)` from [`read`] is the
//! end of the stream, `WouldBlock` means "not now, the poll will say when".
//!
//! Called from the tcp plane's sender and receiver threads, each on sockets it owns; nothing
//! here blocks. With edge-triggered polling a caller that sees `WouldBlock` waits for the next
//! event of that direction, so these return it only when the socket itself said so: [`read`]
//! after the socket had no more bytes, [`write`] and [`flush`] after it took no more. The
//! handshake runs inside them: [`read`] processes what arrived and sends what rustls answers,
//! [`write`] and [`flush`] send what it has ready (the client's first flight included).

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;

use rustls::Connection;

/// Sends what rustls has ready (handshake messages, records) as far as the socket takes it:
/// `Ok(())` once nothing is left, `WouldBlock` while the socket is full.
pub(crate) fn flush(sock: &TcpStream, conn: &mut Connection) -> io::Result<()> {
    while conn.wants_write() {
        match conn.write_tls(&mut &*sock) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// [`flush`], where a full socket is no error (what is left goes at the next write or read).
fn flush_what_fits(sock: &TcpStream, conn: &mut Connection) -> io::Result<()> {
    match flush(sock, conn) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(()),
        other => other,
    }
}

/// Reads plaintext into `buf`: `Ok(0)` at the end of the stream (the peer's close_notify, or
/// its socket's end without one: a frame cut short is the caller's to see), `WouldBlock` once
/// the socket has nothing more, and `InvalidData` for a TLS error (a bad certificate, a record
/// that does not authenticate), after rustls's alert was sent where the socket takes it.
pub(crate) fn read(sock: &TcpStream, conn: &mut Connection, buf: &mut [u8]) -> io::Result<usize> {
    read_noting_drain(sock, conn, buf).map(|(n, _)| n)
}

/// [`read`], and whether the socket was found drained meanwhile with nothing left decrypted
/// (the socket's last read was short, epoll(7)'s other sign of a drained stream, and `buf` took
/// all the plaintext there was): the caller may wait for the next readiness instead of asking
/// again only to hear `WouldBlock`, a system call per message saved.
pub(crate) fn read_noting_drain(
    sock: &TcpStream,
    conn: &mut Connection,
    buf: &mut [u8],
) -> io::Result<(usize, bool)> {
    let mut ended = false;
    let mut short = false;
    loop {
        match conn.reader().read(buf) {
            Ok(n) => return Ok((n, short && n > 0 && n < buf.len())),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok((0, false)),
            Err(e) => return Err(e),
        }
        if ended {
            return Ok((0, false));
        }
        let mut noted = NotingShort { sock, short: false };
        match conn.read_tls(&mut noted) {
            Ok(0) => ended = true,
            Ok(_) => short = noted.short,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                // Best effort: a peer whose socket no longer takes our bytes may still have
                // sent its last ones, and those are read to the end first.
                let _ = flush_what_fits(sock, conn);
                return Err(e);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        if let Err(e) = conn.process_new_packets() {
            let _ = flush(sock, conn);
            return Err(io::Error::new(ErrorKind::InvalidData, e));
        }
        // As above: what the peer sent is read whether or not it takes our bytes.
        let _ = flush_what_fits(sock, conn);
    }
}

/// The socket as rustls reads it, noting whether its last read was short (fewer bytes than
/// asked: the socket had no more).
struct NotingShort<'a> {
    sock: &'a TcpStream,
    short: bool,
}

impl Read for NotingShort<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = (&mut &*self.sock).read(buf)?;
        self.short = n < buf.len();
        Ok(n)
    }
}

/// Writes plaintext from `buf`: how many of its bytes rustls took (encrypted into records, so
/// `buf` is not read again), `WouldBlock` while the socket is full. Meant for after the
/// handshake: during it rustls only buffers, up to its limit.
pub(crate) fn write(sock: &TcpStream, conn: &mut Connection, buf: &[u8]) -> io::Result<usize> {
    flush(sock, conn)?;
    let n = conn.writer().write(buf)?;
    if n == 0 && !buf.is_empty() {
        return Err(ErrorKind::WouldBlock.into());
    }
    flush_what_fits(sock, conn)?;
    Ok(n)
}

/// After a write failed (the peer closed): the TLS error its alert carries, if one arrived
/// before the close, so the writer learns "unknown CA" rather than "broken pipe". Best effort:
/// a reset that overtook the alert leaves nothing to read, and then this is `None`.
pub(crate) fn alert_before_close(sock: &TcpStream, conn: &mut Connection) -> Option<io::Error> {
    loop {
        match conn.read_tls(&mut &*sock) {
            Ok(0) => return None,
            Ok(_) => {
                if let Err(e) = conn.process_new_packets() {
                    return Some(io::Error::new(ErrorKind::InvalidData, e));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}
