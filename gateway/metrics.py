"""Prometheus metrics, labelled by protocol and by served model.

Each :class:`~prismgate.server.Gateway` owns one :class:`GatewayMetrics` with its own
registry, so that two gateways in one process (tests) never mix their counts; the
gateway puts it on ``app.state.metrics`` and ``/metrics`` serves that registry.
What the metrics count is decided in one place, :mod:`prismgate.observer`, which sees
every generation of every protocol as it passes through the core service.

Names follow the Prometheus conventions (``_total`` for counters, base units in
seconds). ``deploy/grafana/prismgate.json`` charts them; docs/operations.md lists them.

The ``model`` label holds a configured model name or ``""`` (a request refused before its
model was known), never a name a client sent: the observer maps anything else to ``""``,
so a client cannot create series.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from prismgate.core.engine import EngineInfo
    from prismgate.core.service import SessionService

REGISTRY = CollectorRegistry(auto_describe=True)
"""Fallback registry for an app built without a Gateway (it then holds process metrics only)."""

KNOWN_PROTOCOLS = ("salience", "evergreen", "graphpipe", "openai")
"""Series for these (and each served model) exist at zero from the start, so dashboards show 0 rather than 'no data'."""

NO_MODEL = ""
"""The ``model`` label of a request refused before its model was known (Prometheus reads it as no label)."""

# Time to first token covers queueing and prefill: from a few ms (cached prefix) to minutes (long prompt, busy pool).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Inter-token latency: one decode step, plus any wait for the client to read.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """Every metric one gateway exports, in one registry of its own."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = ["protocol", "model"]
        self.requests = Counter(
            "prismgate_requests",
            "Generation requests received (every protocol's generations pass the core).",
            p,
            registry=r,
        )
        self.errors = Counter(
            "prismgate_request_errors",
            "Requests that failed, by gateway error code (gRPC-style names).",
            ["protocol", "code", "model"],
            registry=r,
        )
        self.finished = Counter(
            "prismgate_generations_finished",
            "Generations that ended, by finish reason (cancelled: the client left).",
            ["protocol", "finish_reason", "model"],
            registry=r,
        )
        self.active = Gauge(
            "prismgate_active_sessions",
            "Sessions with a generation in flight (one-request sessions such as GraphPipe rows included).",
            ["protocol"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.streamed_tokens = Counter(
            "prismgate_streamed_tokens", "Decoded tokens streamed to clients.", p, registry=r
        )
        self.prompt_tokens = Counter(
            "prismgate_prompt_tokens",
            "Prompt tokens of finished generations (the whole timeline the engine saw).",
            p,
            registry=r,
        )
        self.cached_tokens = Counter(
            "prismgate_prompt_cached_tokens",
            "Prompt tokens served from the engine's prefix/session cache.",
            p,
            registry=r,
        )
        self.prefilled_tokens = Counter(
            "prismgate_prompt_prefilled_tokens",
            "Prompt tokens the engine ran through the model (not cached).",
            p,
            registry=r,
        )
        self.readout_tokens = Counter(
            "prismgate_readout_tokens", "Token positions streamed with a concept readout.", p, registry=r
        )
        self.ttft = Histogram(
            "prismgate_time_to_first_token_seconds",
            "From the request reaching the core to its first decoded token (queueing and prefill included).",
            p,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "prismgate_inter_token_latency_seconds",
            "Time between consecutive decoded tokens of one generation.",
            p,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "prismgate_generation_duration_seconds",
            "Whole generation, request to last event.",
            p,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        # per key (prismgate.keys): label values are the configured key names only ("" for requests
        # without a known key: refused before authentication, or a server without keys)
        self.key_requests = Counter(
            "prismgate_key_requests", "Generation requests by the key that sent them.", ["key"], registry=r
        )
        self.key_tokens = Counter(
            "prismgate_key_tokens",
            "Tokens of finished generations by key: prompt (the whole timeline) and completion.",
            ["key", "kind"],
            registry=r,
        )
        self.key_refusals = Counter(
            "prismgate_key_refusals",
            'Requests refused, by key and gateway error code (UNAUTHENTICATED ones have no key: "").',
            ["key", "code"],
            registry=r,
        )
        self.model = Info("prismgate_model", "The model served and the engine that runs it.", registry=r)
        self.model_load = Gauge(
            "prismgate_model_load_seconds",
            "Seconds the engine took to load the model at start-up.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.ready = Gauge(
            "prismgate_ready",
            "1 once the model is loaded and the gateway serves; 0 while draining.",
            registry=r,
            multiprocess_mode="livemin",  # several front-ends: 1 only while every one of them serves
        )
        self._live: list[Collector] = [self.model]  # what exists only in this process (multiprocess view)
        self._merged: CollectorRegistry | None = None
        for protocol in KNOWN_PROTOCOLS:
            self.active.labels(protocol)
        if process_metrics:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def touch(self, protocol: str, model: str) -> None:
        """Create the protocol's series for ``model`` at zero (a counter that never moved is still a series)."""
        for metric in (
            self.requests,
            self.streamed_tokens,
            self.prompt_tokens,
            self.cached_tokens,
            self.prefilled_tokens,
            self.readout_tokens,
            self.ttft,
            self.itl,
            self.duration,
        ):
            metric.labels(protocol, model)

    def touch_keys(self, names: Iterable[str]) -> None:
        """Create each key's series at zero (refusals: for the codes a key's own rules give)."""
        for name in names:
            self.key_requests.labels(name)
            for kind in ("prompt", "completion"):
                self.key_tokens.labels(name, kind)
            for code in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED"):
                self.key_refusals.labels(name, code)

    def bind(self, service: SessionService) -> None:
        """Export the service's live state (admission queue, sessions), read at each scrape; one series per model."""
        collector = _ServiceCollector(service)
        self.registry.register(collector)
        self._live.append(collector)
        for protocol in KNOWN_PROTOCOLS:
            for model in service.models.names:
                self.touch(protocol, model)

    def exposed(self) -> CollectorRegistry:
        """The registry ``/metrics`` serves: this gateway's own, or with several front-end processes
        (``PROMETHEUS_MULTIPROC_DIR``, set by :mod:`prismgate.workers.supervisor`) every process's
        counters and histograms summed, ``prismgate_active_sessions`` summed over the live ones,
        ``prismgate_ready`` their minimum, and the engine host's live gauges (queue, slots, sessions),
        which every front-end mirrors, once. process_* and python_* series are left out of that view:
        they would describe one front-end only."""
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not folder:
            return self.registry
        if self._merged is None:
            merged = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(merged, path=folder)
            merged.register(_Live(self._live))
            self._merged = merged
        return self._merged

    def model_loaded(self, info: EngineInfo, seconds: float) -> None:
        self.model.info(
            {"model": info.model_id, "engine": info.engine_name or "unknown", "max_model_len": str(info.max_model_len)}
        )
        self.model_load.set(seconds)
        self.ready.set(1)


class _Live(Collector):
    """Collectors whose values live in this process only (the model's Info, the service's gauges)."""

    def __init__(self, collectors: list[Collector]) -> None:
        self._collectors = collectors

    def collect(self) -> Iterable[Metric]:
        for collector in self._collectors:
            yield from collector.collect()


class _ServiceCollector(Collector):
    """Gauges read from the pool and the session store when Prometheus scrapes (no bookkeeping of our own)."""

    def __init__(self, service: SessionService) -> None:
        self._service = service

    def collect(self) -> Iterable[Metric]:
        admission = self._service.pool.admission
        store = self._service.store
        yield GaugeMetricFamily(
            "prismgate_engine_queue_depth",
            "Generations waiting for an engine slot (admission queue, all protocols).",
            value=admission.queued,
        )
        yield GaugeMetricFamily(
            "prismgate_engine_active_requests", "Generations holding an engine slot.", value=admission.active
        )
        yield GaugeMetricFamily(
            "prismgate_engine_max_active", "Engine slots (settings.max_active).", value=admission.max_active
        )
        yield CounterMetricFamily(
            "prismgate_engine_preemptions",
            "Running generations paused to give their slot to a key with nothing running or far below its share "
            "(settings.preemption).",
            value=admission.preemptions,
        )
        yield CounterMetricFamily(
            "prismgate_engine_preemption_recomputes",
            "Of the preemptions, those that dropped the paused generation's keys and values to lend their memory "
            "to the newcomer; they are recomputed before it goes on.",
            value=admission.recomputes,
        )
        ready = GaugeMetricFamily("prismgate_model_ready", "1 when the model can take requests.", labels=["model"])
        for model, health in self._service.models.health().items():
            ready.add_metric([model], 1 if health.ready else 0)
        yield ready
        yield GaugeMetricFamily("prismgate_sessions_open", "Sessions held in the session store.", value=len(store))
        yield GaugeMetricFamily(
            "prismgate_session_tokens", "Tokens held by all stored sessions together.", value=store.total_tokens
        )


async def metrics_endpoint(request: Request) -> Response:
    """The Prometheus exposition (OpenMetrics when the scraper asks for it)."""
    metrics: GatewayMetrics | None = getattr(request.app.state, "metrics", None)
    registry = metrics.exposed() if metrics is not None else REGISTRY
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(registry), media_type=content_type)
