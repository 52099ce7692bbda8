#!/usr/bin/env bash
# The side-by-side benchmark of issue 6: vLLM 0.33's own P2P code and kvpeer in the four
# pairings (tests/interop/bench.py; results in docs/benchmarks.md). One command:
#   scripts/bench-interop.sh [--requests-16k N] [--requests-2m N]
# Needs what scripts/test.sh needs (it makes the venv if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVPEER_VENV:-target/kvpeer-venv}
if ! "$venv/bin/python" -c 'import msgspec, zmq, msgpack' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
fi
cargo build -q --release -p kvpeer
pysrc="$(KVPEER_PYTHON="$venv/bin/python" bash tests/interop/setup.sh)"
PYTHONPATH="$pysrc" "$venv/bin/python" tests/interop/bench.py --kvpeer target/release/kvpeer \
  --json target/interop-bench.json "$@"
