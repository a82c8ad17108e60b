"""Test helpers for plugin authors and for the project's own tests.

``proxy_with_emulator`` starts the built-in upstream emulator and a proxy in
front of it, both on ephemeral ports of 127.0.0.1, in the running event loop::

    from proxy.testing import proxy_with_emulator

    async def test_counts_requests() -> None:
        counter = RequestCounter()
        async with proxy_with_emulator(plugins=[counter]) as h:
            client = openai.AsyncOpenAI(base_url=h.openai_base_url, api_key="test")
            await client.chat.completions.create(model="m", messages=[...])
        assert counter.by_model == {"m": 1}

Leaving the block drains the proxy (commit hooks finish, plugins shut down)
and stops the emulator, so assertions after it see the final state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from .app import STATE, AppState, build_app, running
from .config import Settings, load_settings
from .emulator import EmulatorServer, start_emulator
from .plugins import Plugin, PluginHost

__all__ = ["Harness", "proxy_with_emulator"]


@dataclasses.dataclass(frozen=True, slots=True)
class Harness:
    """A running proxy in front of a running emulator.

    ``url`` is the proxy's base URL (``http://127.0.0.1:<port>``);
    ``openai_base_url`` adds ``/v1`` as the ``openai`` SDK expects, while the
    ``anthropic`` SDK takes ``url`` itself.
    """

    url: str
    emulator: EmulatorServer
    app: web.Application
    settings: Settings

    @property
    def openai_base_url(self) -> str:
        """Base URL for ``openai.OpenAI(base_url=...)``."""
        return f"{self.url}/v1"

    @property
    def state(self) -> AppState:
        """The proxy's live state (exchanges, sessions, metrics, plugins)."""
        return self.app[STATE]


@contextlib.asynccontextmanager
async def proxy_with_emulator(
    *,
    plugins: Sequence[Plugin] | None = None,
    plugin_timeout: float = 5.0,
    **settings: Any,
) -> AsyncIterator[Harness]:
    """Run the emulator and a proxy using ``plugins`` (instances, in order).

    ``settings`` override :class:`~proxy.config.Settings` fields (for example
    ``max_body_bytes=1024``); the upstream URLs always point at the emulator and
    the environment is ignored. ``plugins=None`` loads the plugins named in
    ``settings`` (none by default here).

    Raises:
        proxy.config.ConfigError: a bad setting.
    """
    async with await start_emulator() as emulator:
        overrides: dict[str, Any] = {
            "plugins": [],
            "shutdown_grace": 5.0,
            **settings,
            "upstream_openai": emulator.url,
            "upstream_anthropic": emulator.url,
            "plugin_timeout": plugin_timeout,
        }
        resolved = load_settings(environ={}, overrides=overrides)
        host = PluginHost(plugins, timeout=plugin_timeout) if plugins is not None else None
        app = build_app(resolved, host=host)
        async with running(app, "127.0.0.1", 0) as port:
            yield Harness(f"http://127.0.0.1:{port}", emulator, app, resolved)
