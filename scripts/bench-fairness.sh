#!/usr/bin/env bash
# Fairness (issue 19; results in docs/benchmarks.md): an honest peer's lookup p50/p99 and fetch
# rate against one release `kvpeer serve` while one peer of the same host floods it at full
# speed, against the same honest load with no attacker, in one run; and how much the node's
# memory grew while each attacker ran (peak VmRSS during the attack minus VmRSS before it).
#
#   scripts/bench-fairness.sh [--requests N] [--kvpeer BIN] [--config FILE] [--only NAME] [--pin]
#
# --pin runs the node and the honest consumer on CPU 0 and the attacker on CPU 1 (taskset), so
# the figures show what the node's own bounds leave of the attacker's cost, not the attacker's
# process taking a core from the node on a small machine.
#
# The attackers are tests/hostile/attacker.py's (pyzmq + msgpack from tests/requirements.txt,
# in the venv of scripts/test.sh, KVPEER_VENV): sessions (200 sessions of one host, each
# re-opened when ended), hoard (lookups of half the pool, never fetched, over and over: pins and
# held state), huge (lookups of 1,048,576 keys, one after another), flood (junk payloads,
# messages without a session, spoofed identities), spread (issue 37: 8,192-key lookups of keys
# the node lacks, back to back, from 120 hosts with a session each; from one host's 16
# sessions; from one host's 64 connections, its 32 sessions admitted). Goals: honest p99 <= 5x
# unloaded, node RSS growth caused by one peer <= 64 MiB; and the node idle once the attacker
# left (the last column: the node's CPU in the second after).
set -euo pipefail
cd "$(dirname "$0")/.."
requests=2000
bin=target/release/kvpeer
config=()
only=""
node_cpu=()
attacker_cpu=()
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --kvpeer) bin=$2; shift 2 ;;
    --config) config=(--config "$2"); shift 2 ;;
    --only) only=$2; shift 2 ;;
    --pin) node_cpu=(taskset -c 0); attacker_cpu=(taskset -c 1); shift ;;
    *) echo "usage: $0 [--requests N] [--kvpeer BIN] [--config FILE] [--only NAME]" >&2; exit 2 ;;
  esac
done
venv=${KVPEER_VENV:-target/kvpeer-venv}
if ! "$venv/bin/python" -c 'import msgspec, zmq, msgpack' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
fi
py="$venv/bin/python"
if [ "$bin" = target/release/kvpeer ]; then
  cargo build -q --release -p kvpeer
fi
tmp="$(mktemp -d)"
node=""
attack_pid=""
sampler=""
cleanup() {
  stop_attack
  for p in $sampler $node; do kill "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

blocks=4096
len=16384
"${node_cpu[@]}" "$bin" serve --plane both --blocks "$blocks" --block-len "$len" --fill 2048 --max-peers 160 "${config[@]}" \
  > "$tmp/serve.out" 2> "$tmp/serve.err" &
node=$!
for _ in $(seq 600); do grep -q " ready " "$tmp/serve.out" && break; sleep 0.1; done
id="$(grep -o 'id=[^ ]*' "$tmp/serve.out" | head -n1 | cut -d= -f2 || true)"
if [ -z "$id" ]; then
  echo "bench-fairness: the node never got ready:" >&2
  cat "$tmp/serve.out" "$tmp/serve.err" >&2
  exit 1
fi

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$node/status"; }
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$node/stat"; }

# One honest run: its JSON summary in $tmp/honest.json (every byte checked by the child).
honest() {
  if ! "${node_cpu[@]}" "$bin" fetch --peer "$id" --plane shm --blocks 512 --block-len "$len" \
      --requests "$requests" --keys 8 --miss-share 0 --prefixes 64 --warmup 50 --json \
      --timeout-secs 60 > "$tmp/honest.json" 2> "$tmp/honest.err"; then
    echo "bench-fairness: the honest fetch failed:" >&2
    cat "$tmp/honest.json" "$tmp/honest.err" >&2
    exit 1
  fi
}

field() { "$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$@"; }

# An attacker, run again whenever it ends, until killed.
start_attack() {
  ( trap exit TERM; while true; do "${attacker_cpu[@]}" "$py" tests/hostile/attacker.py "$@" > /dev/null 2>&1 || true; done ) &
  attack_pid=$!
}

stop_attack() {
  if [ -n "$attack_pid" ]; then
    # The loop first (its trap runs once its attacker ends), then its attacker: the other way
    # round, the loop could start a new attacker between the two and wait for it to end.
    kill "$attack_pid" 2>/dev/null || true
    pkill -P "$attack_pid" 2>/dev/null || true
    wait "$attack_pid" 2>/dev/null || true
    attack_pid=""
  fi
}

# Peak VmRSS of the node while it runs, into $tmp/peak.
start_sampler() {
  ( peak=0; while true; do r="$(rss_kib)"; [ "$r" -gt "$peak" ] && peak=$r && echo "$peak" > "$tmp/peak"; sleep 0.05; done ) &
  sampler=$!
}

stop_sampler() { kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true; sampler=""; }

honest
base_p50="$(field "$tmp/honest.json" lookup_p50_us)"
base_p99="$(field "$tmp/honest.json" lookup_p99_us)"
base_rate="$("$py" -c "print(round($requests / $(field "$tmp/honest.json" seconds)))")"

echo "kvpeer fairness: one honest consumer ($requests requests of 8 x 16 KiB blocks, every byte checked) against one node (shm+tcp planes, the honest peer on shm, $blocks blocks, 160 session slots), with one attacker of the same host at full speed"
echo
echo "| attacker | honest lookup p50 µs | honest lookup p99 µs | p99 / unloaded | honest requests/s | node RSS growth MiB | node CPU ms in the second after it left |"
echo "|---|---|---|---|---|---|---|"
echo "| none | $base_p50 | $base_p99 | 1.00 | $base_rate | 0 | |"

run() {
  local name=$1
  shift
  if [ -n "$only" ] && [ "${name%%:*}" != "$only" ]; then
    return
  fi
  local before
  before="$(rss_kib)"
  echo "$before" > "$tmp/peak"
  start_sampler
  start_attack "$@"
  sleep 3
  honest
  stop_attack
  stop_sampler
  # What the node still works after the attacker left (a departed peer's backlog is dropped,
  # not worked off).
  local t0 t1 after_ms
  t0="$(cpu_ticks)"
  sleep 1
  t1="$(cpu_ticks)"
  after_ms=$(( (t1 - t0) * 1000 / $(getconf CLK_TCK) ))
  local p50 p99 secs peak
  p50="$(field "$tmp/honest.json" lookup_p50_us)"
  p99="$(field "$tmp/honest.json" lookup_p99_us)"
  secs="$(field "$tmp/honest.json" seconds)"
  peak="$(cat "$tmp/peak")"
  "$py" -c "print('| $name | $p50 | $p99 | %.2f | %d | %.1f | $after_ms |' % ($p99 / max($base_p99, 1), $requests / $secs, max(0, $peak - $before) / 1024))"
  sleep 2 # let the node end the attacker's sessions before the next one
}

run "sessions: 200 identities of one host" sessions --node "$id" --count 200 --duration 60 --block-len "$len"
run "hoard: lookups of 2,048 keys, never fetched" hoard --node "$id" --keys 0-2047 --rounds 1000 --block-len "$len" --num-blocks "$blocks" --wait 2
run "huge: lookups of 1,048,576 keys" hoard --node "$id" --keys 0-0 --huge 1048576 --huge-distinct 4096 --block-len "$len" --num-blocks "$blocks" --wait 30
run "flood: junk, strangers, spoofed identities" flood --node "$id" --count 1000000 --spoofed 1000
run "spread: 120 hosts, a session each, 8,192-key lookups back to back" spread --node "$id" --hosts 120 --keys 8192 --duration 600 --block-len "$len" --num-blocks "$blocks"
run "sessions16: one host, 16 sessions, 8,192-key lookups back to back" spread --node "$id" --hosts 1 --sessions 16 --keys 8192 --duration 600 --block-len "$len" --num-blocks "$blocks"
run "conns64: one host, 64 connections (its 32 sessions admitted), 8,192-key lookups" spread --node "$id" --hosts 1 --sessions 64 --keys 8192 --duration 600 --block-len "$len" --num-blocks "$blocks"
