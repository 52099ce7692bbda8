#!/usr/bin/env bash
# Issue 15's benchmark: a shared pool node for 4 in-process engines (hit rate, recompute saved,
# pull bandwidth, the hit-rate curve into docs/pool-hit-rate.svg) and the follower's ingest
# rate (crates/kvpeer/benches/pool.rs; results in docs/benchmarks.md).
# One command: scripts/bench-pool.sh [--requests N] [--rate R] [--seed S] [--events N]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -q -p kvpeer --bench pool -- --svg "$PWD/docs/pool-hit-rate.svg" "$@"
