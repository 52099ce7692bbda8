"""The fleet of real engines the tests share (engine start-up dominates: each starts once).

* ``S1``, ``S2``: vLLM's own p2p tier (NIXL).
* ``K1``: kvpeer's tier on the nixl plane (talks to S1, S2), short timeouts.
* ``K2``, ``K3``: kvpeer's tier on the tcp plane; K3 sends at most 1 MB/s per peer, so that a
  load from it lasts long enough to be cut by a kill.
* ``K4``: kvpeer's tier on tcp whose allowlist names K2 only.
* ``K5``: kvpeer's tier on tcp with another hash seed (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import Engine, free_port, kvpeer_tier, make_model, stock_tier  # noqa: E402


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-engine")
    model = make_model(root / "model")
    ports = {name: free_port() for name in ("S1", "S2", "K1", "K2", "K3", "K4", "K5")}
    fast = {"lookup_timeout_s": 5, "handshake_timeout_s": 5}
    engines = {
        "S1": Engine("S1", stock_tier(ports["S1"]), model, root),
        "S2": Engine("S2", stock_tier(ports["S2"]), model, root),
        "K1": Engine("K1", kvpeer_tier(ports["K1"], "nixl", **fast), model, root),
        "K2": Engine("K2", kvpeer_tier(ports["K2"], "tcp", **fast), model, root),
        "K3": Engine(
            "K3", kvpeer_tier(ports["K3"], "tcp", tcp_max_rate=1_000_000, **fast), model, root
        ),
        "K4": Engine(
            "K4",
            kvpeer_tier(ports["K4"], "tcp", allow=[f"127.0.0.1:{ports['K2']}"], **fast),
            model,
            root,
        ),
        "K5": Engine(
            "K5",
            kvpeer_tier(ports["K5"], "tcp", **fast),
            model,
            root,
            env={"PYTHONHASHSEED": "4242"},
        ),
    }
    try:
        # One at a time, each paused once ready: an idle engine steps without pause (see
        # Engine.pause), and six of them would starve the seventh's start.
        for engine in engines.values():
            engine.start()
            engine.wait_ready()
            engine.pause()
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


@pytest.fixture
def running(fleet):
    """`running(*names)`: those engines run, every other one is paused (see Engine.pause)."""

    def only(*names: str) -> dict[str, Engine]:
        for name, engine in fleet.items():
            if name not in names:
                engine.pause()
        for name in names:
            fleet[name].resume()
        return {name: fleet[name] for name in names}

    yield only
    for engine in fleet.values():
        engine.pause()


@pytest.fixture
def prompt(request):
    """A prompt no engine has seen: 2048 token ids (64 blocks), from the test's name."""
    rng = random.Random(request.node.name)
    return [rng.randrange(1, 500) for _ in range(2048)]
