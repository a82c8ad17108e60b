"""A Responses stream that ends in band with ``response.failed`` is booked as failed.

Real sockets on 127.0.0.1: the proxy runs in this process in front of its emulator,
whose context overflow (``overflow_above``, here too small for any refold) arrives
inside a 200 stream for the Responses API.
"""

from __future__ import annotations

import json
from typing import Final

import aiohttp

from proxy.testing import proxy_with_emulator

OVERFLOW: Final = {"x-emulator": "overflow_above=10; context=2", "Authorization": "Bearer sk-t"}


async def test_a_responses_stream_failed_in_band_is_booked_upstream_error() -> None:
    async with proxy_with_emulator() as h, aiohttp.ClientSession() as http:
        body = {"model": "m", "stream": True, "input": "hello there"}
        async with http.post(
            f"{h.url}/v1/responses", data=json.dumps(body), headers=OVERFLOW
        ) as resp:
            raw = await resp.read()
            status = resp.status
        await h.settle()
        assert status == 200 and b"event: response.failed" in raw
        labels = {"protocol": "openai-responses", "code": "200"}
        assert h.metric("context_proxy_requests_total", **labels, outcome="upstream_error") == 1
        assert h.metric("context_proxy_requests_total", **labels, outcome="ok") is None
