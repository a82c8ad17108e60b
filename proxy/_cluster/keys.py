"""Redis key names of cluster mode (pure; docs/design.md §9).

Every key that belongs to one session carries the session id as a Redis Cluster
*hash tag* (``cp:{<sid>}:...``), so all of a session's keys live in one slot and
the Lua scripts that touch several of them run on one shard. The close stream
is the one key shared by every session; no script touches it together with a
session's keys (its ``XADD`` is a command of its own), so nothing crosses slots.

The tag is the text between the first ``{`` and the next ``}``; for an id that
itself contains ``}`` the tag ends inside the id, identically for each of its
keys, so they still share a slot.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CLOSE_STREAM", "PREFIX", "SessionKeys"]

PREFIX: Final = "cp:"
CLOSE_STREAM: Final = PREFIX + "closes"
"""The Redis stream every node tails for close commands (fields: sid, timeout, origin)."""


class SessionKeys:
    """The keys of one session.

    ``tombstone``: string (the close id), with the tombstone TTL.
    ``in_flight``: sorted set, member ``node|boot|exchange``, score = deadline in
    Redis-clock milliseconds (refreshed by the owning node's heartbeat).
    ``tally``: hash ``finished``, ``cancelled``, ``expired``, ``done`` of the
    close in progress or last completed (same TTL as the tombstone).
    ``ledger``: hash of the ledger's hash gate (``plugins/ledger.py``).
    :meth:`plugin`: hash of one plugin's shared session state
    (:class:`proxy._shared.SharedSessionState`), with a TTL.
    """

    __slots__ = ("in_flight", "ledger", "sid", "tally", "tombstone")

    def __init__(self, sid: str) -> None:
        base = f"{PREFIX}{{{sid}}}:"
        self.sid: Final = sid
        self.tombstone: Final = base + "tomb"
        self.in_flight: Final = base + "inflight"
        self.tally: Final = base + "close"
        self.ledger: Final = base + "ledger"

    def plugin(self, name: str) -> str:
        """The key of plugin ``name``'s shared state for this session."""
        return f"{PREFIX}{{{self.sid}}}:plugin:{name}"
