"""A client's malformed trace headers cost no log line (``serve --tracing otel``).

OpenTelemetry's propagators warned of every over-long ``traceparent`` and every
over-long ``baggage``: one WARNING per request, for anyone who can reach the proxy.
"""

from __future__ import annotations

import signal

import aiohttp

from proxy._emulator import start_emulator
from tests.support.process import Proc

HEADERS = [
    {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "x" * 600},
    {"traceparent": "zz-not-a-trace-context"},
    {"baggage": ",".join(f"k{i}=v" for i in range(200))},  # over 180 members
]


async def test_malformed_trace_headers_are_served_without_a_log_line_each() -> None:
    emulator = await start_emulator()
    proc, port = await Proc.serve(
        emulator.url,
        env={
            "CONTEXT_PROXY_TRACING": "otel",
            "OTEL_TRACES_EXPORTER": "none",
            "CONTEXT_PROXY_LOG_LEVEL": "info",
        },
    )
    try:
        async with aiohttp.ClientSession() as http:
            for extra in HEADERS * 3:
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": "Bearer k", **extra},
                ) as answer:
                    assert answer.status == 200
                    await answer.read()
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(15) == 0
    finally:
        await proc.stop()
        await emulator.close()
    assert "context-proxy stopped" in proc.output
    assert "opentelemetry" not in proc.output, proc.output
