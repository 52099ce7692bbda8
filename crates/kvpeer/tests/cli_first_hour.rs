//! What a user meets first with the `kvpeer` binary, checked from the outside (exit status,
//! the last line on stderr, stdout): `kvpeer fetch` says why it has no session for each cause
//! (nothing listens, not a control port, a port that never answers, an allowlist, a secret, a
//! configuration that differs, told in the refusing node's words with both values), in JSON
//! too; `fetch --help` carries no pool flag; a bad `KVPEER_LOG` stops the command; a pool node
//! announces its `--fill` blocks, warns of a `--follow` at nothing, and stops without a
//! warning; docs/pool.md's three commands work as written. An honest fetch is served
//! byte-exact by the same refusing nodes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use kvpeer::{synthetic, OffloadKey};
use kvpeer_pool::keys::{key_event, KeyEvent};
use kvpeer_proto::events::KvEvent;

mod common;
use common::cli::Cli;
use common::events::replayed_until;
use common::{free_port, num, Proc, BIN};

/// Runs `kvpeer fetch --peer PEER` with `extra` flags to its end: (exit status, stdout,
/// stderr's last line).
fn fetch(peer: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "fetch",
        "--peer",
        peer,
        "--requests",
        "1",
        "--keys",
        "1",
        "--timeout-secs",
        "3",
    ];
    args.extend_from_slice(extra);
    let out = std::process::Command::new(BIN)
        .args(&args)
        .env("KVPEER_LOG", "error")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or("").to_owned();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        last,
    )
}

/// The consumer's pool flags, then `more`.
fn with<'a>(more: &[&'a str]) -> Vec<&'a str> {
    ["--blocks", "16", "--block-len", "4096"]
        .into_iter()
        .chain(more.iter().copied())
        .collect()
}

/// A port that takes a connection and then does `then` with it (on its own thread, bounded).
fn listener(then: fn(std::net::TcpStream)) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        if let Ok((c, _)) = l.accept() {
            then(c);
        }
    });
    addr
}

#[test]
fn fetch_says_why_it_has_no_session_for_each_cause() {
    let nothing = format!("127.0.0.1:{}", free_port());
    let http = listener(|mut c| {
        let mut buf = [0u8; 64];
        let _ = c.read(&mut buf);
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_secs(2));
    });
    let mute = listener(|_c| std::thread::sleep(Duration::from_secs(8)));
    let secret = std::env::temp_dir().join(format!("kvpeer-first-hour-{}", std::process::id()));
    let other = secret.with_extension("other");
    std::fs::write(&secret, "one secret of this fleet, 32 b.").unwrap();
    std::fs::write(&other, "another fleet's secret, 32 bytes").unwrap();
    for file in [&secret, &other] {
        std::fs::set_permissions(file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
    }
    let secret_s = secret.display().to_string();
    let other_s = other.display().to_string();
    let base = |s: Cli| s.pool(16, 4096).arg("--fill", 4);
    let (_allow, allow_id) = base(Cli::serve())
        .arg("--allow", "10.9.9.9")
        .start_serving();
    let (_auth, auth_id) = base(Cli::serve())
        .arg("--auth-secret-file", &secret_s)
        .start_serving();
    let (_seed, seed_id) = base(Cli::serve()).arg("--hash-seed", "7").start_serving();
    let (_wide, wide_id) = Cli::serve().pool(16, 8192).arg("--fill", 4).start_serving();
    // A kvpeer peer that refuses us says why, with both values (the seeds by digest only).
    let seeds_told = format!(
        "the peer refused our connect: \"hash seed differs: yours (SHA-256 {}...) is not mine",
        kvpeer_core::seed_digest("5")
    );

    let cases: Vec<(&str, String, Vec<&str>, &str)> = vec![
        (
            "nothing listens",
            nothing.clone(),
            with(&[]),
            "control connection lost: nothing listens at 127.0.0.1:",
        ),
        (
            "not a control port",
            http,
            with(&[]),
            "not a kvpeer or vLLM control port: not a ZMTP greeting: its first bytes are \"HTTP/1.1 4\"",
        ),
        (
            "a port that never answers",
            mute,
            with(&[]),
            "no ZMTP handshake within 3.0 s: the port takes connections but does not answer",
        ),
        (
            "outside the allowlist",
            allow_id.to_string(),
            with(&[]),
            "closed by the peer before answering our connect: it refused this node (a kvpeer node's allowlist",
        ),
        (
            "another hash seed",
            seed_id.to_string(),
            with(&["--hash-seed", "5"]),
            &seeds_told,
        ),
        (
            "another block size",
            wide_id.to_string(),
            with(&[]),
            "the peer refused our connect: \"block_len differs: yours 4096, mine 8192\"",
        ),
    ];
    for (what, peer, extra, want) in &cases {
        let (status, stdout, last) = fetch(peer, extra);
        assert_eq!(status, 1, "{what}: {last}");
        assert!(stdout.is_empty(), "{what}: {stdout}");
        assert!(
            last.starts_with(&format!("kvpeer fetch: no session with {peer}: "))
                || last.starts_with(&format!("kvpeer fetch: {peer}: ")),
            "{what}: {last}"
        );
        assert!(last.contains(want), "{what}: {last}");
    }
    // Another secret and none are refused alike, with the same pointer at the cause.
    for extra in [with(&["--auth-secret-file", other_s.as_str()]), with(&[])] {
        let (status, _, last) = fetch(auth_id.as_str(), &extra);
        assert_eq!(status, 1, "{last}");
        assert!(
            last.contains("another --auth-secret-file or none"),
            "{last}"
        );
    }

    // With --json, stdout carries an object either way, and stderr's line is JSON too.
    let out = std::process::Command::new(BIN)
        .args([
            "--log-format",
            "json",
            "fetch",
            "--json",
            "--peer",
            &nothing,
        ])
        .args(["--requests", "1", "--keys", "1", "--timeout-secs", "3"])
        .env("KVPEER_LOG", "error")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let error = summary["error"].as_str().unwrap();
    assert!(error.contains("nothing listens at"), "{summary}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for line in stderr.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
    }
    let last: serde_json::Value = serde_json::from_str(stderr.lines().last().unwrap()).unwrap();
    assert_eq!(last["fields"]["message"].as_str(), Some(error));

    // The refusing nodes still serve a peer that is what they want, byte-exact.
    for (peer, extra) in [
        (
            auth_id.as_str(),
            with(&["--auth-secret-file", secret_s.as_str()]),
        ),
        (seed_id.as_str(), with(&["--hash-seed", "7"])),
    ] {
        let (status, stdout, last) = fetch(peer, &extra);
        assert_eq!(status, 0, "{last}");
        assert!(
            stdout.contains("hits=1 ") && stdout.contains("corrupt_blocks=0 "),
            "{stdout}"
        );
    }
    let _ = std::fs::remove_file(&secret);
    let _ = std::fs::remove_file(&other);
}

#[test]
fn fetch_help_has_no_pool_flag_and_serve_help_has_them_all() {
    let help = |cmd: &str| {
        let out = std::process::Command::new(BIN)
            .args([cmd, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let (fetch, serve) = (help("fetch"), help("serve"));
    for flag in [
        "--follow",
        "--pull-min-holders",
        "--pull-max-rate",
        "--pull-max-lookups",
        "--publish-events",
        "--publish-replay",
        "--publish-topic",
        "--publish-hashes",
        "--publish-ownership",
        "--shard",
    ] {
        assert!(!fetch.contains(flag), "fetch --help lists {flag}");
        assert!(serve.contains(flag), "serve --help lacks {flag}");
    }
    assert!(fetch.contains("--listen") && fetch.contains("--auth-secret-file"));
}

#[test]
fn a_kvpeer_log_that_is_no_filter_stops_the_command() {
    for (bogus, json) in [("bogus", false), ("info,loud", true)] {
        let mut cmd = std::process::Command::new(BIN);
        if json {
            cmd.args(["--log-format", "json"]);
        }
        let out = cmd.arg("demo").env("KVPEER_LOG", bogus).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "KVPEER_LOG={bogus}");
        assert!(out.stdout.is_empty(), "the demo did not run");
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err.lines().last().unwrap();
        let message = if json {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            v["fields"]["message"].as_str().unwrap().to_owned()
        } else {
            line.strip_prefix("kvpeer: ").unwrap().to_owned()
        };
        assert!(
            message.starts_with("KVPEER_LOG: ") && message.contains("TARGET=LEVEL"),
            "{message}"
        );
    }
}

#[test]
fn a_pool_node_announces_its_fill_and_stops_without_a_warning() {
    let publish = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let replay = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (mut node, _) = Proc::serve(&[
        "--blocks",
        "16",
        "--block-len",
        "4096",
        "--fill",
        "6",
        "--publish-events",
        &format!("tcp://{publish}"),
        "--publish-replay",
        &format!("tcp://{replay}"),
        "--metrics",
        "127.0.0.1:0",
    ]);
    let stored_keys = |events: &[KvEvent]| -> Vec<OffloadKey> {
        events
            .iter()
            .filter_map(|e| match key_event(e) {
                KeyEvent::Stored(k) => Some(k),
                _ => None,
            })
            .collect()
    };
    let events = replayed_until(publish, replay, |events| !stored_keys(events).is_empty());
    let mut stored = stored_keys(&events);
    stored.sort();
    let mut want: Vec<OffloadKey> = (0..6).map(synthetic::key).collect();
    want.sort();
    assert_eq!(stored, want, "the filled blocks are announced");
    // The metrics server holds the pool too: it still stops before the node, so nothing
    // calls a node that is gone.
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
    std::thread::sleep(Duration::from_millis(200));
    let log = node.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
    // Its synthetic blocks carry no tokens, which is said once, plainly, at info.
    let said: Vec<&str> = log.lines().filter(|l| l.contains("placeholder")).collect();
    assert!(
        said.len() == 1 && said[0].contains(" INFO ") && said[0].contains("follows no engine"),
        "{said:#?}"
    );
}

#[test]
fn a_pool_node_following_nothing_says_so() {
    let events = format!("tcp://127.0.0.1:{}", free_port());
    let follow = format!("{events}=127.0.0.1:{}", free_port());
    let (mut node, _) = Proc::serve(&["--follow", &follow]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let want = format!("no KV event stream after 10s: nothing publishes at {events}");
    while !node.log().contains(&want) {
        assert!(
            Instant::now() < deadline,
            "no warning; log:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
}

/// This host's `MemAvailable`, in bytes.
fn memory_available() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[test]
fn a_pool_larger_than_the_host_is_refused_before_anything_is_allocated() {
    // Twice the memory available, in 1 MiB blocks, on shm (the doc example that took a 24 GiB
    // machine down asked for 32 GiB). The child runs under a 4 GiB address-space limit, so
    // even a node that skipped its check could not touch such a pool: it would fail to map.
    let blocks = ((2 * memory_available()) >> 20).to_string();
    let port = free_port().to_string();
    let started = Instant::now();
    let child = std::process::Command::new("prlimit")
        .args(["--as=4294967296", "--", BIN, "serve", "--plane", "shm"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--blocks", &blocks, "--block-len", "1048576"])
        .env("KVPEER_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // prlimit execs the node in its own process: the pool's name carries that pid.
    let object = format!("/dev/shm/kvpeer-serve-{}", child.id());
    let out = child.wait_with_output().unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("does not fit this host")
            && stderr.contains(&format!("{blocks} blocks of 1048576 bytes"))
            && stderr.contains("lower num_blocks (--blocks)"),
        "the refusal names the sizes and the key: {stderr}"
    );
    assert!(
        !stderr.contains("allocating the pool"),
        "nothing was allocated: {stderr}"
    );
    assert!(
        !stderr.contains("ready follows"),
        "no promise of ready before the refusal: {stderr}"
    );
    assert!(took < Duration::from_secs(20), "refused after {took:?}");
    assert!(
        !std::path::Path::new(&object).exists(),
        "{object} left behind"
    );
    // The port never opened.
    assert!(std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err());
}

#[test]
fn a_node_says_what_it_allocates_before_its_port_opens() {
    let (mut node, _) = Proc::serve(&["--blocks", "16", "--block-len", "4096", "--plane", "shm"]);
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
    let log = node.log();
    let allocating = log.find("allocating the pool").expect(&log);
    let allocated = log.find("pool allocated").expect(&log);
    assert!(allocating < allocated, "{log}");
    assert!(
        log[allocating..]
            .lines()
            .next()
            .unwrap()
            .contains("64.0 KiB"),
        "{log}"
    );
    let serving = log.find("serving").expect(&log);
    assert!(allocated < serving, "{log}");
}

#[test]
fn a_large_pool_is_announced_before_it_is_allocated() {
    // 1 GiB of private memory (not /dev/shm): the smallest pool announced.
    let (mut node, _) = Proc::serve(&[
        "--blocks",
        "16384",
        "--block-len",
        "65536",
        "--plane",
        "tcp",
    ]);
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
    let log = node.log();
    assert!(
        log.contains(
            "kvpeer serve: allocating a pool of 1.0 GiB (16384 blocks of 65536 bytes, private \
             memory); ready follows"
        ),
        "{log}"
    );
}

#[test]
fn fetch_fails_when_its_session_is_lost_mid_run_or_its_hit_rate_is_too_low() {
    let (mut node, id) = Proc::serve(&["--blocks", "64", "--block-len", "4096", "--fill", "64"]);
    let id = id.to_string();
    // Every key hits: the rate is met. Keys past the filled ones all miss: it is not, and the
    // run says so, though every load that ran succeeded.
    let (code, _, last) = fetch(&id, &with(&["--min-hit-rate", "1"]));
    assert_eq!(code, 0, "{last}");
    let (code, stdout, last) = fetch(&id, &with(&["--first", "1000", "--min-hit-rate", "0.5"]));
    assert_eq!(code, 1, "{stdout} {last}");
    assert!(
        last.contains("hit rate 0.000 below --min-hit-rate 0.5"),
        "{last}"
    );
    let (code, _, last) = fetch(&id, &with(&["--first", "1000"]));
    assert_eq!(code, 0, "no rate asked, none enforced: {last}");

    // The peer dies while the run goes on: the requests after it miss, and the run fails.
    let mut args: Vec<String> = ["fetch", "--peer", &id, "--requests", "20000", "--keys", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(with(&["--json"]).iter().map(|s| s.to_string()));
    let child = std::process::Command::new(BIN)
        .args(&args)
        .env("KVPEER_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    node.child.kill().unwrap();
    node.child.wait().unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout} {stderr}");
    assert!(
        stderr.contains(&format!("the session with {id} ended during the run")),
        "{stderr}"
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(summary["sessions_lost"].as_u64() >= Some(1), "{summary}");
    assert!(
        summary["hits"].as_u64() > Some(0),
        "it ran before the peer died: {summary}"
    );
}

#[test]
fn a_named_pool_comes_back_after_a_kill_and_a_live_ones_name_is_refused() {
    let name = format!("kvpeer-named-test-{}-x", std::process::id());
    let object = format!("/dev/shm/{name}");
    let serve = |more: &[&str]| {
        let mut args = vec!["--blocks", "16", "--block-len", "4096", "--plane", "shm"];
        args.extend_from_slice(&["--shm-name", &name]);
        args.extend_from_slice(more);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let args = serve(&["--fill", "4"]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut first, id) = Proc::serve(&argv);
    assert!(first
        .ready
        .as_deref()
        .unwrap()
        .contains(&format!("shm={name}")));
    // A second node under the same name while the first lives: refused, saying why.
    let out = std::process::Command::new(BIN)
        .arg("serve")
        .args(serve(&[]))
        .env("KVPEER_LOG", "error")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        stderr.contains("a live node holds it") && stderr.contains("--shm-name"),
        "{stderr}"
    );
    // Killed: its object stays behind; a node started under its name takes it over and serves.
    first.kill9();
    assert!(std::path::Path::new(&object).exists());
    let (mut second, id2) = Proc::serve(&argv);
    let (code, _, last) = fetch(&id2.to_string(), &with(&[]));
    assert_eq!(code, 0, "{last}");
    assert_ne!(id, id2);
    assert_eq!(second.terminate(Duration::from_secs(20)), 0);
    assert!(
        !std::path::Path::new(&object).exists(),
        "removed at its orderly end"
    );
}

#[test]
fn a_dead_nodes_default_named_pool_is_removed_by_the_next_node_and_a_live_ones_never() {
    // A process that is gone: its pid names the object a node killed with SIGKILL left.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    // A live node's default-named pool (holding its lock).
    let (mut live, _) = Proc::serve(&["--blocks", "16", "--block-len", "4096", "--plane", "shm"]);
    let live_object = format!("/dev/shm/{}", live.shm);
    assert!(std::path::Path::new(&live_object).exists());
    let stale = format!("/dev/shm/kvpeer-serve-{pid}");
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    std::fs::write(format!("{stale}.fence"), vec![0u8; 8]).unwrap();
    // The next node with a shm pool removes the dead one's object (or a node of a test running
    // beside this one did, at its start) and leaves the live one's.
    let (mut next, _) = Proc::serve(&["--blocks", "16", "--block-len", "4096", "--plane", "shm"]);
    assert!(!std::path::Path::new(&stale).exists(), "{}", next.log());
    assert!(!std::path::Path::new(&format!("{stale}.fence")).exists());
    assert!(std::path::Path::new(&live_object).exists());
    assert_eq!(next.terminate(Duration::from_secs(20)), 0);
    assert_eq!(live.terminate(Duration::from_secs(20)), 0);
}

/// docs/pool.md's local pool quick start, its three commands as written (with free ports): the
/// "engine" and the pool node start, and the fetch from the pool gets the summary the page
/// shows once the pool has pulled, with exit status 0.
#[test]
fn the_pool_pages_three_commands_work_as_written() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/pool.md"))
        .unwrap();
    let section = page
        .split("## A local pool in three commands")
        .nth(1)
        .unwrap();
    let block = section
        .split("```sh\n")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let ports: Vec<(String, String)> = ["5601", "5602", "5557", "5558"]
        .iter()
        .map(|p| (format!(":{p}"), format!(":{}", free_port())))
        .collect();
    let commands: Vec<Vec<String>> = block
        .replace("\\\n", " ")
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut l = l.to_owned();
            for (from, to) in &ports {
                l = l.replace(from.as_str(), to);
            }
            let rest = l
                .strip_prefix("cargo run -q --release -p kvpeer -- ")
                .unwrap_or_else(|| panic!("not a kvpeer command: {l}"));
            rest.split_whitespace().map(str::to_owned).collect()
        })
        .collect();
    assert_eq!(commands.len(), 3, "{commands:?}");
    let args = |i: usize| commands[i].iter().map(String::as_str).collect::<Vec<_>>();
    let (_engine, _) = Proc::serve(&args(0)[1..]);
    let (_pool, _) = Proc::serve(&args(1)[1..]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = std::process::Command::new(BIN)
            .args(args(2))
            .env("KVPEER_LOG", "error")
            .output()
            .unwrap();
        let summary = String::from_utf8_lossy(&out.stdout).into_owned();
        if num(&summary, "hits") == 48 {
            assert_eq!(out.status.code(), Some(0), "{summary}");
            assert_eq!(num(&summary, "misses"), 16, "{summary}");
            assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
            assert!(summary.contains("hit_rate=0.75"), "{summary}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pool never held the blocks: {summary}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `--metrics 9100` (a bare port) is refused before anything starts, with the HOST:PORT forms.
#[test]
fn a_bare_metrics_port_is_refused_with_the_forms_it_needs() {
    let out = std::process::Command::new(BIN)
        .args(["serve", "--metrics", "9100"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("127.0.0.1:9100") && said.contains("0.0.0.0:9100"),
        "{said}"
    );
    // The same from the configuration file's metrics_listen, naming the file and the key.
    let file = std::env::temp_dir().join(format!("kvpeer-metrics-{}.toml", std::process::id()));
    std::fs::write(&file, "metrics_listen = \"9100\"\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--config", &file.display().to_string()])
        .output()
        .unwrap();
    std::fs::remove_file(&file).unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("metrics_listen: expected HOST:PORT, as 127.0.0.1:9100"),
        "{said}"
    );
}

/// The "no allowlist" warning is for a node others can reach: none on IPv6's loopback, as on
/// IPv4's; a wildcard listen gets it.
#[test]
fn loopback_nodes_are_not_warned_of_an_open_allowlist() {
    let warned = |listen: &str| {
        let (mut node, _) = Proc::serve(&["--listen", listen, "--blocks", "8"]);
        assert_eq!(node.terminate(Duration::from_secs(20)), 0);
        std::thread::sleep(Duration::from_millis(100));
        node.log().contains("no allowlist")
    };
    // IPv6's loopback where the host has one (a host with IPv6 off has no [::1] to listen on).
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        assert!(!warned("[::1]:0"));
    } else {
        eprintln!("no IPv6 loopback here: only IPv4's is checked");
    }
    assert!(!warned("127.0.0.1:0"));
    assert!(warned("0.0.0.0:0"));
}

/// Pull flags (or keys of its config file) on a node that follows no engine would do
/// nothing: it says which, as the user gave them.
#[test]
fn pull_flags_without_follow_are_named_as_doing_nothing() {
    let (mut node, _) = Proc::serve(&[
        "--blocks",
        "8",
        "--pull-max-rate",
        "5M",
        "--shard",
        "127.0.0.1:1",
    ]);
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
    std::thread::sleep(Duration::from_millis(100));
    let log = node.log();
    let line = log
        .lines()
        .find(|l| l.contains("do nothing without --follow"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains(" WARN ") && line.contains("--pull-max-rate --shard"),
        "{line}"
    );
    // The same settings from a config file are named by their keys (before: not at all).
    let config = std::env::temp_dir().join(format!("kvpeer-pull-keys-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "pull_max_rate = \"5M\"\npull_min_holders = 2\npool_shard = [\"127.0.0.1:1\"]\n",
    )
    .unwrap();
    let (mut node, _) = Proc::serve(&["--blocks", "8", "--config", config.to_str().unwrap()]);
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
    std::fs::remove_file(&config).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let log = node.log();
    let line = log
        .lines()
        .find(|l| l.contains("do nothing without --follow"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains("pull_min_holders pull_max_rate pool_shard"),
        "{line}"
    );
}

/// `fetch` logs only errors by default, but still the warnings about what the user configured:
/// a secret its group can read, and the pool node's keys it ignores, from a config file shared
/// with `serve` (before, both were silent without KVPEER_LOG).
#[test]
fn fetch_still_warns_of_its_configuration() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("kvpeer-fetch-warns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "a shared secret of 32 bytes, ok.").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
    let config = dir.join("kvpeer.toml");
    std::fs::write(
        &config,
        format!(
            "auth_secret_file = {:?}\npublish_events = \"tcp://127.0.0.1:0\"\n",
            secret.display().to_string()
        ),
    )
    .unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let out = std::process::Command::new(BIN)
        .args([
            "fetch",
            "--config",
            config.to_str().unwrap(),
            "--peer",
            &peer,
        ])
        .args(["--requests", "1", "--keys", "1", "--timeout-secs", "2"])
        .env_remove("KVPEER_LOG")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("the auth secret can be read by the file's group"),
        "{said}"
    );
    assert!(
        said.contains("the pool node's keys (follow, publish_events, ...) are ignored by fetch"),
        "{said}"
    );
    // The failure itself still once, last.
    assert!(
        said.lines()
            .last()
            .is_some_and(|l| l.starts_with(&format!("kvpeer fetch: no session with {peer}: "))),
        "{said}"
    );
}

/// A failed `fetch` says its cause once, in its last line: no node warning repeats it (unless
/// KVPEER_LOG asks for them).
#[test]
fn a_failed_fetch_says_its_cause_once() {
    let peer = format!("127.0.0.1:{}", free_port());
    let out = std::process::Command::new(BIN)
        .args(["fetch", "--peer", &peer, "--requests", "1", "--keys", "1"])
        .env_remove("KVPEER_LOG")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.len(), 1, "{said}");
    assert!(
        lines[0].starts_with(&format!("kvpeer fetch: no session with {peer}: ")),
        "{said}"
    );
}

/// `--help` lists the planes this build has; `--plane nixl` in a build without it is refused
/// with how to build it, before the demo says anything.
#[test]
fn the_planes_offered_are_the_planes_built() {
    let help = std::process::Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let listed = help.contains("[possible values: shm, tcp, both, nixl]");
    assert_eq!(listed, cfg!(feature = "nixl"), "{help}");
    assert!(help.contains("[possible values: shm, tcp, both"), "{help}");
    if !cfg!(feature = "nixl") {
        let out = std::process::Command::new(BIN)
            .args(["demo", "--plane", "nixl"])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{said}");
        assert!(
            out.stdout.is_empty(),
            "nothing before the refusal: {:?}",
            out.stdout
        );
        assert!(
            said.contains("built without the nixl plane: build with `--features nixl`"),
            "{said}"
        );
    }
}

/// A control port that is taken says where it came from when no flag gave it.
#[test]
fn a_taken_port_from_the_environment_says_so() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let run = |args: &[&str], env: Option<&str>| {
        let mut cmd = std::process::Command::new(BIN);
        cmd.arg("serve").args(args).env("KVPEER_LOG", "error");
        match env {
            Some(port) => cmd.env("VLLM_P2P_SIDE_CHANNEL_PORT", port),
            None => cmd.env_remove("VLLM_P2P_SIDE_CHANNEL_PORT"),
        };
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = run(&[], Some(&port));
    assert!(
        said.contains(&format!("cannot listen at 127.0.0.1:{port}"))
            && said.contains("(the address is from env VLLM_P2P_SIDE_CHANNEL_PORT)"),
        "{said}"
    );
    let listen = format!("127.0.0.1:{port}");
    let said = run(&["--listen", &listen], Some("1"));
    assert!(
        said.contains(&format!("cannot listen at {listen}")),
        "{said}"
    );
    assert!(!said.contains("the address is from"), "{said}");
    drop(taken);
}

/// Ctrl-C of a `fetch --json` prints the summary of the requests that ran (marked interrupted)
/// and exits 130; its pool's shared-memory object is gone.
#[test]
fn an_interrupted_fetch_prints_what_ran() {
    let (_node, id) = Proc::serve(&["--fill", "64"]);
    let mut fetch = std::process::Command::new(BIN)
        .args([
            "fetch",
            "--peer",
            id.as_str(),
            "--requests",
            "10000000",
            "--keys",
            "4",
            "--json",
        ])
        .env("KVPEER_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = fetch.id();
    std::thread::sleep(Duration::from_millis(1500));
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while fetch.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "fetch still running after SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = fetch.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    let summary: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(summary["interrupted"], true, "{summary}");
    assert!(summary["hits"].as_u64() > Some(0), "{summary}");
    assert_eq!(summary["corrupt_blocks"], 0, "{summary}");
    assert!(stderr.contains("stopped by signal 2"), "{stderr}");
    assert!(
        !std::path::Path::new(&format!("/dev/shm/kvpeer-fetch-{pid}")).exists(),
        "the fetch's pool was left behind"
    );
}
