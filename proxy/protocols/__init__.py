"""The three LLM wire protocols: routing, error shapes, overflow, usage (pure).

(Skeleton: the protocols helper fills in the modules.) The string values of
:class:`Protocol` are stable: plugins, metrics and records use them.
"""

from __future__ import annotations

import enum

__all__ = ["Protocol"]


class Protocol(enum.StrEnum):
    """Which API an exchange speaks, decided from the request path."""

    CHAT = "openai-chat"  # POST /v1/chat/completions
    RESPONSES = "openai-responses"  # POST /v1/responses
    MESSAGES = "anthropic-messages"  # POST /v1/messages
    COUNT_TOKENS = "anthropic-count-tokens"  # POST /v1/messages/count_tokens
    OPENAI = "openai"  # any other /v1/ path: forwarded verbatim to the OpenAI upstream
    ANTHROPIC = "anthropic"  # other Anthropic paths (e.g. /v1/messages/batches)
