"""Real vLLM engines in their own processes, for the tests: start, ask, read counters, kill.

Each engine is ``engine_server.py`` (vLLM's offline ``LLM`` on the CPU platform with
``kvpeer.vllm.cpu``'s offloading spec and one secondary tier) in a new session (process group)
of its own, so that killing it ends its engine-core and worker processes too. Commands go to its
stdin; answers come back on a pipe, each waited for with a deadline; vLLM's logs go to a file
that a failing test prints.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVER = HERE / "engine_server.py"
# Tokens per engine block (vLLM's CPU attention needs a multiple of 32), and per prompt.
BLOCK_SIZE = 32
# How long an engine may take to start (several start at once on 2 cores) and to answer.
START_TIMEOUT_S = 600.0
# The priority of an engine that waits while others start or compute (see start_in_turn).
IDLE_NICE = 19
ANSWER_TIMEOUT_S = 300.0


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range.

    Ports are chosen long before the engine binds them (all engines of a fleet start one after
    another, minutes apart). A port from the ephemeral range could meanwhile be taken by any
    socket bound to port 0 or any outgoing connection of an engine started earlier (a CI run
    lost K4 that way: "Address already in use"); nothing takes a port below that range unasked.
    """
    low, _ = _ephemeral_range()
    first = max(1024, low - 12000)
    for _ in range(1000):
        port = random.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {first}..{low}")


def stock_tier(port: int, **extra: Any) -> dict[str, Any]:
    """vLLM's own p2p tier (NIXL data plane)."""
    return {"type": "p2p", "host": "127.0.0.1", "port": port, **extra}


def kvpeer_tier(port: int, plane: str, **extra: Any) -> dict[str, Any]:
    """kvpeer's tier on `plane`."""
    return {
        "type": "KvpeerTier",
        "module_path": "kvpeer.vllm",
        "host": "127.0.0.1",
        "port": port,
        "plane": plane,
        **extra,
    }


def _mapped_multiprocessing_objects(wanted) -> set[str]:
    """The multiprocessing objects (``psm_*``, ``sem.mp-*``) in /dev/shm that the processes
    whose pid passes ``wanted`` map."""
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if not wanted(int(entry)):
                continue
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    path = line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)")
                    if path.startswith("/dev/shm/") and os.path.basename(path).startswith(
                        ("psm_", "sem.mp-")
                    ):
                        found.add(path)
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile, or not ours to read
    return found


def _shm_objects_of_group(pgid: int) -> set[str]:
    """The vLLM multiprocessing objects in /dev/shm that processes of group `pgid` map."""
    return _mapped_multiprocessing_objects(lambda pid: os.getpgid(pid) == pgid)


def multiprocessing_objects() -> set[str]:
    """The multiprocessing objects (``psm_*``, ``sem.mp-*``) in /dev/shm now."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return set()
    return {
        f"/dev/shm/{name}" for name in names if name.startswith(("psm_", "sem.mp-"))
    }


def remove_unmapped_since(before: set[str]) -> None:
    """Removes the multiprocessing objects that appeared since ``before`` and that no live
    process maps: what engines' processes left behind (a semaphore whose creator's resource
    tracker was killed with its group before it unlinked it)."""
    new = multiprocessing_objects() - before
    if not new:
        return
    for path in new - _mapped_multiprocessing_objects(lambda pid: True):
        Path(path).unlink(missing_ok=True)


@dataclass
class Engine:
    """One engine process; `tier_label` is how vLLM labels its secondary tier's counters."""

    name: str
    tier: dict[str, Any]
    model: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    # engine_server.py settings (max_model_len, kv_cache_memory_bytes, ...), and the bytes of
    # vLLM's offload region that the tiers share.
    options: dict[str, Any] = field(default_factory=dict)
    offload_bytes: int = 256 << 20
    engine_id: str = ""
    process: subprocess.Popen | None = None
    _results: Any = None
    _buffer: str = ""

    @property
    def port(self) -> int:
        return int(self.tier["port"])

    @property
    def tier_label(self) -> str:
        return f"1:{self.tier['type']}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> None:
        self.engine_id = f"kvpeer-real-{os.getpid()}-{self.name}"
        read_end, write_end = os.pipe()
        config = {
            "model": self.model,
            "engine_id": self.engine_id,
            "result_fd": write_end,
            "block_size": BLOCK_SIZE,
            "extra_config": {
                "spec_name": "CPUTieringOffloadingSpec",
                "spec_module_path": "kvpeer.vllm.cpu",
                "cpu_bytes_to_use": self.offload_bytes,
                "secondary_tiers": [self.tier],
            },
            **self.options,
        }
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            UCX_NET_DEVICES="lo",
            UCX_MODULES="^ib*",
            PYTHONUNBUFFERED="1",
            # Several engines share 2 cores, and an idle 0.32 engine with a p2p tier steps
            # without pause (has_pending_work): one OpenMP thread each, sleeping when idle,
            # bound to no core.
            OMP_NUM_THREADS="1",
            OMP_WAIT_POLICY="PASSIVE",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
        )
        env.update(self.env)
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=[write_end],
            env=env,
            text=True,
            # Its own process group (killed as one), but not its own session: with the
            # kernel's autogroup scheduling (sched_autogroup_enabled, on here) every session
            # is a group with a fair share of its own, so a niced engine in a session of its
            # own still took half the CPU from the engine a test was waiting on.
            process_group=0,
        )
        log.close()
        os.close(write_end)
        self._results = read_end

    def wait_ready(self) -> float:
        """Seconds the engine took to start."""
        return float(self._read(START_TIMEOUT_S)["seconds"])

    def ask(self, command: dict[str, Any], timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        self.send(command)
        return self.receive(timeout)

    def send(self, command: dict[str, Any]) -> None:
        """Sends a command without waiting for its answer (`receive` reads it)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        """The answer to the oldest command not answered yet."""
        answer = self._read(timeout)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}\n{answer.get('traceback', '')}")
        return answer

    def generate(
        self, prompt: list[int], source: Engine | None = None, max_tokens: int = 8
    ) -> dict[str, Any]:
        """Greedy tokens for `prompt`, loading what it can from `source` (a peer engine)."""
        return self.ask(self.generate_command(prompt, source, max_tokens))

    def generate_command(
        self, prompt: list[int], source: Engine | None = None, max_tokens: int = 8
    ) -> dict[str, Any]:
        command: dict[str, Any] = {"cmd": "generate", "prompt": prompt, "max_tokens": max_tokens}
        if source is not None:
            command["kv_transfer_params"] = {
                "remote_kv_source": {
                    "kv_request_id": f"{self.name}-{time.monotonic_ns()}",
                    "remote_host": "127.0.0.1",
                    "remote_port": source.port,
                }
            }
        return command

    def metrics(self) -> dict[str, float]:
        return self.ask({"cmd": "metrics"})["metrics"]

    def counter(self, metrics: dict[str, float], name: str, tier: bool = False) -> float:
        """The value of counter `name` (this engine's secondary tier's series when `tier`)."""
        total = 0.0
        for key, value in metrics.items():
            if key.split("{", 1)[0] != name:
                continue
            if tier and f"tier={self.tier_label}" not in key:
                continue
            total += float(value or 0)
        return total

    @contextmanager
    def idle(self):
        """This engine at the lowest priority meanwhile (nice 19, every thread of its process
        group), while another one computes: not frozen, so it keeps answering heartbeats
        and its engine core's deadlines hold."""
        self._set_nice(IDLE_NICE)
        try:
            yield self
        finally:
            self._set_nice(0)

    def _set_nice(self, nice: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.setpriority(os.PRIO_PGRP, self.process.pid, nice)
        except PermissionError:
            # Raising a priority back needs CAP_SYS_NICE: without it an engine stays low,
            # as do the others (the engine of a test still gets its share).
            pass

    def kill(self) -> None:
        """SIGKILL to the engine's whole process group (its engine core and worker too), then
        removes the shared-memory objects the group had mapped: vLLM's multiprocessing buffers
        (`psm_*`) and semaphores (`sem.mp-*`) are unlinked only by a clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            left = _shm_objects_of_group(self.process.pid)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
            # Its engine core and worker are its children: reaped by init, gone with the group.
            for path in left:
                Path(path).unlink(missing_ok=True)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.ask({"cmd": "quit"}, timeout=60)
                self.process.wait(60)
            except Exception:
                pass
        self.kill()
        # An engine killed without its shutdown leaves its offload region behind, and with
        # kvpeer's shm plane the region's fence words beside it (`<region>.fence`).
        region = f"/dev/shm/vllm_offload_{self.engine_id}.mmap"
        for path in (region, f"{region}.fence"):
            Path(path).unlink(missing_ok=True)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer within {timeout} s\n{self.log_tail()}")
            ready, _, _ = select.select([self._results], [], [], min(left, 1.0))
            if not ready:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited ({self.process.returncode})\n{self.log_tail()}"
                    )
                continue
            chunk = os.read(self._results, 1 << 20)
            if not chunk:
                raise RuntimeError(f"{self.name} closed its answers\n{self.log_tail()}")
            self._buffer += chunk.decode()
        line, self._buffer = self._buffer.split("\n", 1)
        return json.loads(line)


def start_in_turn(engines: list[Engine]) -> None:
    """Starts `engines` one after another, each ready one at the lowest priority while the
    next starts, all back at normal priority once all are ready.

    An idle 0.32 engine steps without pause (vLLM's own tier keeps about 2.5 cores busy while
    idle: its NIXL progress thread and engine loop), so started engines would starve the next
    one's start on 2 cores. Engines live for one test only: frozen engines (SIGSTOP), tried
    to keep one fleet for the whole session, sometimes never recovered (an engine core whose
    worker stopped reading its queue, then garbage blocks served to a peer) or lost their
    engine core to vLLM's RPC timeout; the lowest priority alone, for six idle engines, made
    the seventh take 12 minutes to start instead of 20 s.
    """
    try:
        for engine in engines:
            engine.start()
            engine.wait_ready()
            engine._set_nice(IDLE_NICE)
    finally:
        for engine in engines:
            engine._set_nice(0)


def make_model(directory: Path, **shape: Any) -> str:
    """A Llama with random weights (no hub), float32; by default tiny: 2 layers, head size 64
    (the CPU attention backend's smallest). `shape` overrides LlamaConfig's fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8192,
    }
    fields.update(shape)
    config = LlamaConfig(torch_dtype="float32", **fields)
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)
