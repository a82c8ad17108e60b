"""Fixtures of the cluster tests: a real redis-server of the test's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server on a free loopback port (skipped where it is not installed), its
    files in ``tmp_path``; resumed (if a test paused it) and stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.resume()
        server.stop()
