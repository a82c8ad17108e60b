"""Many concurrent cluster closes against a healthy Redis: pool waits are not outages.

A real redis-server, the emulator and three ``python -m proxy serve`` nodes
(tests/support/cluster.py). Each session holds one stream on one node and is
closed by a ``DELETE`` sent to the next node, all at once: every node's
64-connection Redis pool is far smaller than the Redis work in flight, so
callers queue for a connection. A node must not take that queue for an outage
(degraded mode answers with its local counts only, without waiting for the
other nodes' streams). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.cluster import Cluster, ProxyNode

pytestmark = pytest.mark.timeout(300)

SESSIONS = 1000
GRACE = 0.5  # session_shutdown_timeout of the nodes, seconds: the held streams outlive it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = Path(tmp_path_factory.mktemp("mass-close"))
    settings = {
        "session_shutdown_timeout": GRACE,
        "cluster_heartbeat_ttl": 3.0,
        "shutdown_grace": 3.0,
        "access_log": "false",
    }
    c = Cluster(workdir, n=3, settings=settings)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def _hold(http: aiohttp.ClientSession, node: ProxyNode, sid: str) -> aiohttp.ClientResponse:
    """A chat stream of ``sid`` on ``node``, held by the emulator after its first event."""
    resp = await http.post(
        f"{node.url}/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        headers={
            "x-session-id": sid,
            "Authorization": "Bearer test",
            "x-emulator": f"chunks=4; hold=never-{sid}",
        },
    )
    assert resp.status == 200, await resp.text()
    first = await asyncio.wait_for(resp.content.readline(), 30)
    assert first.startswith(b"data:"), first
    return resp


async def _drain(resp: aiohttp.ClientResponse) -> bytes:
    """The rest of a held stream (it ends when its session's close cancels it)."""
    try:
        return await asyncio.wait_for(resp.content.read(), 60)
    finally:
        resp.release()


async def _delete(http: aiohttp.ClientSession, node: ProxyNode, sid: str) -> dict[str, Any]:
    async with http.delete(f"{node.url}/admin/sessions/{sid}") as resp:
        text = await resp.text()
        assert resp.status == 200, text
        answer: dict[str, Any] = json.loads(text)
        return answer


async def test_a_thousand_concurrent_closes_across_three_nodes_are_never_degraded(
    cluster: Cluster,
) -> None:
    nodes = cluster.nodes
    sids = [f"mass-{n}" for n in range(SESSIONS)]
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        opening = asyncio.Semaphore(100)  # opened in waves; the closes are what runs at once

        async def hold(n: int) -> aiohttp.ClientResponse:
            async with opening:
                return await _hold(http, nodes[n % 3], sids[n])

        streams = await asyncio.gather(*(hold(n) for n in range(SESSIONS)))
        drains = [asyncio.ensure_future(_drain(resp)) for resp in streams]
        # Each session closed on the node after the one holding its stream.
        answers = await asyncio.gather(
            *(_delete(http, nodes[(n + 1) % 3], sids[n]) for n in range(SESSIONS))
        )
        tails = await asyncio.gather(*drains)

    degraded = [sids[n] for n, a in enumerate(answers) if a["degraded"]]
    assert degraded == [], f"{len(degraded)} of {SESSIONS} closes answered degraded"
    # Every close waited for the stream held on another node: it ended (cancelled
    # after the grace) before the answer, and the answer counts it cluster-wide.
    counted = [a for a in answers if a["finished"] + a["cancelled"] + a["expired"] == 1]
    assert len(counted) == SESSIONS, [a for a in answers if a not in counted][:5]
    assert all(a["cancelled"] == 1 and a["remaining"] == 0 for a in answers)
    assert all(not a["already_closed"] for a in answers)
    assert len(tails) == SESSIONS
    for node in nodes:
        assert "Redis unreachable" not in node.log_text(), node.name
