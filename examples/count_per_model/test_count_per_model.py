"""Tests of the count_per_model plugin: the hooks alone, then through a real proxy."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest
from count_per_model import CountPerModelPlugin

from proxy.pytest_plugin import ProxyFactory
from proxy.testing import make_record

CONFIG = Path(__file__).with_name("context-proxy.toml")


async def test_counts_per_model_and_forgets_closed_sessions() -> None:
    plugin = CountPerModelPlugin(max_models=1)
    await plugin.commit(make_record(model="m1"))
    await plugin.commit(make_record(model="m1"))
    await plugin.commit(make_record(model="m2", session_id="s2"))
    assert plugin.by_model == {"m1": 2, "other": 1}
    assert plugin.session_state("s1") == {"requests": 2}
    await plugin.session_closed("s1")
    assert plugin.session_state("s1") == {}
    assert plugin.session_state("s2") == {"requests": 1}


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="max_models"):
        CountPerModelPlugin(max_models=0)


async def test_counts_through_the_proxy(context_proxy: ProxyFactory) -> None:
    counter = CountPerModelPlugin()
    h = await context_proxy(counter)
    client = openai.AsyncOpenAI(
        base_url=h.openai_base_url, api_key="test", default_headers={"x-session-id": "s1"}
    )
    for model in ("m1", "m1", "m2"):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
    # The client has its answer before the proxy runs the commit hooks.
    await h.settle()
    view = await h.session_view("s1")
    assert view is not None
    assert view["plugins"]["count_per_model"] == {"requests": 3}
    assert h.metric("count_per_model_requests_total", model="m1") == 2
    await h.stop()  # drains the proxy: every hook, shutdown included, has run
    assert counter.by_model == {"m1": 2, "m2": 1}


async def test_the_config_file_enables_it(context_proxy: ProxyFactory) -> None:
    h = await context_proxy(config=CONFIG)
    names = [plugin.name for plugin in h.state.host.plugins]
    assert names == ["fold", "count_per_model"]
    counter = h.state.host.plugins[1]
    assert isinstance(counter, CountPerModelPlugin)
    assert counter.max_models == 50
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="test")
    await client.messages.create(
        model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    await h.stop()
    assert counter.by_model == {"claude-x": 1}
