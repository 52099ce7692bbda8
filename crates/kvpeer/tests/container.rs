//! deploy/container/: the image built by `deploy/container/build.sh` from this repository alone
//! (no base image, no registry), run as docs/deploying.md runs it: on the host's network, its
//! root read-only, its configuration mounted. It starts as user 65532, is healthy and ready,
//! serves synthetic blocks byte-exact over the tcp plane to a `kvpeer fetch` outside it, and
//! stops with exit status 0 on `podman stop` (SIGTERM). A pool larger than the container's own
//! `/dev/shm` or its memory limit is refused before it is allocated (without the cgroup v1
//! reading, the kernel killed it mid-allocation), naming the option that gives it more; with
//! that option, it starts.
//!
//! Needs podman (Debian's `podman`, and `runc` where crun cannot run, as on a cgroup v1 host):
//! a plain `cargo test` leaves this out (feature `container`), scripts/test.sh turns it on,
//! and .ci/run installs both; the suite fails, never skips, without them. Every container and
//! image it makes carries this process's PID and is removed at its end; those of a run that
//! was killed stop within 300 s (`podman run --timeout`) and are removed at the next run's
//! start.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{field, free_port, http_get, num, set_key, BIN};

/// The label every container of this suite carries: the PID of the test process.
const LABEL: &str = "kvpeer-test-pid";
/// The repository of the images this suite builds (tagged with the PID).
const IMAGE_REPO: &str = "localhost/kvpeer-test";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn podman(args: &[&str]) -> Output {
    Command::new("podman")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "podman cannot be run ({e}): install it (Debian: apt-get install podman runc; \
                 .ci/run does)"
            )
        })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn alive(pid: &str) -> bool {
    PathBuf::from("/proc").join(pid).exists()
}

/// Removes the containers and images of earlier runs whose test process is gone.
fn remove_what_dead_runs_left() {
    let listed = podman(&[
        "ps",
        "-a",
        "--filter",
        &format!("label={LABEL}"),
        "--format",
        &format!("{{{{.ID}}}} {{{{index .Labels \"{LABEL}\"}}}}"),
    ]);
    for line in String::from_utf8_lossy(&listed.stdout).lines() {
        if let Some((id, pid)) = line.split_once(' ') {
            if !alive(pid) {
                podman(&["rm", "-f", "-t", "0", id]);
            }
        }
    }
    let images = podman(&[
        "images",
        "--filter",
        &format!("reference={IMAGE_REPO}"),
        "--format",
        "{{.Tag}}",
    ]);
    for tag in String::from_utf8_lossy(&images.stdout).lines() {
        if !alive(tag) {
            podman(&["rmi", "-f", &format!("{IMAGE_REPO}:{tag}")]);
        }
    }
}

/// This run's image and containers, removed when dropped (a failed assertion included).
struct Suite {
    image: String,
    /// How every container is run: the runtime that works here, and limits it may set.
    run_args: Vec<String>,
    containers: Vec<String>,
    dir: PathBuf,
}

impl Drop for Suite {
    fn drop(&mut self) {
        for name in &self.containers {
            podman(&["rm", "-f", "-t", "0", name]);
        }
        podman(&["rmi", "-f", &self.image]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Suite {
    /// Builds the image from the kvpeer binary under test, as an operator builds it.
    fn build() -> Suite {
        let pid = std::process::id();
        remove_what_dead_runs_left();
        let image = format!("{IMAGE_REPO}:{pid}");
        let dir = std::env::temp_dir().join(format!("kvpeer-container-{pid}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut suite = Suite {
            image: image.clone(),
            run_args: Vec::new(),
            containers: Vec::new(),
            dir,
        };
        let built = Command::new("bash")
            .arg(repo().join("deploy/container/build.sh"))
            .args(["--kvpeer", BIN, "--tag", &image, "--engine", "podman"])
            .output()
            .unwrap();
        assert!(built.status.success(), "build.sh: {}", text(&built));
        let said = String::from_utf8_lossy(&built.stdout).into_owned();
        assert_eq!(
            said.lines().last(),
            Some(image.as_str()),
            "{}",
            text(&built)
        );
        suite.run_args = suite.working_runtime();
        suite
    }

    /// The runtime that can start this image here: podman's default (crun), else runc (crun
    /// refuses a host whose cgroups are v1 with a v2 mount beside, as this machine's). The
    /// descriptor and process limits are set lower than the test's own, which a runtime in a
    /// user namespace may not raise; a node raises its soft limit to them.
    fn working_runtime(&self) -> Vec<String> {
        let limits = [
            "--ulimit",
            "nofile=4096:4096",
            "--ulimit",
            "nproc=4096:4096",
        ];
        let mut tried = String::new();
        for runtime in [None, Some("runc")] {
            let mut args: Vec<String> = Vec::new();
            if let Some(runtime) = runtime {
                args.extend(["--runtime".to_owned(), runtime.to_owned()]);
            }
            args.push("run".to_owned());
            args.extend(limits.iter().map(|s| s.to_string()));
            let mut probe = args.clone();
            probe.extend([
                "--rm".to_owned(),
                self.image.clone(),
                "--version".to_owned(),
            ]);
            let probe: Vec<&str> = probe.iter().map(String::as_str).collect();
            let out = podman(&probe);
            if out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("kvpeer ") {
                return args;
            }
            tried.push_str(&format!("\n{runtime:?}: {}", text(&out)));
        }
        panic!("no container runtime can start the image here:{tried}");
    }

    /// `podman run` of the image with `options` before it and `command` after it.
    fn run(
        &mut self,
        name_part: &str,
        options: &[&str],
        command: &[&str],
    ) -> (String, Vec<String>) {
        let name = format!("kvpeer-test-{}-{name_part}", std::process::id());
        self.containers.push(name.clone());
        let mut args = self.run_args.clone();
        args.extend(
            [
                "--name",
                name.as_str(),
                "--label",
                &format!("{LABEL}={}", std::process::id()),
                "--network",
                "host",
                "--read-only",
                // A container outlives a test process killed with SIGKILL: it is stopped by
                // conmon after this long, and removed by the next run's start.
                "--timeout",
                "300",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        args.extend(options.iter().map(|s| s.to_string()));
        args.push(self.image.clone());
        args.extend(command.iter().map(|s| s.to_string()));
        (name, args)
    }

    /// Runs a container to its end (at most `limit`); its exit status and what it printed.
    fn run_to_end(&mut self, name_part: &str, options: &[&str], command: &[&str]) -> (i32, String) {
        let (name, args) = self.run(name_part, options, command);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = podman(&args);
        let status = out.status.code().unwrap_or(-1);
        podman(&["rm", "-f", "-t", "0", &name]);
        (status, text(&out))
    }

    /// Starts a container in the background and waits for `kvpeer serve`'s ready line.
    fn start_serving(
        &mut self,
        name_part: &str,
        options: &[&str],
        command: &[&str],
    ) -> (String, String) {
        let (name, mut args) = self.run(name_part, options, command);
        args.insert(
            args.iter().position(|a| a == "run").unwrap() + 1,
            "-d".to_owned(),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = podman(&args);
        assert!(started.status.success(), "podman run: {}", text(&started));
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let logs = text(&podman(&["logs", &name]));
            if let Some(ready) = logs.lines().find(|l| l.starts_with("kvpeer serve: ready")) {
                return (name, ready.to_owned());
            }
            let running = podman(&["inspect", "--format", "{{.State.Running}}", &name]);
            assert!(
                Instant::now() < until && text(&running).trim() == "true",
                "the container did not become ready: {logs}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn inspect(&self, what: &str, of: &str) -> String {
        text(&podman(&["inspect", "--format", what, of]))
            .trim()
            .to_owned()
    }
}

#[test]
fn the_image_built_from_the_repository_serves_and_stops_cleanly_and_refuses_what_it_cannot_hold() {
    let mut suite = Suite::build();
    let image = suite.image.clone();
    assert_eq!(suite.inspect("{{.Config.User}}", &image), "65532:65532");
    assert_eq!(
        suite.inspect("{{json .Config.Cmd}}", &image),
        r#"["serve","--config","/etc/kvpeer/kvpeer.toml"]"#
    );
    assert_eq!(suite.inspect("{{.Config.StopSignal}}", &image), "SIGTERM");

    // The example configuration, as shipped but for this machine: loopback, free ports, a pool
    // of 32 blocks of its block size, loopback peers allowed; mounted read-only where the
    // image's command reads it.
    let toml = std::fs::read_to_string(repo().join("deploy/kvpeer.toml")).unwrap();
    let port = free_port();
    let tcp_port = free_port();
    let metrics = format!("127.0.0.1:{}", free_port());
    let toml = set_key(&toml, "listen_host", "\"127.0.0.1\"");
    let toml = set_key(&toml, "listen_port", &port.to_string());
    let toml = set_key(&toml, "tcp_port", &tcp_port.to_string());
    let toml = set_key(&toml, "num_blocks", "32");
    let toml = set_key(&toml, "allowlist", "[\"127.0.0.0/8\"]");
    let toml = set_key(&toml, "metrics_listen", &format!("\"{metrics}\""));
    // The shared secret, mounted read-only as docs/deploying.md says: owned by the image's
    // user, mode 0600 (the node refuses a world-readable one).
    let toml = format!("{toml}\nauth_secret_file = \"/run/secrets/auth_secret\"\n");
    let secret = suite.dir.join("auth_secret");
    std::fs::write(&secret, "a secret of the container suite, 16+ bytes\n").unwrap();
    std::fs::set_permissions(&secret, PermissionsExt::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&secret, Some(65532), Some(65532)).unwrap();
    let config = suite.dir.join("kvpeer.toml");
    std::fs::write(&config, toml).unwrap();
    let mount = format!("{}:/etc/kvpeer/kvpeer.toml:ro", config.display());
    let secret_mount = format!("{}:/run/secrets/auth_secret:ro", secret.display());
    // The suite's folder is the test's (root's): the image's user must reach the files in it.
    std::fs::set_permissions(&suite.dir, PermissionsExt::from_mode(0o755)).unwrap();

    let (name, ready) = suite.start_serving(
        "serve",
        &["-v", &mount, "-v", &secret_mount],
        &[
            "serve",
            "--config",
            "/etc/kvpeer/kvpeer.toml",
            "--fill",
            "8",
        ],
    );
    assert_eq!(field(&ready, "id").unwrap(), format!("127.0.0.1:{port}"));
    assert_eq!(
        field(&ready, "tcp").unwrap(),
        format!("127.0.0.1:{tcp_port}")
    );
    let top = text(&podman(&["top", &name, "user", "args"]));
    assert!(
        top.lines()
            .any(|l| l.contains("kvpeer serve") && !l.trim_start().starts_with("root")),
        "the node runs as root: {top}"
    );
    for probe in ["/healthz", "/readyz"] {
        let (head, _) = http_get(&metrics, probe);
        assert!(head.starts_with("HTTP/1.1 200"), "{probe}: {head}");
    }
    // A consumer outside the container loads the 8 synthetic blocks over the tcp plane, each
    // checked byte by byte against what the producer's seed makes.
    let block_len = field(&ready, "block_len").unwrap();
    let fetch_with = |secret: &Path| {
        Command::new(BIN)
            .args([
                "fetch",
                "--peer",
                &format!("127.0.0.1:{port}"),
                "--plane",
                "tcp",
            ])
            .args(["--requests", "4", "--keys", "2", "--miss-share", "0"])
            .args([
                "--blocks",
                "8",
                "--block-len",
                &block_len,
                "--timeout-secs",
                "20",
            ])
            .arg("--auth-secret-file")
            .arg(secret)
            .env("KVPEER_LOG", "error")
            .output()
            .unwrap()
    };
    // A consumer holding another secret is refused.
    let other = suite.dir.join("other_secret");
    std::fs::write(&other, "another secret, also 16+ bytes long\n").unwrap();
    std::fs::set_permissions(&other, PermissionsExt::from_mode(0o600)).unwrap();
    let refused = fetch_with(&other);
    assert_ne!(refused.status.code(), Some(0), "{}", text(&refused));
    let fetch = fetch_with(&secret);
    let summary = String::from_utf8_lossy(&fetch.stdout).into_owned();
    assert_eq!(fetch.status.code(), Some(0), "{}", text(&fetch));
    assert_eq!(num(&summary, "hits"), 8, "{summary}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    assert_eq!(num(&summary, "sessions_lost"), 0, "{summary}");

    // `podman stop` sends the image's stop signal; the node drains and exits 0 well within
    // the unit's 30 s.
    let asked = Instant::now();
    let stopped = podman(&["stop", "-t", "30", &name]);
    assert!(stopped.status.success(), "{}", text(&stopped));
    assert!(
        asked.elapsed() < Duration::from_secs(25),
        "{:?}",
        asked.elapsed()
    );
    let logs = text(&podman(&["logs", &name]));
    assert_eq!(suite.inspect("{{.State.ExitCode}}", &name), "0", "{logs}");
    assert!(logs.contains("stopping on signal signal=15"), "{logs}");

    // A shared-memory pool of 128 MiB in the container's own /dev/shm (64 MiB): refused
    // before it is allocated, naming --shm-size; with --shm-size 256m it starts.
    let both = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--plane",
        "both",
        "--blocks",
        "64",
        "--block-len",
        "2097152",
    ];
    let (status, said) = suite.run_to_end("shm", &[], &both);
    assert_eq!(status, 1, "{said}");
    assert!(
        said.contains("does not fit this host: /dev/shm has"),
        "{said}"
    );
    assert!(said.contains("start it with a larger --shm-size"), "{said}");
    assert!(!said.contains("allocating the pool"), "{said}");
    let (roomy, ready) = suite.start_serving("shm-roomy", &["--shm-size", "256m"], &both);
    assert_eq!(field(&ready, "plane").unwrap(), "both");
    podman(&["stop", "-t", "30", &roomy]);
    assert_eq!(suite.inspect("{{.State.ExitCode}}", &roomy), "0");

    // A private pool of 512 MiB in a container limited to 256 MiB: refused naming the limit
    // and --memory (before, the kernel killed it with SIGKILL while it touched the pool).
    let (status, said) = suite.run_to_end(
        "memory",
        &["--memory", "256m"],
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--plane",
            "tcp",
            "--blocks",
            "512",
            "--block-len",
            "1048576",
        ],
    );
    assert_eq!(status, 1, "{said}");
    assert!(
        said.contains("does not fit this host: the cgroup's memory limit has"),
        "{said}"
    );
    assert!(said.contains("start it with a larger --memory"), "{said}");
    drop(suite);

    let left = podman(&[
        "ps",
        "-a",
        "--filter",
        &format!("label={LABEL}={}", std::process::id()),
    ]);
    assert_eq!(
        text(&left).lines().count(),
        1,
        "containers left: {}",
        text(&left)
    );
}
