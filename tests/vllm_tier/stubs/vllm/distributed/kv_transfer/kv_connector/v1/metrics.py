"""The names vLLM's offloading metrics module imports from
`vllm.distributed.kv_transfer.kv_connector.v1.metrics` (kvpeer's vLLM tier harness, not vLLM's
file; vLLM's imports prometheus_client and the connector factory, i.e. the engine).

`KVConnectorStats` is the base of `OffloadingConnectorStats`, which the managers fill on every
`get_stats()`: a dataclass holding one `data` dict, the shape vLLM 0.33 gives it. The Prometheus
side (`KVConnectorPromMetrics`, `PromMetric`) is a type only: the harness exports no metrics.
"""

from dataclasses import dataclass, field
from typing import Any, TypeVar


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        raise NotImplementedError

    def reduce(self) -> dict[str, int | float]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError


class PromMetric:
    """Type name only (vLLM: a prometheus_client Gauge, Counter or Histogram)."""


PromMetricT = TypeVar("PromMetricT", bound=PromMetric)


class KVConnectorPromMetrics:
    """Type name only: the harness exports no Prometheus metrics."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("kvpeer's vLLM tier harness exports no Prometheus metrics")
