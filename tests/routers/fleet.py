"""The small fleet the router tests run on 127.0.0.1: an engine, a pool node following it, a
control engine announced by vLLM's own publisher, and stub HTTP workers for the routers.

* **The engine** is a kvpeer node (``kvpeer.Node``) holding the chunks of the test prompts, with
  an event stream published by vLLM 0.33's own ``ZmqEventPublisher`` (``distributed/
  kv_events.py`` extracted unchanged from the wheel by tests/interop/setup.sh) in the form a
  vLLM engine with a CPU tier publishes: its GPU pool's ``BlockStored`` (every block hash, the
  parent, the tokens, ``block_size`` 16) and its CPU tier's placeholder per chunk (one hash, no
  tokens; vLLM's default offloading events).
* **The pool** is ``kvpeer serve --follow ... --publish-events ...`` (the binary under test): it
  pulls the chunks over P2P and publishes its own stream, which the routers index.
* **The control** is what the same chunks look like when an engine's CPU tier announces them
  itself (vLLM's self-describing offloading events: each chunk's two block hashes, its parent,
  its 32 tokens, ``block_size`` 16), through vLLM's publisher: what a router does with it is
  what it does with an engine. A router must credit the pool exactly as it credits the control.

A prompt is ``PROMPT_BLOCKS`` blocks of 16 tokens plus one token (a router counts only whole
blocks before the last token), in chunks of ``CHUNK_BLOCKS`` blocks; each prompt has its own
tokens and hashes. Nothing here sleeps for a fixed time: every wait polls a condition under a
deadline. Processes are ended by their PID.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

BLOCK_SIZE = 16
CHUNK_BLOCKS = 2
PROMPT_BLOCKS = 8
CHUNKS = PROMPT_BLOCKS // CHUNK_BLOCKS
BLOCK_LEN = 4096
MODEL = "stub-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(done: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Polls ``done`` every 50 ms until it returns something true; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- prompts


def tokens(prompt: int) -> list[int]:
    return [prompt * 1000 + i for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 1)]


def block_hashes(prompt: int) -> list[bytes]:
    return [
        hashlib.sha256(f"kvpeer-routers:{prompt}:{i}".encode()).digest()
        for i in range(PROMPT_BLOCKS)
    ]


def chunk_key(prompt: int, chunk: int) -> bytes:
    """The P2P offload key of a chunk: its last block's hash and group 0 (4 bytes BE)."""
    return block_hashes(prompt)[(chunk + 1) * CHUNK_BLOCKS - 1] + (0).to_bytes(4, "big")


def as_int(h: bytes) -> int:
    """vLLM's int form of a hash (``maybe_convert_block_hash``): its low 64 bits."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


# --------------------------------------------------------------------------- vLLM's publisher


def vllm_events():
    """vLLM 0.33's event classes (the extracted module)."""
    from vllm.distributed import kv_events

    return kv_events


class VllmStream:
    """A KV event stream published by vLLM's own ``ZmqEventPublisher``, bound on 127.0.0.1
    (vLLM binds only wildcard endpoints and connects to the rest; the test binds loopback)."""

    def __init__(self, replay: bool = True) -> None:
        kv = vllm_events()
        self.port = free_port()
        self.replay_port = free_port() if replay else None
        publisher = kv.ZmqEventPublisher
        publisher._is_bind_endpoint = staticmethod(lambda endpoint: True)
        self.pub = publisher(
            data_parallel_rank=0,
            endpoint=f"tcp://127.0.0.1:{self.port}",
            replay_endpoint=(
                f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None
            ),
            topic="",
        )

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def publish(self, events: list) -> None:
        kv = vllm_events()
        self.pub.publish(kv.KVEventBatch(ts=time.time(), events=events))

    def shutdown(self) -> None:
        self.pub.shutdown()


def engine_events(prompt: int, gpu: bool = True) -> list:
    """What a vLLM engine with a CPU tier publishes for a prompt: the GPU pool's store of every
    block (unless ``gpu`` is false), then its CPU tier's placeholder per chunk."""
    kv = vllm_events()
    hashes = block_hashes(prompt)
    events = []
    if gpu:
        events.append(
            kv.BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=tokens(prompt)[: PROMPT_BLOCKS * BLOCK_SIZE],
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
    for c in range(CHUNKS):
        events.append(
            kv.BlockStored(
                block_hashes=[hashes[(c + 1) * CHUNK_BLOCKS - 1]],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=0,
            )
        )
    return events


def described_chunks(prompt: int, int_hashes: bool) -> list:
    """The prompt's chunks as an engine's CPU tier announces them with vLLM's self-describing
    events: two block hashes each, the parent, 32 tokens, block size 16."""
    kv = vllm_events()
    form = as_int if int_hashes else (lambda h: h)
    hashes = [form(h) for h in block_hashes(prompt)]
    toks = tokens(prompt)
    per_chunk = CHUNK_BLOCKS * BLOCK_SIZE
    return [
        kv.BlockStored(
            block_hashes=hashes[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS],
            parent_block_hash=hashes[c * CHUNK_BLOCKS - 1] if c else None,
            token_ids=toks[c * per_chunk : (c + 1) * per_chunk],
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        for c in range(CHUNKS)
    ]


# --------------------------------------------------------------------------- processes


class Procs:
    """Processes a test started, each logging to its own file; ended by PID at the end."""

    def __init__(self, logs: str) -> None:
        self.logs = logs
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.logs, f"{name}.log"), "wb")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.started.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        with open(os.path.join(self.logs, f"{name}.log"), "rb") as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace"))

    def stop(self) -> None:
        for _, proc in reversed(self.started):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self.started):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if raw.strip()[:1] in ("{", "[") else raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


# --------------------------------------------------------------------------- the pool


class PoolNode:
    """``kvpeer serve`` following ``engine_id``'s stream and publishing its own events."""

    def __init__(self, procs: Procs, stream: VllmStream, engine_id: str, *flags: str) -> None:
        self.events_port = free_port()
        self.metrics_port = free_port()
        binary = os.environ.get("KVPEER_BIN", "kvpeer")
        follow = f"{stream.endpoint},tcp://127.0.0.1:{stream.replay_port}={engine_id}"
        self.proc = procs.start(
            "pool",
            [
                binary,
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--plane",
                "tcp",
                "--blocks",
                "64",
                "--block-len",
                str(BLOCK_LEN),
                "--follow",
                follow,
                "--publish-events",
                f"tcp://127.0.0.1:{self.events_port}",
                "--metrics",
                f"127.0.0.1:{self.metrics_port}",
                *flags,
            ],
        )

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def metrics(self) -> dict[str, float]:
        status, text = http_json("GET", f"http://127.0.0.1:{self.metrics_port}/metrics")
        if status != 200 or not isinstance(text, str):
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def metric(self, name: str) -> float:
        assert self.proc.poll() is None, "the pool node exited"
        return self.metrics().get(name, 0.0)


def start_engine(prompts: list[int]):
    """A kvpeer node holding every chunk of ``prompts`` (random bytes, returned)."""
    import kvpeer

    node = kvpeer.Node(
        {"num_blocks": "64", "block_len": str(BLOCK_LEN), "plane": "tcp"}, tag="routers"
    )
    blocks = {
        chunk_key(p, c): os.urandom(BLOCK_LEN) for p in prompts for c in range(CHUNKS)
    }
    node.store(blocks)
    return node, blocks


# --------------------------------------------------------------------------- stub workers


class StubWorker:
    """An HTTP worker for a router: renders a prompt of space-separated numbers to those token
    ids and answers completions with its own name, recording each one it served."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.completions: list[dict] = []
        worker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path in ("/health", "/health_generate"):
                    return self._send(200, {})
                if path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": MODEL}]})
                return self._send(404, {"error": path})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                path = self.path.split("?")[0]
                if path.endswith("/render"):
                    ids = [int(t) for t in str(body.get("prompt", "")).split()]
                    return self._send(200, {"token_ids": ids, "prompt_token_ids": ids})
                if path in ("/v1/completions", "/v1/chat/completions"):
                    worker.completions.append(body)
                    return self._send(
                        200,
                        {
                            "id": f"cmpl-{worker.name}",
                            "object": "text_completion",
                            "created": int(time.time()),
                            "model": MODEL,
                            "choices": [
                                {
                                    "index": 0,
                                    "text": worker.name,
                                    "finish_reason": "stop",
                                    "logprobs": None,
                                }
                            ],
                            "usage": {
                                "prompt_tokens": 1,
                                "completion_tokens": 1,
                                "total_tokens": 2,
                            },
                        },
                    )
                return self._send(404, {"error": path})

        http.server.ThreadingHTTPServer.daemon_threads = True
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
