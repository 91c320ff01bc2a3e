"""The one place that maps priority names to the protobuf enum and back."""
from __future__ import annotations

from services.common.proto.qos.v1 import common_pb2

PRIORITY_HEADER = "x-priority"
TENANT_HEADER = "x-tenant"
SLO_HEADER = "x-slo-ms"
LORA_HEADER = "x-lora"

PRIORITIES = {
    "high": common_pb2.PRIORITY_HIGH,
    "medium": common_pb2.PRIORITY_MEDIUM,
    "low": common_pb2.PRIORITY_LOW,
}
NAMES = {value: name for name, value in PRIORITIES.items()}
ORDER = (common_pb2.PRIORITY_HIGH, common_pb2.PRIORITY_MEDIUM, common_pb2.PRIORITY_LOW)
DEFAULT_PRIORITY = common_pb2.PRIORITY_MEDIUM


def parse_priority(value: str | None) -> int:
    """`x-priority` metadata value -> Priority enum; missing means medium.

    Raises ValueError naming the value for anything else."""
    if value is None:
        return DEFAULT_PRIORITY
    try:
        return PRIORITIES[value.strip().lower()]
    except KeyError:
        raise ValueError(f"invalid x-priority {value!r}: use high, medium or low") from None


def priority_name(priority: int) -> str:
    return NAMES.get(priority, "medium")


def parse_slo_ms(value: str | None) -> int:
    """`x-slo-ms` metadata -> milliseconds (0 = none). Raises ValueError naming the value."""
    if value is None:
        return 0
    try:
        slo = int(value)
    except ValueError:
        raise ValueError(f"invalid x-slo-ms {value!r}: a whole number of milliseconds") from None
    if slo <= 0:
        raise ValueError(f"invalid x-slo-ms {value!r}: must be > 0")
    return slo
