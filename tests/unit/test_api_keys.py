"""API keys at the router's gate (services/control/tenancy.py): what is not a key of ours is
refused as such, never an internal error."""
from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.control.tenancy import ANONYMOUS, TenantBook
from services.store.store import Store, StoreError, Tenant


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'keys.db'}")
    yield store
    store.close()


@pytest.mark.parametrize("key, offset", [("qsk_clé", 6), ("qsk_日本", 4), ("qsk_a\x01b", 5), ("q\u00a0sk", 1)])
def test_a_key_that_is_not_printable_ascii_is_unauthenticated(store, key, offset):
    # hmac.compare_digest raises TypeError on a non-ASCII str: this was a 500 with an admin key set.
    book = TenantBook(store, required=True, admin_key="admin-secret")
    with pytest.raises(ServiceError) as caught:
        book.authenticate(f"Bearer {key}")
    error = caught.value
    assert (error.kind, error.field) == (ErrorKind.UNAUTHENTICATED, "authorization")
    assert f"not printable ASCII at offset {offset}" in error.message


def test_with_auth_off_such_a_key_is_no_key(store):
    book = TenantBook(store, required=False, admin_key="admin-secret")
    assert book.authenticate("Bearer qsk_clé", "acme").name == "acme"
    assert book.authenticate("Bearer qsk_clé").name == ANONYMOUS


@pytest.mark.parametrize("tenant, says", [("t" * 65, "65 characters"), ("a\x01b", "control character"),
                                          ("admin", "reserved: it names the admin key's requests")])
def test_with_auth_off_a_tenant_header_that_names_no_tenant_is_invalid(store, tenant, says):
    # As on Generate: /v1/usage, /v1/alerts and the console read x-tenant here.
    book = TenantBook(store, required=False)
    with pytest.raises(ServiceError) as caught:
        book.authenticate(None, tenant)
    assert (caught.value.kind, caught.value.field) == (ErrorKind.INVALID, "x-tenant")
    assert says in caught.value.message
    assert book.authenticate(None, "t" * 64).name == "t" * 64


def test_the_admin_key_still_opens(store):
    book = TenantBook(store, required=True, admin_key="admin-secret")
    assert book.authenticate("Bearer admin-secret").admin


def test_no_tenant_can_take_the_admin_keys_name(store, tmp_path):
    """The admin key's requests are tenant 'admin' in the ledger, the request table and the prefix
    cache's scope: a tenant of that name, with a key of its own, read and cancelled the operator's
    requests, hit its cached prompts and was billed for its traffic."""
    with pytest.raises(StoreError, match="'admin' is reserved"):
        store.add_tenant(Tenant("admin"))
    # A store written before the name was reserved: its keys are refused, not taken as the admin.
    store.add_tenant(Tenant("placeholder"))
    key, _ = store.create_key("placeholder")
    with store.engine.begin() as db:
        db.exec_driver_sql("UPDATE tenants SET name = 'admin' WHERE name = 'placeholder'")
    book = TenantBook(store, required=True, admin_key="admin-secret")
    asyncio.run(book.refresh())
    with pytest.raises(ServiceError) as caught:
        book.authenticate(f"Bearer {key}")
    assert (caught.value.kind, caught.value.reason) == (ErrorKind.PERMISSION_DENIED, "reserved_tenant")
    assert book.authenticate("Bearer admin-secret").admin
