"""OpenAI's Files and Batch APIs on the HTTP front (the batches run in batch_runner.py):

    POST   /v1/files                   a JSONL file of requests (multipart: file, purpose "batch")
    GET    /v1/files[?purpose&after&limit], /v1/files/{id}, /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/batches                 {input_file_id, endpoint, completion_window "24h", metadata}
    GET    /v1/batches[?after&limit], /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Each file and batch is its tenant's (the caller's key names it; with auth off, x-tenant): to
another tenant it is a 404 as an unknown id is; the admin key sees every tenant's. The input is
checked when the batch is created: one bad line fails the batch (status "failed", its errors
listed by line), as OpenAI's do.
"""
from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common.errors import ErrorKind, ServiceError, invalid
from services.control.storage_quota import require_room, storage_limit, storage_refusal
from services.router.openai_api.batch_lines import ENDPOINTS, read_lines
from services.router.openai_api.body import read_body
from services.router.openai_api.generation import error_response
from services.router.openai_api.json_fields import text_field
from services.router.openai_api.request import json_object
from services.router.openai_api.responses_request import check_metadata
from services.store.batch_store import errors_json, new_id
from services.store.storage_use import StorageFull

COMPLETION_WINDOW_S = {"24h": 24 * 3600.0}
TIMES = ("in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": None, "status_details": None}


def batch_object(row: dict) -> dict:
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "input_file_id": row["input_file_id"], "completion_window": "24h", "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            "created_at": int(row["created_at"]), "expires_at": int(row["expires_at"]),
            **{f"{t}_at": int(row[f"{t}_at"]) if row[f"{t}_at"] else None for t in TIMES},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": json.loads(row["meta"]) if row["meta"] else None}


class BatchFront:
    """The endpoints above, for the HTTP front `front` (its caller and limits)."""

    def __init__(self, front, batches, config, wake: asyncio.Event):
        self.front, self.store, self.config, self.wake = front, batches, config, wake


    async def upload(self, http: Request) -> Response:
        try:
            caller = self.front.caller(http)
            body = await read_body(http, self.config.max_file_bytes, self.front.config.http_read_timeout_s)
            form = multipart_form(http.headers.get("content-type", ""), body)
            purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace")
            if purpose != "batch":
                raise invalid(f"purpose must be \"batch\" (the files kept here are batch inputs), got {purpose!r}",
                              "purpose")
            if "file" not in form:
                raise invalid("the form has no file part", "file")
            filename, content = form["file"]
            row = await asyncio.to_thread(self.store.add_file, caller.name, purpose, (filename or "upload.jsonl")[:256],
                                          content, time.time(), storage_limit(caller, self.front.book.storage_mb))
        except StorageFull as full:
            return error_response(storage_refusal(full, "file"))
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(file_object(row))

    async def list_files(self, http: Request) -> Response:
        try:
            owner = self.front.caller(http).scope
            after, limit = _page(http, 10_000)
            rows = await asyncio.to_thread(self.store.files, owner, http.query_params.get("purpose"), after, limit)
        except ServiceError as error:
            return error_response(error)
        return _list(rows, limit, file_object)

    async def file(self, http: Request) -> Response:
        try:
            return JSONResponse(file_object(await self._file(http)))
        except ServiceError as error:
            return error_response(error)

    async def file_content(self, http: Request) -> Response:
        try:
            await self._file(http)
            content = await asyncio.to_thread(self.store.file_content, self.front.caller(http).scope,
                                              http.path_params["file_id"])
        except ServiceError as error:
            return error_response(error)
        return Response(content, media_type="application/jsonl")

    async def delete_file(self, http: Request) -> Response:
        try:
            file_id = http.path_params["file_id"]
            if not await asyncio.to_thread(self.store.delete_file, self.front.caller(http).scope, file_id):
                raise _missing("file", file_id)
        except ServiceError as error:
            return error_response(error)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def _file(self, http: Request) -> dict:
        file_id = http.path_params["file_id"]
        row = await asyncio.to_thread(self.store.file, self.front.caller(http).scope, file_id)
        if row is None:
            raise _missing("file", file_id)
        return row

    async def create(self, http: Request) -> Response:
        try:
            caller = self.front.caller(http)
            self.front.router.drain.check()
            row = await self._new_batch(caller, json_object(await self.front.body(http)))
        except ServiceError as error:
            return error_response(error)
        self.wake.set()
        return JSONResponse(batch_object(row))

    async def _new_batch(self, caller, body: dict) -> dict:
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                      "output_expires_after"})
        if unknown:
            raise invalid(f"unknown field {unknown[0]!r} for batches", unknown[0])
        if body.get("output_expires_after") is not None:
            raise invalid("output_expires_after is not supported: output files are kept until deleted",
                          "output_expires_after")
        endpoint = text_field(body.get("endpoint"), "endpoint")
        if endpoint not in ENDPOINTS:
            raise invalid(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOW_S:
            raise invalid(f"completion_window must be \"24h\", got {window!r}", "completion_window")
        metadata = check_metadata(body["metadata"]) if body.get("metadata") is not None else None
        file_id = text_field(body.get("input_file_id"), "input_file_id")
        # its output file is kept when it ends, whatever its size: let in while under the limit
        require_room(self.front.book, caller, "input_file_id")
        owner = caller.scope
        row = await asyncio.to_thread(self.store.file, owner, file_id)
        if row is None or row["purpose"] != "batch":
            raise _missing("file", file_id, "input_file_id")
        content = await asyncio.to_thread(self.store.file_content, owner, file_id)
        lines, errors = await asyncio.to_thread(read_lines, content, endpoint, self.config.max_lines)
        now = time.time()
        batch = {"id": new_id("batch_"), "tenant": row["tenant"], "key_prefix": caller.key_prefix,
                 "endpoint": endpoint, "input_file_id": file_id, "status": "failed" if errors else "validating",
                 "total": 0 if errors else len(lines), "completed": 0, "failed": 0,
                 "errors": errors_json(errors) if errors else None, "meta": json.dumps(metadata) if metadata else None,
                 "created_at": now, "expires_at": now + COMPLETION_WINDOW_S[window], "failed_at": now if errors else None}
        return await asyncio.to_thread(self.store.add_batch, batch)

    async def batch(self, http: Request) -> Response:
        try:
            return JSONResponse(batch_object(await self._batch(http)))
        except ServiceError as error:
            return error_response(error)

    async def cancel(self, http: Request) -> Response:
        try:
            await self._batch(http)
            row = await asyncio.to_thread(self.store.cancel, self.front.caller(http).scope,
                                          http.path_params["batch_id"], time.time())
        except ServiceError as error:
            return error_response(error)
        self.wake.set()
        return JSONResponse(batch_object(row))

    async def list_batches(self, http: Request) -> Response:
        try:
            after, limit = _page(http, 100)
            rows = await asyncio.to_thread(self.store.batches, self.front.caller(http).scope, after, limit)
        except ServiceError as error:
            return error_response(error)
        return _list(rows, limit, batch_object)

    async def _batch(self, http: Request) -> dict:
        batch_id = http.path_params["batch_id"]
        row = await asyncio.to_thread(self.store.batch, self.front.caller(http).scope, batch_id)
        if row is None:
            raise _missing("batch", batch_id)
        return row


def _list(rows: list[dict], limit: int, shown) -> JSONResponse:
    """OpenAI's page of a list: the objects, whether more may follow, the ids to page from."""
    return JSONResponse({"object": "list", "data": [shown(r) for r in rows], "has_more": len(rows) == limit,
                         "first_id": rows[0]["id"] if rows else None, "last_id": rows[-1]["id"] if rows else None})


def _missing(kind: str, name: str, field: str | None = None) -> ServiceError:
    return ServiceError(ErrorKind.NOT_FOUND, f"no {kind} {name[:80]!r} here", field=field, reason="not_found")


def _page(http: Request, most: int) -> tuple[str | None, int]:
    limit = http.query_params.get("limit", "20" if most == 100 else str(most))
    if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= most:     # ("²".isdigit())
        raise invalid(f"limit must be a number from 1 to {most}, got {limit[:20]!r}", "limit")
    return http.query_params.get("after"), int(limit)


def multipart_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's parts by name: (filename or None, bytes). INVALID when it is not one."""
    kind, _, params = content_type.partition(";")
    boundary = next((p.strip().split("=", 1)[1].strip('"') for p in params.split(";")
                     if p.strip().lower().startswith("boundary=")), "")
    if kind.strip().lower() != "multipart/form-data" or not boundary:
        raise invalid("send the file as multipart/form-data (fields file and purpose)", "file")
    form = {}
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, _, data = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        disposition = next((line.decode("latin-1") for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-disposition:")), "")
        fields = dict(_param(p) for p in disposition.split(";")[1:] if "=" in p)
        if "name" in fields:
            form[fields["name"]] = (fields.get("filename"), data.removesuffix(b"\r\n"))
    return form


def _param(text: str) -> tuple[str, str]:
    key, _, value = text.strip().partition("=")
    return key.lower(), value.strip().strip('"')
