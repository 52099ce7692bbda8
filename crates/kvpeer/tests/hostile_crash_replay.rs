//! A peer can neither kill the node nor replay proofs into a later instance of it (issue 19,
//! classes 1 and 2), against real `kvpeer serve` processes and the attacker of
//! `tests/hostile/attacker.py` (run with `KVPEER_PYTHON`).
//!
//! * A peer that proved its shm pool and then shrinks that object under the node: the node's
//!   next write into it must fail that transfer, not the process (a node that maps peers'
//!   objects dies of SIGBUS). Judged from the attacker's side (the node answered, its
//!   connection stayed up) and by an honest fetch served byte-exact right after.
//! * A large sparse pool object: registering it must not make the node allocate it (the
//!   attacker reads its own object's allocated size).
//! * An impostor holding a node's address before the node binds it collects the proofs an
//!   honest kvpeer consumer sends there (`shm_token`, `kvpeer_auth`) and replays them to the
//!   real node, claiming the consumer's identity, then fetches into the consumer's pool. Judged
//!   from the attacker's side: the consumer's block was not written (and with authentication,
//!   the node closed the attacker's connection at the `connect`). The control run is the same script against a node told to accept proofs that are
//!   not bound to a connection (`shm_allow_replayable_tokens`): there the replay writes the
//!   consumer's block, so the refusal is the defence, not a broken attacker.
//!
//! Everything on 127.0.0.1; ports from the system; every wait bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use common::{free_port, Proc};
use hostile::*;

const BLOCKS: &str = "64";
const LEN: &str = "4096";

fn serve_shm(extra: &[&str]) -> (Proc, String) {
    let mut args = vec![
        "--plane",
        "shm",
        "--blocks",
        BLOCKS,
        "--block-len",
        LEN,
        "--fill",
        "32",
    ];
    args.extend_from_slice(extra);
    serve_at(&args, "info", None)
}

fn alive(p: &mut Proc) -> bool {
    p.child.try_wait().unwrap().is_none()
}

#[test]
fn a_peer_shrinking_its_proven_pool_under_the_node_does_not_kill_it() {
    let (mut server, id) = serve_shm(&[]);
    // Control: the same attacker, its object left alone, is served byte-exact.
    let control = attack(&[
        "session",
        "--node",
        &id,
        "--own-pool",
        "--shm-token",
        "from-object",
        "--keys",
        "0-7",
        "--indexes",
        "16-23",
    ]);
    println!("control: {control}");
    assert_eq!(
        control["transfer_done"],
        serde_json::json!([true]),
        "{control}"
    );
    assert_eq!(control["own_pool_bytes_ok"], true, "{control}");

    let s = attack(&[
        "session",
        "--node",
        &id,
        "--own-pool",
        "--shm-token",
        "from-object",
        "--keys",
        "0-7",
        "--indexes",
        "16-23",
        "--shrink-own-pool",
    ]);
    println!("shrunk: {s}");
    assert!(alive(&mut server), "the node died: {}", server.log());
    assert_eq!(s["connect_ack"], true, "{s}");
    // From the attacker's side: its fetch was answered (failed), not met by a dead socket.
    assert_eq!(s["transfer_done"], serde_json::json!([false]), "{s}");
    let run = honest_fetch(&id, "shm", 4, 8, &[]);
    assert_fetch_ok(&run, 32, "after a peer shrank its pool");
    assert!(alive(&mut server), "the node died: {}", server.log());
}

#[test]
fn registering_a_large_sparse_pool_allocates_none_of_it() {
    let (mut server, id) = serve_shm(&[]);
    // 1 GiB of 4 KiB blocks, sparse: nothing is allocated until someone writes it.
    let s = attack(&[
        "session",
        "--node",
        &id,
        "--own-pool",
        "--shm-token",
        "from-object",
        "--num-blocks",
        "262144",
        "--keys",
        "0-1",
        "--indexes",
        "5-6",
    ]);
    println!("sparse: {s}");
    assert_eq!(s["connect_ack"], true, "{s}");
    assert_eq!(s["transfer_done"], serde_json::json!([true]), "{s}");
    assert_eq!(s["own_pool_bytes_ok"], true, "{s}");
    let allocated = s["own_pool_allocated"].as_u64().unwrap();
    // The trailer page (written by the attacker) and nothing of the GiB before any write.
    assert!(
        allocated <= 64 * 1024,
        "the node allocated {allocated} bytes of the peer's object"
    );
    assert!(alive(&mut server));
    let run = honest_fetch(&id, "shm", 2, 8, &[]);
    assert_fetch_ok(&run, 16, "after a sparse registration");
}

/// The impostor at `port`, an honest `kvpeer fetch` dialling it (its proofs collected), then
/// the real node at that port with `node_extra`; returns the impostor's summary, after checking
/// an honest fetch against the real node during the replay.
fn replay_at_a_later_instance(challenge: &str, fetch_extra: &[&str], node_extra: &[&str]) -> Value {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let impostor = attacker(&["impostor", "--listen", &addr, "--challenge", challenge]);
    impostor.event("ready");
    // The victim: an honest consumer with its own shm pool, dialling what it takes for the node.
    let mut victim_args = vec![
        "fetch",
        "--peer",
        &addr,
        "--plane",
        "shm",
        "--blocks",
        BLOCKS,
        "--block-len",
        LEN,
        "--requests",
        "1",
        "--keys",
        "2",
        "--timeout-secs",
        "40",
    ];
    victim_args.extend_from_slice(fetch_extra);
    let _victim = Proc::spawn(&victim_args, "fetch");
    let captured = impostor.event("captured");
    println!("captured: {captured}");
    // The real node now binds the address the impostor held.
    let listen = addr.clone();
    let mut args = vec!["--listen", listen.as_str()];
    args.extend_from_slice(node_extra);
    let (mut node, id) = serve_shm(&args);
    assert_eq!(id, addr);
    // An honest peer of the same host is served meanwhile.
    let run = honest_fetch(&id, "shm", 4, 8, fetch_extra);
    assert_fetch_ok(&run, 32, "during the replay");
    let summary = impostor.event("summary");
    println!("replay: {summary}");
    assert!(alive(&mut node), "{}", node.log());
    summary
}

#[test]
fn proofs_collected_at_a_nodes_address_before_it_ran_open_nothing_at_the_real_node() {
    // Defaults: the impostor's READY gives no challenge (as a stock ROUTER), so the consumer's
    // token is the address-bound version 1, which the real node refuses.
    // (The node refuses the registration: the session is refused, its `disconnect` goes to the
    // victim's address; the attacker sees its fetch land nowhere.)
    let s = replay_at_a_later_instance("none", &[], &[]);
    assert_eq!(s["victim_block_written"], false, "{s}");

    // The impostor gives a challenge of its own: the token is bound to that connection.
    let s = replay_at_a_later_instance("random", &[], &[]);
    assert_eq!(s["victim_block_written"], false, "{s}");

    // Control: a node that accepts address-bound tokens takes the replay, and writes the
    // victim's pool where the attacker said (what kvpeer did before challenges).
    let dir = std::env::temp_dir().join(format!("kvpeer-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("replayable.toml");
    std::fs::write(&config, "shm_allow_replayable_tokens = true\n").unwrap();
    let s = replay_at_a_later_instance("none", &[], &["--config", config.to_str().unwrap()]);
    assert_eq!(s["victim_block_was_key"], false, "{s}");
    assert_eq!(
        s["victim_block_written"], true,
        "control: the replay should land: {s}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_signed_connect_collected_before_the_node_ran_is_refused_by_it() {
    let dir = std::env::temp_dir().join(format!("kvpeer-replay-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "a shared secret of more than 16 bytes\n").unwrap();
    // Only its owner may read a secret (the node refuses one every user can).
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let secret = secret.to_str().unwrap().to_owned();
    let auth = ["--auth-secret-file", secret.as_str()];
    for challenge in ["none", "random"] {
        let s = replay_at_a_later_instance(challenge, &auth, &auth);
        assert_eq!(s["closed_by_node"], true, "{challenge}: {s}");
        assert_eq!(s["victim_block_written"], false, "{challenge}: {s}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
