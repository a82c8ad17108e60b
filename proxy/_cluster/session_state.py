"""A plugin's per-session state in Redis: :class:`proxy.SharedSessionState` for cluster mode.

An I/O edge over :class:`~proxy._cluster.store.RedisStore`: one hash per session
and plugin (``cp:{sid}:plugin:<name>``, with a TTL), read with one ``HGETALL``
and written in one ``MULTI`` transaction. A :class:`~proxy._cluster.ledger.Breaker`
fails calls fast while Redis does not answer, as for the ledger's gate. Built by
:func:`proxy.open_session_state`; plugins never import this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .ledger import Breaker
from .store import RedisStore

__all__ = ["RedisSessionState"]


class RedisSessionState:
    """A :class:`proxy.SharedSessionState` kept in one Redis hash per session.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        name: the plugin's name (part of the key).
        timeout: seconds per command (and for connecting), never retried.
        max_connections: size of the bounded connection pool (>= 2).

    Raises:
        ValueError: ``url`` is not a Redis URL (from the client).
    """

    __slots__ = ("_store", "breaker", "name")

    def __init__(self, url: str, *, name: str, timeout: float, max_connections: int) -> None:
        self.name: Final = name
        self._store: Final = RedisStore(url, timeout=timeout, max_connections=max_connections)
        self.breaker: Final = Breaker(0.9 * timeout)

    async def load(self, session_id: str) -> dict[str, str]:
        """See :meth:`proxy.SharedSessionState.load`. Raises ``ClusterUnavailable``."""
        return await self.breaker.call(lambda: self._store.plugin_state(session_id, self.name))

    async def save(
        self, session_id: str, put: dict[str, str], drop: Sequence[str], ttl: float
    ) -> None:
        """See :meth:`proxy.SharedSessionState.save`. Raises ``ClusterUnavailable``."""
        await self.breaker.call(
            lambda: self._store.save_plugin_state(session_id, self.name, put, drop, ttl)
        )

    async def close(self) -> None:
        """Close the pool's connections."""
        await self._store.close()
