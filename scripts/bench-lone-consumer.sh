#!/usr/bin/env bash
# A lone consumer against one release `kvpeer serve` (issue 37: the shares are work-conserving):
# req/s, lookup p99 and producer CPU with the default config and with the shares off in effect
# (`inbound_ms_per_s = 1000`), in turn, in one run (tests/interop/bench_lone.py; results in
# docs/benchmarks.md). One command:
#   scripts/bench-lone-consumer.sh [--runs N] [--before OTHER_KVPEER_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p kvpeer
python3 tests/interop/bench_lone.py --kvpeer "${CARGO_TARGET_DIR:-target}/release/kvpeer" "$@"
