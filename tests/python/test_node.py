"""`kvpeer.Node` from Python: two nodes on this machine share blocks byte-exact (shm and tcp),
lookups answer per key, a bad setting names its key, a dead peer is a bounded error."""

import os
import socket

import pytest

import kvpeer

BLOCK_LEN = 4096


def node(plane: str, **settings) -> kvpeer.Node:
    return kvpeer.Node(
        {"num_blocks": "32", "block_len": str(BLOCK_LEN), "plane": plane, **settings},
        tag="pytest",
    )


@pytest.mark.parametrize("plane", ["shm", "tcp", "both"])
def test_a_node_fetches_another_nodes_blocks_byte_exact(plane):
    producer, consumer = node(plane), node(plane)
    try:
        blocks = {os.urandom(36): os.urandom(BLOCK_LEN) for _ in range(6)}
        producer.store(blocks)
        keys = list(blocks)
        absent = os.urandom(36)
        assert consumer.lookup(producer.id, keys + [absent], kv_request_id="probe") == [True] * 6 + [False]
        fetched = consumer.fetch(producer.id, keys + [absent], kv_request_id="pull")
        assert sorted(fetched) == sorted(keys)
        assert all(consumer.read(k) == blocks[k] for k in keys)
        assert consumer.read(absent) is None
        served = producer.stats()
        assert served["fetch_blocks_served"] == 6 and served["lookups_served"] >= 2
        assert consumer.stats()["bytes_fetched"] == 6 * BLOCK_LEN
    finally:
        consumer.shutdown(0.5)
        producer.shutdown(0.5)


def test_a_bad_setting_names_its_key():
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"block_len": "0"})
    assert e.value.args[1] == "block_len"
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"no_such_key": "1"})
    assert e.value.args[1] == "no_such_key"


def test_settings_take_numbers_bools_lists_and_rates_as_a_config_file_does():
    # As a TOML file writes them: numbers, bools, lists; rates with the flags' suffixes.
    n = kvpeer.Node(
        {
            "num_blocks": 16,
            "block_len": BLOCK_LEN,
            "plane": "tcp",
            "tcp_max_rate": "500M",
            "allowlist": ["127.0.0.1", "10.0.0.0/8"],
            "bind_identity": True,
            "pull_max_rate": 2.5e9,
            "pool_shard": ["127.0.0.1:5710", "127.0.0.2:5710"],
        },
        tag="pytest",
    )
    try:
        assert n.stats()["sessions"] == 0
    finally:
        n.shutdown(0.5)
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"num_blocks": {"many": 1}})
    assert e.value.args[1] == "num_blocks"
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"allowlist": ["127.0.0.1", 5]})
    assert e.value.args[1] == "allowlist"
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"tcp_max_rate": "fast"})
    assert e.value.args[1] == "tcp_max_rate"
    # The error names where the user wrote it, in Python's terms.
    assert e.value.args[0].startswith("kvpeer.Node settings: tcp_max_rate: "), e.value.args[0]


def test_a_peer_with_no_session_raises_peer_unavailable_saying_why():
    # Nothing listens at the port: the error names it (not an all-False answer).
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    consumer = node("tcp")
    producer = node("tcp", allowlist="10.9.9.9")
    try:
        with pytest.raises(kvpeer.PeerUnavailable, match="nothing listens at 127.0.0.1:"):
            consumer.lookup(f"127.0.0.1:{port}", [os.urandom(36)], timeout_s=3.0)
        # A node whose allowlist leaves this one out: refused, and the error says so.
        with pytest.raises(kvpeer.PeerUnavailable, match="it refused this node"):
            consumer.fetch(producer.id, [os.urandom(36)], timeout_s=3.0)
        assert issubclass(kvpeer.PeerUnavailable, kvpeer.KvpeerError)
    finally:
        consumer.shutdown(0.1)
        producer.shutdown(0.1)


def test_a_silent_peer_is_a_bounded_error():
    # A socket that accepts and never answers: the lookup gives up at its timeout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    consumer = node("tcp")
    try:
        with pytest.raises((TimeoutError, kvpeer.KvpeerError)):
            consumer.lookup(f"127.0.0.1:{silent.getsockname()[1]}", [os.urandom(36)], timeout_s=0.5)
    finally:
        consumer.shutdown(0.1)
        silent.close()


def test_the_vllm_tier_without_vllm_is_an_import_error_that_says_what_it_needs():
    # A Python without vLLM (this one, without the test's PYTHONPATH of vLLM's modules).
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", "import kvpeer.vllm"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvpeer.vllm is a vLLM secondary tier"), out.stderr
    assert "kvpeer.Node works without vLLM" in last
    # kvpeer itself imports, and its Node is there.
    ok = subprocess.run([sys.executable, "-c", "import kvpeer; kvpeer.Node"], env=env, timeout=60)
    assert ok.returncode == 0


def test_the_package_states_the_supported_vllm_releases_as_the_readme_does():
    import pathlib

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    statement = " ".join(readme.split("**Supported vLLM releases**")[1].split("\n\n")[0].split())
    assert f"vLLM {kvpeer.VLLM_PEERS}," in statement
    assert f"vLLM {kvpeer.VLLM_TIER}," in statement
    assert kvpeer.VLLM_PEERS in kvpeer.__doc__ and kvpeer.VLLM_TIER in kvpeer.__doc__


def test_the_readmes_python_example_runs_as_written(capsys):
    import pathlib

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("From Python without vLLM", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "README.md", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["[True, True, False]", "131072"]


def test_help_says_the_types_keys_are_bytes_and_blocks_block_len():
    doc = kvpeer.Node.__doc__
    assert "Keys are `bytes`" in doc and "exactly `block_len` bytes" in doc, doc
    assert "dict[bytes, bytes]" in kvpeer.Node.store.__doc__
    assert "-> list[bool]" in kvpeer.Node.lookup.__doc__
    assert "-> list[bytes]" in kvpeer.Node.fetch.__doc__
    assert "-> bytes | None" in kvpeer.Node.read.__doc__


def test_a_key_that_is_not_bytes_is_a_type_error_saying_keys_are_bytes():
    producer, consumer = node("tcp"), node("tcp")
    try:
        with pytest.raises(TypeError) as e:
            consumer.lookup(producer.id, [b"fine", "prefix-1"])
        assert "keys[1] is a str" in str(e.value) and "bytes" in str(e.value)
        with pytest.raises(TypeError) as e:
            consumer.fetch(producer.id, [7])
        assert "keys[0] is a int" in str(e.value)
    finally:
        consumer.shutdown(0.5)
        producer.shutdown(0.5)


def test_two_nodes_share_blocks_over_mutual_tls_with_the_same_keys_as_a_config_file(tmp_path):
    import subprocess

    def run(*args):
        subprocess.run(args, check=True, capture_output=True, cwd=tmp_path)

    # A CA and one certificate naming 127.0.0.1, for both nodes (as docs/deploying.md issues them).
    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-days", "2", "-subj", "/CN=test CA", "-keyout", "ca.key", "-out", "ca.pem")
    run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", "/CN=node", "-keyout", "node.key", "-out", "node.csr")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "node.pem")
    tls = {
        "tls": "required",
        "tls_cert": str(tmp_path / "node.pem"),
        "tls_key": str(tmp_path / "node.key"),
        "tls_ca": str(tmp_path / "ca.pem"),
    }
    producer, consumer = node("tcp", **tls), node("tcp", **tls)
    plain = node("tcp")
    try:
        blocks = {os.urandom(36): os.urandom(BLOCK_LEN) for _ in range(4)}
        producer.store(blocks)
        fetched = consumer.fetch(producer.id, list(blocks))
        assert sorted(fetched) == sorted(blocks)
        assert all(consumer.read(k) == blocks[k] for k in blocks)
        # A node without TLS is refused by one that requires it, and told why.
        with pytest.raises(kvpeer.PeerUnavailable) as e:
            plain.fetch(producer.id, list(blocks), timeout_s=5.0)
        assert "this node takes TLS control connections only (tls = required)" in str(e.value)
    finally:
        plain.shutdown(0.5)
        consumer.shutdown(0.5)
        producer.shutdown(0.5)
