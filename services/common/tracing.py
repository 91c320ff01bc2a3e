"""OpenTelemetry tracing, set up once per process from the standard OTEL_* variables.

On when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set (and
OTEL_SDK_DISABLED is not true): spans go to that OTLP gRPC endpoint through a batch span
processor (OTEL_BSP_* tune it). Otherwise the API's no-op tracer is used and spans cost next to
nothing. Context crosses processes as W3C `traceparent` in gRPC metadata (router -> scheduler)
and in each new sequence of a step plan (scheduler -> worker). Attributes share the `qos.` prefix.
"""
from __future__ import annotations

import logging
import os

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_W3C = TraceContextTextMapPropagator()
TRACEPARENT = "traceparent"      # the W3C header (and gRPC metadata key) carrying a span's context


def tracing_configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup_tracing(service_name: str) -> trace.Tracer:
    """Install the exporting tracer provider if configured; returns this service's tracer."""
    if tracing_configured():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # OTEL_RESOURCE_ATTRIBUTES still adds to this; the service name is the process's role.
        provider = TracerProvider(resource=Resource.create({"service.name": f"qos-{service_name}"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        log.info("tracing to %s as qos-%s", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                 or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), service_name)
    return trace.get_tracer(f"qos-serve.{service_name}")


def shutdown_tracing() -> None:
    """Flush pending spans (called when a service stops)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def extract_metadata(metadata) -> Context:
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def traceparent(context: Context | None = None) -> str:
    """The W3C traceparent of the current (or given) span, '' when not recording."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=context)
    return carrier.get(TRACEPARENT, "")


def span_context_from(traceparent_value: str) -> trace.SpanContext | None:
    if not traceparent_value:
        return None
    ctx = _W3C.extract({TRACEPARENT: traceparent_value})
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None
