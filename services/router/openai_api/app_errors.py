"""What the HTTP front answers when an endpoint raises instead of answering: the exceptions no
endpoint catches itself, each a status and an OpenAI error body (front.py registers them)."""
from __future__ import annotations

import logging

from sqlalchemy import exc as db_errors
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from services.common.errors import ErrorKind, ServiceError
from services.router.openai_api.generation import error_response

log = logging.getLogger(__name__)


async def _client_gone(http: Request, exc: ClientDisconnect) -> Response:
    """The client hung up while sending its body (any endpoint): nobody is left to answer, and
    nothing went wrong here, so no error is logged (unhandled, Starlette logged a traceback)."""
    return Response(status_code=499)


async def _store_down(http: Request, exc: Exception) -> Response:
    """The store's database did not answer (an endpoint that reads or writes it: usage, requests,
    files, batches, kept responses): a 503 saying when to retry, not a 500."""
    log.warning("%s %s: the store did not answer (%s)", http.method, http.url.path, str(exc).splitlines()[0][:200])
    return error_response(ServiceError(ErrorKind.UNAVAILABLE, "the store (the tenants' and billing database) did "
                                       "not answer: retry in a second", retry_after_ms=1000,
                                       reason="store_unavailable"))


APP_ERRORS = {ClientDisconnect: _client_gone, db_errors.OperationalError: _store_down,
              db_errors.InterfaceError: _store_down, db_errors.TimeoutError: _store_down}
