//! Shared by the KV event stream tests: bounded driving loops, and Python peers (vLLM 0.33's
//! own `kv_events.py`, extracted by `tests/interop/setup.sh`, or bare pyzmq) as child
//! processes spoken to line by line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_net::events::{EventSubscriber, SubEvent};

#[path = "../python_env/mod.rs"]
mod python_env;
pub(crate) use python_env::{python, pythonpath};

/// How long any loop of these tests may run before it fails (a liveness bound, not a
/// measurement: nothing asserts how fast anything is).
pub(crate) const BOUND: Duration = Duration::from_secs(30);

/// 127.0.0.1, a port the system picks.
pub(crate) fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Calls `step` until it says done; fails past [`BOUND`].
pub(crate) fn until(what: &str, mut step: impl FnMut() -> bool) {
    let deadline = Instant::now() + BOUND;
    while !step() {
        assert!(Instant::now() < deadline, "{what}: not within {BOUND:?}");
    }
}

/// The live batches among `events`: (seq, payload).
pub(crate) fn lives(events: &[SubEvent]) -> Vec<(u64, Vec<u8>)> {
    events
        .iter()
        .filter_map(|e| match e {
            SubEvent::Live { seq, payload } => Some((*seq, payload.clone())),
            _ => None,
        })
        .collect()
}

/// The replayed batches among `events`: (seq, payload).
pub(crate) fn replayed(events: &[SubEvent]) -> Vec<(u64, Vec<u8>)> {
    events
        .iter()
        .filter_map(|e| match e {
            SubEvent::Replayed { seq, payload } => Some((*seq, payload.clone())),
            _ => None,
        })
        .collect()
}

/// Moves every event `sub` holds into `into`.
pub(crate) fn take(sub: &mut EventSubscriber, into: &mut Vec<SubEvent>) {
    while let Some(e) = sub.poll_event() {
        into.push(e);
    }
}

/// A Python peer: its stdout as lines, its stdin to talk to it.
pub(crate) struct Py {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Py {
    /// Runs `script` with `args`; `vllm`: with vLLM's modules on PYTHONPATH.
    pub(crate) fn start(script: &str, args: &[String], vllm: bool) -> Py {
        let mut command = Command::new(python());
        command
            .arg("-u")
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if vllm {
            command.env("PYTHONPATH", pythonpath());
        }
        let mut child = command.spawn().unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            sink.lock().unwrap().push_str(&s);
        });
        Py {
            stdin: child.stdin.take(),
            child,
            lines,
            stderr,
        }
    }

    /// Writes one line to its stdin.
    pub(crate) fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// The next line it printed, if one is there.
    pub(crate) fn try_line(&mut self) -> Option<String> {
        self.lines.try_recv().ok()
    }

    /// The next line it prints (waiting for it, bounded).
    pub(crate) fn line(&mut self) -> String {
        match self.lines.recv_timeout(BOUND) {
            Ok(line) => line,
            Err(e) => panic!("no line from Python ({e}): {}", self.stderr()),
        }
    }

    /// What it wrote to stderr so far.
    pub(crate) fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Whether it exited; its status then must be success.
    pub(crate) fn exited(&mut self) -> bool {
        match self.child.try_wait().unwrap() {
            None => false,
            Some(status) => {
                // Let stderr's reader finish.
                std::thread::sleep(Duration::from_millis(20));
                assert!(status.success(), "Python failed: {}", self.stderr());
                true
            }
        }
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `bytes` as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lowercase hex back to bytes.
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}
