"""The emulator's prompt cache: cached input tokens as the longest common prefix in blocks.

Real upstreams bill a request's input in two parts: the prefix they still hold from an
earlier request (cache-read tokens, about a tenth of the price) and the rest. The
emulator models that so the proxy's folds can be measured against it: a request's body
(after content decoding) is cut into blocks of :data:`BLOCK_BYTES` (1,024 tokens at the
emulator's 4 bytes per token, OpenAI's caching granularity); each block gets a *chained*
digest, the xxh3_128 of the previous block's digest followed by the block, so digest
*k* names the whole prefix up to block *k*. The cached part of a request is the longest
run of leading digests that an earlier accepted request of the same route and model
stored within the last :data:`DEFAULT_TTL_S` seconds (Anthropic's default cache lifetime;
OpenAI keeps prefixes 5-10 minutes). Storing refreshes a prefix's lifetime, as a cache
hit does upstream.

No body bytes are kept: :class:`PrefixChain` holds at most one partial block while it is
fed, and the cache holds 16-byte digests only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

import xxhash
from cachetools import TTLCache

__all__ = ["BLOCK_BYTES", "BLOCK_TOKENS", "DEFAULT_TTL_S", "PrefixChain", "PromptCache"]

#: Tokens in one cache block (OpenAI caches prompts of 1,024 tokens and more).
BLOCK_TOKENS: Final = 1024
#: Bytes in one cache block: the emulator counts 4 body bytes per token.
BLOCK_BYTES: Final = 4 * BLOCK_TOKENS
#: Seconds a stored prefix stays cached after its last use (Anthropic's 5-minute default).
DEFAULT_TTL_S: Final = 300.0
#: Block digests kept at most (about 100 bytes each): 4 GiB of distinct prefixes.
DEFAULT_MAX_BLOCKS: Final = 1_000_000

_Scope = tuple[str, str]
"""(route, model): prefixes are cached per API and per model, as upstreams do."""


class PrefixChain:
    """Chained digests of a body's whole :data:`BLOCK_BYTES` blocks, fed as it arrives.

    ``feed(chunk)`` accepts pieces of any size; :attr:`digests` lists one 16-byte digest
    per complete block so far (a trailing partial block has none, as upstreams cache
    whole blocks only). Holds at most one partial block (< 4 KiB) of the body.
    """

    __slots__ = ("_digests", "_partial")

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._partial = bytearray()

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Add the next ``chunk`` of the body (bytes-like, any length)."""
        view = memoryview(chunk)
        while len(view):
            room = BLOCK_BYTES - len(self._partial)
            self._partial += view[:room]
            view = view[room:]
            if len(self._partial) == BLOCK_BYTES:
                previous = self._digests[-1] if self._digests else b""
                self._digests.append(xxhash.xxh3_128_digest(previous + self._partial))
                self._partial.clear()

    @property
    def digests(self) -> Sequence[bytes]:
        """One chained digest per complete block, first block first."""
        return self._digests


class PromptCache:
    """Prefix digests of accepted requests, each kept ``ttl_s`` seconds after its last use.

    ``timer`` is the clock in seconds (``time.monotonic`` by default; tests pass their
    own). ``max_blocks`` bounds the digests kept; the least recently stored go first.
    """

    __slots__ = ("_entries",)

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: TTLCache[tuple[_Scope, bytes], None] = TTLCache(
            maxsize=max_blocks, ttl=ttl_s, timer=timer
        )

    def cached_blocks(self, scope: _Scope, chain: PrefixChain) -> int:
        """Leading blocks of ``chain`` an earlier request in ``scope`` stored (0 to all)."""
        hit = 0
        for digest in chain.digests:
            if (scope, digest) not in self._entries:
                break
            hit += 1
        return hit

    def store(self, scope: _Scope, chain: PrefixChain) -> None:
        """Remember every block of ``chain`` in ``scope``; a stored block's lifetime restarts."""
        for digest in chain.digests:
            self._entries[(scope, digest)] = None

    def clear(self) -> None:
        """Forget every stored prefix (the emulator's reset)."""
        self._entries.clear()
