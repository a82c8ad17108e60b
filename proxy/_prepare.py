"""Running the ``prepare`` hooks on an exchange's body (docs/design.md §1 step 4, §5).

The exchange (:mod:`proxy._exchange`) owns the buffers and drops them; this
module owns the run: which plugins want which view of the body, the session
lock around them, the :class:`~proxy._plugins.PrepareContext` they see, and
what becomes of their edits. Every buffer the run makes or replaces is handed
to the exchange (:meth:`~proxy._exchange.Exchange.open_draft`,
:meth:`~proxy._exchange.Exchange.adopt_splice`,
:meth:`~proxy._exchange.Exchange.adopt_object`), which keeps the release
contract in one file. The exchange does not import this module: it keeps a
:class:`Preparer` as its opaque :class:`~proxy._exchange.Preparing` closure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Final

from ._exchange import Exchange
from ._plugins import PluginHost, PrepareContext
from ._structure import Splice

__all__ = ["Overflow", "Preparer", "null_lock", "prepare", "refold"]

#: ``(refused body bytes, prompt tokens, window tokens)`` a refold's hooks see
#: (``None`` for a figure the upstream's error did not state).
Overflow = tuple[int, int | None, int | None]

# What wire.encode_body raises for an object JSON cannot carry (UnicodeEncodeError is a ValueError).
_UNENCODABLE: Final = (TypeError, ValueError, RecursionError, OverflowError)


class Preparer:
    """The prepare closure: what an exchange needs to run ``prepare`` hooks again.

    ``lock`` returns the session's lock context (or a null context when the
    request has no session); prepare hooks run inside it (docs/design.md §6,
    rule 2). The exchange drops it at release, so nothing it reaches outlives
    the boundary.
    """

    __slots__ = ("host", "lock", "session_id")

    def __init__(
        self,
        host: PluginHost,
        lock: Callable[[], AbstractAsyncContextManager[object]],
        session_id: str | None,
    ) -> None:
        self.host = host
        self.lock = lock
        self.session_id = session_id

    async def run(self, ex: Exchange, level: int, overflow: Overflow | None) -> bool:
        """One prepare run at fold level ``level``; whether the outbound body changed.

        ``overflow`` is ``(refused body bytes, prompt tokens, window tokens)`` on a
        refold, ``None`` at level 0. A whole-object edit that JSON cannot carry is
        logged by the host and dropped: the body goes on as before the run.

        Raises:
            RuntimeError: the exchange has no body or was released.
            proxy._wire.WireError: a plugin wanted the body and it is not a JSON object.
        """
        meta = ex.begin_prepare(level)
        host = self.host
        wants = host.wants_body(meta, level)
        # Counted in C, not all() over a generator (every request): the entries are
        # None or a bool, and None equals only None.
        if wants.count(None) == len(wants):
            # Every plugin declined this run (or none prepares): nothing can change the
            # body, so no lock, no draft and no hook call; the body goes on as it is.
            ex.end_prepare()
            return False
        async with self.lock():
            draft = ex.open_draft()
            ctx = PrepareContext(
                meta=meta,
                fold_level=level,
                session_id=self.session_id,
                path=ex.path,
                draft=draft,
                overflow=overflow,
            )
            try:
                reported = await host.run_prepare(ctx, wants)
                result = draft.result(reported)
            finally:
                ctx._close()
                del draft
                ex.close_draft()
        if isinstance(result, Splice):
            ex.adopt_splice(result)
        elif result is not None:
            try:
                ex.adopt_object(result)
            except _UNENCODABLE as exc:
                # A plugin put something JSON cannot carry into ctx.body (a lone
                # surrogate, a set, a cycle). The object was changed in place, so
                # there is no "before that plugin" to return to: the edits of
                # this run are dropped and the body goes on as it was before it.
                host.whole_body_edit_failed(wants, exc)
                ex.discard_object(result)
                result = None
        ex.end_prepare()
        return result is not None


async def prepare(ex: Exchange) -> None:
    """Run the prepare hooks at fold level 0 with the exchange's bound :class:`Preparer`.

    Raises:
        RuntimeError: no preparer was bound, or the body was released.
        proxy._wire.WireError: a plugin wanted the body and it is not a JSON object.
    """
    await _preparer(ex).run(ex, 0, None)


async def refold(
    ex: Exchange, *, prompt_tokens: int | None = None, window_tokens: int | None = None
) -> bool:
    """Re-run prepare at the next fold level after a context overflow.

    ``prompt_tokens`` and ``window_tokens`` are what the upstream's error
    stated (``None`` where it states nothing); the hooks see them, and the
    size of the body just rejected (bytes), on their :class:`PrepareContext`.

    Returns ``True`` when the outbound body changed and is smaller than
    before, i.e. a resend may succeed; ``False`` when nothing shrank (the
    caller then relays the upstream's error unchanged). ``ex.refolds`` counts
    only the refolds that shrank the body, so upstream requests = 1 +
    ``refolds`` + ``retries``; ``fold_level`` counts every prepare run.

    Raises:
        RuntimeError: no preparer is bound any more (released), or no body.
    """
    before = ex.outbound_size
    changed = await _preparer(ex).run(ex, ex.fold_level + 1, (before, prompt_tokens, window_tokens))
    shrank = changed and ex.outbound_size < before
    if shrank:
        ex.count_refold()
    return shrank


def _preparer(ex: Exchange) -> Preparer:
    """The :class:`Preparer` bound to ``ex`` (the exchange keeps it as an opaque closure).

    Raises:
        RuntimeError: none is bound (never bound, or dropped at release).
    """
    preparer = ex.preparer
    if not isinstance(preparer, Preparer):
        raise RuntimeError(f"{ex.id}: prepare after release or before the body was read")
    return preparer


_NULL_LOCK: Final = contextlib.nullcontext()  # stateless: one serves every exchange


def null_lock() -> AbstractAsyncContextManager[object]:
    """The lock context for a request without a session."""
    return _NULL_LOCK
