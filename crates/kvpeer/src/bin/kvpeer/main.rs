//! The `kvpeer` command line.
//!
//! `kvpeer serve` runs a node, `kvpeer fetch` runs a consumer workload against one, and
//! `kvpeer wire decode|encode` inspects and crafts control-channel payloads. Each subcommand
//! returns its exit status; `main` only sets up logging, parses and dispatches.

mod demo_cmd;
mod fetch_cmd;
mod fetch_driven;
mod fetch_error;
mod fetch_workload;
mod node_args;
mod report;
mod serve_cmd;
mod wire_cmd;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc keeps the core's per-request cost flat as requests grow, where glibc's allocator
/// slows with many live objects (`cargo bench -p kvpeer-core --bench core`, docs/benchmarks.md).
/// Built without transparent huge pages (the workspace's `no_thp`): zeroing a fresh 2 MiB page
/// on the node's thread put 10-80 ms into a lookup's round trip now and then.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvpeer: peer-to-peer KV-cache sharing for LLM inference, wire-compatible with vLLM's P2P
/// tier (the releases: `kvpeer::SUPPORTED_VLLM`).
#[derive(Debug, Parser)]
#[command(name = "kvpeer", version, propagate_version = true)]
#[command(about = format!(
    "kvpeer: peer-to-peer KV-cache sharing for LLM inference, wire-compatible with vLLM's P2P \
     tier ({})",
    kvpeer::SUPPORTED_VLLM
))]
#[command(after_help = "\
Examples:
  kvpeer demo
  kvpeer wire decode --hex 81a474797065aa646973636f6e6e656374")]
struct Cli {
    /// Log lines on stderr: `human` or `json` (one object per line). KVPEER_LOG sets the level.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Two nodes on this machine share KV-cache blocks: a one-command tour, no setup.
    Demo(demo_cmd::DemoArgs),
    /// Inspect and craft control-channel payloads (msgpack, as vLLM sends them).
    #[command(subcommand)]
    #[command(after_help = "\
Examples:
  kvpeer wire decode --hex 81a474797065aa646973636f6e6e656374
  echo '{\"type\":\"disconnect\"}' | kvpeer wire encode --hex")]
    Wire(wire_cmd::WireCommand),
    /// Run a node that serves its block pool to peers (until SIGINT/SIGTERM).
    #[command(after_help = "\
Example:
  kvpeer serve --listen 127.0.0.1:5600 --fill 256")]
    Serve(serve_cmd::ServeArgs),
    /// Run a consumer workload against a serving node: lookup, fetch, verify every byte.
    #[command(after_help = "\
Example:
  kvpeer fetch --peer 127.0.0.1:5600 --requests 32 --keys 8")]
    Fetch(fetch_workload::FetchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    report::set_json(cli.log_format == LogFormat::Json);
    // Logs go to stderr (stdout carries results); KVPEER_LOG overrides the level. `fetch`
    // reports every failure in its summary and last line, so by default it logs only errors
    // (a node's per-session warnings would say each cause a second time), and the warnings
    // about what the user configured: the configuration's (a secret its group can read), the
    // command's own (keys it ignores) and the descriptors the caps need.
    let default = match cli.command {
        Command::Fetch(_) => FETCH_LOG_DEFAULT,
        _ => "warn",
    };
    let filter = match log_filter(std::env::var("KVPEER_LOG").ok().as_deref(), default) {
        Ok(f) => f,
        Err(e) => {
            report::fatal_line("", &e);
            return ExitCode::from(2);
        }
    };
    // Colour codes only for a person at a terminal: in a file, a pipe or a log collector they
    // are noise that breaks grep and JSON-minded readers.
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter);
    match cli.log_format {
        LogFormat::Human => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    let status = match cli.command {
        Command::Demo(args) => demo_cmd::run(args),
        Command::Wire(cmd) => wire_cmd::run(cmd),
        Command::Serve(args) => serve_cmd::run(args),
        Command::Fetch(args) => fetch_cmd::run(args),
    };
    ExitCode::from(status)
}

/// `fetch`'s log filter unless `KVPEER_LOG` says otherwise: errors, and warnings about the
/// configuration.
const FETCH_LOG_DEFAULT: &str =
    "error,kvpeer::config=warn,kvpeer::fetch_cmd=warn,kvpeer::node::descriptors=warn";

/// The level filter `KVPEER_LOG` names (`default` when unset or empty). Each of its
/// comma-separated directives must be a level (`off`, `error`, `warn`, `info`, `debug`,
/// `trace`) or `TARGET=LEVEL`: tracing would take a lone word such as `bogus` for a target
/// to show at every level, which silences every other log line without a word.
fn log_filter(value: Option<&str>, default: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let text = value
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or(default);
    for directive in text.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let level = directive
            .rsplit_once('=')
            .map_or(directive, |(_, level)| level);
        if !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "KVPEER_LOG: {directive:?} is neither a level ({}) nor TARGET=LEVEL \
                 (e.g. KVPEER_LOG=info or KVPEER_LOG=warn,kvpeer_net=debug)",
                LEVELS.join(", ")
            ));
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(text)
        .map_err(|e| format!("KVPEER_LOG: {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::log_filter;

    #[test]
    fn log_levels_and_directives_are_taken_and_a_lone_word_is_refused() {
        for good in [
            None,
            Some(""),
            Some("info"),
            Some("warn,kvpeer_net=debug"),
            Some("OFF"),
        ] {
            assert!(log_filter(good, "warn").is_ok(), "{good:?}");
        }
        for bad in ["bogus", "info,verbose", "kvpeer=loud"] {
            let e = log_filter(Some(bad), "warn").unwrap_err();
            assert!(
                e.starts_with("KVPEER_LOG: ") && e.contains("TARGET=LEVEL"),
                "{e}"
            );
        }
    }
}
