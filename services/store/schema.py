"""The billing and tenant database's tables (SQLAlchemy Core), the same on SQLite and PostgreSQL,
and its version.

    tenants       who may call: allowed priorities, limits, fair-share weight, budget
    api_keys      one row per key: only a SHA-256 of the key and a short display prefix are
                  stored; revoked keys keep their row (revoked_at set)
    ledger        one row per request that ended having produced tokens (or completed): the bill
    tenant_spend  each tenant's running total of the ledger's amounts (kept with every ledger write,
                  so router replicas can re-read what a tenant spent twice a second, cheaply)
    limit_shares  router replicas' shares of each tenant's rpm/tpm/max_concurrent
                  (services/control/limit_shares.py): one row per replica, tenant and limit
    files         files uploaded for the Batch API (their bytes too), each a tenant's
    batches       Batch API jobs: input file, endpoint, status and its times, the replica that
                  runs it (a lease), counts, output and error files
    batch_results one row per finished line of a batch: what its output or error line says
    conversations OpenAI's Conversations API: a tenant's conversation (its metadata)
    conversation_items  its items in order (messages, function calls and outputs), each with an id
    responses     Responses API answers kept (store: true), each a tenant's, until expires_at: the
                  response object, its own input items and the response it continued (a chain:
                  each turn stored once); a background one's status as it runs, and the router
                  replica running it (a lease)
    response_events  a background response made with stream true: its stream's events in order,
                  for a client resuming it (GET /v1/responses/{id}?stream=true&starting_after=N)
                  on any replica; kept [responses] stream_events_s
    tenant_storage  each tenant's bytes in files, responses and conversations (kept with every
                  write and delete of those rows: services/store/storage_use.py)
    schema_info   one row: the schema version this database holds

A database at a newer version than SCHEMA_VERSION is refused with a message (an older qos-serve
must not write into a schema it does not know); an older one is upgraded by MIGRATIONS in order.
"""
from __future__ import annotations

from sqlalchemy import (BigInteger, Column, Float, ForeignKey, Integer, LargeBinary, MetaData, String, Table,
                        Text, UniqueConstraint)

from services.common.priority import TENANT_NAME_MAX  # noqa: F401 (the store checks names by it)

SCHEMA_VERSION = 7
metadata = MetaData()

schema_info = Table(
    "schema_info", metadata,
    Column("id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),
)

tenants = Table(
    "tenants", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(64), nullable=False, unique=True),
    Column("priorities", String(32), nullable=False, default="high,medium,low"),
    Column("rpm", Integer),                      # requests per minute; NULL: no limit
    Column("tpm", Integer),                      # tokens per minute (prompt + max_tokens)
    Column("max_concurrent", Integer),           # streams open at once
    Column("budget", Float),                     # cost units it may spend in all; NULL: no limit
    Column("weight", Float, nullable=False, default=1.0),   # share inside a priority class
    Column("created_at", Float, nullable=False),
    Column("storage_mb", Integer),               # what it may keep in the store; NULL: [store] tenant_storage_mb
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tenant_id", Integer, ForeignKey("tenants.id"), nullable=False),
    Column("prefix", String(16), nullable=False, unique=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
)

ledger = Table(
    "ledger", metadata,
    Column("request_id", String(64), primary_key=True),     # unique: a row is never written twice
    Column("tenant", String(64), nullable=False, index=True),
    Column("key_prefix", String(16), nullable=False, default=""),
    Column("priority", String(8), nullable=False),
    Column("pool", String(64), nullable=False),
    Column("device", String(8), nullable=False),
    Column("model", String(128), nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False, default=0),   # of prompt_tokens: from the prefix cache
    Column("price_per_token", Float, nullable=False),
    Column("multiplier", Float, nullable=False),
    # (prompt - cached + cached x cached_fraction + completion) x price x multiplier
    Column("amount", Float, nullable=False),
    Column("cached_fraction", Float, nullable=False, default=1.0),
    Column("outcome", String(16), nullable=False),           # completed | cancelled | failed
    Column("started_at", Float, nullable=False),             # unix seconds
    Column("finished_at", Float, nullable=False, index=True),
    UniqueConstraint("request_id", name="ledger_request_id"),
)

tenant_storage = Table(
    "tenant_storage", metadata,
    Column("tenant", String(64), primary_key=True),
    Column("bytes", BigInteger, nullable=False),             # what its rows below hold (storage_use.py)
)

tenant_spend = Table(
    "tenant_spend", metadata,
    Column("tenant", String(64), primary_key=True),
    Column("amount", Float, nullable=False),                 # the sum of the tenant's ledger amounts
)

limit_shares = Table(
    "limit_shares", metadata,
    Column("replica", String(64), primary_key=True),         # a router replica's id (host-pid-random)
    Column("tenant", String(64), primary_key=True),
    Column("kind", String(16), primary_key=True),            # rpm | tpm | concurrent
    Column("share", Integer, nullable=False),                # what this replica may admit of the limit
    Column("used", Integer, nullable=False),                 # what it had used when it wrote the row
    Column("demand", Float, nullable=False),                 # its recent asks (admitted + refused)
    Column("heartbeat", Float, nullable=False),              # unix seconds of its last exchange
)

files = Table(
    "files", metadata,
    Column("id", String(40), primary_key=True),              # file-<hex>
    Column("tenant", String(64), nullable=False, index=True),
    Column("purpose", String(16), nullable=False),           # batch | batch_output
    Column("filename", String(256), nullable=False),
    Column("bytes", Integer, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Column("created_at", Float, nullable=False),
)

batches = Table(
    "batches", metadata,
    Column("id", String(40), primary_key=True),              # batch_<hex>
    Column("tenant", String(64), nullable=False, index=True),
    Column("key_prefix", String(16), nullable=False, default=""),   # the key that created it (billed with it)
    Column("endpoint", String(32), nullable=False),
    Column("input_file_id", String(40), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("total", Integer, nullable=False),                # lines of the input
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("errors", Text),                                  # JSON: why it failed validation
    Column("meta", Text),                                    # JSON: the metadata the client sent
    Column("output_file_id", String(40)),
    Column("error_file_id", String(40)),
    Column("owner", String(64)),                             # the router replica running it
    Column("lease_until", Float),                            # ... until then (unix seconds)
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("in_progress_at", Float),
    Column("finalizing_at", Float),
    Column("completed_at", Float),
    Column("failed_at", Float),
    Column("cancelling_at", Float),
    Column("cancelled_at", Float),
    Column("expired_at", Float),
)

batch_results = Table(
    "batch_results", metadata,
    Column("batch_id", String(40), primary_key=True),
    Column("line", Integer, primary_key=True),               # 0-based line of the input
    Column("ok", Integer, nullable=False),                   # 1: an output line, 0: an error line
    Column("text", Text, nullable=False),                    # the line, JSON
)

responses = Table(
    "responses", metadata,
    Column("id", String(64), primary_key=True),              # resp_<request id>
    Column("tenant", String(64), nullable=False, index=True),
    Column("previous_id", String(64)),                       # the response it continued, if any
    Column("status", String(16), nullable=False),            # queued | in_progress | completed | incomplete |
                                                             # failed | cancelled (the response's own)
    Column("owner", String(64)),                             # a background one: the router replica running it
    Column("lease_until", Float),                            # ... until then (unix seconds), renewed as it runs
    # A background one (not streamed): what runs it again on another router when its own is lost,
    # JSON {body, priority, key_prefix, runs}
    Column("request", Text),
    Column("input_items", Text, nullable=False),             # JSON: its own input items (earlier turns': theirs)
    Column("response", Text, nullable=False),                # JSON: the response object as answered
    Column("deleted", Integer, nullable=False, default=0),   # 1: deleted, its content gone, its link kept
    Column("bytes", Integer, nullable=False, default=0),     # its input_items and response JSON (ASCII)
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False, index=True),
)

response_events = Table(
    "response_events", metadata,
    Column("response_id", String(64), primary_key=True),
    Column("seq", Integer, primary_key=True),                # the event's sequence_number
    Column("event", Text, nullable=False),                   # JSON: the event as streamed
    Column("created_at", Float, nullable=False, index=True),
)

conversations = Table(
    "conversations", metadata,
    Column("id", String(64), primary_key=True),              # conv_<hex>
    Column("tenant", String(64), nullable=False, index=True),
    Column("meta", Text),                                    # JSON: the metadata the client set
    Column("created_at", Float, nullable=False),
    Column("bytes", Integer, nullable=False, default=0),     # its meta JSON
)

conversation_items = Table(
    "conversation_items", metadata,
    Column("conversation_id", String(64), primary_key=True),
    Column("position", Integer, primary_key=True),           # 0, 1, ... in the order items came
    Column("item_id", String(64), nullable=False, index=True),
    Column("item", Text, nullable=False),                    # JSON: the item (its id inside too)
    Column("bytes", Integer, nullable=False, default=0),     # the item's JSON
)

# version -> the statements that bring a database from version-1 to it (metadata.create_all has
# already created any missing table when they run).
MIGRATIONS: dict[int, list[str]] = {
    2: ["DELETE FROM tenant_spend",
        "INSERT INTO tenant_spend (tenant, amount) SELECT tenant, SUM(amount) FROM ledger GROUP BY tenant"],
    # storage limits: the rows' sizes (their JSON is ASCII: json.dumps escapes the rest), then the
    # totals (the store's upgrade calls storage_use.recount after these)
    6: ["UPDATE responses SET bytes = LENGTH(input_items) + LENGTH(response)",
        "UPDATE conversations SET bytes = COALESCE(LENGTH(meta), 0)",
        "UPDATE conversation_items SET bytes = LENGTH(item)"],
}

# version -> columns it added to existing tables (table, column, type and default), added by the
# upgrade where missing: rows written before have the default.
ADDED_COLUMNS: dict[int, list[tuple[str, str, str]]] = {
    # prefix caching: rows before it had no cached tokens and were billed in full
    3: [("ledger", "cached_tokens", "INTEGER NOT NULL DEFAULT 0"),
        ("ledger", "cached_fraction", "FLOAT NOT NULL DEFAULT 1.0")],
    6: [("tenants", "storage_mb", "INTEGER"), ("responses", "bytes", "INTEGER NOT NULL DEFAULT 0"),
        ("conversations", "bytes", "INTEGER NOT NULL DEFAULT 0"),
        ("conversation_items", "bytes", "INTEGER NOT NULL DEFAULT 0")],
    7: [("responses", "request", "TEXT")],          # background responses taken over
}

# Column sizes a caller must respect (they are checked before any write): tenant names up to
# TENANT_NAME_MAX (services/common/priority.py, where the routers check x-tenant by it too).
# Ids of files, batches and responses (ours: a prefix and random hex) are at most ROW_ID_MAX
# printable characters; one a client sends that is not (a NUL, which PostgreSQL refuses in a text
# comparison) names no row, and the stores answer so without asking the database.
ROW_ID_MAX = 64


def row_id(text: str) -> bool:
    return 0 < len(text) <= ROW_ID_MAX and text.isprintable()
