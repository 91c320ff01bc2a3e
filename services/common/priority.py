"""The one place that maps priority names to the protobuf enum and back."""
from __future__ import annotations

from services.common.proto.qos.v1 import common_pb2

PRIORITY_HEADER = "x-priority"
TENANT_HEADER = "x-tenant"
REQUEST_ID_HEADER = "x-request-id"

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
