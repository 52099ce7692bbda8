"""`KVEventsConfig` for vLLM's `ZmqEventPublisher` (kvpeer interop tests): the fields and
defaults of vLLM 0.33's `vllm/config/kv_events.py`, as a plain dataclass (vLLM's is a pydantic
config)."""

from dataclasses import dataclass


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
