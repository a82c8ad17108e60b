"""Hostile query parameters of the admin routes are a 400 in JSON, never a 500 or a 503."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from plugins.usage import UsagePlugin
from proxy.testing import proxy_with_emulator


@pytest.mark.parametrize("route", ["/admin/usage", "/admin/sessions"])
@pytest.mark.parametrize("limit", ["%C2%B2", "%E2%91%A0"], ids=["superscript-2", "circled-1"])
async def test_a_limit_of_unicode_digits_is_a_400_not_an_internal_error(
    route: str, limit: str
) -> None:
    async with (
        proxy_with_emulator(plugins=[UsagePlugin()]) as h,
        aiohttp.ClientSession() as http,
        http.get(f"{h.url}{route}?limit={limit}") as answer,
    ):
        assert answer.status == 400, await answer.text()
        assert (await answer.json())["error"].startswith("limit:")


@pytest.mark.parametrize("store", [False, True], ids=["memory", "sqlite"])
async def test_a_cursor_that_is_not_utf8_is_a_400_and_the_store_is_not_blamed(
    tmp_path: Path, store: bool
) -> None:
    """``_w==`` is the URL-safe base64 of the byte 0xff: no key this endpoint issues."""
    plugin = UsagePlugin(path=str(tmp_path / "usage.db") if store else None)
    async with (
        proxy_with_emulator(plugins=[plugin]) as h,
        aiohttp.ClientSession() as http,
        http.get(f"{h.url}/admin/usage?by=session&cursor=_w==") as answer,
    ):
        assert answer.status == 400, await answer.text()
        assert (await answer.json())["error"].startswith("cursor:")
