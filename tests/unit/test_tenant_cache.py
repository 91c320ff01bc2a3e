"""The router's copy of the tenant store (services/control/tenancy.py) while the store cannot be
read: tenants without limits are served, tenants with limits or a budget are refused
(UNAVAILABLE, with a retry-after) once the copy is older than stale_s, the outage shows on
/metrics, and a key revoked meanwhile stops working at the first refresh after it."""
from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import PRIORITIES
from services.control.tenancy import TenantBook, store_metrics
from services.store.store import Tenant, hash_key

TENANTS = [Tenant("free"), Tenant("capped", rpm=1000), Tenant("budgeted", budget=100.0),
           Tenant("streams", max_concurrent=10)]


class FlakyStore:
    url = "fake://"

    def __init__(self):
        self.down = False
        self.keys = {hash_key(f"key-{t.name}"): (t.name, f"qsk_{t.name}") for t in TENANTS}

    def snapshot(self):
        if self.down:
            raise OSError("connection timeout expired")
        return dict(self.keys), list(TENANTS), {}, {}


def admit(book: TenantBook, key: str):
    return book.admit(book.authenticate(f"Bearer {key}"), PRIORITIES["medium"], 10)


def metrics(book: TenantBook) -> dict:
    return {m.name: m.samples[0].value for m in store_metrics(book)}


def test_limited_tenants_fail_closed_after_stale_s_and_unlimited_ones_are_served():
    store = FlakyStore()

    async def body():
        book = TenantBook(store, required=True, admin_key="root", refresh_s=0.02, stale_s=0.3)
        await book.refresh()
        task = asyncio.create_task(book.keep_fresh())
        try:
            store.down = True
            del store.keys[hash_key("key-free")]                  # revoked while the store is unreachable
            # Within stale_s of the last read: all served. Taken before the first await, so the
            # copy's age is this loop's, not the host's scheduling (a loaded host once slept the
            # loop past stale_s inside a 0.1 s sleep).
            early = [admit(book, f"key-{t.name}").caller.name for t in TENANTS]
            await asyncio.sleep(0.4)
            refused = {}
            for tenant in TENANTS:
                try:
                    admit(book, f"key-{tenant.name}")
                except ServiceError as error:
                    refused[tenant.name] = error
            admin = admit(book, "root").caller.admin
            during = metrics(book)
            store.down = False
            await asyncio.sleep(0.1)
            after = [admit(book, f"key-{t.name}").caller.name for t in TENANTS[1:]]
            with pytest.raises(ServiceError) as revoked:
                admit(book, "key-free")
            return early, refused, admin, during, after, revoked.value, metrics(book)
        finally:
            task.cancel()

    early, refused, admin, during, after, revoked, recovered = asyncio.run(body())
    assert early == [t.name for t in TENANTS] and admin
    assert sorted(refused) == ["budgeted", "capped", "streams"]          # "free" (its key still cached) is served
    error = refused["capped"]
    assert error.kind == ErrorKind.UNAVAILABLE and error.reason == "store_unreachable"
    assert error.retry_after_ms == 20 and "tenant store" in str(error)
    assert during["qos_store_limits_failing_closed"] == 1 and during["qos_store_failing_refreshes"] > 3
    assert during["qos_store_seconds_since_read"] > 0.3
    assert after == ["capped", "budgeted", "streams"] and revoked.kind == ErrorKind.UNAUTHENTICATED
    assert recovered["qos_store_limits_failing_closed"] == 0 and recovered["qos_store_failing_refreshes"] == 0
