//! Hostile clients of the Prometheus endpoint against a real `kvpeer serve --metrics` (issue 19:
//! "one client dripping bytes at `/metrics` denies it to every scraper").
//!
//! Attackers open more connections than the endpoint keeps and hold them: some send nothing,
//! some drip a request head one byte every 200 ms (never finishing it), some send an endless
//! header. While they do, an honest scraper must get complete, correct answers (liveness, with a
//! generous bound, not a speed test), and, judged from the attackers' side, every attacker
//! connection must be closed by the node within a bound after the request-head deadline. A
//! control run shows the scraper served alone.
//!
//! Everything is on 127.0.0.1; ports come from the system (port 0, read back from the ready
//! line); every loop is bounded in time; only the node this test starts is killed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{metrics_addr, Proc};

/// A metric every node's `/metrics` carries.
const KNOWN_METRIC: &str = "kvpeer_sessions_opened_total";

/// How long an honest scrape may take at most (liveness, not speed: the node is a debug build
/// on a shared machine).
const SCRAPE_BOUND: Duration = Duration::from_secs(5);

/// The node's deadline for a whole request head (`metrics.rs`, `HEAD_DEADLINE`).
const HEAD_DEADLINE: Duration = Duration::from_secs(5);

/// How long after the head deadline an attacker connection may still be open (scheduling on a
/// loaded machine; the node checks deadlines far more often).
const CLOSE_SLACK: Duration = Duration::from_secs(5);

/// Attacker connections of each kind (three kinds): together more than the node keeps open.
const PER_KIND: usize = 40;

fn serve() -> Proc {
    let (p, _id) = Proc::serve(&[
        "--plane",
        "tcp",
        "--blocks",
        "16",
        "--block-len",
        "4096",
        "--metrics",
        "127.0.0.1:0",
    ]);
    p
}

/// `GET /metrics` with one deadline for the whole exchange; the full response or why not.
fn scrape(addr: &str, within: Duration) -> Result<String, String> {
    let deadline = Instant::now() + within;
    let sock: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sock, within).map_err(|e| format!("connect: {e}"))?;
    s.set_write_timeout(Some(within)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut response = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no complete response within {within:?} ({} bytes so far)",
                response.len()
            ));
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => response.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("read: {e} ({} bytes so far)", response.len())),
        }
    }
    let response = String::from_utf8(response).map_err(|e| format!("not UTF-8: {e}"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no head: {response:?}"))?;
    if !head.starts_with("HTTP/1.1 200 ") {
        return Err(format!("not 200: {head}"));
    }
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no Content-Length: {head}"))?;
    if body.len() != length {
        return Err(format!(
            "body {} bytes, Content-Length {length}",
            body.len()
        ));
    }
    if !body
        .lines()
        .any(|l| l.starts_with(KNOWN_METRIC) && l[KNOWN_METRIC.len()..].starts_with(' '))
    {
        return Err(format!("no {KNOWN_METRIC} sample in the body"));
    }
    Ok(body.to_owned())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Connects and sends nothing.
    Silent,
    /// A request head one byte every 200 ms, never finished.
    Drip,
    /// A header line that never ends, as fast as the node takes it.
    Endless,
}

/// One attacker connection.
struct Attacker {
    kind: Kind,
    stream: TcpStream,
    opened: Instant,
    sent: usize,
}

const DRIP: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: ";

impl Attacker {
    fn open(addr: &str, kind: Kind) -> Option<Attacker> {
        let sock: std::net::SocketAddr = addr.parse().unwrap();
        let stream = TcpStream::connect_timeout(&sock, Duration::from_secs(2)).ok()?;
        stream.set_nonblocking(true).unwrap();
        Some(Attacker {
            kind,
            stream,
            opened: Instant::now(),
            sent: 0,
        })
    }

    /// One step of its attack; whether the node has closed the connection (a read of 0 or an
    /// error, or a write the peer reset). Whatever the node answers is read and dropped.
    fn step(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return true,
            }
        }
        let chunk: Vec<u8> = match self.kind {
            Kind::Silent => return false,
            Kind::Drip => {
                let byte = DRIP.get(self.sent).copied().unwrap_or(b'a');
                vec![byte]
            }
            Kind::Endless => {
                let mut c = Vec::new();
                if self.sent == 0 {
                    c.extend_from_slice(b"GET /metrics HTTP/1.1\r\nX-Endless: ");
                }
                c.resize(c.len() + 8192, b'b');
                c
            }
        };
        match self.stream.write(&chunk) {
            Ok(n) => {
                self.sent += n;
                false
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => false,
            Err(_) => true,
        }
    }
}

/// What the attackers saw.
#[derive(Debug, Default)]
struct Seen {
    opened: usize,
    /// Lifetimes of connections the node closed, per kind.
    closed: Vec<(Kind, Duration)>,
    /// Connections still open when the attack gave up waiting, with their age.
    still_open: Vec<(Kind, Duration)>,
}

/// Keeps `PER_KIND` connections of each kind open (a closed one is replaced) until `stop`, then
/// waits (bounded) until the node has closed every one.
fn attack(addr: String, stop: Arc<AtomicBool>) -> Seen {
    let kinds = [Kind::Silent, Kind::Drip, Kind::Endless];
    let mut seen = Seen::default();
    let mut conns: Vec<Attacker> = Vec::new();
    for _ in 0..PER_KIND {
        for kind in kinds {
            if let Some(a) = Attacker::open(&addr, kind) {
                conns.push(a);
                seen.opened += 1;
            }
        }
    }
    let mut stopped: Option<Instant> = None;
    let give_up = HEAD_DEADLINE + CLOSE_SLACK + Duration::from_secs(5);
    // Bounded: the attack phase ends when `stop` is set (the test sets it after a fixed time,
    // or this gives up after 60 s), the drain phase after `give_up`.
    let hard_end = Instant::now() + Duration::from_secs(60);
    loop {
        let now = Instant::now();
        if stopped.is_none() && (stop.load(Ordering::Relaxed) || now > hard_end) {
            stopped = Some(now);
        }
        let mut replace = Vec::new();
        conns.retain_mut(|a| {
            if a.step() {
                seen.closed.push((a.kind, a.opened.elapsed()));
                replace.push(a.kind);
                false
            } else {
                true
            }
        });
        match stopped {
            None => {
                for kind in replace {
                    if let Some(a) = Attacker::open(&addr, kind) {
                        conns.push(a);
                        seen.opened += 1;
                    }
                }
            }
            Some(at) => {
                if conns.is_empty() || at.elapsed() > give_up {
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    seen.still_open = conns.iter().map(|a| (a.kind, a.opened.elapsed())).collect();
    seen
}

/// Control: a scraper alone is answered, completely and correctly.
#[test]
fn an_honest_scraper_alone_is_served() {
    let node = serve();
    let addr = metrics_addr(&node);
    for _ in 0..3 {
        let body = scrape(&addr, SCRAPE_BOUND).unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
        assert!(body.contains("# TYPE kvpeer_sessions gauge"), "{body}");
    }
}

/// Silent, dripping and endless-header clients, more than the endpoint keeps, held open (each
/// one the node closes replaced at once): an honest scraper is answered throughout, and every
/// attacker connection is closed by the node within the head deadline and some slack.
#[test]
fn slow_silent_and_endless_clients_do_not_deny_scrapes() {
    let node = serve();
    let addr = metrics_addr(&node);
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let (addr, stop) = (addr.clone(), stop.clone());
        std::thread::spawn(move || attack(addr, stop))
    };
    // Let the attackers fill the endpoint first.
    std::thread::sleep(Duration::from_millis(500));
    // Scrape for longer than the head deadline, so the attackers' connections held the
    // longest the node allows are open meanwhile.
    let phase = Instant::now();
    let mut scrapes = 0;
    let mut failures = Vec::new();
    while phase.elapsed() < HEAD_DEADLINE + Duration::from_secs(2) {
        let t = Instant::now();
        match scrape(&addr, SCRAPE_BOUND) {
            Ok(_) => scrapes += 1,
            Err(e) => failures.push(format!("after {:?}: {e}", phase.elapsed())),
        }
        println!("scrape after {:?} took {:?}", phase.elapsed(), t.elapsed());
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, Ordering::Relaxed);
    let seen = attacker.join().unwrap();
    let longest = |kind: Kind| {
        seen.closed
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, d)| *d)
            .max()
    };
    println!(
        "{scrapes} scrapes served, {} failed; attackers opened {}, closed by the node {}, still \
         open {}; longest lived: silent {:?}, drip {:?}, endless {:?}",
        failures.len(),
        seen.opened,
        seen.closed.len(),
        seen.still_open.len(),
        longest(Kind::Silent),
        longest(Kind::Drip),
        longest(Kind::Endless),
    );
    assert!(
        failures.is_empty(),
        "honest scrapes failed while attacked: {failures:#?}"
    );
    assert!(scrapes >= 3, "{scrapes} scrapes");
    assert!(
        seen.still_open.is_empty(),
        "attacker connections the node never closed: {:?}",
        seen.still_open
    );
    let bound = HEAD_DEADLINE + CLOSE_SLACK;
    for kind in [Kind::Silent, Kind::Drip, Kind::Endless] {
        let n = seen.closed.iter().filter(|(k, _)| *k == kind).count();
        assert!(n >= PER_KIND, "{kind:?}: only {n} closed");
        let longest = longest(kind).unwrap_or_default();
        assert!(
            longest <= bound,
            "a {kind:?} connection lived {longest:?} (bound {bound:?})"
        );
    }
    // The endpoint is still fine once the attack is over.
    scrape(&addr, SCRAPE_BOUND).unwrap_or_else(|e| panic!("after the attack: {e}"));
}
