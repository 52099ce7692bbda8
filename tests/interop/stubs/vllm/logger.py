"""`init_logger` as vLLM's modules use it (kvpeer interop tests): a standard logger on stderr at
the level `VLLM_LOGGING_LEVEL` names (vLLM's variable; default INFO as in vLLM), with vLLM's
`info_once` / `warning_once` (each message logged once)."""

import logging
import os

logging.basicConfig(
    level=os.getenv("VLLM_LOGGING_LEVEL", "INFO").upper(),
    format="%(levelname)s %(asctime)s %(name)s: %(message)s",
)

_seen = set()


class _Logger(logging.LoggerAdapter):
    def _once(self, level, msg, *args):
        if (level, msg, args) not in _seen:
            _seen.add((level, msg, args))
            self.log(level, msg, *args)

    def info_once(self, msg, *args, **_):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **_):
        self._once(logging.WARNING, msg, *args)

    def debug_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
