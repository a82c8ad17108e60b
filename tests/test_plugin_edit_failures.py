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
from proxy.testing import proxy_with_emulator

from .test_e2e_support import CHAT_PATH, request_body


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
