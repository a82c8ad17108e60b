"""Tiny body-mutating plugins for the benchmarks.

``Marker`` appends a marker to the text of the last user message through the
whole parsed object, so every request makes the proxy parse the body and
serialize a new outbound body: the worst case a plugin can cause.
``ViewMarker`` makes the same kind of small edit through the structural view
(one field replaced, the rest sent as slices of the raw bytes). Enable them with
``plugins = ["benchmarks.plugins:Marker"]`` (or ``:ViewMarker``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy import Node, Plugin, PrepareContext, WireMetadata

from ._workload import marker_text

__all__ = ["Marker", "ViewMarker"]


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


def _last_user(items: list[Node]) -> Node | None:
    for item in reversed(items):
        role = item.get("role") if item.kind == "object" else None
        if role is not None and role.short_text() == "user":
            return item
    return None


class ViewMarker(Plugin):
    """Appends :func:`~benchmarks._workload.marker_text` through ``ctx.view``: one small edit.

    The last user message's string content grows, or its last text part's text
    does (``text`` / ``input_text``). Never asks for the whole object.
    """

    name: ClassVar[str] = "view_marker"

    async def prepare(self, ctx: PrepareContext) -> bool:
        """Replace one string value; ``False`` when there is no user text to mark."""
        item = _last_user(ctx.view.items())
        content = item.get("content") if item is not None else None
        if content is None:
            return False
        if content.kind == "array" and len(content):
            content = content[len(content) - 1].get("text")
        if content is None or content.kind != "string":
            return False
        content.replace(content.text() + marker_text())
        return True
