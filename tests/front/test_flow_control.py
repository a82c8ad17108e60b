"""The connection's record of why its transport is paused (proxy/_front.py, ``FlowControl``).

Reading pauses on the first reason and resumes only when the last one is gone: a
body read slowly and a full pipelining queue overlap, and neither may resume
reading while the other still holds it. Writing's pause is the transport's, and
``drain`` waits on it.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from proxy._front import FlowControl, Paused


class FakeTransport:
    """Counts pause/resume calls, as asyncio's transports take them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closing = False

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return self.closing


def flow() -> tuple[FlowControl, FakeTransport]:
    fake = FakeTransport()
    control = FlowControl()
    control.transport = cast(asyncio.Transport, fake)
    return control, fake


def test_reading_resumes_only_when_every_reason_is_gone() -> None:
    control, fake = flow()
    control.pause_reading(Paused.BODY)
    control.pause_reading(Paused.QUEUE)
    control.pause_reading(Paused.BODY)  # again: nothing new
    assert fake.calls == ["pause"]
    control.resume_reading(Paused.BODY)
    assert fake.calls == ["pause"] and control.reading_paused == Paused.QUEUE
    control.resume_reading(Paused.BODY)  # not paused for it: nothing
    control.resume_reading(Paused.QUEUE)
    assert fake.calls == ["pause", "resume"] and not control.reading_paused


def test_resuming_every_reason_at_once_resumes_once() -> None:
    control, fake = flow()
    control.resume_reading()  # nothing paused: no call
    control.pause_reading(Paused.QUEUE)
    control.pause_reading(Paused.BODY)
    control.resume_reading()
    assert fake.calls == ["pause", "resume"] and not control.reading_paused


def test_a_closing_transport_is_not_resumed() -> None:
    control, fake = flow()
    control.pause_reading(Paused.BODY)
    fake.closing = True
    control.resume_reading(Paused.BODY)
    assert fake.calls == ["pause"] and not control.reading_paused


async def test_drain_waits_for_writing_to_resume_and_fails_once_lost() -> None:
    control, _ = flow()
    await asyncio.wait_for(control.drain(), 1)  # not paused: at once
    control.pause_writing()
    waiting = asyncio.ensure_future(control.drain())
    await asyncio.sleep(0)
    assert not waiting.done()
    control.resume_writing()
    await asyncio.wait_for(waiting, 1)
    control.pause_writing()
    waiting = asyncio.ensure_future(control.drain())
    await asyncio.sleep(0)
    control.lost()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(waiting, 1)
    with pytest.raises(ConnectionResetError):
        control.writing_paused = False
        await control.drain()  # lost: even unpaused, nothing written would arrive
