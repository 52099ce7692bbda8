"""The real engines a test runs: ``running(*names)`` starts those named, fresh for the test,
and stops them after it (see engines.start_in_turn for why none outlives its test).

* ``S1``, ``S2``: vLLM's own p2p tier (NIXL).
* ``K1``: kvpeer's tier on the nixl plane (talks to S1, S2), short timeouts.
* ``K2``, ``K3``: kvpeer's tier on the tcp plane; K3 sends at most 1 MB/s per peer, so that a
  load from it lasts long enough to be cut by a kill.
* ``K4``: kvpeer's tier on tcp whose allowlist names K2 only.
* ``K5``: kvpeer's tier on tcp with another hash seed (``PYTHONHASHSEED``).
* ``K6``: kvpeer's tier on tcp whose ``sources`` are K2 and K7 (asked with no router's hint);
  ``K7``: kvpeer's tier on tcp.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import Engine, free_port, kvpeer_tier, make_model, start_in_turn  # noqa: E402
from engines import multiprocessing_objects, remove_unmapped_since, stock_tier  # noqa: E402

NAMES = ("S1", "S2", "K1", "K2", "K3", "K4", "K5", "K6", "K7")


def fleet_spec(ports: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Each engine's tier and environment, given every engine's control port."""
    fast = {"lookup_timeout_s": 5, "handshake_timeout_s": 5}
    return {
        "S1": {"tier": stock_tier(ports["S1"])},
        "S2": {"tier": stock_tier(ports["S2"])},
        "K1": {"tier": kvpeer_tier(ports["K1"], "nixl", **fast)},
        "K2": {"tier": kvpeer_tier(ports["K2"], "tcp", **fast)},
        "K3": {"tier": kvpeer_tier(ports["K3"], "tcp", tcp_max_rate=1_000_000, **fast)},
        "K4": {
            "tier": kvpeer_tier(ports["K4"], "tcp", allow=[f"127.0.0.1:{ports['K2']}"], **fast)
        },
        "K5": {"tier": kvpeer_tier(ports["K5"], "tcp", **fast), "env": {"PYTHONHASHSEED": "4242"}},
        "K6": {
            "tier": kvpeer_tier(
                ports["K6"],
                "tcp",
                sources=[f"127.0.0.1:{ports['K2']}", f"127.0.0.1:{ports['K7']}"],
                **fast,
            )
        },
        "K7": {"tier": kvpeer_tier(ports["K7"], "tcp", **fast)},
    }


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def running(model, tmp_path):
    """`running(*names)`: those engines, started for this test (logs in its tmp_path)."""
    started: list[Engine] = []
    before = multiprocessing_objects()

    def start(*names: str) -> dict[str, Engine]:
        spec = fleet_spec({name: free_port() for name in NAMES})
        engines = {
            name: Engine(name, spec[name]["tier"], model, tmp_path, env=spec[name].get("env", {}))
            for name in names
        }
        started.extend(engines.values())
        start_in_turn(list(engines.values()))
        return engines

    yield start
    for engine in started:
        engine.stop()
    remove_unmapped_since(before)


@pytest.fixture
def prompt(request):
    """A prompt no engine has seen: 2048 token ids (64 blocks), from the test's name."""
    rng = random.Random(request.node.name)
    return [rng.randrange(1, 500) for _ in range(2048)]
