"""Which class an OpenAI request body asks for, and how it squares with the x-priority header.
Pure.

    service_tier    OpenAI's: "priority" -> High, "default" or "auto" -> Medium, "flex" -> Low
    priority        vLLM's integer (lower is served sooner, 0 by default): only its sign carries over

Both sent, they must name the same class; the header, when sent too, must agree (a 400 naming the
body's field). Every response echoes the class served as `service_tier` (TIER_OF).
"""
from __future__ import annotations

from services.common.errors import invalid
from services.common.priority import HIGH, LOW, MEDIUM, Priority, parse_priority
from services.router.openai_api.json_fields import json_kind, text_field

TIERS = {"priority": HIGH, "default": MEDIUM, "auto": MEDIUM, "flex": LOW}
TIER_OF = {HIGH: "priority", MEDIUM: "default", LOW: "flex"}
MAX_INT64 = 2**63 - 1


def class_of_priority(priority: int) -> Priority | None:
    """vLLM's `priority` -> our class. vLLM orders requests by it (lower sooner, 0 by default)
    but gives it no scale, so only its sign carries over: below 0 High, above 0 Low; 0, vLLM's
    default, asks for nothing (Medium unless service_tier or x-priority says otherwise)."""
    return HIGH if priority < 0 else LOW if priority > 0 else None


def body_class(body: dict) -> tuple[str, Priority] | None:
    """(the field that named it, the class) from service_tier and priority; None: neither names
    one. Both sent, they must name the same one."""
    asked = []
    tier = body.get("service_tier")
    if tier is not None:
        if text_field(tier, "service_tier") not in TIERS:
            raise invalid(f"service_tier must be one of {', '.join(TIERS)}, got {tier!r}", "service_tier")
        asked.append(("service_tier", TIERS[tier]))
    value = body.get("priority")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"priority must be an integer, got {json_kind(value)}", "priority")
        if not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise invalid(f"priority must be in {-MAX_INT64 - 1}..{MAX_INT64}, got {value}", "priority")
        if (priority := class_of_priority(value)) is not None:
            asked.append(("priority", priority))
    if len({p for _, p in asked}) > 1:
        raise invalid(f"priority {value} asks for {asked[1][1].label} and service_tier "
                      f"{tier!r} for {asked[0][1].label}: send one of them", "priority")
    return asked[-1] if asked else None


def class_header(request, header: str | None) -> str | None:
    """The x-priority value a request (an OpenAIRequest) goes on with: the header's or the body's
    class, which must agree when both are sent (a 400 naming the body's field). None: neither
    names one. A header that is no class is passed on as it is, to be refused by name where
    headers are read."""
    if request.tier is None:
        return header
    if header is None:
        return request.tier.label
    try:
        sent = parse_priority(header)
    except ValueError:
        return header
    if sent != request.tier:
        raise invalid(f"{request.tier_field} asks for {request.tier.label} and the x-priority header "
                      f"for {sent.label}: send one of them", request.tier_field)
    return header
