"""pytest setup for the vLLM tier harness: vLLM's modules must be on PYTHONPATH (setup.sh prints
the directory), and NIXL's UCX backend is kept on loopback unless the environment says
otherwise (UCX reads these when the first NIXL agent is made, after this file runs)."""

import os

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib*")

try:
    import vllm.v1.kv_offload.tiering.manager  # noqa: F401
except ImportError as exc:  # pragma: no cover - a usage error, said plainly
    raise ImportError(
        "vLLM's modules are not on PYTHONPATH: "
        "P=$(KVPEER_PYTHON=target/kvpeer-venv/bin/python bash tests/vllm_tier/setup.sh) "
        "and run with PYTHONPATH=$P"
    ) from exc

from harness import Engine, make_engine  # noqa: E402


@pytest.fixture
def engines():
    """`engines(tier_config, num_chunks, block_len, **kw)` builds an engine (harness.make_engine)
    that is shut down when the test ends, whatever happens."""
    made: list[Engine] = []

    def build(*args, **kwargs) -> Engine:
        engine = make_engine(*args, **kwargs)
        made.append(engine)
        return engine

    yield build
    errors = []
    for engine in reversed(made):
        try:
            engine.shutdown()
        except Exception as exc:  # keep shutting the others down
            errors.append(exc)
    if errors:
        raise errors[0]
