"""kvpeer's vLLM tier (`kvpeer.vllm.KvpeerTier`, loaded by vLLM's SecondaryTierFactory through
`module_path`) inside vLLM 0.33's real TieringOffloadingManager:

* two KvpeerTier engines move blocks both ways, byte-exact, on tcp and on nixl: symmetric
  rounds (RETRY, then HIT), partial prefixes, PD roles;
* the mixed fleet: KvpeerTier and vLLM's stock P2PSecondaryTierManager (NixlTransport), each
  as producer and as consumer;
* failures: a peer gone mid-load (the job fails, the slots are freed, nothing stays pinned), a
  peer refused by the allowlist (and an allowed one served byte-exact), mismatched block
  length and hash seed, bad config keys, drain_jobs with loads in flight, shutdown with peers
  connected.

Every wait is a bounded `drive` loop; ports are picked free.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvpeer
import kvpeer.vllm as kvpeer_vllm
from harness import (
    Engine,
    LookupResult,
    drive,
    free_port,
    make_key,
    open_stock_session,
    stop_process,
)

NUM_CHUNKS = 16
BLOCK_LEN = 4096
TIMEOUT_S = 10.0


def kvpeer_tier(plane: str = "tcp", **extra) -> dict:
    return {
        "type": "KvpeerTier",
        "module_path": "kvpeer.vllm",
        "host": "127.0.0.1",
        "port": free_port(),
        "plane": plane,
        **extra,
    }


def stock_tier() -> dict:
    return {"type": "p2p", "host": "127.0.0.1", "port": free_port()}


def random_blocks(n: int, seed: int, block_len: int = BLOCK_LEN) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(block_len) for _ in range(n)]


def produce(a: Engine, keys, blocks, kv_transfer_params=None, req_id="a-req") -> None:
    """A computes the blocks: offloads them to its CPU tier."""
    req = a.new_request(req_id, kv_transfer_params)
    assert a.put(keys, blocks, req) == keys
    a.finish(req)
    a.step()


def source(a: Engine, kv_request_id: str = "kv-1", role: str = "remote_kv_source") -> dict:
    return {
        role: {
            "kv_request_id": kv_request_id,
            "remote_host": "127.0.0.1",
            "remote_port": a.port,
        }
    }


def wait_lookup(engines_, b: Engine, keys, req) -> tuple[int, list[tuple[str, ...]]]:
    answers: list[tuple[str, ...]] = []
    hits: list[int] = []

    source = (req.kv_transfer_params or {}).get("remote_kv_source")
    if source:
        open_stock_session(engines_, b, source["remote_port"])

    def resolved() -> bool:
        n = b.lookup(keys, req)
        answers.append(tuple(r.name for r in b.last_lookup))
        if n is not None:
            hits.append(n)
        return n is not None

    drive(engines_, resolved, timeout_s=TIMEOUT_S)
    return hits[0], answers


def settle(*engines_: Engine) -> None:
    drive(
        list(engines_),
        lambda: all(e.jobs_in_flight() == 0 for e in engines_),
        timeout_s=TIMEOUT_S,
    )


def planes() -> list:
    return ["tcp", "nixl"]


def test_the_package_has_the_nixl_plane():
    """The nixl cases below (and the mixed fleet with the stock tier) need the package built
    with the nixl plane, as scripts/test.sh installs it: without it they fail, never skip."""
    assert kvpeer.NIXL_BUILT, (
        'kvpeer was built without the nixl plane: MATURIN_PEP517_ARGS="--features nixl" '
        "pip install . (scripts/test.sh does)"
    )


def pull(a: Engine, b: Engine, keys, blocks, kv_request_id="kv-1") -> list[tuple[str, ...]]:
    """B pulls `keys` from A (symmetric P2P) and checks every byte."""
    req = b.new_request(f"b-{kv_request_id}", source(a, kv_request_id))
    hits, answers = wait_lookup([a, b], b, keys, req)
    assert hits == len(keys), answers
    assert [b.read(k) for k in keys] == blocks
    assert b.load(keys, req) == blocks
    b.finish(req)
    settle(a, b)
    assert [a.pins(k) for k in keys] == [0] * len(keys)
    assert [b.pins(k) for k in keys] == [0] * len(keys)
    return answers


@pytest.mark.parametrize(
    ("plane", "poll_s", "io_thread"),
    [
        ("tcp", 0, True),
        ("tcp", 0.001, True),
        ("shm", 0, True),
        ("both", 0, True),
        ("nixl", 0, True),
        ("tcp", 0, False),
        ("shm", 0, False),
        ("nixl", 0, False),
    ],
    ids=[
        "tcp-stepped", "tcp-tier-poll-thread", "shm-stepped", "both-stepped", "nixl-stepped",
        "tcp-io-inline", "shm-io-inline", "nixl-io-inline",
    ],
)
def test_two_kvpeer_tiers_exchange_blocks_both_ways(engines, plane, poll_s, io_thread):
    """With poll_s > 0 vLLM's tier-poll thread also calls the tier between steps
    (tolerates_off_thread_polling), under the manager's lock. On shm (and both, which picks
    shm on one host) the primary memory is a /dev/shm file, as vLLM maps it. `io_thread`
    false: the node's I/O runs in the engine's own calls, not on its thread."""
    shm = plane in ("shm", "both")
    a = engines(
        kvpeer_tier(plane, io_thread=io_thread), NUM_CHUNKS, BLOCK_LEN,
        engine_id=f"A-{plane}-{os.getpid()}", tier_poll_interval_s=poll_s, shm_region=shm,
    )
    b = engines(
        kvpeer_tier(plane, io_thread=io_thread), NUM_CHUNKS, BLOCK_LEN,
        engine_id=f"B-{plane}-{os.getpid()}", tier_poll_interval_s=poll_s, shm_region=shm,
    )
    assert type(a.tier).__name__ == "KvpeerTier" and a.tier.plane == plane
    assert (a.tier._tier.io_thread, b.tier._tier.io_thread) == (io_thread, io_thread)
    if shm:
        # vLLM's file, grown by kvpeer's trailer page (the shm plane's ownership proof).
        assert os.path.getsize(a.region.path) == NUM_CHUNKS * BLOCK_LEN + 4096
    keys_a = [make_key(f"a-{i}") for i in range(6)]
    keys_b = [make_key(f"b-{i}") for i in range(5)]
    blocks_a, blocks_b = random_blocks(6, 1), random_blocks(5, 2)
    produce(a, keys_a, blocks_a)
    produce(b, keys_b, blocks_b, req_id="b-own")
    answers = pull(a, b, keys_a, blocks_a, "kv-ab")
    # Rounds as the stock tier: RETRY while the peer is asked, then the promotion, then HIT.
    assert answers[0] == ("RETRY",) * len(keys_a) and answers[-1] == ("HIT",) * len(keys_a)
    pull(b, a, keys_b, blocks_b, "kv-ba")
    # vLLM's metrics: what each side asked, loaded and served, through get_stats.
    with b._scope():
        counted = b.tier.get_stats().reduce()
    assert counted["vllm:kv_offload_kvpeer_lookup_keys"] == len(keys_a), counted
    assert counted["vllm:kv_offload_kvpeer_loaded_blocks"] == len(keys_a), counted
    assert counted["vllm:kv_offload_kvpeer_served_blocks"] == len(keys_b), counted
    assert set(type(b.tier).build_metric_definitions({})) >= set(counted)
    # The time vLLM's threads spent in the tier's methods: reported by whole milliseconds,
    # the rest kept for the next report.
    busy_ns = counted.get("vllm:kv_offload_kvpeer_busy_us", 0) * 1000 + b.tier._busy_ns
    assert busy_ns > 0, counted
    # A second request for blocks B now holds locally needs no peer.
    req = b.new_request("b-again", source(a, "kv-again"))
    assert b.lookup(keys_a, req) == len(keys_a)
    b.finish(req)


@pytest.mark.parametrize("io_thread", [True, False], ids=["io-thread", "io-inline"])
@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_a_producer_engine_between_steps_serves_the_fetch_only_with_its_io_thread(
    engines, plane, io_thread
):
    """A busy producer engine steps rarely (a long forward pass). Its answers to a consumer's
    lookups need vLLM (its step), but the consumer's fetch of the blocks it pinned does not:
    the node's I/O thread serves it while the engine does not step at all, and the consumer
    loads byte-exact. With the I/O on the engine's thread (`io_thread` false) nothing reads the
    fetch until the producer's next step."""
    shm = plane == "shm"
    a = engines(kvpeer_tier(plane, io_thread=io_thread), NUM_CHUNKS, BLOCK_LEN,
                engine_id=f"A-busy-{plane}-{io_thread}-{os.getpid()}", shm_region=shm)
    b = engines(kvpeer_tier(plane), NUM_CHUNKS, BLOCK_LEN,
                engine_id=f"B-busy-{plane}-{io_thread}-{os.getpid()}", shm_region=shm)
    keys = [make_key(f"busy-{i}") for i in range(6)]
    blocks = random_blocks(6, 11)
    produce(a, keys, blocks)
    req = b.new_request("b-busy", source(a, "kv-busy"))

    def answered() -> bool:
        # A answers (and pins) at its steps; B's lookup call then starts the promotion.
        b.lookup(keys, req)
        return all(r is not LookupResult.RETRY for r in b.last_lookup)

    drive([a, b], answered, timeout_s=TIMEOUT_S)
    assert b.last_lookup == [LookupResult.HIT_PENDING] * len(keys), b.last_lookup
    # From here on A's engine does not step: B's fetch leaves at B's next step.
    loaded = lambda: b.lookup(keys, req) == len(keys)  # noqa: E731
    if io_thread:
        drive([b], loaded, timeout_s=TIMEOUT_S)
        assert [b.read(k) for k in keys] == blocks
    else:
        with pytest.raises(TimeoutError):
            drive([b], loaded, timeout_s=1.0)
        assert a.tier._tier.stats()["fetches_served"] == 0
        drive([a, b], loaded, timeout_s=TIMEOUT_S)
        assert [b.read(k) for k in keys] == blocks
    b.finish(req)
    settle(a, b)
    assert [a.pins(k) for k in keys] == [0] * len(keys)


@pytest.mark.parametrize("plane", planes() + ["shm"])
def test_partial_prefix_and_pd_roles(engines, plane):
    shm = plane == "shm"
    a = engines(kvpeer_tier(plane), NUM_CHUNKS, BLOCK_LEN, engine_id=f"A-pp-{plane}-{os.getpid()}", shm_region=shm)
    b = engines(kvpeer_tier(plane), NUM_CHUNKS, BLOCK_LEN, engine_id=f"B-pp-{plane}-{os.getpid()}", shm_region=shm)
    keys = [make_key(f"part-{i}") for i in range(5)]
    blocks = random_blocks(3, 3)
    produce(a, keys[:3], blocks)
    req = b.new_request("b-part", source(a, "kv-part"))
    hits, answers = wait_lookup([a, b], b, keys, req)
    assert hits == 3, answers
    assert answers[-1] == ("HIT", "HIT", "HIT", "MISS"), answers
    assert [b.read(k) for k in keys[:3]] == blocks and b.read(keys[3]) is None
    b.finish(req)
    settle(a, b)

    # PD: A prefills for decoder B (REQUEST_LEVEL, parked until B fetches); B trusts A.
    pd_keys = [make_key(f"pd-{i}") for i in range(4)]
    pd_blocks = random_blocks(4, 4)
    producer = a.new_request("a-pd", {"remote_decoder": {"kv_request_id": "kv-pd"}})
    assert a.policy(producer).name == "REQUEST_LEVEL"
    assert a.put(pd_keys, pd_blocks, producer) == pd_keys
    a.finish(producer)
    a.step()
    req = b.new_request("b-pd", source(a, "kv-pd", role="remote_prefiller"))
    hits, answers = wait_lookup([a, b], b, pd_keys, req)
    assert hits == len(pd_keys), answers
    assert answers[0] == ("HIT_PENDING",) * len(pd_keys), answers
    assert [b.read(k) for k in pd_keys] == pd_blocks
    b.finish(req)
    settle(a, b)
    assert [a.pins(k) for k in pd_keys] == [0] * len(pd_keys)


@pytest.mark.parametrize("kvpeer_produces", [True, False], ids=["kvpeer-to-stock", "stock-to-kvpeer"])
def test_mixed_fleet_with_the_stock_p2p_tier(engines, kvpeer_produces):
    ours = engines(kvpeer_tier("auto"), NUM_CHUNKS, BLOCK_LEN, engine_id="K")
    stock = engines(stock_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="S")
    assert ours.tier.plane == "nixl", "auto picks nixl when NIXL is installed"
    assert type(stock.tier).__name__ == "P2PSecondaryTierManager"
    a, b = (ours, stock) if kvpeer_produces else (stock, ours)
    keys = [make_key(f"mix-{i}") for i in range(6)]
    blocks = random_blocks(len(keys), 5)
    produce(a, keys, blocks)
    pull(a, b, keys, blocks, "kv-mix")
    # And the other way on the same pair of engines (the session both ways).
    back_keys = [make_key(f"back-{i}") for i in range(3)]
    back_blocks = random_blocks(3, 6)
    produce(b, back_keys, back_blocks, req_id="b-own")
    pull(b, a, back_keys, back_blocks, "kv-back")


@pytest.mark.parametrize(
    "b_kwargs",
    [{"hash_seed": "another-seed"}, {"block_len": 2 * BLOCK_LEN}],
    ids=["hash-seed", "block-len"],
)
def test_mismatched_peer_is_a_miss(engines, b_kwargs):
    block_len = b_kwargs.get("block_len", BLOCK_LEN)
    a = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="A")
    b = engines(
        kvpeer_tier(),
        NUM_CHUNKS,
        block_len,
        engine_id="B",
        **{k: v for k, v in b_kwargs.items() if k != "block_len"},
    )
    keys = [make_key(f"mm-{i}") for i in range(3)]
    produce(a, keys, random_blocks(3, 7))
    req = b.new_request("b-mm", source(a, "kv-mm"))
    hits, answers = wait_lookup([a, b], b, keys, req)
    assert hits == 0, answers
    assert [b.read(k) for k in keys] == [None] * 3
    b.finish(req)
    assert a.tier.node_stats()["lookups_served"] == 0


def test_a_hash_seed_drawn_after_the_tiers_are_built_is_the_one_sessions_use(engines):
    """vLLM draws its NONE_HASH seed after it builds the tiers: B is built while the seed is
    still vLLM's default, then draws A's. Its first session must carry the drawn seed (read
    through vLLM's public getter before a session opens), or A would refuse it as a mismatch."""
    a = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="A", hash_seed="drawn-late")
    b = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="B")
    assert b.hash_seed is None
    b.spec.hash_seed = "drawn-late"
    keys = [make_key(f"late-seed-{i}") for i in range(3)]
    blocks = random_blocks(3, 11)
    produce(a, keys, blocks)
    pull(a, b, keys, blocks, "kv-late-seed")


def test_allowlist_refuses_a_peer_and_serves_the_allowed_one(engines):
    """A allows 127.0.0.1 only (any port): the intruder on 127.0.0.2 (also loopback) is refused
    before its messages reach the protocol, and a peer on 127.0.0.1 is served byte-exact."""
    a = engines(kvpeer_tier(allow=["127.0.0.1"]), NUM_CHUNKS, BLOCK_LEN, engine_id="A")
    intruder_config = kvpeer_tier()
    intruder_config["host"] = "127.0.0.2"
    intruder = engines(intruder_config, NUM_CHUNKS, BLOCK_LEN, engine_id="X")
    friend = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="F")
    keys = [make_key(f"allow-{i}") for i in range(4)]
    blocks = random_blocks(4, 8)
    produce(a, keys, blocks)
    before = a.region.array.copy()

    req = intruder.new_request("x-req", source(a, "kv-x"))
    hits, answers = wait_lookup([a, intruder, friend], intruder, keys, req)
    assert hits == 0, answers
    assert [intruder.read(k) for k in keys] == [None] * 4
    intruder.finish(req)
    # From A's side: nothing was served to the intruder, and its memory is unchanged; from the
    # intruder's: no lookup was ever answered with a hit.
    assert a.tier.node_stats()["lookups_served"] == 0
    assert intruder.tier.node_stats()["lookup_hits_received"] == 0
    assert np.array_equal(a.region.array, before)

    pull(a, friend, keys, blocks, "kv-friend")
    assert a.tier.node_stats()["lookups_served"] >= 1


def _tls_files(tmp_path) -> dict:
    """A CA and one certificate naming 127.0.0.1 (as docs/deploying.md issues them): the
    tier's TLS keys for it."""

    def run(*args):
        subprocess.run(args, check=True, capture_output=True, cwd=tmp_path)

    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-days", "2", "-subj", "/CN=test CA", "-keyout", "ca.key", "-out", "ca.pem")
    run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", "/CN=node", "-keyout", "node.key", "-out", "node.csr")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "node.pem")
    # Paths as `pathlib.Path`: the tier takes them as a config file's strings.
    return {
        "tls": "required",
        "tls_cert": tmp_path / "node.pem",
        "tls_key": tmp_path / "node.key",
        "tls_ca": tmp_path / "ca.pem",
    }


def test_tiers_with_tls_required_and_block_digests_share_byte_exact_and_refuse_plaintext(
    engines, tmp_path
):
    """The tier takes the node's TLS keys and `tcp_block_digests` (issue 40): two tiers with
    `tls = required` and digests exchange blocks byte-exact over tcp, and a tier without TLS is
    refused by them: its lookups never hit and the producer served it nothing."""
    tls = _tls_files(tmp_path)
    a = engines(kvpeer_tier(tcp_block_digests=True, **tls), NUM_CHUNKS, BLOCK_LEN, engine_id="A")
    b = engines(kvpeer_tier(tcp_block_digests=True, **tls), NUM_CHUNKS, BLOCK_LEN, engine_id="B")
    # `tls: off` in YAML arrives as False.
    plain = engines(kvpeer_tier(tls=False), NUM_CHUNKS, BLOCK_LEN, engine_id="P")
    keys = [make_key(f"tls-{i}") for i in range(4)]
    blocks = random_blocks(4, 40)
    produce(a, keys, blocks)
    pull(a, b, keys, blocks, "kv-tls")
    served = a.tier.node_stats()["lookups_served"]
    assert served >= 1

    req = plain.new_request("p-req", source(a, "kv-plain"))
    hits, answers = wait_lookup([a, b, plain], plain, keys, req)
    assert hits == 0, answers
    assert [plain.read(k) for k in keys] == [None] * 4
    plain.finish(req)
    assert a.tier.node_stats()["lookups_served"] == served, "nothing served in plaintext"


def test_a_tier_with_a_tenant_shares_with_its_tenant_and_tells_another_nothing(engines):
    """`tenant` and `tenants` (issue 40): engines A and B of tenant alpha share blocks
    byte-exact; engine C of tenant beta, asking A for the same keys, gets no hit, and A served
    it not a single lookup (A's tier never dials C back nor answers it)."""
    ports = {name: free_port() for name in "ABC"}
    rules = [f"alpha=127.0.0.1:{ports['A']}", f"alpha=127.0.0.1:{ports['B']}",
             f"beta=127.0.0.1:{ports['C']}"]

    def tier(name: str, tenant: str) -> dict:
        return kvpeer_tier(port=ports[name], tenant=tenant, tenants=rules)

    a = engines(tier("A", "alpha"), NUM_CHUNKS, BLOCK_LEN, engine_id="A")
    b = engines(tier("B", "alpha"), NUM_CHUNKS, BLOCK_LEN, engine_id="B")
    c = engines(tier("C", "beta"), NUM_CHUNKS, BLOCK_LEN, engine_id="C")
    keys = [make_key(f"tenant-{i}") for i in range(4)]
    blocks = random_blocks(4, 41)
    produce(a, keys, blocks)
    pull(a, b, keys, blocks, "kv-alpha")
    served = a.tier.node_stats()["lookups_served"]
    assert served >= 1

    req = c.new_request("c-req", source(a, "kv-beta"))
    hits, answers = wait_lookup([a, b, c], c, keys, req)
    assert hits == 0, answers
    assert [c.read(k) for k in keys] == [None] * 4
    c.finish(req)
    assert a.tier.node_stats()["lookups_served"] == served, "nothing served to another tenant"


def test_peer_killed_mid_load_fails_the_job_and_frees_the_slots(engines):
    """The producer (another process) is killed with SIGKILL while B's load from it runs:
    the job fails, no key is readable in B's primary tier, no slot stays pinned, nothing of
    the tier's waits, and the request falls back to local prefill (MISS)."""
    # 12 blocks of 64 KiB at 256 KiB/s per peer: the load takes ~3 s; the kill lands in it.
    block_len, n = 65536, 12
    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [sys.executable, os.path.join(here, "peer_process.py"), str(port), str(block_len),
         str(n), "9", "262144"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        b = engines(kvpeer_tier(), NUM_CHUNKS, block_len, engine_id="B")
        keys = [make_key(f"gone-{i}") for i in range(n)]
        req = b.new_request("b-gone", {"remote_kv_source": {
            "kv_request_id": "kv-gone", "remote_host": "127.0.0.1", "remote_port": port}})
        drive([b], lambda: b.lookup(keys, req) is not None or b.jobs_in_flight() > 0,
              timeout_s=TIMEOUT_S)
        assert b.jobs_in_flight() > 0, "the promotion (a load from the child) is running"
        time.sleep(0.3)
        child.kill()
        child.wait(timeout=10)
        drive([b], lambda: b.jobs_in_flight() == 0, timeout_s=40)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert [b.read(k) for k in keys] == [None] * n
    assert all(b.pins(k) in (None, 0) for k in keys)
    stats = b.tier.node_stats()
    assert stats["loads_failed"] >= 1 and stats["loads_ok"] == 0, stats
    # Nothing of the tier's waits (B is stepped without vLLM's tier-poll thread, so it keeps the
    # engine stepping all the same: test_an_idle_tier_keeps_an_unpolled_engine_stepping).
    assert not b.tier._busy()
    assert b.lookup(keys, req) == 0  # the request falls back to local prefill
    b.finish(req)


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_a_stalled_producer_never_writes_slots_given_to_another_request(engines, plane):
    """The producer (another process) is stopped with SIGSTOP as B's load from it starts and
    stays stopped past B's load and abort-ack timeouts: B's job fails and its slots go to a load
    from an honest producer A; then the stopped producer resumes (SIGCONT) with B's fetch still
    in its socket. Every block of A's keys in B's primary tier (vLLM's memory) stays byte-exact,
    nothing of the stalled load is readable, and B fetches from A again afterwards. Before the
    fences (6d26cca), on shm the resumed producer copied its blocks over A's."""
    block_len, n = 65536, 12
    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [sys.executable, os.path.join(here, "peer_process.py"), str(port), str(block_len),
         str(n), "9", "262144", plane],
        stdout=subprocess.PIPE,
        text=True,
    )
    stopped = False
    try:
        assert child.stdout.readline().strip() == "ready"
        shm = plane != "tcp"
        # Exactly one load's slots: the honest load takes the stalled one's.
        b = engines(kvpeer_tier(plane, load_timeout_s=1, abort_ack_timeout_s=1), n, block_len,
                    engine_id=f"B-stall-{plane}", shm_region=shm)
        a = engines(kvpeer_tier(plane), NUM_CHUNKS, block_len, engine_id=f"A-stall-{plane}",
                    shm_region=shm)
        stalled = [make_key(f"gone-{i}") for i in range(n)]
        req = b.new_request("b-stall", {"remote_kv_source": {
            "kv_request_id": "kv-stall", "remote_host": "127.0.0.1", "remote_port": port}})

        def stop_once_answered() -> bool:
            # The producer stops once B's lookup call saw its answer (the call starts the
            # promotion: HIT_PENDING) and before B's fetch leaves, which is only at the step
            # after that call (the promotion is submitted then). Not on B's node's count of
            # answers: the node's I/O thread takes the answer in at once, and vLLM sees it only
            # at its next lookup call. (CI on 1cd49fc: the count was read a round after that
            # call, when the fetch had left and been served.)
            nonlocal stopped
            b.lookup(stalled, req)
            if all(r is LookupResult.RETRY for r in b.last_lookup):
                return False
            stop_process(child.pid)
            stopped = True
            return True

        drive([b], stop_once_answered, timeout_s=TIMEOUT_S)
        # Past the load (1 s) and abort-ack (1 s) timeouts: the session with the producer ends.
        end = time.monotonic() + 4
        drive([b], lambda: time.monotonic() > end, timeout_s=10)
        if plane == "nixl":
            # Nothing on our side revokes a NIXL writer: its blocks stay held until it confirms.
            # vLLM 0.34 hears of the failure at once and frees the chunks when told (its
            # JobResult's deferred_release); 0.32/0.33 hear of it only then.
            if kvpeer_vllm._DEFERRED_RELEASE:
                assert (b.jobs_in_flight(), b.tier.pending_releases()) == (0, 1)
            else:
                assert (b.jobs_in_flight(), b.tier.pending_releases()) == (1, 0)
        if b.tier.pending_releases():
            # vLLM 0.34 (deferred release): the failed load was reported at once; only its
            # chunks wait for the fence.
            assert b.jobs_in_flight() == 0, "0.34: the failed load is reported, not held"
        if b.jobs_in_flight() or b.tier.pending_releases():
            # The producer's writes are not fenced yet (nixl: nothing on our side revokes
            # them until it confirms): its blocks stay out of use (0.33: the job with them;
            # 0.34: the job's deferred release) until then.
            held_for = time.monotonic() + 3
            drive([b], lambda: time.monotonic() > held_for, timeout_s=10)
            assert b.jobs_in_flight() > 0 or b.tier.pending_releases() > 0, (
                "an unfenced load keeps its slots")
            assert [b.read(k) for k in stalled] == [None] * n
            child.send_signal(signal.SIGCONT)
            stopped = False
        drive([b], lambda: b.jobs_in_flight() == 0 and b.tier.pending_releases() == 0,
              timeout_s=30)
        assert b.tier.node_stats()["loads_failed"] >= 1, str(b.tier.node_stats())
        assert [b.read(k) for k in stalled] == [None] * n
        b.finish(req)

        honest = [make_key(f"honest-{i}") for i in range(n)]
        blocks = random_blocks(n, seed=77, block_len=block_len)
        produce(a, honest, blocks, req_id="a-honest")
        req = b.new_request("b-honest", source(a, "kv-honest"))
        assert wait_lookup([a, b], b, honest, req)[0] == n
        settle(a, b)
        assert [b.read(k) for k in honest] == blocks
        b.finish(req)

        if stopped:
            child.send_signal(signal.SIGCONT)
            stopped = False
        # The resumed producer reads B's fetch and tries to write while A and B step on.
        end = time.monotonic() + 3
        drive([a, b], lambda: time.monotonic() > end, timeout_s=10)
        assert [b.read(k) for k in honest] == blocks, "a block of A's keys changed"
        assert [b.read(k) for k in stalled] == [None] * n
    finally:
        if stopped:
            child.send_signal(signal.SIGCONT)
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        # A killed child leaves its region (and its fence words) in /dev/shm.
        for leftover in (f"vllm_offload_child-{port}.mmap", f"vllm_offload_child-{port}.mmap.fence"):
            try:
                os.unlink(os.path.join("/dev/shm", leftover))
            except FileNotFoundError:
                pass


@pytest.mark.parametrize("poll_s", [0, 0.001], ids=["unpolled", "tier-poll-thread"])
def test_an_idle_tier_keeps_an_unpolled_engine_stepping(engines, poll_s):
    """Where vLLM services tiers from no thread (vLLM 0.32 has none; 0.33 with
    tier_poll_interval_s <= 0) an idle engine steps only while a tier has pending work, so an
    idle KvpeerTier says it has some, always, as the stock tier does: else an idle producer
    would never answer a peer. With 0.33's tier-poll thread it says so only while its own work
    moves. Detected from what vLLM gives the tier, not from its version."""
    a = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id=f"idle-{poll_s}",
                tier_poll_interval_s=poll_s)
    assert not a.tier._busy()
    assert a.tier.has_pending_work() is (poll_s == 0)
    # Still true once a peer came and went (the unpolled engine must keep answering).
    b = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id=f"idle-peer-{poll_s}",
                tier_poll_interval_s=poll_s)
    keys = [make_key(f"idle-{poll_s}-{i}") for i in range(2)]
    blocks = random_blocks(2, 9)
    produce(a, keys, blocks)
    pull(a, b, keys, blocks, f"kv-idle-{poll_s}")
    drive([a, b], lambda: not a.tier._busy() and not b.tier._busy(), timeout_s=TIMEOUT_S)
    assert a.tier.has_pending_work() is (poll_s == 0)


def test_drain_jobs_aborts_loads_in_flight_and_a_later_pull_is_byte_exact(engines):
    """vLLM's reset_cache drains every tier under the scheduler's lock. kvpeer's drain aborts
    the loads in flight up front (as vLLM 0.34's own tier does), so a producer that is slow or
    never writes holds the reset for one round trip (its abort_ack), not for the load timeout;
    the aborted load fails (its chunks computed locally), and the next pull is byte-exact."""
    block_len = 65536
    # A writes at 256 KiB/s: the 8 blocks (512 KiB) would take two seconds (the pacer banks at
    # most a second of idle time, 256 KiB, plus one 64 KiB chunk).
    a = engines(kvpeer_tier(tcp_max_rate=262144), NUM_CHUNKS, block_len, engine_id="A")
    b = engines(kvpeer_tier(), NUM_CHUNKS, block_len, engine_id="B")
    keys = [make_key(f"drain-{i}") for i in range(8)]
    blocks = random_blocks(len(keys), 10, block_len)
    produce(a, keys, blocks)
    req = b.new_request("b-drain", source(a, "kv-drain"))
    drive([a, b], lambda: b.lookup(keys, req) is not None or b.jobs_in_flight() > 0, timeout_s=TIMEOUT_S)
    assert b.jobs_in_flight() > 0
    assert b.tier._loads, "a load is in flight"
    # A serves on another thread while B's scheduler blocks in drain_jobs (as vLLM's
    # reset_cache does), under B's lock.
    stop = threading.Event()

    def serve_a():
        while not stop.is_set():
            a.step()
            time.sleep(0.0005)

    t = threading.Thread(target=serve_a)
    t.start()
    try:
        with b._scope():
            started = time.monotonic()
            b.tier.drain_jobs()
            took = time.monotonic() - started
            assert not b.tier._loads, "every load ended"
    finally:
        stop.set()
        t.join()
    # Not a speed figure: the drain must not have waited for the load's own timeout (10 s).
    assert took < 10.0, took
    settle(a, b)
    assert all(b.read(k) is None for k in keys), "the aborted load wrote no readable chunk"
    b.finish(req)
    settle(a, b)
    # The pair goes on: a new pull of the same keys is byte-exact.
    pull(a, b, keys, blocks, kv_request_id="kv-drain-2")


def test_a_producer_keeps_hearing_consumers_that_come_and_go(engines):
    """The stock transport went deaf after the 3rd to 23rd closed session (docs/behaviour.md
    #11); kvpeer's tier serves 30 consumer engines in turn, each shut down after its pull."""
    a = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="A")
    keys = [make_key(f"turn-{i}") for i in range(2)]
    blocks = random_blocks(2, 12)
    produce(a, keys, blocks)
    for i in range(30):
        b = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id=f"B{i}")
        pull(a, b, keys, blocks, f"kv-turn-{i}")
        b.shutdown()
    drive([a], lambda: a.tier.node_stats()["sessions"] == 0, timeout_s=TIMEOUT_S)
    assert a.tier.node_stats()["sessions_opened"] >= 30


def test_shutdown_with_peers_connected(engines):
    a = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="A")
    b = engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id="B")
    keys = [make_key(f"sd-{i}") for i in range(3)]
    blocks = random_blocks(3, 11)
    produce(a, keys, blocks)
    pull(a, b, keys, blocks, "kv-sd")
    assert a.tier.node_stats()["sessions"] == 1
    b.shutdown()  # B says disconnect
    drive([a], lambda: a.tier.node_stats()["sessions"] == 0, timeout_s=TIMEOUT_S)
    a.shutdown()
    a.shutdown()  # idempotent


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"max_peers": "many"}, "max_peers"),
        ({"plane": "carrier-pigeon"}, "plane"),
        ({"plane": "shm"}, "plane"),  # the memory here is no /dev/shm file
        ({"allow": ["10.0.0.0/33"]}, "allow"),
        ({"tenants": ["10.0.0.0/8"]}, "tenants"),
        ({"port": "x"}, "port"),
        ({"backends": ["LIBFABRIC"]}, "backends"),
        ({"unbound_store_timeout_s": -1}, "unbound_store_timeout_s"),
        ({"metrics": "yes"}, "metrics"),
        ({"io_thread": "yes"}, "io_thread"),
        ({"host_probe_timeout_ms": "soon"}, "host_probe_timeout_ms"),
        ({"max_peers_per_host": 0}, "max_peers_per_host"),
        ({"max_pins_per_peer": "lots"}, "max_pins_per_peer"),
        ({"sources": ["nohost"]}, "sources"),
        ({"sources": ["10.0.0.7:99999"]}, "sources"),
        ({"sources": ["10.0.0.7:5710", "10.0.0.7:5710"]}, "sources"),
        ({"sources": 5710}, "sources"),
    ],
)
def test_bad_config_fails_start_up_naming_the_key(engines, config, key):
    with pytest.raises(ValueError, match=repr(key)):
        engines(kvpeer_tier(**config), NUM_CHUNKS, BLOCK_LEN)


def test_shutdown_lets_the_engine_unmap_its_memory(engines):
    """After shutdown the tier holds no export of vLLM's primary memory: the memory can be
    resized or unmapped (vLLM closes its mmap after the tiers' shutdown)."""
    import mmap

    from kvpeer import _native

    region = mmap.mmap(-1, 8 * 4096)
    view = memoryview(region).cast("B", (8, 4096))
    tier = _native.EngineTier(view, {"plane": "tcp"}, "unmap-test")
    with pytest.raises(BufferError):
        region.close()  # pinned while the node lives
    tier.shutdown(0.1)
    view.release()
    region.close()  # no export left


def test_the_ranks_of_a_data_parallel_engine_form_one_liveness_group():
    """vLLM's data-parallel ranks on one host each run a tier with its own node: they share
    the entry's host:port as their liveness group (each rank its index of the size), so the
    first rank to lose a host tells the others (docs/behaviour.md, "A host that dies")."""
    from harness import HarnessOffloadingSpec, make_offloading_config

    memory = memoryview(bytearray(4 * BLOCK_LEN)).cast("B", (4, BLOCK_LEN))

    def settings(index, entry):
        spec = HarnessOffloadingSpec(
            make_offloading_config(BLOCK_LEN, engine_id=f"dp{index}", data_parallel_index=index),
            hash_seed="seed",
        )
        found, _ = kvpeer_vllm._settings(spec, memory, {"plane": "tcp", **entry})
        return found

    rank = settings(2, {"host": "10.0.0.5", "port": 5710, "tcp_port": 5810})  # size = index + 1
    assert rank["listen_port"] == "5712"
    # The tcp data port likewise: one per rank, from the one given; 0 stays "a free one".
    assert rank["tcp_port"] == "5812"
    assert settings(2, {"tcp_port": 0})["tcp_port"] == "0"
    assert "tcp_port" not in settings(2, {})
    for bad in ("five", True, 5.5):
        with pytest.raises(ValueError, match="'tcp_port' must be a port number"):
            settings(0, {"tcp_port": bad})
    # Data ports that would take a rank's control port are refused: 3 ranks at 5710..5712.
    with pytest.raises(ValueError, match="overlaps the control ports 5710..5712"):
        settings(2, {"host": "10.0.0.5", "port": 5710, "tcp_port": 5711})
    with pytest.raises(ValueError, match="overlaps"):
        settings(0, {"host": "10.0.0.5", "port": 5710, "tcp_port": 5710})
    assert rank["liveness_group"] == "10.0.0.5:5710"
    assert rank["liveness_rank"] == "2/3"
    # One rank alone, or a port the system picks (no shared base): no group.
    assert "liveness_group" not in settings(0, {"host": "10.0.0.5", "port": 5710})
    assert "liveness_group" not in settings(1, {"host": "10.0.0.5", "port": 0})
    # A host name too long for a group name: the same hashed name in every rank.
    long_host = "engine-" + "x" * 70 + ".example"
    a = settings(1, {"host": long_host, "port": 5710})["liveness_group"]
    b = settings(3, {"host": long_host, "port": 5710})["liveness_group"]
    assert a == b and len(a) == 40
    # The host liveness keys pass through, checked by the node like the others.
    found = settings(0, {"host_probe_timeout_ms": 250, "host_down_hold_ms": 0})
    assert found["host_probe_timeout_ms"] == "250" and found["host_down_hold_ms"] == "0"


def test_parked_stores_and_results_not_taken_yet_are_pending_work(engines):
    """vLLM 0.34's TestHasPendingWork: a PD store parked for its decoder, and a result the tier
    holds that vLLM has not taken yet, are pending work, so an engine with nothing else to do
    keeps stepping and takes the result now, not at its next request. With vLLM's tier-poll
    thread on (without it the tier always says it has work, as the stock tier does)."""
    a = engines(
        kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN, engine_id=f"A-pending-{os.getpid()}",
        tier_poll_interval_s=0.001,
    )
    producer = a.new_request("a-pending", {"remote_decoder": {"kv_request_id": "kv-pending"}})
    keys = [make_key(f"pending-{i}") for i in range(2)]
    assert a.put(keys, random_blocks(2, 31), producer) == keys
    a.finish(producer)
    a.step()
    with a._scope():
        assert a.tier._stores, "the PD stores are parked for the decoder"
        assert a.tier.has_pending_work(), "a parked store is pending work"
        # As reset_cache does before taking the results: the drain fails the parked stores.
        a.tier.drain_jobs()
        assert not a.tier._stores
        assert a.tier._finished, "their results wait for vLLM"
        assert a.tier.has_pending_work(), "results not taken yet are pending work"
    a.step()
    assert not a.tier._finished, "vLLM took them"
    assert a.jobs_in_flight() == 0
    assert not a.tier.has_pending_work()


def test_reset_cache_with_parked_pd_stores_fails_them_and_refuses_a_late_fetch(engines, plane="tcp"):
    """vLLM's reset_cache (sleep mode, weight updates, /reset_prefix_cache) drains every tier and
    then asserts that no job is left. A PD producer's stores parked for a decoder that never
    fetched are failed by the drain (as vLLM 0.34's own P2P tier does), so the reset completes;
    the decoder's later fetch of them is refused and its load fails (computed locally), never
    served stale chunks."""
    a = engines(kvpeer_tier(plane), NUM_CHUNKS, BLOCK_LEN, engine_id=f"A-reset-{os.getpid()}")
    b = engines(kvpeer_tier(plane), NUM_CHUNKS, BLOCK_LEN, engine_id=f"B-reset-{os.getpid()}")
    pd_keys = [make_key(f"reset-pd-{i}") for i in range(3)]
    producer = a.new_request("a-reset-pd", {"remote_decoder": {"kv_request_id": "kv-reset-pd"}})
    assert a.put(pd_keys, random_blocks(3, 21), producer) == pd_keys
    a.finish(producer)
    a.step()
    assert a.tier._stores, "the PD stores are parked for the decoder"
    with a._scope():
        a.manager.reset_cache()
    a.step()
    assert not a.tier._stores, "every parked store ended (failed) with the drain"
    # The decoder comes late: nothing is served for the reaped request.
    req = b.new_request("b-reset-pd", source(a, "kv-reset-pd", role="remote_prefiller"))
    hits, answers = wait_lookup([a, b], b, pd_keys, req)
    assert hits == 0, answers
    b.finish(req)
    settle(a, b)
