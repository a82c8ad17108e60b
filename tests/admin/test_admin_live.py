"""The live admin page (``GET /admin/``, ``GET /admin/events``) and ``context-proxy top``.

The page is driven in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, :func:`benchmarks.admin_page.chromium`); the proxy and the
emulator run in the test's event loop on loopback ports, Selenium's blocking calls
in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import urllib.parse
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from click.testing import CliRunner, Result
from selenium.webdriver.common.by import By

from benchmarks.admin_page import chromium
from plugins.usage import UsagePlugin
from proxy import _live as live
from proxy import _top as top
from proxy._cli import main as cli_main
from proxy.testing import Harness, proxy_with_emulator
from tests.support.e2e import CHAT_PATH, RawClient, exact_body, wait_until
from tests.support.ports import serve_app
from tests.support.process import Proc

PROMPT = "PROMPT-TEXT-7f3a9c-never-shown"
KEY = "sk-KEY-5d2e1b-never-shown"
SESSION = "page-session"
#: Seconds the emulator waits before its answer's headers: the exchange sits in ``sent``.
STALL_S = 5


def _client(h: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=KEY, max_retries=0)


async def _stream(h: Harness, script: str) -> str:
    """One streamed chat completion with ``script`` as its emulator script; its text."""
    client = _client(h)
    try:
        stream = await client.chat.completions.create(
            model="emulator-1",
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            extra_headers={"x-session-id": SESSION, "x-emulator": script},
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)
    finally:
        await client.close()


async def _in_flight(h: Harness) -> None:
    """Wait (10 s at most) until the proxy has an exchange in flight."""
    for _ in range(500):
        if h.state.exchanges:
            return
        await asyncio.sleep(0.02)
    pytest.fail("no exchange in flight within 10 s")


async def _events(h: Harness, count: int, **headers: str) -> tuple[bytes, list[dict[str, Any]]]:
    """The first ``count`` snapshot events of ``GET /admin/events``: raw bytes and data."""
    raw = b""
    snaps: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{h.url}/admin/events", headers=headers) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        async with asyncio.timeout(count * 3 + 5):
            async for line in resp.content:  # bounded: count snapshots, and the timeout
                raw += line
                if line.startswith(b"data: "):
                    snaps.append(json.loads(line[len(b"data: ") :]))
                    if len(snaps) == count:
                        break
    return raw, snaps


# ------------------------------------------------------------------ the routes


async def test_page_ships_in_the_package_with_a_same_origin_csp() -> None:
    async with proxy_with_emulator() as h, aiohttp.ClientSession() as http:
        async with http.get(f"{h.url}/admin/") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/html")
            assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
            html = await resp.text()
        assert 'src="page.js"' in html and 'href="page.css"' in html
        for name, kind in (("page.js", "text/javascript"), ("page.css", "text/css")):
            async with http.get(f"{h.url}/admin/{name}") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith(kind)
                text = await resp.text()
            # Nothing fetched from another origin: the only URL is the SVG namespace name.
            assert set(re.findall(r"https?://[^\s\"']+", text)) <= {"http://www.w3.org/2000/svg"}
        async with http.head(f"{h.url}/admin/events") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream"


async def test_page_and_events_keep_the_admin_access_rules() -> None:
    async with (
        proxy_with_emulator(admin_allow=[], admin_token="tok-123") as h,
        aiohttp.ClientSession() as http,
    ):
        for path in ("/admin/", "/admin/page.js", "/admin/events"):
            async with http.get(f"{h.url}{path}") as resp:
                assert resp.status == 403, path
            async with http.get(
                f"{h.url}{path}", headers={"Authorization": "Bearer wrong"}
            ) as resp:
                assert resp.status == 403, path
        async with http.get(f"{h.url}/admin/", headers={"Authorization": "Bearer tok-123"}) as resp:
            assert resp.status == 200
        _, snaps = await _events(h, 1, Authorization="Bearer tok-123")
        assert snaps[0]["exchanges"] == []


async def test_events_list_an_exchange_without_its_prompt_or_key() -> None:
    async with proxy_with_emulator() as h:
        stream = asyncio.create_task(_stream(h, "hold=secret"))
        await _in_flight(h)
        raw, snaps = await _events(h, 2)
        h.emulator.release("secret")
        assert await stream == "Hello from the emulator."
    (ex,) = snaps[-1]["exchanges"]
    assert ex["session"] == SESSION
    assert ex["protocol"] == "openai-chat"
    assert ex["phase"] in {"sent", "accepted", "streaming"}
    assert isinstance(snaps[-1]["rss_bytes"], int) and snaps[-1]["rss_bytes"] > 0
    assert snaps[-1]["held_by_phase"] == {ex["phase"]: ex["held_bytes"]["total"]}
    assert PROMPT.encode() not in raw and KEY.encode() not in raw
    assert b"Bearer" not in raw


async def test_a_head_of_the_event_stream_does_not_claim_an_empty_body() -> None:
    """``HEAD /admin/events`` gets the head a ``GET`` gets, which has no length (the stream
    does not end): no ``Content-Length: 0`` (RFC 9110 §9.3.2), and the connection goes on
    to the next request."""
    async with proxy_with_emulator() as h:
        host, _, port = h.url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                b"HEAD /admin/events HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                after = await reader.readuntil(b"\r\n\r\n")
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"text/event-stream" in head
    assert b"content-length:" not in head.lower()
    assert after.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_events_end_at_drain_without_holding_shutdown_up() -> None:
    async with proxy_with_emulator(shutdown_grace=30.0) as h:
        lines: list[bytes] = []
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{h.url}/admin/events") as resp,
        ):
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)  # retry field
            assert first.startswith(b"retry: ")
            stopping = asyncio.create_task(h.stop())
            async with asyncio.timeout(10):
                # The stream's clean end (the last chunk), not a cut one: a cut raises here.
                async for line in resp.content:  # bounded: the drain ends it, and the timeout
                    lines.append(line)
            await asyncio.wait_for(stopping, 10)
    assert b"event: end\n" in lines
    assert lines[-2:] == [b'data: {"reason": "draining"}\n', b"\n"]


async def test_events_stream_closes_by_itself_after_its_longest_life(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live, "EVENTS_MAX_S", 1.5)
    async with proxy_with_emulator() as h:
        lines: list[bytes] = []
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{h.url}/admin/events") as resp,
        ):
            async with asyncio.timeout(10):
                async for line in resp.content:  # bounded: EVENTS_MAX_S, and the timeout
                    lines.append(line)
        assert not h.state.stop.is_set()
    # Snapshots until the stream's end of life, then a clean end with no "end" event (the
    # proxy is not draining): the page's EventSource reconnects.
    assert lines.count(b"event: snapshot\n") >= 2
    assert lines[-3] == b"event: snapshot\n"
    assert b"event: end\n" not in lines


# ------------------------------------------------------------------ the browser


#: The rows of one table, read in one script (the page replaces rows every snapshot).
_TABLE_ROWS = """
return Array.from(document.querySelectorAll(arguments[0] + ' tbody tr'), (tr) =>
  [tr.dataset.key ?? null, ...Array.from(tr.cells, (td) => td.textContent)]);
"""


def _table(driver: Any, table: str) -> list[list[str | None]]:
    """Each row of ``#table``'s body: its key (None for the "empty" row), then its cells."""
    rows: list[list[str | None]] = driver.execute_script(_TABLE_ROWS, f"#{table}")
    return rows


def _rows(driver: Any) -> list[tuple[str | None, ...]]:
    """(exchange id, protocol, session, phase) of each row of the in-flight table."""
    return [(r[0], r[2], r[3], r[4]) for r in _table(driver, "exchanges") if r[0] is not None]


def _wait(driver: Any, what: str, check: Any, within: float = 30.0) -> Any:
    """Poll ``check(driver)`` every 50 ms until truthy; its value. Fails after ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # bounded by the deadline
        value = check(driver)
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"the page never showed {what} within {within} s")


def _requested_urls(driver: Any) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


async def test_browser_shows_a_stream_move_through_its_phases_and_go() -> None:
    async with proxy_with_emulator(plugins=["usage"]) as h:
        driver = await asyncio.to_thread(chromium)
        try:
            await asyncio.to_thread(driver.get, f"{h.url}/admin/")
            await asyncio.to_thread(
                _wait,
                driver,
                "a live status",
                lambda d: (
                    d.execute_script("return document.getElementById('status').textContent")
                    == "live"
                ),
            )
            # Headers after STALL_S seconds (phase "sent"), then held after its first event.
            stream = asyncio.create_task(_stream(h, f"stall_headers={STALL_S};hold=page;usage=1"))
            # Its first phases (reading to prepared) last a millisecond; "sent" STALL_S seconds.
            (first,) = await asyncio.to_thread(
                _wait,
                driver,
                "the exchange waiting for the upstream",
                lambda d: [r for r in _rows(d) if r[3] == "sent"],
                STALL_S,
            )
            ex_id, protocol, session, _ = first
            assert (protocol, session) == ("openai-chat", SESSION)
            streaming = await asyncio.to_thread(
                _wait,
                driver,
                "the exchange streaming",
                lambda d: [r for r in _rows(d) if r[0] == ex_id and r[3] == "streaming"],
            )
            assert streaming
            source = await asyncio.to_thread(lambda: driver.page_source)
            assert PROMPT not in source and KEY not in source
            h.emulator.release("page")
            assert await stream == "Hello from the emulator."
            gone = await asyncio.to_thread(
                _wait,
                driver,
                "the exchange gone",
                lambda d: _table(d, "exchanges") == [[None, "no exchange in flight"]],
            )
            assert gone
            # The session with its usage (the usage plugin's), at the next slow poll.
            session_row = await asyncio.to_thread(
                _wait,
                driver,
                "the session's usage",
                lambda d: [r for r in _table(d, "sessions") if r[0] == SESSION and r[8] != "-"],
                15.0,
            )
            # session, in flight, requests, active, input, cached, cache write, output
            assert session_row[0][1:4] == [SESSION, "0", "1"]
            assert int(session_row[0][8] or "0") > 0  # output tokens
            # Usage by model as GET /admin/usage?by=model has it (a 404 while it is not kept).
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"{h.url}/admin/usage?by=model") as resp,
            ):
                by_model = (await resp.json())["rows"] if resp.status == 200 else []
            want = [
                [r["key"], r["key"], str(r["requests"]), f"{r['input_tokens']:,}"] for r in by_model
            ] or [[None, "no usage data"]]
            usage = await asyncio.to_thread(
                _wait,
                driver,
                "usage by model",
                lambda d: [r[:4] for r in _table(d, "usage")] == want,
                15.0,
            )
            assert usage
            chart_lines = await asyncio.to_thread(
                lambda: driver.find_elements(By.CSS_SELECTOR, "#chart polyline")
            )
            assert chart_lines  # RSS at least
            source = await asyncio.to_thread(lambda: driver.page_source)
            assert PROMPT not in source and KEY not in source
            urls = await asyncio.to_thread(_requested_urls, driver)
            assert urls and all(u.startswith(f"{h.url}/") for u in urls), urls
            # No script error and no CSP refusal (network lines: a 404 /favicon.ico, usage).
            console = await asyncio.to_thread(driver.get_log, "browser")
            assert [e for e in console if e["source"] != "network"] == []
        finally:
            await asyncio.to_thread(driver.quit)


async def test_browser_says_no_usage_data_without_a_usage_plugin_and_when_stopped() -> None:
    async with proxy_with_emulator() as h:
        driver = await asyncio.to_thread(chromium)
        try:
            await asyncio.to_thread(driver.get, f"{h.url}/admin/")
            usage = await asyncio.to_thread(
                _wait,
                driver,
                "the usage table after its first poll",
                lambda d: (
                    d.execute_script("return document.getElementById('usage').dataset.answered")
                    and _table(d, "usage") == [[None, "no usage data"]]
                ),
            )
            assert usage
            urls = await asyncio.to_thread(_requested_urls, driver)
            assert f"{h.url}/admin/usage?by=model" in urls
            # The drain's end event: the page says so and does not reconnect.
            await h.stop()
            stopped = await asyncio.to_thread(
                _wait,
                driver,
                "the proxy stopped",
                lambda d: (
                    d.execute_script("return document.getElementById('status').textContent")
                    == "proxy stopped"
                ),
                10.0,
            )
            assert stopped
        finally:
            await asyncio.to_thread(driver.quit)


async def test_browser_shows_a_hostile_session_id_as_text() -> None:
    hostile = '<img src=x id=injected onerror="document.title=1">'
    async with proxy_with_emulator() as h:
        client = _client(h)
        await client.chat.completions.create(
            model="emulator-1",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-session-id": hostile},
        )
        await client.close()
        driver = await asyncio.to_thread(chromium)
        try:
            await asyncio.to_thread(driver.get, f"{h.url}/admin/")
            rows = await asyncio.to_thread(
                _wait,
                driver,
                "the session",
                lambda d: [r for r in _table(d, "sessions") if r[0] is not None],
            )
            # Shown as text, cut like the CLI cuts ids; the whole id is the cell's title.
            assert [r[1] for r in rows] == [hostile[:23] + "\u2026"]
            title = await asyncio.to_thread(
                driver.execute_script, "return document.querySelector('#sessions td.id').title"
            )
            assert title == hostile
            injected = await asyncio.to_thread(
                driver.execute_script, "return document.getElementById('injected')"
            )
            assert injected is None
        finally:
            await asyncio.to_thread(driver.quit)


# ------------------------------------------------------------------ the terminal


async def _top_once(h: Harness) -> tuple[int | None, bytes, bytes]:
    """``context-proxy top --once --url`` against ``h`` (30 s at most): status, stdout,
    stderr. The child gets no ``CONTEXT_PROXY_ADMIN_TOKEN`` of this environment's."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "top",
        "--once",
        "--url",
        h.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "CONTEXT_PROXY_ADMIN_TOKEN"},
    )
    out, err = await asyncio.wait_for(child.communicate(), 30)
    return child.returncode, out, err


async def test_top_once_prints_the_in_flight_table() -> None:
    async with proxy_with_emulator() as h:
        stream = asyncio.create_task(_stream(h, "hold=top"))
        await _in_flight(h)
        (ex_id,) = list(h.state.exchanges)
        code, out, err = await _top_once(h)
        h.emulator.release("top")
        await stream
    assert code == 0, err.decode()
    text = out.decode()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    (row,) = [line for line in lines if line.lstrip().startswith(ex_id)]
    assert "openai-chat" in row and SESSION in row
    assert re.search(r"\b(sent|accepted|streaming)\b", row)
    assert "RSS" in text
    assert PROMPT not in text and KEY not in text


async def test_top_once_says_so_when_nothing_is_in_flight() -> None:
    async with proxy_with_emulator() as h:
        code, out, err = await _top_once(h)
    assert code == 0, err.decode()
    assert "no exchange in flight" in out.decode()


async def test_top_refused_names_the_token() -> None:
    async with proxy_with_emulator(admin_allow=[], admin_token="tok-123") as h:
        code, _, err = await _top_once(h)
    assert code == 1
    assert "HTTP 403" in err.decode() and "CONTEXT_PROXY_ADMIN_TOKEN" in err.decode()


async def test_top_opens_the_stream_again_after_its_end_of_life(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live, "EVENTS_MAX_S", 0.5)  # two snapshots per stream: at 0 and 0.5 s
    async with proxy_with_emulator() as h:
        stream = top.snapshots(h.url, None)
        try:
            snaps = [await asyncio.to_thread(next, stream) for _ in range(5)]
        finally:
            stream.close()
    assert all(s["exchanges"] == [] for s in snaps)
    times = [s["time"] for s in snaps]
    assert times == sorted(times)


async def test_top_live_ends_when_the_proxy_drains() -> None:
    async with proxy_with_emulator() as h:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            "top",
            "--url",
            h.url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert child.stdout is not None
        # The first frame is drawn: top is reading the stream.
        first = await asyncio.wait_for(child.stdout.readuntil(b"in flight"), 30)
        assert b"RSS" in first
        await h.stop()
        out, err = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 0, err.decode()
    assert "the proxy ended the stream (draining)" in out.decode()


async def test_a_spooled_upload_is_shown_as_spooled_in_events_and_top() -> None:
    # A body over spool_above_bytes is in a file: the page and `top` must say so, or RSS
    # grows with nothing on screen to explain it.
    async with proxy_with_emulator(spool_above_bytes=100_000) as h:
        body = exact_body(CHAT_PATH, 150_000)
        upload = await RawClient.connect(h.url)
        try:
            await upload.start_upload(CHAT_PATH, body, 120_000)
            await wait_until(
                lambda: any(e.reading_bytes == 120_000 for e in h.state.exchanges.values()),
                "the upload's first bytes are read",
            )
            snap = live.snapshot(h.state)
            (view,) = snap["exchanges"]
            assert view["held_bytes"]["spooled"] == 120_000
            assert view["held_bytes"]["total"] == 0  # the heap holds none of it
            assert snap["spooled_bytes"] == 120_000
            text = top.print_once(snap, 80)
            (row,) = [line for line in text.splitlines() if line.lstrip().startswith(view["id"])]
            assert "spool=117K" in row, text
            assert "spooled 117K" in text.splitlines()[0], text
        finally:
            await upload.close()


def _in_flight_first(driver: Any) -> list[list[str | None]] | None:
    """The sessions table once its first row is SESSION with one exchange in flight."""
    rows = _table(driver, "sessions")
    return rows if rows and rows[0][:3] == [SESSION, SESSION, "1"] else None


async def test_browser_lists_sessions_in_flight_first_even_past_the_first_page() -> None:
    async with proxy_with_emulator(plugins=["usage"]) as h:
        client = _client(h)
        try:
            for n in range(55):  # older sessions fill the listing's first page of 50
                await client.chat.completions.create(
                    model="emulator-1",
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"x-session-id": f"old-{n:02d}"},
                )
        finally:
            await client.close()
        driver = await asyncio.to_thread(chromium)
        stream = asyncio.create_task(_stream(h, "hold=late"))
        try:
            await _in_flight(h)
            await asyncio.to_thread(driver.get, f"{h.url}/admin/")
            rows = await asyncio.to_thread(
                _wait,
                driver,
                "the session in flight at the top of the sessions table",
                _in_flight_first,
                15.0,
            )
            assert rows[-1][0] == "more"  # the listing has more pages: the table says so
            assert len(rows) == 51
        finally:
            h.emulator.release("late")
            await stream
            await asyncio.to_thread(driver.quit)


# -----------------------------------------------------------------------------
# Many viewers of ``GET /admin/events`` cost one snapshot per half interval, not one each.
#
# A snapshot walks every in-flight exchange (about 5 ms per 1,000 of them); built per
# viewer, 100 viewers of a busy proxy kept its event loop busy half of every second.


VIEWERS = 30
WATCH_S = 2.2  # seconds all viewers stay connected after their first snapshot


async def _first_event(stream: aiohttp.ClientResponse) -> None:
    async with asyncio.timeout(5):
        while not (await stream.content.readline()).startswith(b"data: "):
            pass


async def test_viewers_share_their_periodic_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    real = live.snapshot

    def counted(state: Any) -> dict[str, Any]:
        made.append(1)
        return real(state)

    monkeypatch.setattr(live, "snapshot", counted)
    async with (
        proxy_with_emulator() as h,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):
        streams = [await http.get(f"{h.url}/admin/events") for _ in range(VIEWERS)]
        try:
            await asyncio.gather(*(_first_event(s) for s in streams))
            assert len(made) == VIEWERS  # each viewer's first snapshot is its own
            made.clear()
            await asyncio.sleep(WATCH_S)
            # Built per viewer: about VIEWERS * WATCH_S of them; shared: a few a second.
            assert len(made) <= 3 * (WATCH_S + 1), len(made)
        finally:
            for stream in streams:
                stream.close()


# -----------------------------------------------------------------------------
# ``context-proxy top`` against an event stream cut before its first snapshot.
#
# Something between top and the proxy (a reverse proxy's error page served as 200, a
# buffering intermediary) may end the stream at once. top opened it again at once, for
# ever: a busy loop against the proxy, and a terminal that never came back.


async def test_top_gives_up_on_a_stream_that_ends_before_any_snapshot() -> None:
    opened: list[int] = []

    async def events(request: web.Request) -> web.Response:
        opened.append(1)
        return web.Response(body=b"", content_type="text/event-stream")

    app = web.Application()
    app.router.add_get("/admin/events", events)
    async with serve_app(app) as url:
        proc = await Proc.start("top", "top", "--url", url)
        try:
            code = await proc.wait_exit(10)
        finally:
            await proc.stop()
    assert code == 1, proc.output
    assert "ended before its first snapshot" in proc.output
    assert len(opened) == 1


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"\xff\xfe"])
async def test_top_names_a_stream_that_is_not_a_proxys_instead_of_a_traceback(
    data: bytes,
) -> None:
    async def events(request: web.Request) -> web.Response:
        return web.Response(
            body=b"event: snapshot\ndata: " + data + b"\n\n", content_type="text/event-stream"
        )

    app = web.Application()
    app.router.add_get("/admin/events", events)
    async with serve_app(app) as url:
        proc = await Proc.start("top", "top", "--once", "--url", url)
        try:
            code = await proc.wait_exit(10)
        finally:
            await proc.stop()
    assert code == 1, proc.output
    assert "not a JSON object" in proc.output and "Traceback" not in proc.output


# -----------------------------------------------------------------------------
# Names a client chooses (model, session id) reach the operator's terminal as text.
#
# A model or session id is whatever a client sent: ``[/x]`` is rich markup (a closing
# tag with no opening one made ``context-proxy usage`` and ``top`` die with a
# ``MarkupError`` traceback for every operator), an ESC sequence would drive the
# terminal, and a ``/`` in a session id made ``GET``/``DELETE /admin/sessions/{id}``
# a 404, so the session could be neither shown nor closed, and ``context-proxy
# sessions`` failed as a whole.


MARKUP = "[/x]"
ESCAPE = "evil\x1b]0;title\x07\x1b[2J"
SLASHED = "team/42"


async def _send(h: Harness, http: aiohttp.ClientSession, model: str, session: str) -> None:
    async with http.post(
        f"{h.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-session-id": session, "authorization": "Bearer k"},
    ) as answer:
        assert answer.status == 200
        await answer.read()


async def _cli(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli_main, list(args), env={"COLUMNS": "120"})


async def test_usage_prints_markup_and_escapes_in_names_as_text() -> None:
    async with proxy_with_emulator(plugins=[UsagePlugin()]) as h, aiohttp.ClientSession() as http:
        await _send(h, http, MARKUP, "[/y]")
        await _send(h, http, ESCAPE, "plain")
        await h.settle()
        by_model = await _cli("usage", "--url", h.url)
        by_session = await _cli("usage", "--by", "session", "--url", h.url)
    assert by_model.exit_code == 0, by_model.output
    assert by_session.exit_code == 0, by_session.output
    assert MARKUP in by_model.output and "[/y]" in by_session.output
    assert "\x1b" not in by_model.output and "\x07" not in by_model.output
    assert "evil\\x1b]0;title" in by_model.output


def test_top_draws_a_session_id_that_looks_like_markup() -> None:
    snap = {
        "rss_bytes": 1,
        "held_by_phase": {},
        "exchanges": [
            {
                "id": "ex-1",
                "protocol": "openai-chat",
                "session": "[/x]",
                "phase": "sent",
                "fold_level": 0,
                "age_s": 1.0,
                "held_bytes": {},
            },
        ],
    }
    assert "[/x]" in top.print_once(snap, 120)


async def test_a_session_id_with_a_slash_can_be_shown_listed_and_closed() -> None:
    async with proxy_with_emulator(plugins=[UsagePlugin()]) as h, aiohttp.ClientSession() as http:
        await _send(h, http, "m", SLASHED)
        await h.settle()
        url = f"{h.url}/admin/sessions/{urllib.parse.quote(SLASHED, safe='')}"
        async with http.get(url) as answer:
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["id"] == SLASHED
        listed = await _cli("sessions", "--url", h.url)
        assert listed.exit_code == 0, listed.output
        assert SLASHED in listed.output
        async with http.delete(url) as answer:
            assert answer.status in (200, 202), await answer.text()
        async with http.get(url) as answer:
            assert answer.status == 200
            assert (await answer.json())["tombstoned"] is True
