//! `kvpeer serve` and `kvpeer fetch` with TLS on the control channel and the tcp plane, as a user
//! runs them: with `--tls required` and certificates from one CA the blocks arrive byte-exact
//! and the control connection, recorded through a relay, carries no field of any message; a
//! consumer with
//! no TLS is refused by a node requiring it, and a consumer requiring TLS refuses a node
//! without it, the refused side told why; a certificate file that cannot be used stops the node at start,
//! naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::Command;

mod common;
use common::{num, Proc, BIN};
#[path = "../../kvpeer-net/tests/tls_support/relay.rs"]
mod relay;
use relay::{contains, Relay};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};

/// A CA and one loopback node certificate, as PEM files in a folder removed on drop.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn new(tag: &str) -> Certs {
        let dir = std::env::temp_dir().join(format!("kvpeer-tls-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kvpeer fleet CA");
        let ca_key = KeyPair::generate().unwrap();
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST))];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("ca.key"), ca_key.serialize_pem()).unwrap();
        std::fs::write(dir.join("node.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("node.key"), key.serialize_pem()).unwrap();
        Certs { dir }
    }

    /// `--tls POLICY` and the three files.
    fn flags(&self, policy: &str) -> Vec<String> {
        let at = |f: &str| self.dir.join(f).display().to_string();
        vec![
            "--tls".into(),
            policy.into(),
            "--tls-cert".into(),
            at("node.pem"),
            "--tls-key".into(),
            at("node.key"),
            "--tls-ca".into(),
            at("ca.pem"),
        ]
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `kvpeer fetch` of 8 synthetic blocks over the tcp plane from `peer` with `extra` flags: its
/// exit status, stdout and stderr.
fn fetch(peer: &str, extra: &[String]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .args(["fetch", "--peer", peer, "--plane", "tcp"])
        .args(["--requests", "4", "--keys", "2", "--miss-share", "0"])
        .args(["--timeout-secs", "20"])
        .args(extra)
        .env("KVPEER_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kvpeer serve --plane tcp` with `flags`, expected to stop at start: its exit status and log.
fn serve_until_exit(flags: &[String], role: &str) -> (i32, String) {
    let mut args = vec!["serve", "--plane", "tcp"];
    args.extend(flags.iter().map(String::as_str));
    let mut node = Proc::spawn_env(&args, role, &[("KVPEER_LOG", "error")]);
    let status = node.wait_while(std::time::Duration::from_secs(30), || {
        std::thread::sleep(std::time::Duration::from_millis(20))
    });
    (status, node.log())
}

fn serve(extra: &[String]) -> (Proc, String) {
    let mut args: Vec<&str> = vec!["--plane", "tcp", "--fill", "8"];
    args.extend(extra.iter().map(String::as_str));
    let (node, id) = Proc::serve(&args);
    (node, id.to_string())
}

#[test]
fn serve_and_fetch_move_blocks_byte_exact_over_mutual_tls() {
    let certs = Certs::new("ok");
    let (node, id) = serve(&certs.flags("required"));
    let (status, summary, stderr) = fetch(&id, &certs.flags("required"));
    assert_eq!(status, Some(0), "{summary}\n{stderr}");
    assert_eq!(num(&summary, "hits"), 8, "{summary}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    // A consumer that prefers TLS uses it with this node too.
    let (status, summary, stderr) = fetch(&id, &certs.flags("preferred"));
    assert_eq!(status, Some(0), "{summary}\n{stderr}");
    assert_eq!(num(&summary, "hits"), 8, "{summary}");
    drop(node);
}

/// The consumer's control connection to the node, recorded through a relay the node advertises
/// as its address: with `--tls required` it opens with a TLS handshake and carries none of a
/// `connect`'s fields (its tokens, keys and proofs) nor a lookup's, and the blocks still come
/// byte-exact.
#[test]
fn the_control_channel_between_serve_and_fetch_is_inside_tls() {
    let certs = Certs::new("control");
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let relay = Relay::to(format!("127.0.0.1:{listen}").parse().unwrap());
    let front = relay.addr.port();
    let mut flags = certs.flags("required");
    flags.extend([
        "--listen".to_owned(),
        format!("127.0.0.1:{listen}"),
        "--advertise".to_owned(),
        format!("127.0.0.1:{front}"),
    ]);
    let (node, id) = serve(&flags);
    assert_eq!(id, format!("127.0.0.1:{front}"));
    let (status, summary, stderr) = fetch(&id, &certs.flags("required"));
    assert_eq!(status, Some(0), "{summary}\n{stderr}");
    assert_eq!(num(&summary, "hits"), 8, "{summary}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    let wire = relay.seen.lock().unwrap().clone();
    assert!(wire.len() > 1000, "{} bytes", wire.len());
    assert_eq!(
        wire[0], 0x16,
        "the control connection opened with a TLS handshake"
    );
    for field in [
        &b"agent_metadata"[..],
        b"peer_id",
        b"kv_request_id",
        b"Socket-Type",
    ] {
        assert!(
            !contains(&wire, field),
            "{} is on the wire",
            String::from_utf8_lossy(field)
        );
    }
    drop(node);
}

#[test]
fn a_node_requiring_tls_refuses_a_plaintext_peer_on_either_side_saying_why() {
    let certs = Certs::new("policy");
    let (tls_node, tls_id) = serve(&certs.flags("required"));
    // The consumer without TLS dials in clear: the node requiring TLS refuses its control
    // connection and tells it why; no session, no block written.
    let (status, summary, stderr) = fetch(&tls_id, &[]);
    assert_ne!(status, Some(0), "{summary}\n{stderr}");
    assert!(
        stderr.contains("this node takes TLS control connections only (tls = required)"),
        "the refused consumer is told why: {stderr}"
    );

    // A consumer requiring TLS against a node without it: its control port answers in clear,
    // and the consumer says so.
    let (plain_node, plain_id) = serve(&[]);
    let (status, summary, stderr) = fetch(&plain_id, &certs.flags("required"));
    assert_ne!(status, Some(0), "{summary}\n{stderr}");
    assert!(
        format!("{summary}{stderr}").contains("the peer speaks no TLS"),
        "{summary}\n{stderr}"
    );
    drop(plain_node);
    drop(tls_node);
}

#[test]
fn tls_files_that_cannot_be_used_stop_the_node_at_start_naming_them() {
    let certs = Certs::new("bad");
    // A missing key file, and a key that is not the certificate's (the CA's own file).
    let missing = certs.dir.join("nowhere.key").display().to_string();
    let mut flags = certs.flags("required");
    flags[5] = missing.clone();
    let (status, said) = serve_until_exit(&flags, "tls-bad");
    assert_ne!(status, 0, "{said}");
    assert!(
        said.contains("tls_key") && said.contains("nowhere.key"),
        "{said}"
    );

    // A key that is not the certificate's (the CA's).
    let mut flags = certs.flags("required");
    flags[5] = certs.dir.join("ca.key").display().to_string();
    let (status, said) = serve_until_exit(&flags, "tls-mismatch");
    assert_ne!(status, 0, "a mismatched key was taken: {said}");
    assert!(
        said.contains("tls_cert") && said.contains("tls_key"),
        "{said}"
    );

    // tls = required without the files.
    let (status, said) = serve_until_exit(&["--tls".into(), "required".into()], "tls-nofiles");
    assert_eq!(status, 2, "a configuration error: {said}");
    assert!(said.contains("tls_cert"), "{said}");
}
