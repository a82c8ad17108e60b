"""A POST the upstream read whole and worked on is not sent to it a second time.

The resend on a new connection exists for the keep-alive race: the
upstream's idle timer closes the kept connection as the proxy's next request
crosses it on the wire, so the upstream never read it. Its test shape is an
upstream that closes within milliseconds. But "closed with no byte of answer"
on a kept connection also happens after the upstream *did* read the request
and acted on it: a worker killed by its own timeout (gunicorn's 30 s), an
out-of-memory kill, a crash on this very request, a deploy. Resending then
runs a billed LLM generation (or a tool side effect) twice, and sends a request
that crashes the upstream straight into the next worker. Go's client resends a
POST only when nothing of it was written (or it carries an Idempotency-Key);
the proxy's bound (the close came within ``RESEND_WINDOW_S`` of the request's
first byte, about a round trip) keeps the race covered without this.
"""

from __future__ import annotations

import asyncio

import openai

from tests.support.upstream import Scripted, json_answer, proxy_for, read_request


async def test_a_request_the_upstream_held_for_a_second_then_dropped_is_not_resent() -> None:
    seen: list[tuple[int, int]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for i in range(10):  # bounded
            await read_request(reader)
            seen.append((n, i))
            if (n, i) == (0, 1):
                await asyncio.sleep(1.0)  # generating the answer ...
                return  # ... and the worker dies: closed, not a byte sent
            writer.write(json_answer())
            await writer.drain()

    async with (
        Scripted(serve) as upstream,
        proxy_for(upstream.url) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
    ):
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "run the migration"}
        ]
        await sdk.chat.completions.create(model="m", messages=messages)
        try:
            await sdk.chat.completions.create(model="m", messages=messages)
        except openai.APIStatusError as exc:
            assert exc.status_code == 502, exc
    assert seen == [(0, 0), (0, 1)], f"the upstream got the second request {len(seen) - 1} times"
