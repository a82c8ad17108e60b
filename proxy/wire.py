"""Wire metadata of one request, computed from the raw bytes before any plugin runs.

Pure: no I/O, no aiohttp. (Skeleton: the helper fills in compute_wire_metadata.)
"""

from __future__ import annotations

import dataclasses

__all__ = ["WireMetadata"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WireMetadata:
    """Scalars describing the request exactly as it arrived (DESIGN section 4).

    ``digest`` is the hex xxh3_128 of the wire bytes after content decoding;
    ``byte_length`` is their length in bytes; ``comparable`` is the verdict;
    ``session_hint`` is the session id found in the body (Responses
    ``prompt_cache_key``, Anthropic ``metadata.user_id``), if any.
    """

    protocol: str
    model: str | None
    stream: bool
    message_count: int
    byte_length: int
    digest: str
    comparable: bool
    session_hint: str | None
