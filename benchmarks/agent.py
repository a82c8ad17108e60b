"""``context-proxy bench agent``: a coding-agent session that outgrows the context window.

One synthetic session per protocol, in the shape its agent sends: Claude Code
(Anthropic messages: ``tool_use`` / ``tool_result`` blocks), Codex (Responses:
``function_call`` / ``function_call_output`` items, ``prompt_cache_key``) and an
OpenAI chat agent (``tool_calls`` / ``tool`` messages). Every turn adds one tool call
and one large tool result and sends the whole history, as agents do, so the history
grows to ``--growth`` times the window over ``--turns`` turns (default 120 turns to 3x:
each turn adds 2.5 % of the window, about 5,000 tokens of a 200,000-token window).

The upstream is the project's emulator with a context window (``--window-tokens``)
and its prompt cache on (``emulate --context-window-tokens N --prompt-cache``): it
rejects a prompt over the window with the protocol's real overflow error and reports
as cached the prefix, in whole 1,024-token blocks, shared with an accepted request of
the last 5 minutes. The proxy runs the ``fold`` plugin with ``max_refolds`` at its top
level, once per mode: ``fresh``, where every request starts at fold level 0 (the
proxy's behaviour before carried folds), and ``carried``, where a session's accepted
fold is reapplied to its next request (``[plugin.fold] carry``).

Per turn and in total, from the emulator's own records (what the upstream saw):
upstream requests, rejected requests (bodies over the window), bytes sent upstream,
and the cached share of input tokens (cached / input of the accepted request); and
from the client: whether it saw an error. Targets: after a session's
first overflow at most 1 rejected request per 10 turns, a cached share of at least
85 % over those turns, and no error a client sees.

Outputs in ``--out``: ``agent.json``, ``agent.md``, ``agent.png``; with ``--publish``
also ``docs/bench-agent.{json,md,png}`` (the figures README shows).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import aiohttp
import click

from proxy._emulator_script import window_script

from . import _report as rpt
from ._harness import (
    CONTEXT_SETTINGS,
    EmulatorControl,
    ServiceError,
    open_client_and_emulator,
    run_collect,
    run_command,
    start_proxy,
)
from ._workload import BenchProtocol

__all__ = ["MODES", "AgentHistory", "TurnFigures", "command", "main", "summarize"]

#: Proxy modes compared: name → the fold plugin's ``carry`` option.
MODES: Final = {"fresh": False, "carried": True}
#: Body bytes per token, as the emulator counts them (input tokens = body bytes // 4).
_BYTES_PER_TOKEN: Final = 4
_KEY: Final = "sk-bench-agent"
#: Every fold level of the default fold plugin (2 stages of 2 levels).
_MAX_REFOLDS: Final = 4
#: Seconds one turn may take, answer included.
_TURN_TIMEOUT: Final = 120.0
#: Bytes that end a complete answer, and bytes that mean the client saw a failure.
_DONE: Final = {
    BenchProtocol.CHAT: b"data: [DONE]",
    BenchProtocol.RESPONSES: b"response.completed",
    BenchProtocol.MESSAGES: b"message_stop",
}
_FAILED: Final = (b'"type":"error"', b"response.failed")
_TARGET_REJECTED_PER_10: Final = 1.0
_TARGET_CACHED_SHARE: Final = 0.85
_COLOURS: Final = {
    ("fresh", BenchProtocol.MESSAGES): "#d62728",
    ("fresh", BenchProtocol.RESPONSES): "#ff7f0e",
    ("fresh", BenchProtocol.CHAT): "#8c564b",
    ("carried", BenchProtocol.MESSAGES): "#1f77b4",
    ("carried", BenchProtocol.RESPONSES): "#2ca02c",
    ("carried", BenchProtocol.CHAT): "#17becf",
}


def _filler(seed: str, size: int) -> str:
    """``size`` ASCII characters of file-like text, different for every ``seed``."""
    lines: list[str] = []
    total = 0
    counter = 0
    while total < size:  # bounded: every line adds at least 60 characters
        digest = hashlib.sha256(f"{seed}:{counter}".encode()).hexdigest()
        line = f"    value_{counter} = compute('{digest[:40]}')  # line {counter}\n"
        lines.append(line)
        total += len(line)
        counter += 1
    return "".join(lines)[:size]


class AgentHistory:
    """The growing history of one agent session in ``protocol``'s shape.

    :meth:`body` returns turn ``n``'s request body (bytes): the system prompt, the
    first user message and ``n`` tool exchanges of ``result_bytes`` each, streamed.
    Entries are built once and re-serialized unchanged every turn, as an agent does,
    so consecutive bodies share their prefix byte for byte.
    """

    __slots__ = ("_entries", "_name", "protocol", "result_bytes", "session_id")

    def __init__(self, protocol: BenchProtocol, session_id: str, result_bytes: int) -> None:
        self.protocol = protocol
        self.session_id = session_id
        self.result_bytes = result_bytes
        self._name = f"bench-agent-{protocol.value}"
        task = "Refactor the storage layer so every module uses the new connection pool."
        if protocol is BenchProtocol.RESPONSES:
            first: dict[str, Any] = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": task}],
            }
        else:
            first = {"role": "user", "content": task}
        self._entries: list[dict[str, Any]] = [first]

    def add_turn(self, turn: int) -> None:
        """Append turn ``turn``'s tool call and its result (``result_bytes`` of text)."""
        call_id = f"call_{turn:04d}"
        path = f"src/module_{turn}.py"
        result = _filler(f"{self.session_id}:{turn}", self.result_bytes)
        arguments = json.dumps({"path": path})
        if self.protocol is BenchProtocol.MESSAGES:
            self._entries.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": f"Reading {path}."},
                        {
                            "type": "tool_use",
                            "id": f"toolu_{turn:04d}",
                            "name": "read_file",
                            "input": {"path": path},
                        },
                    ],
                }
            )
            self._entries.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": f"toolu_{turn:04d}",
                            "content": result,
                        }
                    ],
                }
            )
        elif self.protocol is BenchProtocol.RESPONSES:
            self._entries.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "shell",
                    "arguments": arguments,
                }
            )
            self._entries.append(
                {"type": "function_call_output", "call_id": call_id, "output": result}
            )
        else:
            self._entries.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "read_file", "arguments": arguments},
                        }
                    ],
                }
            )
            self._entries.append({"role": "tool", "tool_call_id": call_id, "content": result})

    def body(self, model: str) -> bytes:
        """The whole request body for the history so far (UTF-8 JSON)."""
        system = "You are a coding agent. Follow the repository's conventions."
        payload: dict[str, Any]
        if self.protocol is BenchProtocol.MESSAGES:
            payload = {
                "model": model,
                "max_tokens": 1024,
                "stream": True,
                "system": [{"type": "text", "text": system}],
                "messages": self._entries,
            }
        elif self.protocol is BenchProtocol.RESPONSES:
            payload = {
                "model": model,
                "instructions": system,
                "input": self._entries,
                "stream": True,
                "prompt_cache_key": self.session_id,
            }
        else:
            payload = {
                "model": model,
                "stream": True,
                "messages": [{"role": "system", "content": system}, *self._entries],
            }
        return json.dumps(payload, separators=(",", ":")).encode()

    def headers(self) -> dict[str, str]:
        """The agent's request headers: its credential and its session header."""
        if self.protocol is BenchProtocol.MESSAGES:
            return {
                "x-api-key": _KEY,
                "anthropic-version": "2023-06-01",
                "x-claude-code-session-id": self.session_id,
                "content-type": "application/json",
            }
        if self.protocol is BenchProtocol.RESPONSES:
            return {
                "authorization": f"Bearer {_KEY}",
                "session-id": self.session_id,
                "content-type": "application/json",
            }
        return {
            "authorization": f"Bearer {_KEY}",
            "x-session-id": self.session_id,
            "content-type": "application/json",
        }


@dataclasses.dataclass(frozen=True, slots=True)
class TurnFigures:
    """What one turn cost upstream (from the emulator's records) and what the client saw.

    ``client_bytes``: the body the agent sent; ``upstream_bytes``: bodies the upstream
    received, every attempt; ``input_tokens`` / ``cached_tokens``: of the accepted
    attempt (0 when none was); ``client_error``: the client got no complete answer.
    """

    turn: int
    client_bytes: int
    upstream_requests: int
    rejected: int
    upstream_bytes: int
    input_tokens: int
    cached_tokens: int
    client_error: bool

    @property
    def cached_share(self) -> float:
        """Cached share of the accepted attempt's input tokens (0.0 to 1.0; NaN if none)."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else float("nan")

    @property
    def folded(self) -> bool:
        """True when the upstream received a smaller body than the client sent."""
        return self.upstream_requests > 0 and self.upstream_bytes < self.client_bytes * (
            self.upstream_requests
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """Totals of one session; ``after_*`` count the turns after its first overflow."""

    turns: int
    upstream_requests: int
    rejected: int
    upstream_bytes: int
    client_errors: int
    first_overflow: int | None
    after_turns: int
    after_rejected: int
    after_cached_share: float

    @property
    def rejected_per_10(self) -> float:
        """Rejected requests per 10 turns after the first overflow (NaN if none followed)."""
        return 10 * self.after_rejected / self.after_turns if self.after_turns else float("nan")


def summarize(figures: Sequence[TurnFigures]) -> Summary:
    """The :class:`Summary` of one session's per-turn ``figures``."""
    first = next((f.turn for f in figures if f.rejected), None)
    after = [f for f in figures if first is not None and f.turn > first]
    cached = sum(f.cached_tokens for f in after)
    total = sum(f.input_tokens for f in after)
    return Summary(
        turns=len(figures),
        upstream_requests=sum(f.upstream_requests for f in figures),
        rejected=sum(f.rejected for f in figures),
        upstream_bytes=sum(f.upstream_bytes for f in figures),
        client_errors=sum(f.client_error for f in figures),
        first_overflow=first,
        after_turns=len(after),
        after_rejected=sum(f.rejected for f in after),
        after_cached_share=cached / total if total else float("nan"),
    )


async def _send(
    session: aiohttp.ClientSession, url: str, history: AgentHistory, body: bytes
) -> bool:
    """Send one turn and read the whole answer; True when the client saw no failure."""
    async with session.post(
        url + history.protocol.path,
        data=body,
        headers=history.headers(),
        timeout=aiohttp.ClientTimeout(total=_TURN_TIMEOUT),
    ) as resp:
        answer = await resp.read()
    if resp.status != 200 or _DONE[history.protocol] not in answer:
        return False
    return not any(marker in answer for marker in _FAILED)


async def run_session(
    session: aiohttp.ClientSession,
    proxy_url: str,
    emulator: EmulatorControl,
    history: AgentHistory,
    *,
    turns: int,
    window_tokens: int,
    model: str,
) -> list[TurnFigures]:
    """Drive ``history`` through the proxy for ``turns`` turns; one figure per turn."""
    # The emulator's own rule for a window (the body sizes it rejects), not a copy of it.
    limit = window_script(window_tokens).overflow_above
    assert limit is not None
    seen = max((r["id"] for r in await emulator.records()), default=0)
    figures: list[TurnFigures] = []
    for turn in range(1, turns + 1):
        history.add_turn(turn)
        body = history.body(model)
        ok = await _send(session, proxy_url, history, body)
        records = [r for r in await emulator.records() if r["id"] > seen]
        seen = max((r["id"] for r in records), default=seen)
        accepted = [r for r in records if r["body_bytes"] <= limit]
        last = accepted[-1] if accepted else None
        figures.append(
            TurnFigures(
                turn=turn,
                client_bytes=len(body),
                upstream_requests=len(records),
                rejected=len(records) - len(accepted),
                upstream_bytes=sum(r["body_bytes"] for r in records),
                input_tokens=last["body_bytes"] // _BYTES_PER_TOKEN if last else 0,
                cached_tokens=int(last.get("cached_tokens", 0)) if last else 0,
                client_error=not ok,
            )
        )
    return figures


def _config(out: Path, carry: bool) -> Path:
    """The proxy's settings file for one mode: every fold level, carry on or off."""
    path = out / f"agent-{'carried' if carry else 'fresh'}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'plugins = ["fold"]\nmax_refolds = {_MAX_REFOLDS}\n\n'
        f"[plugin.fold]\ncarry = {'true' if carry else 'false'}\n",
        encoding="utf-8",
    )
    return path


async def collect(args: Any, reporter: rpt.Reporter, log_dir: Path) -> dict[str, Any]:
    """Run every mode and protocol; the per-turn figures by mode and protocol."""
    protocols = [BenchProtocol(name) for name in args.protocols]
    window = args.window_tokens
    final_bytes = args.growth * _BYTES_PER_TOKEN * window
    result_bytes = max(4096, int(final_bytes / args.turns))
    emulator_args = ["--context-window-tokens", str(window), "--prompt-cache"]
    results: dict[str, Any] = {}
    async with open_client_and_emulator(log_dir, emulator_args) as (session, emulator):
        control = EmulatorControl(session, emulator.url)
        with reporter.progress(len(args.modes) * len(protocols), "agent sessions") as steps:
            for mode in args.modes:
                await control.reset()
                config = _config(args.out, MODES[mode])
                proxy = start_proxy(
                    emulator.url,
                    log_dir,
                    plugins=("fold",),
                    env={"CONTEXT_PROXY_CONFIG": str(config)},
                    name=f"proxy-{mode}",
                )
                async with proxy:
                    await proxy.wait_ready(session)
                    for protocol in protocols:
                        steps.describe(f"{mode} {protocol.value}")
                        history = AgentHistory(
                            protocol, f"agent-{mode}-{protocol.value}", result_bytes
                        )
                        figures = await run_session(
                            session,
                            proxy.url,
                            control,
                            history,
                            turns=args.turns,
                            window_tokens=window,
                            model=f"bench-agent-{mode}",
                        )
                        proxy.check_alive()
                        results.setdefault(mode, {})[protocol.value] = figures
                        steps.advance()
    return {"result_bytes": result_bytes, "figures": results}


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.0f} %"  # NaN check


def build_tables(figures: dict[str, dict[str, list[TurnFigures]]]) -> list[rpt.Table]:
    """The totals table (with targets) and one compact per-turn table per protocol."""
    totals = rpt.Table(
        "Agent session through the proxy, totals (upstream = what the emulator received)",
        ("mode", "protocol", "upstream", "rejected", "MiB up", "rej/10 after", "cached after"),
    )
    for mode, by_protocol in figures.items():
        for protocol, turns in by_protocol.items():
            s = summarize(turns)
            rej = s.rejected_per_10
            rej_cell = "n/a" if rej != rej else f"{rej:.1f}"
            cached_cell = _pct(s.after_cached_share)
            if mode == "carried":
                rej_cell += " " + rpt.verdict(rej, _TARGET_REJECTED_PER_10)
                cached_cell += " " + rpt.verdict(-s.after_cached_share, -_TARGET_CACHED_SHARE)
            totals.add(
                mode,
                protocol,
                str(s.upstream_requests),
                str(s.rejected),
                f"{s.upstream_bytes / rpt.MiB:.1f}",
                rej_cell,
                cached_cell,
            )
            if s.client_errors:
                totals.notes.append(f"{mode} {protocol}: {s.client_errors} turns saw an error")
    totals.notes.append(
        "targets (carried): <= 1 rejected request per 10 turns after the first overflow; "
        ">= 85 % of input tokens cached over those turns; no client error"
    )
    tables = [totals]
    for protocol in next(iter(figures.values()), {}):
        table = rpt.Table(
            f"{protocol}, every 5th turn: upstream requests / rejected / cached share",
            ("turn", *(f"{mode}" for mode in figures)),
        )
        length = max(len(figures[mode][protocol]) for mode in figures)
        for index in range(4, length, 5):
            cells = []
            for mode in figures:
                f = figures[mode][protocol][index]
                cells.append(f"{f.upstream_requests} / {f.rejected} / {_pct(f.cached_share)}")
            table.add(str(index + 1), *cells)
        tables.append(table)
    return tables


def plot(path: Path, figures: dict[str, dict[str, list[TurnFigures]]]) -> None:
    """Four panels over the turns: upstream requests, rejected, KiB sent, cached share."""
    panels: list[rpt.Panel] = []
    for title, ylabel, value in (
        ("Upstream requests per turn", "requests", lambda f: float(f.upstream_requests)),
        ("Rejected (context overflow) per turn", "requests", lambda f: float(f.rejected)),
        ("Bytes sent upstream per turn", "KiB", lambda f: f.upstream_bytes / 1024),
        ("Cached share of input tokens", "%", lambda f: 100 * f.cached_share),
    ):
        series = [
            rpt.Series(
                f"{mode} {protocol}",
                [f.turn for f in turns],
                [value(f) for f in turns],
                colour=_COLOURS.get((mode, BenchProtocol(protocol)), "#7f7f7f"),
            )
            for mode, by_protocol in figures.items()
            for protocol, turns in by_protocol.items()
        ]
        hlines = [(100 * _TARGET_CACHED_SHARE, "target 85 %")] if ylabel == "%" else []
        panels.append(rpt.Panel(title, "turn", ylabel, series, hlines=hlines))
    rpt.plot_series(path, "bench agent: fold levels carried across turns, or not", panels)


@click.command(
    context_settings=CONTEXT_SETTINGS,
    help="A coding-agent session growing past the window: rejected requests and cache hits.",
)
@click.option("--turns", type=click.IntRange(min=2), default=120, help="turns per session [120]")
@click.option(
    "--window-tokens",
    type=click.IntRange(min=4096),
    default=32768,
    help="the emulator's context window, tokens (4 bytes each) [32768]",
)
@click.option(
    "--growth",
    type=click.FloatRange(min=1.0),
    default=3.0,
    help="final history size as a multiple of the window [3.0]",
)
@click.option(
    "--protocols",
    default="messages,responses,chat",
    help="comma-separated: messages, responses, chat [all]",
)
@click.option("--modes", default="fresh,carried", help="comma-separated: fresh, carried [both]")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option(
    "--publish",
    is_flag=True,
    help="also write docs/bench-agent.{json,md,png} (what README shows)",
)
@click.option("--publish-dir", type=click.Path(path_type=Path), default=Path("docs"), help="[docs]")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.pass_obj
def command(argv: list[str], /, **options: Any) -> int:
    """Run the sessions, print and write the tables, the JSON and the plot."""
    options["protocols"] = [p.strip() for p in options["protocols"].split(",") if p.strip()]
    options["modes"] = [m.strip() for m in options["modes"].split(",") if m.strip()]
    for name in options["protocols"]:
        if name not in {p.value for p in BenchProtocol}:
            raise click.BadParameter(f"unknown protocol {name!r}", param_hint="--protocols")
    for name in options["modes"]:
        if name not in MODES:
            raise click.BadParameter(f"unknown mode {name!r}", param_hint="--modes")
    ns = types.SimpleNamespace(**options)
    out: Path = options["out"]
    reporter = rpt.Reporter(quiet=options["quiet"])
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        collected = run_collect(collect, ns, reporter, out / "logs-agent")
    except ServiceError as exc:
        reporter.note(f"[bold red]benchmark failed:[/bold red] {exc}")
        return 1
    if collected is None:
        return 1
    figures: dict[str, dict[str, list[TurnFigures]]] = collected["figures"]
    tables = build_tables(figures)
    for table in tables:
        reporter.print_table(table)
    document = {
        "started": started,
        "argv": argv,
        "window_tokens": options["window_tokens"],
        "turns": options["turns"],
        "result_bytes": collected["result_bytes"],
        "summary": {
            mode: {p: dataclasses.asdict(summarize(t)) for p, t in by.items()}
            for mode, by in figures.items()
        },
        "figures": {
            mode: {p: [dataclasses.asdict(f) for f in t] for p, t in by.items()}
            for mode, by in figures.items()
        },
    }
    preamble = f"`context-proxy bench agent {' '.join(argv)}`"
    targets = [(out, "agent")]
    if options["publish"]:
        targets.append((options["publish_dir"], "bench-agent"))
    for folder, stem in targets:
        rpt.write_json(folder / f"{stem}.json", document)
        rpt.write_markdown(folder / f"{stem}.md", tables, preamble)
        plot(folder / f"{stem}.png", figures)
        reporter.note(f"wrote {folder / stem}.json, .md and .png")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``context-proxy bench agent`` and ``python -m benchmarks.agent``.

    Returns 0 when the run completed (targets missed are reported, not an error),
    1 when a server failed, 2 for bad options.
    """
    return run_command(command, "context-proxy bench agent", argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
