"""The node's logs through Python's ``logging``.

``import kvpeer`` starts one daemon thread, ``kvpeer-logs``, that takes the Rust node's log
records (``kvpeer._native.take_logs``, which waits with the GIL released) and logs each as the
logger ``kvpeer.<module>`` (``kvpeer.net.control.outbound``, ``kvpeer.core.session``, ...).
What is made follows the effective level of the ``kvpeer`` logger, read on every take (about
once a second): WARNING and above by default, which Python prints to stderr when nothing else
is configured. ``logging.getLogger("kvpeer").setLevel(logging.INFO)`` shows more; a handler
on ``kvpeer`` sends them elsewhere. With ``KVPEER_LOG`` set, the node logs straight to stderr
instead, filtered by it (as the ``kvpeer`` binary does), and this thread has nothing to do.
At exit, what is still queued is logged.
"""

import atexit
import logging
import os
import threading
import time

from kvpeer import _native

_ROOT = logging.getLogger("kvpeer")
_started = False
_lock = threading.Lock()


def _emit(records) -> None:
    for level, name, message in records:
        logging.getLogger(name).log(level, "%s", message)


def _pump() -> None:
    while True:
        try:
            _emit(_native.take_logs(_ROOT.getEffectiveLevel(), 1.0))
        except Exception:  # a handler or filter of the application's failed: keep going
            time.sleep(1.0)


def _flush_at_exit() -> None:
    if not _native.logs_to_python():
        return
    while True:
        records = _native.take_logs(_ROOT.getEffectiveLevel(), 0.0)
        if not records:
            return
        _emit(records)


def start() -> None:
    """Starts the thread once per process (and again in a forked child, where it is gone)."""
    global _started
    if not _native.logs_to_python():
        return  # KVPEER_LOG: the node writes to stderr itself
    with _lock:
        if _started:
            return
        _started = True
    threading.Thread(target=_pump, name="kvpeer-logs", daemon=True).start()


def _after_fork() -> None:
    global _started, _lock
    _lock = threading.Lock()
    _started = False
    start()


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_after_fork)
