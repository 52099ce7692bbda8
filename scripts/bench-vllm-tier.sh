#!/usr/bin/env bash
# The tier benchmark of issue 13: what vLLM pays on its scheduler thread for a P2P tier,
# kvpeer's KvpeerTier (nixl and tcp planes) against vLLM 0.33's stock p2p tier, inside vLLM's
# real TieringOffloadingManager (tests/vllm_tier/bench_tier.py; results in docs/benchmarks.md).
# One command: scripts/bench-vllm-tier.sh [bench_tier.py options, e.g. --clock cpu, --native]
#
# Builds the extension in release with NIXL and puts it, with a copy of python/kvpeer, first on
# PYTHONPATH (nothing is installed); fetches vLLM's modules with tests/vllm_tier/setup.sh; runs
# with the venv of scripts/test.sh (KVPEER_VENV; it needs numpy, msgspec, pyzmq, nixl, pytest).
# About a minute on 2 cores once built; the JSON goes to target/vllm-tier-bench.json.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVPEER_VENV:-target/kvpeer-venv}
py="$venv/bin/python"
if ! "$py" -c 'import numpy, msgspec, zmq, nixl._api' 2>/dev/null; then
  echo "bench-vllm-tier: $py lacks numpy/msgspec/pyzmq/nixl:" \
    "run scripts/test.sh, or set KVPEER_VENV" >&2
  exit 1
fi
cargo build -q --release -p kvpeer-py --features nixl
pkg="target/bench-vllm-tier/py"
rm -rf "$pkg"
mkdir -p "$pkg/kvpeer"
cp -r python/kvpeer/. "$pkg/kvpeer/"
cp target/release/lib_native.so "$pkg/kvpeer/_native.abi3.so"
pysrc="$(KVPEER_PYTHON="$py" bash tests/vllm_tier/setup.sh)"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_MODULES=${UCX_MODULES:-'^ib*'}
VLLM_LOGGING_LEVEL=WARNING PYTHONPATH="$PWD/$pkg:$pysrc" "$py" tests/vllm_tier/bench_tier.py \
  --json target/vllm-tier-bench.json "$@"
