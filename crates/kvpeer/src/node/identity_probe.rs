//! Who the node at an address says it is: the identity a kvpeer node's control ROUTER tells in
//! its READY (`X-Kvpeer-Identity`), asked once, at an edge (a command line), before a session.
//!
//! Contract: a blocking TCP connect to `addr` (bounded by `timeout`), our ZMTP greeting and a
//! DEALER READY with an empty identity (the node closes such a connection: it never carries a
//! message), then the node's READY is read: `Some(identity)` when it tells one, `None` for a
//! ROUTER that tells none (stock vLLM), or when nothing answers in time. Sessions are keyed by
//! the identity a node answers as, so a consumer that names a node otherwise (`localhost:5600`
//! for a node that calls itself `127.0.0.1:5600`) takes this one instead. Never called on a
//! node's event loop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvpeer_net::zmtp::{greeting, ready_with, Decoder, Input};
use kvpeer_proto::PeerId;

/// The identity the node at `addr` tells, if it tells one within `timeout`.
pub fn identity_at(addr: SocketAddr, timeout: Duration) -> Option<PeerId> {
    let deadline = Instant::now() + timeout;
    let mut stream = TcpStream::connect_timeout(&addr, timeout).ok()?;
    let mut hello = greeting().to_vec();
    hello.extend(ready_with(&[("Socket-Type", b"DEALER"), ("Identity", b"")]));
    stream.write_all(&hello).ok()?;
    // A READY is small: a bound on what is read keeps a port that streams bytes harmless.
    let mut decoder = Decoder::new(64 * 1024);
    let mut buf = [0u8; 4096];
    let mut read = 0usize;
    while read < 64 * 1024 {
        let left = deadline.checked_duration_since(Instant::now())?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        let n = stream.read(&mut buf).ok().filter(|n| *n > 0)?;
        read += n;
        decoder.push(&buf[..n]);
        while let Some(input) = decoder.next_input().ok()? {
            if let Input::Ready { announced, .. } = input {
                let text = String::from_utf8(announced?).ok()?;
                return PeerId::parse(&text).ok();
            }
        }
    }
    None
}
