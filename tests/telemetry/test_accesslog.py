"""Access-log fields an operator uses (issue 24, item 3), from a real ``serve`` process.

Every access line, text and JSON, carries ``peer`` (the client socket's
``address:port``), ``model``, ``user_agent`` (control characters removed, at
most 80 characters, ``-`` when nothing is left), ``upstream_status`` and
``upstream_s`` (seconds from send to the upstream's response head; ``-``/null
when nothing went upstream). The
JSON record's ``message`` is the fixed word ``access``, not the fields again.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import pytest

from proxy._emulator import EmulatorServer
from tests.telemetry.test_logs import API_KEY, BOUND_S, PROMPT, _serve

UA_HEAD = "ua-test/1.0"
#: A tab inside (a control character HTTP allows in a field value) and 200 characters.
USER_AGENT = UA_HEAD + "\tpart" + "x" * 200


async def _raw_post(
    base: str, body: bytes, user_agent: bytes = USER_AGENT.encode()
) -> tuple[str, bytes]:
    """POST ``body`` to /v1/chat/completions on a fresh socket; the client's ``host:port``
    and the whole response (read to EOF, ``Connection: close``)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    local_host, local_port = writer.get_extra_info("sockname")[:2]
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    ).encode()
    writer.write(head + b"User-Agent: " + user_agent + b"\r\n\r\n" + body)
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), BOUND_S)
    writer.close()
    await writer.wait_closed()
    return f"{local_host}:{local_port}", response


async def _two_exchanges(emulator: EmulatorServer, **env: str) -> tuple[list[str], list[str]]:
    """A streamed success and a refused (not JSON) request; the peers and the output lines."""
    proc, base = await _serve(emulator.url, **env)
    try:
        good = json.dumps(
            {"model": "gpt-acc", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
        ).encode()
        peer_ok, answer_ok = await _raw_post(base, good)
        assert answer_ok.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer_ok
        peer_bad, answer_bad = await _raw_post(base, b"{not json")
        assert answer_bad.startswith(b"HTTP/1.1 400")
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    return [peer_ok, peer_bad], proc.lines


@pytest.mark.timeout(60)
async def test_json_access_records_carry_peer_model_agent_and_upstream(
    emulator: EmulatorServer,
) -> None:
    peers, lines = await _two_exchanges(emulator, log_format="json")
    records = [json.loads(line) for line in lines if line]
    access: list[dict[str, Any]] = [r for r in records if r["logger"] == "context_proxy.access"]
    assert len(access) == 2
    ok, refused = access
    assert ok["status"] == 200 and refused["status"] == 400

    assert ok["peer"] == peers[0] and refused["peer"] == peers[1]
    assert ok["model"] == "gpt-acc"
    assert ok["upstream_status"] == 200
    assert 0 < ok["upstream_s"] <= ok["duration_s"]
    expected_ua = (UA_HEAD + "part" + "x" * 200)[:80]
    assert ok["user_agent"] == expected_ua and refused["user_agent"] == expected_ua

    # Refused before anything went upstream: no model parsed, no upstream fields.
    assert refused["model"] is None
    assert refused["upstream_status"] is None and refused["upstream_s"] is None

    for r in access:
        assert r["message"] == "access"  # the fields are keys, not repeated in the message
        assert "status=" not in r["message"] and "peer" not in r["message"]
    text = "\n".join(lines)
    assert API_KEY not in text and PROMPT not in text


@pytest.mark.timeout(60)
async def test_text_access_lines_carry_the_same_fields(emulator: EmulatorServer) -> None:
    peers, lines = await _two_exchanges(emulator)
    access = [line for line in lines if " context_proxy.access: " in line]
    assert len(access) == 2
    ok, refused = access
    assert f"peer={peers[0]} " in ok and f"peer={peers[1]} " in refused
    assert " model=gpt-acc " in ok and " model=- " in refused
    assert " upstream_status=200 upstream_s=0." in ok
    assert " upstream_status=- upstream_s=- " in refused
    expected_ua = (UA_HEAD + "part" + "x" * 200)[:80]
    assert f" user_agent={expected_ua} " in ok
    assert "\t" not in ok and "x" * 81 not in ok


#: U+0085 (NEL), a tab and U+009F, UTF-8 on the wire: a field value llhttp accepts whose
#: every character the cleaning removes.
CONTROL_ONLY_UA = "\u0085\t\u009f".encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_a_user_agent_of_control_characters_only_is_logged_as_a_dash(
    emulator: EmulatorServer, log_format: str
) -> None:
    proc, base = await _serve(emulator.url, log_format=log_format)
    try:
        good = json.dumps(
            {"model": "gpt-acc", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
        ).encode()
        _, answer = await _raw_post(base, good, CONTROL_ONLY_UA)
        assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    if log_format == "json":
        records = [json.loads(line) for line in proc.lines if line]
        (access,) = [r for r in records if r["logger"] == "context_proxy.access"]
        assert access["user_agent"] == "-"
    else:
        (access_line,) = [line for line in proc.lines if " context_proxy.access: " in line]
        assert " user_agent=- " in access_line
