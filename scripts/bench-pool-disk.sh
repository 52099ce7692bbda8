#!/usr/bin/env bash
# Issue 41's disk-tier benchmarks (results in docs/benchmarks.md, "The disk tier"), each beside
# its limit measured in the same run:
#   1. the device: fio on the same file system (direct I/O, 64 KiB and 2 MiB blocks, write and
#      read; with the tier's own queue depth, psync × THREADS jobs, and io_uring at depth 32);
#   2. the tier at the store (crates/kvpeer-store/benches/disk_tier.rs): write and read GB/s at
#      64 KiB and 2 MiB, and a restart's time to open the file and to its first hit;
#   3. restart of a `kvpeer serve` pool holding RESTART_GIB (8) GiB of 2 MiB blocks on disk,
#      after SIGTERM and after SIGKILL: seconds to the ready line and to the first fetch that
#      hits (`kvpeer fetch`, every byte checked), blocks found again, blocks lost (what a
#      following pool would pull again);
#   4. hit rate of one pool with an eighth of the memory plus a disk tier against an
#      all-memory pool of the full size (pool_shards' Zipf workload, --disk-tier).
# One command: scripts/bench-pool-disk.sh [DIR]   (DIR: a directory on the disk to measure;
# default target/bench-disk; it needs RESTART_GIB + 2 GiB free, and is removed at the end).
# Environment: GIB (2: per block size in 2.), THREADS (8), RESTART_GIB (8), REQUESTS (5000).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/bench-disk}"
gib="${GIB:-2}"
threads="${THREADS:-8}"
restart_gib="${RESTART_GIB:-8}"
requests="${REQUESTS:-5000}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
serve_pid=""
cleanup() {
    if [ -n "$serve_pid" ]; then kill -9 "$serve_pid" 2>/dev/null || true; fi
    rm -rf "$dir/fio" "$dir/tier" "$dir/restart" "$dir/shards"
}
trap cleanup EXIT

echo "== 1. the device: fio, direct I/O, on $(findmnt -no FSTYPE -T "$dir") at $dir"
if command -v fio >/dev/null; then
    mkdir -p "$dir/fio"
    for bs in 64k 2m; do
        for rw in write read; do
            # GIB in all: split between the psync jobs.
            for engine in "psync --numjobs=$threads --size=$((gib * 1024 / threads))m" \
                "io_uring --iodepth=32 --numjobs=1 --size=${gib}g"; do
                # shellcheck disable=SC2086 # the engine's options are words
                gbs=$(fio --name=t --directory="$dir/fio" --rw=$rw --bs=$bs \
                    --direct=1 --ioengine=$engine --group_reporting --output-format=json 2>/dev/null |
                    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print("%.2f" % ((j["read"]["bw_bytes"]+j["write"]["bw_bytes"])/1e9))')
                echo "fio $bs $rw ${engine%% *} (${engine#* }): $gbs GB/s"
            done
        done
    done
    rm -rf "$dir/fio"
else
    echo "fio is not installed (apt-get install fio): no device figures to compare with"
fi

echo
echo "== 2. the tier at the store"
cargo bench -q -p kvpeer-store --bench disk_tier -- --dir "$dir/tier" --gib "$gib" --threads "$threads"

echo
echo "== 3. restart of a serve pool holding $restart_gib GiB on disk"
cargo build -q --release -p kvpeer --bin kvpeer
bin="target/release/kvpeer"
[ -n "${CARGO_TARGET_DIR:-}" ] && bin="$CARGO_TARGET_DIR/release/kvpeer"
blocks=$((restart_gib * 512))
capacity=$(( (blocks + 16) * (2097152 + 4096) + 4096 ))
log="$dir/serve.log"
# Starts `serve` with extra args; sets serve_pid and id once the ready line is out.
serve() {
    rm -f "$log"
    KVPEER_LOG=info "$bin" serve --plane tcp --blocks 256 --block-len 2097152 --disk-path "$dir/restart" \
        --disk-capacity "$capacity" "$@" > "$log" 2> "$log.err" &
    serve_pid=$!
    for _ in $(seq 1 6000); do
        if grep -q "ready id=" "$log" 2>/dev/null; then
            id=$(sed -n 's/.*ready id=\([^ ]*\).*/\1/p' "$log")
            return 0
        fi
        sleep 0.01
    done
    echo "serve did not get ready" >&2
    cat "$log.err" >&2
    return 1
}
now() { date +%s.%N; }
since() { python3 -c "print('%.2f' % ($(now) - $1))"; }
first_hit() {
    "$bin" fetch --peer "$1" --plane tcp --blocks 64 --block-len 2097152 --requests 1 --keys 8 \
        --miss-share 0 --first "$2" --json 2>/dev/null |
        python3 -c 'import json,sys; j=json.load(sys.stdin); print("%s of 8 hit, %s corrupt" % (j["hits"], j["corrupt_blocks"]))'
}
t0=$(now)
serve --fill "$blocks"
echo "filled $blocks blocks of 2 MiB ($restart_gib GiB) in $(since "$t0") s (written through to disk)"
for sig in TERM KILL; do
    kill -"$sig" "$serve_pid"
    wait "$serve_pid" 2>/dev/null || true
    serve_pid=""
    t0=$(now)
    serve --fill 0
    ready=$(since "$t0")
    hits=$(first_hit "$id" $((blocks / 2)))
    hit=$(since "$t0")
    found=$(sed -n 's/.*disk tier open.* recovered=\([0-9]*\).*/\1/p' "$log.err" | head -1)
    echo "after SIG$sig: ready in $ready s, first fetch ($hits, every byte checked) done $hit s after the start; blocks found $found of $blocks, lost (to pull again) $((blocks - found))"
done
kill -TERM "$serve_pid"
wait "$serve_pid" 2>/dev/null || true
serve_pid=""
rm -rf "$dir/restart" "$log" "$log.err"

echo
echo "== 4. hit rate: an eighth of the memory plus disk against all memory"
cargo bench -q -p kvpeer --bench pool_shards -- --disk-tier "$dir/shards" --requests "$requests" 2>/dev/null
