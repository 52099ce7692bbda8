//! Nodes on several real hosts: one network namespace per host, joined by a switch, each with its
//! own address, `/dev/shm` and `/etc/hosts` (`common/fleet.rs`). Everything else in the suite runs
//! on loopback, where a host is a string; here addresses, names, wildcard listens, allowlists and
//! cut links are what they are across machines.
//!
//! Needs root and `ip netns` (CI has both): built with the feature `fleet`, which
//! `scripts/test.sh` turns on. When namespaces cannot be made the tests fail, saying why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::time::{Duration, Instant};

use kvpeer::synthetic;
use kvpeer::{Node, NodeConfig, PlaneKind};
use kvpeer_core::LookupResult;
use kvpeer_proto::{OffloadKey, PeerId};

mod common;
use common::engines::keys;
use common::fleet::{Fleet, Host};
use common::num;

const WAIT: Duration = Duration::from_secs(30);

/// Runs `f` on a thread inside `host`'s network namespace: sockets it opens (and threads it
/// starts, which inherit the namespace) live on that host.
fn on_host<T: Send + 'static>(host: &Host, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{}", host.ns);
    std::thread::spawn(move || {
        let ns = File::open(&path).unwrap();
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap()
}

/// A consumer node on `host` (tcp: hosts share no memory), with short load and abort timeouts.
fn consumer_on(host: &Host, tag: &str, blocks: u64, block_len: u64) -> Node {
    let (addr, tag) = (host.addr.clone(), tag.to_owned());
    on_host(host, move || {
        let config = NodeConfig::builder(&tag)
            .listen(&addr, 0)
            .num_blocks(blocks)
            .block_len(block_len)
            .plane(PlaneKind::Tcp)
            .set("load_timeout_s", 2)
            .set("abort_ack_timeout_s", 1)
            .set("lookup_timeout_s", 3)
            .build()
            .unwrap();
        Node::start(config).unwrap()
    })
}

/// Looks up and fetches `keys` from `peer` as request `id`; every byte checked.
fn pull(node: &Node, peer: &PeerId, id: &str, keys: &[OffloadKey], len: u64) {
    let req = node.request(peer, id).unwrap();
    let found = req.lookup(keys, WAIT).unwrap();
    assert!(
        found.iter().all(|r| *r == LookupResult::Hit),
        "{id}: {found:?}"
    );
    req.fetch(keys, WAIT).unwrap();
    req.finish();
    for k in keys {
        assert_eq!(
            node.read(k).as_deref(),
            Some(&synthetic::content(k, len as usize)[..]),
            "{id}: {k:?}"
        );
    }
}

#[test]
fn serve_and_fetch_across_two_hosts() {
    let fleet = Fleet::new(2);
    let (_server, id) = fleet.serve(1, &["--listen", "198.18.0.1:5600", "--fill", "256"]);
    assert_eq!(id, "198.18.0.1:5600");
    let (status, summary, log) = fleet.fetch(
        2,
        &[
            "--peer",
            "198.18.0.1:5600",
            "--listen",
            "198.18.0.2:0",
            "--requests",
            "32",
            "--keys",
            "8",
        ],
    );
    assert_eq!(status, 0, "{summary}\n{log}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    assert_eq!(num(&summary, "failed_loads"), 0, "{summary}");
    assert!(num(&summary, "hits") > 0, "{summary}");
}

#[test]
fn a_cidr_allowlist_serves_the_hosts_it_names_only() {
    let fleet = Fleet::new(3);
    let (server, _) = fleet.serve(
        1,
        &[
            "--listen",
            "198.18.0.1:5600",
            "--fill",
            "64",
            "--allow",
            "198.18.0.2/32",
        ],
    );
    let fetch_from = |i: usize| {
        let listen = format!("198.18.0.{i}:0");
        let args = [
            "--peer",
            "198.18.0.1:5600",
            "--listen",
            &listen,
            "--requests",
            "4",
        ];
        let (status, _, log) = fleet.fetch(i, &[&args[..], &["--timeout-secs", "5"]].concat());
        (status, log)
    };
    let (refused, why) = fetch_from(3);
    assert_eq!(refused, 1, "host3 is not listed: {why}");
    let (served, log) = fetch_from(2);
    assert_eq!(served, 0, "host2 is listed: {log}");
    let server_log = server.stderr.lock().unwrap().clone();
    assert!(
        server_log.contains("198.18.0.3"),
        "the refusal names the refused host: {server_log}"
    );
}

/// A link cut in the middle of a transfer: the consumer's load fails within its timeouts, no
/// byte of the cut transfer lands in a block that meanwhile serves another producer's key (the
/// cut producer's TCP retransmits its queued bytes when the link returns), and the session
/// comes back with the link.
#[test]
fn a_link_cut_mid_transfer_fails_the_load_in_time_and_never_lands_late() {
    const LEN: u64 = 1 << 20;
    let fleet = Fleet::new(3);
    // Host 1's transfers take a while (16 MiB at 64 Mbit/s: about 2 s), so the cut lands in one.
    fleet.limit(1, "64mbit");
    let (_cut, cut_id) = fleet.serve(
        1,
        &[
            "--listen",
            "198.18.0.1:5600",
            "--plane",
            "tcp",
            "--blocks",
            "32",
            "--block-len",
            "1048576",
            "--fill",
            "32",
        ],
    );
    let (_honest, honest_id) = fleet.serve(
        3,
        &[
            "--listen",
            "198.18.0.3:5600",
            "--plane",
            "tcp",
            "--blocks",
            "64",
            "--block-len",
            "1048576",
            "--fill",
            "64",
        ],
    );
    let (cut_id, honest_id) = (PeerId::new(cut_id), PeerId::new(honest_id));
    // Exactly one load's blocks: the honest load after the cut reuses the cut load's.
    let consumer = consumer_on(fleet.host(2), "cut-consumer", 16, LEN);

    let cut_keys = keys(0..16);
    let req = consumer.request(&cut_id, "cut-1").unwrap();
    let found = req.lookup(&cut_keys, WAIT).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    let started = Instant::now();
    // The fetch goes out, then the link goes down 400 ms into its transfer.
    let fetching = {
        let keys = cut_keys.clone();
        std::thread::spawn(move || {
            let r = req.fetch(&keys, WAIT);
            req.finish();
            r
        })
    };
    std::thread::sleep(Duration::from_millis(400));
    fleet.set_link(1, false);
    let failed = fetching.join().unwrap();
    let failed_after = started.elapsed();
    assert!(failed.is_err(), "a load across a cut link cannot succeed");
    assert!(
        failed_after < Duration::from_secs(12),
        "the load fails within its timeouts (load 2 s, abort 1 s), not the link's: {failed_after:?}"
    );

    // The failure is reported at once; the blocks come back once no write of host 1 can land
    // in them (its data connection's claim released, at its frame deadline at the latest).
    let deadline = Instant::now() + Duration::from_secs(20);
    while consumer.stats().unwrap().core.fencing_blocks > 0 {
        assert!(
            Instant::now() < deadline,
            "the cut load's blocks were never handed back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Another producer's keys take the same blocks while the link is still down.
    let honest_keys = keys(32..48);
    pull(&consumer, &honest_id, "honest-1", &honest_keys, LEN);

    // The link returns: whatever host 1 still had queued arrives, and must land nowhere.
    fleet.set_link(1, true);
    std::thread::sleep(Duration::from_secs(3));
    for k in &honest_keys {
        let held = consumer.read(k).expect("the honest key is still held");
        assert!(
            held == synthetic::content(k, LEN as usize),
            "the block of {k:?} changed after the link came back"
        );
    }

    // And the session with host 1 comes back: a new request is served byte-exact.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let req = consumer.request(&cut_id, "cut-2").unwrap();
        let again = keys(16..20);
        let ok = req
            .lookup(&again, Duration::from_secs(5))
            .is_ok_and(|r| r.iter().all(|r| *r == LookupResult::Hit))
            && req.fetch(&again, WAIT).is_ok();
        req.finish();
        if ok {
            for k in &again {
                assert_eq!(
                    consumer.read(k).as_deref(),
                    Some(&synthetic::content(k, LEN as usize)[..])
                );
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no session with host 1 within 40 s of the link's return"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    consumer.shutdown(Duration::from_secs(2));
}

/// An engine's KV event stream on its host: a PUB and a replay ROUTER bound to the host's
/// address, announcing `keys` once (kept for the replay a follower asks on connect).
struct EngineStream {
    events: std::net::SocketAddr,
    replay: std::net::SocketAddr,
    stop: std::sync::mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EngineStream {
    fn start(host: &Host, keys: Vec<OffloadKey>) -> EngineStream {
        use kvpeer_net::events::{EventPublisher, PublisherConfig};
        use kvpeer_pool::{Catalog, CatalogLimits, Publisher, StoreChange};
        let ip: std::net::IpAddr = host.addr.parse().unwrap();
        on_host(host, move || {
            let mut config = PublisherConfig::new(std::net::SocketAddr::new(ip, 0));
            config.replay_bind = Some(std::net::SocketAddr::new(ip, 0));
            let mut socket = EventPublisher::bind(config).unwrap();
            let (events, replay) = (socket.local_addr().unwrap(), socket.replay_addr().unwrap());
            let changes: Vec<StoreChange> = keys.into_iter().map(StoreChange::Stored).collect();
            let payload = Publisher::new("", 1)
                .publish(1.0, &changes, &mut Catalog::new(CatalogLimits::default()))
                .unwrap()
                .unwrap()
                .payload;
            let (stop, stopped) = std::sync::mpsc::channel::<()>();
            let thread = std::thread::spawn(move || {
                socket.publish(&[b"", &0u64.to_be_bytes(), &payload]);
                while stopped.try_recv() == Err(std::sync::mpsc::TryRecvError::Empty) {
                    let replay = |start: u64| {
                        let mut out = Vec::new();
                        if start == 0 {
                            out.push(vec![
                                Vec::new(),
                                0u64.to_be_bytes().to_vec(),
                                payload.clone(),
                            ]);
                        }
                        out.push(vec![Vec::new(), (-1i64).to_be_bytes().to_vec(), Vec::new()]);
                        out
                    };
                    socket.serve(Duration::from_millis(10), replay).unwrap();
                }
            });
            EngineStream {
                events,
                replay,
                stop,
                thread: Some(thread),
            }
        })
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A node on `host` holding synthetic blocks for `keys` (an engine's P2P side).
fn engine_on(host: &Host, tag: &str, keys: &[OffloadKey], len: u64) -> Node {
    let (addr, tag, keys) = (host.addr.clone(), tag.to_owned(), keys.to_vec());
    on_host(host, move || {
        let config = NodeConfig::builder(&tag)
            .listen(&addr, 0)
            .num_blocks(keys.len() as u64)
            .block_len(len)
            .plane(PlaneKind::Tcp)
            .build()
            .unwrap();
        let node = Node::start(config).unwrap();
        let blocks = keys
            .iter()
            .map(|k| (k.clone(), synthetic::content(k, len as usize)))
            .collect();
        node.store(blocks).unwrap();
        node
    })
}

/// A pool node on host 1 follows two engines on hosts 2 and 3 (their event streams and P2P
/// ports on their own addresses), pulls everything each announces, and serves it byte-exact
/// to a consumer on a fourth host.
#[test]
fn a_pool_follows_engines_on_two_other_hosts() {
    common::init_logs();
    use kvpeer::pool_node::{FollowSpec, PoolConfig, PoolNode};
    use kvpeer_net::events::SubEndpoint;
    const LEN: u64 = 16 * 1024;
    let fleet = Fleet::new(4);
    let (k2, k3) = (keys(0..24), keys(100..124));
    let (e2, e3) = (
        engine_on(fleet.host(2), "fleet-engine-2", &k2, LEN),
        engine_on(fleet.host(3), "fleet-engine-3", &k3, LEN),
    );
    let (s2, s3) = (
        EngineStream::start(fleet.host(2), k2.clone()),
        EngineStream::start(fleet.host(3), k3.clone()),
    );
    let config = PoolConfig {
        follow: [(&s2, &e2), (&s3, &e3)]
            .into_iter()
            .map(|(s, e)| FollowSpec {
                events: SubEndpoint::Connect(s.events),
                replay: Some(s.replay),
                peer: e.id().clone(),
            })
            .collect(),
        ..PoolConfig::default()
    };
    let pool_addr = fleet.host(1).addr.clone();
    let (pool_node, pool) = on_host(fleet.host(1), move || {
        let node = std::sync::Arc::new(
            Node::start(
                NodeConfig::builder("fleet-pool")
                    .listen(&pool_addr, 0)
                    .num_blocks(64)
                    .block_len(LEN)
                    .plane(PlaneKind::Tcp)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        );
        let pool = PoolNode::start(node.clone(), &config).unwrap();
        (node, pool)
    });
    let deadline = Instant::now() + WAIT;
    while pool.stats().pulled_blocks < 48 {
        assert!(Instant::now() < deadline, "{:?}", pool.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = pool.stats();
    assert_eq!(stats.connected, 2, "{stats:?}");
    assert_eq!(stats.pull_failures, 0, "{stats:?}");
    let consumer = consumer_on(fleet.host(4), "fleet-pool-consumer", 64, LEN);
    let pool_id = pool_node.id().clone();
    let all: Vec<OffloadKey> = k2.iter().chain(&k3).cloned().collect();
    pull(&consumer, &pool_id, "from-the-pool", &all, LEN);
    consumer.shutdown(Duration::from_secs(2));
    drop(pool);
    drop((s2, s3));
}

/// A peer on host 3 advertises its tcp data address with the host written as a number that
/// the system resolver reads as host 2 (198.18.0.2 in decimal): at 6d26cca the literal check let
/// it through and the node's tcp writer connected to the third machine, sending it the node's
/// blocks. Checked from host 2's side (a listener at that port accepts nothing) and from the
/// attacker's (no `connect_ack`, no transfer); the honest spelling is the control, and an
/// honest consumer on host 2 is served byte-exact afterwards.
#[cfg(feature = "python-peers")]
#[test]
fn a_data_address_spelled_as_a_third_host_gets_no_tcp_writer() {
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let fleet = Fleet::new(3);
    let (_server, id) = fleet.serve(
        1,
        &[
            "--listen",
            "198.18.0.1:5600",
            "--plane",
            "tcp",
            "--blocks",
            "16",
            "--block-len",
            "4096",
            "--fill",
            "8",
        ],
    );
    // The third machine: host 2 listens where the attacker points the node's writer.
    let accepted = Arc::new(AtomicUsize::new(0));
    let listener = on_host(fleet.host(2), || {
        let l = TcpListener::bind("198.18.0.2:7700").unwrap();
        l.set_nonblocking(true).unwrap();
        l
    });
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (accepted, stop) = (accepted.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if listener.accept().is_ok() {
                    accepted.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let python = common::vllm::python().to_str().unwrap().to_owned();
    let script = common::vllm::repo().join("tests/hostile/attacker.py");
    let script = script.to_str().unwrap().to_owned();
    let attack = |tcp_host: &str, tcp_bind: &str| {
        let mut p = fleet.spawn_program(
            3,
            &python,
            &[
                &script,
                "session",
                "--node",
                &id,
                "--bind",
                "198.18.0.3:0",
                "--identity",
                "198.18.0.3:{port}",
                "--tcp-host",
                tcp_host,
                "--tcp-bind",
                tcp_bind,
                "--keys",
                "0-3",
                "--indexes",
                "0-3",
                "--wait",
                "3",
                "--linger",
                "0.5",
            ],
        );
        let summary = p.event("summary");
        assert_eq!(p.wait_while(WAIT, || {}), 0, "{}", p.log());
        summary
    };
    // Control: the attacker's own address, honestly written, gets the writer (on host 3).
    let honest = attack("198.18.0.3", "198.18.0.3:7701");
    assert_eq!(honest["connect_ack"], true, "control: {honest}");
    assert!(
        honest["tcp_bytes"].as_u64().unwrap_or(0) > 0,
        "control: the writer reached the honest data address: {honest}"
    );
    // 198.18.0.2 as one decimal number, and as IPv4-mapped IPv6.
    for spelled in ["3323068418", "[::ffff:198.18.0.2]"] {
        let s = attack(spelled, "198.18.0.3:7700");
        assert_eq!(s["connect_ack"], false, "{spelled}: {s}");
        assert_eq!(s["tcp_accepted"], 0, "{spelled}: {s}");
        assert_eq!(
            accepted.load(Ordering::Relaxed),
            0,
            "{spelled}: the node's writer connected to host 2: {s}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let (status, summary, log) = fleet.fetch(
        2,
        &[
            "--peer",
            &id,
            "--plane",
            "tcp",
            "--blocks",
            "16",
            "--block-len",
            "4096",
            "--requests",
            "2",
            "--keys",
            "4",
        ],
    );
    assert_eq!(status, 0, "{summary}\n{log}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
}

/// The README's two-host commands as written (with this fleet's addresses): a wildcard listen
/// is advertised as the host's routable address, a consumer with no `--listen` calls itself
/// by its address on the route, and a name and `localhost` reach the node.
#[test]
fn the_readmes_two_host_commands_work_as_written() {
    let fleet = Fleet::new(3);
    let (_a, id) = fleet.serve(
        1,
        &[
            "--listen",
            "0.0.0.0:5600",
            "--fill",
            "256",
            "--allow",
            "198.18.0.0/24",
        ],
    );
    assert_eq!(
        id, "198.18.0.1:5600",
        "a wildcard listen is never advertised"
    );
    let run = |host: usize, peer: &str, requests: &str| {
        fleet.fetch(
            host,
            &["--peer", peer, "--requests", requests, "--keys", "8"],
        )
    };
    let (status, summary, log) = run(2, "198.18.0.1:5600", "32");
    assert_eq!(status, 0, "{summary}\n{log}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    assert!(num(&summary, "hits") > 0, "{summary}");
    let (status, summary, log) = run(3, "host1:5600", "4");
    assert_eq!(status, 0, "by name: {summary}\n{log}");
    // `localhost` on the node's own host: a node of its own, not behind the /24 allowlist.
    let (_b, id_b) = fleet.serve(1, &["--listen", "0.0.0.0:5601", "--fill", "64"]);
    assert_eq!(id_b, "198.18.0.1:5601");
    let (status, summary, log) = run(1, "localhost:5601", "4");
    assert_eq!(status, 0, "localhost: {summary}\n{log}");
}

/// A consumer rank on `host` in the liveness group `group` (rank `rank`), with heartbeats of
/// `heartbeat_ms` (interval, timeout) and the default 1 s probe; load and lookup timeouts far
/// out, so only host liveness or the heartbeat can end a load.
fn rank_on(host: &Host, tag: &str, group: &str, rank: &str, heartbeat_ms: (u64, u64)) -> Node {
    let (addr, tag, group, rank) = (
        host.addr.clone(),
        tag.to_owned(),
        group.to_owned(),
        rank.to_owned(),
    );
    on_host(host, move || {
        let config = NodeConfig::builder(&tag)
            .listen(&addr, 0)
            .num_blocks(16)
            .block_len(1 << 20)
            .plane(PlaneKind::Tcp)
            .set("load_timeout_s", 60)
            .set("lookup_timeout_s", 60)
            .set("heartbeat_interval_ms", heartbeat_ms.0)
            .set("heartbeat_timeout_ms", heartbeat_ms.1)
            .set("liveness_group", group)
            .set("liveness_rank", rank)
            .build()
            .unwrap();
        Node::start(config).unwrap()
    })
}

/// A host that dies (its link cut: nothing on it answers, not even its kernel) while two ranks
/// of one engine on another host hold sessions to two of its processes: rank 0, whose
/// heartbeat is short (500 ms + 1.5 s), finds it first and tells rank 1, whose load from the
/// host's other process is in flight; rank 1 probes, nothing acknowledges, and its load fails
/// a second later, not at its own heartbeat's 12 s. The host is then held off on rank 1: a
/// session to its third process fails at once instead of waiting on a connect. (vLLM's issue
/// 56828: each rank's sessions waited for their own timeout, 36–43 s.)
#[test]
fn a_dead_host_fails_every_ranks_load_at_once_and_is_held_off() {
    const LEN: u64 = 1 << 20;
    let fleet = Fleet::new(2);
    // Host 1's transfers take a while (16 MiB at 64 Mbit/s: about 2 s): the cut lands in one.
    fleet.limit(1, "64mbit");
    let producer = |port: &str| {
        let listen = format!("198.18.0.1:{port}");
        let (p, id) = fleet.serve(
            1,
            &[
                "--listen",
                &listen,
                "--plane",
                "tcp",
                "--blocks",
                "32",
                "--block-len",
                "1048576",
                "--fill",
                "32",
            ],
        );
        (p, PeerId::new(id))
    };
    let (_p1, first) = producer("5600");
    let (_p2, second) = producer("5601");
    let (_p3, third) = producer("5602");
    let group = format!("fleet-{}", std::process::id());
    let rank0 = rank_on(fleet.host(2), "rank0", &group, "0/2", (500, 1500));
    let rank1 = rank_on(fleet.host(2), "rank1", &group, "1/2", (2000, 10000));
    // Another engine's rank beside them, in no group: what rank 1 would do alone.
    let outside = rank_on(
        fleet.host(2),
        "outside",
        &format!("{group}-b"),
        "0/1",
        (2000, 10000),
    );
    pull(&rank0, &first, "warm-0", &keys(0..2), LEN);
    let outside_keys = keys(0..16);
    let req = outside.request(&second, "outside").unwrap();
    let found = req.lookup(&outside_keys, WAIT).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    let outside_fetching = std::thread::spawn(move || {
        let r = req.fetch(&outside_keys, Duration::from_secs(90));
        req.finish();
        (r, Instant::now())
    });

    let in_flight = keys(16..32);
    let req = rank1.request(&second, "in-flight").unwrap();
    let found = req.lookup(&in_flight, WAIT).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    let fetching = std::thread::spawn(move || {
        let r = req.fetch(&in_flight, Duration::from_secs(90));
        req.finish();
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(400));
    let died = Instant::now();
    fleet.set_link(1, false);
    let (result, at) = fetching.join().unwrap();
    assert!(result.is_err(), "a load from a dead host cannot succeed");
    let after = at - died;
    eprintln!("rank 1's load failed {after:?} after its host died");
    assert!(
        after < Duration::from_secs(6),
        "rank 1's load failed {after:?} after its host died (its own heartbeat: 12 s)"
    );
    assert_eq!(rank0.stats().unwrap().host_liveness.hosts_down, 1);
    let liveness = rank1.stats().unwrap().host_liveness;
    assert_eq!(liveness.probe_losses, 1, "ended by its probe: {liveness:?}");
    assert_eq!(liveness.hosts_down, 1, "{liveness:?}");

    // Held off: a session to the host's third process fails at once, saying why.
    let asked = Instant::now();
    let refused = rank1
        .connect(&third, Duration::from_secs(30))
        .expect_err("no session with a dead host");
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}: {refused}",
        asked.elapsed()
    );
    assert!(refused.to_string().contains("taken for down"), "{refused}");
    // The rank no one told waits for its own heartbeat.
    let (result, at) = outside_fetching.join().unwrap();
    assert!(result.is_err());
    let alone = at - died;
    eprintln!("the rank outside the group failed its load {alone:?} after the host died");
    assert!(alone >= Duration::from_secs(8), "{alone:?}");
    assert_eq!(outside.stats().unwrap().host_liveness.probe_losses, 0);
    rank0.shutdown(Duration::from_secs(1));
    rank1.shutdown(Duration::from_secs(1));
    outside.shutdown(Duration::from_secs(1));
}
