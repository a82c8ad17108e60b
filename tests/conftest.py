"""Shared pytest configuration of the project's tests.

``proxy.pytest_plugin`` provides the ``context_proxy`` fixture (a proxy plus
the upstream emulator with the plugins a test passes), the same fixture plugin
authors use; loading it here tests it the way they load it. ``emulator`` is the
emulator alone, for tests that run a proxy of their own (a child process) against it.
``spy``, ``counted`` and ``no_gc`` watch an exchange's buffers (``tests.support.lifetime``).
A folder's own shared fixtures are in its ``conftest.py`` (``tests/e2e/conftest.py``).

Hypothesis profiles (pick one with ``--hypothesis-profile NAME``):

* ``ci`` (the default): few examples, no per-example deadline (2 shared cores
  make timings meaningless), so each property suite takes a few seconds;
* ``long``: a local soak, thousands of examples per property, e.g.
  ``python -m pytest tests/*/test_properties_*.py --hypothesis-profile long --timeout 0``
  (minutes per property: the suite's 120 s per-test timeout must be lifted).
"""

import gc
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import HealthCheck, settings

from proxy.testing import EmulatorServer, start_emulator
from tests.support.lifetime import Spy, install_codec_counts, install_spy

pytest_plugins = ["proxy.pytest_plugin"]


@pytest.fixture
async def emulator() -> AsyncIterator[EmulatorServer]:
    """The project's emulator on an ephemeral loopback port, closed after the test."""
    async with await start_emulator() as server:
        yield server


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Every :class:`~proxy._exchange.Exchange` the app makes, traced (phases, releases,
    when each buffer was freed): :func:`tests.support.lifetime.install_spy`."""
    return install_spy(monkeypatch)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of full parses and serializations of request bodies (``parse``, ``encode``)."""
    return install_codec_counts(monkeypatch)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """No cyclic GC during the test: a buffer must be freed by reference counting alone.

    A buffer that only a reference cycle keeps alive stays in memory until the
    next full collection, which in a busy proxy can be many seconds away.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=3000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
