"""How the store reaches its database: the engine, and the bounds that keep a database which stops
answering from holding the router's helper threads (key refresh, ledger writes) forever.

PostgreSQL gets four:
- connect_timeout: opening a connection (TCP, TLS, the startup exchange) takes at most this long.
- statement_timeout: the server cancels a statement that runs longer (a lock held elsewhere, a
  huge batch).
- an answer deadline at the client, statement_timeout + ANSWER_MARGIN_S: statement_timeout is the
  server's, so a server that stopped answering (a hung proxy, a network that black-holes packets
  after a middlebox acknowledged them) never sends its cancellation, and psycopg would wait in
  select() for ever. Past the deadline the connection is closed (where the protocol stood is
  unknown), which SQLAlchemy's pool reads as a disconnect and discards.
- TCP keepalives and tcp_user_timeout: the kernel drops a connection whose peer vanished
  (unacknowledged data, unanswered probes), idle pooled ones included, so a checkout meets a dead
  connection less often.
SQLite is a local file: its `timeout` only bounds the wait for another writer's lock.
"""
from __future__ import annotations

import time
from pathlib import Path

import psycopg
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url

CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_S = 10.0
ANSWER_MARGIN_S = 1.0           # the server's own cancellation arrives first when it can
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


class DeadlineConnection(psycopg.Connection):
    """A psycopg connection that waits at most `answer_timeout_s` for any exchange with the server."""
    answer_timeout_s: float | None = None

    def wait(self, gen, *args, **kwargs):
        if len(args) < 2:               # (interval, timeout): a timeout psycopg passes itself wins
            kwargs.setdefault("timeout", self.answer_timeout_s)
        started = time.monotonic()
        try:
            return super().wait(gen, *args, **kwargs)
        except psycopg.OperationalError as error:
            timeout = kwargs.get("timeout")
            if timeout is None or time.monotonic() - started < timeout:
                raise
            self.pgconn.finish()        # mid-exchange: the connection cannot be used again
            raise psycopg.OperationalError(f"the database did not answer within {timeout:g} s; "
                                           "connection closed") from error


def postgres_args(connect_timeout_s: float, statement_timeout_s: float) -> dict:
    """libpq parameters for every connection (psycopg passes them through)."""
    return {"connect_timeout": max(2, round(connect_timeout_s)),      # libpq's floor is 2 s
            "options": f"-c statement_timeout={round(statement_timeout_s * 1000)}",
            "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE_S,
            "keepalives_interval": KEEPALIVE_INTERVAL_S, "keepalives_count": KEEPALIVE_COUNT,
            "tcp_user_timeout": round((statement_timeout_s + ANSWER_MARGIN_S) * 1000)}


def make_engine(url: str, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                statement_timeout_s: float = STATEMENT_TIMEOUT_S) -> Engine:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]      # the driver we install
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(connection, _record):
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")      # readers do not block the writer
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
        return engine
    if make_url(url).get_driver_name() != "psycopg":
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, pool_pre_ping=True,
                           connect_args=postgres_args(connect_timeout_s, statement_timeout_s))

    @event.listens_for(engine, "do_connect")
    def _with_deadline(_dialect, _record, cargs, cparams):
        connection = DeadlineConnection.connect(*cargs, **cparams)
        connection.answer_timeout_s = statement_timeout_s + ANSWER_MARGIN_S
        return connection
    return engine


def upsert_for(dialect: str):
    """The dialect's INSERT with ON CONFLICT (both databases spell it alike; SQLAlchemy has one per
    dialect)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert
