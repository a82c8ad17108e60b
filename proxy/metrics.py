"""Prometheus metrics of one proxy instance (``GET /metrics``).

Each app has its own ``CollectorRegistry`` so several proxies (tests, embedded
use) can live in one process. Gauges that describe live state (bytes held by
phase, sessions, tombstones) are computed at scrape time from the app state
rather than kept up to date on every change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .exchange import Exchange

__all__ = ["LiveSource", "Metrics"]


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
    """What the metrics read at scrape time: the shape of ``proxy.state.AppState``.

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
        totals: dict[tuple[str, str], int] = {}
        for ex in list(state.exchanges.values()):
            h = ex.held_bytes()
            phase = ex.phase.value
            for kind, value in (
                ("raw", h.raw),
                ("parsed", h.parsed),
                ("outbound", h.outbound),
                ("response", h.response),
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
        self.requests = Counter(
            "context_proxy_requests",
            "Finished requests",
            ["protocol", "status", "outcome"],
            registry=r,
        )
        # Labelled children by (protocol, status, outcome) as the exchange holds them:
        # labels() validates and locks on every call; a finished exchange needs one.
        self._requests_by_key: dict[tuple[object, object, str], Counter] = {}
        self.in_flight = Gauge("context_proxy_in_flight", "In-flight exchanges", registry=r)
        self.releases = Counter(
            "context_proxy_releases", "Exchanges whose buffers were released", registry=r
        )
        self.refolds = Counter("context_proxy_refolds", "Overflow refolds", registry=r)
        self.retries = Counter("context_proxy_retries", "Fake-completion resends", registry=r)
        self.disconnects = Counter(
            "context_proxy_client_disconnects",
            "Clients gone before the end, by phase",
            ["phase"],
            registry=r,
        )
        self.internal_errors = Counter(
            "context_proxy_internal_errors",
            "Unexpected exceptions in the proxy's own request handling (answered 500)",
            ["protocol"],
            registry=r,
        )
        self.bodies_read = Counter(
            "context_proxy_exchanges_read",
            "Exchanges whose request body was read; each one is committed exactly once",
            registry=r,
        )
        self.request_bytes = Counter(
            "context_proxy_request_bytes", "Request body bytes received (decoded)", registry=r
        )
        self.response_bytes = Counter(
            "context_proxy_response_bytes", "Response bytes relayed to clients", registry=r
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
        self.releases.inc(ex.releases)
        if ex.refolds:
            self.refolds.inc(ex.refolds)
        if ex.retries:
            self.retries.inc(ex.retries)
        if ex.meta is not None:
            self.request_bytes.inc(ex.meta.byte_length)
        self.response_bytes.inc(ex.response_bytes)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
