"""The ledger's hash gate in Redis: :class:`proxy.LedgerGate` for cluster mode.

An I/O edge over :class:`~proxy._cluster.store.RedisStore`: each call is one
Lua script (``scripts.LEDGER_GATE`` / ``LEDGER_GATE_RUN`` / ``LEDGER_MARK_CLEAN``),
so the gate is atomic across nodes; :meth:`RedisLedgerGate.apply_runs` pipelines
one script per session in one round trip. Built by :func:`proxy.open_ledger_gate`;
plugins never import this module.

A circuit breaker (:class:`Breaker`) guards every call: once a call failed to
reach Redis (a timeout, a refused connection), the next calls fail at once with
:class:`~proxy.ClusterUnavailable`, without a round trip, for ``cool_off``
seconds; then one call goes through as a probe, and its success closes the
breaker (its failure opens it again). A hung Redis (a partition: no reset, every
command waits its whole timeout) then costs one timeout per cool-off, not one per
call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar, cast

from .._shared import ClusterUnavailable, GateOutcomeName, GateRun, GateVerdict
from .store import RedisStore

__all__ = ["Breaker", "RedisLedgerGate"]

_OUTCOMES: Final = frozenset({"first", "identical", "reformat", "revision"})
_T = TypeVar("_T")


class Breaker:
    """Fail fast while a dependency is known to be down; let one probe through to close.

    States: *closed* (calls go through), *open* (calls fail at once for
    ``cool_off`` seconds since the last failure), *probing* (the cool-off is
    over and one call is out; the others still fail at once). Synchronous,
    no I/O; ``clock`` is monotonic seconds.

    Counters: ``opened`` (closed -> open transitions: outages seen),
    ``fast_failures`` (calls refused without a round trip).
    """

    __slots__ = ("_clock", "_failed_at", "_probing", "cool_off", "fast_failures", "opened")

    def __init__(self, cool_off: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cool_off: Final = cool_off
        self._clock = clock
        self._failed_at: float | None = None  # None: closed
        self._probing = False
        self.opened = 0
        self.fast_failures = 0

    @property
    def is_open(self) -> bool:
        """Whether calls are refused or probed (a failure not yet followed by a success)."""
        return self._failed_at is not None

    async def call(self, run: Callable[[], Awaitable[_T]]) -> _T:
        """Await ``run()`` unless the breaker refuses it.

        Raises:
            ClusterUnavailable: refused (open, or another call is the probe), or
                raised by ``run`` (which opens the breaker).
        """
        if self._failed_at is not None:
            if self._probing or self._clock() - self._failed_at < self.cool_off:
                self.fast_failures += 1
                raise ClusterUnavailable("redis: unreachable moments ago (circuit open)")
            self._probing = True
        try:
            result = await run()
        except ClusterUnavailable:
            if self._failed_at is None:
                self.opened += 1
            self._failed_at = self._clock()
            raise
        finally:
            self._probing = False
        self._failed_at = None
        return result


class RedisLedgerGate:
    """A :class:`proxy.LedgerGate` kept in one Redis hash per session.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        timeout: seconds per command (and for connecting and for a free pooled
            connection).
        max_connections: size of the bounded connection pool (>= 2).
        cool_off: seconds the breaker refuses calls after a failure (default
            0.9 x ``timeout``: a caller retrying every ``timeout`` seconds finds
            it ready to probe).

    Raises:
        ValueError: ``url`` is not a Redis URL (from the client).
    """

    __slots__ = ("_store", "breaker")

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        max_connections: int,
        cool_off: float | None = None,
    ) -> None:
        self._store: Final = RedisStore(url, timeout=timeout, max_connections=max_connections)
        self.breaker: Final = Breaker(0.9 * timeout if cool_off is None else cool_off)

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
        outcome, epoch, dirty = await self.breaker.call(
            lambda: self._store.ledger_gate(
                session_id,
                digest=digest,
                comparable=comparable,
                request_bytes=request_bytes,
                response_bytes=response_bytes,
                last_activity=last_activity,
            )
        )
        return _verdict(outcome, epoch, dirty)

    async def apply_runs(self, writer: str, runs: Sequence[GateRun]) -> list[GateVerdict]:
        """See :meth:`proxy.LedgerGate.apply_runs`. Raises ``ClusterUnavailable``."""
        answers = await self.breaker.call(lambda: self._store.ledger_gate_runs(writer, runs))
        return [_verdict(*answer) for answer in answers]

    async def mark_clean(self, session_id: str, epoch: int | None = None) -> bool:
        """See :meth:`proxy.LedgerGate.mark_clean`. Raises ``ClusterUnavailable``."""
        return await self.breaker.call(lambda: self._store.ledger_mark_clean(session_id, epoch))

    async def close(self) -> None:
        """Close the pool's connections."""
        await self._store.close()


def _verdict(outcome: str, epoch: int, dirty: bool) -> GateVerdict:
    if outcome not in _OUTCOMES:  # the script and this table disagree: a defect
        raise RuntimeError(f"ledger gate script answered an unknown outcome {outcome!r}")
    return GateVerdict(cast(GateOutcomeName, outcome), epoch, dirty)
