"""State shared by the nodes of a cluster, as plugins see it (docs/plugins.md §6).

The ledger's hash gate (docs/design.md §5) lives in Redis in cluster mode, so
that two nodes committing for one session at once still move it once. A plugin
reaches it through this interface only: :class:`LedgerGate` (what a gate does),
:class:`GateVerdict` (what one commit decided) and :class:`ClusterUnavailable`
(Redis could not be reached). :func:`proxy.open_ledger_gate` builds the Redis
implementation (``proxy._cluster.ledger``) on demand.

Nothing here imports redis: ``import proxy`` stays free of it, and so does a
plugin that only *may* run in cluster mode. Pure (no I/O).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

__all__ = ["ClusterUnavailable", "GateOutcomeName", "GateVerdict", "LedgerGate"]

GateOutcomeName = Literal["first", "identical", "reformat", "revision"]
"""What the hash gate decided for one commit (the ledger's ``GateOutcome`` values)."""


class ClusterUnavailable(Exception):
    """Redis could not be reached or did not answer within the command timeout.

    ``__cause__`` is the client's exception. The message never contains the
    Redis URL (it may carry a password).
    """


class GateVerdict(NamedTuple):
    """One commit through a shared gate: the outcome and the session's state after it.

    ``revision_epoch`` counts the verdict flips of the session (0 at first);
    ``dirty`` is set by a flip and cleared by :meth:`LedgerGate.mark_clean`.
    """

    outcome: GateOutcomeName
    revision_epoch: int
    dirty: bool


class LedgerGate(Protocol):
    """A per-session hash gate shared by every node (one atomic step per call).

    Every coroutine raises :class:`ClusterUnavailable` when the shared store
    cannot be reached in time; the gate did not move then.
    """

    async def apply(
        self,
        session_id: str,
        *,
        digest: str,
        comparable: bool,
        request_bytes: int,
        response_bytes: int,
        last_activity: float,
    ) -> GateVerdict:
        """Pass one committed exchange through the session's gate, atomically.

        ``digest`` is the hex wire digest and ``comparable`` the verdict of its
        request; ``request_bytes`` / ``response_bytes`` (bytes) are added to the
        session's counters; ``last_activity`` is Unix seconds. The outcome
        follows the gate table of docs/design.md §5: ``first`` (nothing saved),
        ``identical`` (same digest: nothing changes), ``reformat`` (new digest,
        same verdict), ``revision`` (verdict flipped: epoch + 1, dirty).
        """
        ...

    async def mark_clean(self, session_id: str, epoch: int | None = None) -> bool:
        """Clear ``dirty`` (only while the session is at ``epoch``, if given).

        Returns whether the flag was cleared: ``False`` for an unknown, already
        clean or moved-on session.
        """
        ...

    async def close(self) -> None:
        """Release the gate's connections; the gate is unusable afterwards."""
        ...
