"""The built-in usage plugin: token usage per session and per model.

The proxy counts tokens from the protocol's usage events while it relays the
answer, without keeping any text, and hands the totals to ``commit`` as the
record's ``input_tokens``, ``output_tokens``, ``cache_read_tokens`` and
``cache_write_tokens`` (with Anthropic's 5-minute / 1-hour split where given;
``None`` when the upstream reported none). This plugin adds them up twice:

* per ``(protocol, model)``, exported as Prometheus counters
  ``context_proxy_input_tokens_total``, ``context_proxy_output_tokens_total``,
  ``context_proxy_cache_read_tokens_total`` and
  ``context_proxy_cache_write_tokens_total`` with labels ``protocol`` and
  ``model``; plus the histogram ``context_proxy_cached_input_share`` of each
  exchange's cached share of its input tokens (cache reads / input tokens, 0..1),
  same labels;
* per session, for ``GET /admin/sessions/{id}``: the same totals, the 5m/1h
  split of cache writes, and ``cached_input_share`` (the session's cache reads
  over its input tokens, 0..1, or null before any input token was reported).

Cache reads and writes are billed differently (a read costs about a tenth of
an uncached input token, a write more than one), so they are counted apart.
Why a histogram and no per-session gauge: a session id label would give every
session its own series for ever (unbounded cardinality); an operator alerting on
"the prompt cache stopped hitting" reads the per-model share distribution
(e.g. the fraction of exchanges below 0.5), and looks at one session's share in
its admin view. Exchanges that reported no input tokens are not observed.

``input_tokens`` always means the whole prompt, cached tokens included: the
proxy's usage meter adds Anthropic's ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` to its ``input_tokens`` so the figure compares
with OpenAI's ``prompt_tokens`` / ``input_tokens``, which already include them.

Metrics design: each proxy app has its own ``CollectorRegistry`` (several apps
live in one process in tests), so the plugin does not create global
``Counter`` objects. It keeps plain integer totals and is itself a Prometheus
collector (:meth:`UsagePlugin.collect`), rendered at scrape time by whichever
registry it is registered on: the app's, or the ``registry`` option's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import ClassVar, Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from proxy import ExchangeRecord, Outcome, Plugin, Scalar

__all__ = ["METRIC_NAMES", "UsagePlugin"]

_MODEL_LABEL_CHARS: Final = 128
_LABELS: Final = ("protocol", "model")

METRIC_NAMES: Final = (
    "context_proxy_input_tokens",
    "context_proxy_output_tokens",
    "context_proxy_cache_read_tokens",
    "context_proxy_cache_write_tokens",
)
"""The counters' family names (Prometheus adds ``_total`` to each sample)."""

SHARE_METRIC: Final = "context_proxy_cached_input_share"
"""The histogram of each exchange's cached share of input tokens (a ratio, 0..1)."""

#: Upper bounds of the share histogram's buckets (ratios); ``+Inf`` is added.
SHARE_BUCKETS: Final = (0.1, 0.25, 0.5, 0.75, 0.85, 0.9, 0.95, 0.99, 1.0)

_HELP: Final = (
    "Input (prompt) tokens reported by the upstream.",
    "Output (completion) tokens reported by the upstream.",
    "Input tokens the upstream served from its prompt cache.",
    "Input tokens the upstream wrote to its prompt cache.",
)
_SHARE_HELP: Final = "Share of an exchange's input tokens served from the prompt cache (0..1)."


class _Totals:
    """Token totals of one session or one ``(protocol, model)`` label pair."""

    __slots__ = (
        "cache_read_tokens",
        "cache_write_1h_tokens",
        "cache_write_5m_tokens",
        "cache_write_tokens",
        "input_tokens",
        "output_tokens",
        "requests",
        "share_buckets",
        "share_count",
        "share_sum",
    )

    def __init__(self) -> None:
        self.input_tokens = 0
        self.output_tokens = 0
        self.cache_read_tokens = 0
        self.cache_write_tokens = 0
        self.cache_write_5m_tokens = 0
        self.cache_write_1h_tokens = 0
        self.requests = 0
        # Share histogram (used for the per-model totals only): non-cumulative
        # counts per SHARE_BUCKETS bound, observation count and sum.
        self.share_buckets = [0] * len(SHARE_BUCKETS)
        self.share_count = 0
        self.share_sum = 0.0

    def observe_share(self, record: ExchangeRecord) -> None:
        """Add the record's cached share to the histogram, if it reported input tokens."""
        inputs = record.input_tokens or 0
        if inputs <= 0:
            return
        share = min(1.0, max(0, record.cache_read_tokens or 0) / inputs)
        for i, bound in enumerate(SHARE_BUCKETS):
            if share <= bound:
                self.share_buckets[i] += 1
                break
        self.share_count += 1
        self.share_sum += share

    def cached_share(self) -> float | None:
        """Cache reads over input tokens (0..1), None before any input token."""
        if self.input_tokens <= 0:
            return None
        return min(1.0, self.cache_read_tokens / self.input_tokens)

    def add(self, record: ExchangeRecord) -> None:
        # None (no usage reported) adds nothing; a negative count is a broken
        # upstream and must not make a counter go down.
        self.input_tokens += max(0, record.input_tokens or 0)
        self.output_tokens += max(0, record.output_tokens or 0)
        self.cache_read_tokens += max(0, record.cache_read_tokens or 0)
        self.cache_write_tokens += max(0, record.cache_write_tokens or 0)
        self.cache_write_5m_tokens += max(0, record.cache_write_5m_tokens or 0)
        self.cache_write_1h_tokens += max(0, record.cache_write_1h_tokens or 0)
        self.requests += 1


class UsagePlugin(Plugin):
    """Token usage per model (Prometheus collector) and per session (admin view).

    Options (the ``[plugin.usage]`` table):

    ``max_sessions`` (int, >= 1)
        Sessions whose totals are kept; beyond it the least recently active
        one is forgotten. A closed session is forgotten at once. Default 10000.
    ``max_models`` (int, >= 1)
        Distinct ``model`` label values. The model comes from the client's
        request, so a client inventing names must not grow the metrics without
        bound: later new models are counted as ``other``. Values are cut to 128
        characters; a missing model is ``unknown``. Default 256.

    From code only: ``registry``. If given, the plugin registers itself on it
    in :meth:`startup` and unregisters in :meth:`shutdown`, so apps built one
    after another on one registry never collide. Without it the plugin
    registers nowhere and the host exports it (it has ``collect()``).

    Raises:
        ValueError: on construction, for an option out of range.
    """

    name: ClassVar[str] = "usage"

    def __init__(
        self,
        *,
        max_sessions: int = 10_000,
        max_models: int = 256,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ValueError(f"max_sessions: expected an int >= 1, got {max_sessions!r}")
        if not (isinstance(max_models, int) and max_models >= 1):
            raise ValueError(f"max_models: expected an int >= 1, got {max_models!r}")
        self.max_sessions: Final = max_sessions
        self.max_models: Final = max_models
        self.registry: Final = registry
        self._registered = False
        self._sessions: OrderedDict[str, _Totals] = OrderedDict()  # least recent first
        self._by_label: dict[tuple[str, str], _Totals] = {}
        self._models: set[str] = set()

    # -- hooks -----------------------------------------------------------------------------

    async def startup(self) -> None:
        """Register on ``registry`` if one was given.

        Raises:
            ValueError: another live collector on that registry already uses
                one of :data:`METRIC_NAMES` (e.g. a second usage plugin).
        """
        if self.registry is not None and not self._registered:
            self.registry.register(self)
            self._registered = True

    async def commit(self, record: ExchangeRecord) -> None:
        """Count the record's tokens, whatever its outcome.

        A failed exchange can still have been billed (a stream cut after its
        usage event), so every record counts; ``None`` counts add nothing. A
        record without a session id counts in the metrics only, and so does a
        request refused because its session was closed: the session's totals were
        forgotten in :meth:`session_closed`, and the refusal must not bring them back.
        A record without a wire digest (refused before its body was parsed, or a
        passthrough route) is not counted at all: it never reached an upstream as
        an exchange, so it has no usage, and counting it would only add series of
        zeros (model ``unknown``) and inflate a session's ``requests``.
        """
        if not record.wire_digest:
            return
        key = (record.protocol, self.model_label(record.model))
        totals = self._by_label.get(key)
        if totals is None:
            totals = self._by_label[key] = _Totals()
        totals.add(record)
        totals.observe_share(record)
        sid = record.session_id
        if sid is None or _refused_as_closed(record):
            return
        usage = self._sessions.get(sid)
        if usage is None:
            usage = self._sessions[sid] = _Totals()
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(sid)
        usage.add(record)

    async def session_closed(self, session_id: str) -> None:
        """Forget the session's totals (the per-model counters keep them)."""
        self._sessions.pop(session_id, None)

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """The session's totals, or ``{}`` for a session not (or no longer) known.

        Keys: ``input_tokens``, ``output_tokens``, ``cache_read_tokens``,
        ``cache_write_tokens``, ``cache_write_5m_tokens``, ``cache_write_1h_tokens``
        and ``requests`` (ints), ``cached_input_share`` (float 0..1, or None
        before any input token was reported).
        """
        usage = self._sessions.get(session_id)
        if usage is None:
            return {}
        return {
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cache_read_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "cache_write_5m_tokens": usage.cache_write_5m_tokens,
            "cache_write_1h_tokens": usage.cache_write_1h_tokens,
            "cached_input_share": usage.cached_share(),
            "requests": usage.requests,
        }

    async def shutdown(self) -> None:
        """Unregister from ``registry`` (if registered)."""
        if self.registry is not None and self._registered:
            self.registry.unregister(self)
            self._registered = False

    # -- Prometheus collector protocol -----------------------------------------------------

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The metric families without samples (used by a registry to check names)."""
        for name, help_text in zip(METRIC_NAMES, _HELP, strict=True):
            yield CounterMetricFamily(name, help_text, labels=_LABELS)
        yield HistogramMetricFamily(SHARE_METRIC, _SHARE_HELP, labels=_LABELS)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The token counters and the share histogram, per ``(protocol, model)`` seen.

        May be called from a scrape thread: it copies the totals first (a dict
        copy is atomic under the GIL) and only reads ints afterwards.
        """
        snapshot = self._by_label.copy()
        families = [
            CounterMetricFamily(name, help_text, labels=_LABELS)
            for name, help_text in zip(METRIC_NAMES, _HELP, strict=True)
        ]
        share = HistogramMetricFamily(SHARE_METRIC, _SHARE_HELP, labels=_LABELS)
        for (protocol, model), totals in sorted(snapshot.items()):
            labels = (protocol, model)
            families[0].add_metric(labels, totals.input_tokens)
            families[1].add_metric(labels, totals.output_tokens)
            families[2].add_metric(labels, totals.cache_read_tokens)
            families[3].add_metric(labels, totals.cache_write_tokens)
            counts = list(totals.share_buckets)
            buckets: list[tuple[str, float]] = []
            running = 0
            for bound, count in zip(SHARE_BUCKETS, counts, strict=True):
                running += count
                buckets.append((str(bound), running))
            buckets.append(("+Inf", totals.share_count))
            share.add_metric(list(labels), buckets, totals.share_sum)
        yield from families
        yield share

    # -- helpers ---------------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """The ``model`` label value for ``model``: capped in number, cut in length."""
        if not model:
            return "unknown"
        label = model[:_MODEL_LABEL_CHARS]
        if label in self._models:
            return label
        if len(self._models) >= self.max_models:
            return "other"
        self._models.add(label)
        return label


def _refused_as_closed(record: ExchangeRecord) -> bool:
    """A request the proxy refused (503) because its session was already closed."""
    return record.outcome is Outcome.REJECTED and record.error == "session_closed"
