"""A small, complete answer as a value: status, fields, body bytes.

Pure: no I/O. The server edge (:meth:`proxy._front.ClientConnection._write_response`)
writes it, adding the framing (``Content-Length``, ``Connection: close``) and
``Date``; everything that answers with a body it has in full (errors in the
client's protocol shape, the admin routes, the live page's files) builds one.
An answer whose body is not known in full is a :class:`proxy._front.StreamAnswer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from multidict import CIMultiDict

__all__ = ["JSON_TYPE", "TEXT_TYPE", "SmallAnswer"]

JSON_TYPE: Final = "application/json; charset=utf-8"
"""The ``Content-Type`` of :meth:`SmallAnswer.json` (RFC 8259 §8.1: JSON is UTF-8)."""
TEXT_TYPE: Final = "text/plain; charset=utf-8"
"""The ``Content-Type`` of :meth:`SmallAnswer.text`."""


class SmallAnswer:
    """An answer whose body is known in full before its head is written.

    Args:
        status: the HTTP status (RFC 9110 §15).
        body: the body, bytes (none for 1xx, 204 and 304, and to ``HEAD``:
            the writer leaves it out, RFC 9110 §9.3.2, §15).
        headers: fields to send, in order; never the framing fields
            (``Content-Length``, ``Transfer-Encoding``, ``Connection``), which
            the writer decides.
        content_type: a ``Content-Type`` added after ``headers``.
        reason: the status line's reason phrase; None: the standard one (or
            none for a status without one, e.g. 499).
        close: the connection closes after this answer (``Connection: close``,
            RFC 9112 §9.6), e.g. when the request's body was not read.

    Raises:
        ValueError: ``content_type`` is given and ``headers`` has one too.

    Attributes are plain and may be set after construction (``close`` by a
    caller that learns the connection must end); :attr:`headers` is a
    case-insensitive :class:`multidict.CIMultiDict`.
    """

    __slots__ = ("body", "close", "headers", "reason", "status")

    def __init__(
        self,
        status: int = 200,
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
        reason: str | None = None,
        close: bool = False,
    ) -> None:
        fields: CIMultiDict[str] = CIMultiDict(headers) if headers else CIMultiDict()
        if content_type is not None:
            if "Content-Type" in fields:
                raise ValueError("content_type given twice: as an argument and in headers")
            fields["Content-Type"] = content_type
        self.status = status
        self.body = body
        self.headers = fields
        self.reason = reason
        self.close = close

    @classmethod
    def json(
        cls,
        data: Any,
        *,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        close: bool = False,
    ) -> SmallAnswer:
        """``data`` as a JSON body (``json.dumps``, UTF-8), ``Content-Type: application/json``.

        Raises:
            TypeError: ``data`` holds a value JSON cannot encode.
            ValueError: ``data`` holds a cycle, or ``headers`` a ``Content-Type``.
        """
        return cls(
            status,
            body=json.dumps(data).encode(),
            headers=headers,
            content_type=JSON_TYPE,
            close=close,
        )

    @classmethod
    def text(cls, text: str, *, status: int = 200) -> SmallAnswer:
        """``text`` as a UTF-8 ``text/plain`` body."""
        return cls(status, body=text.encode(), content_type=TEXT_TYPE)

    def __repr__(self) -> str:
        # Never the fields' values or the body: they may quote a request.
        return f"<SmallAnswer {self.status} {len(self.body)} B close={self.close}>"
