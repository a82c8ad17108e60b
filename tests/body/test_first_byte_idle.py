"""A request body whose first byte never comes is refused after ``body_idle_timeout``.

The idle clock runs from the head on, not only once body bytes have started: a
client that announces a body and sends nothing holds a connection and its reading
budget for ``body_idle_timeout`` seconds, then gets its 408.
"""

from __future__ import annotations

from tests.support.lifetime import CHAT, RawConn, closed_port_url, proxy_at

IDLE_S = 0.3


async def test_a_body_that_never_starts_gets_its_408_after_the_idle_timeout() -> None:
    async with proxy_at(closed_port_url(), body_idle_timeout=IDLE_S, body_timeout=600.0) as proxy:
        conn = await RawConn.open(proxy.url)
        try:
            await conn.send_head(CHAT, 100, {})  # 100 bytes announced, none sent
            # Read within RawConn's 10 s bound: before, the wait was ~2 x the loop's clock.
            assert await conn.status() == 408
        finally:
            conn.abort()
