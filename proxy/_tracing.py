"""OpenTelemetry traces of exchanges: the optional extra ``context-proxy[otel]``.

Off by default (``tracing = "off"``): then nothing of OpenTelemetry is imported
(this module imports it only inside its functions) and the hot path pays one
``is None`` test per exchange and per upstream attempt.
With ``tracing = "otel"`` :func:`start_tracing` imports the OpenTelemetry SDK
(raising :class:`~proxy._config.ConfigError` naming the extra when it is not
installed) and each exchange gets

- one ``SERVER`` span, from the request's head to the end of its answer, whose
  parent is the W3C trace context the client sent (``traceparent`` /
  ``tracestate``), carrying the GenAI semantic-convention attributes
  (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/), the
  HTTP server ones (https://opentelemetry.io/docs/specs/semconv/http/http-spans/)
  and the proxy's own (``context_proxy.*``: fold level, outcome, refolds,
  resends, a digest of the session id);
- one ``CLIENT`` span per upstream attempt, a child of the exchange's span:
  the first send, each refold (``context_proxy.attempt.reason = "refold"``)
  and each fake-completion resend (``"resend"``). Its context replaces the
  client's trace fields on that attempt's request (the proxy is a participant
  of the trace, W3C Trace Context §2.3), through the global propagator
  (``OTEL_PROPAGATORS``, W3C ``tracecontext,baggage`` by default).

Everything else is the SDK's and is configured by the standard ``OTEL_*``
environment variables, read by the SDK itself: ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (the service is ``context-proxy`` when neither
names one), ``OTEL_TRACES_EXPORTER`` (``otlp`` by default, ``console``,
``none``, or any exporter registered under the ``opentelemetry_traces_exporter``
entry point), ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, protocol: the extra
ships ``http/protobuf``), ``OTEL_BSP_*`` (batching), ``OTEL_TRACES_SAMPLER``
and ``OTEL_SDK_DISABLED`` (no spans; the client's trace fields then pass
upstream untouched, as with tracing off). An embedder that set a global
tracer provider gets its spans there; tests pass one to ``build_app``.

Never on a span: an API key, a header value, a body, a query string, or the
session id itself (only the first 16 hex digits of its SHA-256).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.metadata
import os
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Final, Literal

from ._config import ConfigError
from ._exchange import Exchange
from ._plugins import Outcome
from ._protocols import Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = [
    "AttemptTrace",
    "ExchangeTrace",
    "Tracing",
    "exporter_entries",
    "start_tracing",
    "tracing_problems",
]

#: What the start-up error tells a user who enabled tracing without the extra.
MISSING_EXTRA: Final = (
    "tracing = \"otel\" needs the optional extra: pip install 'context-proxy[otel]'"
)
#: The service name when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES gives one.
DEFAULT_SERVICE: Final = "context-proxy"

AttemptReason = Literal["first", "refold", "resend"]

#: gen_ai.operation.name per protocol (semconv's GenAiOperationNameValues); the
#: passthrough routes have none.
_OPERATION: Final[Mapping[Protocol, str]] = {
    Protocol.CHAT: "chat",
    Protocol.RESPONSES: "chat",
    Protocol.MESSAGES: "chat",
}
#: Outcomes that are a failure of the exchange itself (HTTP semconv: a server
#: span is an error on a 5xx; a stream cut after its 200 head is one too).
_FAILED: Final = frozenset({Outcome.STREAM_ERROR, Outcome.ERROR})


def session_digest(session_id: str) -> str:
    """The first 16 hex digits of the SHA-256 of ``session_id``: correlates a
    session's traces without sending its id (which may name a user) to the
    trace backend. A guessable id stays guessable: this is no secret."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class AttemptTrace:
    """The ``CLIENT`` span of one upstream attempt.

    The relay says what came of it (:meth:`answered` with the upstream's
    status, or :meth:`failed` with the outcome when no answer came) and then
    calls :meth:`end`, once, however the attempt ended.
    """

    __slots__ = ("failure", "span", "status")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.status: int | None = None
        self.failure: Outcome | None = None

    def answered(self, status: int) -> None:
        """The upstream answered this attempt with HTTP ``status``."""
        self.status = status

    def failed(self, outcome: Outcome) -> None:
        """No answer came: unreachable, timed out, or refused by the proxy's own pool."""
        self.failure = outcome

    def end(self) -> None:
        """End the span (after the answer was relayed, refolded or resent).

        HTTP semconv: a client span is an error on a 4xx too, so an overflow
        that caused a refold shows as one (which is what it was). An attempt
        with neither status nor failure was cut short by a cancel (the client
        went, or a shutdown).
        """
        from opentelemetry.trace import StatusCode

        span = self.span
        status = self.status
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_attribute("error.type", str(status))
                span.set_status(StatusCode.ERROR)
        else:
            span.set_attribute("error.type", str(self.failure or Outcome.CANCELLED))
            span.set_status(StatusCode.ERROR)
        span.end()


class ExchangeTrace:
    """The ``SERVER`` span of one exchange and the attempts under it."""

    __slots__ = ("_attempts", "_context", "_tracing", "span")

    def __init__(self, tracing: Tracing, span: Span, context: Context) -> None:
        self._tracing = tracing
        self.span = span
        #: The span as a parent: what each attempt's span starts from.
        self._context = context
        self._attempts = 0

    def attempt(
        self,
        ex: Exchange,
        headers: MutableMapping[str, str],
        *,
        reason: AttemptReason,
        host: str,
        port: int,
    ) -> AttemptTrace:
        """Start the span of the attempt about to be sent to ``host:port`` and put
        its trace context in ``headers`` (the attempt's request fields).

        The fields the propagator writes (``traceparent``, ``tracestate``,
        ``baggage`` by default) are replaced: the client's trace context is the
        exchange span's parent now (its ``tracestate`` and baggage are carried
        on), and a stale field must not ride along.
        """
        from opentelemetry import trace

        tracing = self._tracing
        self._attempts += 1
        attributes: dict[str, str | int] = {
            "http.request.method": ex.method,
            "url.path": ex.path,
            "server.address": host,
            "server.port": port,
            "context_proxy.attempt": self._attempts,
            "context_proxy.attempt.reason": reason,
            "context_proxy.fold_level": ex.fold_level,
            "http.request.body.size": ex.outbound_size,
        }
        _gen_ai(attributes, ex)
        span = tracing.tracer.start_span(
            f"{ex.method} {ex.path}",
            context=self._context,
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
        )
        for name in tracing.fields:
            while name in headers:
                del headers[name]
        tracing.propagator.inject(headers, context=trace.set_span_in_context(span, self._context))
        return AttemptTrace(span)

    def end(self, ex: Exchange) -> None:
        """End the exchange's span with what the exchange became (after its close)."""
        from opentelemetry.trace import StatusCode

        span = self.span
        meta = ex.meta
        attributes: dict[str, str | int | bool] = {
            "http.response.status_code": ex.status,
            "http.request.body.size": ex.received_bytes,
            "http.response.body.size": ex.response_bytes,
            "context_proxy.outcome": str(ex.outcome),
            "context_proxy.fold_level": ex.fold_level,
            "context_proxy.refolds": ex.refolds,
            "context_proxy.resends": ex.retries,
        }
        if meta is not None:
            attributes["context_proxy.stream"] = meta.stream
        _gen_ai(attributes, ex)
        usage = ex.usage
        if usage.response_model:
            attributes["gen_ai.response.model"] = usage.response_model
        for name, count in (
            ("gen_ai.usage.input_tokens", usage.input_tokens),
            ("gen_ai.usage.output_tokens", usage.output_tokens),
            ("gen_ai.usage.cache_read.input_tokens", usage.cache_read_tokens),
            ("gen_ai.usage.cache_creation.input_tokens", usage.cache_write_tokens),
        ):
            if count is not None:
                attributes[name] = count
        if ex.session_id is not None:
            attributes["context_proxy.session.digest"] = session_digest(ex.session_id)
        if ex.outcome is not Outcome.OK:
            attributes["error.type"] = str(ex.outcome)
        span.set_attributes(attributes)
        operation = _OPERATION.get(ex.protocol)
        model = meta.model if meta is not None else None
        if operation is not None and model:
            # The GenAI span name (semconv: "{gen_ai.operation.name} {gen_ai.request.model}").
            span.update_name(f"{operation} {model}")
        if ex.status >= 500 or ex.outcome in _FAILED:
            span.set_status(StatusCode.ERROR)
        span.end()


def _gen_ai(attributes: dict[str, str | int], ex: Exchange) -> None:
    """The GenAI attributes known from the request: provider, operation, model.

    ``gen_ai.system`` is the older name of ``gen_ai.provider.name``; both are
    set so backends on either semconv version see it.
    """
    provider = ex.protocol.upstream
    attributes["gen_ai.provider.name"] = provider
    attributes["gen_ai.system"] = provider
    operation = _OPERATION.get(ex.protocol)
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    meta = ex.meta
    if meta is not None and meta.model:
        attributes["gen_ai.request.model"] = meta.model


class Tracing:
    """The tracer of one proxy instance and the propagator of its trace context.

    Built by :func:`start_tracing`; :meth:`close` flushes the spans still
    batched when the provider is the proxy's own.
    """

    __slots__ = ("_owned", "fields", "propagator", "tracer")

    def __init__(
        self,
        tracer: Tracer,
        propagator: TextMapPropagator,
        owned: SdkTracerProvider | None,
    ) -> None:
        self.tracer = tracer
        self.propagator = propagator
        #: The header fields the propagator writes (a composite one builds the set anew
        #: on each ask: asked once here).
        self.fields: Final = tuple(propagator.fields)
        self._owned = owned

    def exchange(
        self, ex: Exchange, request_headers: Mapping[str, str], peer: tuple[str, int] | None
    ) -> ExchangeTrace:
        """Start the ``SERVER`` span of ``ex``, a child of the client's trace context
        in ``request_headers`` (a new trace when it sent none or an invalid one)."""
        from opentelemetry import trace

        parent = self.propagator.extract(request_headers)
        attributes: dict[str, str | int] = {
            "http.request.method": ex.method,
            "url.path": ex.path,
            "url.scheme": "http",
            "context_proxy.exchange.id": ex.id,
            "context_proxy.protocol": str(ex.protocol),
        }
        if peer is not None:
            attributes["client.address"], attributes["client.port"] = peer
        _gen_ai(attributes, ex)
        span = self.tracer.start_span(
            f"{ex.method} {ex.path}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
        )
        # The extracted context stays underneath (its baggage goes upstream again).
        return ExchangeTrace(self, span, trace.set_span_in_context(span, parent))

    async def close(self) -> None:
        """Export what is batched and stop the exporter (the proxy's own provider only).

        Off the event loop: an exporter's final flush may wait on the network
        (``OTEL_BSP_EXPORT_TIMEOUT``, 30 s by default).
        """
        owned, self._owned = self._owned, None
        if owned is not None:
            await asyncio.to_thread(owned.shutdown)


def start_tracing(provider: TracerProvider | None = None) -> Tracing:
    """The proxy's :class:`Tracing`: on ``provider``, else on the global tracer provider
    if an embedder set one, else on an SDK provider of its own built from ``OTEL_*``.

    Raises:
        ConfigError: the OpenTelemetry SDK is not installed (:data:`MISSING_EXTRA`),
            or ``OTEL_TRACES_EXPORTER`` names an exporter that is not installed.
    """
    try:
        from opentelemetry import propagate, trace

        importlib.import_module("opentelemetry.sdk.trace")
    except ImportError:
        # The API alone, or nothing: the SDK (and the OTLP exporter) come with the extra.
        raise ConfigError(MISSING_EXTRA) from None
    owned: SdkTracerProvider | None = None
    if provider is None:
        current = trace.get_tracer_provider()
        if not isinstance(current, trace.ProxyTracerProvider):
            provider = current  # an embedder's own
        else:
            provider = owned = _sdk_provider()
    tracer = provider.get_tracer("context_proxy", _version())
    return Tracing(tracer, propagate.get_global_textmap(), owned)


def _version() -> str | None:
    """The installed package's version, the tracer's (instrumentation scope) version."""
    try:
        return importlib.metadata.version("context-proxy")
    except importlib.metadata.PackageNotFoundError:
        return None


def _sdk_provider() -> SdkTracerProvider:
    """An SDK tracer provider whose resource, sampler, batching and exporters come
    from the ``OTEL_*`` environment (the SDK reads each; only the exporter list is
    ours to resolve, as the SDK's own auto-configuration is a private module)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE}))
    provider = SdkTracerProvider(resource=resource)
    for exporter in _exporters(os.environ):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names, each built with no arguments
    so it reads its own ``OTEL_EXPORTER_*`` variables (see :func:`exporter_entries`).

    Raises:
        ConfigError: a named exporter is not installed.
    """
    return [entry.load()() for entry in exporter_entries(environ)]


def exporter_entries(environ: Mapping[str, str]) -> list[importlib.metadata.EntryPoint]:
    """The installed exporters ``OTEL_TRACES_EXPORTER`` names (comma-separated; ``otlp``
    by default; ``none`` for none), found, not loaded.

    ``otlp`` is resolved by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf`` by default, as the
    OpenTelemetry specification says) to the ``otlp_proto_http`` or
    ``otlp_proto_grpc`` entry point; any other name is an entry point of the
    ``opentelemetry_traces_exporter`` group as it is (``console``, ``zipkin_json``).

    Raises:
        ConfigError: a named exporter is not installed.
    """
    names = [
        name.strip()
        for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if name.strip()
    ]
    entries: list[importlib.metadata.EntryPoint] = []
    for name in names:
        if name == "none":
            continue
        entry = name
        if name == "otlp":
            protocol = environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            )
            entry = "otlp_proto_grpc" if protocol.strip() == "grpc" else "otlp_proto_http"
        found = importlib.metadata.entry_points(group="opentelemetry_traces_exporter", name=entry)
        if not found:
            package = (
                "opentelemetry-exporter-otlp-proto-grpc"
                if entry == "otlp_proto_grpc"
                else "the package that provides it"
            )
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER: exporter {name!r} ({entry}) is not installed; "
                f"install {package}"
            )
        entries.append(next(iter(found)))
    return entries


def tracing_problems(environ: Mapping[str, str]) -> list[str]:
    """What would stop ``tracing = "otel"`` from starting (``context-proxy check``):
    the SDK missing, or an exporter named in ``OTEL_TRACES_EXPORTER`` missing.

    The SDK is imported, not just looked up: one present that cannot be imported
    is as missing as an absent one. The exporters are found, not loaded.
    """
    try:
        importlib.import_module("opentelemetry.sdk.trace")
    except ImportError:
        return [MISSING_EXTRA]
    try:
        exporter_entries(environ)
    except ConfigError as exc:
        return [str(exc)]
    return []
