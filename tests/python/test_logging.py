"""The node's logs reach Python's ``logging`` (python/kvpeer/_logs.py): warnings by default, as
the logger ``kvpeer.<module>``; the ``kvpeer`` logger's level decides what is made. And a refused
peer is told why: ``PeerUnavailable`` carries the refusing node's words with both values."""

import logging
import subprocess
import sys
import textwrap
import time

import pytest

import kvpeer

# A consumer refused for its block size: the producer logs a WARNING naming both values, the
# consumer's PeerUnavailable says what the producer told it.
REFUSED = textwrap.dedent(
    """
    import kvpeer
    producer = kvpeer.Node({"num_blocks": "8", "block_len": "4096", "plane": "tcp"}, tag="logs")
    consumer = kvpeer.Node({"num_blocks": "8", "block_len": "8192", "plane": "tcp"}, tag="logs")
    try:
        consumer.lookup(producer.id, [bytes(36)], timeout_s=5.0)
        raise SystemExit("the mismatched consumer was served")
    except kvpeer.PeerUnavailable as refused:
        print("CONSUMER:", refused)
    finally:
        consumer.shutdown(0.5)
        producer.shutdown(0.5)
    """
)


def run_python(prelude: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", prelude + REFUSED],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )


def test_warnings_reach_stderr_with_no_logging_configured():
    run = run_python("")
    assert run.returncode == 0, run.stderr
    # Python's last-resort handler prints WARNING and above, the message alone.
    assert "rejecting peer connect" in run.stderr, run.stderr
    assert "block_len mismatch: remote=8192, local=4096" in run.stderr, run.stderr
    # The refused side hears why, in the refusing node's words, both values.
    consumer = [line for line in run.stdout.splitlines() if line.startswith("CONSUMER:")]
    assert consumer and 'block_len differs: yours 8192, mine 4096' in consumer[0], run.stdout


def test_the_kvpeer_loggers_level_decides_what_is_shown():
    quiet = run_python("import logging; logging.getLogger('kvpeer').setLevel(logging.ERROR)\n")
    assert quiet.returncode == 0, quiet.stderr
    assert "rejecting peer connect" not in quiet.stderr, quiet.stderr
    loud = run_python(
        "import logging; logging.basicConfig(format='%(levelname)s %(name)s %(message)s')\n"
        "logging.getLogger('kvpeer').setLevel(logging.DEBUG)\n"
    )
    assert loud.returncode == 0, loud.stderr
    lines = loud.stderr.splitlines()
    assert any(line.startswith("WARNING kvpeer.core.") and "rejecting peer connect" in line for line in lines), loud.stderr
    assert any(line.startswith(("DEBUG kvpeer.", "INFO kvpeer.")) for line in lines), loud.stderr


def test_kvpeer_log_sends_the_logs_to_stderr_as_the_binary_does():
    run = subprocess.run(
        [sys.executable, "-c", REFUSED],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVPEER_LOG": "warn"},
    )
    assert run.returncode == 0, run.stderr
    # tracing's own format: the level and the module path on the line.
    assert any(" WARN " in line and "kvpeer_core" in line and "rejecting peer connect" in line
               for line in run.stderr.splitlines()), run.stderr
    # And no thread of kvpeer's waits for records that never come (nor spins for them).
    idle = subprocess.run(
        [sys.executable, "-c",
         "import threading, time, kvpeer; time.sleep(0.5); "
         "print(sorted(t.name for t in threading.enumerate()))"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVPEER_LOG": "warn"},
    )
    assert idle.returncode == 0, idle.stderr
    assert "kvpeer-logs" not in idle.stdout, idle.stdout


def test_records_arrive_as_kvpeer_loggers_in_this_process():
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = Keep()
    logging.getLogger("kvpeer").addHandler(handler)
    try:
        producer = kvpeer.Node({"num_blocks": "8", "block_len": "4096", "plane": "tcp"}, tag="logs")
        consumer = kvpeer.Node({"num_blocks": "8", "block_len": "4096", "plane": "tcp", "hash_seed": "5"}, tag="logs")
        try:
            with pytest.raises(kvpeer.PeerUnavailable, match="hash seed differs"):
                consumer.lookup(producer.id, [bytes(36)], timeout_s=5.0)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any("hash seed mismatch" in r.getMessage() for r in seen):
                time.sleep(0.05)
        finally:
            consumer.shutdown(0.5)
            producer.shutdown(0.5)
    finally:
        logging.getLogger("kvpeer").removeHandler(handler)
    refusal = [r for r in seen if "hash seed mismatch" in r.getMessage()]
    assert refusal, [r.getMessage() for r in seen]
    assert refusal[0].levelno == logging.WARNING
    assert refusal[0].name.startswith("kvpeer.core."), refusal[0].name
    # The thread that carries them is the one kvpeer started.
    assert refusal[0].threadName == "kvpeer-logs"
