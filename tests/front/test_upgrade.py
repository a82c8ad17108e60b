"""A request asking for h2c with its body is answered as HTTP/1.1, body and all (proxy/_front.py).

curl ``--http2`` on an ``http://`` URL and Java's HttpClient (HTTP/2 by
default) send ``Connection: Upgrade, HTTP2-Settings`` and ``Upgrade: h2c`` on
a POST, with its body right behind the head. The proxy upgrades to nothing;
RFC 9110 §7.8 lets a server ignore the field, and aiohttp's server did: the
request is an ordinary one, its body read whole, the connection kept. llhttp
reports the upgrade at the end of the head and httptools then skips the body,
so the framing must take the body back itself.
"""

from __future__ import annotations

import asyncio
import json

from proxy._http1 import END, RequestFraming, RequestHead
from proxy.testing import proxy_with_emulator
from tests.support.e2e import CHAT_PATH, RawClient, stream_body

H2C = (
    "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
)


def _post(body: bytes, framing: str) -> bytes:
    return (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\n{H2C}{framing}\r\n").encode() + body


def test_the_body_of_an_h2c_upgrade_request_is_framed_and_the_next_request_too() -> None:
    body = b'{"model":"m"}'
    sized = _post(body, f"Content-Length: {len(body)}\r\n")
    chunked = _post(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), "Transfer-Encoding: chunked\r\n")
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    for data in (sized + get, chunked + get):
        for step in (None, 1):
            framing = RequestFraming()
            events: list[object] = []
            if step is None:
                events = list(framing.feed(data))
            else:
                for i in range(len(data)):
                    events += framing.feed(data[i : i + 1])
            heads = [e for e in events if isinstance(e, RequestHead)]
            assert [h.path for h in heads] == [CHAT_PATH, "/healthz"]
            assert b"".join(e for e in events if isinstance(e, bytes)) == body
            assert [e for e in events if e is END] == [END, END]
            assert not framing.upgraded


async def test_an_h2c_upgrade_post_gets_its_answer_on_a_kept_connection() -> None:
    async with proxy_with_emulator() as h:
        body = stream_body(CHAT_PATH, stream=False)
        client = await RawClient.connect(h.url)
        try:
            await client.send(_post(body, f"Content-Length: {len(body)}\r\n"))
            async with asyncio.timeout(5.0):
                head = await client.read_head()
                answer = json.loads(await client.read_body(head))
                await client.request("GET", "/healthz", b"")
                again = await client.read_head()
                await client.read_body(again)
        finally:
            await client.close()
        assert head.status == 200 and answer["object"] == "chat.completion"
        assert again.status == 200
        assert h.emulator.stats[0].body_bytes == len(body)
