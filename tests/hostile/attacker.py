"""A hostile peer for kvpeer's adversarial tests (crates/kvpeer/tests/hostile_peers.rs).

It speaks the control protocol correctly (ZeroMQ DEALER/ROUTER, msgpack maps as vLLM's
msgspec writes them, docs/wire-format.md) and the data planes' byte formats
(docs/data-planes.md), and lies where an attacker would: about its identity, about the shm object
it owns, about who it is on a tcp data connection, or by sheer volume. Every wait is bounded.

Subcommands (each prints JSON lines on stdout; the last one is {"event": "summary", ...}):

  session   connect to a node (optionally lying), then lookup + fetch synthetic keys
  auth      a signed `connect` (kvpeer_auth v2) for node A, sent to node B, then to A, then
            replayed to A
  producer  act as the producer a `kvpeer fetch --peer` victim dials; while its fetch is
            outstanding, a third party tries tcp HELLOs the victim never issued; then write
            the blocks honestly and send transfer_done
  flood     junk payloads at a node: undecodable, unknown types, messages without a session,
            connects that must be rejected, and payloads from many spoofed identities
  connects  many `connect`s claiming an identity whose port drops every connection
  cycles    sessions opened properly and ended at once (disconnect, or a protocol error), in
            a loop
  squat     hold a connection claiming someone else's identity, silent, then inject a
            `fetch` into that identity's session
  sessions  open `--count` sessions from one host (one identity per port, each with its own
            ROUTER), hold them, and re-open any the node ends, for `--duration` seconds
  impostor  hold a node's address before the node binds it, collect the proofs an honest
            kvpeer consumer sends there, then replay them to the real node once it runs
            (claiming the consumer's identity) and fetch into the consumer's pool

  session --shrink-own-pool: after the handshake, shrink our own (proven) pool object under the
  node before its write (a node that maps peers' objects dies of SIGBUS); the summary says how
  many bytes of our object the node made the kernel allocate (`own_pool_allocated`).
  trickle   a consumer over tcp: lookup + fetch synthetic keys, then read the node's data
            connection a trickle at a time (or at full speed, ACKing: the control run)
  hoard     a correct session that looks up keys and never fetches them (pins held until the
            store timeout), then optionally one huge lookup; reports what each lookup_resp said
  spread    a flood spread out: `--hosts` source addresses (127.0.1.1, 127.0.1.2, ...), each
            with `--sessions` sessions (one identity and ROUTER each) over `--conns` DEALER
            connections per session (more than one: each new connection takes the identity
            over, as a reconnecting DEALER does), every session sending `--keys`-key lookups of keys the
            node lacks back to back (`--window` outstanding), for `--duration` seconds; says
            when every session is flooding, then how many lookups were answered once a second

Needs pyzmq and msgpack (tests/requirements.txt).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import hmac
import json
import os
import select
import signal
import socket
import struct
import sys
import time

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zmtp_raw import RawDealer, RawRouter  # noqa: E402

MISS_BASE = 1 << 48
TRAILER_LEN = 4096
MAGIC = b"KVPSHM01"


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def key(i: int) -> bytes:
    """Synthetic key `i` (docs/synthetic-workload.md; crates/kvpeer/src/synthetic.rs)."""
    return hashlib.sha256(f"kvpeer-synthetic:{i}".encode()).digest() + (0).to_bytes(4, "big")


def content(k: bytes, n: int) -> bytes:
    p = hashlib.sha256(k).digest()
    return (p * (n // 32 + 1))[:n]


def span(text: str) -> list[int]:
    """"3-5,9" -> [3, 4, 5, 9]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def default_seed() -> str:
    return os.environ.get("PYTHONHASHSEED") or "vllm-none-hash"


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(payload: bytes):
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001 - anything the node sends that is not msgpack
        return {"type": "<undecodable>"}


# --- shm pool objects and tokens (crates/kvpeer-store/src/trailer.rs) -------------------------


def shm_token(secret: bytes, destination: str, challenge: bytes | None) -> bytes:
    """HMAC-SHA256(secret, u32be(len) ‖ "kvpeer-shm-token-v2" ‖ u32be(len) ‖ destination ‖
    u32be(len) ‖ challenge), or version 1 (no challenge) when `challenge` is None."""
    if challenge is None:
        fields = (b"kvpeer-shm-token-v1", destination.encode())
    else:
        fields = (b"kvpeer-shm-token-v2", destination.encode(), challenge)
    msg = b""
    for field in fields:
        msg += struct.pack(">I", len(field)) + field
    return hmac.new(secret, msg, hashlib.sha256).digest()


def create_pool(name: str, num_blocks: int, block_len: int) -> bytes:
    """A pool object as kvpeer makes one: blocks, then the trailer (magic, 32-byte secret)."""
    secret = os.urandom(32)
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    # Removed however we end (a benchmark stops its attackers with SIGTERM: see main).
    atexit.register(lambda: os.path.exists(f"/dev/shm/{name}") and os.unlink(f"/dev/shm/{name}"))
    try:
        os.ftruncate(fd, num_blocks * block_len + TRAILER_LEN)
        os.pwrite(fd, MAGIC + secret, num_blocks * block_len)
    finally:
        os.close(fd)
    return secret


def read_secret(name: str, num_blocks: int, block_len: int) -> bytes:
    with open(f"/dev/shm/{name}", "rb") as f:
        f.seek(num_blocks * block_len)
        head = f.read(40)
    return head[8:40]


def read_block(name: str, index: int, block_len: int) -> bytes:
    with open(f"/dev/shm/{name}", "rb") as f:
        f.seek(index * block_len)
        return f.read(block_len)


def read_memory_block(pid: int, base_addr: int, index: int, block_len: int) -> bytes:
    """Block `index` of a pool in another process's memory (any kind: a tcp node's pool is
    private anonymous memory), at the `base_addr` its `connect` advertised."""
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(base_addr + index * block_len)
        return f.read(block_len)


# --- kvpeer_auth v3 (crates/kvpeer/src/node/auth.rs) ------------------------------------------


def auth_token(secret: bytes, destination: str, challenge: bytes, c: dict, when: int,
               nonce: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)

    def field(b: bytes) -> None:
        mac.update(struct.pack(">Q", len(b)))
        mac.update(b)

    field(b"kvpeer-auth-v3")
    field(destination.encode())
    field(challenge)
    field(c["peer_id"].encode())
    field(c["agent_metadata"])
    field(struct.pack(">Q", c["base_addr"]))
    field(struct.pack(">Q", c["num_blocks"]))
    field(struct.pack(">Q", c["block_len"]))
    field(c.get("config_fingerprint", "").encode())
    field(c["hash_seed"].encode())
    field(struct.pack(">Q", when))
    field(nonce)
    return bytes([3]) + struct.pack(">Q", when) + nonce + mac.digest()


# --- the control channel ----------------------------------------------------------------------


class Peer:
    """A ROUTER bound where the node will dial us back, and DEALERs to nodes."""

    def __init__(self, bind: str, identity: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        host, port = bind.rsplit(":", 1)
        self.router.bind(f"tcp://{host}:{port if port != '0' else '*'}")
        endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.addr = endpoint.rsplit("/", 1)[1]
        self.identity = (identity or self.addr).replace("{port}", self.addr.rsplit(":", 1)[1])
        self.dealers: dict[str, zmq.Socket] = {}
        self.received: list[dict] = []  # every message heard, with who sent it

    def dealer(self, node: str, source: str | None = None, identity: str | None = None):
        """Our DEALER to `node`: ZMTP spoken here (zmtp_raw.py), so the node's READY, and the
        challenge our proofs must be made for, can be read."""
        ident = identity or self.identity
        if (node, ident) in self.dealers:
            return self.dealers[(node, ident)]
        s = RawDealer(node, ident, source)
        self.dealers[(node, ident)] = s
        return s

    def challenge(self, node: str, source: str | None = None) -> bytes | None:
        """The challenge `node` gave our connection to it (None: none, or not connected)."""
        return self.dealer(node, source).challenge()

    def send(self, node: str, msg, source: str | None = None, identity: str | None = None):
        payload = msg if isinstance(msg, bytes) else pack(msg)
        self.dealer(node, source, identity).send(payload)

    def poll(self, timeout_s: float) -> list[tuple[str, dict]]:
        """Messages reaching our ROUTER within `timeout_s` (returns at the first batch)."""
        out = []
        for d in self.dealers.values():
            d.pump()  # PINGs answered, the node's closing seen
        if self.router.poll(int(timeout_s * 1000)):
            while True:
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    continue
                who = frames[0].decode(errors="replace")
                msg = unpack(frames[1])
                if not isinstance(msg, dict):
                    msg = {"type": "<not a map>"}
                self.received.append({"from": who, "type": msg.get("type")})
                out.append((who, msg))
        return out

    def wait_for(self, types: set[str], timeout_s: float, sink=None):
        """Collects messages until one of `types` arrives or time runs out; returns it or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for who, msg in self.poll(max(0.0, deadline - time.monotonic())):
                if sink is not None:
                    sink(who, msg)
                if msg.get("type") in types:
                    return who, msg
        return None

    def close(self) -> None:
        for s in self.dealers.values():
            s.close(linger=200)
        self.router.close(linger=0)
        self.ctx.term()


def metadata(
    agent: str, shm: str | None, token: bytes | None, tcp: str | None, tcp_key: bytes | None
) -> bytes:
    m: dict = {"agent": agent}
    if shm is not None:
        m["shm"] = shm
    if token is not None:
        m["shm_token"] = token
    if tcp is not None:
        m["tcp"] = tcp
    if tcp_key is not None:
        m["tcp_key"] = tcp_key
    return pack(m)


def connect_msg(peer_id: str, meta: bytes, num_blocks: int, block_len: int, seed: str) -> dict:
    return {
        "type": "connect",
        "peer_id": peer_id,
        "agent_metadata": meta,
        "base_addr": 0,
        "num_blocks": num_blocks,
        "block_len": block_len,
        "config_fingerprint": "",
        "hash_seed": seed,
    }


def describe_meta(raw) -> dict:
    try:
        m = msgpack.unpackb(raw, raw=False)
        return {
            k: (v.hex() if isinstance(v, bytes) else v) for k, v in m.items()
        }
    except Exception:  # noqa: BLE001
        return {"<undecodable>": True}


class DummyTcp:
    """A tcp data listener we advertise (the node's writer dials it); it accepts and reads,
    counting what reached it. `host` is how the advertised address spells its host (the
    listener itself is on 127.0.0.1: `0` reaches it too, as `connect(2)` reads 0.0.0.0 as this
    host)."""

    def __init__(self, host: str = "127.0.0.1", bind: str = "127.0.0.1:0") -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bind_host, bind_port = bind.rsplit(":", 1)
        self.sock.bind((bind_host, int(bind_port)))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.addr = "%s:%d" % (host, self.sock.getsockname()[1])
        self.key = os.urandom(32)
        self.conns: list[socket.socket] = []
        self.bytes = 0

    def pump(self) -> None:
        try:
            while True:
                c, _ = self.sock.accept()
                c.setblocking(False)
                self.conns.append(c)
        except BlockingIOError:
            pass
        for c in self.conns:
            try:
                while True:
                    b = c.recv(1 << 16)
                    if not b:
                        break
                    self.bytes += len(b)
            except (BlockingIOError, OSError):
                pass


# --- session ------------------------------------------------------------------------------------


def cmd_session(a) -> int:
    peer = Peer(a.bind, a.identity)
    extra = Peer(a.also_bind) if a.also_bind else None
    num_blocks, block_len = a.num_blocks, a.block_len
    own_pool = None
    if a.own_pool:
        own_pool = f"kvpeer-hostile-{os.getpid()}"
        create_pool(own_pool, num_blocks, block_len)
    shm = own_pool or a.shm
    if a.shm_token == "none":
        token = None
    elif a.shm_token == "random":
        token = os.urandom(32)
    elif a.shm_token == "from-object":
        token = shm_token(read_secret(shm, a.secret_blocks or num_blocks, block_len), a.node,
                          peer.challenge(a.node, a.source))
    else:
        token = bytes.fromhex(a.shm_token)
    tcp = (DummyTcp(a.tcp_host or "127.0.0.1", a.tcp_bind)
           if (a.tcp_dummy or a.tcp_host) else None)
    meta = metadata(
        peer.identity, shm, token, tcp.addr if tcp else None, tcp.key if tcp else None
    )
    peer_id = extra.identity if (extra and a.peer_id_extra) else (a.peer_id or peer.identity)
    c = connect_msg(peer_id, meta, num_blocks, block_len, a.hash_seed)
    emit({"event": "ready", "identity": peer.identity, "extra": extra and extra.identity,
          "own_pool": own_pool})

    node_meta = {}
    state = {"connect_ack": False, "disconnect": False, "connect": False}

    def note(who, msg):
        if tcp:
            tcp.pump()
        t = msg.get("type")
        if t == "connect":
            state["connect"] = True
            node_meta.update(describe_meta(msg.get("agent_metadata", b"")))
        elif t == "connect_ack":
            state["connect_ack"] = True
        elif t == "disconnect":
            state["disconnect"] = True

    peer.send(a.node, c, source=a.source)
    got = peer.wait_for({"connect_ack", "disconnect"}, a.wait, note)
    if state["connect_ack"]:
        # Let a disconnect that follows the ack arrive too.
        peer.wait_for({"disconnect"}, 0.3, note)
        peer.send(a.node, {"type": "connect_ack", "peer_id": peer_id}, source=a.source)
    allocated = None
    if own_pool:
        # What registering our (sparse) object made the kernel allocate for it, before any write.
        peer.wait_for(set(), 0.5, note)
        allocated = os.stat(f"/dev/shm/{own_pool}").st_blocks * 512
    if own_pool and a.shrink_own_pool:
        # Our object, proven: now cut it to nothing but one page under the node.
        fd = os.open(f"/dev/shm/{own_pool}", os.O_RDWR)
        os.ftruncate(fd, 4096)
        os.close(fd)
    keys = [key(i) for i in span(a.keys)]
    indexes = span(a.indexes) if a.indexes else list(range(len(keys)))
    hits = None
    transfer_done = []
    # Request ids as long as asked (vLLM bounds none): what the node keeps and logs of them.
    request_id = "hostile-1" + "r" * a.id_bytes
    for i in range(a.unknown_aborts):
        peer.send(a.node, {"type": "abort_fetch", "kv_request_id": f"{i}-{request_id}",
                           "round_seq": 0}, source=a.source)

    def abort_acks() -> int:
        return sum(1 for m in peer.received if m["type"] == "abort_ack")

    deadline = time.monotonic() + a.wait
    while abort_acks() < a.unknown_aborts and time.monotonic() < deadline:
        for who, msg in peer.poll(deadline - time.monotonic()):
            note(who, msg)
    if keys:
        # Whatever the handshake said: a hostile peer tries anyway.
        peer.send(a.node, {"type": "lookup", "kv_request_id": request_id, "keys": keys,
                           "round_seq": 0}, source=a.source)
        got = peer.wait_for({"lookup_resp"}, a.wait if state["connect_ack"] else 1.0, note)
        if got:
            hits = got[1].get("hits")
        peer.send(a.node, {"type": "fetch", "kv_request_id": request_id, "keys": keys,
                           "block_indexes": indexes, "round_seq": 0}, source=a.source)
        deadline = time.monotonic() + (a.wait if state["connect_ack"] else 1.5)
        while time.monotonic() < deadline:
            got = peer.wait_for({"transfer_done"}, deadline - time.monotonic(), note)
            if not got:
                break
            transfer_done.append(got[1].get("success"))
            break
    own_ok = None
    if own_pool and transfer_done and transfer_done[0] is True and not a.shrink_own_pool:
        own_ok = all(
            read_block(own_pool, r, block_len) == content(k, block_len)
            for k, r in zip(keys, indexes)
        )
    if a.linger:
        peer.wait_for(set(), a.linger, note)
    if tcp:
        tcp.pump()
    heard_extra = []
    if extra:
        extra.poll(0.2)
        heard_extra = extra.received
    if state["connect_ack"]:
        peer.send(a.node, {"type": "disconnect"}, source=a.source)
        time.sleep(0.2)
    emit({
        "event": "summary",
        "identity": peer.identity,
        "received": [m["type"] for m in peer.received],
        "connect": state["connect"],
        "connect_ack": state["connect_ack"],
        "disconnect": state["disconnect"],
        "node_meta": node_meta,
        "hits": hits,
        "transfer_done": transfer_done,
        "abort_acks": abort_acks(),
        "own_pool_bytes_ok": own_ok,
        "own_pool_allocated": allocated,
        "closed_by_node": any(d.closed for d in peer.dealers.values()),
        "refused_with": next((d.error for d in peer.dealers.values() if d.error), None),
        "tcp_accepted": len(tcp.conns) if tcp else None,
        "tcp_bytes": tcp.bytes if tcp else None,
        "extra_received": [m["type"] for m in heard_extra],
    })
    peer.close()
    if extra:
        extra.close()
    if own_pool:
        os.unlink(f"/dev/shm/{own_pool}")
    return 0


# --- auth replay --------------------------------------------------------------------------------


def cmd_auth(a) -> int:
    with open(a.secret_file, "rb") as f:
        secret = f.read().strip()
    peer = Peer(a.bind)
    own_pool = f"kvpeer-hostile-{os.getpid()}"
    pool_secret = create_pool(own_pool, a.num_blocks, a.block_len)
    # One token per destination and connection: B gets what A's connection was given (as a
    # captured connect would carry).
    challenge_a = peer.challenge(a.node_a)
    meta = metadata(peer.identity, own_pool, shm_token(pool_secret, a.node_a, challenge_a),
                    None, None)
    c = connect_msg(peer.identity, meta, a.num_blocks, a.block_len, a.hash_seed)
    c["kvpeer_auth"] = auth_token(secret, a.node_a, challenge_a, c, int(time.time()),
                                  os.urandom(16))
    captured = pack(c)
    out: dict = {"event": "summary", "identity": peer.identity}

    def attempt(node: str, wait: float) -> dict:
        state = {"connect": False, "connect_ack": False, "disconnect": False}

        def note(who, msg):
            t = msg.get("type")
            if t in state:
                state[t] = True

        peer.send(node, captured)
        peer.wait_for({"connect_ack", "disconnect"}, wait, note)
        if state["connect_ack"]:
            peer.send(node, {"type": "connect_ack", "peer_id": peer.identity})
        return state

    # 1. The connect signed for A, replayed to B (which shares the secret).
    out["to_b"] = attempt(a.node_b, a.wait)
    # 2. The same bytes to A, its intended destination: accepted (the signing is right).
    out["to_a"] = attempt(a.node_a, a.wait)
    lookup_ok = None
    if out["to_a"]["connect_ack"]:
        peer.send(a.node_a, {"type": "lookup", "kv_request_id": "auth-1",
                             "keys": [key(0)], "round_seq": 0})
        got = peer.wait_for({"lookup_resp"}, a.wait)
        lookup_ok = bool(got) and got[1].get("hits") == [True]
        peer.send(a.node_a, {"type": "fetch", "kv_request_id": "auth-1", "keys": [],
                             "block_indexes": [], "round_seq": 1})
        peer.send(a.node_a, {"type": "disconnect"})
    out["lookup_at_a"] = lookup_ok
    # 3. A new connection (another identity is not needed: the old session is gone) replays the
    #    same bytes to A: the nonce was seen.
    time.sleep(1.0)
    for s in peer.dealers.values():
        s.close(linger=0)
    peer.dealers.clear()
    peer.poll(0.2)
    out["replay_to_a"] = attempt(a.node_a, a.wait)
    out["received"] = [m["type"] for m in peer.received]
    emit(out)
    peer.close()
    os.unlink(f"/dev/shm/{own_pool}")
    return 0


# --- producer (victim: a `kvpeer fetch` consumer on the tcp plane) -----------------------------


def recv_exact(s: socket.socket, n: int, deadline: float) -> bytes | None:
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        s.settimeout(left)
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def hello(version: int, writer: str, key_bytes: bytes | None) -> bytes:
    w = writer.encode()
    return b"KVPH" + bytes([version]) + struct.pack(">H", len(w)) + w + (key_bytes or b"")


def write_frame(tid: int, indexes: list[int], blocks: list[bytes]) -> bytes:
    return (
        b"KVPW"
        + struct.pack(">QI", tid, len(indexes))
        + b"".join(struct.pack(">Q", i) for i in indexes)
        + b"".join(blocks)
    )


def data_attempt(addr: str, frame_hello: bytes, write: bytes, wait: float) -> dict:
    """Opens a data connection, sends HELLO then WRITE; what came back and how fast."""
    host, port = addr.rsplit(":", 1)
    started = time.monotonic()
    s = socket.create_connection((host, int(port)), timeout=5)
    outcome = "timeout"
    try:
        try:
            s.sendall(frame_hello)
            s.sendall(write)
        except (BrokenPipeError, ConnectionResetError):
            outcome = "closed"
        if outcome == "timeout":
            try:
                ack = recv_exact(s, 13, started + wait)
                if ack is None:
                    outcome = "closed"
                elif ack[:4] != b"KVPA":
                    outcome = "junk"
                else:
                    outcome = f"ack{ack[12]}"
            except (ConnectionResetError, BrokenPipeError):
                outcome = "closed"
            except (TimeoutError, socket.timeout):
                outcome = "timeout"
    finally:
        s.close()
    return {"outcome": outcome, "seconds": round(time.monotonic() - started, 3)}


def cmd_producer(a) -> int:
    peer = Peer(a.bind)
    tcp = DummyTcp()
    emit({"event": "ready", "id": peer.identity})
    victim_pid = None
    if a.victim_pid_from_stdin:
        r, _, _ = select.select([sys.stdin], [], [], 30)
        if r:
            victim_pid = int(sys.stdin.readline().strip() or 0) or None
    victim = None
    victim_meta: dict = {}
    victim_base = 0

    def victim_blocks(idx: list[int]) -> list[bytes]:
        return [read_memory_block(victim_pid, victim_base, r, a.block_len) for r in idx]

    out: dict = {"event": "summary", "spoofs": {}, "honest": None, "served_fetches": 0}
    deadline = time.monotonic() + a.timeout
    done = False
    while time.monotonic() < deadline and not done:
        tcp.pump()
        for who, msg in peer.poll(0.05):
            t = msg.get("type")
            if t == "connect" and victim is None:
                victim = who
                victim_meta = msgpack.unpackb(msg["agent_metadata"], raw=False)
                victim_base = msg["base_addr"]
                meta = metadata(peer.identity, None, None, tcp.addr, tcp.key)
                peer.send(victim, connect_msg(peer.identity, meta, msg["num_blocks"],
                                              a.block_len, a.hash_seed))
                peer.send(victim, {"type": "connect_ack", "peer_id": peer.identity})
            elif t == "lookup":
                peer.send(who, {"type": "lookup_resp", "kv_request_id": msg["kv_request_id"],
                                "keys": msg["keys"], "hits": [True] * len(msg["keys"])})
            elif t == "abort_fetch":
                peer.send(who, {"type": "abort_ack", "kv_request_id": msg["kv_request_id"],
                                "round_seq": msg["round_seq"]})
            elif t == "fetch" and msg["keys"]:
                keys, idx = msg["keys"], msg["block_indexes"]
                addr = victim_meta.get("tcp")
                issued = victim_meta.get("tcp_key") or b""
                junk = [b"\xee" * a.block_len for _ in keys]
                before = victim_blocks(idx) if victim_pid else None
                attempts = {
                    # A third party claims the producer's id on the old HELLO (no key)...
                    "v1_as_producer": hello(1, peer.identity, None),
                    # ... on HELLO v2 with a key it guessed ...
                    "v2_wrong_key": hello(2, peer.identity, os.urandom(32)),
                    # ... with the key cut short ...
                    "v2_short_key": hello(2, peer.identity, issued[:16]),
                    # ... or names another writer id with no key of its own.
                    "v2_other_id": hello(2, "127.0.0.1:1", os.urandom(32)),
                }
                for name, h in attempts.items():
                    out["spoofs"][name] = data_attempt(addr, h, write_frame(7, idx, junk), a.wait)
                if victim_pid:
                    after = victim_blocks(idx)
                    out["victim_pool_unchanged"] = before == after
                    out["victim_pool_has_junk"] = any(b == junk[0] for b in after)
                # Junk connections holding the victim's data port (idle, never a HELLO).
                flood = []
                if a.flood:
                    host, port = addr.rsplit(":", 1)
                    for _ in range(a.flood):
                        try:
                            flood.append(socket.create_connection((host, int(port)), timeout=2))
                        except OSError:
                            out["flood_failed"] = out.get("flood_failed", 0) + 1
                    out["flood_open"] = len(flood)
                # The real producer: HELLO v2 with the key the victim issued to it.
                blocks = [content(k, a.block_len) for k in keys]
                out["honest"] = data_attempt(
                    addr, hello(2, peer.identity, issued), write_frame(1, idx, blocks), a.wait
                )
                for f in flood:
                    f.close()
                ok = out["honest"]["outcome"] == "ack0"
                peer.send(who, {"type": "transfer_done", "kv_request_id": msg["kv_request_id"],
                                "success": ok, "round_seq": msg["round_seq"]})
                out["served_fetches"] += 1
            elif t == "disconnect":
                done = True
    out["victim"] = victim
    out["victim_pid"] = victim_pid
    out["received"] = [m["type"] for m in peer.received]
    emit(out)
    peer.close()
    return 0


# --- flood --------------------------------------------------------------------------------------


def cmd_flood(a) -> int:
    peer = Peer(a.bind)
    emit({"event": "ready", "identity": peer.identity})
    n = a.count
    kinds = {
        "undecodable": 0, "unknown_type": 0, "no_session": 0, "bad_connect": 0,
        "bad_fields": 0, "spoofed": 0,
    }
    junk = [b"\xc1", b"\x93\x01", b"\xda\xff\xff", b"", b"\xdf\x00\x00\x00\x05"]
    spoofed = a.spoofed
    per = (n - spoofed) // 5
    for i in range(per):
        peer.send(a.node, junk[i % len(junk)] + struct.pack(">I", i))
        kinds["undecodable"] += 1
    for i in range(per):
        peer.send(a.node, {"type": f"hostile-{i}", "x": i})
        kinds["unknown_type"] += 1
    for i in range(per):
        peer.send(a.node, {"type": "lookup", "kv_request_id": f"r{i}", "keys": [key(i)],
                           "round_seq": i})
        kinds["no_session"] += 1
    for i in range(per):
        # A well-formed known type with a bad field: a protocol error.
        peer.send(a.node, {"type": "fetch", "kv_request_id": f"r{i}", "keys": [key(0)],
                           "block_indexes": [-i - 1], "round_seq": 0})
        kinds["bad_fields"] += 1
    sent = 0
    for i in range(n - spoofed - 4 * per):
        # Connects the node must reject (another hash seed): each a session, a dial-back, a
        # disconnect, and a warning.
        meta = metadata(peer.identity, None, None, None, None)
        peer.send(a.node, connect_msg(peer.identity, meta, 8, a.block_len, f"not-{i}"))
        kinds["bad_connect"] += 1
        sent += 1
        if sent % 200 == 0:
            peer.poll(0.001)
    # Many identities, each a claim the node must refuse (not this host's addresses).
    batch = []
    for i in range(spoofed):
        ident = f"203.0.113.{i % 250 + 1}:{20000 + i}"
        s = peer.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, ident.encode())
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(f"tcp://{a.node}")
        s.send(pack({"type": "lookup", "kv_request_id": "s", "keys": [key(i)], "round_seq": 0}))
        kinds["spoofed"] += 1
        batch.append(s)
        if len(batch) >= 100:
            time.sleep(0.05)
            for b in batch:
                b.close(linger=1000)
            batch = []
    for b in batch:
        b.close(linger=1000)
    # Let the node's answers (disconnects to the bad connects) arrive.
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        peer.poll(0.1)
    emit({"event": "summary", "sent": kinds, "total": sum(kinds.values()),
          "received": len(peer.received)})
    peer.close()
    return 0


# --- connects that make the node dial an address that drops every connection -----------------


def cmd_connects(a) -> int:
    """Sends `connect` claiming `--identity` (an address that accepts and drops every
    connection) `--count` times, `--interval` apart: each one asks the node to dial it."""
    peer = Peer(a.bind)
    # A pool of our own with a valid token: the registration succeeds, only the dial fails.
    own_pool = f"kvpeer-hostile-{os.getpid()}"
    secret = create_pool(own_pool, a.num_blocks, a.block_len)
    challenge = peer.dealer(a.node, identity=a.identity).challenge()
    meta = metadata(a.identity, own_pool, shm_token(secret, a.node, challenge), None, None)
    c = connect_msg(a.identity, meta, a.num_blocks, a.block_len, a.hash_seed)
    emit({"event": "ready"})
    for _ in range(a.count):
        peer.send(a.node, c, identity=a.identity)
        time.sleep(a.interval)
    emit({"event": "summary", "sent": a.count})
    peer.close()
    os.unlink(f"/dev/shm/{own_pool}")
    return 0


# --- sessions opened and ended at will ----------------------------------------------------------


def cmd_cycles(a) -> int:
    """`--count` sessions one after another, each opened properly (a pool of our own, a valid
    token, the node's `connect` acked) and ended at once: with `disconnect`, or with a `fetch`
    naming a negative block (a protocol error) every other time when `--protocol-errors`."""
    peer = Peer(a.bind)
    own_pool = f"kvpeer-hostile-{os.getpid()}"
    secret = create_pool(own_pool, a.num_blocks, a.block_len)
    token = shm_token(secret, a.node, peer.challenge(a.node))
    meta = metadata(peer.identity, own_pool, token, None, None)
    c = connect_msg(peer.identity, meta, a.num_blocks, a.block_len, a.hash_seed)
    emit({"event": "ready", "identity": peer.identity})
    acked = errors = 0
    for i in range(a.count):
        peer.send(a.node, c)
        if peer.wait_for({"connect_ack"}, a.wait):
            acked += 1
            peer.send(a.node, {"type": "connect_ack", "peer_id": peer.identity})
        else:
            # Refused (the last session ended before the node saw our ack: its dial backoff,
            # 250 ms at first): let it pass.
            time.sleep(0.3)
            continue
        if a.protocol_errors and i % 2:
            peer.send(a.node, {"type": "fetch", "kv_request_id": f"c{i}", "keys": [key(0)],
                               "block_indexes": [-1], "round_seq": 0})
            errors += 1
            # The node's `disconnect` ends the session before the next `connect`.
            peer.wait_for({"disconnect"}, a.wait)
        else:
            peer.send(a.node, {"type": "disconnect"})
            # Let the node end the session before the next `connect`.
            time.sleep(0.01)
    emit({"event": "summary", "sessions": a.count, "acked": acked, "protocol_errors": errors})
    peer.close()
    os.unlink(f"/dev/shm/{own_pool}")
    return 0


# --- identity squatting -------------------------------------------------------------------------


def cmd_squat(a) -> int:
    """Connects a DEALER claiming `--identity` before its owner does and stays silent for
    `--hold` seconds (libzmq answers heartbeats by itself), then sends a `fetch` naming the
    owner's blocks as if from the owner's session, and holds `--after` seconds more."""
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IDENTITY, a.identity.encode())
    d.connect(f"tcp://{a.node}")
    emit({"event": "ready"})
    time.sleep(a.hold)
    fetch = msgpack.packb({"type": "fetch", "kv_request_id": "squat", "keys": [key(0)],
                           "block_indexes": [0], "round_seq": 0}, use_bin_type=True)
    d.send(fetch)
    time.sleep(a.after)
    emit({"event": "summary", "identity": a.identity})
    d.close()
    ctx.term()
    return 0


# --- many sessions from one host ---------------------------------------------------------------


def cmd_sessions(a) -> int:
    """Holds as many sessions at once as it can: `--count` identities of this host (each a
    ROUTER of its own, so the node can answer), every one opened properly (our own pool, a
    token for the connection's challenge, the node's `connect` acked); any session the node
    ends (a `disconnect`) is opened again at once, for `--duration` seconds. The summary says
    how many were alive at the end and how many the node ended."""
    own_pool = f"kvpeer-hostile-{os.getpid()}"
    secret = create_pool(own_pool, a.num_blocks, a.block_len)
    # Each identity's host spelled in turn as `--spellings` lists (one host written many ways),
    # else our ROUTER's address.
    spellings = [x for x in (a.spellings or "").split(",") if x]
    peers = [Peer(a.bind, f"{spellings[i % len(spellings)]}:{{port}}" if spellings else None)
             for i in range(a.count)]
    alive: dict[str, bool] = {}
    ended = opened = 0

    def open_session(p: Peer) -> None:
        nonlocal opened
        token = shm_token(secret, a.node, p.challenge(a.node))
        meta = metadata(p.identity, own_pool, token, None, None)
        p.send(a.node, connect_msg(p.identity, meta, a.num_blocks, a.block_len, a.hash_seed))
        opened += 1

    for p in peers:
        open_session(p)
    emit({"event": "ready", "identities": [p.identity for p in peers]})
    end = time.monotonic() + a.duration
    while time.monotonic() < end:
        for p in peers:
            for _who, msg in p.poll(0.0):
                t = msg.get("type")
                if t == "connect_ack":
                    p.send(a.node, {"type": "connect_ack", "peer_id": p.identity})
                    alive[p.identity] = True
                elif t == "disconnect" and alive.get(p.identity, True):
                    alive[p.identity] = False
                    ended += 1
                    # Fresh connection (the node may have closed ours), then a fresh session.
                    d = p.dealers.pop((a.node, p.identity), None)
                    if d is not None:
                        d.close()
                    time.sleep(0.01)
                    open_session(p)
        time.sleep(0.005)
    emit({"event": "summary", "opened": opened, "ended_by_node": ended,
          "alive": sum(1 for v in alive.values() if v)})
    for p in peers:
        p.close()
    os.unlink(f"/dev/shm/{own_pool}")
    return 0


# --- an impostor at a node's address, replaying what it collected to the real node ---------------


def cmd_impostor(a) -> int:
    """Plays the node at `--listen` before it runs: an honest kvpeer consumer dials it and sends
    its `connect` (its shm_token and, with auth on, its kvpeer_auth, made for what our READY
    said). The listener is closed; once the real node answers at the same address, the captured
    `connect` is replayed to it from a connection claiming the consumer's identity (loopback may
    claim it), then a blind handshake, lookup and fetch of `--key` into block `--index` of the
    consumer's pool. The summary says whether the node closed our connection and whether the
    consumer's block now holds the key's bytes (the write landed)."""
    challenge = None if a.challenge == "none" else os.urandom(16)
    router = RawRouter(a.listen, challenge)
    emit({"event": "ready"})
    victim = router.accept(30.0)
    if victim is None:
        emit({"event": "summary", "error": "no victim dialled us"})
        return 1
    deadline = time.monotonic() + 30.0
    while not victim.messages and not victim.closed and time.monotonic() < deadline:
        victim.pump(0.1)
    if not victim.messages:
        emit({"event": "summary", "error": "the victim sent no connect"})
        return 1
    captured = victim.messages[0]
    c = unpack(captured)
    meta = msgpack.unpackb(c["agent_metadata"], raw=False)
    victim_id, pool = c["peer_id"], meta.get("shm")
    block_len = c["block_len"]
    router.close_listener()
    # Held open: the victim's object stays readable here even if the victim exits and unlinks it.
    pool_fd = os.open(f"/dev/shm/{pool}", os.O_RDONLY)

    def victim_block() -> bytes:
        return os.pread(pool_fd, block_len, a.index * block_len)

    emit({"event": "captured", "victim": victim_id, "pool": pool,
          "has_auth": "kvpeer_auth" in c, "has_token": "shm_token" in meta})
    # The real node binds our address now: wait for it (our victim connection stays open and
    # answered, so the victim keeps its pool and does not re-dial).
    node = None
    deadline = time.monotonic() + 30.0
    while node is None and time.monotonic() < deadline:
        victim.pump(0.05)
        try:
            d = RawDealer(a.listen, victim_id, timeout=1.0)
        except OSError:
            time.sleep(0.1)
            continue
        if d.props is not None:
            node = d
        else:
            d.close()
    if node is None:
        emit({"event": "summary", "error": "the real node never answered"})
        return 1
    expected = content(key(a.key), block_len)
    before = victim_block()
    if "kvpeer_auth" not in c and "shm_epoch" in meta:
        # The victim's fence words would refuse a block it never armed for us: an attacker
        # drops the epoch, so the node copies without them (they bind honest writers; what
        # stops this replay is the token, docs/security.md G5' and G2').
        meta.pop("shm_epoch")
        c["agent_metadata"] = msgpack.packb(meta, use_bin_type=True)
        captured = pack(c)
    node.send(captured)
    for msg, pause in (
        ({"type": "connect_ack", "peer_id": victim_id}, 0.5),
        ({"type": "lookup", "kv_request_id": "replayed-1", "keys": [key(a.key)],
          "round_seq": 0}, 0.3),
        ({"type": "fetch", "kv_request_id": "replayed-1", "keys": [key(a.key)],
          "block_indexes": [a.index], "round_seq": 0}, 0.5),
    ):
        end = time.monotonic() + pause
        while time.monotonic() < end:
            node.pump(0.05)
            victim.pump(0.0)
        node.send(pack(msg))
    written = False
    end = time.monotonic() + a.wait
    while time.monotonic() < end and not written:
        node.pump(0.05)
        victim.pump(0.0)
        written = victim_block() == expected
    emit({"event": "summary", "victim": victim_id, "pool": pool,
          "node_challenge": (node.challenge() or b"").hex(),
          "closed_by_node": node.closed, "victim_block_written": written,
          "victim_block_was_key": before == expected})
    node.close()
    victim.close()
    os.close(pool_fd)
# --- trickle: a consumer that reads its tcp data connection slowly -----------------------------


def cmd_trickle(a) -> int:
    peer = Peer(a.bind)
    data = socket.socket()
    # A small receive window: the node's writer is held by our reading, not by our buffer.
    data.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, a.rcvbuf)
    data.bind(("127.0.0.1", 0))
    data.listen(4)
    addr = "127.0.0.1:%d" % data.getsockname()[1]
    tcp_key = os.urandom(32)
    meta = metadata(peer.identity, None, None, addr, tcp_key)
    c = connect_msg(peer.identity, meta, a.num_blocks, a.block_len, a.hash_seed)
    emit({"event": "ready", "identity": peer.identity})
    state = {"connect_ack": False, "disconnect": False, "transfer_done": []}

    def note(who, msg):
        t = msg.get("type")
        if t == "connect_ack":
            state["connect_ack"] = True
        elif t == "disconnect":
            state["disconnect"] = True
        elif t == "transfer_done":
            state["transfer_done"].append(msg.get("success"))

    peer.send(a.node, c)
    peer.wait_for({"connect_ack", "disconnect"}, a.wait, note)
    peer.send(a.node, {"type": "connect_ack", "peer_id": peer.identity})
    keys = [key(i) for i in span(a.keys)]
    indexes = list(range(len(keys)))
    hits = None
    peer.send(a.node, {"type": "lookup", "kv_request_id": "trickle-1", "keys": keys,
                       "round_seq": 0})
    got = peer.wait_for({"lookup_resp"}, a.wait, note)
    if got:
        hits = got[1].get("hits")
    # The node's writer dials our data port at its first write (the fetch), not before.
    peer.send(a.node, {"type": "fetch", "kv_request_id": "trickle-1", "keys": keys,
                       "block_indexes": indexes, "round_seq": 0})
    start = time.monotonic()
    data.settimeout(a.wait)
    conn, _ = data.accept()
    # What the node's writer must send: its HELLO (checked by length and key), then WRITEs of
    # our keys' blocks.
    expected_blocks = b"".join(content(k, a.block_len) for k in keys)
    got_bytes = bytearray()
    closed_after = None
    acked = 0
    parsed = 0  # bytes of got_bytes consumed by complete frames
    hello_len = None
    block_bytes = bytearray()
    frames_ok = True
    left_after = None
    while time.monotonic() - start < a.hold:
        for who, msg in peer.poll(0.0):
            note(who, msg)
        if a.reading == "leave" and left_after is None and time.monotonic() - start >= a.leave_after:
            # End the session mid-write; the data connection stays ours to read.
            peer.send(a.node, {"type": "disconnect"})
            left_after = time.monotonic() - start
        r, _, _ = select.select([conn], [], [], 0.05)
        if r:
            try:
                chunk = conn.recv(a.chunk if a.reading == "trickle" else 1 << 20)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if not chunk:
                closed_after = time.monotonic() - start
                break
            got_bytes += chunk
        # Parse what is complete: the HELLO, then whole WRITEs (header, then blocks); slices
        # only of headers, so reading at full speed stays fast.
        while True:
            have = len(got_bytes) - parsed
            if hello_len is None:
                if have < 7:
                    break
                hello_len = 7 + struct.unpack(">H", got_bytes[5:7])[0] + 32
                frames_ok &= bytes(got_bytes[:5]) == b"KVPH\x02"
                continue
            if parsed == 0:
                if have < hello_len:
                    break
                frames_ok &= bytes(got_bytes[hello_len - 32:hello_len]) == tcp_key
                parsed = hello_len
                continue
            if have < 16:
                break
            frames_ok &= bytes(got_bytes[parsed:parsed + 4]) == b"KVPW"
            tid, count = struct.unpack(">QI", got_bytes[parsed + 4:parsed + 16])
            head = 16 + 8 * count
            if have < head + count * a.block_len:
                break
            block_bytes += got_bytes[parsed + head:parsed + head + count * a.block_len]
            parsed += head + count * a.block_len
            if a.reading == "full":
                conn.sendall(b"KVPA" + struct.pack(">Q", tid) + b"\x00")
                acked += 1
        if state["transfer_done"] and a.reading == "full":
            break
        if a.reading in ("trickle", "leave"):
            time.sleep(a.every)
    frames_ok &= expected_blocks.startswith(bytes(block_bytes))
    if hello_len is not None and parsed > 0 and len(got_bytes) - parsed >= 16:
        # A WRITE cut short: what came of its blocks must be our blocks' start.
        count = struct.unpack(">I", got_bytes[parsed + 12:parsed + 16])[0]
        body = bytes(got_bytes[parsed + 16 + 8 * count:])
        frames_ok &= expected_blocks[len(block_bytes):].startswith(body)
    # Let a transfer_done or disconnect that follows the close arrive.
    if left_after is None:
        peer.wait_for({"transfer_done"} if not state["transfer_done"] else set(), a.wait, note)
    peer.wait_for(set(), 0.3, note)
    emit({
        "event": "summary",
        "identity": peer.identity,
        "connect_ack": state["connect_ack"],
        "hits": None if hits is None else sum(1 for h in hits if h),
        "bytes": len(got_bytes),
        "frame_bytes": 16 + 8 * len(keys) + len(expected_blocks),
        "frames_ok": bool(frames_ok),
        "blocks_received": len(block_bytes) // a.block_len,
        "acked": acked,
        "closed_after_s": closed_after,
        "left_after_s": left_after,
        "transfer_done": state["transfer_done"],
        "disconnect": state["disconnect"],
    })
    if not state["disconnect"] and left_after is None:
        peer.send(a.node, {"type": "disconnect"})
        time.sleep(0.2)
    conn.close()
    data.close()
    peer.close()
    return 0


# --- hoard -------------------------------------------------------------------------------------


def cmd_hoard(a) -> int:
    peer = Peer(a.bind)
    tcp = DummyTcp()
    meta = metadata(peer.identity, None, None, tcp.addr, tcp.key)
    c = connect_msg(peer.identity, meta, a.num_blocks, a.block_len, a.hash_seed)
    state = {"connect_ack": False, "disconnect": False}

    def note(who, msg):
        tcp.pump()
        t = msg.get("type")
        if t == "connect_ack":
            state["connect_ack"] = True
        elif t == "disconnect":
            state["disconnect"] = True

    peer.send(a.node, c)
    peer.wait_for({"connect_ack", "disconnect"}, a.wait, note)
    if not state["connect_ack"]:
        emit({"event": "summary", "connect_ack": False, "lookups": [], "huge": None})
        peer.close()
        return 0
    peer.send(a.node, {"type": "connect_ack", "peer_id": peer.identity})

    def answer(keys: list[bytes], rid: str, wait: float):
        sent = time.monotonic()
        peer.send(a.node, {"type": "lookup", "kv_request_id": rid, "keys": keys,
                           "round_seq": 0})
        deadline = sent + wait
        while time.monotonic() < deadline:
            got = peer.wait_for({"lookup_resp"}, deadline - time.monotonic(), note)
            if got and got[1].get("kv_request_id") == rid:
                hits = got[1].get("hits") or []
                return {
                    "rid": rid,
                    "keys": len(keys),
                    "answered": len(hits),
                    "hits": sum(1 for h in hits if h),
                    "first_miss": next((i for i, h in enumerate(hits) if not h), None),
                    "hits_after_first_miss": sum(
                        1 for h in hits[next((i for i, h in enumerate(hits) if not h),
                                             len(hits)):] if h),
                    "seconds": time.monotonic() - sent,
                    "at": time.time(),
                }
        return {"rid": rid, "keys": len(keys), "answered": None, "seconds": None}

    keys = [key(i) for i in span(a.keys)]
    lookups = []
    for r in range(a.rounds):
        lookups.append(answer(keys, f"hoard-{r}", a.wait))
    emit({"event": "hoarded", "lookups": lookups})
    huge = None
    if a.huge:
        big = [key(i % a.huge_distinct) for i in range(a.huge)]
        emit({"event": "huge_sending", "at": time.time()})
        huge = answer(big, "hoard-huge", a.wait)
        emit({"event": "huge_answered", "huge": huge})
    end = time.monotonic() + a.hold
    while time.monotonic() < end:
        peer.wait_for(set(), min(0.2, max(0.0, end - time.monotonic())), note)
    peer.send(a.node, {"type": "disconnect"})
    time.sleep(0.2)
    emit({
        "event": "summary",
        "connect_ack": state["connect_ack"],
        "disconnect": state["disconnect"],
        "lookups": lookups,
        "huge": huge,
        "received": sorted({m["type"] for m in peer.received}),
    })
    peer.close()
    return 0


# --- a peer that dials again -------------------------------------------------------------------


def cmd_redial(a) -> int:
    """An honest peer whose connection to the node closes while the node's to it lives on (it
    was paused past its heartbeat, or restarted its DEALER, as vLLM's tier does on a heartbeat
    expiry), and that dials again. `--sessions` sessions, each opened properly (a pool of our
    own, a valid token for this connection's challenge, the node's `connect` acked), then
    `--keys` looked up and fetched into our pool; then our DEALER is closed (our ROUTER stays)
    and, `--gap` s later, a new one claims the same identity. What each session got."""
    peer = Peer(a.bind)
    own_pool = f"kvpeer-hostile-{os.getpid()}"
    secret = create_pool(own_pool, a.num_blocks, a.block_len)
    keys = [key(i) for i in span(a.keys)]
    emit({"event": "ready", "identity": peer.identity})
    sessions = []
    for n in range(a.sessions):
        state = {"connect_ack": False, "disconnect": False}

        def note(who, msg):
            if msg.get("type") in state:
                state[msg["type"]] = True

        token = shm_token(secret, a.node, peer.challenge(a.node))
        meta = metadata(peer.identity, own_pool, token, None, None)
        peer.send(a.node, connect_msg(peer.identity, meta, a.num_blocks, a.block_len,
                                      a.hash_seed))
        peer.wait_for({"connect_ack", "disconnect"}, a.wait, note)
        hits, done, exact = None, None, None
        if state["connect_ack"]:
            peer.wait_for({"disconnect"}, 0.3, note)
            peer.send(a.node, {"type": "connect_ack", "peer_id": peer.identity})
            rid = f"redial-{n}"
            peer.send(a.node, {"type": "lookup", "kv_request_id": rid, "keys": keys,
                               "round_seq": 0})
            got = peer.wait_for({"lookup_resp", "disconnect"}, a.wait, note)
            if got and got[1].get("type") == "lookup_resp":
                hits = got[1].get("hits")
                peer.send(a.node, {"type": "fetch", "kv_request_id": rid, "keys": keys,
                                   "block_indexes": list(range(len(keys))), "round_seq": 0})
                got = peer.wait_for({"transfer_done", "disconnect"}, a.wait, note)
                if got and got[1].get("type") == "transfer_done":
                    done = got[1].get("success")
                    exact = all(read_block(own_pool, i, a.block_len) == content(k, a.block_len)
                                for i, k in enumerate(keys))
        sessions.append({"connect_ack": state["connect_ack"],
                         "disconnect": state["disconnect"], "hits": hits,
                         "transfer_done": done, "bytes_exact": exact})
        # Our side of the connection goes; the next session dials afresh (a new DEALER, so a
        # new connection and challenge), the node's connection to our ROUTER untouched.
        peer.dealers.pop((a.node, peer.identity)).close(linger=0)
        fd = os.open(f"/dev/shm/{own_pool}", os.O_RDWR)
        os.pwrite(fd, bytes(a.block_len * len(keys)), 0)
        os.close(fd)
        time.sleep(a.gap)
    emit({"event": "summary", "sessions": sessions,
          "received": [m["type"] for m in peer.received]})
    peer.close()
    os.unlink(f"/dev/shm/{own_pool}")
    return 0


# --- a flood spread over many hosts and sessions ------------------------------------------------


def cmd_spread(a) -> int:
    """Sessions opened properly from many source addresses (pyzmq: libzmq's I/O thread does the
    socket work, so one process drives hundreds of sessions), each sending large lookups of
    keys the node lacks back to back: each answer is followed at once by the next lookup.
    `--window 0`: sessions only, idle (heartbeats answered by libzmq)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        # Two sockets per session, and libzmq's own.
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 65536)
    sessions = []  # (router, [dealers], identity)
    for h in range(a.hosts):
        host = f"127.0.{1 + h // 250}.{1 + h % 250}"
        for _ in range(a.sessions):
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(f"tcp://{host}:*")
            ident = router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit("/", 1)[1]
            dealers = []
            for c in range(a.conns):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.ROUTING_ID, ident.encode())
                d.setsockopt(zmq.SNDHWM, 100000)
                d.connect(f"tcp://{host}:0;{a.node}")
                dealers.append(d)
            sessions.append((router, dealers, ident))
    tcp = DummyTcp()
    poller = zmq.Poller()
    by_router = {}
    for i, (router, dealers, ident) in enumerate(sessions):
        meta = metadata(ident, None, None, tcp.addr, tcp.key)
        dealers[0].send(pack(connect_msg(ident, meta, a.num_blocks, a.block_len, a.hash_seed)))
        poller.register(router, zmq.POLLIN)
        by_router[router] = i
    keys = [(MISS_BASE + i).to_bytes(32, "big") + (0).to_bytes(4, "big") for i in range(a.keys)]
    acked = [False] * len(sessions)
    outstanding = [0] * len(sessions)
    turn = [0] * len(sessions)
    sent = answered = 0
    started = time.monotonic()
    end = started + a.duration
    flooding = False
    next_progress = started

    def lookup(i: int) -> None:
        nonlocal sent
        router, dealers, ident = sessions[i]
        turn[i] += 1
        msg = pack({"type": "lookup", "kv_request_id": f"spread-{i}-{turn[i]}", "keys": keys,
                    "round_seq": 0})
        dealers[turn[i] % len(dealers)].send(msg)
        # The request is ended at once: nothing of it is held after its answer.
        outstanding[i] += 1
        sent += 1

    while time.monotonic() < end:
        tcp.pump()
        if not flooding and all(acked):
            flooding = True
            emit({"event": "flooding", "at": time.time(), "answered": answered})
        if flooding and time.monotonic() >= next_progress:
            # Where the flood stands, once a second: how many of its lookups were answered.
            next_progress = time.monotonic() + 1.0
            emit({"event": "progress", "at": time.time(), "answered": answered})
        for sock, _ in poller.poll(100):
            i = by_router[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = unpack(frames[-1])
                t = msg.get("type") if isinstance(msg, dict) else None
                if t == "connect_ack" and not acked[i]:
                    acked[i] = True
                    sessions[i][1][0].send(pack({"type": "connect_ack",
                                                 "peer_id": sessions[i][2]}))
                    for _ in range(a.window):
                        lookup(i)
                elif t == "lookup_resp":
                    answered += 1
                    outstanding[i] -= 1
                    sessions[i][1][0].send(pack({"type": "abort_fetch",
                                                 "kv_request_id": msg.get("kv_request_id"),
                                                 "round_seq": 0}))
                    lookup(i)
    emit({"event": "summary", "sessions": len(sessions), "acked": sum(acked), "sent": sent,
          "answered": answered, "seconds": time.monotonic() - started})
    for router, dealers, _ in sessions:
        for d in dealers:
            d.close(linger=0)
        router.close(linger=0)
    ctx.term()
    return 0


def main() -> int:
    # SIGTERM ends us through SystemExit, so the pools we made are removed (atexit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s):
        s.add_argument("--bind", default="127.0.0.1:0", help="where our ROUTER listens")
        s.add_argument("--block-len", type=int, default=4096)
        s.add_argument("--num-blocks", type=int, default=64)
        s.add_argument("--hash-seed", default=default_seed())
        s.add_argument("--wait", type=float, default=5.0, help="bound on each wait, seconds")

    s = sub.add_parser("session")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--identity", help="the identity our DEALER claims ({port}: our ROUTER's)")
    s.add_argument("--source", help="source IP of our DEALER's connection")
    s.add_argument("--peer-id", help="connect.peer_id (default: the identity)")
    s.add_argument("--also-bind", help="a second ROUTER (a bystander peer)")
    s.add_argument("--peer-id-extra", action="store_true", help="connect names the bystander")
    s.add_argument("--shm", help="the shm object our metadata names")
    s.add_argument("--own-pool", action="store_true", help="make and name our own pool")
    s.add_argument("--shm-token", default="none",
                   help="none | random | from-object (read the named object's trailer) | hex")
    s.add_argument("--secret-blocks", type=int, help="blocks before the trailer to read")
    s.add_argument("--tcp-dummy", action="store_true", help="also advertise a tcp listener")
    s.add_argument("--tcp-host", help="advertise the tcp listener with its host spelled so")
    s.add_argument("--tcp-bind", default="127.0.0.1:0",
                   help="where the advertised tcp listener listens (HOST:PORT)")
    s.add_argument("--keys", default="", help="synthetic key indexes to look up and fetch")
    s.add_argument("--indexes", default="", help="block indexes our fetch names")
    s.add_argument("--linger", type=float, default=0.0)
    s.add_argument("--id-bytes", type=int, default=0,
                   help="pad the lookup's and fetch's request id with this many bytes")
    s.add_argument("--unknown-aborts", type=int, default=0,
                   help="abort_fetch this many unknown requests (ids as long) first")
    s.add_argument("--shrink-own-pool", action="store_true",
                   help="after the handshake, cut our own pool object to one page")

    s = sub.add_parser("auth")
    common(s)
    s.add_argument("--node-a", required=True)
    s.add_argument("--node-b", required=True)
    s.add_argument("--secret-file", required=True)

    s = sub.add_parser("producer")
    common(s)
    s.add_argument("--timeout", type=float, default=60.0)
    s.add_argument("--victim-pid-from-stdin", action="store_true",
                   help="read the victim's pid, to read its pool at its advertised base_addr")
    s.add_argument("--flood", type=int, default=0,
                   help="idle connections opened to the victim's data port before the write")

    s = sub.add_parser("flood")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--count", type=int, default=10000)
    s.add_argument("--spoofed", type=int, default=1000)

    s = sub.add_parser("connects")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--identity", required=True)
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--interval", type=float, default=0.03)

    s = sub.add_parser("cycles")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--count", type=int, default=200)
    s.add_argument("--protocol-errors", action="store_true")

    s = sub.add_parser("squat")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--identity", required=True)
    s.add_argument("--hold", type=float, default=3.0)
    s.add_argument("--after", type=float, default=3.0)

    s = sub.add_parser("sessions")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--count", type=int, default=40)
    s.add_argument("--duration", type=float, default=10.0)
    s.add_argument("--spellings", help="comma-separated spellings of our host, one per identity")

    s = sub.add_parser("impostor")
    common(s)
    s.add_argument("--listen", required=True, help="the address the real node will bind later")
    s.add_argument("--challenge", choices=["none", "random"], default="random",
                   help="what our READY gives the victim: no challenge, or one of ours")
    s.add_argument("--key", type=int, default=20, help="synthetic key fetched into the victim")
    s.add_argument("--index", type=int, default=63, help="the victim's block written")
    s = sub.add_parser("trickle")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--keys", default="0-63", help="synthetic key indexes to look up and fetch")
    s.add_argument("--reading", choices=["trickle", "full", "leave"], default="trickle",
                   help="leave: trickle, then end the session (disconnect) after --leave-after "
                        "seconds while the write runs, still reading the data connection")
    s.add_argument("--leave-after", type=float, default=0.5, help="seconds, with --reading leave")
    s.add_argument("--chunk", type=int, default=1024, help="bytes per read when trickling")
    s.add_argument("--every", type=float, default=0.02, help="pause between reads, seconds")
    s.add_argument("--rcvbuf", type=int, default=4096, help="our data socket's SO_RCVBUF")
    s.add_argument("--hold", type=float, default=20.0, help="longest we read, seconds")
    s = sub.add_parser("hoard")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--keys", default="0-63", help="synthetic key indexes each lookup names")
    s.add_argument("--rounds", type=int, default=1, help="lookups of those keys (none fetched)")
    s.add_argument("--huge", type=int, default=0, help="then one lookup of this many keys")
    s.add_argument("--huge-distinct", type=int, default=1 << 30,
                   help="key i of the huge lookup is synthetic key i modulo this")
    s.add_argument("--hold", type=float, default=0.0, help="seconds to stay connected after")

    s = sub.add_parser("spread")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--hosts", type=int, default=120, help="source addresses, 127.0.1.1 on")
    s.add_argument("--sessions", type=int, default=1, help="sessions per host")
    s.add_argument("--conns", type=int, default=1, help="connections per session")
    s.add_argument("--keys", type=int, default=8192, help="keys per lookup")
    s.add_argument("--window", type=int, default=1, help="lookups outstanding per session")
    s.add_argument("--duration", type=float, default=30.0)

    s = sub.add_parser("redial")
    common(s)
    s.add_argument("--node", required=True)
    s.add_argument("--keys", default="0-7", help="synthetic key indexes to look up and fetch")
    s.add_argument("--sessions", type=int, default=3)
    s.add_argument("--gap", type=float, default=0.5,
                   help="seconds between closing our DEALER and dialing again")

    a = p.parse_args()
    return {"session": cmd_session, "auth": cmd_auth, "producer": cmd_producer,
            "flood": cmd_flood, "connects": cmd_connects, "squat": cmd_squat,
            "impostor": cmd_impostor, "sessions": cmd_sessions, "cycles": cmd_cycles,
            "trickle": cmd_trickle, "hoard": cmd_hoard, "spread": cmd_spread,
            "redial": cmd_redial}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
