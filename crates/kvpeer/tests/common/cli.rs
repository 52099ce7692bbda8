//! `kvpeer` command lines for the tests that run the binary: a builder for the flags they
//! repeat (pool size, plane, workload), and ways to run the result (a child [`Proc`], `serve`
//! until ready, or to completion).

use std::process::{Command, Output};
use std::time::Duration;

use kvpeer_proto::PeerId;

use super::{Proc, BIN};

/// A `kvpeer` command line, built flag by flag.
#[derive(Debug, Clone)]
pub(crate) struct Cli {
    args: Vec<String>,
}

impl Cli {
    /// `kvpeer COMMAND`.
    pub(crate) fn new(command: &str) -> Cli {
        Cli {
            args: vec![command.to_owned()],
        }
    }

    /// `kvpeer serve`.
    pub(crate) fn serve() -> Cli {
        Cli::new("serve")
    }

    /// `kvpeer fetch --peer PEER`.
    pub(crate) fn fetch(peer: &str) -> Cli {
        Cli::new("fetch").arg("--peer", peer)
    }

    /// `kvpeer fetch --peer PEER --miss-share 0`: every request asks only keys of the shared
    /// prefixes, so the counts of hits and misses follow from `--fill` alone.
    pub(crate) fn fetch_shared(peer: &str) -> Cli {
        Cli::fetch(peer).arg("--miss-share", 0)
    }

    /// Adds `FLAG VALUE`.
    pub(crate) fn arg(mut self, flag: &str, value: impl ToString) -> Cli {
        self.args.push(flag.to_owned());
        self.args.push(value.to_string());
        self
    }

    /// Adds a flag without a value (`--json`).
    pub(crate) fn flag(mut self, flag: &str) -> Cli {
        self.args.push(flag.to_owned());
        self
    }

    /// Puts a global option (`--log-format json`) before the subcommand.
    pub(crate) fn global(mut self, flag: &str, value: &str) -> Cli {
        self.args.splice(0..0, [flag.to_owned(), value.to_owned()]);
        self
    }

    /// `--plane PLANE`.
    pub(crate) fn plane(self, plane: &str) -> Cli {
        self.arg("--plane", plane)
    }

    /// `--blocks BLOCKS --block-len BLOCK_LEN`.
    pub(crate) fn pool(self, blocks: u64, block_len: u64) -> Cli {
        self.arg("--blocks", blocks).arg("--block-len", block_len)
    }

    /// `fetch`'s `--requests REQUESTS --keys KEYS`.
    pub(crate) fn workload(self, requests: u64, keys: u64) -> Cli {
        self.arg("--requests", requests).arg("--keys", keys)
    }

    /// The value after `flag` replaced (the last one given wins in clap, but a test that
    /// changes one reads better this way).
    pub(crate) fn with(mut self, flag: &str, value: impl ToString) -> Cli {
        match self.args.iter().position(|a| a == flag) {
            Some(at) if at + 1 < self.args.len() => self.args[at + 1] = value.to_string(),
            _ => return self.arg(flag, value),
        }
        self
    }

    /// The arguments, as `Proc` and `Command` take them.
    pub(crate) fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    /// The subcommand (its name tags the child's pool).
    fn command(&self) -> &str {
        self.args
            .iter()
            .find(|a| matches!(a.as_str(), "serve" | "fetch" | "demo" | "wire"))
            .map_or("kvpeer", String::as_str)
    }

    /// Starts it as a child with piped output.
    pub(crate) fn spawn(&self) -> Proc {
        Proc::spawn(&self.args(), self.command())
    }

    /// Starts `kvpeer serve ...` and waits for its ready line; returns it and its identity.
    pub(crate) fn start_serving(&self) -> (Proc, PeerId) {
        assert_eq!(self.args[0], "serve", "{:?}", self.args);
        Proc::serve(&self.args()[1..])
    }

    /// Runs `kvpeer ... --json` as a child to its end, which must succeed; its JSON summary
    /// (the child is returned too, for its logs).
    pub(crate) fn run_json(&self) -> (serde_json::Value, Proc) {
        let mut p = self.spawn();
        let line = p.line();
        assert_eq!(p.wait_while(Duration::from_secs(30), || {}), 0, "{line}");
        let summary =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        (summary, p)
    }

    /// Runs it to completion.
    pub(crate) fn output(&self) -> Output {
        Command::new(BIN)
            .args(&self.args)
            .output()
            .expect("kvpeer runs")
    }
}
