#!/usr/bin/env bash
# Prepares vLLM 0.33.0's scheduler-side offloading code for the tier harness, without committing
# any of vLLM and without installing vllm or torch:
#   1. the released wheel is downloaded once into a cache outside the repo
#      (${KVPEER_CACHE:-$HOME/.cache/kvpeer}, shared with tests/interop/setup.sh), and re-used;
#   2. the modules listed below (TieringOffloadingManager, SecondaryTierFactory, the CPU primary
#      tier and its policies, the stock p2p tier with its ZMQ control and NIXL data transports,
#      vllm.envs, vllm.logger, ...) are extracted, unchanged, into target/vllm-tier/pysrc;
#   3. the modules they import from the rest of vLLM (torch, GPU, engine and config code) come
#      from tests/vllm_tier/stubs, written for this project (upstream names, see README.md).
# Prints the directory to put on PYTHONPATH (with the repo's python/ dir for kvpeer's own tier).
# Needs the Python of scripts/test.sh's venv (KVPEER_PYTHON) or python3 with pip; installs
# tests/vllm_tier/requirements.txt (pytest, typing_extensions) when that Python is a venv's.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
py="${KVPEER_PYTHON:-python3}"
# The vLLM release whose modules are extracted (KVPEER_VLLM_VERSION; 0.33.0 by default, and
# 0.34.0 for the suites CI runs against both): each into its own directory.
version="${KVPEER_VLLM_VERSION:-0.33.0}"
cache="${KVPEER_CACHE:-$HOME/.cache/kvpeer}/vllm-$version"
out="$root/target/vllm-tier/pysrc"
if [ "$version" != "0.33.0" ]; then out="$out-$version"; fi

mkdir -p "$cache"
wheel="$(ls "$cache"/vllm-"$version"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
    echo "vllm-tier: downloading the vLLM $version wheel into $cache (once)" >&2
    "$py" -m pip download --quiet --no-deps --only-binary :all: "vllm==$version" -d "$cache" >&2
    wheel="$(ls "$cache"/vllm-"$version"-*.whl | head -n1)"
fi

if ! "$py" -c 'import pytest, typing_extensions' 2>/dev/null; then
    if "$py" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
        echo "vllm-tier: installing tests/vllm_tier/requirements.txt into $py's venv" >&2
        "$py" -m pip install --quiet --disable-pip-version-check \
            -r "$root/tests/vllm_tier/requirements.txt" >&2
    else
        echo "vllm-tier: $py lacks pytest/typing_extensions;" \
            "pip install -r tests/vllm_tier/requirements.txt" >&2
        exit 1
    fi
fi

rm -rf "$out"
mkdir -p "$out"
"$py" - "$wheel" "$out" <<'PY'
import sys, zipfile

wheel, out = sys.argv[1], sys.argv[2]
# Whole packages (every .py file below them).
trees = (
    "vllm/v1/kv_offload/tiering/p2p/",  # the stock tier: manager, control/, data/, session/
    "vllm/v1/kv_offload/cpu/policies/",  # the CPU primary tier's cache policies (lru, arc)
    "vllm/v1/kv_hints/",  # KvHintsEnvelope (ReqContext field; msgspec)
    "vllm/logging_utils/",  # vllm.logger's formatters
)
# Single modules.
files = (
    "vllm/envs.py",
    "vllm/logger.py",
    "vllm/utils/math_utils.py",
    "vllm/distributed/nixl_utils.py",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/__init__.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
    "vllm/v1/__init__.py",
    "vllm/v1/core/__init__.py",
    "vllm/v1/metrics/__init__.py",
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/v1/kv_offload/__init__.py",
    "vllm/v1/kv_offload/base.py",
    "vllm/v1/kv_offload/config.py",
    "vllm/v1/kv_offload/factory.py",
    "vllm/v1/kv_offload/file_mapper.py",
    "vllm/v1/kv_offload/cpu/__init__.py",
    "vllm/v1/kv_offload/cpu/common.py",
    "vllm/v1/kv_offload/cpu/manager.py",
    "vllm/v1/kv_offload/tiering/__init__.py",
    "vllm/v1/kv_offload/tiering/backpressure.py",
    "vllm/v1/kv_offload/tiering/base.py",
    "vllm/v1/kv_offload/tiering/factory.py",
    "vllm/v1/kv_offload/tiering/manager.py",
    "vllm/v1/kv_offload/tiering/metrics.py",
)
wanted = lambda n: n.endswith(".py") and (n in files or n.startswith(trees))
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if wanted(n)]
    missing = [f for f in files if f not in names]
    if missing or not any(n.endswith("p2p/manager.py") for n in names):
        sys.exit(f"vllm-tier: {wheel} lacks {missing or 'the p2p tier'}")
    z.extractall(out, names)
print(f"vllm-tier: extracted {len(names)} vLLM modules", file=sys.stderr)
PY
# The stubs only add modules: none of them replaces an extracted file.
for f in $(cd "$root/tests/vllm_tier/stubs" && find . -type f -name '*.py'); do
    if [ -e "$out/$f" ]; then
        echo "vllm-tier: stub $f would replace vLLM's own module" >&2
        exit 1
    fi
done
cp -r "$root/tests/vllm_tier/stubs/." "$out/"
find "$out" -name '__pycache__' -prune -exec rm -rf {} +
echo "$out"
