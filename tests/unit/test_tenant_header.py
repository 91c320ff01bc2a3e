"""x-tenant is checked at both fronts against the store's rule for tenant names (1-64 printable
characters): a name the ledger could not store never reaches its batch. And each header both
fronts read is taken once: twice with different values is refused, naming it."""
import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import TENANT_NAME_MAX, parse_tenant
from services.router.validation import parse_head, request_headers
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


def test_a_header_sent_twice_must_say_one_thing():
    """HTTP took the first of two x-priority headers and gRPC the last: each served a request as
    one of them without a word."""
    assert request_headers([("X-Priority", "high"), ("x-priority", "high"), ("x-other", "1"), ("x-other", "2")]) \
        == {"x-priority": "high"}
    for name in ("x-priority", "authorization", "x-tenant", "x-slo-ms"):
        try:
            request_headers([(name, "a"), ("Content-Type", "x"), (name.upper(), "b")])
        except ServiceError as error:
            assert (error.kind, error.field) == (ErrorKind.INVALID, name) and "sent twice" in error.message
        else:
            raise AssertionError(f"{name} twice, differently, was taken")


def test_the_same_value_in_another_case_is_no_conflict_and_auth_off_ignores_a_second_key():
    assert request_headers([("x-priority", "High"), ("X-Priority", " high ")]) == {"x-priority": "High"}
    proxied = [("authorization", "Bearer EMPTY"), ("Authorization", "Basic cHJveHk6c2VjcmV0")]
    assert request_headers(proxied, auth_required=False) == {"authorization": "Bearer EMPTY"}
    try:
        request_headers(proxied, auth_required=True)
    except ServiceError as error:
        assert error.field == "authorization"
    else:
        raise AssertionError("two keys with auth on were taken")
