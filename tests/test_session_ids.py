"""Session-id resolution: sources in order, bounds on ids, credentials never exposed (pure)."""

from __future__ import annotations

from multidict import CIMultiDict

from proxy._session_ids import (
    MAX_SESSION_ID_CHARS,
    bearer_session_id,
    normalize_session_id,
    resolve_session_id,
)


def test_headers_are_searched_in_configured_order_case_insensitively() -> None:
    headers = {"Session-Id": "from-session-id", "X-Claude-Code-Session-Id": "CC-Sess-1"}
    assert resolve_session_id(headers, body_hint="hint") == "CC-Sess-1"
    reordered = ["session-id", "x-claude-code-session-id"]
    assert resolve_session_id(headers, header_order=reordered) == "from-session-id"


def test_blank_sources_are_skipped_down_to_body_hint_then_bearer() -> None:
    headers = {"x-session-id": "   ", "Authorization": "Bearer  tok-123 "}
    assert resolve_session_id(headers, body_hint=" \t") is None
    assert resolve_session_id(headers, body_hint="cache-key-7") == "cache-key-7"
    sid = resolve_session_id(headers, body_hint=None, from_bearer=True)
    assert sid is not None and sid == bearer_session_id("bearer tok-123")
    assert sid.startswith("b:") and "tok-123" not in sid
    assert resolve_session_id({"authorization": "Basic dXNlcg=="}, from_bearer=True) is None


def test_repeated_header_uses_first_non_blank_value() -> None:
    headers = CIMultiDict([("X-Session-Id", ""), ("x-session-id", "second"), ("x-session-id", "3")])
    assert resolve_session_id(headers) == "second"


def test_ids_keep_case_and_overlong_or_unprintable_ones_are_hashed() -> None:
    assert normalize_session_id("  MixedCase-ID ") == "MixedCase-ID"
    at_limit = "A" * MAX_SESSION_ID_CHARS
    assert normalize_session_id(at_limit) == at_limit
    hashed = normalize_session_id(at_limit + "A")
    assert hashed is not None and hashed.startswith("h:") and len(hashed) == 34
    assert normalize_session_id(at_limit + "A") == hashed  # stable
    assert normalize_session_id(at_limit + "B") != hashed
    assert normalize_session_id(hashed) == hashed  # idempotent
    forged = normalize_session_id("abc\r\nx-admin: 1")
    assert forged is not None and forged.startswith("h:")


def test_credential_header_named_as_session_source_is_never_exposed() -> None:
    sid = resolve_session_id({"X-Api-Key": "sk-secret-1"}, header_order=["x-api-key"])
    assert sid is not None and sid.startswith("b:") and "sk-secret" not in sid
