//! A real pool node (`kvpeer serve --follow`, a child process) against what its event sources
//! can do to it (issue 36), each seen from the outside, with an honest engine's keys pulled
//! byte-exact throughout:
//!
//! * a PUB from another host connecting to a bound SUB is closed at once and sent nothing
//!   (what the attacker's socket received), while the engine's own PUB is heard;
//! * forged sequence numbers on the engine's stream make the pool ask the engine's replay
//!   ROUTER at most once per interval (the requests counted at that ROUTER);
//! * once the followed engine is gone (its P2P side dead, then its event stream), the pool
//!   node's threads stay idle: their CPU ticks in `/proc/PID/task/*/stat` over a window.
//!
//! The engines are nodes of this process (the tcp plane) and their event streams this test's
//! own sockets: kvpeer's native PUB and replay ROUTER driven by a thread, or a raw ZMTP PUB
//! that connects, bound first to the source address it plays.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpeer::{synthetic, OffloadKey, PeerId};
use kvpeer_net::events::{EventPublisher, PublisherConfig};
use kvpeer_net::zmtp::{self, Decoder, Input};
use kvpeer_pool::{Catalog, CatalogLimits, Publisher, StoreChange};

mod common;
use common::engines::{engine, keys, node, LEN};
use common::{free_port, http_get, metrics_addr, samples, ticks_over, Proc};

/// A `KVEventBatch` announcing `keys` stored on the CPU tier, as vLLM's would.
fn batch(keys: &[OffloadKey]) -> Vec<u8> {
    let changes: Vec<StoreChange> = keys.iter().cloned().map(StoreChange::Stored).collect();
    Publisher::new("", 1)
        .publish(1.0, &changes, &mut Catalog::new(CatalogLimits::default()))
        .unwrap()
        .unwrap()
        .payload
}

/// Junk keys no engine holds.
fn junk(round: u64, n: u64) -> Vec<OffloadKey> {
    (0..n)
        .map(|i| OffloadKey::from_parts(&(round * 1000 + i).to_be_bytes(), 0xBAD))
        .collect()
}

enum Say {
    /// The next batch, kept for replays and published live.
    Stored(Vec<OffloadKey>),
    /// `count` batches each announcing a junk key, published live one per millisecond with
    /// forged sequence numbers (alternately far ahead and back at 1: a gap, then a
    /// "restart"), never kept; replays are answered meanwhile.
    Forged { count: u64 },
}

/// An engine's event stream (kvpeer's native PUB and replay ROUTER on loopback), driven by a
/// thread, counting the replay requests its ROUTER receives.
struct Stream {
    tx: Option<Sender<(Say, Sender<()>)>>,
    events: SocketAddr,
    replay: SocketAddr,
    requests: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Stream {
    fn start() -> Stream {
        let mut config = PublisherConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)));
        config.replay_bind = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        let mut socket = EventPublisher::bind(config).unwrap();
        let events = socket.local_addr().unwrap();
        let replay = socket.replay_addr().unwrap();
        let requests = Arc::new(AtomicU64::new(0));
        let counted = requests.clone();
        let (tx, rx) = channel::<(Say, Sender<()>)>();
        let thread = std::thread::spawn(move || {
            let mut kept: Vec<(u64, Vec<u8>)> = Vec::new();
            let serve = |socket: &mut EventPublisher, kept: &[(u64, Vec<u8>)], wait| {
                let answer = |start: u64| {
                    let mut out: Vec<Vec<Vec<u8>>> = kept
                        .iter()
                        .filter(|(s, _)| *s >= start)
                        .map(|(s, p)| vec![Vec::new(), s.to_be_bytes().to_vec(), p.clone()])
                        .collect();
                    out.push(vec![Vec::new(), (-1i64).to_be_bytes().to_vec(), Vec::new()]);
                    out
                };
                socket.serve(wait, answer).unwrap();
                let s = socket.stats();
                // Every request that reached the ROUTER: answered, or dropped for being too many.
                counted.store(s.replays + s.requests_dropped, Ordering::Relaxed);
            };
            loop {
                serve(&mut socket, &kept, Duration::from_millis(10));
                let (said, done) = match rx.try_recv() {
                    Ok(s) => s,
                    Err(std::sync::mpsc::TryRecvError::Empty) => continue,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                };
                match said {
                    Say::Stored(keys) => {
                        let seq = kept.len() as u64;
                        let payload = batch(&keys);
                        socket.publish(&[b"", &seq.to_be_bytes(), &payload]);
                        kept.push((seq, payload));
                    }
                    Say::Forged { count } => {
                        for i in 0..count {
                            let seq = if i % 2 == 0 { 1_000_000 + i } else { 1 };
                            socket.publish(&[b"", &seq.to_be_bytes(), &batch(&junk(i, 1))]);
                            serve(&mut socket, &kept, Duration::from_millis(1));
                        }
                    }
                }
                let _ = done.send(());
            }
        });
        Stream {
            tx: Some(tx),
            events,
            replay,
            requests,
            thread: Some(thread),
        }
    }

    fn say(&self, s: Say) {
        let (done, said) = channel();
        self.tx.as_ref().unwrap().send((s, done)).unwrap();
        said.recv_timeout(Duration::from_secs(60)).unwrap();
    }

    /// Replay requests the ROUTER received so far.
    fn replay_requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// `--follow` for this stream and the engine `peer`.
    fn follow(&self, peer: &PeerId) -> String {
        format!("tcp://{},tcp://{}={peer}", self.events, self.replay)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A file in the temporary directory, removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("kvpeer-{name}-{}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `kvpeer serve` as a pool node of 256 blocks of 4 KiB on the tcp plane with `extra` flags,
/// metrics on; the process and its identity once ready.
fn pool(extra: &[&str]) -> (Proc, PeerId) {
    let mut args = vec![
        "--plane",
        "tcp",
        "--blocks",
        "256",
        "--block-len",
        "4096",
        "--metrics",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    Proc::serve(&args)
}

/// One of the pool's metrics now.
fn metric(pool: &Proc, name: &str) -> f64 {
    let (_, body) = http_get(&metrics_addr(pool), "/metrics");
    samples(&body).get(name).copied().unwrap_or(0.0)
}

/// Waits (bounded) until the pool's metric `name` reaches `at_least`.
fn wait_metric(pool: &Proc, name: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = metric(pool, name);
        if v >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} = {v}, waited for {at_least}; the pool's log:\n{}",
            pool.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What an honest consumer fetches from `pool`: every key of `want` must hit and come back
/// with its synthetic bytes.
fn assert_pool_serves(pool: &PeerId, want: &[OffloadKey], tag: &str) {
    let consumer = node(tag, want.len() as u64);
    let req = consumer.request(pool, tag).unwrap();
    let found = req.lookup(want, Duration::from_secs(20)).unwrap();
    assert!(
        found.iter().all(|r| *r == kvpeer::LookupResult::Hit),
        "{found:?}"
    );
    req.fetch(want, Duration::from_secs(20)).unwrap();
    for k in want {
        assert_eq!(
            consumer.read(k),
            Some(synthetic::content(k, LEN as usize)),
            "{k:?}"
        );
    }
    req.finish();
    consumer.shutdown(Duration::from_secs(3));
}

/// A pool node whose engine stopped (first its P2P side, so pulls fail, then its event
/// stream) and that also follows an engine that never came up stays idle: over 3 s, well past
/// the lookup timeout (1 s here) and the give-up of every failed pull, all its threads
/// together spend under 2% of a core (6 ticks of 1/100 s), the node's thread included. Before:
/// the node's thread spun from the lookup timeout on (its wait's deadline stayed in the past
/// once the last waiting lookup was answered: ~50,000 zero-timeout waits a second).
#[test]
fn a_pool_node_whose_engine_went_away_stays_idle() {
    let engine = engine("idle-engine", 16);
    let stream = Stream::start();
    stream.say(Say::Stored(keys(0..8)));
    let config = TempFile::new(
        "idle-pool.toml",
        "lookup_timeout_s = 1\nload_timeout_s = 1\n",
    );
    let never = format!(
        "tcp://127.0.0.1:{},tcp://127.0.0.1:{}=127.0.0.1:{}",
        free_port(),
        free_port(),
        free_port()
    );
    let (mut pool, pool_id) = pool(&[
        "--config",
        config.0.to_str().unwrap(),
        "--follow",
        &stream.follow(engine.id()),
        "--follow",
        &never,
    ]);
    wait_metric(&pool, "kvpeer_follow_pulled_blocks_total", 8.0);
    assert_pool_serves(&pool_id, &keys(0..8), "idle-check");

    // The engine's P2P side goes: what it announces next cannot be pulled.
    engine.shutdown(Duration::ZERO);
    drop(engine);
    stream.say(Say::Stored(keys(8..16)));
    wait_metric(&pool, "kvpeer_follow_pull_failures_total", 8.0);
    // Then its event stream.
    drop(stream);

    // Past the lookup timeout of the last pull (and the replay's give-up, 5 s, never reached:
    // no stream connects), with the event stream redialled with backoff.
    std::thread::sleep(Duration::from_secs(2));
    let pid = pool.child.id();
    let spent = ticks_over(pid, Duration::from_secs(3));
    let total: u64 = spent.iter().map(|(_, t)| t).sum();
    let node_thread: u64 = spent
        .iter()
        .filter(|(n, _)| n.starts_with("kvpeer-node"))
        .map(|(_, t)| t)
        .sum();
    eprintln!("idle pool node, CPU ticks (1/100 s) per thread over 3 s: {spent:?}");
    assert!(
        total < 6,
        "the idle pool node spent {total} ticks in 3 s (node thread {node_thread}): {spent:?}"
    );
    // Still serving what it pulled.
    assert_pool_serves(&pool_id, &keys(0..8), "idle-check-after");
    assert_eq!(pool.terminate(Duration::from_secs(10)), 0, "{}", pool.log());
}

/// A raw ZMTP PUB that connects to `to` from `from` (bound first: 127.0.0.2 plays another
/// host on loopback), sending its greeting and READY at once.
struct RawPub {
    socket: TcpStream,
    /// Everything the other side sent it.
    received: Vec<u8>,
    closed: bool,
}

impl RawPub {
    fn connect(from: Ipv4Addr, to: SocketAddr) -> RawPub {
        use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrIn};
        let fd = socket::socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        socket::bind(
            fd.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(from, 0)),
        )
        .unwrap();
        let SocketAddr::V4(to) = to else {
            panic!("IPv4 expected")
        };
        socket::connect(fd.as_raw_fd(), &SockaddrIn::from(to)).unwrap();
        let mut socket = TcpStream::from(fd);
        socket
            .write_all(&[zmtp::greeting().to_vec(), zmtp::ready("PUB")].concat())
            .unwrap();
        socket.set_nonblocking(true).unwrap();
        RawPub {
            socket,
            received: Vec::new(),
            closed: false,
        }
    }

    /// Takes what arrived (never blocks); whether the other side closed.
    fn read(&mut self) -> bool {
        let mut b = [0u8; 64 * 1024];
        while !self.closed {
            match self.socket.read(&mut b) {
                Ok(0) => self.closed = true,
                Ok(n) => self.received.extend_from_slice(&b[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => self.closed = true,
            }
        }
        self.closed
    }

    /// Sends live batch `seq` (never blocks for long: the socket buffers it, or the write
    /// fails on a closed connection, which is ignored: the attacker's loss).
    fn publish(&mut self, seq: u64, payload: &[u8]) -> bool {
        let mut frame = Vec::new();
        zmtp::write_message(&mut frame, &[b"", &seq.to_be_bytes(), payload]);
        self.socket.set_nonblocking(false).unwrap();
        self.socket
            .set_write_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let sent = self.socket.write_all(&frame).is_ok();
        self.socket.set_nonblocking(true).unwrap();
        sent
    }

    /// What the other side sent, decoded (greeting, READY, messages).
    fn inputs(&self) -> Vec<Input> {
        let mut d = Decoder::new(1 << 20);
        d.push(&self.received);
        let mut out = Vec::new();
        while let Ok(Some(i)) = d.next_input() {
            out.push(i);
        }
        out
    }
}

/// A bound SUB (`--follow bind:...`) hears only the followed engine's host. An attacker PUB
/// from 127.0.0.2 (another host here: the engine's identity is 127.0.0.1) connects first and
/// floods junk batches with forged sequence numbers: its connection is closed at once and it
/// receives not a byte (no greeting, no subscription). The engine's own PUB, from 127.0.0.1,
/// then announces 48 keys: all of them are pulled and served byte-exact. Before: the attacker
/// was subscribed like the engine, and its junk crowded the engine's candidates out.
#[test]
fn a_bound_sub_hears_only_the_followed_engines_host() {
    let engine = engine("bound-engine", 48);
    let port = free_port();
    let sub = SocketAddr::from(([127, 0, 0, 1], port));
    let (mut pool, pool_id) = pool(&["--follow", &format!("bind:tcp://{sub}={}", engine.id())]);

    let mut attacker = RawPub::connect(Ipv4Addr::new(127, 0, 0, 2), sub);
    let mut flooded = 0;
    for round in 0..200u64 {
        let seq = if round % 2 == 0 {
            u64::MAX - round
        } else {
            round
        };
        if !attacker.publish(seq, &batch(&junk(round, 64))) {
            break;
        }
        flooded += 1;
        if attacker.read() {
            break;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !attacker.read() {
        assert!(Instant::now() < deadline, "the attacker's PUB still open");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        attacker.received.is_empty(),
        "the attacker was sent {:?} (after {flooded} batches)",
        attacker.inputs()
    );

    let mut honest = RawPub::connect(Ipv4Addr::LOCALHOST, sub);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            !honest.read(),
            "the engine's PUB was closed: {}",
            pool.log()
        );
        let subscribed = honest.inputs().iter().any(
            |i| matches!(i, Input::Message(m) if m.first().is_some_and(|f| f.first() == Some(&1))),
        );
        if subscribed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no subscription: {:?}",
            honest.inputs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(honest.publish(0, &batch(&keys(0..48))));
    wait_metric(&pool, "kvpeer_follow_pulled_blocks_total", 48.0);
    assert_pool_serves(&pool_id, &keys(0..48), "bound-check");
    assert!(metric(&pool, "kvpeer_follow_refused_publishers_total") >= 1.0);
    assert_eq!(metric(&pool, "kvpeer_follow_pull_failures_total"), 0.0);
    assert!(!honest.read(), "the engine's PUB is still heard");
    assert_eq!(pool.terminate(Duration::from_secs(10)), 0, "{}", pool.log());
}

/// Forged sequence numbers on the followed stream (2,000 batches in about 2 s, each a gap or a
/// "restart") make the pool ask the engine's replay ROUTER at most once per second, counted
/// at that ROUTER; the engine's 48 keys, announced before and after the forgeries, are all
/// pulled and served byte-exact. Before: a replay of the engine's whole buffer per forged
/// batch (27 KB of forgeries made 158,000 replayed batches, issue 36).
#[test]
fn forged_sequence_numbers_make_at_most_one_replay_per_second() {
    let engine = engine("forged-engine", 48);
    let stream = Stream::start();
    stream.say(Say::Stored(keys(0..24)));
    let (mut pool, pool_id) = pool(&["--follow", &stream.follow(engine.id())]);
    wait_metric(&pool, "kvpeer_follow_pulled_blocks_total", 24.0);
    let before = stream.replay_requests();
    let started = Instant::now();
    stream.say(Say::Forged { count: 2000 });
    let forged_for = started.elapsed();
    // The one put off to the end of the last interval may come after the forgeries end.
    std::thread::sleep(Duration::from_millis(1200));
    let asked = stream.replay_requests() - before;
    let bound = forged_for.as_secs() + 3;
    eprintln!(
        "{asked} replay requests at the engine's ROUTER for 2,000 forged batches in {forged_for:?}"
    );
    assert!(
        asked <= bound,
        "{asked} replay requests in {forged_for:?} of forged batches (at most {bound})"
    );
    stream.say(Say::Stored(keys(24..48)));
    wait_metric(&pool, "kvpeer_follow_pulled_blocks_total", 48.0);
    assert_pool_serves(&pool_id, &keys(0..48), "forged-check");
    assert!(metric(&pool, "kvpeer_follow_replays_deferred_total") >= 1.0);
    assert_eq!(pool.terminate(Duration::from_secs(10)), 0, "{}", pool.log());
}
