"""Metrics an operator can alert on (issue 12, item 1): scrape ``/metrics`` after traffic.

The histograms must count exactly the exchanges sent, by protocol, in buckets that
suit LLM traffic; the process and GC collectors must be there; no ``_created``
series; the HTTP status is the label ``code``; and every series is in the README.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy._metrics import BODY_BUCKETS, TIME_BUCKETS
from proxy._protocols import Protocol
from proxy.testing import proxy_with_emulator
from tests.support.cluster import RedisServer, need_binary

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
README = Path(__file__).resolve().parents[2] / "README.md"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _buckets(samples: Samples, name: str, **labels: str) -> dict[float, float]:
    """``{upper bound: cumulative count}`` of one histogram child."""
    want = set(labels.items())
    return {
        float(dict(lab)["le"]): value
        for (sample_name, lab), value in samples.items()
        if sample_name == f"{name}_bucket" and want <= set(lab)
    }


def _chat(content: str) -> dict[str, Any]:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}


def _messages(content: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }


async def test_histograms_count_the_exchanges_sent_by_protocol_and_size() -> None:
    """3 chat streams (one slow) and 2 Anthropic streams with known body sizes: the
    histograms' counts and buckets say exactly that; process/GC/build series exist;
    no _created series; the status label is ``code``."""
    bodies = [_chat("a" * 100), _chat("b" * 3000), _chat("c" * 200_000)]
    sizes = [len(json.dumps(b).encode()) for b in bodies]
    anthropic = [_messages("d" * 10), _messages("e" * 10)]
    sizes += [len(json.dumps(b).encode()) for b in anthropic]
    async with (
        proxy_with_emulator(plugins=[]) as h,
        aiohttp.ClientSession() as http,
    ):
        for i, body in enumerate(bodies):
            # The first stream takes at least 3 x 0.1 s between its deltas.
            headers = {"x-emulator": "chunks=4; delay=0.1"} if i == 0 else {}
            async with http.post(h.url + CHAT, json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
        for body in anthropic:
            async with http.post(h.url + MESSAGES, json=body) as resp:
                assert resp.status == 200
                await resp.read()
        await h.settle()
        async with http.get(h.url + "/metrics") as resp:
            text = await resp.text()
    samples = _parse(text)

    for name in (
        "context_proxy_time_to_first_byte_seconds",
        "context_proxy_exchange_duration_seconds",
    ):
        for protocol, count in ((Protocol.CHAT, 3), (Protocol.MESSAGES, 2)):
            buckets = _buckets(samples, name, protocol=str(protocol))
            assert sorted(buckets) == [*TIME_BUCKETS, float("inf")]
            assert buckets[float("inf")] == count
            assert samples[(f"{name}_count", frozenset({("protocol", str(protocol))}))] == count
    # The slow stream lasted over 0.3 s: it is in no duration bucket below that.
    chat_duration = _buckets(
        samples, "context_proxy_exchange_duration_seconds", protocol=str(Protocol.CHAT)
    )
    assert chat_duration[0.25] <= 2
    assert chat_duration[600.0] == 3

    body_buckets = _buckets(samples, "context_proxy_request_body_bytes")
    assert sorted(body_buckets) == [*BODY_BUCKETS, float("inf")]
    assert BODY_BUCKETS[0] == 1024 and BODY_BUCKETS[-1] == 256 * 1024 * 1024
    for bound, cumulative in body_buckets.items():
        assert cumulative == sum(1 for s in sizes if s <= bound), bound
    assert samples[("context_proxy_request_body_bytes_sum", frozenset())] == sum(sizes)

    requests = {
        (dict(lab)["protocol"], dict(lab)["code"]): v
        for (n, lab), v in samples.items()
        if n == "context_proxy_requests_total"
    }
    assert requests == {(str(Protocol.CHAT), "200"): 3, (str(Protocol.MESSAGES), "200"): 2}
    assert ("process_resident_memory_bytes", frozenset()) in samples
    assert ("process_open_fds", frozenset()) in samples
    assert ("process_cpu_seconds_total", frozenset()) in samples
    assert any(n == "python_gc_collections_total" for n, _ in samples)
    build = [dict(lab) for n, lab in samples if n == "context_proxy_build_info"]
    assert len(build) == 1 and build[0]["version"] and build[0]["python_version"]
    # The versions of what runs: aiohttp is no runtime dependency (only the emulator's).
    assert set(build[0]) == {"version", "python_version"}
    assert "_created" not in text


async def test_every_series_is_documented_in_the_readme() -> None:
    """Each family /metrics exposes (plugin series aside) has a row in the README table."""
    async with (
        proxy_with_emulator(plugins=[]) as h,
        aiohttp.ClientSession() as http,
        http.get(h.url + "/metrics") as resp,
    ):
        text = await resp.text()
    names = {f.name for f in text_string_to_metric_families(text)}
    readme = README.read_text()
    table = readme[readme.index("### Metrics") :]
    documented = set(re.findall(r"`((?:context_proxy|process|python)_[a-z_]+)", table))
    missing = {
        n
        for n in names
        if n not in documented and f"{n}_total" not in documented and f"{n}_info" not in documented
    }
    assert not missing, f"series missing from the README metrics table: {sorted(missing)}"


def _documented_series() -> set[str]:
    readme = README.read_text()
    table = readme[readme.index("### Metrics") : readme.index("## Shutdown")]
    return set(re.findall(r"`((?:context_proxy|process|python)_[a-z_]+)", table))


async def test_series_with_a_small_known_label_set_are_there_at_zero_from_the_start() -> None:
    """Before any traffic, every phase a client can leave in, every protocol and every
    (phase, buffer kind) has its sample at 0: rate() and alerts need no first event."""
    async with (
        proxy_with_emulator(plugins=[]) as h,
        aiohttp.ClientSession() as http,
        http.get(h.url + "/metrics") as resp,
    ):
        samples = _parse(await resp.text())
    for phase in ("reading", "parsed", "prepared", "sent", "accepted", "streaming"):
        key = ("context_proxy_client_disconnects_total", frozenset({("phase", phase)}))
        assert samples.get(key) == 0, phase
        for kind in ("raw", "parsed", "outbound", "response"):
            held = frozenset({("phase", phase), ("kind", kind)})
            assert samples.get(("context_proxy_held_bytes", held)) == 0, (phase, kind)
    for protocol in Protocol:
        key = ("context_proxy_internal_errors_total", frozenset({("protocol", str(protocol))}))
        assert samples.get(key) == 0, protocol
    for event in ("started", "finished", "failed", "timed_out"):
        assert samples.get(("context_proxy_commits_total", frozenset({("event", event)}))) == 0


@pytest.mark.timeout(60)
async def test_every_family_scraped_after_traffic_in_cluster_mode_is_in_the_readme_table(
    tmp_path: Path,
) -> None:
    """Cluster mode (a real redis-server), the default plugins, then traffic: a complete
    stream, a refused body, a client that hangs up mid-stream. Every family on /metrics
    then has a row in README's table."""
    need_binary("redis-server")
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        async with (
            proxy_with_emulator(plugins=["fold"], redis_url=redis.url) as h,
            aiohttp.ClientSession() as http,
        ):
            async with http.post(h.url + CHAT, json=_chat("hi")) as resp:
                assert resp.status == 200
                await resp.read()
            async with http.post(h.url + CHAT, data=b"not json") as resp:
                assert resp.status == 400
            slow = {"x-emulator": "chunks=40; delay=0.05"}
            async with http.post(h.url + CHAT, json=_chat("bye"), headers=slow) as resp:
                assert resp.status == 200
                await resp.content.readany()
                resp.close()  # hang up mid-stream
            await h.settle()
            for _ in range(200):  # bounded (10 s): the hang-up is counted once the handler ends
                if h.metric("context_proxy_client_disconnects_total", phase="streaming"):
                    break
                await asyncio.sleep(0.05)
            assert h.metric("context_proxy_client_disconnects_total", phase="streaming") == 1
            async with http.get(h.url + "/metrics") as resp:
                text = await resp.text()
    finally:
        redis.stop()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "context_proxy_cluster_degraded" in names
    documented = _documented_series()
    missing = {
        n
        for n in names
        if n not in documented and f"{n}_total" not in documented and f"{n}_info" not in documented
    }
    assert not missing, f"series missing from the README metrics table: {sorted(missing)}"
