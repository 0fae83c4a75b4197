"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms with fixed label names; all updates happen on the event loop
thread (or under the lock), so a scrape sees consistent values.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Final

__all__ = ["Metrics", "MetricsMiddleware", "CONTENT_TYPE", "path_label"]

_LOGGER = logging.getLogger(__name__)

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RTF_BUCKETS: Final = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_PREFIX: Final = "trt_cosy_"
_KNOWN_PATHS: Final = frozenset(
    ("/v1/audio/speech", "/tts", "/v1/models", "/v1/voices", "/health", "/metrics")
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        self.name = _PREFIX + name
        self.help_text = help_text
        self.label_names = tuple(label_names)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        super().__init__(name, help_text, label_names)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        with self._lock:
            items = sorted(self._values.items()) or ([((), 0.0)] if not self.label_names else [])
        for labels, value in items:
            lines.append(f"{self.name}_total{_labels(self.label_names, labels)} {_number(value)}")
        return lines


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str):
        super().__init__(name, help_text)
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def render(self) -> list[str]:
        return [*self.header(), f"{self.name} {_number(self.value)}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float], label_names: Sequence[str] = ()):
        super().__init__(name, help_text, label_names)
        self.bounds = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], list[float]] = {}  # counts per bucket + [+Inf, sum]

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            series = self._series.setdefault(labels, [0.0] * (len(self.bounds) + 2))
            series[bisect.bisect_left(self.bounds, value)] += 1
            series[-1] += value

    def count(self, *labels: str) -> int:
        series = self._series.get(labels)
        return 0 if series is None else int(sum(series[:-1]))

    def render(self) -> list[str]:
        lines = self.header()
        with self._lock:
            items = sorted((key, list(value)) for key, value in self._series.items())
        for labels, series in items:
            cumulative = 0.0
            for bound, count in zip((*self.bounds, math.inf), series[:-1], strict=True):
                cumulative += count
                le = f'le="{_number(bound)}"'
                lines.append(
                    f"{self.name}_bucket{_labels(self.label_names, labels, le)} {_number(cumulative)}"
                )
            label_text = _labels(self.label_names, labels)
            lines.append(f"{self.name}_sum{label_text} {_number(series[-1])}")
            lines.append(f"{self.name}_count{label_text} {_number(cumulative)}")
        return lines


class Metrics:
    """Every metric the server exports; ``render()`` is the ``GET /metrics`` body."""

    def __init__(self) -> None:
        self.requests = Counter(
            "http_requests", "HTTP requests answered, by path and status.", ("path", "status")
        )
        self.errors = Counter(
            "http_errors", "Requests answered with an error, by path and code.", ("path", "code")
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "Time from request to the last response byte, by path.",
            _LATENCY_BUCKETS,
            ("path",),
        )
        self.first_audio = Histogram(
            "time_to_first_audio_seconds",
            "Time from request to the first synthesised audio.",
            _LATENCY_BUCKETS,
        )
        self.rtf = Histogram(
            "rtf", "Real-time factor of each synthesis (compute time / audio time).", _RTF_BUCKETS
        )
        self.audio_seconds = Counter("audio_seconds", "Seconds of audio synthesised.")
        self.cancelled = Counter("syntheses_cancelled", "Syntheses stopped early, by reason.", ("reason",))
        self.queue_depth = Gauge("queue_depth", "Requests waiting for a synthesis slot.")
        self.active = Gauge("active_requests", "Syntheses (and voice uploads) running now.")
        self.ready = Gauge("ready", "1 once warm-up has finished, else 0.")
        self._all: tuple[_Metric, ...] = (
            self.requests,
            self.errors,
            self.latency,
            self.first_audio,
            self.rtf,
            self.audio_seconds,
            self.cancelled,
            self.queue_depth,
            self.active,
            self.ready,
        )

    def render(self) -> str:
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"


def path_label(path: str) -> str:
    """A bounded set of path labels: the route, never the raw path (voice names stay out)."""
    if path in _KNOWN_PATHS:
        return path
    if path.startswith("/v1/voices/"):
        return "/v1/voices/{name}"
    return "other"


class MetricsMiddleware:
    """ASGI middleware: counts every HTTP request and times it to its last body byte."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = path_label(scope.get("path", ""))
        status = [500]

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.inc(path, str(status[0]))
            self.metrics.latency.observe(time.perf_counter() - started, path)
