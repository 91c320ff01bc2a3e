"""Which requests streaming mode serves and how admission checks them
(services/scheduler/long_context.py, services/scheduler/admission.py), and the x-context-mode
header and context_mode body field on the fronts. Pure Python."""
from __future__ import annotations

import pytest

from services.common.config import SchedulerConfig
from services.common.errors import ErrorKind, ServiceError
from services.common.priority import HIGH, LOW, MEDIUM, parse_context_mode
from services.common.proto.qos.v1 import common_pb2
from services.common.stream_window import StreamWindow
from services.router.openai_api.request import CHAT, parse_openai
from services.router.validation import parse_head
from services.scheduler.admission import Admission, PoolLimits
from services.scheduler.long_context import StreamSettings, choose_window

AUTO, DENSE, STREAMING = (common_pb2.CONTEXT_MODE_AUTO, common_pb2.CONTEXT_MODE_DENSE,
                          common_pb2.CONTEXT_MODE_STREAMING)
LIMITS = PoolLimits(max_context=1000, block_size=16, largest_worker_blocks=1000)
SETTINGS = StreamSettings({HIGH: "refuse", MEDIUM: "refuse", LOW: "stream"}, StreamWindow(4, 500),
                          chunk_tokens=100, max_tokens=50_000)
CAPS = {HIGH: 1.0, MEDIUM: 0.7, LOW: 0.3}


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


def window(mode, priority, prompt_len, settings=SETTINGS, **fields):
    return choose_window(mode, priority, prompt_len, sampling(**fields), LIMITS.max_context,
                         LIMITS.block_size, settings)


def admission() -> Admission:
    return Admission("cpu", CAPS.__getitem__, lambda _p: 0, lambda *_: 0.0, max_queue=8,
                     retry_after_ms=750, streaming=SETTINGS)


def test_auto_streams_only_long_requests_of_classes_that_stream():
    assert window(AUTO, LOW, 999) is None                          # fits: dense
    assert window(AUTO, LOW, 1000) == SETTINGS.window              # the prompt alone passes the context
    assert window(AUTO, LOW, 600, max_tokens=401) == SETTINGS.window
    assert window(AUTO, LOW, 600, max_tokens=400) is None
    assert window(AUTO, HIGH, 5000) is None                        # High refuses (admission says so)
    assert window(DENSE, LOW, 5000) is None
    assert window(STREAMING, HIGH, 10) == SETTINGS.window          # asked for: any class, any length


def test_a_window_the_workers_cannot_serve_is_refused_precisely():
    wide = StreamSettings(SETTINGS.long_prompts, StreamWindow(4, 1000), 100, 50_000)
    with pytest.raises(ServiceError) as caught:
        window(STREAMING, LOW, 10, settings=wide)
    assert caught.value.kind is ErrorKind.UNSUPPORTED and caught.value.field == "x-context-mode"
    assert "exceeds the model's context window of 1000" in caught.value.message
    many_sinks = StreamSettings(SETTINGS.long_prompts, StreamWindow(32, 500), 100, 50_000)
    with pytest.raises(ServiceError, match="must fit the first KV block"):
        window(STREAMING, LOW, 10, settings=many_sinks)


def test_streaming_admission_counts_the_window_not_the_document():
    """A 32K-token document on a 1,000-token model: admitted for Low, whose cap (300 blocks of
    16) holds its window's bound, not the 2,000 blocks its whole text would take."""
    got = admission().check(LOW, [1] * 32_000, sampling(max_tokens=500), 0, LIMITS, SETTINGS.window)
    assert got.max_tokens == 500
    assert admission().check(LOW, [1] * 32_000, sampling(), 0, LIMITS, SETTINGS.window).max_tokens == 256
    with pytest.raises(ServiceError) as caught:
        admission().check(LOW, [1] * 49_900, sampling(max_tokens=200), 0, LIMITS, SETTINGS.window)
    assert caught.value.field == "sampling.max_tokens" and "stream_max_tokens" in caught.value.message


def test_a_long_dense_request_is_told_about_streaming_mode():
    with pytest.raises(ServiceError) as caught:
        admission().check(HIGH, [1] * 1200, sampling(), 0, LIMITS)
    assert caught.value.kind is ErrorKind.INVALID and caught.value.field == "prompt"
    assert "context window is 1000 tokens" in caught.value.message
    assert "x-context-mode: streaming" in caught.value.message


def test_the_config_defaults_stream_low_only():
    settings = StreamSettings.from_config(SchedulerConfig())
    assert settings.long_prompts == {HIGH: "refuse", MEDIUM: "refuse", LOW: "stream"}
    assert settings.window == StreamWindow(4, 2048)


def test_the_fronts_take_the_mode():
    assert parse_head({"x-context-mode": "Streaming"}).context_mode == STREAMING
    assert parse_head({}).context_mode == AUTO
    with pytest.raises(ServiceError, match="use auto, dense or streaming"):
        parse_head({"x-context-mode": "sliding"})
    assert parse_context_mode("dense") == DENSE
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "context_mode": "streaming"}'
    assert parse_openai(CHAT, body).context_mode == "streaming"
    with pytest.raises(ServiceError) as caught:
        parse_openai(CHAT, body.replace(b'"streaming"', b'"everything"'))
    assert caught.value.field == "context_mode"
    with pytest.raises(ServiceError, match="context_mode must be a string"):
        parse_openai(CHAT, body.replace(b'"streaming"', b'3'))
