#!/usr/bin/env bash
# The tcp data plane with and without TLS, beside this machine's single-core AES-128-GCM rate
# measured in the same run (docs/benchmarks.md, "TLS on the tcp plane").
#
#   scripts/bench-tls.sh [--runs N] [--kvpeer BIN] [--lookups-only]
#
# For 64 KiB and 2 MiB blocks, plaintext then TLS (`--tls required`, a CA and a loopback node
# certificate made here with openssl), each run N times (default 3) in turn: one `kvpeer serve
# --plane tcp --fill` and one `kvpeer fetch --plane tcp` pulling every filled block. Reported,
# medians: the consumer's fetch GB/s, the CPU per GB of each side (the consumer's from its own
# summary, the producer's from /proc/PID/stat), lookup p50/p99. Then `openssl speed -evp
# aes-128-gcm` (16 KiB records, one core) and the ratios the goals use: TLS GB/s over the lower of
# plaintext and the AES-GCM rate (goal >= 0.8), TLS lookups over plaintext (goal <= 1.1). Last,
# lookups alone (every key a miss: no block moves), plaintext against TLS on the control
# channel, N runs each in turn.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=3
bin=""
lookups_only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --kvpeer) bin="$2"; shift 2 ;;
    --lookups-only) lookups_only=1; shift ;;
    *) echo "bench-tls.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  cargo build --release -q -p kvpeer --bin kvpeer
  bin="${CARGO_TARGET_DIR:-target}/release/kvpeer"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/kvpeer-bench-tls.XXXXXX")"
serve_pid=""
cleanup() {
  if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# A CA and one certificate naming 127.0.0.1, for both nodes.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj "/CN=kvpeer bench CA" -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=kvpeer bench node" \
  -keyout "$work/node.key" -out "$work/node.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\n' > "$work/san.ext"
openssl x509 -req -in "$work/node.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" \
  -CAcreateserial -days 2 -extfile "$work/san.ext" -out "$work/node.pem" 2>/dev/null
tls_flags=(--tls required --tls-cert "$work/node.pem" --tls-key "$work/node.key" --tls-ca "$work/ca.pem")

ticks="$(getconf CLK_TCK)"
cpu_of() { awk -v t="$ticks" '{print ($14 + $15) / t}' "/proc/$1/stat"; }
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

# One run: prints "gb_per_s consumer_cpu_per_gb producer_cpu_per_gb lookup_p50 lookup_p99".
run_once() {
  local block_len="$1" blocks="$2" keys="$3" mode="$4"
  local extra=()
  if [ "$mode" = tls ]; then extra=("${tls_flags[@]}"); fi
  "$bin" serve --listen 127.0.0.1:0 --plane tcp --blocks "$blocks" --block-len "$block_len" \
    --fill "$blocks" --metrics 127.0.0.1:0 "${extra[@]}" > "$work/serve.out" 2> "$work/serve.err" &
  serve_pid=$!
  for _ in $(seq 200); do grep -q ready "$work/serve.out" 2>/dev/null && break; sleep 0.05; done
  local id; id="$(sed -n 's/.* id=\([^ ]*\).*/\1/p' "$work/serve.out")"
  [ -n "$id" ] || { cat "$work/serve.err" >&2; exit 1; }
  local before; before="$(cpu_of "$serve_pid")"
  local line
  line="$(KVPEER_LOG=error "$bin" fetch --peer "$id" --plane tcp --blocks "$blocks" --block-len "$block_len" \
    --requests $((blocks / keys)) --keys "$keys" --miss-share 0 --timeout-secs 60 "${extra[@]}")"
  local after; after="$(cpu_of "$serve_pid")"
  kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true; serve_pid=""
  [ "$(field "$line" corrupt_blocks)" = 0 ] || { echo "corrupt blocks: $line" >&2; exit 1; }
  local gb; gb="$(awk -v b="$(field "$line" bytes)" 'BEGIN {print b / 1e9}')"
  awk -v g="$(field "$line" fetch_gb_per_s)" -v c="$(field "$line" cpu_seconds)" -v p0="$before" \
    -v p1="$after" -v gb="$gb" -v l50="$(field "$line" lookup_p50_us)" -v l99="$(field "$line" lookup_p99_us)" \
    'BEGIN {printf "%s %.3f %.3f %s %s\n", g, c / gb, (p1 - p0) / gb, l50, l99}'
}

# Lookups alone (every key a miss, so no block moves): what TLS on the control channel costs a
# lookup once the session is up, with no data plane work beside it. Prints "p50 p99".
lookups_once() {
  local mode="$1" extra=()
  if [ "$mode" = tls ]; then extra=("${tls_flags[@]}"); fi
  "$bin" serve --listen 127.0.0.1:0 --plane tcp --blocks 1024 --block-len 16384 --fill 1024 \
    "${extra[@]}" > "$work/serve.out" 2> "$work/serve.err" &
  serve_pid=$!
  for _ in $(seq 200); do grep -q ready "$work/serve.out" 2>/dev/null && break; sleep 0.05; done
  local id; id="$(sed -n 's/.* id=\([^ ]*\).*/\1/p' "$work/serve.out")"
  [ -n "$id" ] || { cat "$work/serve.err" >&2; exit 1; }
  local line
  line="$(KVPEER_LOG=error "$bin" fetch --peer "$id" --plane tcp --blocks 1024 --block-len 16384 \
    --requests 4000 --keys 8 --miss-share 1 --timeout-secs 60 "${extra[@]}")"
  kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true; serve_pid=""
  echo "$(field "$line" lookup_p50_us) $(field "$line" lookup_p99_us)"
}

declare -A result
if [ -z "$lookups_only" ]; then
printf '%-8s %-6s %9s %14s %14s %10s %10s\n' block mode "GB/s" "cons. s/GB" "prod. s/GB" "lookup p50" "p99 us"
for spec in "65536 4096 8" "2097152 256 8"; do
  read -r block_len blocks keys <<<"$spec"
  for mode in plain tls; do : > "$work/$mode.runs"; done
  for _ in $(seq "$runs"); do
    for mode in plain tls; do run_once "$block_len" "$blocks" "$keys" "$mode" >> "$work/$mode.runs"; done
  done
  for mode in plain tls; do
    med() { awk -v c="$1" '{print $c}' "$work/$mode.runs" | median; }
    gbps="$(med 1)"; result["$block_len-$mode"]="$gbps"
    result["$block_len-$mode-p99"]="$(med 5)"
    printf '%-8s %-6s %9s %14s %14s %10s %10s\n' "$((block_len / 1024))K" "$mode" "$gbps" "$(med 2)" "$(med 3)" "$(med 4)" "$(med 5)"
  done
done

aes="$(openssl speed -evp aes-128-gcm -seconds 2 -bytes 16384 2>/dev/null | awk '/^AES-128-GCM|^aes-128-gcm/ {v=$NF} END {sub(/k$/, "", v); print v * 1000 / 1e9}')"
echo
echo "openssl speed -evp aes-128-gcm (16 KiB, one core): ${aes} GB/s"
for block_len in 65536 2097152; do
  plain="${result[$block_len-plain]}"; tls="${result[$block_len-tls]}"
  awk -v b="$((block_len / 1024))K" -v p="$plain" -v t="$tls" -v a="$aes" \
    -v l0="${result[$block_len-plain-p99]}" -v l1="${result[$block_len-tls-p99]}" 'BEGIN {
      lim = (p < a) ? p : a
      printf "%s: TLS %.2f GB/s = %.2fx plaintext, %.2fx of min(plaintext, AES-GCM) (goal >= 0.8); lookup p99 TLS/plain %.2fx (goal <= 1.1)\n", b, t, t / p, t / lim, l1 / l0
    }'
done
fi

echo
for mode in plain tls; do : > "$work/$mode.lookups"; done
for _ in $(seq "$runs"); do
  for mode in plain tls; do lookups_once "$mode" >> "$work/$mode.lookups"; done
done
for mode in plain tls; do
  result["lk-$mode-50"]="$(awk '{print $1}' "$work/$mode.lookups" | median)"
  result["lk-$mode-99"]="$(awk '{print $2}' "$work/$mode.lookups" | median)"
  echo "lookups alone (4000 x 8 keys, all misses), $mode: p50 ${result["lk-$mode-50"]} us, p99 ${result["lk-$mode-99"]} us"
done
awk -v a="${result[lk-plain-50]}" -v b="${result[lk-tls-50]}" -v c="${result[lk-plain-99]}" -v d="${result[lk-tls-99]}" \
  'BEGIN {printf "lookups alone: TLS/plain p50 %.2fx, p99 %.2fx (goal <= 1.1)\n", b / a, d / c}'
