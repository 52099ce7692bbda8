//! Running vLLM's own P2P code as a peer process (`tests/interop/vllm_peer.py`), and reading
//! both sides' open state, for the interop tests.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{http_get, metrics_addr, samples, Proc, BIN};

#[path = "../../../kvpeer-net/tests/python_env/mod.rs"]
mod python_env;
pub(crate) use python_env::{python, pythonpath, repo};

/// `vllm_peer.py ARGS` (a vLLM peer process).
pub(crate) fn vllm(args: &[&str]) -> Proc {
    let mut command = Command::new(python());
    command
        .arg(repo().join("tests/interop/vllm_peer.py"))
        .args(args)
        .env("PYTHONPATH", pythonpath());
    let role = args[0].to_owned();
    Proc::start(command, move |pid| format!("kvpeer-vllm-{role}-{pid}"))
}

/// A vLLM producer serving synthetic blocks; returns it and its identity once it listens.
pub(crate) fn vllm_serve(extra: &[&str]) -> (Proc, String) {
    let mut args = vec!["serve"];
    args.extend_from_slice(extra);
    let p = vllm(&args);
    let id = p.event("ready")["id"].as_str().unwrap().to_owned();
    (p, id)
}

/// Runs a vLLM consumer to its end; returns its exit status and summary.
pub(crate) fn vllm_fetch(args: &[&str]) -> (i32, Value) {
    let mut all = vec!["fetch"];
    all.extend_from_slice(args);
    let mut p = vllm(&all);
    let summary = p.event("summary");
    let status = p.wait_while(Duration::from_secs(60), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    (status, summary)
}

/// What a kvpeer process on the shm plane needs to hear vLLM's session over kvpeer's Python
/// shm transport (`tests/interop/shm_transport.py`): that transport's tokens are bound to our
/// address only, since pyzmq cannot show it the challenge in our READY (docs/security.md,
/// "Fresh proofs").
pub(crate) const VLLM_SHM_TOKENS: &[&str] = &["--shm-allow-replayable-tokens", "true"];

/// `kvpeer serve` on the shm plane with metrics, plus `extra`.
pub(crate) fn kvpeer_serve(extra: &[&str]) -> (Proc, String) {
    kvpeer_serve_on(
        &["--plane", "shm", VLLM_SHM_TOKENS[0], VLLM_SHM_TOKENS[1]],
        extra,
    )
}

/// `kvpeer serve` with `plane` (its flags) and metrics, plus `extra`.
pub(crate) fn kvpeer_serve_on(plane: &[&str], extra: &[&str]) -> (Proc, String) {
    let mut args = plane.to_vec();
    args.extend_from_slice(&["--metrics", "127.0.0.1:0"]);
    args.extend_from_slice(extra);
    let (p, id) = Proc::serve(&args);
    (p, id.as_str().to_owned())
}

/// The directory of NIXL's `libnixl_capi.so`: `KVPEER_NIXL_LIB_DIR`, or the NIXL wheel that
/// scripts/test.sh installs into its venv.
pub(crate) fn nixl_lib_dir() -> String {
    if let Ok(dir) = std::env::var("KVPEER_NIXL_LIB_DIR") {
        return dir;
    }
    let lib = repo().join("target/kvpeer-venv/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|entries| {
        entries
            .filter_map(Result::ok)
            .map(|e| e.path().join("site-packages/.nixl_cu12.mesonpy.libs"))
            .find(|p| p.join("libnixl_capi.so").exists())
    });
    found
        .unwrap_or_else(|| {
            panic!("needs NIXL's wheel: run scripts/test.sh (it installs it) or set KVPEER_NIXL_LIB_DIR")
        })
        .display()
        .to_string()
}

pub(crate) fn metric(p: &Proc, name: &str) -> f64 {
    let (_, body) = http_get(&metrics_addr(p), "/metrics");
    samples(&body)
        .get(name)
        .copied()
        .unwrap_or_else(|| panic!("no {name} in\n{body}"))
}

/// Waits (bounded) until the serving process has no session, request, pin or transfer open.
pub(crate) fn assert_serve_clean(p: &Proc) {
    let open = [
        "kvpeer_sessions",
        "kvpeer_client_requests",
        "kvpeer_server_requests",
        "kvpeer_store_jobs",
        "kvpeer_inflight_transfers",
        "kvpeer_pool_pinned_blocks",
        "kvpeer_pool_writing_blocks",
    ];
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left: Vec<_> = open
            .iter()
            .map(|n| (*n, metric(p, n)))
            .filter(|(_, v)| *v != 0.0)
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still open: {left:?}\n{}",
            p.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The vLLM side left nothing open: no pins, no lookups, no request state, no transfers.
pub(crate) fn assert_vllm_clean(summary: &Value) {
    let left = &summary["leftover"];
    for k in ["pins", "open_lookups", "client_requests", "server_requests"] {
        assert_eq!(left[k], 0, "{k} left open: {summary}");
    }
    assert_eq!(left["pending_work"], false, "{summary}");
}

/// Stops a vLLM peer with SIGTERM (it must exit 0); its summary, which must show nothing open.
pub(crate) fn vllm_stop(p: &mut Proc) -> Value {
    assert_eq!(p.terminate(Duration::from_secs(20)), 0, "{}", p.log());
    let s = p.event("summary");
    assert_vllm_clean(&s);
    s
}

/// `kvpeer fetch --peer ID --json ARGS` against the vLLM `producer`, run to its end, which must
/// succeed with no failed load and no corrupt block; its JSON summary.
pub(crate) fn kvpeer_fetch(id: &str, args: &[&str], producer: &Proc) -> Value {
    let out = Command::new(BIN)
        .args(["fetch", "--peer", id, "--json"])
        .args(VLLM_SHM_TOKENS)
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{}", producer.log());
    let f: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(f["failed_loads"], 0, "{f}");
    assert_eq!(f["corrupt_blocks"], 0, "{f}");
    f
}

/// After a kvpeer consumer's `disconnect`: the vLLM producer ends the session as the peer's own
/// decision, holds no session, and stops cleanly; its summary.
pub(crate) fn vllm_stop_after_disconnect(producer: &mut Proc) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !producer.log().contains("peer disconnected") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let s = vllm_stop(producer);
    assert_eq!(s["deaths"][0]["reason"], "peer disconnected", "{s}");
    assert_eq!(s["leftover"]["sessions"], 0, "{s}");
    s
}

/// A vLLM PD consumer (`transport`: its transport flags) whose two rounds of 4 keys kvpeer never
/// writes: each load times out after 1 s, vLLM aborts it, and kvpeer's abort_ack names its
/// round. Its summary.
pub(crate) fn vllm_pd_fetch_aborted(id: &str, transport: &[&str]) -> Value {
    let mut args = transport.to_vec();
    args.extend_from_slice(&[
        "--peer",
        id,
        "--pd",
        "--requests",
        "1",
        "--keys",
        "4",
        "--miss-share",
        "0",
        "--rounds",
        "2",
        "--load-timeout",
        "1",
        "--expect-failures",
    ]);
    let (status, s) = vllm_fetch(&args);
    assert_eq!(status, 0, "{s}");
    assert_eq!(s["failed_loads"], 2, "{s}");
    assert_eq!(s["abort_ack_rounds"], serde_json::json!([0, 1]), "{s}");
    assert_vllm_clean(&s);
    s
}

/// A vLLM consumer (`transport`: its transport flags) runs `requests` requests of 12 keys
/// against kvpeer at `id`, in three lookup rounds each (two with 4 held keys, closed by a
/// fetch; the last all misses, closed by the terminal empty fetch); every byte checked. Its
/// summary, its counts checked.
pub(crate) fn vllm_fetch_three_rounds(
    transport: &[&str],
    id: &str,
    requests: u64,
    serve: &Proc,
) -> Value {
    let requests_arg = requests.to_string();
    let mut args = transport.to_vec();
    args.extend_from_slice(&[
        "--peer",
        id,
        "--requests",
        &requests_arg,
        "--keys",
        "12",
        "--miss-share",
        "0.3334",
        "--rounds",
        "3",
    ]);
    let (status, s) = vllm_fetch(&args);
    assert_eq!(status, 0, "{s}\n{}", serve.log());
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(requests * 8), Some(requests * 4)),
        "{s}"
    );
    assert_eq!(s["corrupt_blocks"], 0, "{s}");
    assert_eq!(s["failed_loads"], 0, "{s}");
    assert_eq!(s["bytes"], requests * 8 * 65536, "{s}");
    assert_eq!(s["received"]["transfer_done"], requests * 2, "{s}");
    assert_vllm_clean(&s);
    s
}

/// UCX on loopback only, in this process and the children it starts.
pub(crate) fn ucx_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_NET_DEVICES").is_none() {
            std::env::set_var("UCX_NET_DEVICES", "lo");
        }
        if std::env::var_os("UCX_MODULES").is_none() {
            std::env::set_var("UCX_MODULES", "^ib*");
        }
    });
}
