"""Kept Responses API answers: the store's rows (services/store/response_store.py) on SQLite and
PostgreSQL, each tenant's own and gone at expiry; a body continuing a kept response
(previous_response_id: its input and output before the new input, its instructions not), the
conversation's items as kept; what an answer keeps, and when; a background response's run on a
stub request path (kept as it goes, refused, cancelled here or elsewhere, stopped)."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import text

from services.common.config_file import ConfigError, parse_config
from services.common.drain import Drain
from services.common.errors import ErrorKind, ServiceError
from services.common.priority import LOW, MEDIUM
from services.common.proto.qos.v1 import common_pb2
from services.common.responses_config import ResponsesConfig
from services.control.tenancy import Caller
from services.router.openai_api.item_pages import item_page, listed
from services.router.openai_api.responses_background import BackgroundResponses
from services.router.openai_api.responses_output import ResponsesAnswer
from services.router.openai_api.responses_request import parse_responses, parse_responses_body, previous_id
from services.router.openai_api.responses_stream import stored_tail
from services.router.validation import RequestHead
from services.store.conversation_store import ConversationStore
from services.store.response_store import MAX_RUNS, ResponseStore
from services.store.store import Store, Tenant

KEEPING = ResponsesConfig()


@pytest.fixture
def kept(url):
    store = Store(url)
    with store.engine.begin() as db:
        db.execute(text("DELETE FROM responses"))
    yield ResponseStore(store)
    store.close()


def response(rid: str, previous: str | None = None) -> dict:
    return {"id": rid, "object": "response", "status": "completed", "previous_response_id": previous,
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "Hello there.", "annotations": [],
                                     "logprobs": [{"token": "Hello", "logprob": -0.1}]}]}]}


USER = {"id": "msg_u1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}


def test_a_kept_response_is_its_tenants_until_it_expires(kept):
    kept.add("alpha", response("resp_1"), [USER], now=100.0, expires_at=200.0)
    assert kept.get("alpha", "resp_1", now=150.0) == (response("resp_1"), [USER])
    assert kept.get(None, "resp_1", now=150.0) is not None             # the admin's view: every tenant's
    assert kept.get("beta", "resp_1", now=150.0) is None               # another tenant's is no id at all
    assert not kept.delete("beta", "resp_1", now=150.0)
    assert kept.get("alpha", "resp_1", now=200.0) is None              # expired: gone for every reader
    assert not kept.delete("alpha", "resp_1", now=200.0)
    kept.add("alpha", response("resp_2"), [USER], now=100.0, expires_at=300.0)
    assert kept.purge(now=250.0) == 1                                   # resp_1's row, not resp_2's
    assert kept.delete("alpha", "resp_2", now=250.0) and kept.get("alpha", "resp_2", now=250.0) is None
    for bad in ("resp_\x00", "r" * 65, ""):                            # no row can have it (a NUL: PostgreSQL's error)
        assert kept.get(None, bad, now=250.0) is None and kept.cancel(None, bad, now=250.0) is None
        assert not kept.delete(None, bad, now=250.0)


def test_a_chain_is_read_along_its_links_each_turn_stored_once(kept):
    first, second = response("resp_a"), response("resp_b", previous="resp_a")
    then = {**USER, "id": "msg_u2"}
    kept.add("alpha", first, [USER], now=100.0, expires_at=300.0)
    kept.add("alpha", second, [then], now=110.0, expires_at=400.0)
    kept.add("alpha", response("resp_c", previous="resp_b"), [{**USER, "id": "msg_u3"}], now=120.0, expires_at=500.0)
    _, items = kept.get("alpha", "resp_c", now=150.0)
    assert [i["id"] for i in items] == ["msg_u1", "msg_resp_a", "msg_u2", "msg_resp_b", "msg_u3"]
    with kept.engine.connect() as db:        # each row holds its own input only
        assert [json.loads(r[0]) for r in db.execute(text("SELECT input_items FROM responses ORDER BY id"))] \
            == [[USER], [then], [{**USER, "id": "msg_u3"}]]
    assert kept.delete("alpha", "resp_b", now=150.0) and kept.get("alpha", "resp_b", now=150.0) is None
    with kept.engine.connect() as db:        # its content erased, its link kept
        assert db.execute(text("SELECT response, input_items, previous_id FROM responses WHERE id = 'resp_b'")) \
            .one() == ("{}", "[]", "resp_a")
    _, items = kept.get("alpha", "resp_c", now=150.0)       # a deleted turn's items gone, the others kept
    assert [i["id"] for i in items] == ["msg_u1", "msg_resp_a", "msg_u3"]
    _, items = kept.get("alpha", "resp_c", now=350.0)       # an expired one ends the chain
    assert [i["id"] for i in items] == ["msg_u3"]
    assert not kept.delete("alpha", "resp_b", now=150.0)  # deleted once


def body(**fields) -> dict:
    return {"model": "m", "input": "Hi", **fields}


def test_store_defaults_to_kept_where_the_server_keeps_responses():
    assert parse_responses_body(body(), keeping=KEEPING).responses.store
    assert not parse_responses_body(body(store=False), keeping=KEEPING).responses.store
    assert not parse_responses_body(body()).responses.store          # storage off: left out means not kept
    for fields, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
        with pytest.raises(ServiceError) as refused:
            parse_responses(json.dumps(body(**fields)).encode())        # a batch's line: nothing kept
        assert refused.value.field == param and "no response is kept" in refused.value.message
    with pytest.raises(ServiceError) as refused:
        parse_responses_body(body(store="yes"), keeping=KEEPING)
    assert refused.value.field == "store"
    for bad in (7, "", "r" * 65):
        with pytest.raises(ServiceError) as refused:
            previous_id(body(previous_response_id=bad))
        assert refused.value.kind is ErrorKind.INVALID and refused.value.field == "previous_response_id"


def test_the_kept_conversation_is_items_with_ids():
    items = parse_responses_body(body(input=[{"role": "user", "content": "Hi"},
                                             {"type": "message", "role": "assistant", "id": "msg_a", "content": "Yo"},
                                             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                             {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
                                      instructions="Be brief."), keeping=KEEPING).responses.items
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi"}] and items[0]["id"].startswith("msg_")
    assert items[1]["id"] == "msg_a" and items[1]["content"] == [{"type": "output_text", "text": "Yo"}]
    assert items[2]["id"].startswith("fc_") and items[3]["id"].startswith("fco_")
    assert len({i["id"] for i in items}) == 4                            # instructions are not an item


def test_a_continued_response_says_the_earlier_turns_before_its_own():
    previous = (response("resp_1"), [USER])
    request = parse_responses_body(body(input="And you?", instructions="Be kind.", previous_response_id="resp_1"),
                                   previous, KEEPING)
    assert [(m.role, m.content) for m in request.body.messages] == [
        ("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello there."), ("user", "And you?")]
    echo = request.responses
    assert echo.previous_id == "resp_1"
    [own] = echo.items                           # kept: its own input (the store reads the earlier turns')
    assert own["content"] == [{"type": "input_text", "text": "And you?"}]
    with pytest.raises(ServiceError) as refused:
        parse_responses_body(body(input="More", previous_response_id="resp_1"), previous,
                             ResponsesConfig(max_items=2))
    assert refused.value.field == "previous_response_id" and "3 input items" in refused.value.message


def answer_to(request, finish=common_pb2.FINISH_REASON_STOP) -> ResponsesAnswer:
    answer = ResponsesAnswer(request, "r9", 100, 2)
    chunk = common_pb2.GenerateChunk(text="Fine.", token_ids=[1], finish_reason=finish)
    chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 5, 1
    answer.add(0, chunk)
    return answer


def test_an_answer_is_kept_as_it_ended_only_when_asked():
    request = parse_responses_body(body(previous_response_id="resp_1"), (response("resp_1"), [USER]), KEEPING)
    answer = answer_to(request)
    assert answer.kept() is None                                          # not ended yet
    shown = answer.body()
    assert shown["store"] is True and shown["previous_response_id"] == "resp_1"
    kept, items = answer.kept()
    assert kept == shown and [i["content"][0]["text"] for i in items] == ["Hi"]        # its own input
    unkept = answer_to(parse_responses_body(body(store=False), keeping=KEEPING))
    assert unkept.body()["store"] is False and unkept.kept() is None
    streamed = ResponsesAnswer(parse_responses_body(body(), keeping=KEEPING), "r10", 100, 2)
    streamed.failed(ServiceError(ErrorKind.UNAVAILABLE, "the worker was lost", reason="unavailable"), None)
    assert streamed.kept()[0]["status"] == "failed"                       # its stream began: it is kept as it ended


def test_the_responses_table_is_read_from_a_config_file():
    config = parse_config({"responses": {"store": False, "retention_s": 3600, "max_items": 50}})
    assert (config.responses.store, config.responses.retention_s, config.responses.max_items) == (False, 3600, 50)
    assert parse_config({}).responses == ResponsesConfig()
    with pytest.raises(ConfigError, match="responses.retention_s"):
        parse_config({"responses": {"retention_s": 0}})


def queued(rid: str) -> dict:
    return {**response(rid), "status": "queued", "output": [], "background": True}


def test_a_background_response_changes_only_while_it_runs(kept):
    kept.add("alpha", queued("resp_b"), [USER], now=100.0, expires_at=1000.0, owner="r1", lease_until=110.0)
    assert kept.get("alpha", "resp_b", now=105.0)[0]["status"] == "queued"
    assert not kept.update({**queued("resp_b"), "status": "in_progress"}, owner="r2")   # not its runner
    assert kept.update({**queued("resp_b"), "status": "in_progress"}, owner="r1")
    assert kept.renew("r1", ["resp_b"], now=108.0, lease_s=10.0) == {"resp_b": "in_progress"}
    assert kept.cancel("beta", "resp_b", now=109.0) is None                              # another tenant's
    cancelled, changed = kept.cancel("alpha", "resp_b", now=109.0)
    assert changed and cancelled["status"] == "cancelled"
    assert not kept.update(response("resp_b"), owner="r1")          # the runner's last write loses to the cancel
    assert kept.renew("r1", ["resp_b"], now=110.0, lease_s=10.0) == {"resp_b": "cancelled"}   # its runner stops
    assert kept.cancel("alpha", "resp_b", now=111.0) == (cancelled, False)               # a second cancel: as it is
    assert kept.get("alpha", "resp_b", now=500.0)[0]["status"] == "cancelled"           # no lease on an ended one


def test_a_background_response_whose_router_was_lost_reads_as_failed(kept):
    kept.add("alpha", queued("resp_l"), [USER], now=100.0, expires_at=1000.0, owner="r1", lease_until=110.0)
    assert kept.get("alpha", "resp_l", now=109.0)[0]["status"] == "queued"
    lost = kept.get("alpha", "resp_l", now=111.0)[0]
    assert lost["status"] == "failed" and "send the request again" in lost["error"]["message"]
    assert not kept.update(response("resp_l"), owner="r1")         # a late runner cannot bring it back
    assert kept.get("alpha", "resp_l", now=112.0)[0] == lost


def test_background_needs_store():
    assert parse_responses_body(body(background=True), keeping=KEEPING).responses.background
    assert parse_responses_body(body(background=True, stream=True), keeping=KEEPING).stream
    for fields, param in (({"background": True, "store": False}, "background"), ({"background": 1}, "background")):
        with pytest.raises(ServiceError) as refused:
            parse_responses_body(body(**fields), keeping=KEEPING)
        assert refused.value.field == param
    with pytest.raises(ServiceError) as refused:
        parse_responses_body(body(background=True))                     # nothing kept here
    assert refused.value.field == "background"


class SlowPath:
    """The request path's serve(): one token a tick until `stop`, or the error it is given."""

    def __init__(self, error: ServiceError | None = None, tokens: int = 1000):
        self.error, self.tokens = error, tokens

    def serve(self, head, read_body, caller, estimate, parent, attrs):
        async def chunks():
            read_body(2048)
            if self.error is not None:
                raise self.error
            for k in range(self.tokens):
                await asyncio.sleep(0.01)
                last = k == self.tokens - 1
                chunk = common_pb2.GenerateChunk(text="a", token_ids=[7],
                                                 finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)
                chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 3, k + 1
                yield chunk
        return chunks()


def run_background(kept: ResponseStore, path, act, stream: bool = False) -> list:
    """A background response started on a router stub whose path is `path`; `act(runner, id)` then
    runs; the statuses the store showed along the way, and the last response (made with stream:
    and the events its POST streamed, and those the store holds)."""
    async def go():
        async def join(caller, out):          # (no conversation here)
            assert out.joined() is None
        front = SimpleNamespace(drain=Drain("router"), path=path, kept_responses=SimpleNamespace(join=join))
        runner = BackgroundResponses(front, kept, ResponsesConfig(background_lease_s=0.3), "r1")
        request = parse_responses_body(body(background=True, max_output_tokens=1000, stream=stream), keeping=KEEPING)
        answer = await runner.start(RequestHead(priority=MEDIUM, tenant="alpha"), Caller(Tenant("alpha")), request, {})
        posted = asyncio.create_task(read_events(answer.body_iterator)) if stream else None
        response_id = next(iter(runner.running)) if stream else json.loads(answer.body)["id"]
        seen = [kept.get("alpha", response_id, time.time())[0]["status"]]
        await act(runner, response_id)
        seen.append(kept.get("alpha", response_id, time.time())[0])
        assert front.drain.in_flight == 0 and not runner.running and not runner.logs
        if stream:
            seen += [await posted, [json.loads(event) for _, event in kept.events(response_id, -1)]]
        return seen
    return asyncio.run(go())


async def read_events(frames) -> list[dict]:
    """Server-Sent Events as the Responses API frames them: their data objects, in order."""
    events = []
    async for framed in frames:
        for block in framed.decode().split("\n\n"):
            data = [line.removeprefix("data: ") for line in block.split("\n") if line.startswith("data: ")]
            if data:
                events.append(json.loads(data[0]))
    return events



async def until_running(kept: ResponseStore, response_id: str) -> None:
    while kept.get("alpha", response_id, time.time())[0]["status"] != "in_progress":
        await asyncio.sleep(0.01)


def test_a_background_run_is_kept_as_it_goes_and_ends_as_it_ended(kept):
    async def finish(runner, response_id):
        await until_running(kept, response_id)
        await asyncio.gather(*runner.running.values())
    queued, done = run_background(kept, SlowPath(tokens=5), finish)
    assert queued == "queued" and done["status"] == "incomplete" and done["output"][0]["content"][0]["text"] == "aaaaa"
    refused = ServiceError(ErrorKind.EXHAUSTED, "tenant alpha: 3 requests a minute", reason="rate_limit_requests")
    _, failed = run_background(kept, SlowPath(error=refused), lambda runner, _: asyncio.gather(*runner.running.values()))
    assert failed["status"] == "failed" and failed["error"]["code"] == "rate_limit_requests"


def test_a_cancel_stops_the_run_here_or_at_the_next_renewal_and_a_stop_fails_it(kept):
    async def cancel_elsewhere(runner, response_id):        # another replica's cancel: seen at the renewal
        await until_running(kept, response_id)
        assert kept.cancel("alpha", response_id, time.time())[1]
        await asyncio.wait_for(asyncio.gather(*runner.running.values()), timeout=5)
    _, cancelled = run_background(kept, SlowPath(), cancel_elsewhere)
    assert cancelled["status"] == "cancelled"

    async def stop(runner, response_id):                    # the router drained and stops
        await until_running(kept, response_id)
        await runner.stop()
    _, stopped = run_background(kept, SlowPath(), stop)
    assert stopped["status"] == "failed" and "send the request again" in stopped["error"]["message"]


def test_a_streamed_background_run_keeps_its_events_for_a_reader_anywhere(kept):
    async def finish(runner, response_id):
        await asyncio.gather(*runner.running.values())
    queued, done, posted, stored = run_background(kept, SlowPath(tokens=5), finish, stream=True)
    assert queued == "queued" and done["status"] == "incomplete"
    assert posted == stored and [e["sequence_number"] for e in stored] == list(range(len(stored)))
    assert [e["type"] for e in stored[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert stored[0]["response"]["status"] == "queued" and stored[-1]["type"] == "response.incomplete"
    assert "".join(e["delta"] for e in stored if e["type"] == "response.output_text.delta") == "aaaaa"
    assert stored[-1]["response"] == done
    # A reader elsewhere, from the store: after any event, the rest, to the last.
    for after in (-1, 3, len(stored) - 2, len(stored) - 1, len(stored) + 5):
        assert asyncio.run(read_events(stored_tail(kept, done["id"], after))) == stored[after + 1:]

    async def cancel_elsewhere(runner, response_id):
        await until_running(kept, response_id)
        assert kept.cancel("alpha", response_id, time.time())[1]
        await asyncio.wait_for(asyncio.gather(*runner.running.values()), timeout=5)
    _, cancelled, posted, stored = run_background(kept, SlowPath(), cancel_elsewhere, stream=True)
    assert posted == stored and stored[-1]["type"] == "response.failed"
    assert stored[-1]["response"]["status"] == cancelled["status"] == "cancelled"


def test_a_reader_of_a_lost_routers_stream_gets_its_end_from_the_store(kept):
    """The router running it was lost after two events: the reader reads them, then (its lease
    lapsed) response.failed with the response as the store ends it."""
    queued = {**response("resp_lost"), "status": "queued", "background": True}
    kept.add("alpha", queued, [USER], now=time.time(), expires_at=time.time() + 60, owner="gone",
             lease_until=time.time() + 0.3)
    kept.add_events("resp_lost", [(k, json.dumps({"type": kind, "sequence_number": k}))
                                  for k, kind in enumerate(("response.created", "response.queued"))], time.time())
    events = asyncio.run(read_events(stored_tail(kept, "resp_lost", -1)))
    assert [e["type"] for e in events] == ["response.created", "response.queued", "response.failed"]
    assert events[-1]["sequence_number"] == 2 and events[-1]["response"]["status"] == "failed"
    assert "send the request again" in events[-1]["response"]["error"]["message"]
    assert kept.delete("alpha", "resp_lost", time.time()) and kept.last_event("resp_lost") is None   # erased too


def test_a_lost_routers_background_response_is_claimed_once_to_run_again(kept):
    """adopt(): a response whose lease lapsed and that can run again is claimed by one router;
    until then readers leave it running. One that cannot (a stream: no request kept; or run
    MAX_RUNS times) is ended failed by its first reader, as before."""
    now = time.time()
    for rid, request in (("resp_again", {"body": {"input": "Hi"}, "priority": "low", "key_prefix": "", "runs": 1}),
                         ("resp_stream", None), ("resp_tired", {"body": {}, "priority": "low", "key_prefix": "",
                                                                "runs": MAX_RUNS})):
        kept.add("alpha", {**response(rid), "status": "in_progress", "background": True}, [USER], now=now - 5,
                 expires_at=now + 60, owner="gone", lease_until=now - 1, request=request)
    assert kept.get("alpha", "resp_again", now)[0]["status"] == "in_progress"           # left to be taken over
    assert kept.get("alpha", "resp_stream", now)[0]["status"] == "failed"
    assert kept.get("alpha", "resp_tired", now)[0]["status"] == "failed"
    claimed = kept.adopt("r1", now, lease_s=10.0)
    assert claimed["id"] == "resp_again" and claimed["request"]["runs"] == 2 and claimed["tenant"] == "alpha"
    assert kept.adopt("r2", now, lease_s=10.0) is None                                   # one claim wins
    assert kept.renew("gone", ["resp_again"], now, 10.0) == {"resp_again": "taken"}   # its lost router, if alive, stops
    assert kept.renew("r1", ["resp_again"], now, 10.0) == {"resp_again": "in_progress"}


def test_a_claimed_response_runs_again_here_under_its_id(kept):
    now = time.time()
    sent = {"model": "m", "input": "Hi", "max_output_tokens": 1000, "background": True}
    kept.add("alpha", {**response("resp_r7"), "status": "in_progress", "background": True}, [USER], now=now - 5,
             expires_at=now + 60, owner="gone", lease_until=now - 1,
             request={"body": sent, "priority": "low", "key_prefix": "qsk_abc", "runs": 1})

    async def go():
        async def parse(raw, caller):
            assert caller.name == "alpha" and caller.key_prefix == "qsk_abc"
            return parse_responses_body(json.loads(raw), keeping=KEEPING)

        async def join(caller, out):
            assert out.id == "resp_r7"
        heads = []
        front = SimpleNamespace(drain=Drain("router"), path=SlowPath(tokens=5), book=SimpleNamespace(tenants={}),
                                router=SimpleNamespace(let_in=lambda headers, caller: heads.append(headers) or
                                                       RequestHead(priority=LOW, tenant=caller.name)),
                                kept_responses=SimpleNamespace(join=join, parse=parse))
        runner = BackgroundResponses(front, kept, ResponsesConfig(background_lease_s=0.3), "r1")
        runner.begin()
        deadline = time.monotonic() + 10
        while kept.get("alpha", "resp_r7", time.time())[0]["status"] not in ("completed", "incomplete"):
            assert time.monotonic() < deadline, "not taken over"
            await asyncio.sleep(0.05)
        await runner.stop()
        assert heads == [{"x-priority": "low"}] and front.drain.in_flight == 0
    asyncio.run(go())
    done = kept.get("alpha", "resp_r7", time.time())[0]
    assert done["status"] == "incomplete" and done["output"][0]["content"][0]["text"] == "aaaaa"
    assert done["created_at"] == int(now - 5)


@pytest.fixture
def talks(url):
    store = Store(url)
    with store.engine.begin() as db:
        db.execute(text("DELETE FROM conversation_items"))
        db.execute(text("DELETE FROM conversations"))
    yield ConversationStore(store)
    store.close()


def test_a_conversations_pages_are_read_by_the_database_as_from_the_whole_list(talks):
    """items_page (a page read by the database) answers every query as item_page over the whole
    list: each limit, order, and `after` at every item, a deleted one and one never there."""
    talks.create("conv_p", "alpha", {}, [{**USER, "id": f"msg_{k}"} for k in range(7)], now=1.0)
    talks.delete_item("conv_p", "msg_3")
    whole = talks.items("conv_p")
    for limit in (1, 2, 3, 6, 100):
        for order in ("asc", "desc"):
            for after in (None, "msg_3", "msg_x", "x\x00", *(item["id"] for item in whole)):
                expected = item_page(whole, (limit, order, after))
                items, more = talks.items_page("conv_p", limit, order, after)
                assert listed(items, more) == expected, (limit, order, after)


def test_a_conversation_is_its_tenants_and_its_items_come_in_order(talks):
    made = talks.create("conv_a", "alpha", {"topic": "sky"}, [USER], now=100.0)
    assert made["metadata"] == {"topic": "sky"} and talks.get("beta", "conv_a") is None
    assert talks.append("alpha", "conv_a", [{**USER, "id": "msg_2"}, {**USER, "id": "msg_3"}])
    assert not talks.append("beta", "conv_a", [{**USER, "id": "msg_x"}])            # not beta's
    assert [i["id"] for i in talks.items("conv_a")] == ["msg_u1", "msg_2", "msg_3"]
    assert talks.delete_item("conv_a", "msg_2") and not talks.delete_item("conv_a", "msg_2")
    assert talks.append("alpha", "conv_a", [{**USER, "id": "msg_4"}])               # after the last, a gap or not
    assert [i["id"] for i in talks.items("conv_a")] == ["msg_u1", "msg_3", "msg_4"]
    assert talks.set_metadata("alpha", "conv_a", {"topic": "sea"})["metadata"] == {"topic": "sea"}
    assert not talks.delete("beta", "conv_a") and talks.delete("alpha", "conv_a")
    assert talks.get("alpha", "conv_a") is None and talks.items("conv_a") == []
    assert not talks.append("alpha", "conv_a", [USER]) and talks.get(None, "conv_\x00") is None


def test_a_response_in_a_conversation_reads_it_and_joins_it():
    said = [USER, {"id": "msg_o", "type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                      "text": "Hello there."}]}]
    request = parse_responses_body(body(input="And you?", conversation={"id": "conv_a"}, store=False), None, KEEPING,
                                   ("conv_a", said))
    assert [(m.role, m.content) for m in request.body.messages] == [
        ("user", "Hi"), ("assistant", "Hello there."), ("user", "And you?")]
    answer = answer_to(request)
    shown = answer.body()
    assert shown["conversation"] == {"id": "conv_a"} and answer.kept() is None          # store false: not kept ...
    conversation, joining = answer.joined()                                              # ... but it joins
    assert conversation == "conv_a" and [i["role"] for i in joining] == ["user", "assistant"]
    assert joining[0]["content"] == [{"type": "input_text", "text": "And you?"}]
    with pytest.raises(ServiceError) as refused:
        parse_responses_body(body(conversation="conv_a", previous_response_id="resp_1"), (response("resp_1"), [USER]),
                             KEEPING, ("conv_a", said))
    assert refused.value.field == "conversation"
