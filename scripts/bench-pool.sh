#!/usr/bin/env bash
# The pool benchmarks (results in docs/benchmarks.md):
#   1. issue 15's: a shared pool node for 4 in-process engines (hit rate, recompute saved, pull
#      bandwidth, the hit-rate curve into docs/pool-hit-rate.svg) and the follower's ingest rate
#      (crates/kvpeer/benches/pool.rs);
#   2. issue 21's: no pool, one pool, 2 and 4 pools sharded by rendezvous hashing of each
#      prefix's root chunk, through the tiers' `sources`, for 8 engines behind a round-robin
#      router and then a KV-aware one (hit rate, lookup p50/p99,
#      pull bandwidth, memory per pool; the curves into docs/pool-shards.svg;
#      crates/kvpeer/benches/pool_shards.rs).
# One command: scripts/bench-pool.sh [--requests N] [--rate R] [--seed S]  (both benches)
# The curves go to target/bench/ (printed at the end), never over the tracked docs/*.svg:
# KVPEER_BENCH_SVG_DIR=docs scripts/bench-pool.sh writes them where docs/benchmarks.md shows
# them, for a run whose figures go into the docs with them.
set -euo pipefail
cd "$(dirname "$0")/.."
svg_dir="${KVPEER_BENCH_SVG_DIR:-target/bench}"
mkdir -p "$svg_dir"
svg_dir="$(cd "$svg_dir" && pwd)"
cargo bench -q -p kvpeer --bench pool -- --svg "$svg_dir/pool-hit-rate.svg" "$@"
cargo bench -q -p kvpeer --bench pool_shards -- --svg "$svg_dir/pool-shards.svg" "$@"
echo "curves: $svg_dir/pool-hit-rate.svg $svg_dir/pool-shards.svg"
