"""OpenAI's Batch API in pieces: the input file's checks (services/router/openai_api/batch_lines.py), the
multipart upload, the store's rows on SQLite and PostgreSQL (tenants apart, one runner at a time
by lease, a line recorded once), and the runner on a stub request path (services/router/
batch_runner.py): retries what says when to retry, records every other outcome once, writes the
output and error files in the input's order, stops for a cancel and for a lost lease."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import text
from starlette.requests import Request

from services.common.batch_config import BatchConfig
from services.common.drain import Drain
from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.batch_front import _page, batch_object, multipart_form
from services.router.openai_api.batch_lines import read_lines
from services.router.openai_api.batch_runner import BatchRunner
from services.router.validation import RequestHead
from services.store.batch_store import BatchStore
from services.store.store import Store

CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str = "Hi", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body}})


def test_an_input_file_is_read_line_by_line_and_each_fault_named_with_its_line():
    lines, errors = read_lines(f"{line('a')}\n{line('b', max_tokens=3)}\n\n".encode(), CHAT, 10)
    assert not errors and [(l.number, l.custom_id) for l in lines] == [(0, "a"), (1, "b")]
    assert lines[1].body["max_tokens"] == 3
    bad = "\n".join([line("a"), line("a"), "{not json", json.dumps({"custom_id": "c", "method": "GET", "url": CHAT,
                                                                    "body": {}}),
                     line("d").replace(CHAT, "/v1/completions"), line("e", stream=True), line("")])
    _, errors = read_lines(bad.encode(), CHAT, 10)
    assert [(e["line"], e["code"]) for e in errors] == [(2, "duplicate_custom_id"), (3, "invalid_json_line"),
                                                        (4, "invalid_request"), (5, "mismatched_endpoint"),
                                                        (6, "invalid_request"), (7, "invalid_request")]
    assert read_lines(b"", CHAT, 10)[1][0]["code"] == "empty_file"
    assert read_lines(("\n".join(line(str(i)) for i in range(11))).encode(), CHAT, 10)[1][0]["code"] == "too_many_lines"
    assert read_lines(b"\xff", CHAT, 10)[1][0]["code"] == "invalid_file"


def test_a_multipart_upload_is_read_byte_for_byte():
    data = b'{"a": 1}\r\n{"b": "\xc3\xa9"}\n'
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--XyZ--\r\n")
    form = multipart_form('multipart/form-data; boundary="XyZ"', body)
    assert form == {"purpose": (None, b"batch"), "file": ("in.jsonl", data)}
    with pytest.raises(ServiceError) as refused:
        multipart_form("application/json", b"{}")
    assert refused.value.field == "file"


@pytest.fixture
def store(url):
    store = Store(url)
    with store.engine.begin() as db:
        for table in ("batch_results", "batches", "files"):
            db.execute(text(f"DELETE FROM {table}"))
    yield BatchStore(store)
    store.close()


def new_batch(store: BatchStore, tenant: str = "alpha", lines: list[str] | None = None, created: float = 100.0) -> dict:
    lines = lines or [line(f"r{i}") for i in range(3)]
    upload = store.add_file(tenant, "batch", "in.jsonl", "\n".join(lines).encode(), created)
    return store.add_batch({"id": f"batch_{tenant}{int(created)}", "tenant": tenant, "key_prefix": "",
                            "endpoint": CHAT, "input_file_id": upload["id"], "status": "validating",
                            "total": len(lines), "completed": 0, "failed": 0, "errors": None, "meta": None,
                            "created_at": created, "expires_at": time.time() + 86400})


def test_files_and_batches_are_their_tenants(store):
    batch = new_batch(store)
    assert store.file("beta", batch["input_file_id"]) is None and store.batch("beta", batch["id"]) is None
    assert store.file_content("beta", batch["input_file_id"]) is None
    assert not store.delete_file("beta", batch["input_file_id"]) and store.files("beta", None, None, 10) == []
    assert store.file("alpha", batch["input_file_id"])["bytes"] > 0 and store.batch(None, batch["id"])
    assert store.cancel("beta", batch["id"], 101) is None
    assert store.batch("alpha", batch["id"])["status"] == "validating"      # beta's cancel changed nothing
    later = new_batch(store, created=200.0)
    assert [b["id"] for b in store.batches("alpha", None, 10)] == [later["id"], batch["id"]]   # newest first
    assert [b["id"] for b in store.batches("alpha", later["id"], 10)] == [batch["id"]]
    # An id no row can have (PostgreSQL refuses a NUL in a comparison: that was a 500) names nothing.
    for bad in ("file-\x00", "x" * 65, ""):
        assert store.file("alpha", bad) is None and store.file_content(None, bad) is None
        assert store.batch(None, bad) is None and store.cancel(None, bad, 101) is None
        assert not store.delete_file(None, bad) and len(store.batches("alpha", bad, 10)) == 2


def test_one_router_runs_a_batch_until_its_lease_is_over(store):
    batch = new_batch(store)
    assert store.claim("r1", 1000, 30)["id"] == batch["id"]
    assert store.claim("r2", 1010, 30) is None                     # r1's lease holds
    assert store.renew(batch["id"], "r1", 1020, 30) == "validating"
    assert store.claim("r2", 1049, 30) is None
    assert store.claim("r2", 1051, 30)["id"] == batch["id"]       # r1 stopped renewing
    assert store.renew(batch["id"], "r1", 1052, 30) is None          # ... and learns it lost it
    store.release(batch["id"], "r2")
    assert store.claim("r1", 1053, 30)["id"] == batch["id"]


def test_a_line_is_recorded_once_and_counted_once(store):
    batch = new_batch(store)
    assert store.record(batch["id"], 1, True, "one") and not store.record(batch["id"], 1, False, "again")
    assert store.record(batch["id"], 0, False, "zero")
    row = store.batch(None, batch["id"])
    assert (row["completed"], row["failed"]) == (1, 1) and store.done_lines(batch["id"]) == {0, 1}
    assert store.results(batch["id"]) == [(0, False, "zero"), (1, True, "one")]
    store.finish(row, "completed", 2000, b"one\n", b"zero\n")
    done = store.batch("alpha", batch["id"])
    assert done["status"] == "completed" and done["owner"] is None and done["completed_at"] == 2000
    assert store.file_content("alpha", done["output_file_id"]) == b"one\n"
    assert store.file("alpha", done["error_file_id"])["purpose"] == "batch_output"
    assert batch_object(done)["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert store.cancel("alpha", batch["id"], 2001)["status"] == "completed"     # over: nothing to cancel


class StubPath:
    """The request path's serve(): a refusal with retry advice the first `busy` times a request
    id is sent, an error for prompts saying "fail", else one chunk with the prompt echoed."""

    def __init__(self, busy: int = 0, gate: asyncio.Event | None = None):
        self.busy, self.gate, self.sent = busy, gate, []

    def serve(self, head: RequestHead, read_body, caller, estimate, parent, attrs):
        async def chunks():
            body = read_body(2048)
            self.sent.append(head.request_id)
            if self.sent.count(head.request_id) <= self.busy:
                raise ServiceError(ErrorKind.EXHAUSTED, "queue full", retry_after_ms=1, reason="queue_full")
            if self.gate is not None:
                await self.gate.wait()
            prompt = body.messages[0].content
            if prompt == "fail":
                raise invalid("sampling.temperature is wrong", "sampling.temperature")
            chunk = common_pb2.GenerateChunk(text=prompt.upper(), token_ids=[1],
                                             finish_reason=common_pb2.FINISH_REASON_STOP)
            chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 3, 1
            yield chunk
        return chunks()


def runner(store: BatchStore, path: StubPath, **config) -> BatchRunner:
    router = SimpleNamespace(book=SimpleNamespace(replica="r1", tenants={}), drain=Drain("router"), path=path,
                             let_in=lambda headers, caller: RequestHead(priority=3, tenant=caller.name))
    return BatchRunner(router, store, BatchConfig(**config), asyncio.Event())


def output(store: BatchStore, batch: dict, field: str) -> list[dict]:
    row = store.batch(None, batch["id"])
    return [json.loads(t) for t in store.file_content(None, row[field]).decode().splitlines()] if row[field] else []


def test_the_runner_retries_what_may_be_retried_and_records_the_rest_in_order(store):
    batch = new_batch(store, lines=[line("a", "one"), line("b", "fail"), line("c", "three"),
                                    line("d", "x", service_tier="priority")])
    path = StubPath(busy=2)
    run = runner(store, path, concurrency=2)
    asyncio.run(run.run_batch(store.claim("r1", 1000, 30)))
    assert [run.lines.labels(o)._value.get() for o in ("completed", "failed")] == [2, 2]
    assert run.batches.labels("completed")._value.get() == 1 and run.running._value.get() == 0
    row = store.batch(None, batch["id"])
    assert (row["status"], row["completed"], row["failed"]) == ("completed", 2, 2)
    good = output(store, batch, "output_file_id")
    assert [(o["custom_id"], o["response"]["body"]["choices"][0]["message"]["content"]) for o in good] == \
        [("a", "ONE"), ("c", "THREE")]
    assert good[0]["response"]["request_id"] == f"{batch['id']}-0" and good[0]["response"]["status_code"] == 200
    assert good[0]["response"]["body"]["service_tier"] == "flex"        # the batch's class: Low
    bad = output(store, batch, "error_file_id")
    assert [(o["custom_id"], o["response"]["status_code"], o["response"]["body"]["error"]["param"]) for o in bad] == \
        [("b", 400, "temperature"), ("d", 400, "service_tier")]
    assert path.sent.count(f"{batch['id']}-0") == 3                  # two refusals, then served
    assert f"{batch['id']}-3" not in path.sent                       # its class was refused before sending


def test_a_cancelled_batch_stops_and_lists_what_never_ran(store):
    batch = new_batch(store, lines=[line(f"r{i}", f"p{i}") for i in range(6)])

    async def go():
        gate = asyncio.Event()
        run = runner(store, StubPath(gate=gate), concurrency=2, lease_s=0.3)
        task = asyncio.create_task(run.run_batch(store.claim("r1", 1000, 30)))
        await asyncio.sleep(0.05)
        lease = store.cancel("alpha", batch["id"], 1001)["lease_until"]
        assert store.batch(None, batch["id"])["status"] == "cancelling"
        while store.batch(None, batch["id"])["lease_until"] == lease:      # the runner's next renewal
            await asyncio.sleep(0.02)                                       # reads the status (under any load)
        gate.set()
        await asyncio.wait_for(task, 10)
    asyncio.run(go())
    row = store.batch(None, batch["id"])
    assert row["status"] == "cancelled" and row["completed"] == 2       # the two in flight finished
    unrun = [o for o in output(store, batch, "error_file_id") if o["response"] is None]
    assert [o["error"]["code"] for o in unrun] == ["batch_cancelled"] * 4


def test_a_runner_that_lost_its_lease_leaves_the_batch_to_the_other(store):
    batch = new_batch(store, lines=[line(f"r{i}", f"p{i}") for i in range(4)])

    async def go():
        gate = asyncio.Event()
        run = runner(store, StubPath(gate=gate), concurrency=1, lease_s=0.3)
        task = asyncio.create_task(run.run_batch(store.claim("r1", 1000, 30)))
        await asyncio.sleep(0.05)
        with store.engine.begin() as db:
            db.execute(text("UPDATE batches SET owner = 'r2' WHERE id = :b"), {"b": batch["id"]})
        await asyncio.wait_for(task, 5)
    asyncio.run(go())
    row = store.batch(None, batch["id"])
    assert row["status"] == "in_progress" and row["owner"] == "r2" and row["completed"] == 0


def test_a_batch_whose_input_was_deleted_fails_keeping_what_ran(store):
    batch = new_batch(store)
    store.record(batch["id"], 0, True, json.dumps({"custom_id": "r0"}))
    assert store.delete_file("alpha", batch["input_file_id"])
    asyncio.run(runner(store, StubPath()).run_batch(store.claim("r1", 1000, 30)))
    row = store.batch(None, batch["id"])
    assert row["status"] == "failed" and [o["custom_id"] for o in output(store, batch, "output_file_id")] == ["r0"]


def test_a_batch_line_is_held_to_its_tenants_classes_and_budget_not_to_its_rates(tmp_path):
    """rpm, tpm and max_concurrent are a tenant's interactive traffic's: a batch's lines (the
    runner bounds them) do not take them, so a running batch never 429s the tenant's chat."""
    from services.common.priority import HIGH, LOW
    from services.control.tenancy import Caller, TenantBook
    from services.store.store import Tenant
    book = TenantBook(Store(f"sqlite:///{tmp_path / 'store.db'}"))
    caller = Caller(Tenant("t", priorities=("low",), rpm=1, max_concurrent=1, budget=10.0))
    for _ in range(5):
        assert book.admit(caller, LOW, 100, rate_limited=False).reservation is None
    book.admit(caller, LOW, 100)                                         # its one request a minute
    with pytest.raises(ServiceError) as limited:
        book.admit(caller, LOW, 100)
    assert limited.value.kind is ErrorKind.EXHAUSTED and limited.value.retry_after_ms is not None
    book.admit(caller, LOW, 100, rate_limited=False)                     # the batch goes on
    with pytest.raises(ServiceError) as denied:
        book.admit(caller, HIGH, 100, rate_limited=False)
    assert denied.value.kind is ErrorKind.PERMISSION_DENIED
    book.spent["t"] = 10.0
    with pytest.raises(ServiceError) as spent:
        book.admit(caller, LOW, 100, rate_limited=False)
    assert spent.value.reason == "insufficient_quota" and spent.value.retry_after_ms is None


def test_a_page_limit_is_ascii_digits():
    assert _page(Request({"type": "http", "query_string": b"limit=7&after=batch_1", "headers": []}), 100) \
        == ("batch_1", 7)
    for limit in (b"%C2%B2", b"0", b"101", b"-1"):          # "\u00b2".isdigit() is true; int() refuses it (a 500)
        with pytest.raises(ServiceError) as refused:
            _page(Request({"type": "http", "query_string": b"limit=" + limit, "headers": []}), 100)
        assert refused.value.field == "limit"
