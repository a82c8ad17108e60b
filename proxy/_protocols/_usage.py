"""Token usage of one exchange, read from the upstream's own usage reports (pure)."""

from __future__ import annotations

from typing import Final

from .._sse import SSEEvent
from ._common import Protocol, UsageReport
from ._dialects import DIALECTS

__all__ = ["UsageMeter"]


class UsageMeter:
    """Collects token counts from a response's usage events or body; keeps no text.

    Per protocol (the last report of each count wins, since streams repeat
    cumulative counts):

    * CHAT: ``usage`` of any chunk (the final chunk with
      ``stream_options.include_usage``; every chunk with vLLM's continuous
      usage): ``prompt_tokens``, ``completion_tokens``,
      ``prompt_tokens_details.cached_tokens``. Chunks over 64 KiB are content
      deltas and are skipped without a decode.
    * RESPONSES: ``response.usage`` of ``response.completed`` /
      ``.incomplete`` / ``.failed``: ``input_tokens``, ``output_tokens``,
      ``input_tokens_details.cached_tokens``. These events embed the whole
      response, so they are decoded at any size (a typed decode that skips
      everything but ``usage``); other events are never decoded.
    * MESSAGES: ``message_start.message.usage`` then ``message_delta.usage``
      (cumulative), with ``cache_read_input_tokens``,
      ``cache_creation_input_tokens`` and its ``cache_creation`` split
      (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``).
      :attr:`input_tokens` is normalized to the total prompt
      size, ``input_tokens + cache_read_input_tokens +
      cache_creation_input_tokens``, because Anthropic's ``input_tokens``
      excludes cached tokens while OpenAI's ``prompt_tokens`` includes them.
    * COUNT_TOKENS, OPENAI, ANTHROPIC: nothing is consumed, nothing is counted.

    The answer's ``model`` comes with the usage: the chat chunk's (or body's),
    ``response.model``, ``message_start.message.model`` (or the body's).

    Counts are in tokens, ``None`` until the upstream reported them. Malformed
    JSON is ignored, never raised.

    Args:
        protocol: the exchange's protocol.
    """

    __slots__ = (
        "_adds_cache",
        "_cache_read",
        "_cache_write",
        "_cache_write_1h",
        "_cache_write_5m",
        "_from_body",
        "_from_event",
        "_input",
        "_model",
        "_output",
        "protocol",
    )

    def __init__(self, protocol: Protocol) -> None:
        self.protocol = protocol
        row = DIALECTS[protocol]
        self._from_event: Final = row.usage_from_event
        self._from_body: Final = row.usage_from_body
        self._adds_cache: Final = row.input_excludes_cache
        self._input: int | None = None
        self._output: int | None = None
        self._cache_read: int | None = None
        self._cache_write: int | None = None
        self._cache_write_5m: int | None = None
        self._cache_write_1h: int | None = None
        self._model: str | None = None

    @property
    def input_tokens(self) -> int | None:
        """Prompt tokens, cached ones included (see the class docstring for Anthropic)."""
        if self._input is None or not self._adds_cache:
            return self._input
        return self._input + (self._cache_read or 0) + (self._cache_write or 0)

    @property
    def output_tokens(self) -> int | None:
        """Generated tokens (reasoning included, as the upstreams count them)."""
        return self._output

    @property
    def cache_read_tokens(self) -> int | None:
        """Prompt tokens served from the upstream's prompt cache."""
        return self._cache_read

    @property
    def cache_write_tokens(self) -> int | None:
        """Prompt tokens written to the upstream's prompt cache (Anthropic only)."""
        return self._cache_write

    def totals(self) -> UsageReport:
        """All counts so far: :attr:`input_tokens` normalized, the cache reads, the
        cache writes and their 5-minute / 1-hour split, and the answer's model
        (``None``: not reported)."""
        return UsageReport(
            input_tokens=self.input_tokens,
            output_tokens=self._output,
            cache_read_tokens=self._cache_read,
            cache_write_tokens=self._cache_write,
            cache_write_5m_tokens=self._cache_write_5m,
            cache_write_1h_tokens=self._cache_write_1h,
            response_model=self._model,
        )

    def feed_event(self, event: SSEEvent) -> None:
        """Take the usage out of one streamed event, if it carries any."""
        if self._from_event is not None:
            report = self._from_event(event)
            if report is not None:
                self.merge(report)

    def feed_json(self, body: bytes) -> None:
        """Take the usage out of a complete non-streaming JSON response body."""
        if self._from_body is not None:
            report = self._from_body(body)
            if report is not None:
                self.merge(report)

    def merge(self, report: UsageReport) -> None:
        """Take the counts of one report (the dialect's ``usage_from_event`` /
        ``usage_from_body``); the counts it does not carry stay as they were."""
        if report.input_tokens is not None:
            self._input = report.input_tokens
        if report.output_tokens is not None:
            self._output = report.output_tokens
        if report.cache_read_tokens is not None:
            self._cache_read = report.cache_read_tokens
        if report.cache_write_tokens is not None:
            self._cache_write = report.cache_write_tokens
        if report.cache_write_5m_tokens is not None:
            self._cache_write_5m = report.cache_write_5m_tokens
        if report.cache_write_1h_tokens is not None:
            self._cache_write_1h = report.cache_write_1h_tokens
        if report.response_model is not None:
            self._model = report.response_model
