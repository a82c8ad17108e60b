"""The event-loop setting: asyncio by default, uvloop on request, a fallback without uvloop."""

from __future__ import annotations

import asyncio
import builtins
import logging
import sys
from typing import Any

import openai
import pytest
import uvloop

from proxy import _loops as loops
from proxy._config import ConfigError, load_settings
from tests.support.lifetime import SubprocessEmulator, proxy_at


def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def _kind() -> str:
    return _loop_kind()


def test_default_setting_runs_on_the_standard_loop() -> None:
    settings = load_settings(environ={})
    assert settings.event_loop == "asyncio"
    assert loops.run(_kind(), settings.event_loop) == "asyncio"


def test_uvloop_setting_runs_on_uvloop() -> None:
    settings = load_settings(environ={"CONTEXT_PROXY_EVENT_LOOP": "uvloop"})
    assert loops.run(_kind(), settings.event_loop) == "uvloop"


def test_unknown_loop_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^CONTEXT_PROXY_EVENT_LOOP: .*trio"):
        load_settings(environ={"CONTEXT_PROXY_EVENT_LOOP": "trio"})


def test_without_uvloop_installed_it_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "uvloop")
    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    factory, used = loops.loop_factory("uvloop")
    assert used == "asyncio"
    assert factory is asyncio.new_event_loop
    with caplog.at_level(logging.WARNING, logger="proxy._loops"):
        assert loops.run(_kind(), "uvloop") == "asyncio"
    assert "not importable" in caplog.text
    assert uvloop.__name__ == "uvloop"


def test_a_streamed_exchange_on_uvloop_reaches_the_client_whole() -> None:
    """The whole exchange path (our upstream client included) on uvloop's transports,
    through the emulator, with the openai SDK as the client: a stream and a JSON answer."""

    async def exchange(emulator_url: str) -> tuple[str, str]:
        async with proxy_at(emulator_url) as proxy:
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
            async with client:
                messages: Any = [{"role": "user", "content": "hi"}]
                stream = await client.chat.completions.create(
                    model="m", messages=messages, stream=True
                )
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
                whole = await client.chat.completions.create(model="m", messages=messages)
                return text, whole.choices[0].message.content or ""

    with SubprocessEmulator() as emulator, asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        streamed, whole = r.run(exchange(emulator.url))
    assert streamed and whole
