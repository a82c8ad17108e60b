"""The exchange's phase machine and bookkeeping methods, without sockets.

Every legal move of :data:`proxy._exchange.TRANSITIONS` is driven through the
public methods that make it; every move outside the table raises
:class:`IllegalTransition`; the observer sees each move exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest

from proxy import _wire as wire
from proxy._exchange import Exchange
from proxy._phases import TRANSITIONS, IllegalTransition, Phase
from proxy._plugins import Outcome, PluginHost
from proxy._prepare import Preparer, null_lock, prepare, refold
from proxy._protocols import Protocol, UsageReport

BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def _exchange(moves: list[tuple[Phase, Phase]] | None = None) -> Exchange:
    def observe(ex: Exchange, old: Phase, new: Phase) -> None:
        if moves is not None:
            moves.append((old, new))

    return Exchange(
        protocol=Protocol.CHAT,
        method="POST",
        path="/v1/chat/completions",
        keep_for_resend=True,
        observer=observe,
    )


def _attach(ex: Exchange) -> None:
    buffer = bytearray(BODY)
    meta = wire.compute_wire_metadata(Protocol.CHAT, buffer, "digest")
    ex.attach_body(buffer, meta)
    ex.bind_preparer(Preparer(PluginHost([], timeout=1.0), null_lock, None))


# How to drive an exchange from its current phase into each target phase, through
# the same public methods the app and the relay call.
def _enter(ex: Exchange, target: Phase) -> None:
    if target is Phase.PARSED:
        _attach(ex)
    elif target is Phase.PREPARED:
        if ex.phase is Phase.SENT:
            asyncio.run(refold(ex))
        else:
            asyncio.run(prepare(ex))
    elif target is Phase.SENT:
        ex.mark_sent()
    elif target is Phase.ACCEPTED:
        ex.accept()
    elif target is Phase.STREAMING:
        ex.mark_streaming()
    elif target is Phase.COMMITTED:
        ex.begin_commit()
    elif target is Phase.CLOSED:
        ex.close()
    else:  # pragma: no cover - READING is only ever the first phase
        raise AssertionError(target)


# A shortest path from READING to each phase, along legal moves only.
_PATHS: dict[Phase, list[Phase]] = {
    Phase.READING: [],
    Phase.PARSED: [Phase.PARSED],
    Phase.PREPARED: [Phase.PARSED, Phase.PREPARED],
    Phase.SENT: [Phase.PARSED, Phase.PREPARED, Phase.SENT],
    Phase.ACCEPTED: [Phase.PARSED, Phase.PREPARED, Phase.SENT, Phase.ACCEPTED],
    Phase.STREAMING: [Phase.PARSED, Phase.PREPARED, Phase.SENT, Phase.ACCEPTED, Phase.STREAMING],
    Phase.COMMITTED: [Phase.PARSED, Phase.COMMITTED],
    Phase.CLOSED: [Phase.CLOSED],
}


def _at(phase: Phase, moves: list[tuple[Phase, Phase]] | None = None) -> Exchange:
    ex = _exchange(moves)
    for step in _PATHS[phase]:
        _enter(ex, step)
    assert ex.phase is phase
    return ex


def test_the_table_covers_every_phase_and_includes_both_loops() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert Phase.PREPARED in TRANSITIONS[Phase.SENT]  # refold
    assert Phase.SENT in TRANSITIONS[Phase.ACCEPTED]  # resend
    assert TRANSITIONS[Phase.CLOSED] == frozenset()
    assert TRANSITIONS[Phase.COMMITTED] == frozenset({Phase.CLOSED})


LEGAL = [
    (old, new)
    for old, targets in TRANSITIONS.items()
    for new in sorted(targets, key=list(Phase).index)
]


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=[f"{o.value}->{n.value}" for o, n in LEGAL])
def test_every_legal_move_is_made_and_observed_once(old: Phase, new: Phase) -> None:
    moves: list[tuple[Phase, Phase]] = []
    ex = _at(old, moves)
    moves.clear()
    _enter(ex, new)
    assert ex.phase is new
    assert moves == [(old, new)]


ILLEGAL = [
    (old, new)
    for old, new in itertools.product(Phase, Phase)
    if new not in TRANSITIONS[old] and new is not Phase.READING
]


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{o.value}->{n.value}" for o, n in ILLEGAL])
def test_every_illegal_move_raises_and_leaves_the_phase(old: Phase, new: Phase) -> None:
    moves: list[tuple[Phase, Phase]] = []
    ex = _at(old, moves)
    moves.clear()
    if (old, new) == (Phase.ACCEPTED, Phase.ACCEPTED) or (old, new) == (Phase.CLOSED, Phase.CLOSED):
        # accept() and close() are idempotent: a second call is no move at all.
        _enter(ex, new)
        assert (ex.phase, moves) == (old, [])
        return
    held = ex.held_bytes()
    with pytest.raises(RuntimeError) as info:
        _enter(ex, new)
    if isinstance(info.value, IllegalTransition):
        assert (info.value.old, info.value.new) == (old, new)
    else:
        # prepare() with no body or after release says so (its older, more precise error).
        assert new is Phase.PREPARED and "prepare after release" in str(info.value)
    # Refused before any work: same phase, same buffers, nothing observed.
    assert (ex.phase, ex.held_bytes(), moves) == (old, held, [])


def test_illegal_transition_is_a_runtime_error_naming_the_move() -> None:
    ex = _at(Phase.STREAMING)
    with pytest.raises(IllegalTransition, match="streaming -> sent") as info:
        ex.mark_sent()
    assert isinstance(info.value, RuntimeError)


def test_a_commit_runs_once() -> None:
    ex = _at(Phase.STREAMING)
    record = ex.begin_commit()
    # The record carries the public str enum: equal to its string, typed for plugins.
    assert record.outcome is Outcome.OK and record.outcome == "ok"
    with pytest.raises(IllegalTransition):
        ex.begin_commit()
    # commit_record() only reads: no phase change, any number of times.
    assert ex.commit_record().exchange_id == ex.id
    assert ex.phase is Phase.COMMITTED


def test_start_reading_only_while_reading() -> None:
    ex = _exchange()
    ex.start_reading(1000)
    # A declared length reserves nothing: only bytes received count as held.
    assert (ex.declared_bytes, ex.held_bytes().raw) == (1000, 0)
    ex.count_received(600)
    assert ex.held_bytes().raw == 600
    ex.end_reading()
    assert ex.held_bytes().raw == 0
    _attach(ex)
    with pytest.raises(IllegalTransition):
        ex.start_reading(10)


def test_outcome_values_are_what_records_carry() -> None:
    assert [o.value for o in Outcome] == [
        "ok",
        "client_gone",
        "rejected",
        "cancelled",
        "upstream_error",
        "upstream_timeout",
        "upstream_unreachable",
        "stream_error",
        "error",
    ]


def test_client_gone_after_a_complete_answer_keeps_ok() -> None:
    ex = _at(Phase.STREAMING)
    ex.response_complete()
    ex.client_gone()
    assert ex.outcome is Outcome.OK
    cut = _at(Phase.STREAMING)
    cut.client_gone()
    assert cut.outcome is Outcome.CLIENT_GONE
    failed = _at(Phase.STREAMING)
    failed.set_outcome(Outcome.STREAM_ERROR, "upstream stream failed")
    failed.client_gone()
    assert (failed.outcome, failed.error) == (Outcome.STREAM_ERROR, "upstream stream failed")


def test_bookkeeping_methods_reach_the_record() -> None:
    ex = _at(Phase.ACCEPTED)
    ex.upstream_answered(200)
    ex.count_retry()
    ex.count_response_bytes(10)
    ex.count_response_bytes(5)
    ex.set_usage(UsageReport(3, 4, None, 5, 4, 1))
    ex.set_session("s-1")
    ex.mark_streaming()
    ex.conclude(502, Outcome.UPSTREAM_UNREACHABLE, "upstream unreachable")
    record = ex.begin_commit()
    assert (record.status, record.outcome, record.error) == (
        502,
        "upstream_unreachable",
        "upstream unreachable",
    )
    assert (record.retries, record.response_bytes, record.session_id) == (1, 15, "s-1")
    assert (record.input_tokens, record.output_tokens, record.cache_read_tokens) == (3, 4, None)
    assert (
        record.cache_write_tokens,
        record.cache_write_5m_tokens,
        record.cache_write_1h_tokens,
    ) == (5, 4, 1)


def test_response_side_bytes_are_held_bytes_until_close() -> None:
    ex = _at(Phase.STREAMING)
    assert ex.held_bytes().response == 0
    ex.hold_response(4096)
    held = ex.held_bytes()
    assert (held.response, held.total) == (4096, 4096)
    ex.close()
    assert ex.held_bytes().total == 0


def test_a_prepare_run_every_plugin_declines_takes_no_lock_and_keeps_the_body() -> None:
    """``fold`` declines fold level 0 (``wants_prepare``): the first prepare run is
    skipped whole (no session lock entered), the refold at level 1 is not."""
    from plugins.fold import FoldPlugin

    locks: list[int] = []

    def lock() -> contextlib.AbstractAsyncContextManager[object]:
        locks.append(1)
        return contextlib.nullcontext()

    moves: list[tuple[Phase, Phase]] = []
    ex = _exchange(moves)
    buffer = bytearray(
        BODY.replace(b'"content":"hi"}]', b'"content":"hi"},{"role":"user","content":"x"}]')
    )
    meta = wire.compute_wire_metadata(Protocol.CHAT, buffer, "digest")
    ex.attach_body(buffer, meta)
    ex.bind_preparer(Preparer(PluginHost([FoldPlugin()], timeout=1.0), lock, "s"))
    raw = ex.raw_holder
    asyncio.run(prepare(ex))
    assert locks == [] and ex.fold_level == 0
    assert ex.phase is Phase.PREPARED and moves[-1] == (Phase.PARSED, Phase.PREPARED)
    assert ex.outbound_holder is raw and ex.outbound_size == len(buffer)
    ex.mark_sent()
    assert asyncio.run(refold(ex)) is False  # nothing bulky to fold, but the run happened
    assert locks == [1] and ex.fold_level == 1 and ex.phase is Phase.PREPARED
