"""Fixtures of the end-to-end tests: a proxy in front of the emulator, an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.testing import Harness, proxy_with_emulator


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A proxy (no plugins) in front of the emulator, both on ephemeral loopback ports."""
    async with proxy_with_emulator() as h:
        yield h


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp client whose requests each take at most 20 s."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session
