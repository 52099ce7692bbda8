"""The four helpers vLLM's `kv_events.py` imports from `vllm.utils.network_utils` (kvpeer interop
tests; vLLM's module needs psutil and urllib3). Same meaning as vLLM 0.33's, for loopback
tests: `get_ip` answers 127.0.0.1 unless `VLLM_HOST_IP` says otherwise."""

import ipaddress
import os


def get_ip() -> str:
    return os.environ.get("VLLM_HOST_IP", "127.0.0.1")


def is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def split_zmq_path(path: str) -> tuple[str, str, str]:
    """`tcp://host:port` → ("tcp", host, port)."""
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port
