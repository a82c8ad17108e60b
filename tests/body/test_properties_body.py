"""Property-based tests of the body reader (hypothesis): random bodies, codings, chunkings, limits.

Each example builds a body, applies a random stack of content codings, feeds
the wire to the server edge's ``BodyStream`` in random pieces and reads it with
:func:`proxy._body.read_body` at a random read size and limit, with and without
a declared ``Content-Length``. What must hold for every example: a body within
the limit comes back byte for byte with its digest; one over it is a 413
carrying the limit; corrupted coded data is a :class:`BodyError` (400/413),
never another exception; and no task is left behind.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import zlib

import brotli
import pytest
import xxhash
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from proxy._body import BodyError, BodyTooLarge, read_body
from proxy._front import BodyStream

_ENCODERS = {
    "gzip": lambda d: gzip.compress(d, 1),
    "deflate": lambda d: zlib.compress(d, 1),
    "br": lambda d: brotli.compress(d, quality=1),
    "zstd": lambda d: zstandard.ZstdCompressor(level=1).compress(d),
}

_bodies = st.one_of(
    st.binary(max_size=6000),
    # Compressible, chat-like: a few words repeated.
    st.lists(
        st.sampled_from([b'{"role":"user",', b'"content":"', b"hello ", b"\\n", b"}"]),
        max_size=2000,
    ).map(b"".join),
)
_codings = st.lists(st.sampled_from(list(_ENCODERS)), max_size=2)


def _encode(body: bytes, codings: list[str]) -> bytes:
    for coding in codings:
        body = _ENCODERS[coding](body)
    return body


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _proxy_tasks() -> int:
    """Tasks running the proxy's code (an SDK client collected by the GC mid-test
    schedules its own ``aclose`` task on whatever loop runs: not ours to count)."""
    codes = (getattr(task.get_coro(), "cr_code", None) for task in asyncio.all_tasks())
    return sum(1 for code in codes if code is not None and "/proxy/" in code.co_filename)


async def _read(
    pieces: list[bytes], *, declared: int | None, encoding: str | None, limit: int, chunk: int
) -> bytes | BodyError:
    content = BodyStream(None)
    for piece in pieces:
        content.feed(piece)
    content.feed_eof()
    tasks = _proxy_tasks()
    try:
        result = await read_body(
            content,
            content_length=declared,
            content_encoding=encoding,
            limit=limit,
            idle_timeout=10.0,
            body_timeout=20.0,
            chunk_bytes=chunk,
        )
    except BodyError as exc:
        return exc
    finally:
        assert _proxy_tasks() == tasks
    assert result.digest == xxhash.xxh3_128(result.buffer).hexdigest()
    return bytes(result.buffer)


@given(
    body=_bodies,
    codings=_codings,
    cuts=st.lists(st.integers(min_value=0), max_size=8),
    slack=st.integers(min_value=-3, max_value=3),
    chunk=st.sampled_from([1, 7, 512, 4096, 65536]),
    declare=st.booleans(),
)
def test_any_chunking_coding_and_limit_reads_the_body_or_refuses_it(
    body: bytes, codings: list[str], cuts: list[int], slack: int, chunk: int, declare: bool
) -> None:
    wire = _encode(body, codings)
    limit = max(0, len(body) + slack)
    # Content-Encoding lists codings in the order they were applied.
    encoding = ", ".join(codings) or None
    got = asyncio.run(
        _read(
            _pieces(wire, cuts),
            declared=len(wire) if declare else None,
            encoding=encoding,
            limit=limit,
            chunk=chunk,
        )
    )
    if len(body) <= limit:
        assert got == body
    else:
        assert isinstance(got, BodyTooLarge)
        assert (got.status, got.limit) == (413, limit)


@given(
    body=_bodies,
    codings=st.lists(st.sampled_from(list(_ENCODERS)), min_size=1, max_size=2),
    where=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
    cut=st.booleans(),
)
def test_corrupt_or_truncated_coded_data_is_a_body_error_never_a_crash(
    body: bytes, codings: list[str], where: int, flip: int, cut: bool
) -> None:
    wire = bytearray(_encode(body, codings))
    if cut:
        del wire[where % len(wire) :]
    else:
        wire[where % len(wire)] ^= flip
    got = asyncio.run(
        _read(
            [bytes(wire)], declared=None, encoding=", ".join(codings), limit=len(body), chunk=4096
        )
    )
    if isinstance(got, BodyError):
        assert got.status in (400, 413)
    else:
        # brotli and raw deflate carry no checksum: a flipped bit may decode to
        # other bytes, but never to more than the limit.
        assert len(got) <= len(body)


@pytest.mark.parametrize("declared", [10, 5000])
def test_a_body_shorter_than_declared_is_incomplete(declared: int) -> None:
    got = asyncio.run(_read([b"x" * 9], declared=declared, encoding=None, limit=10_000, chunk=7))
    assert isinstance(got, BodyError) and (got.status, got.kind) == (400, "incomplete")
