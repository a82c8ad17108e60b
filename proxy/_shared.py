"""State shared by the nodes of a cluster, as plugins see it (docs/plugins.md §6).

The ledger's hash gate (docs/design.md §5) lives in Redis in cluster mode, so
that two nodes committing for one session at once still move it once. A plugin
reaches it through this interface only: :class:`LedgerGate` (what a gate does),
:class:`GateVerdict` (what one commit decided) and :class:`ClusterUnavailable`
(Redis could not be reached). :func:`proxy.open_ledger_gate` builds the Redis
implementation (``proxy._cluster.ledger``) on demand. :class:`SharedSessionState`
is a plugin's own per-session scalars in the same store (the ``fold`` plugin's
carried folds), built by :func:`proxy.open_session_state`.

Nothing here imports redis: ``import proxy`` stays free of it, and so does a
plugin that only *may* run in cluster mode. Pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

__all__ = [
    "ClusterUnavailable",
    "GateOutcomeName",
    "GateRun",
    "GateVerdict",
    "LedgerGate",
    "SharedSessionState",
]

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


class GateRun:
    """Consecutive commits of one session, folded for one atomic pass through the gate.

    The gate of docs/design.md §5 applied commit by commit is a function of the
    saved state and the sequence, and only the first commit of a run meets the
    saved state: every later one is classified against the one before it, which
    this object does as it is extended. So a run of any length is kept in a
    constant size: the first commit as it came, then for the rest the number of
    non-identical commits (``requests``) and their bytes, the verdict flips among
    them (``flips``, each a ``revision_epoch`` + 1), the newest digest and verdict
    and the newest ``last_activity``. Applying the run is exactly applying its
    commits one after another, with no other node's commit between them.

    Args:
        session_id: the session.
        digest / comparable / request_bytes / response_bytes / last_activity: the
            first commit (bytes; Unix seconds), as :meth:`LedgerGate.apply` takes them.
    """

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "commits",
        "comparable",
        "digest",
        "first_bytes_in",
        "first_bytes_out",
        "first_comparable",
        "first_digest",
        "first_last_activity",
        "flips",
        "last_activity",
        "requests",
        "seq",
        "session_id",
    )

    def __init__(
        self,
        session_id: str,
        *,
        digest: str,
        comparable: bool,
        request_bytes: int,
        response_bytes: int,
        last_activity: float,
    ) -> None:
        self.session_id = session_id
        self.first_digest = digest
        self.first_comparable = comparable
        self.first_bytes_in = request_bytes
        self.first_bytes_out = response_bytes
        self.first_last_activity = last_activity
        #: Commits folded in, identical ones included.
        self.commits = 1
        #: After the first: non-identical commits, their bytes, flips, newest activity.
        self.requests = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.flips = 0
        self.last_activity = last_activity
        #: The newest commit's digest and verdict (what the gate holds after the run).
        self.digest = digest
        self.comparable = comparable
        #: Set by the sender when the run is first sent (it is resent with the same
        #: number, so Redis applies it at most once); ``None`` before.
        self.seq: int | None = None

    def append(
        self,
        *,
        digest: str,
        comparable: bool,
        request_bytes: int,
        response_bytes: int,
        last_activity: float,
    ) -> GateOutcomeName:
        """Fold in one more commit; returns its outcome against the commit before it
        (``identical``, ``reformat`` or ``revision``; never ``first``)."""
        self.commits += 1
        if digest == self.digest:
            return "identical"
        outcome: GateOutcomeName = "reformat" if comparable == self.comparable else "revision"
        self.flips += outcome == "revision"
        self.requests += 1
        self.bytes_in += request_bytes
        self.bytes_out += response_bytes
        self.last_activity = max(self.last_activity, last_activity)
        self.digest = digest
        self.comparable = comparable
        return outcome

    def extend(self, later: GateRun) -> None:
        """Fold in ``later``, a run of the same session whose commits came after these."""
        self.append(
            digest=later.first_digest,
            comparable=later.first_comparable,
            request_bytes=later.first_bytes_in,
            response_bytes=later.first_bytes_out,
            last_activity=later.first_last_activity,
        )
        self.commits += later.commits - 1
        self.requests += later.requests
        self.bytes_in += later.bytes_in
        self.bytes_out += later.bytes_out
        self.flips += later.flips
        if later.requests:
            self.last_activity = max(self.last_activity, later.last_activity)
            self.digest = later.digest
            self.comparable = later.comparable


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

    async def apply_runs(self, writer: str, runs: Sequence[GateRun]) -> list[GateVerdict]:
        """Pass each run (:class:`GateRun`, its ``seq`` set) through its session's gate,
        each atomically, in one round trip; one verdict per run, in order: the outcome
        of the run's first commit and the session's state after the whole run.

        ``writer`` names the sender (unique per process start); a run whose ``seq``
        is not above the newest one applied for ``writer`` in that session changes
        nothing (verdict ``identical``), so a run resent after a timeout is applied
        once. A writer numbers its runs of one session in increasing order."""
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


class SharedSessionState(Protocol):
    """One plugin's per-session state shared by every node: a hash of short strings.

    Each session has one hash per plugin (its fields and values are the
    plugin's own encoding of scalars: never body bytes or text). Writes replace
    the named fields and delete others in one atomic step, and refresh the
    hash's lifetime. Every coroutine raises :class:`ClusterUnavailable` when the
    store cannot be reached in time; nothing changed then.
    """

    async def load(self, session_id: str) -> dict[str, str]:
        """The session's hash (``{}`` for none)."""
        ...

    async def save(
        self, session_id: str, put: dict[str, str], drop: Sequence[str], ttl: float
    ) -> None:
        """Set the fields of ``put``, delete those of ``drop``; the hash lives ``ttl`` s more."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...
