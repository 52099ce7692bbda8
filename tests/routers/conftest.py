"""Fixtures of the router tests (tests/routers): where the binaries are, and a fleet that is
always taken down. Run by scripts/test.sh with the variables below set; nothing is skipped:
a missing router is an error that names the variable."""

from __future__ import annotations

import os

import pytest

from fleet import Procs


def required(variable: str) -> str:
    value = os.environ.get(variable)
    if not value:
        raise RuntimeError(f"{variable} is not set (scripts/test.sh sets it from tests/routers/setup.sh)")
    return value


@pytest.fixture
def procs(tmp_path):
    procs = Procs(str(tmp_path))
    yield procs
    procs.stop()


@pytest.fixture
def vllm_router() -> str:
    return required("KVPEER_VLLM_ROUTER")


@pytest.fixture
def dynamo_python() -> str:
    return required("KVPEER_DYNAMO_PYTHON")


@pytest.fixture(autouse=True)
def kvpeer_bin() -> str:
    return required("KVPEER_BIN")
