//! Helpers shared by the tests that run real processes: a child process killed by its PID
//! when dropped (its shared-memory pool removed), its stdout as lines, its stderr kept for
//! failure messages.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_proto::PeerId;

pub(crate) mod cli;
pub(crate) mod engines;
pub(crate) mod events;
pub(crate) mod fleet;
pub(crate) mod node;
pub(crate) mod node_io;
pub(crate) mod pool_memory;
pub(crate) mod vllm;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_kvpeer");

/// A child process, killed (by its PID) when dropped; its pool's shm object is removed too.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) stdout: mpsc::Receiver<String>,
    /// Everything the child wrote to stderr so far (its logs), for failure messages.
    pub(crate) stderr: Arc<Mutex<String>>,
    /// Signalled (by disconnect) when the stderr reader reached the end of the child's stderr.
    stderr_end: mpsc::Receiver<()>,
    /// The shm object of its pool, removed on drop (a killed child leaves it behind).
    pub(crate) shm: String,
    /// `serve`'s ready line.
    pub(crate) ready: Option<String>,
}

impl Proc {
    pub(crate) fn spawn(args: &[&str], role: &str) -> Proc {
        Self::spawn_env(args, role, &[])
    }

    pub(crate) fn spawn_env(args: &[&str], role: &str, env: &[(&str, &str)]) -> Proc {
        let mut command = Command::new(BIN);
        command.args(args).envs(env.iter().copied()).env(
            "KVPEER_LOG",
            std::env::var("KVPEER_LOG").unwrap_or_else(|_| "info".into()),
        );
        let role = role.to_owned();
        Self::start(command, move |pid| format!("kvpeer-{role}-{pid}"))
    }

    /// Starts `command` with piped output; `shm` names its pool's object from its pid.
    pub(crate) fn start(mut command: Command, shm: impl FnOnce(u32) -> String) -> Proc {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let log = stderr.clone();
        let (stderr_ended, stderr_end) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut log = log.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
            drop(stderr_ended);
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let shm = shm(child.id());
        Proc {
            child,
            stdout: rx,
            stderr,
            stderr_end,
            shm,
            ready: None,
        }
    }

    /// The next stdout line (bounded: 60 s, debug builds fill large pools slowly).
    pub(crate) fn line(&self) -> String {
        self.line_within(Duration::from_secs(60))
    }

    /// The next stdout line, waiting at most `bound`.
    pub(crate) fn line_within(&self, bound: Duration) -> String {
        match self.stdout.recv_timeout(bound) {
            Ok(line) => line,
            Err(e) => {
                // Let the stderr reader catch up with a child that just exited.
                std::thread::sleep(Duration::from_millis(200));
                panic!(
                    "no line from the child ({e}); its stderr:\n{}",
                    self.stderr.lock().unwrap()
                )
            }
        }
    }

    /// `kvpeer serve` with these extra args; returns it and its identity once ready.
    pub(crate) fn serve(extra: &[&str]) -> (Proc, PeerId) {
        let mut args = vec!["serve"];
        args.extend_from_slice(extra);
        let mut p = Proc::spawn(&args, "serve");
        let ready = p.line();
        let id = field(&ready, "id").unwrap_or_else(|| panic!("not a ready line: {ready}"));
        p.ready = Some(ready);
        (p, PeerId::new(id))
    }

    /// SIGKILL, then reap.
    pub(crate) fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits (bounded) for the exit status while `tick` runs.
    pub(crate) fn wait_while(&mut self, timeout: Duration, mut tick: impl FnMut()) -> i32 {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The child has exited, but the reader may not have taken its last lines yet
                // (a test that reads `stderr` next would miss the final error): wait for the
                // end of the pipe, bounded in case a grandchild inherited it.
                let _ = self.stderr_end.recv_timeout(Duration::from_secs(10));
                return status.code().unwrap_or(-1);
            }
            tick();
        }
        panic!("child still running after {timeout:?}");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.shm));
        // And its fence words (kvpeer_store::fence), left beside it by a kill too.
        let _ = std::fs::remove_file(format!("/dev/shm/{}.fence", self.shm));
    }
}

/// Stops process `pid` (SIGSTOP) and returns once every thread of it is stopped. The signal
/// is asynchronous: `kill` returns once it is queued, one thread is woken to start the group's
/// stop, and under load that thread may run milliseconds later while the others, woken by
/// their sockets, go on working (a "stopped" producer served a fetch sent after the `kill`).
pub(crate) fn stop_process(pid: u32) {
    let ok = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill -STOP {pid}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !all_threads_stopped(pid) {
        assert!(
            Instant::now() < deadline,
            "{pid} not stopped 10 s after SIGSTOP"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether every thread of `pid` is in the stopped state (`T` in `/proc/PID/task/TID/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.filter_map(Result::ok).all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // "TID (COMMAND) STATE ...": the command may hold spaces and parentheses.
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    })
}

/// Sends this process's logs (nodes it runs in-process) to the test's output at the level
/// `KVPEER_LOG` names (default warn); once per test binary, later calls do nothing.
pub(crate) fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVPEER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
}

/// `key=value` from a space-separated line.
pub(crate) fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(str::to_owned))
}

pub(crate) fn num(line: &str, key: &str) -> u64 {
    field(line, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

/// A port free on every interface right now, for a child process to bind. It is drawn below
/// the kernel's ephemeral range (32768 up by default), where no outgoing connection of another
/// test can take it between this check and the child's bind (vLLM's event publisher binds
/// `*:port`, which any connection's local 127.0.0.1:port blocks); each call in this process
/// draws another.
pub(crate) fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static DRAWN: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let start = std::process::id().wrapping_mul(7_919);
    for _ in 0..SPAN {
        let n = DRAWN.fetch_add(1, Ordering::Relaxed);
        let port = (FIRST + start.wrapping_add(n.wrapping_mul(4_099)) % SPAN) as u16;
        let free = |host: &str| std::net::TcpListener::bind((host, port)).is_ok();
        if free("0.0.0.0") && free("127.0.0.1") {
            return port;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + SPAN);
}

pub(crate) fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

/// `name{labels} value` lines of a Prometheus text body; panics on a line that is not one.
pub(crate) fn samples(body: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        out.insert(name.to_owned(), value);
    }
    out
}

/// The metrics address `serve` printed in its ready line (kept by `Proc::serve`).
pub(crate) fn metrics_addr(p: &Proc) -> String {
    p.ready
        .as_deref()
        .and_then(|r| field(r, "metrics"))
        .expect("metrics= in the ready line")
}

impl Proc {
    /// Sends SIGTERM (by PID) and waits (bounded) for the exit status.
    pub(crate) fn terminate(&mut self, timeout: Duration) -> i32 {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        self.wait_while(timeout, || std::thread::sleep(Duration::from_millis(5)))
    }

    /// The next stdout line that is a JSON object with `"event": event`.
    pub(crate) fn event(&self, event: &str) -> serde_json::Value {
        loop {
            // An attacker's summary comes at its end: a long attack on a loaded machine (many
            // sessions, each racing the end of the one before it) may take minutes.
            let line = self.line_within(Duration::from_secs(180));
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if v["event"] == event {
                    return v;
                }
            }
        }
    }

    /// Everything the child wrote to stderr so far.
    pub(crate) fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

/// CPU ticks (user + system, 1/100 s) of each thread of process `pid`, by thread name.
pub(crate) fn thread_ticks(pid: u32) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_owned();
        // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name's ')'.
        let f: Vec<u64> = stat[close + 1..]
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        out.push((
            name,
            f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0),
        ));
    }
    out
}

/// What each thread of `pid` spent during `window`, in ticks (threads that came or went in
/// it count what they spent while seen).
pub(crate) fn ticks_over(pid: u32, window: Duration) -> Vec<(String, u64)> {
    let before = thread_ticks(pid);
    std::thread::sleep(window);
    let after = thread_ticks(pid);
    after
        .into_iter()
        .map(|(name, t)| {
            let was = before
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0, |(_, t)| *t);
            (name, t.saturating_sub(was))
        })
        .collect()
}

/// `toml` with the line `key = ...` replaced by `key = value` (the key must be there, set,
/// not commented out): deploy/kvpeer.toml made to fit a test's machine.
pub(crate) fn set_key(toml: &str, key: &str, value: &str) -> String {
    let mut found = false;
    let out: Vec<String> = toml
        .lines()
        .map(|l| {
            if l.split('=').next().map(str::trim) == Some(key) && !l.starts_with('#') {
                found = true;
                format!("{key} = {value}")
            } else {
                l.to_owned()
            }
        })
        .collect();
    assert!(found, "the file sets no {key}");
    out.join("\n")
}
