"""Incremental byte-level Server-Sent Events framer (pure, sans-I/O).

The proxy relays upstream bytes to the client untouched; this framer only lets
it *look* at the stream: which SSE events went by (usage, terminal events,
overflow errors, whether output started) and where event boundaries are, so the
relay can hold back or cut a stream exactly between two events.

Parsing follows the WHATWG "event stream interpretation" rules
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):

* lines end with CRLF, LF or a lone CR, in any mix, split anywhere across chunks;
* one UTF-8 BOM at the very start of the stream is ignored;
* a line starting with ``:`` is a comment; a line without ``:`` is a field name
  with an empty value; one space after the colon is dropped;
* ``data`` values are joined with ``"\\n"``; ``event`` sets the type; ``id``,
  ``retry`` and unknown fields are ignored here (the proxy has no use for them);
* a blank line dispatches the block, but only if a ``data`` field was seen
  (a block of comments, or of ``event:`` alone, dispatches nothing);
* at end of stream an unterminated block is discarded.

Cost: every byte is scanned at most twice (once for line ends, once for the
colon of a field name), never again on later feeds, and the framer keeps at
most ``max_data`` bytes of a ``data`` field however long the line is, plus a
few hundred bytes of bookkeeping.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["SSEEvent", "SSEFramer"]

_CR: Final = 0x0D
_LF: Final = 0x0A
_COLON: Final = 0x3A
_SPACE: Final = 0x20
_BOM: Final = b"\xef\xbb\xbf"
_BOM_FIRST: Final = _BOM[0]
_DATA_FIELD: Final = b"data:"
_DATA_SPACE: Final = b"data: "
_EVENT_FIELD: Final = b"event:"
# Their lengths, for the per-event loop (a len() call there costs as much as a slice).
_DATA_LEN: Final = len(_DATA_FIELD)
_EVENT_LEN: Final = len(_EVENT_FIELD)

# Field names the framer acts on are at most 5 bytes ("event"); keeping 8 is
# enough to tell any longer name apart from them.
_MAX_NAME: Final = 8
# Event type names are short identifiers ("response.output_text.delta"); a
# longer value is kept truncated rather than letting one line grow memory.
_MAX_EVENT_NAME: Final = 1024

# Line states.
_START: Final = 0  # nothing of the current line seen yet
_NAME: Final = 1  # inside the field name (no colon yet)
_VALUE_START: Final = 2  # just after the colon: a single space may follow
_VALUE: Final = 3  # inside the field value
_COMMENT: Final = 4  # line began with ":"

# What the current field's value feeds.
_IGNORE: Final = 0
_DATA: Final = 1
_EVENT: Final = 2


class SSEEvent(msgspec.Struct, gc=False):
    """One dispatched SSE event (a struct: made in C, several per answer, and not
    tracked by the garbage collector, as it holds no container).

    Attributes:
        event: the last ``event:`` field value of the block (decoded as UTF-8
            with replacement), or ``None`` when absent or empty (the spec's
            default type ``message``).
        data: the ``data`` field values joined with ``b"\\n"``; ``b""`` when
            ``truncated``.
        data_size: total size in bytes of the joined data, counted even when
            it was not retained (``data_size == len(data)`` unless truncated).
        truncated: the joined data exceeded the framer's ``max_data`` bytes
            and was dropped as it streamed by.
        start: stream offset in bytes (counting from the first byte fed, BOM
            included) where the event's block begins.
        end: stream offset just past the blank line that ended the block, so
            ``raw[start:end]`` are exactly the upstream bytes of this event.
    """

    event: str | None
    data: bytes
    data_size: int
    truncated: bool
    start: int
    end: int


class SSEFramer:
    """Frames a byte stream into :class:`SSEEvent` objects, one chunk at a time.

    Feed chunks as they arrive; each :meth:`feed` returns the events completed
    by that chunk. Boundaries are chunk-independent: splitting the same stream
    differently yields the same events with the same offsets, and after the
    same number of bytes the same :attr:`pending_bytes`.

    One detail needs lookahead: a blank line ended by CR may be the first half
    of a CRLF. When a chunk ends exactly on such a CR, the event it completes
    is returned by the next :meth:`feed` (or :meth:`close`), once the next byte
    tells whether the LF belongs to it.

    Args:
        max_data: bytes of joined ``data`` retained per event; a larger event
            is reported with ``truncated=True`` and ``data=b""``. Must be >= 0.

    Raises:
        ValueError: if ``max_data`` is negative.
    """

    __slots__ = (
        "_bom_check",
        "_closed",
        "_cr_held",
        "_data",
        "_data_size",
        "_event",
        "_field",
        "_has_data",
        "_head",
        "_max_data",
        "_name",
        "_name_overflow",
        "_offset",
        "_region_start",
        "_scanned",
        "_skip_lf",
        "_state",
        "_truncated",
        "_value",
    )

    def __init__(self, *, max_data: int = 1 << 20) -> None:
        if max_data < 0:
            raise ValueError(f"max_data must be >= 0, got {max_data}")
        self._max_data = max_data
        self._closed = False
        # Stream position.
        self._offset = 0  # bytes fed and processed so far
        self._region_start = 0  # offset where the current (not yet ended) block began
        self._scanned = 0
        # BOM detection: up to 2 bytes held while they could still be a BOM.
        self._bom_check = True
        self._head = b""
        # Line-ending state.
        self._skip_lf = False  # previous chunk ended on a CR ending a non-blank line
        self._cr_held = False  # previous chunk ended on a CR ending a blank line
        # Current line. An empty buffer is the shared b"", so a framer waiting between
        # events (an idle stream's) holds no buffer object of its own.
        self._state = _START
        self._name = b""
        self._name_overflow = False
        self._field = _IGNORE
        self._value = b""
        # Current block: _data is a bytearray only while the block has data bytes.
        self._event: bytes | None = None
        self._has_data = False
        self._data: bytes | bytearray = b""
        self._data_size = 0
        self._truncated = False

    # -- public state -------------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        """Bytes fed so far that belong to a block not yet ended by a blank line.

        The relay may forward ``fed - pending_bytes`` bytes and stay on an event
        boundary. Comment-only blocks and stray blank lines end a region too.
        After :meth:`close`, it is the number of trailing bytes discarded.
        """
        return self._offset - self._region_start + len(self._head)

    @property
    def mid_event(self) -> bool:
        """``True`` while :attr:`pending_bytes` > 0 (the stream is inside a block)."""
        return self.pending_bytes > 0

    @property
    def fed_bytes(self) -> int:
        """Total bytes passed to :meth:`feed` so far."""
        return self._offset + len(self._head)

    @property
    def scanned_bytes(self) -> int:
        """Bytes examined by searches so far (diagnostic; at most 2x :attr:`fed_bytes`)."""
        return self._scanned

    @property
    def retained_bytes(self) -> int:
        """Bytes the framer currently holds (diagnostic; <= ``max_data`` + ~1 KiB)."""
        return len(self._data) + len(self._value) + len(self._name) + len(self._head)

    # -- feeding ------------------------------------------------------------

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[SSEEvent]:
        """Process the next chunk of the stream.

        Args:
            chunk: the next bytes as received (any size, may be empty). The
                framer copies what it keeps; the caller may reuse the buffer.

        Returns:
            The events completed by this chunk, in stream order.

        Raises:
            RuntimeError: if called after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("SSEFramer.feed() after close()")
        buf = chunk if isinstance(chunk, bytes) else bytes(chunk)
        events: list[SSEEvent] = []
        if not buf:
            return events
        if self._bom_check:
            held = self._head
            if not held and buf[0] != _BOM_FIRST:
                self._bom_check = False  # the usual first chunk: no BOM can start it
            else:
                head = held + buf[: 3 - len(held)]
                if len(head) < 3 and _BOM.startswith(head):
                    self._head = head  # still ambiguous: wait for more bytes
                    return events
                self._bom_check = False
                self._head = b""
                if head == _BOM:
                    self._offset += 3  # the BOM is part of the first block's bytes
                    buf = buf[3 - len(held) :]
                elif held:
                    buf = held + buf  # (no copy of the first chunk when nothing was held)
        self._scan(buf, events)
        return events

    def close(self) -> list[SSEEvent]:
        """Signal end of stream.

        Returns:
            The event of a blank line that ended on the very last byte with a
            CR (see the class docstring), if any; otherwise ``[]``. Per the
            spec an unterminated block is discarded, never dispatched.

        Idempotent. Releases the retained buffers.
        """
        events: list[SSEEvent] = []
        if self._closed:
            return events
        self._closed = True
        if self._cr_held:
            self._cr_held = False
            self._blank_line(self._offset, events)
        self._offset += len(self._head)
        self._head = b""
        self._data = self._value = self._name = b""
        return events

    # -- internals ----------------------------------------------------------

    def _scan(self, buf: bytes, events: list[SSEEvent]) -> None:
        base = self._offset
        n = len(buf)
        if n == 0:
            return
        pos = 0
        if self._cr_held or self._skip_lf:
            # Resolve the CR that ended the previous chunk: an LF here is its pair.
            pair = buf[0] == _LF
            if pair:
                pos = 1
            if self._cr_held:
                self._cr_held = False
                self._blank_line(base + pos, events)
            self._skip_lf = False
        # Next CR and LF at or after pos (-1: none left). bytes.find is a memchr, far
        # cheaper per byte than a regex character class; a CR-free stream costs one
        # CR search per chunk. (Without a position when there is none: parsing the
        # position arguments costs more than the search of a small chunk.)
        next_cr = buf.find(b"\r", pos) if pos else buf.find(b"\r")
        if next_cr < 0 and self._state == _START and not self._has_data and self._event is None:
            pos = self._split_events(buf, pos, base, events)
            if pos == n:
                self._offset = base + n
                return
            whole = self._whole_events
        else:
            whole = self._split_events  # the chunk's first run of whole events
        next_lf = buf.find(b"\n", pos)
        while pos < n:
            if 0 <= next_cr < pos:
                next_cr = buf.find(b"\r", pos)
            if 0 <= next_lf < pos:
                next_lf = buf.find(b"\n", pos)
            if next_cr < 0 and next_lf < 0:
                self._scanned += n - pos
                self._segment(buf, pos, n)
                break
            eol = next_lf if next_cr < 0 else next_cr if next_lf < 0 else min(next_cr, next_lf)
            self._scanned += eol + 1 - pos
            if self._state == _START and buf.startswith(_DATA_FIELD, pos, eol):
                # A whole ``data:`` line (nearly every line of a stream): what
                # _segment + _end_line would do, minus their per-line dispatch.
                # At _START the field, name and overflow state are already reset.
                self._scanned += len(_DATA_FIELD)
                a = pos + len(_DATA_FIELD)
                if a < eol and buf[a] == _SPACE:
                    a += 1
                if (
                    not self._has_data
                    and eol + 1 < n
                    and buf[eol] == _LF
                    and buf[eol + 1] == _LF
                    and eol - a <= self._max_data
                ):
                    # The block's only data line, and the blank line that ends it, are
                    # both in this chunk (the usual event): its data is this one slice,
                    # with no trip through the block's data buffer.
                    self._scanned += 1
                    pos = eol + 2
                    self._dispatch_line(buf[a:eol], base + pos, events)
                    if next_cr < 0:
                        pos = whole(buf, pos, base, events)
                        whole = self._whole_events
                    continue
                if self._has_data:
                    self._add_separator()
                self._has_data = True
                if a < eol:
                    self._add_data(buf, a, eol)
                blank = False
            elif self._state == _START and buf.startswith(_EVENT_FIELD, pos, eol):
                # A whole ``event:`` line (every event of Responses and Anthropic): what
                # _segment + _begin_field + _end_line would keep, the value truncated.
                self._scanned += len(_EVENT_FIELD)
                a = pos + len(_EVENT_FIELD)
                if a < eol and buf[a] == _SPACE:
                    a += 1
                self._event = buf[a : eol if eol - a <= _MAX_EVENT_NAME else a + _MAX_EVENT_NAME]
                blank = False
            else:
                if eol > pos:
                    self._segment(buf, pos, eol)
                blank = self._end_line()
            pos = eol + 1
            if buf[eol] == _CR:
                if pos == n:
                    # Next byte unknown: it may be this CR's LF.
                    if blank:
                        self._cr_held = True
                    else:
                        self._skip_lf = True
                    break
                if buf[pos] == _LF:
                    pos += 1
            if blank:
                self._blank_line(base + pos, events)
                if next_cr < 0:
                    pos = whole(buf, pos, base, events)
                    whole = self._whole_events
        self._offset = base + n

    def _split_events(self, buf: bytes, pos: int, base: int, events: list[SSEEvent]) -> int:
        """:meth:`_whole_events` for the first run of a chunk, one split instead of a walk.

        Same preconditions and result. ``buf`` is cut at every blank line once (C
        speed), so each common event costs a few tests of its piece rather than
        three searches at positions: the per-event walk was the framer's main cost.
        Once per :meth:`_scan` only (the pieces after the first odd block are cut for
        nothing): the line loop's later runs go on with :meth:`_whole_events`.
        """
        pieces = (buf[pos:] if pos else buf).split(b"\n\n")
        # The last piece has no blank line after it: never a whole event here.
        pieces.pop()
        start = self._region_start
        end = base + pos
        max_data = self._max_data
        for piece in pieces:
            if piece.startswith(_DATA_SPACE):  # the usual line first: one test
                data = piece[6:]
                kind = None
            elif piece.startswith(_DATA_FIELD):
                data = piece[5:]
                kind = None
            elif piece.startswith(_EVENT_FIELD):
                line, _, data = piece.partition(b"\n")
                if not data.startswith(_DATA_FIELD):
                    break  # no data line after the name
                data = data[6:] if data[5:6] == b" " else data[5:]
                name = line[7:] if line[6:7] == b" " else line[6:]
                if len(name) > _MAX_EVENT_NAME:
                    name = name[:_MAX_EVENT_NAME]
                kind = name.decode("utf-8", "replace") if name else None
            else:
                break
            if b"\n" in data:
                break  # a second data line (or another field) in the block
            size = len(data)
            if size > max_data:
                break  # to be truncated: the line loop drops it as it goes
            end += len(piece) + 2
            # Positional (event, data, data_size, truncated, start, end), as below.
            events.append(SSEEvent(kind, data, size, False, start, end))
            start = end
        self._region_start = start
        done = end - base
        self._scanned += done - pos
        return done

    def _whole_events(self, buf: bytes, pos: int, base: int, events: list[SSEEvent]) -> int:
        """Dispatch the whole common events from ``pos``; return where the line loop goes on.

        ``pos`` is in a block with nothing of it kept yet (no data, no event name,
        at a line start) and ``buf`` has no CR from there (the caller checks). The
        common event is an optional ``event:`` line, one ``data:`` line and the
        blank line, LF-ended, with at most ``max_data`` bytes of data: what the
        line loop would make of it is dispatched here, without its per-line state
        machine (the events after an odd block of a chunk take this path; the
        chunk's first run takes :meth:`_split_events`). It stops
        before the first block of any other shape, or one not complete in
        ``buf``, having kept nothing of it: the line loop reads that block.
        """
        n = len(buf)
        first = pos
        start = self._region_start
        max_data = self._max_data
        while True:
            name = b""
            line = pos
            if buf.startswith(_EVENT_FIELD, pos):
                eol = buf.find(b"\n", pos)
                if eol < 0:
                    break
                a = pos + _EVENT_LEN
                if a < eol and buf[a] == _SPACE:
                    a += 1
                # Not min(): the builtin's call costs more than the slice.
                name = buf[a : eol if eol - a <= _MAX_EVENT_NAME else a + _MAX_EVENT_NAME]
                line = eol + 1
            if not buf.startswith(_DATA_FIELD, line):
                break
            a = line + _DATA_LEN
            eol = buf.find(b"\n", a)
            if eol < 0 or eol + 1 == n or buf[eol + 1] != _LF:
                break  # incomplete here, or a second line in the block
            if a < eol and buf[a] == _SPACE:
                a += 1
            if eol - a > max_data:
                break  # to be truncated: the line loop drops it as it goes
            pos = eol + 2
            end = base + pos
            # Positional (event, data, data_size, truncated, start, end): keywords cost
            # a third of the event here.
            kind = name.decode("utf-8", "replace") if name else None
            events.append(SSEEvent(kind, buf[a:eol], eol - a, False, start, end))
            start = end
        self._region_start = start
        self._scanned += pos - first
        return pos

    def _segment(self, buf: bytes, a: int, b: int) -> None:
        """Consume ``buf[a:b]``, a piece of one line without its line ending."""
        state = self._state
        if state == _START:
            if buf[a] == _COLON:
                self._state = _COMMENT
                return
            state = self._state = _NAME
        if state == _COMMENT:
            return
        if state == _NAME:
            colon = buf.find(b":", a, b)
            name_end = b if colon < 0 else colon
            self._scanned += (name_end + 1 if colon >= 0 else b) - a
            room = _MAX_NAME - len(self._name)
            if name_end - a > room:
                self._name_overflow = True
            if room > 0:
                self._name += buf[a : min(name_end, a + room)]
            if colon < 0:
                return
            self._begin_field()
            a = colon + 1
            state = self._state = _VALUE_START
            if a == b:
                return
        if state == _VALUE_START:
            if buf[a] == _SPACE:
                a += 1
            self._state = _VALUE
            if a == b:
                return
        field = self._field
        if field == _DATA:
            self._add_data(buf, a, b)
        elif field == _EVENT:
            room = _MAX_EVENT_NAME - len(self._value)
            if room > 0:
                self._value += memoryview(buf)[a : min(b, a + room)]

    def _begin_field(self) -> None:
        """The field name is complete: decide what its value feeds."""
        name = bytes(self._name)
        if self._name_overflow:
            self._field = _IGNORE
        elif name == b"data":
            self._field = _DATA
            if self._has_data:
                self._add_separator()
            self._has_data = True
        elif name == b"event":
            self._field = _EVENT
            self._value = b""
        else:
            self._field = _IGNORE  # id, retry and unknown fields

    def _end_line(self) -> bool:
        """Finish the current line; return ``True`` if it was blank."""
        state = self._state
        if state == _START:
            return True
        if state == _NAME:
            self._begin_field()  # a line without a colon: the value is empty
        if self._field == _EVENT:
            self._event = self._value
            self._value = b""
        self._state = _START
        self._name = b""
        self._name_overflow = False
        self._field = _IGNORE
        return False

    def _add_separator(self) -> None:
        self._data_size += 1
        if not self._truncated:
            if len(self._data) + 1 > self._max_data:
                self._truncate()
            else:
                self._append_data(b"\n")

    def _add_data(self, buf: bytes, a: int, b: int) -> None:
        size = b - a
        self._data_size += size
        if self._truncated:
            return
        if len(self._data) + size > self._max_data:
            self._truncate()
        else:
            self._append_data(memoryview(buf)[a:b])

    def _append_data(self, piece: bytes | memoryview) -> None:
        if self._data:
            self._data += piece
        else:
            self._data = bytearray(piece)  # the block's first data bytes

    def _truncate(self) -> None:
        self._truncated = True
        self._data = b""  # drop the buffer itself, not just its length

    def _dispatch_line(self, data: bytes, end: int, events: list[SSEEvent]) -> None:
        """A block whose one data line was ``data``, ended by a blank line at ``end``.

        What :meth:`_blank_line` dispatches for it, without the data buffer; the
        block's data state is untouched (it was never used).
        """
        event = self._event
        events.append(
            SSEEvent(
                event=event.decode("utf-8", "replace") if event else None,
                data=data,
                data_size=len(data),
                truncated=False,
                start=self._region_start,
                end=end,
            )
        )
        self._region_start = end
        self._event = None

    def _blank_line(self, end: int, events: list[SSEEvent]) -> None:
        """A blank line ending at stream offset ``end``: dispatch, then reset the block."""
        start = self._region_start
        self._region_start = end
        if self._has_data:
            event = self._event
            events.append(
                SSEEvent(
                    event=event.decode("utf-8", "replace") if event else None,
                    data=b"" if self._truncated else bytes(self._data),
                    data_size=self._data_size,
                    truncated=self._truncated,
                    start=start,
                    end=end,
                )
            )
            self._data = b""  # no buffer (nor its capacity) kept between events
            self._data_size = 0
            self._truncated = False
            self._has_data = False
        self._event = None
