"""A tiny body-mutating plugin for the benchmarks.

``Marker`` appends a marker to the text of the last user message, so every
request makes the proxy parse the body and serialize a new outbound body: the
worst case a plugin can cause. Enable it with
``--plugin benchmarks.plugins:Marker`` (or ``plugins = ["benchmarks.plugins:Marker"]``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy import Plugin, PrepareContext, WireMetadata

from ._workload import marker_text

__all__ = ["Marker"]


def _append(message: dict[str, Any], text: str, part_type: str) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = content + text
        return True
    if isinstance(content, list):
        content.append({"type": part_type, "text": text})
        return True
    return False


class Marker(Plugin):
    """Appends :func:`~benchmarks._workload.marker_text` to the last user message.

    Chat and Anthropic: the last ``messages`` entry with role ``user`` (a string
    content grows; a list gets a ``text`` part). Responses: the last ``input``
    item with role ``user`` (an ``input_text`` part), or the ``input`` string.
    Asks for the body at every fold level; returns whether it changed it.
    """

    name: ClassVar[str] = "marker"

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        """Always: this plugin exists to make the proxy parse and rewrite the body."""
        return True

    async def prepare(self, ctx: PrepareContext) -> bool:
        """Append the marker; ``False`` when there is no user message to mark."""
        body = ctx.body
        text = marker_text()
        items = body.get("input") if "input" in body else body.get("messages")
        if isinstance(items, str):
            body["input"] = items + text
            return True
        if not isinstance(items, list):
            return False
        part = "input_text" if "input" in body else "text"
        for item in reversed(items):
            if isinstance(item, dict) and item.get("role") == "user":
                return _append(item, text, part)
        return False
