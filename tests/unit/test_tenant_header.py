"""x-tenant is checked at both fronts against the store's rule for tenant names (1-64 printable
characters): a name the ledger could not store never reaches its batch."""
import pytest

from services.common.errors import ServiceError
from services.common.priority import TENANT_NAME_MAX, parse_tenant
from services.router.validation import parse_head
from services.store.schema import ledger, tenants


def test_the_bound_is_the_ledgers_and_the_tenants_column_size():
    assert ledger.c.tenant.type.length == tenants.c.name.type.length == TENANT_NAME_MAX


@pytest.mark.parametrize("value", ["", None, "acme", "t" * TENANT_NAME_MAX, "Ünïcode ok"])
def test_names_a_tenant_could_have_pass(value):
    assert parse_tenant(value) == (value or "")


@pytest.mark.parametrize("value, words", [("t" * (TENANT_NAME_MAX + 1), "65 characters long"),
                                          ("a\nb", "control character"), ("tab\there", "control character")])
def test_other_names_are_invalid_naming_the_header(value, words):
    with pytest.raises(ServiceError) as caught:
        parse_head({"x-tenant": value})
    assert caught.value.field == "x-tenant" and words in str(caught.value)
