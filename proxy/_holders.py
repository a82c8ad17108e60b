"""What holds an exchange's buffers, and the record of what it holds (docs/design.md §2).

Plain data types of :mod:`proxy._exchange`: the weak-referenceable
:class:`BodyHolder` (``bytes``, ``bytearray`` and ``memoryview`` cannot be
weak-referenced, and tests put finalizers on buffers), the :class:`HeldBytes`
record of ``held_bytes()`` and how it is counted (:func:`heap_parts`), and the
:class:`HeadHolder` interface of the upstream answer whose header fields the
exchange makes it forget. Nothing here drops a buffer: the exchange does (its
release contract).
"""

from __future__ import annotations

import dataclasses
import typing

from ._structure import ParsedHolder, Splice

__all__ = ["BodyHolder", "HeadHolder", "HeldBytes", "heap_parts", "on_view"]


class HeadHolder(typing.Protocol):
    """What holds the upstream answer's head (``proxy._upstream.UpstreamAnswer``)."""

    def drop_head(self) -> None:
        """Forget the header fields (idempotent)."""


class BodyHolder:
    """Weak-referenceable owner of one body buffer (``bytes``, ``bytearray``, or the
    read-only ``memoryview`` of a spooled body's mapping)."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)


@dataclasses.dataclass(frozen=True, slots=True)
class HeldBytes:
    """Bytes an exchange holds right now, by kind. ``parsed`` is an estimate.

    ``response`` is what the response side holds (the stream head held while a
    refold or resend is possible, the JSON head kept for usage, the partial-event
    tail), as last reported through :meth:`proxy._exchange.Exchange.hold_response`.

    ``spooled`` is the body bytes in the exchange's spool file (docs/design.md
    §2, "the spool"): file-backed, not process memory, so not in ``total``; a
    spooled raw body counts there and not in ``raw``.
    """

    raw: int
    parsed: int
    outbound: int
    response: int = 0
    spooled: int = 0

    @property
    def total(self) -> int:
        """``raw + parsed + outbound + response`` in bytes (memory; ``spooled`` apart)."""
        return self.raw + self.parsed + self.outbound + self.response


def on_view(holder: BodyHolder | Splice | None, view: memoryview | None) -> bool:
    """Whether ``holder`` is ``view`` (a spool file's mapping) or a splice over it."""
    if holder is None or view is None:
        return False
    if isinstance(holder, Splice):
        return holder.base is view
    return holder.data is view


def heap_parts(
    raw: BodyHolder | None,
    parsed: ParsedHolder | None,
    outbound: BodyHolder | Splice | None,
    spool_view: memoryview | None,
    spooled: bool,
    reading: int,
) -> tuple[int, int, int]:
    """Heap bytes an exchange holds, as ``(raw, parsed, outbound)`` of :class:`HeldBytes`.

    ``raw``: the raw buffer, or while reading the ``reading`` bytes received so
    far; 0 when the body is ``spooled`` (file-backed). ``parsed``: the parsed
    object's estimate. ``outbound``: what the outbound body holds beyond the raw
    buffer, which counts once (a splice's own pieces, plus its base when that is
    neither raw nor the spool's ``spool_view``).
    """
    raw_heap = 0 if spooled else (len(raw) if raw is not None else reading)
    parsed_bytes = parsed.estimate if parsed is not None else 0
    if outbound is None or outbound is raw:
        extra = 0
    elif isinstance(outbound, Splice):
        on_raw = (raw is not None and outbound.base is raw.data) or on_view(outbound, spool_view)
        extra = outbound.owned_bytes + (0 if on_raw else outbound.base_bytes)
    else:
        extra = 0 if on_view(outbound, spool_view) else len(outbound)
    return raw_heap, parsed_bytes, extra
