"""A plugin's change to ``ctx.body`` that JSON cannot carry is that plugin's failure.

A lone surrogate in a string (UnicodeEncodeError) or a value of a non-JSON type
(TypeError) in the whole parsed object used to become a proxy 500 on every
request. The object is changed in place, so the proxy cannot return to "before
that plugin": it logs the plugins that held the body, counts their failure and
sends the body as it was before the prepare run (here: byte for byte as received).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest
import xxhash

from proxy import Plugin, PrepareContext, WireMetadata
from proxy import _wire as wire
from proxy._exchange import Exchange
from proxy._holders import BodyHolder
from proxy._plugins import PluginHost
from proxy._prepare import Preparer, null_lock, prepare, refold
from proxy._protocols import Protocol
from proxy.testing import proxy_with_emulator
from tests.support.e2e import CHAT_PATH, request_body


class Poison(Plugin):
    """Puts a value JSON cannot encode into the whole parsed body."""

    name = "poison"

    def __init__(self, value: Any) -> None:
        self.value = value

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return True

    async def prepare(self, ctx: PrepareContext) -> bool:
        ctx.body["model"] = self.value
        return True


@pytest.mark.parametrize(
    "value", ["rewritten-\ud800", object()], ids=["lone-surrogate", "non-json-type"]
)
async def test_an_unserializable_whole_body_edit_is_skipped_and_the_body_goes_on(
    value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="context_proxy.plugins")
    poison = Poison(value)
    body = json.dumps(request_body(CHAT_PATH, stream=False)).encode()
    async with (
        proxy_with_emulator(plugins=[poison]) as h,
        aiohttp.ClientSession() as session,
    ):
        for _ in range(2):
            async with session.post(
                f"{h.url}{CHAT_PATH}", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["message"]["content"]
        assert [r.body_digest for r in h.emulator.stats] == [xxhash.xxh3_128_hexdigest(body)] * 2
        assert h.state.host.failures == {"poison": 2}
    warnings = [r.getMessage() for r in caplog.records if "cannot be serialized" in r.getMessage()]
    assert len(warnings) == 2 and all("plugin poison:" in w for w in warnings)
    # The error's message (which may quote the body) is not logged.
    assert all("\ud800" not in w and "rewritten" not in w for w in warnings)


class Stages(Plugin):
    """Level 0: a valid change; level 1: an unserializable one; level 2: a shrinking one."""

    name = "stages"

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return True

    async def prepare(self, ctx: PrepareContext) -> bool:
        body = ctx.body
        self.seen.append(body.get("model"))
        if ctx.fold_level == 0:
            body["temperature"] = 0.25
        elif ctx.fold_level == 1:
            body["model"] = "poisoned-\ud800"
        else:
            del body["temperature"]
        return True


async def test_a_failed_refold_edit_keeps_the_last_body_and_the_next_refold_starts_there() -> None:
    """At a refold the object of the earlier level is changed in place: when that
    change cannot be serialized, the body sent stays the earlier level's, and the next
    refold starts from that body, not from the poisoned object."""
    raw = bytearray(json.dumps(request_body(CHAT_PATH, stream=False)).encode())
    meta = wire.compute_wire_metadata(Protocol.CHAT, raw, wire.digest_bytes(raw))
    stages = Stages()
    host = PluginHost([stages], timeout=5.0)
    ex = Exchange(protocol=Protocol.CHAT, method="POST", path=CHAT_PATH)
    ex.attach_body(raw, meta)
    ex.bind_preparer(Preparer(host, null_lock, None))
    await prepare(ex)
    level0 = ex.outbound_digest
    ex.mark_sent()
    assert await refold(ex) is False  # the level-1 edit is skipped: nothing changed
    assert ex.outbound_digest == level0 and host.failures == {"stages": 1}
    ex.mark_sent()
    assert await refold(ex) is True  # level 2 shrinks the level-0 body
    outbound = ex.outbound_holder
    assert isinstance(outbound, BodyHolder)
    sent = json.loads(bytes(outbound.data))
    assert sent["model"] == "e2e-model" and "temperature" not in sent
    assert stages.seen == ["e2e-model"] * 3
