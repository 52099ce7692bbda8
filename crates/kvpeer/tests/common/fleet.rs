//! A fleet of hosts on this machine: one network namespace per host, each with its own address
//! on a bridge (in a namespace of its own, the "switch"), its own `/dev/shm` and its own
//! `/etc/hosts`, so processes on two hosts share nothing but the network, as on real hosts.
//!
//! Addresses come from 198.18.0.0/15 (RFC 2544's benchmarking range) and exist only inside the
//! namespaces this fleet made: nothing is routed out of them. Everything is removed when the
//! [`Fleet`] drops (its processes first, by PID), and a fleet left behind by a test process that
//! was killed is swept by the next one (its namespace names carry the creator's PID). Needs
//! root and `ip`; when namespaces cannot be made the test fails, saying why (it never skips).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{Proc, BIN};

/// The prefix of every namespace a fleet makes: `kvpf<creator pid>x<n>`.
const PREFIX: &str = "kvpf";

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Runs `ip ARGS`, panicking with its stderr when it fails.
pub(crate) fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("the fleet needs `ip` (iproute2): {e}"));
    assert!(
        out.status.success(),
        "ip {}: {} (the fleet suite needs root and network namespaces)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Runs `ip netns exec NS CMD...` to its end; returns whether it succeeded.
pub(crate) fn in_ns(ns: &str, cmd: &[&str]) -> bool {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .args(cmd)
        .status()
        .is_ok_and(|s| s.success())
}

/// Removes namespaces (and their host folders) of fleets whose creator is gone.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.split('x').next().unwrap_or_default();
        if pid.is_empty() || std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        kill_all_in(name);
        let _ = Command::new("ip").args(["netns", "del", name]).status();
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{name}"));
        let _ = std::fs::remove_dir_all(host_dir(name));
    }
}

/// SIGKILLs every process left in namespace `ns`.
fn kill_all_in(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

fn host_dir(ns: &str) -> PathBuf {
    std::env::temp_dir().join(format!("{ns}-host"))
}

/// One host of a fleet.
#[derive(Debug, Clone)]
pub(crate) struct Host {
    /// Its namespace.
    pub(crate) ns: String,
    /// Its address on the fleet's network.
    pub(crate) addr: String,
    /// Its name in every host's `/etc/hosts`.
    pub(crate) name: String,
    /// The host side of its link to the switch.
    pub(crate) link: String,
}

/// Several hosts joined by one switch.
pub(crate) struct Fleet {
    pub(crate) hosts: Vec<Host>,
    switch: String,
    namespaces: Vec<String>,
}

impl Fleet {
    /// `n` hosts, `198.18.0.1` … `198.18.0.n`, named `host1` … `hostn` in each host's
    /// `/etc/hosts` (with `localhost`), each with a default route through its link.
    pub(crate) fn new(n: usize) -> Fleet {
        sweep_stale();
        let tag = format!(
            "{PREFIX}{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let switch = format!("{tag}s");
        let mut fleet = Fleet {
            hosts: Vec::new(),
            switch: switch.clone(),
            namespaces: Vec::new(),
        };
        ip(&["netns", "add", &switch]);
        fleet.namespaces.push(switch.clone());
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &switch, "link", "set", "br0", "up"]);
        let mut hosts_file = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for i in 1..=n {
            hosts_file.push_str(&format!("198.18.0.{i} host{i}\n"));
        }
        for i in 1..=n {
            let ns = format!("{tag}h{i}");
            ip(&["netns", "add", &ns]);
            fleet.namespaces.push(ns.clone());
            let port = format!("p{i}");
            ip(&[
                "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &switch,
            ]);
            ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"]);
            let addr = format!("198.18.0.{i}");
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &ns, "route", "add", "default", "dev", "eth0"]);
            // `ip netns exec` mounts /etc/netns/NS/* over /etc/*.
            let etc = PathBuf::from(format!("/etc/netns/{ns}"));
            std::fs::create_dir_all(&etc).unwrap();
            std::fs::write(etc.join("hosts"), &hosts_file).unwrap();
            std::fs::create_dir_all(host_dir(&ns)).unwrap();
            fleet.hosts.push(Host {
                ns,
                addr,
                name: format!("host{i}"),
                link: port,
            });
        }
        fleet
    }

    /// Host `i` (1-based, as its address).
    pub(crate) fn host(&self, i: usize) -> &Host {
        &self.hosts[i - 1]
    }

    /// Starts `kvpeer ARGS` on host `i`, with that host's `/dev/shm`.
    pub(crate) fn spawn(&self, i: usize, args: &[&str], role: &str) -> Proc {
        let host = self.host(i);
        let dir = host_dir(&host.ns);
        // `ip netns exec` and `unshare` exec in place: the child's PID is kvpeer's own.
        let script = "mount --bind \"$0\" /dev/shm && exec \"$@\"";
        let mut command = Command::new("ip");
        command
            .args([
                "netns", "exec", &host.ns, "unshare", "--mount", "sh", "-c", script,
            ])
            .arg(&dir)
            .arg(BIN)
            .args(args)
            .env(
                "KVPEER_LOG",
                std::env::var("KVPEER_LOG").unwrap_or_else(|_| "info".into()),
            );
        let role = role.to_owned();
        Proc::start(command, move |pid| format!("kvpeer-{role}-{pid}"))
    }

    /// Starts `program ARGS` on host `i` (its network only: the program sees this machine's
    /// files, `/dev/shm` included).
    pub(crate) fn spawn_program(&self, i: usize, program: &str, args: &[&str]) -> Proc {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.host(i).ns, program])
            .args(args)
            .env("PYTHONUNBUFFERED", "1");
        Proc::start(command, |pid| format!("kvpeer-fleet-program-{pid}"))
    }

    /// `kvpeer serve ARGS` on host `i`; returns it and the identity its ready line gives.
    pub(crate) fn serve(&self, i: usize, args: &[&str]) -> (Proc, String) {
        let mut full = vec!["serve"];
        full.extend_from_slice(args);
        let mut p = self.spawn(i, &full, "serve");
        let ready = p.line();
        let id = super::field(&ready, "id").unwrap_or_else(|| panic!("not a ready line: {ready}"));
        p.ready = Some(ready);
        (p, id)
    }

    /// Runs `kvpeer fetch ARGS` on host `i` to its end: its exit status, its summary line (empty
    /// when it printed none) and its log.
    pub(crate) fn fetch(&self, i: usize, args: &[&str]) -> (i32, String, String) {
        let mut full = vec!["fetch"];
        full.extend_from_slice(args);
        let mut p = self.spawn(i, &full, "fetch");
        let status = p.wait_while(std::time::Duration::from_secs(60), || {});
        let summary = p.stdout.try_iter().last().unwrap_or_default();
        (status, summary, p.log())
    }

    /// Takes host `i`'s link down (`up = false`) or up: every connection across it stalls.
    pub(crate) fn set_link(&self, i: usize, up: bool) {
        let port = &self.host(i).link;
        ip(&[
            "-n",
            &self.switch,
            "link",
            "set",
            port,
            if up { "up" } else { "down" },
        ]);
    }

    /// Limits host `i`'s outgoing traffic to `rate` (tc's syntax, e.g. `200mbit`).
    pub(crate) fn limit(&self, i: usize, rate: &str) {
        let ns = &self.host(i).ns;
        assert!(
            in_ns(
                ns,
                &[
                    "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst",
                    "64kb", "latency", "400ms"
                ]
            ),
            "tc tbf on {ns}"
        );
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            kill_all_in(ns);
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
            let _ = std::fs::remove_dir_all(host_dir(ns));
        }
    }
}
