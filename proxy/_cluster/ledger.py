"""The ledger's hash gate in Redis: :class:`proxy.LedgerGate` for cluster mode.

An I/O edge over :class:`~proxy._cluster.store.RedisStore`: each call is one
Lua script (``scripts.LEDGER_GATE`` / ``LEDGER_MARK_CLEAN``), so the gate is
atomic across nodes. Built by :func:`proxy.open_ledger_gate`; plugins never
import this module.
"""

from __future__ import annotations

from typing import Final, cast

from .._shared import GateOutcomeName, GateVerdict
from .store import RedisStore

__all__ = ["RedisLedgerGate"]

_OUTCOMES: Final = frozenset({"first", "identical", "reformat", "revision"})


class RedisLedgerGate:
    """A :class:`proxy.LedgerGate` kept in one Redis hash per session.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        timeout: seconds per command (and for connecting and for a free pooled
            connection).
        max_connections: size of the bounded connection pool (>= 2).

    Raises:
        ValueError: ``url`` is not a Redis URL (from the client).
    """

    __slots__ = ("_store",)

    def __init__(self, url: str, *, timeout: float, max_connections: int) -> None:
        self._store: Final = RedisStore(url, timeout=timeout, max_connections=max_connections)

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
        """See :meth:`proxy.LedgerGate.apply`. Raises ``ClusterUnavailable``."""
        outcome, epoch, dirty = await self._store.ledger_gate(
            session_id,
            digest=digest,
            comparable=comparable,
            request_bytes=request_bytes,
            response_bytes=response_bytes,
            last_activity=last_activity,
        )
        if outcome not in _OUTCOMES:  # the script and this table disagree: a defect
            raise RuntimeError(f"ledger gate script answered an unknown outcome {outcome!r}")
        return GateVerdict(cast(GateOutcomeName, outcome), epoch, dirty)

    async def mark_clean(self, session_id: str, epoch: int | None = None) -> bool:
        """See :meth:`proxy.LedgerGate.mark_clean`. Raises ``ClusterUnavailable``."""
        return await self._store.ledger_mark_clean(session_id, epoch)

    async def close(self) -> None:
        """Close the pool's connections."""
        await self._store.close()
