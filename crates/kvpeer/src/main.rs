//! The `kvpeer` command line.
//!
//! Today: `kvpeer wire decode|encode`, the tools to inspect and craft control-channel
//! payloads. Each subcommand returns its exit status; `main` only parses and dispatches.

mod wire_cmd;

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
Example:
  kvpeer wire decode --hex 81a474797065aa646973636f6e6e656374")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inspect and craft control-channel payloads (msgpack, as vLLM sends them).
    #[command(subcommand)]
    #[command(after_help = "\
Examples:
  kvpeer wire decode --hex 81a474797065aa646973636f6e6e656374
  echo '{\"type\":\"disconnect\"}' | kvpeer wire encode --hex")]
    Wire(wire_cmd::WireCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let status = match cli.command {
        Command::Wire(cmd) => wire_cmd::run(cmd),
    };
    ExitCode::from(status)
}
