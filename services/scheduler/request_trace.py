"""A request's trace, ended: queue, prefill and decode as child spans of its scheduler span, made
from the request's own timestamps (no span is open while it waits or computes), its failovers as
events and its outcome as attributes."""
from __future__ import annotations

import time

from opentelemetry import trace

from services.scheduler.request import Request


def end_request_trace(tracer, span, request: Request, outcome: str) -> None:
    """Queue, prefill and decode as child spans of the request's span, from its timestamps."""
    end = request.finished_at or time.perf_counter()
    parent = trace.set_span_in_context(span)
    phases = [("scheduler.queue", request.arrival, request.first_scheduled_at or end),
              ("scheduler.prefill", request.first_scheduled_at, request.first_token_at or end),
              ("scheduler.decode", request.first_token_at, end)]
    for name, start, stop in phases:
        if start is not None:
            tracer.start_span(name, context=parent, start_time=request.wall_ns(start)) \
                .end(end_time=request.wall_ns(max(start, stop)))
    for at, why, address in request.failovers:
        span.add_event("failover", {"qos.failover.reason": why, "qos.failover.worker": address},
                       timestamp=request.wall_ns(at))
    span.set_attributes({"qos.output_tokens": len(request.output_ids), "qos.outcome": outcome,
                         "qos.preempted": request.preemptions, "qos.failovers": len(request.failovers),
                         "qos.resumed_tokens": request.resumed})
    span.end(end_time=request.wall_ns(end))
