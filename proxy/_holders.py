"""What holds an exchange's buffers, and the record of what it holds (docs/design.md §2).

Plain data types of :mod:`proxy._exchange`: the weak-referenceable
:class:`BodyHolder` (``bytes``, ``bytearray`` and ``memoryview`` cannot be
weak-referenced, and tests put finalizers on buffers), the :class:`HeldBytes`
record of ``held_bytes()``, and the :class:`HeadHolder` interface of the
upstream answer whose header fields the exchange makes it forget. Nothing here
drops a buffer: the exchange does (its release contract).
"""

from __future__ import annotations

import dataclasses
import typing

__all__ = ["BodyHolder", "HeadHolder", "HeldBytes"]


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
