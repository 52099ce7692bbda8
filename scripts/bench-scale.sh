#!/usr/bin/env bash
# A node at a thousand peers (results in docs/benchmarks.md, "One node, many peers"): for
# N = 1, 10, 100, 1000 and 4000 real peer sessions against one release `kvpeer serve` (tcp
# plane, 16 KiB blocks, caps sized for N, idle eviction off), the node's RSS, descriptors and
# threads with every session idle, its idle CPU, the handshake of one more peer, a fixed fetch
# workload's lookup p50/p99 and CPU per request, and 2,000 lookups a second spread over the N
# peers (round trip p50/p99, CPU per lookup). crates/kvpeer/benches/scale.rs drives the peers.
#
#   scripts/bench-scale.sh [--sessions 1,10,100,1000,4000] [--before REV]
#
# --before REV also measures the node built from git revision REV (in a worktree under
# target/, built once), in the same run, so the table has a "before" beside the "after".
# 4,000 peers need about 3 descriptors each on the bench's side: the soft limit is raised to
# the hard one (see `ulimit -Hn`; docs/scaling.md says how to raise it).
set -euo pipefail
cd "$(dirname "$0")/.."
sessions="1,10,100,1000,4000"
before=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sessions) sessions=$2; shift 2 ;;
    --before) before=$2; shift 2 ;;
    *) echo "usage: $0 [--sessions N,N,...] [--before REV]" >&2; exit 2 ;;
  esac
done
cargo build -q --release -p kvpeer
after="$PWD/target/release/kvpeer"
mkdir -p target/bench
if [ -n "$before" ]; then
  tree="target/bench/before-$before"
  if [ ! -x "$tree/target/release/kvpeer" ]; then
    rm -rf "$tree"
    git worktree add -q --detach "$tree" "$before" 2>/dev/null || git -C "$tree" checkout -q "$before"
    (cd "$tree" && cargo build -q --release -p kvpeer)
  fi
  echo "== before: $before"
  cargo bench -q -p kvpeer --bench scale -- --kvpeer "$PWD/$tree/target/release/kvpeer" \
    --sessions "$sessions" --json "$PWD/target/bench/scale-before.json"
  echo
fi
echo "== after: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"
cargo bench -q -p kvpeer --bench scale -- --kvpeer "$after" --sessions "$sessions" \
  --json "$PWD/target/bench/scale-after.json"
echo "figures: target/bench/scale-*.json"
