#!/usr/bin/env bash
# Seeds the fuzz corpora with the payloads of ../shared/vectors/wire-vectors.json, and the
# zmtp_decode corpus with control-channel byte streams built here (the corpus is not committed:
# it is made at run time).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
vectors=${KVPEER_VECTORS:-$here/../../shared/vectors/wire-vectors.json}
for target in decode decode_value json_roundtrip; do
  mkdir -p "$here/corpus/$target"
  python3 - "$vectors" "$here/corpus/$target" <<'PY'
import json, sys, pathlib
vectors, out = sys.argv[1], pathlib.Path(sys.argv[2])
for v in json.load(open(vectors))["vectors"]:
    (out / f"vector-{v['name']}").write_bytes(bytes.fromhex(v["msgpack_hex"]))
PY
done
echo "seeded $(ls "$here/corpus/decode" | wc -l) payloads per target"

# zmtp_decode: control-channel and KV event stream byte streams (first byte: the read size),
# every side's opening, heartbeats, short and long frames, multipart, subscriptions, replay
# requests and answers, a 1 TiB header, ZMTP 2.0 and foreign bytes.
mkdir -p "$here/corpus/zmtp_decode"
python3 - "$here/corpus/zmtp_decode" <<'PY'
import struct, sys, pathlib
out = pathlib.Path(sys.argv[1])
def greeting(major=3, minor=1):
    return bytes([0xFF] + [0] * 8 + [0x7F, major, minor]) + b"NULL".ljust(20, b"\0") + b"\0" * 32
def command(name, data=b""):
    body = bytes([len(name)]) + name + data
    return bytes([0x04, len(body)]) + body if len(body) < 256 else bytes([0x06]) + struct.pack(">Q", len(body)) + body
def ready(socket_type, identity=None):
    props = [(b"Socket-Type", socket_type)] + ([(b"Identity", identity)] if identity else [])
    return command(b"READY", b"".join(bytes([len(k)]) + k + struct.pack(">I", len(v)) + v for k, v in props))
def frame(body, more=False):
    flags = 0x01 if more else 0
    if len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body
seeds = {
    "dealer-session": greeting() + ready(b"DEALER", b"127.0.0.1:5600") + command(b"PING", b"\0\x64")
        + frame(b"\x81\xa4type\xaadisconnect") + frame(bytes(range(256)) + b"long"),
    "router-challenge": greeting() + command(b"READY", b"".join(bytes([len(k)]) + k
        + struct.pack(">I", len(v)) + v for k, v in [(b"Socket-Type", b"ROUTER"),
        (b"X-Kvpeer-Challenge", bytes(range(16)))])) + command(b"PING", b"\0\x64") + frame(b"m"),
    "router-session": greeting(3, 0) + ready(b"ROUTER") + command(b"PING", b"\0\x64ctx")
        + command(b"PONG", b"ctx") + frame(b"to a dealer"),
    "multipart": greeting() + ready(b"ROUTER") + frame(b"a", True) + frame(b"", True) + frame(b"bc"),
    "one-tib-header": greeting() + ready(b"ROUTER") + b"\x02" + struct.pack(">Q", 1 << 40) + b"\0" * 64,
    "zmtp-2": bytes([0xFF] + [0] * 8 + [0x7F, 1, 5]),
    "http": b"GET / HTTP/1.1\r\n\r\n",
    # The KV event stream: a PUB's batches to a SUB, a SUB's subscriptions (both forms) to a
    # PUB, a DEALER's replay request to a ROUTER and the ROUTER's answer.
    "pub-to-sub": greeting() + ready(b"PUB") + frame(b"kv@a", True)
        + frame(struct.pack(">Q", 7), True) + frame(b"\x93\xcb" + b"\0" * 8 + b"\x90\x00"),
    "sub-to-pub": greeting() + ready(b"SUB") + command(b"SUBSCRIBE", b"kv@") + frame(b"\x01kv@b")
        + command(b"CANCEL", b"kv@") + frame(b"\x00kv@b"),
    "dealer-replay": greeting() + ready(b"DEALER", b"") + frame(b"", True)
        + frame(struct.pack(">Q", 0)),
    "router-answer": greeting() + ready(b"ROUTER") + frame(b"", True) + frame(b"t", True)
        + frame(struct.pack(">Q", 3), True) + frame(b"p") + frame(b"", True) + frame(b"", True)
        + frame(b"\xff" * 8, True) + frame(b""),
}
for name, stream in seeds.items():
    for cut in (1, 7, 63):
        (out / f"{name}-{cut}").write_bytes(bytes([cut]) + stream)
PY
echo "seeded $(ls "$here/corpus/zmtp_decode" | wc -l) ZMTP streams"
