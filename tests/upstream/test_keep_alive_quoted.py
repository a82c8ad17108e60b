"""A ``Keep-Alive`` timeout given as a quoted string is honoured.

RFC 2068 section 19.7.1.1 defines ``keep-alive-param = attribute "=" value``,
whose value may be a quoted-string (as in ``Keep-Alive: timeout="5"``). Read as
no timeout, the connection would be kept the pool's own 15 s, and every reuse
between 5 and 15 s idle would cross the upstream's close.
"""

from __future__ import annotations

import pytest

from proxy._http1 import ClientConnection, Request


@pytest.mark.parametrize("value", ['timeout="5"', 'timeout="5", max=100'])
def test_a_quoted_keep_alive_timeout_bounds_the_idle_time(value: str) -> None:
    conn = ClientConnection()
    conn.send_head(Request("GET", "/", []))
    conn.receive_data(
        b"HTTP/1.1 200 OK\r\nKeep-Alive: %s\r\nContent-Length: 0\r\n\r\n" % value.encode()
    )
    assert conn.ended and conn.keep_alive
    assert conn.keep_alive_s == 4.0
