"""The live admin page in a real headless Chromium, and ``docs/admin-page.png``.

``python -m benchmarks.admin_page [PATH]`` starts the emulator and a proxy with the
``usage`` plugin on loopback ports, finishes a few exchanges (so that sessions have
usage), holds two streams in flight (one OpenAI, one Anthropic), lets the page draw
about 20 s of its memory chart, and saves a screenshot of ``/admin/`` to ``PATH``
(default ``docs/admin-page.png``).

:func:`chromium` is the browser the tests drive too: Debian's ``chromium`` through
its ``chromedriver`` (packages ``chromium`` and ``chromium-driver``), never a
downloaded build, with every host but loopback unresolvable so that the page
cannot reach anything but the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import anthropic
import openai
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from proxy.testing import Harness, proxy_with_emulator

__all__ = ["CHROMEDRIVER", "CHROMIUM", "chromium", "main", "save_screenshot"]

CHROMIUM: Final = "/usr/bin/chromium"
CHROMEDRIVER: Final = "/usr/bin/chromedriver"
#: Seconds of chart the screenshot waits for (one point per snapshot, one a second).
CHART_S: Final = 20.0


def chromium(width: int = 1400, height: int = 1000) -> webdriver.Chrome:
    """A headless Chromium of ``width`` x ``height`` CSS pixels, logging the page's
    network requests (``driver.get_log("performance")``).

    Raises:
        FileNotFoundError: ``chromium`` or ``chromedriver`` is not installed.
        selenium.common.exceptions.WebDriverException: the browser did not start.
    """
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            raise FileNotFoundError(f"{path}: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        # No network beyond loopback: any other host fails to resolve.
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    # An explicit driver path: Selenium then never runs its manager (which downloads).
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


@contextlib.asynccontextmanager
async def busy_proxy() -> AsyncIterator[Harness]:
    """A proxy (``usage`` plugin, ``fake_completion_retries=1``) with finished exchanges
    in two sessions and three streams in flight, cut (the clients hang up) on exit:
    one waiting for the upstream's headers (``sent``, holding its body), one held right
    after them (``accepted``: its outbound body kept for a resend) and one streaming."""
    async with proxy_with_emulator(plugins=["usage"], fake_completion_retries=1) as h:
        oa = openai.AsyncOpenAI(base_url=h.openai_base_url, api_key="test", max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=h.url, api_key="test", max_retries=0)
        for session in ("agent-build", "agent-review"):
            await oa.chat.completions.create(
                model="emulator-1",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-session-id": session},
            )

        async def chat(session: str, script: str, size: int) -> None:
            stream = await oa.chat.completions.create(
                model="emulator-1",
                messages=[{"role": "user", "content": "x" * size}],
                stream=True,
                extra_headers={"x-session-id": session, "x-emulator": script},
            )
            async for _ in stream:
                pass

        async def messages() -> None:
            stream = await an.messages.create(
                model="claude-emulator",
                max_tokens=64,
                messages=[{"role": "user", "content": "y" * 300_000}],
                stream=True,
                extra_headers={"x-session-id": "agent-review", "x-emulator": "hold=shot"},
            )
            async for _ in stream:
                pass

        streams = [
            asyncio.create_task(chat("agent-build", "stall_headers=600", 2_000_000)),
            asyncio.create_task(chat("agent-plan", "hold=shot;stall_after=0", 1_000_000)),
            asyncio.create_task(messages()),
        ]
        try:
            yield h
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            await oa.close()
            await an.close()


async def save_screenshot(path: Path) -> None:
    """Run :func:`busy_proxy`, open its page for :data:`CHART_S` seconds, save a PNG."""
    async with busy_proxy() as h:
        driver = await asyncio.to_thread(chromium)
        try:
            await asyncio.to_thread(driver.get, f"{h.url}/admin/")
            await asyncio.sleep(CHART_S)
            await asyncio.to_thread(driver.save_screenshot, str(path))
        finally:
            await asyncio.to_thread(driver.quit)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.admin_page [PATH]``."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "docs/admin-page.png")
    started = time.monotonic()
    asyncio.run(save_screenshot(path))
    print(f"{path}: saved in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
