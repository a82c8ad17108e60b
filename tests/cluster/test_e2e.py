"""Cluster mode end to end: a real redis-server, real nginx, three node processes.

One cluster per module (tests/support/cluster.py): redis-server and the
emulator on loopback ports, three ``python -m proxy serve`` processes with
``CONTEXT_PROXY_REDIS_URL`` set and the ledger enabled, nginx hashing the
session id in front (the configuration of docs/cluster.md). A test that stops
a node or Redis starts it again on the same port before it ends. Clients are
the real ``openai`` SDK, and aiohttp where a test needs status lines and
nginx's ``X-Upstream-Node`` header. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis

from tests.support.closed_log import closed_ids
from tests.support.cluster import Cluster, ProxyNode

pytestmark = pytest.mark.timeout(120)

GRACE = 1.0  # session_shutdown_timeout of the nodes, seconds
TTL = 1.5  # cluster_heartbeat_ttl of the nodes, seconds

_NODE_SETTINGS = {
    "session_shutdown_timeout": GRACE,
    "cluster_heartbeat_ttl": TTL,
    "shutdown_grace": 3.0,
    "plugins": "ledger,tests.support.closed_log:ClosedLog",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = Path(tmp_path_factory.mktemp("cluster"))
    # Each node's ClosedLog writes the ids its plugins were told are closed here.
    plugin = {"tests.support.closed_log:ClosedLog": {"directory": str(workdir)}}
    settings = {**_NODE_SETTINGS, "plugin": json.dumps(plugin)}
    c = Cluster(workdir, n=3, settings=settings)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def rdb(cluster: Cluster) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(cluster.redis.url, decode_responses=True, socket_timeout=2)
    try:
        yield client
    finally:
        client.close()


def _chat(text: str = "hi", *, image: bool = False) -> dict[str, Any]:
    content: Any = text
    if image:
        content = [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def _post(
    http: aiohttp.ClientSession,
    base: str,
    sid: str,
    *,
    body: dict[str, Any] | None = None,
    script: str = "",
) -> tuple[int, str, str]:
    """One chat request; (status, body, ``host:port`` of the node per nginx, if via nginx)."""
    headers = {"x-session-id": sid, "Authorization": "Bearer test"}
    if script:
        headers["x-emulator"] = script
    async with http.post(
        f"{base}/v1/chat/completions", json=body or _chat(), headers=headers
    ) as resp:
        return resp.status, await resp.text(), resp.headers.get("X-Upstream-Node", "")


async def _delete(base: str, sid: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.delete(f"{base}/admin/sessions/{sid}") as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


def _get(node: ProxyNode, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"{node.url}{path}", timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
    except OSError:
        return 0, {}  # not listening


def _metrics(node: ProxyNode) -> dict[str, float]:
    """The node's unlabelled metrics, name -> value."""
    with urllib.request.urlopen(f"{node.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


def _in_flight_keys(rdb: redis.Redis) -> dict[str, list[str]]:
    return {key: list(rdb.zrange(key, 0, -1)) for key in rdb.scan_iter("cp:*:inflight", count=1000)}


async def _until(condition: Any, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # bounded
        if await asyncio.to_thread(condition):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"not {what} within {within} s")


def _record_has(cluster: Cluster, sid: str, field: str) -> bool:
    return any(
        r["headers"].get("x-session-id") == sid and r[field] for r in cluster.emulator.stats()
    )


async def _held_stream(node: ProxyNode, sid: str) -> tuple[openai.AsyncOpenAI, Any]:
    """A chat stream of ``sid`` on ``node`` that the emulator holds after its first event."""
    client = openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key="test", max_retries=0)
    stream = await client.chat.completions.create(
        **_chat(),
        stream=True,
        extra_headers={"x-session-id": sid, "x-emulator": f"chunks=4; hold=never-{sid}"},
    )
    chunks = aiter(stream)
    first = await asyncio.wait_for(anext(chunks), 10)
    assert first.choices[0].delta is not None
    return client, chunks


# ----------------------------------------------------------------------------- tests


async def test_a_close_on_node_a_ends_the_stream_held_on_node_b(
    cluster: Cluster, rdb: redis.Redis
) -> None:
    a, b, c = cluster.nodes
    client, chunks = await _held_stream(b, "held")
    await _until(lambda: _record_has(cluster, "held", "headers_sent"), "upstream answering")

    began = time.monotonic()
    answer = await asyncio.wait_for(_delete(a.url, "held"), GRACE + TTL + 10)
    with pytest.raises(openai.APIError, match="session closed") as cut:
        async with asyncio.timeout(GRACE + 5):
            async for _ in chunks:
                pass
    assert cut.value.code == "session_closed"
    assert time.monotonic() - began < GRACE + TTL + 3
    # B's exchange is in the cluster-wide counts; nothing is left in flight.
    assert answer["cancelled"] == 1 and answer["remaining"] == 0, answer
    assert not answer["already_closed"] and not answer["degraded"]
    await _until(lambda: _record_has(cluster, "held", "aborted_by_peer"), "upstream aborted")
    async with aiohttp.ClientSession() as http:
        status, body, _ = await _post(http, c.url, "held")
    assert status == 503 and "session closed" in body
    # Every node's admin view shows the session closed, with what is left of the tombstone.
    for node in cluster.nodes:
        code, view = await asyncio.to_thread(_get, node, "/admin/sessions/held")
        assert (code, view["tombstoned"]) == (200, True), node.name
        assert view["tombstone_ttl_s"] > 0, node.name
    assert (await _delete(b.url, "held"))["already_closed"]
    assert "cp:{held}:inflight" not in _in_flight_keys(rdb)
    await client.close()


def _told_closed(cluster: Cluster, node: ProxyNode) -> list[str]:
    """The ids ``node``'s plugins got ``session_closed`` for (its current process)."""
    assert node.proc is not None
    return closed_ids(cluster.workdir, node.proc.pid)


async def test_only_the_nodes_that_served_a_session_get_session_closed(
    cluster: Cluster, rdb: redis.Redis
) -> None:
    a, b, c = cluster.nodes
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, a.url, "served-on-a"))[0] == 200
        assert (await _post(http, c.url, "served-on-c"))[0] == 200
    # The client has the last byte before the node's handler ends and leaves the
    # in-flight set: the close below must find nothing in flight.
    await _until(lambda: not _in_flight_keys(rdb), "both exchanges out of the in-flight sets")

    # Closed on B, which never served it: A's plugins are told, B's are not (B
    # answers after its own local close, plugins included).
    answer = await asyncio.wait_for(_delete(b.url, "served-on-a"), GRACE + TTL + 10)
    assert not answer["already_closed"] and answer["finished"] == 0, answer
    await _until(lambda: "served-on-a" in _told_closed(cluster, a), "A's plugins told")
    assert "served-on-a" not in _told_closed(cluster, b)

    # A later close, of a session C served: once C's plugins have it, C's tailer has
    # applied the earlier command too (the stream is read in order).
    await asyncio.wait_for(_delete(b.url, "served-on-c"), GRACE + TTL + 10)
    await _until(lambda: "served-on-c" in _told_closed(cluster, c), "C's plugins told")
    await asyncio.sleep(0.3)  # the earlier close's local task, had it anything to tell
    assert "served-on-a" not in _told_closed(cluster, c)
    assert "served-on-c" not in _told_closed(cluster, a) + _told_closed(cluster, b)
    assert _told_closed(cluster, a).count("served-on-a") == 1


async def test_sessions_stick_to_a_node_and_a_stopped_node_moves_only_its_own(
    cluster: Cluster, rdb: redis.Redis
) -> None:
    nginx = cluster.nginx
    assert nginx is not None
    sids = [f"route-{n}" for n in range(24)]
    placed: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            for sid in sids:
                status, _, node = await _post(http, nginx.url, sid)
                assert status == 200
                assert placed.setdefault(sid, node) == node, sid
        assert len(set(placed.values())) >= 2  # the hash spreads sessions
        async with http.get(f"{nginx.url}/admin/sessions") as resp:
            assert resp.status == 403  # the balancer keeps the admin routes to itself
        # A rolling restart of the node holding route-0, while it streams for it.
        leaving = cluster.node_at(int(placed["route-0"].rsplit(":", 1)[1]))
        slow = asyncio.create_task(
            _post(
                http,
                leaving.url,
                "route-0",
                body={**_chat(), "stream": True},
                script="chunks=6; delay=0.4",
            )
        )

        def streaming() -> bool:
            return any(
                r["headers"].get("x-emulator") == "chunks=6; delay=0.4"
                and r["events_sent"] >= 1
                and not r["finished"]
                for r in cluster.emulator.stats()
            )

        await _until(streaming, "the slow stream started")
        stopper = asyncio.create_task(asyncio.to_thread(leaving.stop))
        await _until(lambda: _get(leaving, "/readyz")[0] == 503, "readiness 503", within=5)
        # Draining, it still listens and answers a new request 503 (never sent upstream):
        # the doc's proxy_next_upstream (http_503 non_idempotent) retries the POST on
        # another node, so the client never sees that 503. nginx's $upstream_addr lists
        # every node tried: the leaving one first, then the one that answered.
        status, _, tried = await _post(http, nginx.url, "route-0")
        assert not slow.done(), "the drain ended before the request through nginx"
        first, *rest = tried.split(", ")
        assert (status, first) == (200, placed["route-0"]), tried
        assert rest and rest[-1] != placed["route-0"], tried
        status, body, _ = await slow  # the grace period let it finish
        assert status == 200 and "data: [DONE]" in body
        assert await stopper == 0
        assert not any(
            m.startswith(f"{leaving.name}|") for ms in _in_flight_keys(rdb).values() for m in ms
        )
        try:
            for sid in sids:
                status, _, node = await _post(http, nginx.url, sid)
                assert status == 200, sid
                if placed[sid] != placed["route-0"]:
                    assert node == placed[sid], f"{sid} moved although its node stayed"
                else:
                    assert node != placed[sid]
        finally:
            await asyncio.to_thread(leaving.start, same_port=True)


async def test_kill_9_of_the_node_holding_a_stream_then_close_on_another(
    cluster: Cluster, rdb: redis.Redis
) -> None:
    a, b, _ = cluster.nodes
    client, _chunks = await _held_stream(b, "orphan")
    assert any(m.startswith("b|") for m in rdb.zrange("cp:{orphan}:inflight", 0, -1))
    b.kill()
    try:
        began = time.monotonic()
        answer = await asyncio.wait_for(_delete(a.url, "orphan"), GRACE + TTL + 10)
        assert time.monotonic() - began < GRACE + TTL + 2.0
        assert answer["expired"] == 1 and answer["remaining"] == 0, answer
        assert rdb.zrange("cp:{orphan}:inflight", 0, -1) == []
    finally:
        await client.close()
        await asyncio.to_thread(b.start, same_port=True)
    # The restarted node refuses the closed session too (the tombstone is in Redis).
    async with aiohttp.ClientSession() as http:
        status, _, _ = await _post(http, b.url, "orphan")
    assert status == 503


async def test_the_ledger_gate_holds_across_nodes_and_a_restart(
    cluster: Cluster, rdb: redis.Redis
) -> None:
    a, b, _ = cluster.nodes
    key = "cp:{ledger-s}:ledger"
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, a.url, "ledger-s", body=_chat("one")))[0] == 200
        assert (await _post(http, b.url, "ledger-s", body=_chat("one")))[0] == 200  # identical
        assert (await _post(http, b.url, "ledger-s", body=_chat("two")))[0] == 200  # reformat
        await _until(lambda: rdb.hget(key, "requests") == "2", "two gate writes")
        assert rdb.hget(key, "dirty") == "0" and rdb.hget(key, "revision_epoch") == "0"
        # Two nodes commit the same verdict flip at once: the epoch moves once.
        flip = _chat("three", image=True)
        results = await asyncio.gather(
            _post(http, a.url, "ledger-s", body=flip), _post(http, b.url, "ledger-s", body=flip)
        )
        assert [r[0] for r in results] == [200, 200]
        await _until(lambda: rdb.hget(key, "dirty") == "1", "the flip committed")
        await asyncio.sleep(0.3)  # both commits have run (the second is identical)
        assert rdb.hget(key, "revision_epoch") == "1"
        await asyncio.to_thread(a.stop)
        await asyncio.to_thread(a.start, same_port=True)
        # The state survived the restart: flipping back is the second revision.
        assert (await _post(http, a.url, "ledger-s", body=_chat("four")))[0] == 200
        await _until(lambda: rdb.hget(key, "revision_epoch") == "2", "second revision")
        status, view = _get(a, "/admin/sessions/ledger-s")
        assert status == 200 and view["plugins"]["ledger"]["revision_epoch"] == 2


async def test_redis_killed_mid_traffic_and_restarted(cluster: Cluster, rdb: redis.Redis) -> None:
    a, b, c = cluster.nodes
    nginx = cluster.nginx
    assert nginx is not None
    failures: list[tuple[str, int]] = []
    served = 0
    stop = asyncio.Event()

    async def traffic(http: aiohttp.ClientSession) -> None:
        nonlocal served
        for n in range(100_000):  # bounded; ended by `stop`
            if stop.is_set():
                return
            sid = f"flow-{n % 8}"
            status, _, _ = await _post(http, nginx.url, sid)
            if status != 200:
                failures.append((sid, status))
            served += 1

    async with aiohttp.ClientSession() as http:
        runners = [asyncio.create_task(traffic(http)) for _ in range(4)]
        # A stream admitted before the outage and finished during it: the stream
        # itself never needs Redis; its deregistration waits for the reconcile.
        through = asyncio.create_task(
            _post(
                http,
                c.url,
                "through-outage",
                body={**_chat(), "stream": True},
                script="chunks=3; hold=outage",
            )
        )
        try:
            await _until(lambda: _record_has(cluster, "through-outage", "headers_sent"), "held")
            await _until(lambda: served > 20, "traffic flowing")
            cluster.redis.kill()
            await _until(
                lambda: all(
                    _get(n, "/readyz")[1].get("cluster") == "degraded" for n in cluster.nodes
                ),
                "every node degraded",
            )
            for node in cluster.nodes:
                status, ready = _get(node, "/readyz")
                assert status == 200 and ready["status"] == "ready"
            await asyncio.to_thread(cluster.emulator.release, "outage")
            status, body, _ = await asyncio.wait_for(through, 10)
            assert status == 200 and "data: [DONE]" in body
            before = served
            answer = await _delete(a.url, "outage-closed")
            assert answer["degraded"]
            await _until(lambda: served > before + 20, "traffic flowing while Redis is down")
            cluster.redis.start(same_port=True)
            await _until(
                lambda: all(_get(n, "/readyz")[1].get("cluster") == "ok" for n in cluster.nodes),
                "every node reconciled",
                within=15,
            )
        finally:
            stop.set()
            await asyncio.gather(*runners)
            cluster.emulator.release("outage")
            await asyncio.gather(through, return_exceptions=True)
        assert failures == []
        # Redis restarted empty; the reconcile re-added only live entries, and the
        # stream that ended during the outage left none behind.
        await _until(lambda: not _in_flight_keys(rdb), "no in-flight entry left", within=5)
        # The close issued during the outage holds on every node afterwards.
        for node in (a, b, c):
            status, body, _ = await _post(http, node.url, "outage-closed")
            assert (status, "session closed" in body) == (503, True), node.name
        metrics = await asyncio.to_thread(_metrics, b)
        assert metrics["context_proxy_cluster_degraded"] == 0.0
        assert metrics["context_proxy_cluster_reconciles"] >= 1


async def test_2000_requests_with_random_closes(cluster: Cluster, rdb: redis.Redis) -> None:
    nginx = cluster.nginx
    assert nginx is not None
    rng = random.Random(13)
    sids = [f"mix-{n}" for n in range(60)]
    closed_at: dict[str, float] = {}
    violations: list[tuple[str, int]] = []
    queue = [rng.choice(sids) for _ in range(2000)]
    closes = set(rng.sample(range(2000), 30))
    done = 0

    async def worker(http: aiohttp.ClientSession, w: int) -> None:
        nonlocal done
        for index in range(w, len(queue), 24):
            sid = queue[index]
            if index in closes:
                node = cluster.nodes[index % 3]
                await _delete(node.url, sid)
                closed_at.setdefault(sid, time.monotonic())
                continue
            sent = time.monotonic()
            status, _, _ = await _post(http, nginx.url, sid)
            done += 1
            late = status == 200 and sid in closed_at and closed_at[sid] < sent
            if late or status not in (200, 503):
                violations.append((sid, status))

    # Redis reachable the whole time: the guarantee is not the degraded mode's.
    await _until(
        lambda: all(_get(n, "/readyz")[1].get("cluster") == "ok" for n in cluster.nodes),
        "every node attached to Redis",
    )
    reconciles = [
        (await asyncio.to_thread(_metrics, n))["context_proxy_cluster_reconciles"]
        for n in cluster.nodes
    ]
    connector = aiohttp.TCPConnector(limit=32)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.wait_for(asyncio.gather(*(worker(http, w) for w in range(24))), 90)
    after = [
        (await asyncio.to_thread(_metrics, n))["context_proxy_cluster_reconciles"]
        for n in cluster.nodes
    ]
    assert after == reconciles, "a node lost Redis during the run"
    assert violations == []
    assert done == 2000 - len(closes)
    await _until(lambda: not _in_flight_keys(rdb), "no in-flight entry left", within=5)
