//! The control channel's floor: what one message round trip costs between two channels (two
//! nodes' channels in one process), in latency, CPU and context switches, next to the same
//! bytes over bare loopback TCP and over pyzmq ROUTER/DEALER sockets (vLLM's transport).
//!
//! Run: `cargo bench -p kvpeer-net --bench control` (`KVPEER_PYTHON` names a Python with pyzmq
//! for the pyzmq row; without it the row is skipped and says why). `KVPEER_BENCH_ROUNDS`
//! changes the number of round trips (20,000).
//!
//! A kvpeer request is two round trips (lookup → lookup_resp, fetch → transfer_done), so twice
//! this CPU is the transport's share of a request. Each row measures the same shape: side A
//! sends a lookup-sized msgpack payload (a real `lookup` of three keys) and waits for the
//! echo; side B echoes it. CPU and context switches are the whole process's (both sides and
//! every thread, `getrusage`), per round trip.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use kvpeer_net::control::{ChannelEvent, ControlChannel, ControlConfig};
use kvpeer_proto::{KvRequestId, Lookup, Message, OffloadKey, RoundSeq};

/// CPU used by the whole process, and its context switches (voluntary + involuntary).
fn usage() -> (Duration, i64) {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    (
        tv(u.user_time()) + tv(u.system_time()),
        u.voluntary_context_switches() + u.involuntary_context_switches(),
    )
}

/// One row of the table.
struct Row {
    name: String,
    p50: f64,
    p99: f64,
    cpu: f64,
    switches: f64,
}

impl Row {
    fn print(&self) {
        println!(
            "{:<34} {:>9.1} {:>9.1} {:>13.1} {:>12.2}",
            self.name, self.p50, self.p99, self.cpu, self.switches
        );
    }
}

/// Times `rounds` calls of `round_trip` after a warm-up.
fn measure(name: &str, rounds: usize, mut round_trip: impl FnMut()) -> Row {
    for _ in 0..200 {
        round_trip();
    }
    let (c0, s0) = usage();
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        round_trip();
        samples.push(t.elapsed());
    }
    let (c1, s1) = usage();
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    Row {
        name: name.to_owned(),
        p50: us(samples[rounds / 2]),
        p99: us(samples[rounds * 99 / 100]),
        cpu: us(c1 - c0) / rounds as f64,
        switches: (s1 - s0) as f64 / rounds as f64,
    }
}

/// A `lookup` of three 36-byte keys: the size of a typical lookup (about 170 bytes).
fn payload() -> Vec<u8> {
    Message::Lookup(Lookup {
        kv_request_id: KvRequestId::new("cmpl-0123456789abcdef0123456789abcdef-0"),
        keys: (0u8..3).map(|i| OffloadKey::from_bytes(&[i; 36])).collect(),
        round_seq: RoundSeq(0),
    })
    .encode()
    .unwrap()
}

/// Waits for the next payload on `ch` as a node's loop does: sleep in the channel's poll, then
/// read what it saw ready (one `recv` per wait).
fn next(ch: &mut ControlChannel) -> Vec<u8> {
    loop {
        ch.wait(Duration::from_secs(5)).unwrap();
        for event in ch.recv() {
            if let ChannelEvent::Payload { payload, .. } = event {
                return payload;
            }
        }
    }
}

fn kvpeer_row(message: &[u8], rounds: usize) -> Row {
    let mut a = ControlChannel::bind_any_port("127.0.0.1", ControlConfig::default()).unwrap();
    let mut b = ControlChannel::bind_any_port("127.0.0.1", ControlConfig::default()).unwrap();
    let (a_id, b_id) = (a.identity().clone(), b.identity().clone());
    let echo = std::thread::spawn(move || {
        for _ in 0..rounds + 200 {
            let payload = next(&mut b);
            b.send(&a_id, &payload).unwrap();
        }
        b
    });
    a.dial(&b_id).unwrap();
    let row = measure("kvpeer channel", rounds, || {
        a.send(&b_id, message).unwrap();
        next(&mut a);
    });
    // The channels drop here, after the echo side is done.
    drop(echo.join().unwrap());
    row
}

fn tcp_row(message: &[u8], rounds: usize) -> Row {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let len = message.len();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; len];
        for _ in 0..rounds + 200 {
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf).unwrap();
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut buf = vec![0u8; len];
    let row = measure("raw TCP (blocking, TCP_NODELAY)", rounds, || {
        s.write_all(message).unwrap();
        s.read_exact(&mut buf).unwrap();
    });
    echo.join().unwrap();
    row
}

/// vLLM's pattern in pyzmq: each side a ROUTER (bound) and a DEALER to the other's ROUTER;
/// A's DEALER sends, B's ROUTER receives, B's DEALER answers to A's ROUTER. Measured inside
/// Python (both sides and libzmq's I/O threads in one process).
const PYZMQ: &str = r#"
import resource, sys, threading, time, zmq
rounds, payload = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
ctx = zmq.Context()
def side(name):
    r = ctx.socket(zmq.ROUTER); r.setsockopt(zmq.LINGER, 0)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    return r, f"127.0.0.1:{port}"
ra, ida = side("a"); rb, idb = side("b")
def dealer(me, to):
    d = ctx.socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IDENTITY, me.encode()); d.setsockopt(zmq.SNDHWM, 1000)
    for opt, v in ((zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10000), (zmq.HEARTBEAT_TTL, 10000)):
        d.setsockopt(opt, v)
    d.connect(f"tcp://{to}"); return d
da, db = dealer(ida, idb), dealer(idb, ida)
def echo():
    for _ in range(rounds + 200):
        _, m = rb.recv_multipart(); db.send(m)
t = threading.Thread(target=echo); t.start()
def rt():
    da.send(payload); ra.recv_multipart()
for _ in range(200): rt()
u0 = resource.getrusage(resource.RUSAGE_SELF)
samples = []
for _ in range(rounds):
    t0 = time.perf_counter(); rt(); samples.append(time.perf_counter() - t0)
u1 = resource.getrusage(resource.RUSAGE_SELF)
t.join()
samples.sort()
cpu = (u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime) / rounds * 1e6
sw = (u1.ru_nvcsw + u1.ru_nivcsw - u0.ru_nvcsw - u0.ru_nivcsw) / rounds
print(samples[rounds // 2] * 1e6, samples[rounds * 99 // 100] * 1e6, cpu, sw)
"#;

fn pyzmq_row(message: &[u8], rounds: usize) -> Result<Row, String> {
    let python = std::env::var_os("KVPEER_PYTHON").ok_or("KVPEER_PYTHON is not set")?;
    let hex: String = message.iter().map(|b| format!("{b:02x}")).collect();
    let out = Command::new(python)
        .args(["-c", PYZMQ, &rounds.to_string(), &hex])
        .output()
        .map_err(|e| format!("cannot run KVPEER_PYTHON: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "python failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text
        .split_whitespace()
        .map(|x| x.parse().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let [p50, p99, cpu, switches] = v[..] else {
        return Err(format!("unexpected output {text:?}"));
    };
    Ok(Row {
        name: "pyzmq ROUTER/DEALER (vLLM's)".into(),
        p50,
        p99,
        cpu,
        switches,
    })
}

fn main() {
    let rounds: usize = std::env::var("KVPEER_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20_000);
    let message = payload();
    // Which rows to run (all by default): `KVPEER_BENCH_ONLY=kvpeer` for one (under strace).
    let only = std::env::var("KVPEER_BENCH_ONLY").unwrap_or_default();
    let run = |name: &str| only.is_empty() || only == name;
    println!(
        "control round trip: {rounds} round trips of a {}-byte msgpack lookup, loopback, \
         CPU and context switches of the whole process per round trip (both sides)",
        message.len()
    );
    println!(
        "{:<34} {:>9} {:>9} {:>13} {:>12}",
        "transport", "p50 µs", "p99 µs", "CPU µs/rt", "ctx sw/rt"
    );
    let kvpeer = run("kvpeer").then(|| kvpeer_row(&message, rounds));
    if let Some(r) = &kvpeer {
        r.print();
    }
    let tcp = run("tcp").then(|| tcp_row(&message, rounds));
    if let Some(r) = &tcp {
        r.print();
    }
    if run("pyzmq") {
        match pyzmq_row(&message, rounds) {
            Ok(r) => r.print(),
            Err(why) => println!("{:<34} skipped: {why}", "pyzmq ROUTER/DEALER (vLLM's)"),
        }
    }
    if let (Some(k), Some(t)) = (kvpeer, tcp) {
        println!(
            "kvpeer / raw TCP: p50 {:.2}×, CPU {:.2}× (goal ≤ 3×)",
            k.p50 / t.p50,
            k.cpu / t.cpu
        );
    }
}
