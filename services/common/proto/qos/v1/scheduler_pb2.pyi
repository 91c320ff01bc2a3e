from services.common.proto.qos.v1 import common_pb2 as _common_pb2
from services.common.proto.qos.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "add_special_tokens", "return_token_strs", "chat_template")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    add_special_tokens: bool
    return_token_strs: bool
    chat_template: _common_pb2.ChatTemplateOptions
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ..., chat_template: _Optional[_Union[_common_pb2.ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class TokenizeReply(_message.Message):
    __slots__ = ("token_ids", "max_model_len", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeReply(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("pool", "known")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    pool: str
    known: bool
    def __init__(self, pool: _Optional[str] = ..., known: _Optional[bool] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "priority", "tenant", "prompt", "messages", "sampling", "slo_ms", "lora", "resume_token_ids", "tenant_weight", "stream_interval", "context_mode", "cache_scope", "tools", "tool_choice", "prompt_token_ids", "chat_template")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_MODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    priority: _common_pb2.Priority
    tenant: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    sampling: _common_pb2.SamplingParams
    slo_ms: int
    lora: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant_weight: float
    stream_interval: int
    context_mode: _common_pb2.ContextMode
    cache_scope: str
    tools: str
    tool_choice: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: _common_pb2.ChatTemplateOptions
    def __init__(self, request_id: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., tenant: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., slo_ms: _Optional[int] = ..., lora: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., tenant_weight: _Optional[float] = ..., stream_interval: _Optional[int] = ..., context_mode: _Optional[_Union[_common_pb2.ContextMode, str]] = ..., cache_scope: _Optional[str] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[_Union[_common_pb2.ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("submits", "cancels")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[LinkSubmit]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, submits: _Optional[_Iterable[_Union[LinkSubmit, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkSubmit(_message.Message):
    __slots__ = ("key", "submit", "traceparent")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    key: int
    submit: SubmitRequest
    traceparent: str
    def __init__(self, key: _Optional[int] = ..., submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LinkEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[LinkEvent, _Mapping]]] = ...) -> None: ...

class LinkEvent(_message.Message):
    __slots__ = ("key", "chunk", "error")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    key: int
    chunk: _common_pb2.GenerateChunk
    error: LinkError
    def __init__(self, key: _Optional[int] = ..., chunk: _Optional[_Union[_common_pb2.GenerateChunk, _Mapping]] = ..., error: _Optional[_Union[LinkError, _Mapping]] = ...) -> None: ...

class LinkError(_message.Message):
    __slots__ = ("status", "message", "trailers")
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    status: str
    message: str
    trailers: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[str] = ..., message: _Optional[str] = ..., trailers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PoolStatsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class ClassStats(_message.Message):
    __slots__ = ("priority", "waiting", "running", "kv_blocks", "output_tokens", "weight", "kv_cap", "served_tokens", "kv_blocks_peak", "rejected", "preempted", "recomputed_tokens", "waiting_tokens", "cache_queried_tokens", "cache_hit_tokens", "cache_evictions", "cache_idle_blocks")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_CAP_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PEAK_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_IDLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    priority: _common_pb2.Priority
    waiting: int
    running: int
    kv_blocks: int
    output_tokens: int
    weight: float
    kv_cap: float
    served_tokens: int
    kv_blocks_peak: int
    rejected: int
    preempted: int
    recomputed_tokens: int
    waiting_tokens: int
    cache_queried_tokens: int
    cache_hit_tokens: int
    cache_evictions: int
    cache_idle_blocks: int
    def __init__(self, priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., output_tokens: _Optional[int] = ..., weight: _Optional[float] = ..., kv_cap: _Optional[float] = ..., served_tokens: _Optional[int] = ..., kv_blocks_peak: _Optional[int] = ..., rejected: _Optional[int] = ..., preempted: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., cache_queried_tokens: _Optional[int] = ..., cache_hit_tokens: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., cache_idle_blocks: _Optional[int] = ...) -> None: ...

class WeightChange(_message.Message):
    __slots__ = ("at_unix_s", "priority", "old_weight", "new_weight", "utilization", "free_kv")
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OLD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NEW_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_FIELD_NUMBER: _ClassVar[int]
    at_unix_s: float
    priority: _common_pb2.Priority
    old_weight: float
    new_weight: float
    utilization: float
    free_kv: float
    def __init__(self, at_unix_s: _Optional[float] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., old_weight: _Optional[float] = ..., new_weight: _Optional[float] = ..., utilization: _Optional[float] = ..., free_kv: _Optional[float] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool", "model", "device", "workers", "max_context", "kv_blocks_total", "kv_blocks_used", "block_size", "classes", "steps", "policy", "preemptions", "utilization", "weight_changes", "ttft_p90_ms", "draining", "workers_draining", "failovers", "members", "desired_workers", "min_workers", "max_workers", "scale_reason", "adapters", "step_seconds", "worker_steps", "step_tokens", "max_step_tokens", "max_running", "step_kv_tokens", "finished", "cut_ins")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SCALE_REASON_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    STEP_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CUT_INS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    model: str
    device: str
    workers: int
    max_context: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    classes: _containers.RepeatedCompositeFieldContainer[ClassStats]
    steps: int
    policy: str
    preemptions: int
    utilization: float
    weight_changes: _containers.RepeatedCompositeFieldContainer[WeightChange]
    ttft_p90_ms: float
    draining: bool
    workers_draining: int
    failovers: int
    members: _containers.RepeatedCompositeFieldContainer[WorkerState]
    desired_workers: int
    min_workers: int
    max_workers: int
    scale_reason: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    step_seconds: float
    worker_steps: int
    step_tokens: int
    max_step_tokens: int
    max_running: int
    step_kv_tokens: int
    finished: int
    cut_ins: int
    def __init__(self, pool: _Optional[str] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., workers: _Optional[int] = ..., max_context: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., block_size: _Optional[int] = ..., classes: _Optional[_Iterable[_Union[ClassStats, _Mapping]]] = ..., steps: _Optional[int] = ..., policy: _Optional[str] = ..., preemptions: _Optional[int] = ..., utilization: _Optional[float] = ..., weight_changes: _Optional[_Iterable[_Union[WeightChange, _Mapping]]] = ..., ttft_p90_ms: _Optional[float] = ..., draining: _Optional[bool] = ..., workers_draining: _Optional[int] = ..., failovers: _Optional[int] = ..., members: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., desired_workers: _Optional[int] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., scale_reason: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., step_seconds: _Optional[float] = ..., worker_steps: _Optional[int] = ..., step_tokens: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., max_running: _Optional[int] = ..., step_kv_tokens: _Optional[int] = ..., finished: _Optional[int] = ..., cut_ins: _Optional[int] = ...) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("address", "connected", "draining", "running", "kv_blocks_total", "kv_blocks_used", "admitted", "dtype")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    address: str
    connected: bool
    draining: bool
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    admitted: int
    dtype: str
    def __init__(self, address: _Optional[str] = ..., connected: _Optional[bool] = ..., draining: _Optional[bool] = ..., running: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., admitted: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class AdaptersReply(_message.Message):
    __slots__ = ("pool", "adapters", "missing_on")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MISSING_ON_FIELD_NUMBER: _ClassVar[int]
    pool: str
    adapters: _containers.RepeatedCompositeFieldContainer[_worker_pb2.AdapterInfo]
    missing_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[_worker_pb2.AdapterInfo, _Mapping]]] = ..., missing_on: _Optional[_Iterable[str]] = ...) -> None: ...
