"""Cluster mode end to end: a real redis-server, real nginx, three node processes.

Each test starts its own cluster (tests/cluster_support.py): redis-server and
the emulator on loopback ports, three ``python -m proxy serve`` processes with
``CONTEXT_PROXY_REDIS_URL`` set, nginx hashing the session id in front. Clients
are the real ``openai`` and ``anthropic`` SDKs (and plain aiohttp where a test
needs the status line). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from .cluster_support import Cluster, ProxyNode

pytestmark = pytest.mark.timeout(90)

GRACE = 1.0  # session_shutdown_timeout of the nodes, seconds
TTL = 1.5  # cluster_heartbeat_ttl of the nodes, seconds

_NODE_SETTINGS = {
    "session_shutdown_timeout": GRACE,
    "cluster_heartbeat_ttl": TTL,
    "shutdown_grace": 2.0,
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, n=3, settings=_NODE_SETTINGS)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _chat(text: str = "hi") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


async def _post(
    http: aiohttp.ClientSession, base: str, sid: str, *, script: str = ""
) -> tuple[int, str, str]:
    """One chat request; (status, body, the node that answered per nginx)."""
    headers = {"x-session-id": sid, "Authorization": "Bearer test"}
    if script:
        headers["x-emulator"] = script
    async with http.post(f"{base}/v1/chat/completions", json=_chat(), headers=headers) as resp:
        return resp.status, await resp.text(), resp.headers.get("X-Upstream-Node", "")


async def _delete(base: str, sid: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.delete(f"{base}/admin/sessions/{sid}") as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


def _admin(node: ProxyNode, path: str) -> Any:
    with urllib.request.urlopen(f"{node.url}{path}", timeout=5) as resp:
        return json.load(resp)


async def _wait_record(cluster: Cluster, sid: str, field: str, within: float = 10.0) -> None:
    """Until the emulator's record of ``sid``'s request has ``field`` true."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # bounded
        records = await asyncio.to_thread(cluster.emulator.stats)
        if any(r["headers"].get("x-session-id") == sid and r[field] for r in records):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the emulator never saw {field} for {sid}")


async def test_a_close_on_node_a_ends_the_stream_held_on_node_b(cluster: Cluster) -> None:
    a, b, c = cluster.nodes
    client = openai.AsyncOpenAI(base_url=f"{b.url}/v1", api_key="test", max_retries=0)
    stream = await client.chat.completions.create(
        **_chat(),
        stream=True,
        extra_headers={"x-session-id": "held", "x-emulator": "chunks=4; hold=never"},
    )
    chunks = aiter(stream)
    first = await asyncio.wait_for(anext(chunks), 10)
    assert first.choices[0].delta is not None
    await _wait_record(cluster, "held", "headers_sent")

    began = time.monotonic()
    answer = await asyncio.wait_for(_delete(a.url, "held"), GRACE + TTL + 10)
    with pytest.raises(openai.APIError, match="session closed"):
        async with asyncio.timeout(GRACE + 5):
            async for _ in chunks:
                pass
    assert time.monotonic() - began < GRACE + TTL + 3
    # B's exchange is in the cluster-wide counts; nothing is left in flight.
    assert answer["cancelled"] == 1 and answer["remaining"] == 0, answer
    assert not answer["already_closed"] and not answer["degraded"]
    await _wait_record(cluster, "held", "aborted_by_peer")
    async with aiohttp.ClientSession() as http:
        status, body, _ = await _post(http, c.url, "held")
    assert status == 503 and "session closed" in body
    assert (await _delete(b.url, "held"))["already_closed"]
    await client.close()
