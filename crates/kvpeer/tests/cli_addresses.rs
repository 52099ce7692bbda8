//! Addresses as a user writes them (issue 36, class 2), checked from the outside against the
//! `kvpeer` binary: a peer named by a name or in another spelling of its address is the node
//! that listens there; a wildcard listen is advertised as an address of this host (or what
//! `--advertise` says), never as `0.0.0.0`, which no peer can dial. Everything here talks over
//! loopback only (a wildcard listen's own address is read, never dialed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::cli::Cli;
use common::field;

use kvpeer_proto::PeerAddr;

/// This host's interface addresses.
fn local_addresses() -> Vec<std::net::IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|ifs| {
            ifs.filter_map(|i| i.address)
                .filter_map(|a| {
                    a.as_sockaddr_in()
                        .map(|v4| std::net::IpAddr::V4(v4.ip()))
                        .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `kvpeer fetch --peer PEER --json` of 4 requests of 8 keys, all of them hits, every byte
/// checked by the child.
fn fetch_ok(peer: &str, plane: &str) {
    let (summary, _p) = Cli::fetch_shared(peer)
        .plane(plane)
        .pool(64, 4096)
        .workload(4, 8)
        .flag("--json")
        .run_json();
    assert_eq!(summary["hits"], 32, "{peer}: {summary}");
    assert_eq!(summary["corrupt_blocks"], 0, "{peer}: {summary}");
    assert_eq!(summary["failed_loads"], 0, "{peer}: {summary}");
}

/// `--peer localhost:P` (and `2130706433:P`, 127.0.0.1 as one number) reaches the node that
/// listens at `127.0.0.1:P` and calls itself so. Before, the consumer's session was with the
/// text `localhost:P` while the node answered as `127.0.0.1:P`: it never got a session, and its
/// error blamed the allowlist, the secret or full sessions.
#[test]
fn a_peer_named_by_name_or_number_is_the_node_at_that_address() {
    let (_server, id) = Cli::serve()
        .arg("--listen", "127.0.0.1:0")
        .pool(64, 4096)
        .arg("--fill", 32)
        .start_serving();
    let port = PeerAddr::of(&id).unwrap().port();
    for peer in [format!("localhost:{port}"), format!("2130706433:{port}")] {
        fetch_ok(&peer, "both");
    }
}

/// `serve --listen 0.0.0.0:0` is advertised (identity and tcp data address) as an address of
/// this host's interfaces, never as `0.0.0.0` (which a peer's `connect` reads as its own host).
#[test]
fn a_wildcard_listen_is_advertised_as_an_address_of_this_host() {
    for wildcard in ["0.0.0.0:0", "[::]:0"] {
        let (server, id) = Cli::serve()
            .arg("--listen", wildcard)
            .plane("tcp")
            .pool(16, 4096)
            .start_serving();
        let ready = server.ready.clone().unwrap();
        let id = PeerAddr::of(&id).unwrap();
        let tcp: PeerAddr = field(&ready, "tcp").unwrap().parse().unwrap();
        let ip = id.ip().unwrap();
        assert!(!ip.is_unspecified(), "{wildcard}: {ready}");
        assert!(
            local_addresses().contains(&ip),
            "{wildcard}: {ip} is not an address of this host: {ready}"
        );
        assert_eq!(
            tcp.host(),
            id.host(),
            "{wildcard}: the data address: {ready}"
        );
    }
}

/// `--advertise` names the identity a wildcard listen goes by: peers dial it, and its tcp data
/// address is on the same host; a fetch through it is served byte-exact.
#[test]
fn advertise_names_a_wildcard_listens_identity() {
    let (server, id) = Cli::serve()
        .arg("--listen", "0.0.0.0:0")
        .arg("--advertise", "127.0.0.1")
        .plane("tcp")
        .pool(64, 4096)
        .arg("--fill", 32)
        .start_serving();
    let ready = server.ready.clone().unwrap();
    assert!(id.as_str().starts_with("127.0.0.1:"), "{ready}");
    assert!(
        field(&ready, "tcp").unwrap().starts_with("127.0.0.1:"),
        "{ready}"
    );
    fetch_ok(id.as_str(), "tcp");
}

/// A consumer that calls itself by an address it does not have where the node sees it (here
/// `--advertise 198.51.100.7`, from loopback; across hosts, a fetch that called itself
/// `127.0.0.1`) is refused by the node's identity check, and told why: its last line names the
/// identity it claimed and the address it came from. Before, the node closed the connection
/// saying nothing, and the consumer's error blamed the allowlist, the secret or full sessions.
#[test]
fn a_consumer_whose_identity_its_address_cannot_back_is_told_both_addresses() {
    let (_server, id) = Cli::serve().pool(16, 4096).arg("--fill", 4).start_serving();
    let out = Cli::fetch(id.as_str())
        .pool(16, 4096)
        .workload(1, 1)
        .arg("--advertise", "198.51.100.7")
        .arg("--timeout-secs", 5)
        .output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or("");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        last.contains("refused by the peer")
            && last.contains("198.51.100.7:")
            && last.contains("claimed from another address (127.0.0.1)"),
        "the refusal names both addresses: {last}"
    );
}

/// A node named by another address than the one it calls itself (here a wildcard listen
/// advertised as `127.0.0.1:P`, dialed at `127.0.0.2:P`, which reaches it too) answers as its
/// identity, and tells it in its READY. `kvpeer fetch` asks once and takes that identity: it is
/// served byte-exact. A node started through the API that names it otherwise fails at once, and
/// its error names both addresses. Before, both waited out their connect and blamed the node's
/// allowlist, secret or sessions.
#[test]
fn a_node_named_otherwise_than_it_calls_itself_is_named_both_ways() {
    let (_server, id) = Cli::serve()
        .arg("--listen", "0.0.0.0:0")
        .arg("--advertise", "127.0.0.1")
        .plane("tcp")
        .pool(64, 4096)
        .arg("--fill", 32)
        .start_serving();
    let port = PeerAddr::of(&id).unwrap().port();
    let other = format!("127.0.0.2:{port}");
    fetch_ok(&other, "tcp");

    let node = kvpeer::Node::start(kvpeer::NodeConfig::local("cli-addresses-api")).unwrap();
    let err = node
        .connect(
            &kvpeer::PeerId::new(&other),
            std::time::Duration::from_secs(5),
        )
        .unwrap_err()
        .to_string();
    node.shutdown(std::time::Duration::from_secs(1));
    assert!(
        err.contains(&format!("the node at {other} calls itself {id}")),
        "the error names both addresses: {err}"
    );
}
