"""Prometheus metrics of one proxy instance (``GET /metrics``).

Each app has its own ``CollectorRegistry`` so several proxies (tests, embedded
use) can live in one process. Gauges that describe live state (bytes held by
phase, sessions, tombstones) are computed at scrape time from the app state
rather than kept up to date on every change. The series a finished exchange
updates are lock-free tallies (:mod:`proxy._tally`) rendered at scrape time in
prometheus-client's own text format. Every series is listed in the README's
metrics table.

Names follow the Prometheus conventions (https://prometheus.io/docs/practices/naming/):
base units (seconds, bytes), ``_total`` on counters, ``code`` for an HTTP
status. No ``_created`` series: importing this module turns them off for the
process (prometheus-client has no per-registry switch), since they double the
series count and no alert reads them.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterable, Iterator, Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Final, Protocol

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ._fdlimit import EXHAUSTED_MESSAGE
from ._phases import Phase
from ._protocols import Protocol as ApiProtocol
from ._tally import CounterTally, GaugeTally, HistogramSeries, HistogramTally, Tally, TallyCollector

if TYPE_CHECKING:
    from ._exchange import Exchange

__all__ = ["BODY_BUCKETS", "HELD_KINDS", "LIVE_PHASES", "TIME_BUCKETS", "LiveSource", "Metrics"]

disable_created_metrics()  # type: ignore[no-untyped-call]

#: Seconds, for time to first byte and exchange duration: a cached answer starts
#: within milliseconds, a long agent turn streams for minutes (5 ms to 10 min).
TIME_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: Bytes, for request bodies: 1 KiB to 256 MiB in steps of four.
BODY_BUCKETS: Final = tuple(float(1024 * 4**i) for i in range(10))
#: Buffer kinds of ``context_proxy_held_bytes`` (the fields of ``HeldBytes``).
HELD_KINDS: Final = ("raw", "parsed", "outbound", "response", "spooled")
#: Phases an exchange can be in while listed as in flight, or when its client hangs up.
LIVE_PHASES: Final = tuple(phase.value for phase in Phase if phase is not Phase.CLOSED)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


class _Registry(Protocol):
    @property
    def session_count(self) -> int: ...
    @property
    def tombstone_count(self) -> int: ...


class _Host(Protocol):
    @property
    def plugins(self) -> Iterable[object]: ...


class _Cluster(Protocol):
    @property
    def degraded(self) -> bool: ...
    @property
    def reconciles(self) -> int: ...
    def in_flight_entries(self) -> int: ...


class LiveSource(Protocol):
    """What the metrics read at scrape time: the shape of ``proxy._state.AppState``.

    Declared here, structurally, so that this module does not import the state
    that owns it (imports point one way: state -> metrics).
    """

    @property
    def exchanges(self) -> Mapping[str, Exchange]: ...
    @property
    def registry(self) -> _Registry: ...
    @property
    def host(self) -> _Host: ...
    @property
    def draining(self) -> bool: ...
    @property
    def cluster(self) -> _Cluster | None: ...


class _LiveCollector(Collector):
    """Scrape-time gauges read from the app state."""

    def __init__(self, state: LiveSource) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state
        held = GaugeMetricFamily(
            "context_proxy_held_bytes",
            "Bytes held by in-flight exchanges, by phase and buffer kind",
            labels=["phase", "kind"],
        )
        # Every (phase, kind) from the first scrape, at 0 while nothing is held:
        # a series that appears only once it is non-zero defeats rate() and alerts.
        totals = dict.fromkeys(((phase, kind) for phase in LIVE_PHASES for kind in HELD_KINDS), 0)
        for ex in list(state.exchanges.values()):
            h = ex.held_bytes()
            phase = ex.phase.value
            for kind, value in (
                ("raw", h.raw),
                ("parsed", h.parsed),
                ("outbound", h.outbound),
                ("response", h.response),
                ("spooled", h.spooled),
            ):
                totals[(phase, kind)] = totals.get((phase, kind), 0) + value
        for (phase, kind), value in sorted(totals.items()):
            held.add_metric([phase, kind], value)
        yield held
        sessions = GaugeMetricFamily("context_proxy_sessions", "Live sessions in the registry")
        sessions.add_metric([], state.registry.session_count)
        yield sessions
        tombstones = GaugeMetricFamily("context_proxy_tombstones", "Session tombstones kept")
        tombstones.add_metric([], state.registry.tombstone_count)
        yield tombstones
        draining = GaugeMetricFamily("context_proxy_draining", "1 while the proxy drains")
        draining.add_metric([], 1 if state.draining else 0)
        yield draining
        cluster = state.cluster
        if cluster is not None:
            degraded = GaugeMetricFamily(
                "context_proxy_cluster_degraded",
                "1 while Redis is unreachable and the node serves with its local view",
            )
            degraded.add_metric([], 1 if cluster.degraded else 0)
            yield degraded
            entries = GaugeMetricFamily(
                "context_proxy_cluster_in_flight_entries",
                "In-flight entries this node holds in Redis (refreshed by its heartbeat)",
            )
            entries.add_metric([], cluster.in_flight_entries())
            yield entries
            reconciles = GaugeMetricFamily(
                "context_proxy_cluster_reconciles",
                "Reconciles with Redis after an outage since start",
            )
            reconciles.add_metric([], cluster.reconciles)
            yield reconciles


class Metrics:
    """Counters and gauges of one proxy instance, in their own registry."""

    def __init__(self, state: LiveSource) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The process (RSS, fds, CPU), GC and platform collectors read process-wide
        # facts; the default registry's instances serve any number of registries.
        for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):
            r.register(collector)
        build = Gauge(
            "context_proxy_build_info",
            "Always 1; the labels name the versions running",
            ["version", "python_version"],
            registry=r,
        )
        build.labels(_version("context-proxy"), platform.python_version()).set(1)
        # The per-request series are plain numbers (proxy/_tally.py): a finished
        # exchange updates a dozen of them, and prometheus-client's types lock each time.
        self.requests = CounterTally(
            "context_proxy_requests",
            "Finished requests, by protocol, HTTP status code and outcome",
            ["protocol", "code", "outcome"],
        )
        # Labelled children by (protocol, status, outcome) as the exchange holds them,
        # so a finished exchange needs no label strings.
        self._requests_by_key: dict[tuple[object, object, str], Tally] = {}
        self.ttfb = HistogramTally(
            "context_proxy_time_to_first_byte_seconds",
            "Seconds from the request's arrival to the first response byte sent to the client",
            ["protocol"],
            buckets=TIME_BUCKETS,
        )
        self.duration = HistogramTally(
            "context_proxy_exchange_duration_seconds",
            "Seconds from the request's arrival to the end of its exchange",
            ["protocol"],
            buckets=TIME_BUCKETS,
        )
        self.body_size = HistogramTally(
            "context_proxy_request_body_bytes",
            "Request body size in bytes (decoded), per exchange with a body",
            buckets=BODY_BUCKETS,
        )
        self._timing_by_protocol: dict[object, tuple[HistogramSeries, HistogramSeries]] = {}
        self.fd_exhausted = CounterTally(
            "context_proxy_fd_exhausted",
            "Requests answered 503 because the process ran out of file descriptors",
        )
        self.memory_refused = CounterTally(
            "context_proxy_memory_refused",
            "Requests answered 503 because memory could not be reserved (MemoryError)",
        )
        self.spool_full = CounterTally(
            "context_proxy_spool_full",
            "Requests answered 503 because spool_dir could not take their body"
            " (ENOSPC, EDQUOT, a file-size limit)",
        )
        self.spooled = CounterTally(
            "context_proxy_spooled_bodies",
            "Request bodies kept in the spool (over spool_above_bytes) instead of memory",
        )
        self.in_flight = GaugeTally("context_proxy_in_flight", "In-flight exchanges")
        self.releases = CounterTally(
            "context_proxy_releases", "Exchanges whose buffers were released"
        )
        self.refolds = CounterTally("context_proxy_refolds", "Overflow refolds")
        self.retries = CounterTally("context_proxy_retries", "Fake-completion resends")
        self.disconnects = CounterTally(
            "context_proxy_client_disconnects",
            "Clients gone before the end, by phase",
            ["phase"],
        )
        self.internal_errors = CounterTally(
            "context_proxy_internal_errors",
            "Unexpected exceptions in the proxy's own request handling (answered 500)",
            ["protocol"],
        )
        # Small, known label sets: every child exists (at 0) from the start.
        for phase in LIVE_PHASES:
            self.disconnects.labels(phase)
        for protocol in ApiProtocol:
            self.internal_errors.labels(str(protocol))
        self.bodies_read = CounterTally(
            "context_proxy_exchanges_read",
            "Exchanges whose request body was read; each one is committed exactly once",
        )
        self.request_bytes = CounterTally(
            "context_proxy_request_bytes", "Request body bytes received (decoded)"
        )
        self.response_bytes = CounterTally(
            "context_proxy_response_bytes", "Response bytes relayed to clients"
        )
        r.register(
            TallyCollector(
                [
                    self.requests,
                    self.ttfb,
                    self.duration,
                    self.body_size,
                    self.fd_exhausted,
                    self.memory_refused,
                    self.spool_full,
                    self.spooled,
                    self.in_flight,
                    self.releases,
                    self.refolds,
                    self.retries,
                    self.disconnects,
                    self.internal_errors,
                    self.bodies_read,
                    self.request_bytes,
                    self.response_bytes,
                ]
            )
        )
        r.register(_LiveCollector(state))
        for plugin in state.host.plugins:
            # A plugin that exports metrics is a prometheus Collector (has collect()).
            if callable(getattr(plugin, "collect", None)):
                r.register(plugin)  # type: ignore[arg-type]

    def finished(self, ex: Exchange) -> None:
        """Count a finished exchange (called once, from the handler's ``finally``)."""
        key = (ex.protocol, ex.status, ex.outcome)
        child = self._requests_by_key.get(key)
        if child is None:
            child = self._requests_by_key[key] = self.requests.labels(
                str(ex.protocol), str(ex.status), ex.outcome.value
            )
        child.inc()
        timing = self._timing_by_protocol.get(ex.protocol)
        if timing is None:
            label = str(ex.protocol)
            timing = self._timing_by_protocol[ex.protocol] = (
                self.ttfb.labels(label),
                self.duration.labels(label),
            )
        if ex.ttfb is not None:
            timing[0].observe(ex.ttfb)
        timing[1].observe(time.monotonic() - ex.started)
        self.releases.inc(ex.releases)
        if ex.refolds:
            self.refolds.inc(ex.refolds)
        if ex.retries:
            self.retries.inc(ex.retries)
        if ex.meta is not None:
            self.request_bytes.inc(ex.meta.byte_length)
            self.body_size.observe(ex.meta.byte_length)
        self.response_bytes.inc(ex.response_bytes)
        if ex.error == EXHAUSTED_MESSAGE:
            self.fd_exhausted.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
