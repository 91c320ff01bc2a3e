from services.common.proto.qos.v1 import common_pb2 as _common_pb2
from services.common.proto.qos.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AlertsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlaObjectiveState(_message.Message):
    __slots__ = ("priority", "tenant", "objective", "target", "observed", "has_verdict", "requests", "state", "window_s", "for_seconds")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    HAS_VERDICT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    FOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    priority: _common_pb2.Priority
    tenant: str
    objective: str
    target: float
    observed: float
    has_verdict: bool
    requests: int
    state: str
    window_s: float
    for_seconds: float
    def __init__(self, priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., tenant: _Optional[str] = ..., objective: _Optional[str] = ..., target: _Optional[float] = ..., observed: _Optional[float] = ..., has_verdict: _Optional[bool] = ..., requests: _Optional[int] = ..., state: _Optional[str] = ..., window_s: _Optional[float] = ..., for_seconds: _Optional[float] = ...) -> None: ...

class SlaAlert(_message.Message):
    __slots__ = ("fingerprint", "state", "priority", "tenant", "objective", "target", "observed", "starts_at_unix_s", "ends_at_unix_s", "summary", "breach_since_unix_s")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    STARTS_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ENDS_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    BREACH_SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    state: str
    priority: _common_pb2.Priority
    tenant: str
    objective: str
    target: float
    observed: float
    starts_at_unix_s: float
    ends_at_unix_s: float
    summary: str
    breach_since_unix_s: float
    def __init__(self, fingerprint: _Optional[str] = ..., state: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., tenant: _Optional[str] = ..., objective: _Optional[str] = ..., target: _Optional[float] = ..., observed: _Optional[float] = ..., starts_at_unix_s: _Optional[float] = ..., ends_at_unix_s: _Optional[float] = ..., summary: _Optional[str] = ..., breach_since_unix_s: _Optional[float] = ...) -> None: ...

class AlertsReply(_message.Message):
    __slots__ = ("objectives", "alerts")
    OBJECTIVES_FIELD_NUMBER: _ClassVar[int]
    ALERTS_FIELD_NUMBER: _ClassVar[int]
    objectives: _containers.RepeatedCompositeFieldContainer[SlaObjectiveState]
    alerts: _containers.RepeatedCompositeFieldContainer[SlaAlert]
    def __init__(self, objectives: _Optional[_Iterable[_Union[SlaObjectiveState, _Mapping]]] = ..., alerts: _Optional[_Iterable[_Union[SlaAlert, _Mapping]]] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("tenant", "since_unix_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    since_unix_s: float
    def __init__(self, tenant: _Optional[str] = ..., since_unix_s: _Optional[float] = ...) -> None: ...

class UsageLine(_message.Message):
    __slots__ = ("tenant", "priority", "requests", "prompt_tokens", "completion_tokens", "amount")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    priority: _common_pb2.Priority
    requests: int
    prompt_tokens: int
    completion_tokens: int
    amount: float
    def __init__(self, tenant: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., amount: _Optional[float] = ...) -> None: ...

class UsageReply(_message.Message):
    __slots__ = ("tenant", "lines", "requests", "prompt_tokens", "completion_tokens", "amount", "in_flight", "storage_bytes", "storage_limit_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    lines: _containers.RepeatedCompositeFieldContainer[UsageLine]
    requests: int
    prompt_tokens: int
    completion_tokens: int
    amount: float
    in_flight: int
    storage_bytes: int
    storage_limit_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., lines: _Optional[_Iterable[_Union[UsageLine, _Mapping]]] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., amount: _Optional[float] = ..., in_flight: _Optional[int] = ..., storage_bytes: _Optional[int] = ..., storage_limit_bytes: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("request_id", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "sampling", "model", "cache_salt", "tools", "tool_choice", "prompt_token_ids", "chat_template")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    sampling: _common_pb2.SamplingParams
    model: str
    cache_salt: str
    tools: str
    tool_choice: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: _common_pb2.ChatTemplateOptions
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[_Union[_common_pb2.ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class GenerateRequestBytes(_message.Message):
    __slots__ = ("prompt", "messages", "sampling", "model", "cache_salt", "tools", "tool_choice", "prompt_token_ids", "chat_template")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    prompt: bytes
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessageBytes]
    sampling: _common_pb2.SamplingParams
    model: bytes
    cache_salt: bytes
    tools: bytes
    tool_choice: bytes
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: ChatTemplateOptionsBytes
    def __init__(self, prompt: _Optional[bytes] = ..., messages: _Optional[_Iterable[_Union[ChatMessageBytes, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ..., tools: _Optional[bytes] = ..., tool_choice: _Optional[bytes] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[_Union[ChatTemplateOptionsBytes, _Mapping]] = ...) -> None: ...

class ChatTemplateOptionsBytes(_message.Message):
    __slots__ = ("add_generation_prompt", "continue_final_message", "kwargs_json")
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs_json: bytes
    def __init__(self, add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., kwargs_json: _Optional[bytes] = ...) -> None: ...

class ChatMessageBytes(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: bytes
    content: bytes
    tool_calls: bytes
    tool_call_id: bytes
    def __init__(self, role: _Optional[bytes] = ..., content: _Optional[bytes] = ..., tool_calls: _Optional[bytes] = ..., tool_call_id: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PriorityStats(_message.Message):
    __slots__ = ("priority", "requests", "completed", "failed", "cancelled", "output_tokens", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p95_ms", "e2e_p99_ms", "cost_units")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_P50_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_P95_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_P99_MS_FIELD_NUMBER: _ClassVar[int]
    COST_UNITS_FIELD_NUMBER: _ClassVar[int]
    priority: _common_pb2.Priority
    requests: int
    completed: int
    failed: int
    cancelled: int
    output_tokens: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p95_ms: float
    e2e_p99_ms: float
    cost_units: float
    def __init__(self, priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., requests: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., cancelled: _Optional[int] = ..., output_tokens: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p95_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., e2e_p50_ms: _Optional[float] = ..., e2e_p95_ms: _Optional[float] = ..., e2e_p99_ms: _Optional[float] = ..., cost_units: _Optional[float] = ...) -> None: ...

class GroupStats(_message.Message):
    __slots__ = ("name", "requests", "completed", "failed", "output_tokens", "cost_units", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_UNITS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_P99_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: int
    completed: int
    failed: int
    output_tokens: int
    cost_units: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cost_units: _Optional[float] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., e2e_p99_ms: _Optional[float] = ...) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("priorities", "pools", "by_pool", "by_tenant", "overflow_threshold", "migrations")
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    BY_POOL_FIELD_NUMBER: _ClassVar[int]
    BY_TENANT_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    priorities: _containers.RepeatedCompositeFieldContainer[PriorityStats]
    pools: _containers.RepeatedCompositeFieldContainer[_scheduler_pb2.PoolStats]
    by_pool: _containers.RepeatedCompositeFieldContainer[GroupStats]
    by_tenant: _containers.RepeatedCompositeFieldContainer[GroupStats]
    overflow_threshold: float
    migrations: int
    def __init__(self, priorities: _Optional[_Iterable[_Union[PriorityStats, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[_scheduler_pb2.PoolStats, _Mapping]]] = ..., by_pool: _Optional[_Iterable[_Union[GroupStats, _Mapping]]] = ..., by_tenant: _Optional[_Iterable[_Union[GroupStats, _Mapping]]] = ..., overflow_threshold: _Optional[float] = ..., migrations: _Optional[int] = ...) -> None: ...
