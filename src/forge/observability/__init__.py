"""Metrics: `record_metric` anywhere, exact global reduction, pluggable backends."""

from forge.observability.backends import ConsoleBackend, JsonlBackend, MetricBackend, TensorBoardBackend
from forge.observability.collector import record_metric
from forge.observability.logger import MetricLogger, MetricsConfig, get_metric_logger
from forge.observability.reduce import Accumulator, Reduce

__all__ = [
    "Accumulator",
    "ConsoleBackend",
    "JsonlBackend",
    "MetricBackend",
    "MetricLogger",
    "MetricsConfig",
    "Reduce",
    "TensorBoardBackend",
    "get_metric_logger",
    "record_metric",
]
