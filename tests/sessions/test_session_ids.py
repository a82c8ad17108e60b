"""Session-id resolution: sources in order, bounds on ids, credentials never exposed (pure)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict

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


_NAMES = st.sampled_from(
    [
        "x-session-id",
        "X-Session-Id",
        "session-id",
        "x-claude-code-session-id",
        "Authorization",
        "authorization",
        "x-api-key",
        "X-Api-Key",
        "content-type",
        "accept",
    ]
)
_VALUES = st.one_of(
    st.sampled_from(["", "  ", "sess-1", " Sess-2 ", "Bearer tok", "bearer  t2 ", "Basic x"]),
    st.text(max_size=8),
    st.text(min_size=MAX_SESSION_ID_CHARS, max_size=MAX_SESSION_ID_CHARS + 2),
)


@given(
    fields=st.lists(st.tuples(_NAMES, _VALUES), max_size=8),
    order=st.lists(_NAMES, max_size=4),
    hint=st.one_of(st.none(), _VALUES),
    from_bearer=st.booleans(),
)
@example(
    fields=[("Authorization", "Bearer a"), ("authorization", "Bearer b")],
    order=[],
    hint=None,
    from_bearer=True,
)
@settings(max_examples=400)
def test_a_request_s_own_headers_give_the_id_any_mapping_of_them_gives(
    fields: list[tuple[str, str]], order: list[str], hint: str | None, from_bearer: bool
) -> None:
    # The request's headers (a case-insensitive multidict) are looked up by name; any
    # other mapping is scanned field by field. Both must pick the same id.
    expected = resolve_session_id(
        MultiDict(fields), header_order=order, body_hint=hint, from_bearer=from_bearer
    )
    for headers in (CIMultiDict(fields), CIMultiDictProxy(CIMultiDict(fields))):
        got = resolve_session_id(
            headers, header_order=order, body_hint=hint, from_bearer=from_bearer
        )
        assert got == expected
