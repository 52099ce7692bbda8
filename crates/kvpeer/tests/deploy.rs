//! deploy/: the systemd unit's command line and the example configuration it reads, run as
//! written, with only this machine's paths, ports and pool size put in: the node starts, is
//! healthy and ready, takes a session, and stops cleanly (exit status 0) on the unit's stop
//! signal within its stop timeout. `systemd-analyze verify` checks the unit itself where
//! systemd's tools are installed (CI's machines have them; a host without them still runs the
//! rest).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

mod common;
use common::{field, free_port, http_get, num, set_key, Proc, BIN};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The value of `key=` in the unit's `[Service]` lines (the first, whole line).
fn unit_setting<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("deploy/kvpeer.service has no {key}="))
}

#[test]
fn the_systemd_units_command_and_example_config_start_a_node_that_stops_cleanly() {
    let unit = std::fs::read_to_string(repo().join("deploy/kvpeer.service")).unwrap();
    let exec: Vec<&str> = unit_setting(&unit, "ExecStart")
        .split_whitespace()
        .collect();
    assert_eq!(exec[..2], ["/usr/local/bin/kvpeer", "serve"], "{exec:?}");
    let config_at = exec.iter().position(|w| *w == "--config").unwrap() + 1;
    assert_eq!(exec[config_at], "/etc/kvpeer/kvpeer.toml");
    assert_eq!(unit_setting(&unit, "KillSignal"), "SIGTERM");
    let stop_within: u64 = unit_setting(&unit, "TimeoutStopSec").parse().unwrap();

    // The example configuration, as shipped but for this machine: loopback, a free port, a
    // pool of 32 blocks of its block size, loopback peers allowed.
    let toml = std::fs::read_to_string(repo().join("deploy/kvpeer.toml")).unwrap();
    let port = free_port();
    let toml = set_key(&toml, "listen_host", "\"127.0.0.1\"");
    let toml = set_key(&toml, "listen_port", &port.to_string());
    let tcp_port = free_port();
    let toml = set_key(&toml, "tcp_port", &tcp_port.to_string());
    let toml = set_key(&toml, "num_blocks", "32");
    let toml = set_key(&toml, "allowlist", "[\"127.0.0.0/8\"]");
    let toml = set_key(&toml, "metrics_listen", "\"127.0.0.1:0\"");
    let dir = std::env::temp_dir().join(format!("kvpeer-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("kvpeer.toml");
    std::fs::write(&config, toml).unwrap();

    let mut args: Vec<String> = exec[1..].iter().map(|w| w.to_string()).collect();
    args[config_at - 1] = config.display().to_string();
    let mut command = Command::new(BIN);
    command.args(&args);
    for setting in unit.lines().filter_map(|l| l.strip_prefix("Environment=")) {
        let (k, v) = setting.split_once('=').unwrap();
        command.env(k, v);
    }
    let mut node = Proc::start(command, |pid| format!("kvpeer-deploy-{pid}"));
    let ready = node.line();
    assert!(ready.contains("ready"), "{ready}");
    let id = field(&ready, "id").unwrap();
    assert_eq!(id, format!("127.0.0.1:{port}"));
    assert_eq!(
        field(&ready, "tcp").unwrap(),
        format!("127.0.0.1:{tcp_port}")
    );
    let metrics = field(&ready, "metrics").unwrap();
    for probe in ["/healthz", "/readyz"] {
        let (head, _) = http_get(&metrics, probe);
        assert!(head.starts_with("HTTP/1.1 200"), "{probe}: {head}");
    }
    let block_len = field(&ready, "block_len").unwrap();
    // A consumer of the same block size gets a session (the node holds nothing yet: misses).
    let fetch = Command::new(BIN)
        .args(["fetch", "--peer", &id, "--requests", "2", "--keys", "2"])
        .args([
            "--blocks",
            "8",
            "--block-len",
            &block_len,
            "--timeout-secs",
            "10",
        ])
        .env("KVPEER_LOG", "error")
        .output()
        .unwrap();
    let summary = String::from_utf8_lossy(&fetch.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&fetch.stderr).into_owned();
    assert_eq!(fetch.status.code(), Some(0), "{summary}\n{stderr}");
    assert_eq!(num(&summary, "sessions_lost"), 0, "{summary}");
    assert_eq!(num(&summary, "requests"), 2, "{summary}");

    let status = node.terminate(Duration::from_secs(stop_within));
    assert_eq!(status, 0, "{}", node.log());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--tcp-port` (`tcp_port`) puts the data plane on one known port, so a firewall opens that
/// one; a port already taken stops the node at start, naming it.
#[test]
fn the_tcp_data_port_is_the_one_configured_and_a_taken_one_is_an_error() {
    let tcp_port = free_port().to_string();
    let (node, id) = Proc::serve(&["--plane", "tcp", "--fill", "8", "--tcp-port", &tcp_port]);
    let ready = node.ready.clone().unwrap();
    assert_eq!(
        field(&ready, "tcp").unwrap(),
        format!("127.0.0.1:{tcp_port}")
    );
    let fetch = Command::new(BIN)
        .args([
            "fetch",
            "--peer",
            id.as_str(),
            "--plane",
            "tcp",
            "--requests",
            "4",
            "--keys",
            "2",
        ])
        .args(["--miss-share", "0"])
        .env("KVPEER_LOG", "error")
        .output()
        .unwrap();
    let summary = String::from_utf8_lossy(&fetch.stdout).into_owned();
    assert_eq!(fetch.status.code(), Some(0), "{summary}");
    assert_eq!(num(&summary, "hits"), 8, "{summary}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");

    // Another node, and a fetch (which keeps the port it is given), on the taken port: each
    // stops at start naming it (bounded: a bind that wrongly succeeded would serve forever).
    let serve = ["serve", "--plane", "tcp", "--tcp-port", &tcp_port];
    let fetch = [
        "fetch",
        "--peer",
        id.as_str(),
        "--plane",
        "tcp",
        "--tcp-port",
        &tcp_port,
    ];
    for args in [&serve[..], &fetch[..]] {
        let mut taken = Proc::spawn_env(args, "taken", &[("KVPEER_LOG", "error")]);
        let status = taken.wait_while(Duration::from_secs(30), || {
            std::thread::sleep(Duration::from_millis(20))
        });
        std::thread::sleep(Duration::from_millis(100));
        let said = taken.log();
        assert_ne!(status, 0, "{args:?}: {said}");
        assert!(said.contains(&format!(":{tcp_port}")), "{args:?}: {said}");
    }
    drop(node);
}

#[test]
fn systemd_accepts_the_unit_where_its_tools_are_installed() {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed here: the unit's syntax is not checked");
        return;
    };
    assert!(version.status.success());
    // The unit needs systemd 247 (LoadCredential=, Type=exec, ProtectHostname=, ...), as
    // docs/deploying.md says; an older one would rightly refuse it.
    let said = String::from_utf8_lossy(&version.stdout).into_owned();
    let release: u32 = said
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("systemd-analyze --version: {said}"));
    if release < 247 {
        eprintln!("systemd {release} is older than the unit needs (247): not checked");
        return;
    }
    // The unit as installed, but for the binary's path (verify checks that it exists).
    let unit = std::fs::read_to_string(repo().join("deploy/kvpeer.service")).unwrap();
    let dir = std::env::temp_dir().join(format!("kvpeer-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvpeer.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/kvpeer", BIN)).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{said}");
    let complaints: Vec<&str> = said
        .lines()
        .filter(|l| l.contains("kvpeer.service"))
        .collect();
    assert!(complaints.is_empty(), "{said}");
}
