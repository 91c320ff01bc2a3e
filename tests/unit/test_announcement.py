"""What a step plan tells the worker of a sequence it admits (services/scheduler/announcement.py):
everything the request knows, whether it is new, preempted after some output, or resumed."""
from __future__ import annotations

from services.common.priority import HIGH
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import SamplingParams
from services.scheduler.announcement import announce
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.request import Request


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def make_request(prompt: list[int]) -> Request:
    return Request(request_id="r1", seq_id=7, priority=HIGH, tenant="acme", prompt_ids=prompt,
                   sampling=SamplingParams(temperature=0.5, top_k=4, seed=11, max_tokens=9),
                   detokenizer=IncrementalDetokenizer(NoText(), prompt), lora="tone",
                   traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


def test_a_new_sequence_is_told_its_prompt_sampling_trace_and_adapter():
    request = make_request([5, 6, 7])
    plan = worker_pb2.StepPlan(step_id=1)
    announce(plan, request)
    (new,) = plan.new_sequences
    assert (new.seq_id, list(new.prompt_token_ids), new.num_generated) == (7, [5, 6, 7], 0)
    assert (new.sampling.temperature, new.sampling.top_k, new.sampling.seed, new.sampling.max_tokens) == \
        (0.5, 4, 11, 9)
    assert (new.traceparent, new.lora) == (request.traceparent, "tone")


def test_each_announcement_after_a_preemption_carries_the_output_so_far_once():
    # The prompt's message is made once and copied into each plan: what one plan adds to its copy
    # (the output so far) must not reach the next plan's.
    request = make_request([5, 6, 7])
    first = worker_pb2.StepPlan(step_id=1)
    announce(first, request)
    for token in (40, 41):
        request.add_output(token)
    again = worker_pb2.StepPlan(step_id=2)
    announce(again, request)
    request.add_output(42)
    third = worker_pb2.StepPlan(step_id=3)
    announce(third, request)
    assert list(first.new_sequences[0].prompt_token_ids) == [5, 6, 7]
    assert (list(again.new_sequences[0].prompt_token_ids), again.new_sequences[0].num_generated) == \
        ([5, 6, 7, 40, 41], 2)
    assert (list(third.new_sequences[0].prompt_token_ids), third.new_sequences[0].num_generated) == \
        ([5, 6, 7, 40, 41, 42], 3)


def test_a_request_resumed_from_another_pool_announces_what_that_pool_streamed():
    request = make_request([5, 6, 7])
    request.set_output([50, 51])          # services/scheduler/server.py resume()
    plan = worker_pb2.StepPlan(step_id=1)
    announce(plan, request)
    (new,) = plan.new_sequences
    assert (list(new.prompt_token_ids), new.num_generated) == ([5, 6, 7, 50, 51], 2)
