//! How one node's cost grows with its number of peers (`scripts/bench-scale.sh`; results in
//! docs/benchmarks.md, "One node, many peers").
//!
//! For each N, a fresh release `kvpeer serve` (tcp plane, 16 KiB blocks, caps sized for N,
//! idle eviction off) and N real peer sessions against it, each with the full handshake both
//! ways (our `connect` on a DEALER to the node, the node's dial-back to our own ROUTER, both
//! `connect_ack`s), from `127.0.0.2` up (at most 48 peers per address), plus one real kvpeer
//! node as the consumer of a fixed fetch workload. Then, in that order:
//!
//! * **idle**: the node's RSS, descriptors and threads, and its CPU over 10 s with every
//!   session idle (heartbeats only);
//! * **handshake of the N-th peer**: one more real node's `connect` (both ways) timed;
//! * **fixed fetch**: the consumer runs 1,000 requests at 100/s, each a lookup of 4 blocks, a
//!   fetch of them over tcp (byte-checked) and the end of the request: lookup p50/p99, and
//!   the node's CPU per request;
//! * **spread lookups**: 2,000 lookups a second for 5 s, spread over the N peers in turn (a
//!   1-key lookup the node holds, then the terminal empty fetch that releases its pin): the
//!   round trip's p50/p99 as the peer sees it, and the node's CPU per lookup.
//!
//! The peers are driven by one thread of this process over epoll (edge-triggered), each a pair
//! of `kvpeer_net::zmtp::connection::Connection`s (the sans-IO ZMTP every kvpeer socket is), so the
//! load generator's own cost stays small and does not grow with N faster than the node's.
//!
//! `cargo bench -p kvpeer --bench scale -- [--kvpeer BIN] [--sessions 1,10,100,1000,4000]
//! [--json FILE]`; `--kvpeer` measures another build of the node (the script's `--before REV`).
//! `--follow-engines E`: the node is a pool node following E engines' KV event streams (at rest)
//! while it serves the N peers.
//! `KVPEER_SCALE_WRAP="perf record -g -o FILE --"` starts the node under that command (to
//! profile it; the figures then include the wrapper).

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BinaryHeap, HashMap};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer::{synthetic, Node, NodeConfig, PlaneKind};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::zmtp::connection::{ConnLimits, Connection, Incoming, Role};
use kvpeer_proto::{Connect, ConnectAck, Fetch, KvRequestId, Lookup, Message, PeerId, RoundSeq};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

const BLOCK_LEN: u64 = 16384;
const NODE_BLOCKS: u64 = 4096;
const FILLED: u64 = 2048;
const PEERS_PER_HOST: usize = 48;
const HASH_SEED: &str = "vllm-none-hash";

// ------------------------------------------------------------------ the node under test

/// What /proc says of a process.
#[derive(Debug, Clone, Copy, Default)]
struct ProcSample {
    rss_kib: u64,
    fds: u64,
    threads: u64,
    /// utime + stime, in clock ticks.
    cpu_ticks: u64,
    /// Time on a CPU of the live threads, in nanoseconds (`schedstat`: exact, where ticks are
    /// 10 ms; a thread that exited is missing, which the node's constant threads avoid).
    cpu_ns: u64,
}

fn sample(pid: u32) -> ProcSample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th, stime the 13th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu_ns = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    ProcSample {
        rss_kib: field("VmRSS:"),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64),
        threads: field("Threads:"),
        cpu_ticks: tick(11) + tick(12),
        cpu_ns,
    }
}

/// The node's CPU between two samples, in seconds: from `schedstat` when the threads are the
/// same ones (exact), else from the ticks (10 ms resolution, exited threads included).
fn cpu_between(before: &ProcSample, after: &ProcSample) -> f64 {
    let ticks = (after.cpu_ticks - before.cpu_ticks) as f64 / ticks_per_second();
    if before.threads == after.threads && after.cpu_ns >= before.cpu_ns {
        (after.cpu_ns - before.cpu_ns) as f64 / 1e9
    } else {
        ticks
    }
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a constant of the system.
    let t = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

struct NodeProcess {
    child: Child,
    id: PeerId,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl NodeProcess {
    fn start(bin: &str, peers: usize, follow: &[String]) -> NodeProcess {
        let dir = std::env::temp_dir().join(format!("kvpeer-scale-{}-{peers}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("node.toml");
        // Caps sized for N: every session may exist, idle ones are never evicted.
        let sessions = peers + 16;
        std::fs::write(
            &config,
            format!(
                "max_peers = {sessions}\nmax_peers_per_host = {sessions}\n\
                 max_inbound_connections = {}\nmax_inbound_per_source = {sessions}\n\
                 idle_timeout_s = 86400\nmax_pinned_blocks = {NODE_BLOCKS}\n",
                2 * sessions + 64
            ),
        )
        .unwrap();
        let wrap = std::env::var("KVPEER_SCALE_WRAP").ok();
        let mut command = match &wrap {
            Some(w) => {
                let mut parts = w.split_whitespace();
                let mut c = Command::new(parts.next().unwrap());
                c.args(parts).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let mut child = command
            .args(["serve", "--config"])
            .arg(&config)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--plane",
                "tcp",
                "--blocks",
                &NODE_BLOCKS.to_string(),
                "--block-len",
                &BLOCK_LEN.to_string(),
                "--fill",
                &FILLED.to_string(),
                "--hash-seed",
                HASH_SEED,
            ])
            .args(follow.iter().flat_map(|f| ["--follow", f.as_str()]))
            .env("KVPEER_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let id = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("id="))
            .unwrap_or_else(|| panic!("serve said {line:?}"));
        NodeProcess {
            child,
            id: PeerId::new(id),
            _dir: TempDir(dir),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------ the peers

fn limits() -> ConnLimits {
    ConnLimits {
        max_message_bytes: 16 << 20,
        heartbeat_interval: Duration::from_secs(2),
        heartbeat_timeout: Duration::from_secs(10),
        heartbeat_ttl: Duration::from_secs(10),
        handshake_timeout: Duration::from_secs(30),
        send_queue: 1000,
        send_queue_bytes: 16 << 20,
        max_incoming: 1024,
    }
}

/// One socket of a peer.
struct Link {
    stream: TcpStream,
    conn: Connection,
    open: bool,
}

impl Link {
    fn flush(&mut self) {
        loop {
            let bytes = self.conn.transmit();
            if bytes.is_empty() {
                return;
            }
            match self.stream.write(bytes) {
                Ok(n) => self.conn.advance(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.open = false;
                    return;
                }
            }
        }
    }

    fn read(&mut self, now: Instant) {
        let mut buf = [0u8; 16384];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    self.open = false;
                    return;
                }
                Ok(n) => {
                    if self.conn.handle_bytes(&buf[..n], now).is_err() {
                        self.open = false;
                        return;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.open = false;
                    return;
                }
            }
        }
    }

    fn send(&mut self, message: &Message) {
        let payload = message.encode().unwrap();
        if self.conn.queue(&[&payload]).is_err() {
            self.open = false;
        }
        self.flush();
    }
}

struct Peer {
    identity: PeerId,
    listener: TcpListener,
    /// Ours to the node (we send on it).
    dealer: Option<Link>,
    /// The node's to us (it sends on it).
    router: Option<Link>,
    started: Instant,
    acked: bool,
    answered: bool,
    done: Option<Duration>,
    /// Lookups sent and not answered: request id → when.
    pending: HashMap<String, Instant>,
    failed: bool,
}

/// Tokens: peer i's listener 4i, dealer 4i+1, router 4i+2; data sockets from `DATA_BASE`.
const DATA_BASE: u64 = 1 << 40;

#[derive(Default)]
struct Results {
    /// Handshakes done, each's duration.
    handshakes: Vec<Duration>,
    failed: usize,
    /// Spread-lookup round trips.
    lookups: Vec<Duration>,
    lookups_sent: u64,
}

enum Cmd {
    /// Start `n` more peers.
    Add(usize),
    /// `rate` lookups a second for `for_` over the ready peers.
    Lookups {
        rate: f64,
        for_: Duration,
    },
    Stop,
}

struct Driver {
    node: SocketAddr,
    epoll: Epoll,
    peers: Vec<Peer>,
    timers: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    /// Data listeners (one per host) and the data connections the node opened to them.
    data: HashMap<u64, TcpStream>,
    data_listeners: Vec<TcpListener>,
    next_data: u64,
    results: Arc<Mutex<Results>>,
    lookups: Option<(f64, Instant, Instant)>,
    sent: u64,
    turn: usize,
    to_start: usize,
}

fn host_of(i: usize) -> String {
    let h = 2 + i / PEERS_PER_HOST;
    assert!(h < 255, "too many peers for 127.0.0.0/24");
    format!("127.0.0.{h}")
}

impl Driver {
    fn register(&self, fd: &impl AsFd, token: u64) {
        self.epoll
            .add(
                fd,
                EpollEvent::new(
                    EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT | EpollFlags::EPOLLET,
                    token,
                ),
            )
            .unwrap();
    }

    fn data_addr(&mut self, i: usize) -> String {
        let host = i / PEERS_PER_HOST;
        while self.data_listeners.len() <= host {
            let l = TcpListener::bind(format!("{}:0", host_of(i))).unwrap();
            l.set_nonblocking(true).unwrap();
            self.register(&l, DATA_BASE + self.data_listeners.len() as u64);
            self.data_listeners.push(l);
        }
        self.data_listeners[host].local_addr().unwrap().to_string()
    }

    fn start_peer(&mut self, now: Instant) {
        let i = self.peers.len();
        let listener = TcpListener::bind(format!("{}:0", host_of(i))).unwrap();
        listener.set_nonblocking(true).unwrap();
        let identity = PeerId::new(listener.local_addr().unwrap().to_string());
        self.register(&listener, 4 * i as u64);
        let data = self.data_addr(i);
        // Bound to our own address so the node sees it as this peer's source.
        let socket = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let local: SocketAddr = format!("{}:0", host_of(i)).parse().unwrap();
        nix::sys::socket::bind(
            socket.as_raw_fd(),
            &nix::sys::socket::SockaddrIn::from(match local {
                SocketAddr::V4(a) => a,
                SocketAddr::V6(_) => unreachable!(),
            }),
        )
        .unwrap();
        let stream = TcpStream::from(socket);
        let mut dealer = None;
        let mut failed = false;
        match nix::sys::socket::connect(
            stream.as_raw_fd(),
            &nix::sys::socket::SockaddrIn::from(match self.node {
                SocketAddr::V4(a) => a,
                SocketAddr::V6(_) => unreachable!(),
            }),
        ) {
            Ok(()) => {
                stream.set_nonblocking(true).unwrap();
                stream.set_nodelay(true).unwrap();
                self.register(&stream, 4 * i as u64 + 1);
                let mut conn =
                    Connection::new(Role::control_dealer(identity.as_str().as_bytes()), limits());
                conn.connected(now);
                let mut link = Link {
                    stream,
                    conn,
                    open: true,
                };
                let metadata = AgentMetadata {
                    agent: format!("scale-peer-{i}"),
                    tcp: Some(data),
                    tcp_key: Some(vec![7; 32]),
                    ..Default::default()
                };
                link.send(&Message::Connect(Connect {
                    peer_id: identity.clone(),
                    agent_metadata: metadata.encode(),
                    base_addr: 0,
                    num_blocks: 64,
                    block_len: BLOCK_LEN,
                    config_fingerprint: None,
                    hash_seed: HASH_SEED.into(),
                    kvpeer_auth: None,
                }));
                self.arm(4 * i as u64 + 1, &link.conn);
                dealer = Some(link);
            }
            Err(_) => failed = true,
        }
        self.peers.push(Peer {
            identity,
            listener,
            dealer,
            router: None,
            started: now,
            acked: false,
            answered: false,
            done: None,
            pending: HashMap::new(),
            failed,
        });
        if failed {
            self.results.lock().unwrap().failed += 1;
        }
    }

    fn arm(&mut self, token: u64, conn: &Connection) {
        if let Some(at) = conn.poll_timeout() {
            self.timers.push(std::cmp::Reverse((at, token)));
        }
    }

    fn link(&mut self, token: u64) -> Option<&mut Link> {
        let peer = self.peers.get_mut((token / 4) as usize)?;
        match token % 4 {
            1 => peer.dealer.as_mut(),
            2 => peer.router.as_mut(),
            _ => None,
        }
    }

    fn on_data(&mut self, token: u64) {
        if token < DATA_BASE + (1 << 20) {
            let Some(l) = self.data_listeners.get((token - DATA_BASE) as usize) else {
                return;
            };
            let mut accepted = Vec::new();
            while let Ok((s, _)) = l.accept() {
                s.set_nonblocking(true).unwrap();
                accepted.push(s);
            }
            for s in accepted {
                self.next_data += 1;
                let t = DATA_BASE + (1 << 20) + self.next_data;
                self.register(&s, t);
                self.data.insert(t, s);
            }
            return;
        }
        // A data connection: read and drop (the HELLO; nothing else comes in this bench).
        let mut closed = false;
        if let Some(s) = self.data.get_mut(&token) {
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        if closed {
            self.data.remove(&token);
        }
    }

    fn on_ready(&mut self, token: u64, now: Instant) {
        if token >= DATA_BASE {
            return self.on_data(token);
        }
        let i = (token / 4) as usize;
        if token.is_multiple_of(4) {
            // The node dials back.
            // Edge-triggered: take every waiting connection (the newest is the node's link).
            let mut newest = None;
            while let Some(Ok((stream, _))) = self.peers.get(i).map(|p| p.listener.accept()) {
                newest = Some(stream);
            }
            let Some(stream) = newest else {
                return;
            };
            let peer = &mut self.peers[i];
            stream.set_nonblocking(true).unwrap();
            stream.set_nodelay(true).unwrap();
            let mut conn = Connection::new(Role::control_router(), limits());
            conn.connected(now);
            peer.router = Some(Link {
                stream,
                conn,
                open: true,
            });
            let t = 4 * i as u64 + 2;
            let link = self.peers[i].router.as_ref().unwrap();
            self.register(&link.stream, t);
            self.drive(t, now);
            return;
        }
        self.drive(token, now);
    }

    /// Reads, handles what came, writes, re-arms the timer of one socket.
    fn drive(&mut self, token: u64, now: Instant) {
        let Some(link) = self.link(token) else {
            return;
        };
        link.read(now);
        if link.conn.handle_timeout(now).is_err() {
            link.open = false;
        }
        let mut messages = Vec::new();
        while let Some(incoming) = link.conn.poll_incoming() {
            if let Incoming::Message(frames) = incoming {
                if let Some(frame) = frames.into_iter().next() {
                    messages.push(frame);
                }
            }
        }
        link.flush();
        let open = link.open;
        let i = (token / 4) as usize;
        for payload in messages {
            self.handle(i, &payload, now);
        }
        if !open {
            let peer = &mut self.peers[i];
            if !peer.failed && peer.done.is_none() {
                peer.failed = true;
                self.results.lock().unwrap().failed += 1;
            }
            return;
        }
        if let Some(link) = self.link(token) {
            let at = link.conn.poll_timeout();
            if let Some(at) = at {
                self.timers.push(std::cmp::Reverse((at, token)));
            }
        }
    }

    fn handle(&mut self, i: usize, payload: &[u8], now: Instant) {
        let Ok(message) = kvpeer_proto::decode(payload) else {
            return;
        };
        let peer = &mut self.peers[i];
        match message {
            Message::Connect(_) => {
                let ack = Message::ConnectAck(ConnectAck {
                    peer_id: peer.identity.clone(),
                });
                if let Some(d) = peer.dealer.as_mut() {
                    d.send(&ack);
                }
                peer.answered = true;
            }
            Message::ConnectAck(_) => peer.acked = true,
            Message::LookupResp(resp) => {
                let id = resp.kv_request_id.as_str().to_owned();
                if let Some(sent) = peer.pending.remove(&id) {
                    self.results
                        .lock()
                        .unwrap()
                        .lookups
                        .push(now.saturating_duration_since(sent));
                    // The request ends: its pin is released.
                    let end = Message::Fetch(Fetch {
                        kv_request_id: resp.kv_request_id.clone(),
                        keys: Vec::new(),
                        block_indexes: Vec::new(),
                        round_seq: RoundSeq(0),
                    });
                    if let Some(d) = peer.dealer.as_mut() {
                        d.send(&end);
                    }
                }
            }
            Message::Disconnect(_) => {
                peer.failed = true;
                self.results.lock().unwrap().failed += 1;
            }
            _ => {}
        }
        let peer = &mut self.peers[i];
        if peer.acked && peer.answered && peer.done.is_none() {
            let took = now.saturating_duration_since(peer.started);
            peer.done = Some(took);
            self.results.lock().unwrap().handshakes.push(took);
        }
    }

    fn ready_count(&self) -> usize {
        self.peers.iter().filter(|p| p.done.is_some()).count()
    }

    fn send_lookups(&mut self, now: Instant) {
        let Some((rate, from, until)) = self.lookups else {
            return;
        };
        if now >= until {
            self.lookups = None;
            return;
        }
        let due = (now.saturating_duration_since(from).as_secs_f64() * rate) as u64;
        let ready: Vec<usize> = (0..self.peers.len())
            .filter(|&i| self.peers[i].done.is_some() && !self.peers[i].failed)
            .collect();
        if ready.is_empty() {
            return;
        }
        while self.sent < due {
            self.turn = (self.turn + 1) % ready.len();
            let i = ready[self.turn];
            self.sent += 1;
            let id = format!("s{}-{}", i, self.sent);
            let key = synthetic::key(self.sent % FILLED);
            let peer = &mut self.peers[i];
            peer.pending.insert(id.clone(), now);
            if let Some(d) = peer.dealer.as_mut() {
                d.send(&Message::Lookup(Lookup {
                    kv_request_id: KvRequestId::from(id),
                    keys: vec![key],
                    round_seq: RoundSeq(0),
                }));
            }
        }
        self.results.lock().unwrap().lookups_sent = self.sent;
    }

    fn run(mut self, cmds: mpsc::Receiver<Cmd>) {
        let mut events = vec![EpollEvent::empty(); 1024];
        loop {
            loop {
                match cmds.try_recv() {
                    Ok(Cmd::Add(n)) => self.to_start += n,
                    Ok(Cmd::Lookups { rate, for_ }) => {
                        let now = Instant::now();
                        self.sent = 0;
                        self.lookups = Some((rate, now, now + for_));
                    }
                    Ok(Cmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            let now = Instant::now();
            // At most 32 handshakes under way at once.
            let under_way = self.peers.len()
                - self.ready_count()
                - self.peers.iter().filter(|p| p.failed).count();
            let mut room = 32usize.saturating_sub(under_way);
            while self.to_start > 0 && room > 0 {
                self.start_peer(now);
                self.to_start -= 1;
                room -= 1;
            }
            self.send_lookups(now);
            let wait = self
                .timers
                .peek()
                .map(|t| t.0 .0.saturating_duration_since(now))
                .unwrap_or(Duration::from_millis(2))
                .min(Duration::from_millis(2));
            let timeout = EpollTimeout::from(wait.as_millis().clamp(1, 100) as u16);
            let n = self.epoll.wait(&mut events, timeout).unwrap_or(0);
            let now = Instant::now();
            for e in &events[..n] {
                self.on_ready(e.data(), now);
            }
            while let Some(std::cmp::Reverse((at, token))) = self.timers.peek().copied() {
                if at > now {
                    break;
                }
                self.timers.pop();
                let due = self
                    .link(token)
                    .and_then(|l| l.conn.poll_timeout())
                    .is_some_and(|t| t <= now);
                if due {
                    self.drive(token, now);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ the run

fn quantile(v: &mut [Duration], q: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[derive(Debug, Default)]
struct Row {
    peers: usize,
    sessions_ready: usize,
    failed: usize,
    rss_kib: u64,
    fds: u64,
    threads: u64,
    idle_cpu_pct: f64,
    handshake_last: Duration,
    handshake_p50: Duration,
    fetch_lookup_p50: Duration,
    fetch_lookup_p99: Duration,
    fetch_cpu_per_req_us: f64,
    /// The same less the idle CPU of that time (what the requests themselves cost).
    fetch_cpu_net_us: f64,
    spread_p50: Duration,
    spread_p99: Duration,
    spread_cpu_per_lookup_us: f64,
    spread_done: usize,
    /// Why the consumer could not connect (then nothing after the idle figures was measured).
    consumer_error: Option<String>,
}

fn consumer(tag: &str) -> Node {
    let config = NodeConfig::builder(tag)
        .plane(PlaneKind::Tcp)
        .block_len(BLOCK_LEN)
        .num_blocks(64)
        .hash_seed(HASH_SEED)
        .build()
        .unwrap();
    Node::start(config).unwrap()
}

/// `n` engines' KV event streams (vLLM's PUB, publishing nothing: a followed engine at rest),
/// driven by one thread of this process until `stop`; the `--follow` values naming them.
fn engines(n: usize, stop: Arc<std::sync::atomic::AtomicBool>) -> Vec<String> {
    use kvpeer_net::events::{wait_all, EventIo, EventPublisher, PublisherConfig};
    let mut pubs: Vec<EventPublisher> = (0..n)
        .map(|_| {
            EventPublisher::bind(PublisherConfig::new("127.0.0.1:0".parse().unwrap())).unwrap()
        })
        .collect();
    // Each engine's P2P identity: nothing is pulled from an engine that announces nothing.
    let follow = pubs
        .iter()
        .map(|p| format!("tcp://{}=127.0.0.1:9", p.local_addr().unwrap()))
        .collect();
    std::thread::spawn(move || {
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut drivers: Vec<&mut dyn EventIo> =
                pubs.iter_mut().map(|p| p as &mut dyn EventIo).collect();
            let _ = wait_all(&mut drivers, Duration::from_millis(100), None);
        }
    });
    follow
}

fn measure(bin: &str, peers: usize, follow_engines: usize) -> Row {
    let stop_engines = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let follow = engines(follow_engines, stop_engines.clone());
    let node = NodeProcess::start(bin, peers, &follow);
    let pid = node.pid();
    let addr: SocketAddr = node.id.as_str().parse().unwrap();
    let results = Arc::new(Mutex::new(Results::default()));
    let (tx, rx) = mpsc::channel();
    let driver = Driver {
        node: addr,
        epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).unwrap(),
        peers: Vec::new(),
        timers: BinaryHeap::new(),
        data: HashMap::new(),
        data_listeners: Vec::new(),
        next_data: 0,
        results: results.clone(),
        lookups: None,
        sent: 0,
        turn: 0,
        to_start: 0,
    };
    let thread = std::thread::spawn(move || driver.run(rx));
    let mut row = Row {
        peers,
        ..Row::default()
    };

    // N sessions, each with its handshake both ways.
    tx.send(Cmd::Add(peers)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60 + peers as u64 / 20);
    loop {
        let r = results.lock().unwrap();
        if r.handshakes.len() + r.failed >= peers || Instant::now() > deadline {
            row.sessions_ready = r.handshakes.len();
            row.failed = r.failed;
            row.handshake_p50 = quantile(&mut r.handshakes.clone(), 0.5);
            break;
        }
        drop(r);
        std::thread::sleep(Duration::from_millis(50));
    }

    // Idle: every session up, heartbeats only.
    std::thread::sleep(Duration::from_secs(3));
    let before = sample(pid);
    let idle_for = Duration::from_secs(10);
    std::thread::sleep(idle_for);
    let after = sample(pid);
    row.rss_kib = after.rss_kib;
    row.fds = after.fds;
    row.threads = after.threads;
    let idle_rate = cpu_between(&before, &after) / idle_for.as_secs_f64();
    row.idle_cpu_pct = idle_rate * 100.0;

    // The N-th peer (a real node) connects: its handshake both ways, timed.
    let fetcher = consumer(&format!("scale-consumer-{peers}"));
    let t = Instant::now();
    match fetcher.connect(&node.id, Duration::from_secs(30)) {
        Ok(()) => row.handshake_last = t.elapsed(),
        Err(e) => {
            // The node cannot take one more peer: nothing else to measure at this N.
            row.consumer_error = Some(e.to_string());
            fetcher.shutdown(Duration::from_secs(1));
            let _ = tx.send(Cmd::Stop);
            let _ = thread.join();
            stop_engines.store(true, std::sync::atomic::Ordering::Relaxed);
            return row;
        }
    }

    // Fixed fetch workload: 1,000 requests at 100/s, 4 blocks each.
    let requests = 1000u64;
    let mut lookups = Vec::new();
    let before = sample(pid);
    let start = Instant::now();
    for r in 0..requests {
        let at = start + Duration::from_millis(10 * r);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let keys: Vec<_> = (0..4)
            .map(|k| synthetic::key((r * 4 + k) % FILLED))
            .collect();
        let req = fetcher.request(&node.id, &format!("f{r}")).unwrap();
        let t = Instant::now();
        let found = req.lookup(&keys, Duration::from_secs(10)).unwrap();
        lookups.push(t.elapsed());
        assert!(
            found.iter().all(|f| *f == kvpeer::LookupResult::Hit),
            "{found:?}"
        );
        req.fetch(&keys, Duration::from_secs(10)).unwrap();
        let k = &keys[3];
        assert_eq!(
            fetcher.read(k),
            Some(synthetic::content(k, BLOCK_LEN as usize))
        );
        req.finish();
    }
    let took = start.elapsed();
    let after = sample(pid);
    let cpu = cpu_between(&before, &after);
    row.fetch_cpu_per_req_us = cpu / requests as f64 * 1e6;
    row.fetch_cpu_net_us = (cpu - idle_rate * took.as_secs_f64()).max(0.0) / requests as f64 * 1e6;
    row.fetch_lookup_p50 = quantile(&mut lookups, 0.5);
    row.fetch_lookup_p99 = quantile(&mut lookups, 0.99);
    let _ = took;

    // Spread lookups: 2,000 a second over the N peers, for 5 s.
    let spread_for = Duration::from_secs(5);
    let before = sample(pid);
    tx.send(Cmd::Lookups {
        rate: 2000.0,
        for_: spread_for,
    })
    .unwrap();
    std::thread::sleep(spread_for + Duration::from_millis(500));
    let after = sample(pid);
    let cpu = cpu_between(&before, &after);
    {
        let mut r = results.lock().unwrap();
        let done = r.lookups.len();
        row.spread_done = done;
        row.spread_p50 = quantile(&mut r.lookups, 0.5);
        row.spread_p99 = quantile(&mut r.lookups, 0.99);
        row.spread_cpu_per_lookup_us = cpu / (r.lookups_sent.max(1)) as f64 * 1e6;
    }
    fetcher.shutdown(Duration::from_secs(1));
    let _ = tx.send(Cmd::Stop);
    let _ = thread.join();
    drop(node);
    stop_engines.store(true, std::sync::atomic::Ordering::Relaxed);
    row
}

fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut bin = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/release/kvpeer").to_owned();
    let mut sessions = vec![1usize, 10, 100, 1000, 4000];
    let mut json = None;
    let mut follow_engines = 0;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--follow-engines" => {
                follow_engines = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--follow-engines N")
            }
            "--kvpeer" => bin = args.next().expect("--kvpeer BIN"),
            "--sessions" => {
                sessions = args
                    .next()
                    .expect("--sessions N,N,...")
                    .split(',')
                    .map(|s| s.parse().expect("a number of sessions"))
                    .collect()
            }
            "--json" => json = args.next(),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    raise_fd_limit();
    let mut rows = Vec::new();
    println!(
        "| N peers | up | RSS | RSS/peer | fds | threads | idle CPU | handshake N-th (p50) | fetch lookup p50/p99 | node CPU/request (less idle) | spread lookup p50/p99 | node CPU/lookup |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &n in &sessions {
        let row = measure(&bin, n, follow_engines);
        let base = rows.first().map_or(row.rss_kib, |r: &Row| r.rss_kib);
        let per_peer = if n > 1 && !rows.is_empty() {
            (row.rss_kib as f64 - base as f64)
                / (n - rows.first().map_or(0, |r: &Row| r.peers)) as f64
        } else {
            0.0
        };
        println!(
            "| {} | {}{} | {:.1} MiB | {:.1} KiB | {} | {} | {:.2}% | {:.2} ms ({:.2} ms) | {:.0} / {:.0} µs | {:.0} µs ({:.0} µs) | {:.0} / {:.0} µs | {:.0} µs |",
            row.peers,
            row.sessions_ready,
            if row.failed > 0 { format!(" ({} failed)", row.failed) } else { String::new() },
            row.rss_kib as f64 / 1024.0,
            per_peer,
            row.fds,
            row.threads,
            row.idle_cpu_pct,
            row.handshake_last.as_secs_f64() * 1e3,
            row.handshake_p50.as_secs_f64() * 1e3,
            micros(row.fetch_lookup_p50),
            micros(row.fetch_lookup_p99),
            row.fetch_cpu_per_req_us,
            row.fetch_cpu_net_us,
            micros(row.spread_p50),
            micros(row.spread_p99),
            row.spread_cpu_per_lookup_us,
        );
        if let Some(e) = &row.consumer_error {
            println!("  (N = {n}: the consumer could not connect: {e})");
        }
        rows.push(row);
    }
    if let Some(path) = json {
        let mut out = String::new();
        for r in &rows {
            out.push_str(&format!(
                "{{\"peers\":{},\"up\":{},\"failed\":{},\"rss_kib\":{},\"fds\":{},\"threads\":{},\"idle_cpu_pct\":{:.3},\"handshake_last_ms\":{:.3},\"fetch_lookup_p50_us\":{:.1},\"fetch_lookup_p99_us\":{:.1},\"fetch_cpu_per_req_us\":{:.1},\"fetch_cpu_net_us\":{:.1},\"spread_p50_us\":{:.1},\"spread_p99_us\":{:.1},\"spread_cpu_per_lookup_us\":{:.1},\"spread_done\":{}}}\n",
                r.peers, r.sessions_ready, r.failed, r.rss_kib, r.fds, r.threads, r.idle_cpu_pct,
                r.handshake_last.as_secs_f64() * 1e3, micros(r.fetch_lookup_p50), micros(r.fetch_lookup_p99),
                r.fetch_cpu_per_req_us, r.fetch_cpu_net_us, micros(r.spread_p50), micros(r.spread_p99), r.spread_cpu_per_lookup_us, r.spread_done
            ));
        }
        if let Err(e) = std::fs::write(&path, out) {
            eprintln!("cannot write the figures to {path}: {e}");
            std::process::exit(1);
        }
    }
}
