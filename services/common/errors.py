"""One error type for the whole system, and the one table that maps its kinds to statuses.

Code anywhere (the scheduler's admission checks, the batcher, the router's validation and relay,
the worker) raises `ServiceError(kind, message, field=..., retry_after_ms=...)` and never picks a
transport status itself. Each front maps the kind once, at its edge: gRPC in
services/common/grpc_errors.py (an interceptor), HTTP (OpenAI's error shape) from the same table.
Pure Python: no grpc import, so pure scheduling code can raise these.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(slots=True, frozen=True)
class Status:
    grpc: str           # grpc.StatusCode member name
    http: int           # HTTP status code
    http_type: str      # OpenAI's error "type"


class ErrorKind(Enum):
    """What went wrong, from the client's point of view (not where it happened)."""
    INVALID = "invalid_argument"          # the request is malformed; the message names the field
    UNAUTHENTICATED = "unauthenticated"   # no, unknown or revoked credentials
    PERMISSION_DENIED = "permission_denied"  # credentials fine, not allowed to do this
    NOT_FOUND = "not_found"               # names a request (or other thing) the caller cannot see
    UNSUPPORTED = "failed_precondition"   # names a model / adapter no pool here serves
    CONFLICT = "conflict"                 # clashes with the service's state (a second stream)
    TOO_LARGE = "too_large"               # can never fit as configured (KV cap); shrink it
    PAYLOAD_TOO_LARGE = "payload_too_large"  # the request body is over the size limit
    EXHAUSTED = "resource_exhausted"      # a limit is reached now (queue, SLO, rate); retry later
    UNAVAILABLE = "unavailable"           # nothing can serve it now (no worker, draining, failure)
    CANCELLED = "cancelled"               # the client went away
    DEADLINE = "deadline_exceeded"        # the client's deadline passed
    REQUEST_TIMEOUT = "request_timeout"   # the client stopped sending its request (HTTP 408)
    INTERNAL = "internal"                 # a bug on our side

    @property
    def status(self) -> Status:
        return STATUS[self]


# The one kind -> status table. TOO_LARGE stays RESOURCE_EXHAUSTED on gRPC (the documented
# contract since the first release), but it is a 400 on HTTP: retrying the same request will not
# help, so it must not read as a 429.
STATUS: dict[ErrorKind, Status] = {
    ErrorKind.INVALID: Status("INVALID_ARGUMENT", 400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: Status("UNAUTHENTICATED", 401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: Status("PERMISSION_DENIED", 403, "permission_error"),
    ErrorKind.NOT_FOUND: Status("NOT_FOUND", 404, "not_found_error"),
    ErrorKind.UNSUPPORTED: Status("FAILED_PRECONDITION", 404, "not_found_error"),
    ErrorKind.CONFLICT: Status("FAILED_PRECONDITION", 409, "conflict_error"),
    ErrorKind.TOO_LARGE: Status("RESOURCE_EXHAUSTED", 400, "invalid_request_error"),
    ErrorKind.PAYLOAD_TOO_LARGE: Status("RESOURCE_EXHAUSTED", 413, "invalid_request_error"),
    ErrorKind.EXHAUSTED: Status("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: Status("UNAVAILABLE", 503, "service_unavailable"),
    ErrorKind.CANCELLED: Status("CANCELLED", 499, "cancelled"),
    ErrorKind.DEADLINE: Status("DEADLINE_EXCEEDED", 504, "timeout"),
    ErrorKind.REQUEST_TIMEOUT: Status("DEADLINE_EXCEEDED", 408, "invalid_request_error"),
    ErrorKind.INTERNAL: Status("INTERNAL", 500, "server_error"),
}

# Statuses that did not come from one of our services (transport failures: the peer could not be
# reached, the connection broke) back to kinds. A status our services send carries its kind in
# trailing metadata, so it comes back exactly (TOO_LARGE and EXHAUSTED share a gRPC status).
_KIND_OF_GRPC = {status.grpc: kind for kind, status in STATUS.items()
                 if kind not in (ErrorKind.TOO_LARGE, ErrorKind.PAYLOAD_TOO_LARGE, ErrorKind.CONFLICT,
                                 ErrorKind.REQUEST_TIMEOUT)}

# A message as gRPC sends it (grpc-message: printable ASCII as is, every other byte as %XX) must
# fit, with the other trailers, in the 8 KiB of metadata a client takes; past that the client sees
# RESOURCE_EXHAUSTED "received metadata size exceeds ..." instead of our status. Messages that
# quote a request's value (a model name, a role, an id) are cut in the middle to this many bytes.
MESSAGE_WIRE_BYTES = 2048

RETRY_AFTER_TRAILER = "retry-after-ms"
KIND_TRAILER = "qos-error-kind"
FIELD_TRAILER = "qos-error-field"
REASON_TRAILER = "qos-error-reason"


class ServiceError(Exception):
    """A request that cannot be served, and why.

    `field` names the offending request field (or header) where there is one: HTTP reports it as
    `param`. `retry_after_ms` says when trying again may succeed (limits that pass, draining);
    None where retrying the same request cannot help. `reason` is the short label counted in
    metrics (`qos_rejections_total{reason}`), the kind's name unless given."""

    def __init__(self, kind: ErrorKind, message: str, *, field: str | None = None,
                 retry_after_ms: int | None = None, reason: str | None = None):
        message = bounded(message)
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = None if field is None else bounded(field, MESSAGE_WIRE_BYTES // 8)
        self.retry_after_ms = retry_after_ms
        self.reason = reason or kind.value

    def __repr__(self) -> str:
        return f"ServiceError({self.kind.name}, {self.message!r})"

    @property
    def retry_after_seconds(self) -> int | None:
        """For HTTP's Retry-After header, which counts whole seconds (rounded up)."""
        return None if self.retry_after_ms is None else max(1, -(-self.retry_after_ms // 1000))

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent with the status: when to retry, and (for our own services up the line)
        the exact kind, the metric reason and the field."""
        out = [(KIND_TRAILER, self.kind.value), (REASON_TRAILER, self.reason)]
        if self.field:
            out.append((FIELD_TRAILER, self.field))
        if self.retry_after_ms is not None:
            out.append((RETRY_AFTER_TRAILER, str(self.retry_after_ms)))
        return tuple(out)

    @classmethod
    def from_trailers(cls, message: str, trailers: dict[str, str]) -> ServiceError | None:
        """The ServiceError one of our services sent with this status, or None if the status did
        not come from one (no kind trailer)."""
        try:
            kind = ErrorKind(trailers[KIND_TRAILER])
        except (KeyError, ValueError):
            return None
        retry = trailers.get(RETRY_AFTER_TRAILER, "")
        return cls(kind, message, field=trailers.get(FIELD_TRAILER) or None,
                   retry_after_ms=int(retry) if retry.isdigit() else None,
                   reason=trailers.get(REASON_TRAILER) or None)


def _wire_bytes(char: str) -> int:
    return 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "surrogatepass"))


def bounded(text: str, limit: int = MESSAGE_WIRE_BYTES) -> str:
    """`text` as is when it takes at most `limit` bytes on the wire (MESSAGE_WIRE_BYTES), else its
    start and end with the middle cut: the start says what went wrong, the end what to do."""
    if len(text) * 12 <= limit or sum(map(_wire_bytes, text)) <= limit:   # 12: the most one character takes
        return text
    half = (limit - 40) // 2
    head, used = 0, 0
    while used + _wire_bytes(text[head]) <= half:
        used += _wire_bytes(text[head])
        head += 1
    tail, used = len(text), 0
    while used + _wire_bytes(text[tail - 1]) <= half:
        tail -= 1
        used += _wire_bytes(text[tail])
    return f"{text[:head]} [... {tail - head} characters cut ...] {text[tail:]}"


def kind_of_transport_status(name: str) -> ErrorKind:
    """The kind of a gRPC status that no service of ours chose (UNKNOWN etc. -> INTERNAL)."""
    return _KIND_OF_GRPC.get(name, ErrorKind.INTERNAL)


def invalid(message: str, field: str | None = None) -> ServiceError:
    return ServiceError(ErrorKind.INVALID, message, field=field, reason="invalid_argument")


def unavailable(message: str, retry_after_ms: int | None = None, reason: str = "unavailable") -> ServiceError:
    return ServiceError(ErrorKind.UNAVAILABLE, message, retry_after_ms=retry_after_ms, reason=reason)
