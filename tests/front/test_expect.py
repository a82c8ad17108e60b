"""An ``Expect`` other than ``100-continue`` is a 417 on every route, never a 500.

Found by the HTTP fuzzer (tests/e2e/test_properties_http.py): aiohttp's own answer
echoes the value into its 417 text and fails with a 500 when the value is not
valid UTF-8 (``Expect: \\x80``), on every route that is not the proxy's /v1 one,
matched or not.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.testing import proxy_with_emulator


@pytest.mark.parametrize("value", [b"\x80", b"bogus", b"100-continue, x"])
async def test_an_unknown_expectation_is_417_on_every_path(value: bytes) -> None:
    async with proxy_with_emulator() as h:
        port = int(h.url.rsplit(":", 1)[1])
        for target, shape in [
            (b"/", "openai"),
            (b"/nope", "openai"),
            (b"/healthz", "openai"),
            (b"/admin/shutdown", "openai"),
            (b"/v1/chat/completions", "openai"),
            (b"/v1/messages?beta=true", "anthropic"),
        ]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(
                    b"POST "
                    + target
                    + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: "
                    + value
                    + b"\r\nContent-Length: 2\r\n\r\n{}"
                )
                async with asyncio.timeout(10):
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    body = json.loads(await reader.readexactly(length))
            finally:
                writer.close()
            assert head.startswith(b"HTTP/1.1 417 "), (target, head[:40])
            error = body["error"]
            assert error["message"] == "only Expect: 100-continue is supported"
            assert (body.get("type") == "error") == (shape == "anthropic")
        # The shutdown route was refused, not run.
        assert not h.state.draining
