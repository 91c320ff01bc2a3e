from services.common.proto.qos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterReply(_message.Message):
    __slots__ = ("adapter", "dropped")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ..., dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("active_sequences",)
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    active_sequences: int
    def __init__(self, active_sequences: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("device", "device_type", "dtype", "model", "block_size", "num_blocks", "bytes_per_block", "max_context", "vocab_size", "eos_token_ids", "active_sequences", "threads", "device_name", "draining", "adapters", "max_loras", "kv_tier_blocks", "kv_tier_load_us_per_block")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_US_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    device: str
    device_type: str
    dtype: str
    model: str
    block_size: int
    num_blocks: int
    bytes_per_block: int
    max_context: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    active_sequences: int
    threads: int
    device_name: str
    draining: bool
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loras: int
    kv_tier_blocks: int
    kv_tier_load_us_per_block: float
    def __init__(self, device: _Optional[str] = ..., device_type: _Optional[str] = ..., dtype: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., active_sequences: _Optional[int] = ..., threads: _Optional[int] = ..., device_name: _Optional[str] = ..., draining: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., kv_tier_blocks: _Optional[int] = ..., kv_tier_load_us_per_block: _Optional[float] = ...) -> None: ...

class EngineSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs", "json_schema", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "prompt_logprobs", "regex", "choice", "grammar", "allowed_token_ids", "bad_words", "typical_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    json_schema: str
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    prompt_logprobs: int
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    typical_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., typical_p: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "sampling", "num_generated", "traceparent", "lora", "cached_tokens", "sink_tokens", "window_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: EngineSampling
    num_generated: int
    traceparent: str
    lora: str
    cached_tokens: int
    sink_tokens: int
    window_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[EngineSampling, _Mapping]] = ..., num_generated: _Optional[int] = ..., traceparent: _Optional[str] = ..., lora: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_sequences", "scheduled_seq_ids", "scheduled_num_tokens", "granted_seq_ids", "granted_block_ids", "released_seq_ids", "cut_in", "packed_results", "dropped_seq_ids", "dropped_block_counts", "tier_block_ids", "tier_slots", "tier_loads")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CUT_IN_FIELD_NUMBER: _ClassVar[int]
    PACKED_RESULTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    scheduled_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    granted_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    granted_block_ids: _containers.RepeatedScalarFieldContainer[int]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    cut_in: bool
    packed_results: bool
    dropped_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    dropped_block_counts: _containers.RepeatedScalarFieldContainer[int]
    tier_block_ids: _containers.RepeatedScalarFieldContainer[int]
    tier_slots: _containers.RepeatedScalarFieldContainer[int]
    tier_loads: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled_seq_ids: _Optional[_Iterable[int]] = ..., scheduled_num_tokens: _Optional[_Iterable[int]] = ..., granted_seq_ids: _Optional[_Iterable[int]] = ..., granted_block_ids: _Optional[_Iterable[int]] = ..., released_seq_ids: _Optional[_Iterable[int]] = ..., cut_in: _Optional[bool] = ..., packed_results: _Optional[bool] = ..., dropped_seq_ids: _Optional[_Iterable[int]] = ..., dropped_block_counts: _Optional[_Iterable[int]] = ..., tier_block_ids: _Optional[_Iterable[int]] = ..., tier_slots: _Optional[_Iterable[int]] = ..., tier_loads: _Optional[_Iterable[bool]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "finish_reason")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    finish_reason: _common_pb2.FinishReason
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class DeviceStats(_message.Message):
    __slots__ = ("memory_used_bytes", "memory_total_bytes", "utilization", "device_utilization")
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float
    device_utilization: float
    def __init__(self, memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., device_utilization: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "tokens", "forward_ms", "device", "error", "draining", "sampled_seq_ids", "sampled_token_ids", "ended_seq_ids", "ended_reasons", "logprob_seq_ids", "token_logprobs", "top_logprob_counts", "top_token_ids", "top_logprobs", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_REASONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_ms: float
    device: DeviceStats
    error: str
    draining: bool
    sampled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ended_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    ended_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    logprob_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprob_counts: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., device: _Optional[_Union[DeviceStats, _Mapping]] = ..., error: _Optional[str] = ..., draining: _Optional[bool] = ..., sampled_seq_ids: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., ended_seq_ids: _Optional[_Iterable[int]] = ..., ended_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., logprob_seq_ids: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., top_logprob_counts: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "entries")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
