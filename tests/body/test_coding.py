"""The pure content-coding module: decoders, their output bound, the body sink. No sockets.

:mod:`proxy._coding` is fed bytes and hands out bytes; these tests drive it
directly, the way :mod:`proxy._body` does, and check what a caller relies on:
every split of the wire decodes to the same body, no decoder call produces
more than about one piece, a bomb stops at the limit, truncation and corruption
are 400s, and the sink keeps nothing once it handed its buffer over.
"""

from __future__ import annotations

import gzip
import random
import struct
import weakref
import zlib

import pytest
import xxhash
import zstandard

from proxy._coding import (
    ZSTD_BLOCK_MAX_BYTES,
    BodyEncodingError,
    BodySink,
    BodyTooLarge,
    ContentDecoder,
    encoded_size_cap,
    parse_content_encoding,
)
from tests.body.test_body import BOMBS, CODED, KiB, MiB, chat_json

PIECE = ZSTD_BLOCK_MAX_BYTES


class Collector:
    """A sink that records the size of every piece and keeps the bytes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.pieces: list[int] = []

    def __call__(self, piece: bytes) -> None:
        self.pieces.append(len(piece))
        self.data += piece


def splits(wire: bytes, seed: int) -> list[bytes]:
    """``wire`` cut at random places, 1 byte to 64 KiB apart."""
    rng = random.Random(seed)
    out: list[bytes] = []
    pos = 0
    while pos < len(wire):
        step = rng.choice((1, 2, 3, 17, 4093, 65536))
        out.append(wire[pos : pos + step])
        pos += step
    return out


@pytest.mark.parametrize("case", list(CODED))
def test_every_split_decodes_to_the_body_in_bounded_pieces(case: str) -> None:
    body = chat_json(96 * KiB)
    encoding, encode = CODED[case]
    wire = encode(body)
    for seed in range(3):
        got = Collector()
        decoder = ContentDecoder(
            parse_content_encoding(encoding), got, piece=PIECE, limit=len(body)
        )
        for part in splits(wire, seed):
            decoder.feed(part)
        decoder.finish()
        assert bytes(got.data) == body
        # One call never hands out more than a piece plus one zstd block.
        assert max(got.pieces) <= PIECE + ZSTD_BLOCK_MAX_BYTES


@pytest.mark.parametrize("encoding", list(BOMBS))
def test_a_bomb_stops_at_the_limit_having_produced_at_most_the_limit(encoding: str) -> None:
    limit = 4 * MiB
    got = Collector()
    sink = BodySink(limit, None)

    def write(piece: bytes) -> None:
        got(piece)
        sink.write(piece)

    decoder = ContentDecoder(parse_content_encoding(encoding), write, piece=PIECE, limit=limit)
    with pytest.raises(BodyTooLarge) as info:
        for part in splits(BOMBS[encoding](), 0):
            decoder.feed(part)
        decoder.finish()
    assert info.value.limit == limit
    # Decoding stopped within one piece past the limit, not at the bomb's GiB.
    assert len(got.data) <= limit + PIECE + ZSTD_BLOCK_MAX_BYTES
    assert max(got.pieces) <= PIECE + ZSTD_BLOCK_MAX_BYTES


@pytest.mark.parametrize("case", ["gzip", "deflate-zlib", "br", "zstd", "gzip-then-br"])
def test_a_truncated_coding_is_a_400_at_finish(case: str) -> None:
    body = chat_json(48 * KiB)
    encoding, encode = CODED[case]
    wire = encode(body)
    decoder = ContentDecoder(
        parse_content_encoding(encoding), Collector(), piece=PIECE, limit=len(body)
    )
    decoder.feed(wire[: len(wire) - 9])
    with pytest.raises(BodyEncodingError) as info:
        decoder.finish()
    assert (info.value.status, info.value.kind) == (400, "bad_encoding")
    assert "ends before the end of its" in info.value.message


def test_a_zstd_stream_may_end_only_between_frames() -> None:
    frame = zstandard.ZstdCompressor().compress(b"x" * 1000)
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"pad!"
    for wire, complete in [
        (frame + skippable + frame, True),
        (frame + skippable[:6], False),
        (frame + frame[:5], False),
        (skippable, True),
    ]:
        got = Collector()
        decoder = ContentDecoder(("zstd",), got, piece=PIECE, limit=10_000)
        for byte in range(len(wire)):
            decoder.feed(wire[byte : byte + 1])
        if complete:
            decoder.finish()
        else:
            with pytest.raises(BodyEncodingError):
                decoder.finish()


def test_corrupt_data_is_a_400_naming_the_coding() -> None:
    wire = bytearray(gzip.compress(chat_json(48 * KiB)))
    wire[len(wire) // 2] ^= 0xFF
    decoder = ContentDecoder(("gzip",), Collector(), piece=PIECE, limit=MiB)
    with pytest.raises(BodyEncodingError) as info:
        decoder.feed(bytes(wire))
        decoder.finish()
    assert info.value.message == "request body is not valid gzip data"
    with pytest.raises(BodyEncodingError):
        ContentDecoder(("zstd",), Collector(), piece=PIECE, limit=MiB).feed(b"not zstd")


def test_inner_layers_are_capped_too() -> None:
    # An outer gzip whose payload (the inner zstd stream) is pure padding: the
    # inner layer may not grow past the encoded size cap of the limit.
    limit = 64 * KiB
    padding = struct.pack("<II", 0x184D2A50, 4 * limit) + bytes(4 * limit)
    decoder = ContentDecoder(("zstd", "gzip"), Collector(), piece=PIECE, limit=limit)
    with pytest.raises(BodyTooLarge):
        decoder.feed(gzip.compress(padding))
    assert len(padding) > encoded_size_cap(limit)


def test_release_drops_the_codec_state() -> None:
    decoder = ContentDecoder(("gzip", "br"), Collector(), piece=PIECE, limit=MiB)
    stages = list(decoder._stages)
    refs = [weakref.ref(stage) for stage in stages]
    del stages
    decoder.release()
    assert [ref() for ref in refs] == [None, None]


def test_the_sink_is_inclusive_hashes_and_keeps_nothing_after_take() -> None:
    body = chat_json(48 * KiB)
    sink = BodySink(len(body), len(body))
    sink.write(body[:1000])
    sink.write(body[1000:])
    with pytest.raises(BodyTooLarge):
        sink.write(b"x")
    buffer, digest = sink.take()
    assert (bytes(buffer), digest) == (body, xxhash.xxh3_128(body).hexdigest())
    again, _ = sink.take()
    assert len(again) == 0


def test_release_frees_the_sink_storage_even_while_it_is_referenced() -> None:
    sink = BodySink(MiB, MiB)
    sink.write(zlib.compress(b"a") * 1000)
    held = sink._buf
    sink.release()
    assert len(held) == 0


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_a_declared_size_is_reserved_not_resident() -> None:
    declared = 64 * MiB
    sink = BodySink(declared, declared)
    before = _rss()
    sink.write(b"x")  # the first byte reserves the declared size
    assert _rss() - before < 4 * MiB, "the declared size became resident at once"
    piece = bytes(range(256)) * (MiB // 256)
    for _ in range(8):
        sink.write(piece)
    grown = _rss() - before
    # Resident memory follows the bytes written (8 MiB), not the 64 MiB declared.
    assert 7 * MiB < grown < 12 * MiB, f"{grown / MiB:.1f} MiB resident for 8 MiB written"
    rest = declared - sink.size
    sink.write(b"y" * rest)
    buffer, digest = sink.take()
    assert len(buffer) == declared and buffer[0:1] == b"x" and buffer[-1:] == b"y"
    assert digest == xxhash.xxh3_128(b"x" + piece * 8 + b"y" * rest).hexdigest()


def test_a_reservation_not_filled_is_never_handed_out_beyond_what_was_written() -> None:
    sink = BodySink(MiB, MiB)
    sink.write(b"abc")
    buffer, _ = sink.take()
    assert bytes(buffer) == b"abc"
