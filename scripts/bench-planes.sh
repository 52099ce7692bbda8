#!/usr/bin/env bash
# The data-plane benchmark of issue 7: kvpeer's shm, tcp and nixl planes and vLLM 0.33's own
# NixlTransport, with UCX's default transports and UCX_TLS=tcp (tests/interop/bench_planes.py;
# results in docs/benchmarks.md). One command: scripts/bench-planes.sh [--requests N]
# Needs what scripts/test.sh needs (it makes the venv, with NIXL's wheel, if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVPEER_VENV:-target/kvpeer-venv}
if ! "$venv/bin/python" -c 'import msgspec, zmq, msgpack, nixl._api' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r tests/requirements-nixl.txt
fi
cargo build -q --release -p kvpeer --features nixl
pysrc="$(KVPEER_PYTHON="$venv/bin/python" bash tests/interop/setup.sh)"
KVPEER_NIXL_LIB_DIR="$(cd "$(dirname "$(ls "$venv"/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so)")" && pwd)"
export KVPEER_NIXL_LIB_DIR
PYTHONPATH="$pysrc" VLLM_LOGGING_LEVEL=WARNING "$venv/bin/python" tests/interop/bench_planes.py \
  --kvpeer target/release/kvpeer --json target/planes-bench.json "$@"
