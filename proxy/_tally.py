"""Counters, gauges and histograms kept as plain numbers, exposed at scrape time.

prometheus-client's ``Counter`` / ``Gauge`` / ``Histogram`` take a lock on every
update (they may be shared by threads); a finished exchange makes about a dozen
updates, which cost more CPU than several of the proxy's own per-request steps.
Every series here is written only on the event loop, so no lock is needed: an
update is one addition (a histogram: one ``bisect`` and two additions). A
:class:`TallyCollector` registered on the registry turns the numbers into
metric families when ``/metrics`` is read, in the text format prometheus-client
renders for its own types (same names, ``_total`` suffix, ``le`` labels, no
``_created`` series).

Not thread-safe by design: update only from the event loop's thread.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import ClassVar, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = [
    "CounterTally",
    "GaugeTally",
    "HistogramSeries",
    "HistogramTally",
    "Tally",
    "TallyCollector",
]


def _le(bound: float) -> str:
    """A bucket's ``le`` label, formatted as prometheus-client formats its own."""
    text: str = floatToGoString(bound)  # type: ignore[no-untyped-call]
    return text


class Tally:
    """One series' value (a counter or gauge child): a plain number."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (a counter's callers pass only amounts >= 0)."""
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        """Subtract ``amount`` (gauges only)."""
        self.value -= amount


class _Family:
    """A metric family: label values -> child, the unlabelled child when it has no labels."""

    __slots__ = ("_children", "documentation", "labelnames", "name")

    #: The prometheus-client family the exposition is built with (per subclass).
    _rendered_as: ClassVar[type[CounterMetricFamily] | type[GaugeMetricFamily]]

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name: Final = name
        self.documentation: Final = documentation
        self.labelnames: Final = tuple(labelnames)
        self._children: dict[tuple[str, ...], Tally] = {}
        if not self.labelnames:
            self._children[()] = Tally()

    def labels(self, *values: str) -> Tally:
        """The child for these label values (created at 0 on first use).

        Raises:
            ValueError: the number of values is not the number of label names.
        """
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
            child = self._children[values] = Tally()
        return child

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` to the unlabelled series."""
        self._children[()].value += amount

    def dec(self, amount: float = 1) -> None:
        """Subtract ``amount`` from the unlabelled series (gauges only)."""
        self._children[()].value -= amount

    def value(self, *values: str) -> float:
        """The series' current value (0 for one never updated)."""
        child = self._children.get(values)
        return 0.0 if child is None else child.value

    def metric(self) -> Metric:
        """The family as prometheus-client renders the type it stands for."""
        family = self._rendered_as(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        return family


class CounterTally(_Family):
    """A counter family (exposed as ``<name>_total``)."""

    __slots__ = ()

    _rendered_as = CounterMetricFamily


class GaugeTally(_Family):
    """A gauge family."""

    __slots__ = ()

    _rendered_as = GaugeMetricFamily


class HistogramSeries:
    """One histogram series: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds: Final = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose upper bound is >= it."""
        self.total += amount
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1


class HistogramTally:
    """A histogram family with fixed upper bounds (``+Inf`` is added, as prometheus does).

    Raises:
        ValueError: ``buckets`` is not strictly increasing.
    """

    __slots__ = ("_bounds", "_children", "documentation", "labelnames", "name")

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if bounds[-1] != math.inf:
            bounds += (math.inf,)
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        self.name: Final = name
        self.documentation: Final = documentation
        self.labelnames: Final = tuple(labelnames)
        self._bounds: Final = bounds
        self._children: dict[tuple[str, ...], HistogramSeries] = {}
        if not self.labelnames:
            self._children[()] = HistogramSeries(bounds)

    def labels(self, *values: str) -> HistogramSeries:
        """The series for these label values (created empty on first use).

        Raises:
            ValueError: the number of values is not the number of label names.
        """
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
            child = self._children[values] = HistogramSeries(self._bounds)
        return child

    def observe(self, amount: float) -> None:
        """Observe ``amount`` in the unlabelled series."""
        self._children[()].observe(amount)

    def metric(self) -> Metric:
        """The family as prometheus-client renders a ``Histogram`` (cumulative buckets)."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip(child.bounds, child.counts, strict=True):
                cumulative += count
                buckets.append((_le(bound), float(cumulative)))
            family.add_metric(list(values), buckets, child.total)
        return family


class TallyCollector(Collector):
    """Exposes a fixed list of tally families, in the order given, at scrape time."""

    def __init__(self, families: Sequence[CounterTally | GaugeTally | HistogramTally]) -> None:
        self._families: Final = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.metric()
