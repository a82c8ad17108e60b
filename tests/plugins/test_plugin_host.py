"""PluginHost: hooks resolved once, one dispatch path, isolation (no sockets).

A hook no plugin overrides must cost nothing per request: no method lookup, no
coroutine, no timer. The probes below count exactly those.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from collections.abc import Iterator
from typing import Any

import pytest

import proxy._plugins as plugins_module
from proxy import Plugin
from proxy._plugins import PluginError, PluginHost, PrepareContext
from proxy._protocols import Protocol
from proxy._wire import WireMetadata, compute_wire_metadata, digest_bytes
from proxy.testing import make_record

HOOKS = ("wants_prepare", "wants_body", "prepare", "commit", "session_closed", "session_state")
REQUESTS = 50


def make_meta() -> WireMetadata:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    return compute_wire_metadata(Protocol.CHAT, body, digest_bytes(body))


class Probe:
    """Counts hook lookups on instances of a class, and timers the host starts."""

    def __init__(self) -> None:
        self.lookups: dict[str, int] = {}
        self.timers = 0

    def looked_up(self, name: str) -> None:
        if name in HOOKS:
            self.lookups[name] = self.lookups.get(name, 0) + 1

    @contextlib.contextmanager
    def counting_timers(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        real = asyncio.timeout

        def timeout(delay: float | None) -> asyncio.Timeout:
            self.timers += 1
            return real(delay)

        monkeypatch.setattr(plugins_module.asyncio, "timeout", timeout)
        yield


PROBE = Probe()


class Counted(Plugin):
    """Every attribute lookup on an instance goes through the probe."""

    def __getattribute__(self, name: str) -> Any:
        PROBE.looked_up(name)
        return super().__getattribute__(name)


class Quiet(Counted):
    """Overrides no per-request hook (it only exports state to the admin view)."""

    name = "quiet"

    def session_state(self, session_id: str) -> dict[str, int]:
        return {"n": 1}


class Booker(Counted):
    name = "booker"

    def __init__(self) -> None:
        self.commits = 0

    async def commit(self, record: Any) -> None:
        self.commits += 1


async def one_request(host: PluginHost) -> None:
    meta = make_meta()
    wants = host.wants_body(meta, 0)
    ctx = PrepareContext(meta=meta, fold_level=0, session_id=None, path="/v1/x", body=None)
    await host.run_prepare(ctx, wants)
    await host.run_commit(make_record())


async def test_hooks_nobody_overrides_dispatch_nothing_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = PluginHost([Quiet(), Quiet()], timeout=5.0)
    PROBE.lookups.clear()
    with PROBE.counting_timers(monkeypatch):
        for _ in range(REQUESTS):
            await one_request(host)
    assert PROBE.lookups == {} and PROBE.timers == 0
    assert host.session_state("s") == {"quiet": {"n": 1}}  # the hook it has still runs


async def test_an_overridden_hook_is_the_only_one_dispatched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    booker = Booker()
    host = PluginHost([Quiet(), booker], timeout=5.0)
    PROBE.lookups.clear()
    with PROBE.counting_timers(monkeypatch):
        for _ in range(REQUESTS):
            await one_request(host)
    assert PROBE.lookups == {"commit": REQUESTS} and PROBE.timers == REQUESTS
    assert booker.commits == REQUESTS
    assert host.implementing("commit") == (booker,) and host.implementing("prepare") == ()


class Editor(Plugin):
    name = "editor"

    def __init__(self, *, want: bool, fail: bool = False) -> None:
        self.want, self.fail, self.asked = want, fail, 0

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        self.asked += 1
        return self.want

    async def prepare(self, ctx: PrepareContext) -> bool:
        if self.fail:
            ctx.body["touched"] = True
            raise RuntimeError("half way")
        return False


class AsksButNeverPrepares(Plugin):
    name = "asks"

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        raise AssertionError("asked for the body without a prepare hook to use it")


async def test_only_plugins_with_a_prepare_hook_are_asked_for_the_body() -> None:
    first, second = Editor(want=False), Editor(want=True, fail=True)
    host = PluginHost([AsksButNeverPrepares(), first, second], timeout=5.0)
    meta = make_meta()
    wants = host.wants_body(meta, 0)
    assert wants == [False, True] and first.asked == second.asked == 1
    ctx = PrepareContext(meta=meta, fold_level=0, session_id=None, path="/v1/x", body={})
    # The granted plugin raised after touching the body: that counts as a change.
    assert await host.run_prepare(ctx, wants) is True
    assert host.failures == {"editor": 1}


class Declines(Counted):
    """Has a prepare hook, but declines every run at fold level 0 (as ``fold`` does)."""

    name = "declines"

    def __init__(self, *, fail: bool = False) -> None:
        self.fail, self.prepared, self.asked_body = fail, 0, 0

    def wants_prepare(self, meta: WireMetadata, fold_level: int) -> bool:
        if self.fail:
            raise RuntimeError("broken")
        return fold_level > 0

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        self.asked_body += 1
        return False

    async def prepare(self, ctx: PrepareContext) -> bool:
        self.prepared += 1
        return False


async def test_a_declined_prepare_run_calls_nothing_of_that_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declines, editor = Declines(), Editor(want=False)
    host = PluginHost([declines, editor], timeout=5.0)
    PROBE.lookups.clear()
    PROBE.timers = 0
    with PROBE.counting_timers(monkeypatch):
        for _ in range(REQUESTS):
            await one_request(host)
    # Only wants_prepare was looked up on the declining plugin: no wants_body, no
    # prepare, no timer for it; the other plugin still ran once per request.
    assert PROBE.lookups == {"wants_prepare": REQUESTS}
    assert declines.prepared == declines.asked_body == 0
    assert PROBE.timers == REQUESTS and editor.asked == REQUESTS
    assert host.wants_body(make_meta(), 0) == [None, False]
    assert host.wants_body(make_meta(), 1) == [False, False]
    assert host.failures == {}


async def test_a_wants_prepare_that_raises_takes_part_and_is_booked() -> None:
    declines = Declines(fail=True)
    host = PluginHost([declines], timeout=5.0)
    meta = make_meta()
    wants = host.wants_body(meta, 0)
    assert wants == [False] and declines.asked_body == 1
    ctx = PrepareContext(meta=meta, fold_level=0, session_id=None, path="/v1/x", body=None)
    assert await host.run_prepare(ctx, wants) is False
    assert declines.prepared == 1 and host.failures == {"declines": 1}


class Hangs(Plugin):
    name = "hangs"

    async def commit(self, record: Any) -> None:
        await asyncio.Event().wait()

    async def session_closed(self, session_id: str) -> None:
        raise ValueError("no")


async def test_failures_are_isolated_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    booker = Booker()
    host = PluginHost([Hangs(), booker], timeout=0.2)
    caplog.set_level(logging.WARNING, logger="context_proxy.plugins")
    async with asyncio.timeout(5.0):
        await host.run_commit(make_record())
        await host.run_session_closed("s")
    assert booker.commits == 1  # the next plugin still ran
    assert host.failures == {"hangs": 2}
    assert [r.getMessage() for r in caplog.records] == [
        "plugin hangs: commit exceeded its 0.2s budget; skipped",
        "plugin hangs: session_closed raised ValueError; skipped",
    ]


class Opens(Plugin):
    """Opens a resource in __init__ and has no startup: a later failed start must close it."""

    name = "opens"

    def __init__(self) -> None:
        self.closed = False

    async def shutdown(self) -> None:
        self.closed = True


class Refuses(Plugin):
    name = "refuses"

    async def startup(self) -> None:
        raise OSError("port taken")


async def test_a_failed_startup_shuts_down_every_earlier_plugin() -> None:
    opens = Opens()
    host = PluginHost([opens, Refuses()], timeout=5.0)
    with pytest.raises(PluginError, match="refuses: startup failed: port taken"):
        await host.startup()
    assert opens.closed


# ------------------------------------------------------------------ options tables


class Named(Plugin):
    """A plugin whose ``name`` differs from the entry that loads it."""

    name = "named"

    def __init__(self, *, level: int = 0) -> None:
        self.level = level


def _entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register ``Named`` under the entry-point name "audit" (its name is "named")."""
    ep = importlib.metadata.EntryPoint(
        name="audit", value=f"{__name__}:Named", group=plugins_module.ENTRY_POINT_GROUP
    )

    def entry_points(*, group: str, name: str | None = None) -> list[Any]:
        return [ep] if group == ep.group and name in (None, ep.name) else []

    monkeypatch.setattr(plugins_module.importlib.metadata, "entry_points", entry_points)


def test_an_entry_point_plugin_takes_the_table_of_its_entry_or_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _entry_points(monkeypatch)
    for key in ("audit", "named"):
        (plugin,) = plugins_module.load_plugins(["audit"], {key: {"level": 3}}, timeout=1.0).plugins
        assert isinstance(plugin, Named) and plugin.level == 3
    with pytest.raises(PluginError, match=r"both \[plugin\.audit\] and \[plugin\.named\]"):
        plugins_module.load_plugins(
            ["audit"], {"audit": {"level": 1}, "named": {"level": 2}}, timeout=1.0
        )


def test_a_module_class_plugin_takes_the_table_of_its_entry_string() -> None:
    spec = f"{__name__}:Named"
    (plugin,) = plugins_module.load_plugins([spec], {spec: {"level": 4}}, timeout=1.0).plugins
    assert isinstance(plugin, Named) and plugin.level == 4
    # Its name is no key for it: the table would be silently ignored, so it is an error.
    with pytest.raises(PluginError, match=r"^\[plugin\.named\]: no plugin"):
        plugins_module.load_plugins([spec], {"named": {"level": 4}}, timeout=1.0)


def test_a_table_no_plugin_takes_is_a_startup_error_naming_it() -> None:
    with pytest.raises(PluginError, match=r'^\[plugin\."my\.mod:Thing"\]: no plugin'):
        plugins_module.load_plugins(["fold"], {"my.mod:Thing": {}}, timeout=1.0)
    with pytest.raises(PluginError, match=r"^\[plugin\.jsonlgo\]: no plugin"):
        plugins_module.load_plugins(["fold"], {"jsonlgo": {"path": "x"}}, timeout=1.0)
