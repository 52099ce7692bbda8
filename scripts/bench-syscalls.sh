#!/usr/bin/env bash
# System calls and context switches per request, kvpeer↔kvpeer and vLLM↔vLLM, one run
# (tests/interop/bench_syscalls.py; results in docs/benchmarks.md). Needs perf and strace
# (Debian: linux-perf, strace) and what scripts/test.sh needs.
#   scripts/bench-syscalls.sh [--requests 1000] [--block-len 16384] [--kinds kvpeer,vllm]
#                             [--kvpeer PATH] [--node-consumer]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVPEER_VENV:-target/kvpeer-venv}
if ! "$venv/bin/python" -c 'import msgspec, zmq, msgpack' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
fi
for tool in perf strace; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (Debian: linux-perf, strace)"; exit 1; }
done
if ! printf '%s\n' "$@" | grep -q -- '^--kvpeer$'; then
  cargo build -q --release -p kvpeer
fi
pysrc="$(KVPEER_PYTHON="$venv/bin/python" bash tests/interop/setup.sh)"
PYTHONPATH="$pysrc" "$venv/bin/python" tests/interop/bench_syscalls.py "$@"
