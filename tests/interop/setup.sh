#!/usr/bin/env bash
# Prepares vLLM 0.33.0's P2P modules for the interop tests, without committing any of vLLM:
#   1. the released wheel is downloaded once into a cache outside the repo
#      (${KVPEER_CACHE:-$HOME/.cache/kvpeer}), and re-used when present;
#   2. only vllm/v1/kv_offload/tiering/p2p/{control,session}/, data/{base,nixl}.py,
#      vllm/distributed/nixl_utils.py and vllm/distributed/kv_events.py (the KV event
#      publisher) are extracted, unchanged, into target/interop/pysrc;
#   3. the few modules they import from the rest of vLLM come from tests/interop/stubs
#      (written for this project, upstream names and defaults).
# Prints the directory to put on PYTHONPATH. Needs the Python of scripts/test.sh's venv
# (KVPEER_PYTHON) or python3 with pip.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
py="${KVPEER_PYTHON:-python3}"
# The vLLM release whose modules are extracted (KVPEER_VLLM_VERSION; 0.33.0 by default, and
# 0.34.0 for the suites CI runs against both): each into its own directory.
version="${KVPEER_VLLM_VERSION:-0.33.0}"
cache="${KVPEER_CACHE:-$HOME/.cache/kvpeer}/vllm-$version"
out="$root/target/interop/pysrc"
if [ "$version" != "0.33.0" ]; then out="$out-$version"; fi

mkdir -p "$cache"
wheel="$(ls "$cache"/vllm-"$version"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
    echo "interop: downloading the vLLM $version wheel into $cache (once)" >&2
    "$py" -m pip download --quiet --no-deps --only-binary :all: "vllm==$version" -d "$cache" >&2
    wheel="$(ls "$cache"/vllm-"$version"-*.whl | head -n1)"
fi

rm -rf "$out"
mkdir -p "$out"
"$py" - "$wheel" "$out" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
base = "vllm/v1/kv_offload/tiering/p2p/"
wanted = lambda n: n.endswith(".py") and (
    n.startswith(base + "control/")
    or n.startswith(base + "session/")
    or n in (base + "data/base.py", base + "data/nixl.py", "vllm/distributed/nixl_utils.py",
             "vllm/distributed/kv_events.py")
)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if wanted(n)]
    if not any(n.endswith("session/session.py") for n in names):
        sys.exit(f"interop: {wheel} lacks the P2P session modules")
    z.extractall(out, names)
print(f"interop: extracted {len(names)} vLLM modules", file=sys.stderr)
PY
cp -r "$root/tests/interop/stubs/." "$out/"
echo "$out"
