#!/usr/bin/env bash
# The idle cost of a node, on every data plane (issue 14; results in docs/benchmarks.md):
# `kvpeer serve` with no peer, and the same node right after it served a consumer's fetches
# (its planes' threads must go back to sleep). CPU of all the node's threads over the window,
# from /proc/PID/task/*/schedstat (nanoseconds on the CPU), and the busiest thread.
#   scripts/bench-idle.sh [--seconds N] [--kvpeer BIN]
# Builds the release binary with the nixl plane; NIXL's library comes from the venv of
# scripts/test.sh (KVPEER_VENV) or KVPEER_NIXL_LIB_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=10
bin=target/release/kvpeer
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --kvpeer) bin=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds N] [--kvpeer BIN]" >&2; exit 2 ;;
  esac
done
venv=${KVPEER_VENV:-target/kvpeer-venv}
if [ "$bin" = target/release/kvpeer ]; then
  cargo build -q --release -p kvpeer --features nixl
fi
if [ -z "${KVPEER_NIXL_LIB_DIR:-}" ]; then
  KVPEER_NIXL_LIB_DIR="$(cd "$(dirname "$(ls "$venv"/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so)")" && pwd)"
fi
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_MODULES=${UCX_MODULES:-'^ib*'}
tmp="$(mktemp -d)"
pid=""
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi; rm -rf "$tmp"' EXIT

# Per thread: "tid name ns" of process $1 (a thread that ends meanwhile is left out).
snap() {
  local t name ns
  for t in /proc/"$1"/task/*; do
    name="$(tr ' ' _ < "$t/comm" 2>/dev/null)" || continue
    ns="$(cut -d' ' -f1 "$t/schedstat" 2>/dev/null)" || continue
    echo "$(basename "$t") $name $ns"
  done | sort
}

# CPU µs of process $1 over $seconds s, then the busiest thread as name=µs.
measure() {
  snap "$1" > "$tmp/a"; sleep "$seconds"; snap "$1" > "$tmp/b"
  join "$tmp/a" "$tmp/b" | awk '{d = ($5 - $3) / 1000; t += d; if (d > m) { m = d; n = $2 }}
    END { if (m > 0) printf "%d %s=%d\n", t, n, m; else printf "%d none\n", t }'
}

echo "| plane | idle, no peer: µs of CPU in $seconds s (busiest thread) | after serving 20 fetches: µs in $seconds s (busiest thread) |"
echo "|---|---|---|"
for plane in shm tcp both nixl; do
  args=(--plane "$plane" --block-len 65536 --nixl-lib-dir "$KVPEER_NIXL_LIB_DIR")
  "$bin" serve "${args[@]}" --blocks 256 --fill 64 > "$tmp/serve.out" 2> "$tmp/serve.err" &
  pid=$!
  for _ in $(seq 300); do grep -q " ready " "$tmp/serve.out" && break; sleep 0.1; done
  id="$(grep -o 'id=[^ ]*' "$tmp/serve.out" | head -n1 | cut -d= -f2 || true)"
  if [ -z "$id" ]; then
    echo "bench-idle: the $plane node never got ready:" >&2
    cat "$tmp/serve.out" "$tmp/serve.err" >&2
    exit 1
  fi
  sleep 2
  read -r idle idle_thread < <(measure "$pid")
  "$bin" fetch "${args[@]}" --peer "$id" --blocks 64 --requests 20 --keys 64 \
    --miss-share 0 > /dev/null 2> "$tmp/fetch.err" || { cat "$tmp/fetch.err" >&2; exit 1; }
  sleep 2
  read -r after after_thread < <(measure "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  pid=""
  echo "| $plane | $idle ($idle_thread) | $after ($after_thread) |"
done
