"""ZMTP 3 over a plain socket, for the hostile peers (attacker.py): what pyzmq hides.

A kvpeer node's ROUTER gives every connection a fresh challenge in its READY
(`X-Kvpeer-Challenge`, crates/kvpeer-net/src/zmtp.rs), and a peer's proofs in `connect` are made
for it. pyzmq cannot show a DEALER the READY it got, so the attacker speaks ZMTP itself here:
`RawDealer` (connect, greeting and READY both ways, the peer's properties, one-frame messages,
PONG for every PING) and `RawRouter` (a listener that plays a node: accepts DEALERs, gives a
challenge of its choosing, reads their messages). NULL mechanism only; every wait is bounded.
"""

from __future__ import annotations

import select
import socket
import struct
import time

CHALLENGE = "X-Kvpeer-Challenge"


def greeting() -> bytes:
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def frame(body: bytes, command: bool = False, more: bool = False) -> bytes:
    flags = (0x04 if command else 0) | (0x01 if more else 0)
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def command(name: bytes, data: bytes) -> bytes:
    return frame(bytes([len(name)]) + name + data, command=True)


def ready(props: list[tuple[str, bytes]]) -> bytes:
    data = b""
    for k, v in props:
        data += bytes([len(k)]) + k.encode() + struct.pack(">I", len(v)) + v
    return command(b"READY", data)


def parse_props(data: bytes) -> dict[str, bytes]:
    out, i = {}, 0
    while i < len(data):
        n = data[i]
        k = data[i + 1:i + 1 + n].decode(errors="replace")
        i += 1 + n
        (vl,) = struct.unpack(">I", data[i:i + 4])
        out[k] = data[i + 4:i + 4 + vl]
        i += 4 + vl
    return out


class Stream:
    """One ZMTP connection: a socket and the bytes read so far."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.greeted = False
        self.props: dict[str, bytes] | None = None
        self.messages: list[bytes] = []
        self.parts: list[bytes] = []
        self.closed = False
        self.error: str | None = None  # the reason of a ZMTP ERROR the peer sent

    def _pump_once(self, timeout: float) -> None:
        if self.closed:
            return
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not r:
            return
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.closed = True
            return
        if not data:
            self.closed = True
            return
        self.buf += data
        self._parse()

    def _parse(self) -> None:
        if not self.greeted:
            if len(self.buf) < 64:
                return
            self.buf, self.greeted = self.buf[64:], True
        while self.buf:
            flags = self.buf[0]
            if flags & 0x02:
                if len(self.buf) < 9:
                    return
                (size,) = struct.unpack(">Q", self.buf[1:9])
                head = 9
            else:
                if len(self.buf) < 2:
                    return
                size, head = self.buf[1], 2
            if len(self.buf) < head + size:
                return
            body, self.buf = self.buf[head:head + size], self.buf[head + size:]
            if flags & 0x04:
                n = body[0]
                name, data = body[1:1 + n], body[1 + n:]
                if name == b"READY":
                    self.props = parse_props(data)
                elif name == b"ERROR" and data:
                    self.error = data[1:1 + data[0]].decode(errors="replace")
                elif name == b"PING":
                    self.send_raw(command(b"PONG", data[2:]))
                continue
            self.parts.append(body)
            if not flags & 0x01:
                if len(self.parts) == 1:
                    self.messages.append(self.parts[0])
                else:
                    self.messages.append(b"".join(self.parts[1:]) if self.parts[0] == b""
                                         else self.parts[-1])
                self.parts = []

    def pump(self, timeout: float = 0.0) -> None:
        """Reads what arrives within `timeout` (answering PINGs)."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump_once(deadline - time.monotonic())
            if time.monotonic() >= deadline or self.closed:
                return

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.props is None and not self.closed and time.monotonic() < deadline:
            self._pump_once(deadline - time.monotonic())
        return self.props is not None

    def send_raw(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.closed = True

    def close(self, linger: int = 0) -> None:
        """Closes the socket; `linger` (ms, pyzmq's name) is ignored: writes are synchronous."""
        del linger
        try:
            self.sock.close()
        except OSError:
            pass
        self.closed = True


class RawDealer(Stream):
    """A DEALER to `node` ("host:port") claiming `identity`, optionally from `source`."""

    def __init__(self, node: str, identity: str, source: str | None = None,
                 timeout: float = 5.0) -> None:
        host, port = node.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source:
            sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect((host, int(port)))
        sock.settimeout(None)
        sock.setblocking(True)
        super().__init__(sock)
        self.send_raw(greeting() + ready([("Socket-Type", b"DEALER"),
                                          ("Identity", identity.encode())]))
        self.wait_ready(timeout)

    def challenge(self) -> bytes | None:
        """The challenge the node's READY gave this connection (None: it gave none)."""
        return (self.props or {}).get(CHALLENGE)

    def send(self, payload: bytes) -> None:
        self.send_raw(frame(payload))


class RawRouter:
    """A listener playing a node's ROUTER at `addr`, giving each connection `challenge`."""

    def __init__(self, addr: str, challenge: bytes | None) -> None:
        host, port = addr.rsplit(":", 1)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, int(port)))
        self.listener.listen(16)
        self.challenge = challenge
        self.conns: list[Stream] = []

    def accept(self, timeout: float) -> Stream | None:
        r, _, _ = select.select([self.listener], [], [], timeout)
        if not r:
            return None
        sock, _ = self.listener.accept()
        s = Stream(sock)
        props = [("Socket-Type", b"ROUTER")]
        if self.challenge is not None:
            props.append((CHALLENGE, self.challenge))
        s.send_raw(greeting() + ready(props))
        self.conns.append(s)
        return s

    def close_listener(self) -> None:
        self.listener.close()
