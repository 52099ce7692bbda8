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
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -q -p kvpeer --bench pool -- --svg "$PWD/docs/pool-hit-rate.svg" "$@"
cargo bench -q -p kvpeer --bench pool_shards -- --svg "$PWD/docs/pool-shards.svg" "$@"
