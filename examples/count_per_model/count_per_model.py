"""A context-proxy plugin that counts finished requests per model.

The walk-through of docs/plugins.md, section 3. Counts per model for the whole
process (a Prometheus counter on ``GET /metrics``, and a log line at shutdown)
and per session (``GET /admin/sessions/{id}``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily

from proxy import ExchangeRecord, Plugin, Scalar

log = logging.getLogger("count_per_model")

# Model names come from clients: cut them, so a silly name cannot bloat a label.
_MODEL_CHARS = 128


class CountPerModelPlugin(Plugin):
    """Counts finished requests (any outcome) per model and per session.

    Options (the ``[plugin.<entry>]`` table of the config file):

    ``max_models`` (int >= 1, default 100)
        Distinct model names counted by name; later new names count as ``other``.
    ``max_sessions`` (int >= 1, default 10000)
        Sessions whose counts are kept; beyond it the least recently active
        session is forgotten.

    Raises:
        ValueError: an option is out of range (the proxy refuses to start).
    """

    # One word for logs, the admin view and the metrics; keep it equal to the
    # entry-point name if you register one.
    name: ClassVar[str] = "count_per_model"

    def __init__(self, *, max_models: int = 100, max_sessions: int = 10_000) -> None:
        # Validate options here, open nothing: the proxy turns a ValueError into
        # one "bad options" line at start-up.
        for option, value in (("max_models", max_models), ("max_sessions", max_sessions)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{option}: expected an int >= 1, got {value!r}")
        self.max_models = max_models
        self.max_sessions = max_sessions
        self.by_model: dict[str, int] = {}
        # Least recently active first, so the oldest goes first at the cap.
        self._by_session: OrderedDict[str, int] = OrderedDict()

    async def commit(self, record: ExchangeRecord) -> None:
        """Count one finished exchange. No ``await`` here, so a timeout cannot cut it in half."""
        model = (record.model or "unknown")[:_MODEL_CHARS]
        if model not in self.by_model and len(self.by_model) >= self.max_models:
            model = "other"
        self.by_model[model] = self.by_model.get(model, 0) + 1
        sid = record.session_id
        if sid is None:
            return
        self._by_session[sid] = self._by_session.get(sid, 0) + 1
        self._by_session.move_to_end(sid)
        if len(self._by_session) > self.max_sessions:
            self._by_session.popitem(last=False)

    async def session_closed(self, session_id: str) -> None:
        """Forget the session (its requests stay in the per-model counts)."""
        self._by_session.pop(session_id, None)

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """``{"requests": n}`` for the admin view, or ``{}`` for a session never seen."""
        count = self._by_session.get(session_id)
        return {} if count is None else {"requests": count}

    def collect(self) -> Iterator[CounterMetricFamily]:
        """The Prometheus counter ``count_per_model_requests_total{model=...}``.

        Having ``collect()`` is what makes the proxy register the plugin on its
        metrics registry; it is called at every scrape.
        """
        family = CounterMetricFamily(
            "count_per_model_requests", "Finished requests per model.", labels=["model"]
        )
        for model, count in sorted(self.by_model.items()):
            family.add_metric([model], count)
        yield family

    async def shutdown(self) -> None:
        """Log the totals once, at graceful stop."""
        log.info("requests per model: %s", dict(sorted(self.by_model.items())))
