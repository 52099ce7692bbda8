#!/usr/bin/env bash
# Makes the two real routers' venvs once, under ${KVPEER_CACHE:-~/.cache/kvpeer}/routers, from
# PyPI with every package pinned (pip keeps the wheels in its own cache under ~/.cache/pip):
#   vllm-router 0.1.17         (requirements-vllm-router.txt), the `vllm-router` binary;
#   ai-dynamo-runtime 1.6.1    (requirements-dynamo.txt), `python -m dynamo.indexer`.
# Prints two lines: the vllm-router binary, then the Python that runs Dynamo's indexer.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${KVPEER_CACHE:-$HOME/.cache/kvpeer}/routers"
mkdir -p "$cache"

make_venv() { # dir requirements check
  local dir="$1" req="$2" check="$3"
  if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$check" 2>/dev/null \
      && cmp -s "$req" "$dir/requirements.txt"; then
    return
  fi
  echo "routers: installing $(basename "$req") into $dir (once)" >&2
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$req" >&2
  cp "$req" "$dir/requirements.txt"
}

make_venv "$cache/vllm-router-0.1.17" "$here/requirements-vllm-router.txt" "import vllm_router"
make_venv "$cache/dynamo-1.6.1" "$here/requirements-dynamo.txt" "import dynamo.indexer"
echo "$cache/vllm-router-0.1.17/bin/vllm-router"
echo "$cache/dynamo-1.6.1/bin/python"
