"""The lock-free tallies render exactly what prometheus-client's own types render.

:mod:`proxy._tally` replaced ``Counter`` / ``Gauge`` / ``Histogram`` on the
per-request path; a scraper must not see any difference. The oracle is
prometheus-client itself: the same updates applied to its types and to the
tallies, in two registries, give byte-identical text expositions.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy._metrics import BODY_BUCKETS, TIME_BUCKETS
from proxy._tally import CounterTally, GaugeTally, HistogramTally, TallyCollector

_AMOUNTS = st.one_of(
    st.integers(min_value=0, max_value=10**9),
    st.floats(min_value=0, max_value=1e9, allow_nan=False),
    st.sampled_from([*TIME_BUCKETS, *BODY_BUCKETS, 0.0, math.inf]),
)
_LABELS = st.sampled_from(["openai-chat", "openai-responses", "anthropic-messages"])
_UPDATES = st.lists(
    st.tuples(st.sampled_from(["count", "gauge", "ttfb", "body"]), _LABELS, _AMOUNTS),
    max_size=60,
)


def _pair() -> tuple[CollectorRegistry, CollectorRegistry, dict[str, object], dict[str, object]]:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference: dict[str, object] = {
        "count": Counter("x_requests", "Requests", ["protocol"], registry=theirs),
        "plain": Counter("x_bytes", "Bytes", registry=theirs),
        "gauge": Gauge("x_in_flight", "In flight", registry=theirs),
        "ttfb": Histogram(
            "x_seconds", "Seconds", ["protocol"], buckets=TIME_BUCKETS, registry=theirs
        ),
        "body": Histogram("x_body_bytes", "Body bytes", buckets=BODY_BUCKETS, registry=theirs),
    }
    tallies: dict[str, object] = {
        "count": CounterTally("x_requests", "Requests", ["protocol"]),
        "plain": CounterTally("x_bytes", "Bytes"),
        "gauge": GaugeTally("x_in_flight", "In flight"),
        "ttfb": HistogramTally("x_seconds", "Seconds", ["protocol"], buckets=TIME_BUCKETS),
        "body": HistogramTally("x_body_bytes", "Body bytes", buckets=BODY_BUCKETS),
    }
    ours.register(TallyCollector(list(tallies.values())))  # type: ignore[arg-type]
    return theirs, ours, reference, tallies


def _apply(metrics: dict[str, object], kind: str, label: str, amount: float) -> None:
    m: object = metrics[kind]
    if kind == "count":
        m.labels(label).inc(amount)  # type: ignore[attr-defined]
        metrics["plain"].inc(amount)  # type: ignore[attr-defined]
    elif kind == "gauge":
        m.inc(amount)  # type: ignore[attr-defined]
        m.dec(amount / 2)  # type: ignore[attr-defined]
    elif kind == "ttfb":
        m.labels(label).observe(amount)  # type: ignore[attr-defined]
    else:
        m.observe(amount)  # type: ignore[attr-defined]


@given(_UPDATES)
def test_any_updates_render_byte_for_byte_as_prometheus_client_does(
    updates: list[tuple[str, str, float]],
) -> None:
    theirs, ours, reference, tallies = _pair()
    for kind, label, amount in updates:
        _apply(reference, kind, label, amount)
        _apply(tallies, kind, label, amount)
    assert generate_latest(ours) == generate_latest(theirs)


def test_nothing_updated_renders_the_same_zeros() -> None:
    theirs, ours, _, _ = _pair()
    assert generate_latest(ours) == generate_latest(theirs)


def test_label_values_must_match_the_label_names() -> None:
    with pytest.raises(ValueError, match="expected 1 label values"):
        CounterTally("x", "x", ["a"]).labels("1", "2")
    with pytest.raises(ValueError, match="expected 1 label values"):
        HistogramTally("h", "h", ["a"], buckets=(1.0,)).labels()
    with pytest.raises(ValueError, match="strictly increasing"):
        HistogramTally("h", "h", buckets=(2.0, 1.0))
