#!/usr/bin/env python3
"""Generates fresh wire vectors with msgspec, the encoder vLLM uses, from random values.

Writes a file in the format of ../shared/vectors/wire-vectors.json: valid messages of all nine
types (sizes around every msgpack length boundary, u64 addresses, unicode ids, unknown fields,
reordered fields, absent fingerprint) and every class of bad payload (undecodable, ignored,
protocol error), each labelled with the outcome it must get. The kvpeer vector tests then run
on it (KVPEER_VECTORS=<file>), so the codec is checked against the rules, not against one fixed
set of cases.

Usage: gen_vectors.py OUT.json [--seed N] [--per-kind K]
"""

import argparse
import json
import os
import random

import msgspec

enc = msgspec.msgpack.encode


def key(rng):
    return rng.randbytes(32) + rng.randrange(0, 8).to_bytes(4, "big")


def req_id(rng):
    kind = rng.randrange(4)
    if kind == 0:
        return "req-" + rng.randbytes(8).hex()
    if kind == 1:
        return "r" * rng.choice([0, 1, 31, 32, 255, 256, 65535, 65536, 70000])
    if kind == 2:
        return "req-é-🚀-" + rng.randbytes(4).hex()
    return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 40)))


def count(rng):
    return rng.choice([0, 1, 2, 15, 16, 17, 255, 256, rng.randrange(0, 700)])


def uint(rng):
    return rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                       2**63 - 1, 2**63, 2**64 - 1, rng.randrange(0, 2**64)])


def connect(rng, fingerprint=True):
    m = {
        "type": "connect",
        "peer_id": f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(5710, 5720)}",
        "agent_metadata": rng.randbytes(rng.choice([0, 1, 255, 256, rng.randrange(0, 400)])),
        "base_addr": uint(rng),
        "num_blocks": max(1, uint(rng)),
        "block_len": rng.choice([1, 16384, 65536, 2**21, max(1, uint(rng))]),
    }
    if fingerprint:
        m["config_fingerprint"] = rng.choice(["", rng.randbytes(8).hex()])
    m["hash_seed"] = rng.choice(["42", "0", "vllm-none-hash", rng.randbytes(32).hex()])
    return m


def valid_messages(rng):
    n = count(rng)
    keys = [key(rng) for _ in range(n)]
    rid = req_id(rng)
    rs = rng.choice([0, 1, 4, 127, 128, uint(rng)])
    yield "connect", connect(rng), True
    yield "connect_without_fingerprint", connect(rng, fingerprint=False), False
    yield "connect_ack", {"type": "connect_ack", "peer_id": f"127.0.0.1:{rng.randrange(1, 65536)}"}, True
    yield "disconnect", {"type": "disconnect"}, True
    yield "lookup", {"type": "lookup", "kv_request_id": rid, "keys": keys, "round_seq": rs}, True
    dup = keys + keys[: rng.randrange(0, n + 1)]
    yield "lookup_resp", {"type": "lookup_resp", "kv_request_id": rid, "keys": dup,
                          "hits": [rng.random() < 0.5 for _ in dup]}, True
    idx = [rng.choice([0, 13, 127, 128, 65536, rng.randrange(0, 2**31)]) for _ in keys]
    yield "fetch", {"type": "fetch", "kv_request_id": rid, "keys": keys, "block_indexes": idx,
                    "round_seq": rs}, True
    yield "fetch_terminal_empty", {"type": "fetch", "kv_request_id": rid, "keys": [],
                                   "block_indexes": [], "round_seq": rs}, True
    yield "transfer_done", {"type": "transfer_done", "kv_request_id": rid,
                            "success": rng.random() < 0.5, "round_seq": rs}, True
    yield "abort_fetch", {"type": "abort_fetch", "kv_request_id": rid, "round_seq": rs}, True
    yield "abort_ack", {"type": "abort_ack", "kv_request_id": rid, "round_seq": rs}, True
    extra = {"type": "fetch", "kv_request_id": rid, "keys": keys[:2], "block_indexes": idx[:2],
             "round_seq": 0, "trace_id": rng.randbytes(4).hex(),
             "x": [rng.randrange(-1000, 1000), {"y": None, "z": rng.random()}, b"\x00\x01"]}
    yield "fetch_extra_field", extra, False
    td = {"type": "transfer_done", "kv_request_id": rid, "success": True, "round_seq": rs}
    items = list(td.items())
    rng.shuffle(items)
    yield "transfer_done_reordered_keys", dict(items), False


def as_json(v):
    if isinstance(v, bytes):
        return {"$bin": v.hex()}
    if isinstance(v, list):
        return [as_json(x) for x in v]
    if isinstance(v, dict):
        return {k: as_json(x) for k, x in v.items()}
    return v


def bad_payloads(rng):
    good = enc({"type": "fetch", "kv_request_id": req_id(rng), "keys": [key(rng)],
                "block_indexes": [3], "round_seq": 0})
    yield "empty_payload", "undecodable", b""
    yield "truncated", "undecodable", good[: rng.randrange(1, len(good))]
    yield "trailing_bytes", "undecodable", good + rng.randbytes(rng.randrange(1, 5))
    yield "reserved_byte_c1", "undecodable", b"\xc1" + rng.randbytes(rng.randrange(0, 3))
    yield "bin32_claims_4gib", "undecodable", b"\x81\xa4type\xc6" + rng.randrange(64, 2**32).to_bytes(4, "big")
    yield "str32_claims", "undecodable", b"\x81\xa4type\xdb" + rng.randrange(64, 2**32).to_bytes(4, "big")
    yield "array32_claims_items", "undecodable", b"\xdd" + rng.randrange(16, 2**32).to_bytes(4, "big")
    yield "map32_claims_entries", "undecodable", b"\xdf" + rng.randrange(16, 2**32).to_bytes(4, "big")
    bad_utf8 = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82"])
    yield "invalid_utf8_str", "undecodable", b"\x81\xa4type" + bytes([0xa0 | len(bad_utf8)]) + bad_utf8
    depth = rng.randrange(1000, 100_001)
    yield "deep_nesting", "undecodable", b"\x91" * depth + b"\xc0"

    yield "array_payload", "ignored", enc([rng.randrange(100) for _ in range(rng.randrange(0, 5))])
    yield "int_payload", "ignored", enc(rng.randrange(-100, 100))
    yield "map_without_type", "ignored", enc({"kv_request_id": req_id(rng)})
    yield "unknown_type", "ignored", enc({"type": rng.choice(["hello", "Fetch", "fetch ", "ping"]),
                                          "kv_request_id": "x"})
    yield "int_type", "ignored", enc({"type": rng.randrange(0, 1000)})
    yield "int_map_key", "ignored", enc({rng.randrange(0, 100): rng.randrange(0, 100)})

    rid = req_id(rng)
    k = key(rng)

    def fetch(**over):
        m = {"type": "fetch", "kv_request_id": rid, "keys": [k], "block_indexes": [3], "round_seq": 0}
        m.update(over)
        return {a: b for a, b in m.items() if b is not MISSING}

    def conn(**over):
        m = connect(rng)
        m.update(over)
        return {a: b for a, b in m.items() if b is not MISSING}

    pe = "protocol_error"
    yield "fetch_length_mismatch", pe, enc(fetch(keys=[k, k], block_indexes=[1]))
    yield "fetch_negative_index", pe, enc(fetch(block_indexes=[-rng.randrange(1, 2**31)]))
    yield "fetch_index_not_int", pe, enc(fetch(block_indexes=[rng.choice(["1", 1.5, None, b"\x01"])]))
    yield "fetch_missing_round_seq", pe, enc(fetch(round_seq=MISSING))
    yield "fetch_negative_round_seq", pe, enc(fetch(round_seq=-rng.randrange(1, 2**40)))
    yield "fetch_indexes_not_list", pe, enc(fetch(block_indexes=rng.choice([3, "3", {"a": 1}])))
    yield "fetch_request_id_not_str", pe, enc(fetch(kv_request_id=rng.choice([12, None, b"r", [1]])))
    yield "lookup_keys_not_list", pe, enc({"type": "lookup", "kv_request_id": rid, "keys": k, "round_seq": 0})
    yield "lookup_missing_round_seq", pe, enc({"type": "lookup", "kv_request_id": rid, "keys": []})
    yield "lookup_resp_hit_not_bool", pe, enc({"type": "lookup_resp", "kv_request_id": rid,
                                               "keys": [k], "hits": [rng.choice([1, 0, "true", None])]})
    yield "lookup_resp_length_mismatch", pe, enc({"type": "lookup_resp", "kv_request_id": rid,
                                                  "keys": [k], "hits": []})
    yield "transfer_done_missing_request_id", pe, enc({"type": "transfer_done", "success": True, "round_seq": 0})
    yield "transfer_done_success_not_bool", pe, enc({"type": "transfer_done", "kv_request_id": rid,
                                                     "success": rng.choice([1, 0, "yes"]), "round_seq": 0})
    yield "abort_fetch_round_seq_str", pe, enc({"type": "abort_fetch", "kv_request_id": rid,
                                                "round_seq": str(rng.randrange(10))})
    yield "abort_ack_missing_round_seq", pe, enc({"type": "abort_ack", "kv_request_id": rid})
    yield "connect_ack_missing_peer_id", pe, enc({"type": "connect_ack"})
    yield "connect_zero_blocks", pe, enc(conn(num_blocks=0))
    yield "connect_negative_block_len", pe, enc(conn(block_len=rng.choice([0, -1, -16384])))
    yield "connect_negative_base_addr", pe, enc(conn(base_addr=-rng.randrange(1, 2**63)))
    yield "connect_metadata_str", pe, enc(conn(agent_metadata="text"))
    yield "connect_missing_hash_seed", pe, enc(conn(hash_seed=MISSING))
    yield "connect_peer_id_nil", pe, enc(conn(peer_id=None))
    yield "round_seq_bool", pe, enc({"type": "abort_fetch", "kv_request_id": rid,
                                     "round_seq": rng.choice([True, False])})
    yield "lookup_key_not_bin", pe, enc({"type": "lookup", "kv_request_id": rid,
                                         "keys": [rng.choice([5, 0, "abc"])], "round_seq": 0})


MISSING = object()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--per-kind", type=int, default=5)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    vectors = []
    for i in range(args.per_kind):
        for name, msg, roundtrip in valid_messages(rng):
            payload = enc(msg)
            # The generator's own check: msgspec reads back what it wrote.
            assert msgspec.msgpack.decode(payload) == msg
            vectors.append({"name": f"{name}_{i}", "expect": "valid", "roundtrip": roundtrip,
                            "message": as_json(msg), "msgpack_hex": payload.hex(), "note": ""})
        for name, expect, payload in bad_payloads(rng):
            if expect == "undecodable" and name != "deep_nesting":
                try:
                    msgspec.msgpack.decode(payload)
                    raise AssertionError(f"msgspec decodes {name}")
                except msgspec.DecodeError:
                    pass
            vectors.append({"name": f"{name}_{i}", "expect": expect, "msgpack_hex": payload.hex(),
                            "note": ""})
    with open(args.out, "w") as f:
        json.dump({"format": f"generated by gen_vectors.py, seed {seed}",
                   "expect_values": {}, "vectors": vectors}, f)
    print(f"wrote {len(vectors)} vectors to {args.out} (seed {seed})")


if __name__ == "__main__":
    main()
