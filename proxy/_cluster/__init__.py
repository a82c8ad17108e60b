"""Cluster mode: several proxy nodes share session state through Redis (docs/design.md §9).

With ``redis_url`` unset nothing here is imported by the running proxy and the
proxy behaves as one embedded process. With it set, each node builds one
:class:`ClusterNode` over a :class:`RedisStore`:

* admission: tombstone check + in-flight registration in one Lua script;
* in-flight entries carry a deadline that the node's heartbeat refreshes;
* close: tombstone, then a command on a Redis stream every node tails;
* the ledger's hash gate as one Lua script (:class:`ledger.RedisLedgerGate`, which
  ``plugins/ledger.py`` gets through :func:`proxy.open_ledger_gate`).

See docs/cluster.md for the load balancer set-up and the Redis-down policy.
"""

from __future__ import annotations

import socket

from .node import Admission, ClusterCloseResult, ClusterNode
from .store import ClusterUnavailable, RedisStore, Tally

__all__ = [
    "Admission",
    "ClusterCloseResult",
    "ClusterNode",
    "ClusterUnavailable",
    "RedisStore",
    "Tally",
    "default_node_id",
]


def default_node_id(port: int) -> str:
    """``hostname:port``, the default ``node_id``."""
    return f"{socket.gethostname()}:{port}"
