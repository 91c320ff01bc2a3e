"""`qos-serve alerts`: the SLA objectives now and the alerts (Router.Alerts), as a table; and
`qos-serve alerts --rules`: the Prometheus alerting rules equivalent to the router's built-in
evaluation of the config's [[sla]] contracts (services/control/alert_rules.py)."""
from __future__ import annotations

import asyncio
import sys
import time

import grpc

from services.common.priority import priority_name
from services.common.proto.qos.v1 import router_pb2
from services.tools.stats_view import call_router


def _value(objective: str, value: float) -> str:
    return f"{value * 100:.2f}%" if objective == "success_rate" else f"{value:.0f} ms"


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def render(reply: router_pb2.AlertsReply) -> str:
    lines = [f"{'priority':<8} {'tenant':<12} {'objective':<13} {'target':>9} {'observed':>9} "
             f"{'requests':>8} {'window':>6}  state"]
    for o in reply.objectives:
        observed = _value(o.objective, o.observed) if o.has_verdict else "-"
        target = ("≥ " if o.objective == "success_rate" else "≤ ") + _value(o.objective, o.target)
        lines.append(f"{priority_name(o.priority):<8} {o.tenant:<12} {o.objective:<13} {target:>9} "
                     f"{observed:>9} {o.requests:>8} {o.window_s:>5g}s  {o.state}")
    if not reply.objectives:
        lines.append("(no SLA contracts: add [[sla]] tables to the config)")
    lines.append("")
    if not reply.alerts:
        lines.append("no alerts")
    for a in reply.alerts:
        until = f" until {_when(a.ends_at_unix_s)}" if a.state == "resolved" else ""
        lines.append(f"{a.state.upper():<8} {_when(a.starts_at_unix_s)}{until}  [{a.fingerprint}] {a.summary}")
    return "\n".join(lines)


async def fetch(address: str, api_key: str | None = None, ca_file: str | None = None) -> router_pb2.AlertsReply:
    return await call_router(address, "Alerts", router_pb2.AlertsRequest(), api_key, ca_file)


def show(address: str, api_key: str | None = None, ca_file: str | None = None) -> int:
    try:
        print(render(asyncio.run(fetch(address, api_key, ca_file))))
    except grpc.aio.AioRpcError as exc:
        print(f"qos-serve alerts: router {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
