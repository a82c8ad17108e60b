"""Shared pytest configuration of the project's tests.

``proxy.pytest_plugin`` provides the ``context_proxy`` fixture (a proxy plus
the upstream emulator with the plugins a test passes), the same fixture plugin
authors use; loading it here tests it the way they load it. ``emulator`` is the
emulator alone, for tests that run a proxy of their own (a child process) against it.

Hypothesis profiles (pick one with ``--hypothesis-profile NAME``):

* ``ci`` (the default): few examples, no per-example deadline (2 shared cores
  make timings meaningless), so each property suite takes a few seconds;
* ``long``: a local soak, thousands of examples per property, e.g.
  ``python -m pytest tests/*/test_properties_*.py --hypothesis-profile long --timeout 0``
  (minutes per property: the suite's 120 s per-test timeout must be lifted).
"""

from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, settings

from proxy.testing import EmulatorServer, start_emulator

pytest_plugins = ["proxy.pytest_plugin"]


@pytest.fixture
async def emulator() -> AsyncIterator[EmulatorServer]:
    """The project's emulator on an ephemeral loopback port, closed after the test."""
    async with await start_emulator() as server:
        yield server


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
