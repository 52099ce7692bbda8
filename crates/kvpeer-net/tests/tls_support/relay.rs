//! A relay from a loopback port of its own to another address, recording what the dialer
//! sent (the TLS suites check that the wire carries none of what TLS hides). Each connection is
//! forwarded both ways on threads of its own; the relay lives as long as the test process.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A relay to some address: dial `addr` instead; `seen` is every byte the dialers sent.
pub(crate) struct Relay {
    pub(crate) addr: SocketAddr,
    pub(crate) seen: Arc<Mutex<Vec<u8>>>,
}

impl Relay {
    /// Listens on a free loopback port and forwards each connection to `to`.
    pub(crate) fn to(to: SocketAddr) -> Relay {
        Relay::answering_late(to, Duration::ZERO)
    }

    /// As [`Relay::to`], and each connection's answers (from `to` to the dialer) start only
    /// `delay` after it was made: the dialer's opening bytes go before it hears anything.
    pub(crate) fn answering_late(to: SocketAddr, delay: Duration) -> Relay {
        Relay::with(to, delay, None)
    }

    /// As [`Relay::to`], flipping every bit of the byte at offset `at` of each connection's
    /// stream from the dialer (a corruption in transit that TCP's checksum missed).
    pub(crate) fn corrupting(to: SocketAddr, at: usize) -> Relay {
        Relay::with(to, Duration::ZERO, Some(at))
    }

    fn with(to: SocketAddr, delay: Duration, corrupt_at: Option<usize>) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<u8>>> = Arc::default();
        let record = seen.clone();
        std::thread::spawn(move || {
            for inbound in listener.incoming() {
                let Ok(inbound) = inbound else { return };
                let Ok(outbound) = TcpStream::connect(to) else {
                    return;
                };
                let (a, b) = (inbound.try_clone().unwrap(), outbound.try_clone().unwrap());
                let record = record.clone();
                std::thread::spawn(move || pipe(a, b, Some(&record), corrupt_at));
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    pipe(outbound, inbound, None, None)
                });
            }
        });
        Relay { addr, seen }
    }
}

/// Copies `from` to `to` until either ends, recording into `record` (what was read) and
/// inverting the byte at offset `corrupt_at` on the way.
fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    record: Option<&Mutex<Vec<u8>>>,
    corrupt_at: Option<usize>,
) {
    let mut buf = [0u8; 65536];
    let mut offset = 0usize;
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 {
            break;
        }
        if let Some(record) = record {
            record.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        if let Some(at) = corrupt_at.filter(|at| (offset..offset + n).contains(at)) {
            buf[at - offset] ^= 0xFF;
        }
        offset += n;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Whether `needle` occurs in `haystack`.
pub(crate) fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
