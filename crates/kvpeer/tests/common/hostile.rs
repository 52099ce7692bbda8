//! Helpers of the adversarial tests (`hostile_peers.rs`): the Python attacker
//! (`tests/hostile/attacker.py`, run with `KVPEER_PYTHON` as the other Python-using tests do),
//! `kvpeer serve` at a chosen log level or under a resource limit, honest `kvpeer fetch` runs,
//! and reading shm objects, a process's open files, CPU time and memory.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::vllm::{python, repo};
use crate::common::{field, Proc, BIN};

/// The attacker script with `args`, started (its own pool, if it makes one, is removed on drop).
pub(crate) fn attacker(args: &[&str]) -> Proc {
    attacker_with(args, false)
}

/// [`attacker`], with its stdin piped (to tell it things once it runs) when `stdin` is set.
pub(crate) fn attacker_with(args: &[&str], stdin: bool) -> Proc {
    let mut command = Command::new(python());
    command
        .arg(repo().join("tests/hostile/attacker.py"))
        .args(args)
        .env("PYTHONUNBUFFERED", "1");
    if stdin {
        command.stdin(Stdio::piped());
    }
    Proc::start(command, |pid| format!("kvpeer-hostile-{pid}"))
}

/// Runs the attacker to its end; returns its summary (panics, with its stderr, if it fails).
pub(crate) fn attack(args: &[&str]) -> Value {
    let mut p = attacker(args);
    let summary = p.event("summary");
    // Generous: an attack of many sessions waits out the node's dial backoff on each that
    // races the end of the one before it (about one in ten, 1.3 s each), more on a loaded machine.
    let status = p.wait_while(Duration::from_secs(180), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    assert_eq!(status, 0, "attacker failed: {}", p.log());
    summary
}

/// `kvpeer serve ARGS` with `KVPEER_LOG=level`, optionally under `prlimit` (`limit`, e.g.
/// `--nofile=1024:1024`: prlimit execs the binary, so the pid, and the pool's name, stay);
/// returns it and its identity once ready.
pub(crate) fn serve_at(args: &[&str], level: &str, limit: Option<&str>) -> (Proc, String) {
    let mut command = match limit {
        Some(l) => {
            let mut c = Command::new("prlimit");
            c.arg(l).arg(BIN);
            c
        }
        None => Command::new(BIN),
    };
    command.arg("serve").args(args).env("KVPEER_LOG", level);
    let mut p = Proc::start(command, |pid| format!("kvpeer-serve-{pid}"));
    let ready = p.line();
    let id = field(&ready, "id").unwrap_or_else(|| panic!("not a ready line: {ready}"));
    p.ready = Some(ready);
    (p, id)
}

/// A field of `serve`'s ready line (`shm`, `tcp`, `metrics`, ...).
pub(crate) fn ready(p: &Proc, key: &str) -> String {
    p.ready
        .as_deref()
        .and_then(|r| field(r, key))
        .unwrap_or_else(|| panic!("no {key}= in the ready line {:?}", p.ready))
}

/// What an honest `kvpeer fetch` run ended with.
#[derive(Debug)]
pub(crate) struct FetchRun {
    pub(crate) status: i32,
    pub(crate) summary: Value,
    pub(crate) stderr: String,
}

/// An honest `kvpeer fetch` of `requests` × `keys` synthetic keys from `peer`, every byte
/// checked by the child; `extra` flags after the defaults.
pub(crate) fn honest_fetch(
    peer: &str,
    plane: &str,
    requests: u64,
    keys: u64,
    extra: &[&str],
) -> FetchRun {
    let (requests, keys) = (requests.to_string(), keys.to_string());
    let mut args = vec![
        "fetch",
        "--miss-share",
        "0",
        "--peer",
        peer,
        "--plane",
        plane,
        "--blocks",
        "64",
        "--block-len",
        "4096",
        "--requests",
        &requests,
        "--keys",
        &keys,
        "--json",
        "--timeout-secs",
        "20",
    ];
    args.extend_from_slice(extra);
    let mut p = Proc::spawn(&args, "fetch");
    // Generous: an attack of many sessions waits out the node's dial backoff on each that
    // races the end of the one before it (about one in ten, 1.3 s each), more on a loaded machine.
    let status = p.wait_while(Duration::from_secs(180), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    std::thread::sleep(Duration::from_millis(100));
    let lines: Vec<String> = p.stdout.try_iter().collect();
    let summary = lines
        .iter()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or(Value::Null);
    FetchRun {
        status,
        summary,
        stderr: p.log(),
    }
}

/// Asserts an honest fetch got every block, byte-exact.
pub(crate) fn assert_fetch_ok(run: &FetchRun, hits: u64, context: &str) {
    assert_eq!(
        run.status, 0,
        "{context}: honest fetch failed: {} {}",
        run.summary, run.stderr
    );
    assert_eq!(run.summary["hits"], hits, "{context}: {}", run.summary);
    assert_eq!(
        run.summary["corrupt_blocks"], 0,
        "{context}: {}",
        run.summary
    );
    assert_eq!(run.summary["failed_loads"], 0, "{context}: {}", run.summary);
}

/// The bytes of `/dev/shm/<name>`.
pub(crate) fn shm_bytes(name: &str) -> Vec<u8> {
    std::fs::read(format!("/dev/shm/{name}"))
        .unwrap_or_else(|e| panic!("cannot read /dev/shm/{name}: {e}"))
}

/// Where two byte strings first differ, and how many bytes differ.
pub(crate) fn diff(a: &[u8], b: &[u8]) -> Option<(usize, usize)> {
    if a == b {
        return None;
    }
    let first = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    let count = a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    Some((first, count))
}

/// Open file descriptors of process `pid`.
pub(crate) fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// CPU time (user + system) of process `pid` so far.
pub(crate) fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces), closing ')' first.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after ')'.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    // USER_HZ is 100 on every Linux this runs on.
    Duration::from_millis(ticks * 10)
}

/// Resident memory of process `pid` in KiB (VmRSS).
pub(crate) fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Lines the child wrote to stderr so far.
pub(crate) fn log_lines(p: &Proc) -> usize {
    p.log().lines().count()
}

/// Waits (bounded) until `cond` holds; false if it never did.
pub(crate) fn eventually(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// A file under /dev/shm removed on drop.
pub(crate) struct ShmFile(pub(crate) String);

impl ShmFile {
    pub(crate) fn create(name: String, bytes: &[u8]) -> Self {
        std::fs::write(format!("/dev/shm/{name}"), bytes).unwrap();
        ShmFile(name)
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

/// This host's non-loopback IPv4 addresses (sources for "from another address" tests that
/// never leave the host).
pub(crate) fn local_non_loopback_v4() -> Vec<std::net::Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .map(|ifs| {
            ifs.filter_map(|i| i.address)
                .filter_map(|a| a.as_sockaddr_in().map(|v4| v4.ip()))
                .filter(|ip| !ip.is_loopback())
                .collect()
        })
        .unwrap_or_default()
}
