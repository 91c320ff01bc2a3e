"""The one definition of the priority classes, and parsing them from what clients send.

`Priority` mirrors the wire enum `qos.v1.Priority` value for value (its values are read from the
generated module, so the two cannot drift), and being an IntEnum it compares equal to the plain
ints protobuf hands out. Everything else (policy, routing, metrics) imports HIGH/MEDIUM/LOW or
ORDER from here.
"""
from __future__ import annotations

from enum import IntEnum

from services.common.proto.qos.v1 import common_pb2

PRIORITY_HEADER = "x-priority"
TENANT_HEADER = "x-tenant"
SLO_HEADER = "x-slo-ms"
LORA_HEADER = "x-lora"
STREAM_INTERVAL_HEADER = "x-stream-interval"
CONTEXT_MODE_HEADER = "x-context-mode"
# x-context-mode values (and the HTTP body's context_mode) -> qos.v1.ContextMode
CONTEXT_MODES = {"auto": common_pb2.CONTEXT_MODE_AUTO, "dense": common_pb2.CONTEXT_MODE_DENSE,
                 "streaming": common_pb2.CONTEXT_MODE_STREAMING}
# Stream intervals go as a uint32; a request that is not streamed asks for the largest, and then
# gets its first token's chunk, one every max hold (the scheduler's stream_max_hold_ms) and the last.
MAX_STREAM_INTERVAL = 2**31 - 1


class Priority(IntEnum):
    HIGH = common_pb2.PRIORITY_HIGH        # real-time chat
    MEDIUM = common_pb2.PRIORITY_MEDIUM    # ordinary API calls
    LOW = common_pb2.PRIORITY_LOW          # batch jobs

    @property
    def label(self) -> str:
        """"high", "medium" or "low": metric labels, config keys, logs."""
        return self.name.lower()


HIGH, MEDIUM, LOW = Priority.HIGH, Priority.MEDIUM, Priority.LOW
ORDER = (HIGH, MEDIUM, LOW)            # most urgent first; also the order of per-class lists
DEFAULT_PRIORITY = MEDIUM
PRIORITIES = {p.label: p for p in ORDER}
LABELS = tuple(PRIORITIES)              # ("high", "medium", "low"): what x-priority and configs say
_LABELS = {int(p): p.label for p in ORDER}


def parse_priority(value: str | None) -> Priority:
    """`x-priority` value -> Priority; missing means medium. Raises ValueError naming the value
    for anything else."""
    if value is None:
        return DEFAULT_PRIORITY
    try:
        return PRIORITIES[value.strip().lower()]
    except KeyError:
        raise ValueError(f"invalid x-priority {value!r}: use high, medium or low") from None


def priority_name(priority: int) -> str:
    """The label of a priority value (a wire int or a Priority); "medium" for anything else."""
    return _LABELS.get(priority, DEFAULT_PRIORITY.label)


def parse_context_mode(value: str | None, name: str = CONTEXT_MODE_HEADER) -> int:
    """`x-context-mode` value -> qos.v1.ContextMode; missing means auto. Raises ValueError naming
    the value for anything else."""
    if value is None:
        return common_pb2.CONTEXT_MODE_AUTO
    try:
        return CONTEXT_MODES[value.strip().lower()]
    except KeyError:
        raise ValueError(f"invalid {name} {value!r}: use auto, dense or streaming") from None


def parse_slo_ms(value: str | None) -> int:
    """`x-slo-ms` metadata -> milliseconds (0 = none). Raises ValueError naming the value."""
    return _positive_whole(value, SLO_HEADER, "milliseconds", 2**32 - 1)


# Tenant names are 1-64 printable characters: the store's tenants and ledger columns hold no more
# (services/store/schema.py), and a name the ledger refuses must never reach its batch.
TENANT_NAME_MAX = 64
# The tenant the admin key's requests are billed to and scoped by (services/control/tenancy.py):
# no tenant of the store and no x-tenant header may take the name, or it would share their
# requests, cache and ledger.
ADMIN_TENANT = "admin"


def parse_tenant(value: str | None) -> str:
    """`x-tenant` metadata -> the tenant it names ("" when absent). Raises ValueError naming the
    header when the name could not be a tenant's."""
    if not value:
        return ""
    if len(value) > TENANT_NAME_MAX:
        raise ValueError(f"{TENANT_HEADER} is {len(value)} characters long; a tenant name has at most "
                         f"{TENANT_NAME_MAX}")
    if not value.isprintable():
        raise ValueError(f"{TENANT_HEADER} {value!r} has a control character; a tenant name is printable text")
    if value == ADMIN_TENANT:
        raise ValueError(f"{TENANT_HEADER} {value!r} is reserved: it names the admin key's requests")
    return value


def parse_stream_interval(value: str | None) -> int:
    """`x-stream-interval` metadata -> tokens per chunk after the first (0 = the pool's setting
    for the request's class). Raises ValueError naming the value."""
    return _positive_whole(value, STREAM_INTERVAL_HEADER, "tokens", MAX_STREAM_INTERVAL)


def _positive_whole(value: str | None, header: str, unit: str, largest: int) -> int:
    if value is None:
        return 0
    digits = value.strip()
    # Plain ASCII digits only: int() would also take "+5", "5_0" and other scripts' digits.
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"invalid {header} {value!r}: a whole number of {unit}")
    number = int(digits)
    if number <= 0:
        raise ValueError(f"invalid {header} {value!r}: must be > 0")
    if number > largest:
        raise ValueError(f"invalid {header} {value!r}: must be at most {largest}")
    return number
