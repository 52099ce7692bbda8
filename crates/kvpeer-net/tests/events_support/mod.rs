//! Shared by the KV event stream tests: bounded driving loops, and Python peers (vLLM 0.33's
//! own `kv_events.py`, extracted by `tests/interop/setup.sh`, or bare pyzmq) as child
//! processes spoken to line by line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvpeer_net::events::{EventSubscriber, SubEvent};

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

/// Moves every event `sub` holds into `into`.
pub(crate) fn take(sub: &mut EventSubscriber, into: &mut Vec<SubEvent>) {
    while let Some(e) = sub.poll_event() {
        into.push(e);
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Python with pyzmq and msgspec: `KVPEER_PYTHON`, or scripts/test.sh's venv.
pub(crate) fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVPEER_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo().join("target/kvpeer-venv/bin/python");
    assert!(
        venv.exists(),
        "needs Python with pyzmq and msgspec: run scripts/test.sh (it makes {}) or set KVPEER_PYTHON",
        venv.display()
    );
    venv
}

/// The PYTHONPATH holding vLLM 0.33's `kv_events.py` and the stubs (setup.sh, once per test
/// binary; `KVPEER_INTEROP_PYTHONPATH` names a prepared one).
pub(crate) fn pythonpath() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("KVPEER_INTEROP_PYTHONPATH") {
            return p;
        }
        let out = Command::new("bash")
            .arg(repo().join("tests/interop/setup.sh"))
            .env("KVPEER_PYTHON", python())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tests/interop/setup.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    })
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
