"""pytest plugin for plugin authors: the ``context_proxy`` fixture.

The fixture starts the local upstream emulator and a proxy in front of it,
with your plugin, on ephemeral ports of 127.0.0.1, in the test's event loop::

    async def test_counts(context_proxy: ProxyFactory) -> None:
        counter = CountPerModelPlugin()
        h = await context_proxy(counter)
        client = openai.AsyncOpenAI(base_url=h.openai_base_url, api_key="test")
        await client.chat.completions.create(model="m1", messages=[...])
        await h.stop()                      # drain: commit and shutdown hooks have run
        assert counter.by_model == {"m1": 1}

Every proxy the test started is stopped at teardown, whether or not the test
called :meth:`~proxy.testing.Harness.stop`. Needs ``pytest-asyncio`` (the
fixture is async) and the ``testing`` extra (``pip install
'context-proxy[testing]'``: the emulator runs on aiohttp); without either,
requesting the fixture fails with a message saying so, and nothing else in the
test session changes. Loading this plugin imports neither the emulator nor
aiohttp (pytest loads it in every session of an environment with the package
installed): :mod:`proxy.testing` is imported when a test first asks for the
fixture.

Enable it with ``pytest_plugins = ["proxy.pytest_plugin"]`` in the top-level
``conftest.py`` of your tests, or ``-p proxy.pytest_plugin`` on the command line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ._plugins import Plugin
    from .testing import Harness

__all__ = ["ProxyFactory", "context_proxy"]


class ProxyFactory:
    """What the ``context_proxy`` fixture gives a test: call it to start a proxy.

    Each call starts one emulator and one proxy; all of them are stopped, last
    started first, when the test ends.
    """

    __slots__ = ("_stack",)

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack

    async def __call__(
        self,
        *plugins: Plugin | str,
        config: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> Harness:
        """Start a proxy using ``plugins``, run in the order given.

        Each is an instance, or a name loaded as ``context-proxy serve`` loads
        it (entry-point name or ``module:Class``; its options from
        ``plugin={"name": {...}}``). ``plugins=[...]`` as a keyword works too.
        With none, the plugins of ``config`` (a TOML settings file) are used, or
        none at all. Other keyword arguments override settings (for example
        ``plugin_timeout=0.5``); see :func:`proxy.testing.proxy_with_emulator`.

        Raises:
            TypeError: plugins given both positionally and as ``plugins=``.
            proxy.ConfigError: a bad setting.
            proxy._plugins.PluginError: a plugin cannot be loaded or its
                ``startup`` raised.
        """
        chosen: list[Plugin | str] | None = list(plugins) if plugins else None
        if "plugins" in settings:
            if chosen is not None:
                raise TypeError("pass plugins positionally or as plugins=[...], not both")
            chosen = list(settings.pop("plugins"))
        # Here, not at the top: loading the plugin must not load the emulator or aiohttp.
        from .testing import proxy_with_emulator

        return await self._stack.enter_async_context(
            proxy_with_emulator(plugins=chosen, config=config, **settings)
        )


async def _context_proxy() -> AsyncIterator[ProxyFactory]:
    """Start proxies on demand; stop them all at teardown.

    The emulator and aiohttp are imported here, by a test that asks for the
    fixture, never when pytest loads the plugin.
    """
    try:
        import proxy.testing  # noqa: F401  (checked here: a missing extra fails the setup)
    except ImportError as exc:  # the testing extra is not installed
        pytest.fail(f"the context_proxy fixture: {exc}", pytrace=False)
    async with contextlib.AsyncExitStack() as stack:
        yield ProxyFactory(stack)


def _needs_pytest_asyncio() -> ProxyFactory:
    """Stands in for the fixture when pytest-asyncio is missing."""
    pytest.fail("the context_proxy fixture needs pytest-asyncio: pip install pytest-asyncio")


context_proxy: Any
try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the project's tests always have it
    # Loading this plugin must never break a test session that does not use it.
    context_proxy = pytest.fixture(name="context_proxy")(_needs_pytest_asyncio)
else:
    context_proxy = pytest_asyncio.fixture(name="context_proxy")(_context_proxy)
