//! The `kvpeer` command line.
//!
//! `kvpeer serve` runs a node, `kvpeer fetch` runs a consumer workload against one, and
//! `kvpeer wire decode|encode` inspects and crafts control-channel payloads. Each subcommand
//! returns its exit status; `main` only sets up logging, parses and dispatches.

mod demo_cmd;
mod fetch_cmd;
mod fetch_driven;
mod node_args;
mod serve_cmd;
mod wire_cmd;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc keeps the core's per-request cost flat as requests grow, where glibc's allocator
/// slows with many live objects (`cargo bench -p kvpeer-core --bench core`, docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvpeer: peer-to-peer KV-cache sharing for LLM inference, wire-compatible with vLLM's P2P
/// tier (vLLM 0.27-0.33).
#[derive(Debug, Parser)]
#[command(name = "kvpeer", version, propagate_version = true)]
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
    Fetch(fetch_cmd::FetchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs go to stderr (stdout carries results); KVPEER_LOG overrides the level.
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPEER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
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
