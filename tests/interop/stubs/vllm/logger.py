"""`init_logger` as the P2P modules use it (kvpeer interop tests): a standard logger on stderr,
at the level `VLLM_LOGGING_LEVEL` names (vLLM's variable; default INFO as in vLLM)."""

import logging
import os

logging.basicConfig(
    level=os.getenv("VLLM_LOGGING_LEVEL", "INFO").upper(),
    format="%(levelname)s %(asctime)s %(name)s: %(message)s",
)


def init_logger(name):
    return logging.getLogger(name)
