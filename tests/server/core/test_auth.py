"""The one way a request's headers name its tenant (no server needed)."""

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.core.auth import tenant_key
from kvserve.server.core.errors import APIError
from kvserve.server.core.tenancy import Tenancy, tenant_id


def test_a_bearer_header_names_the_tenant_and_x_api_key_only_where_accepted():
    tenancy = Tenancy(["alice", "bob"])
    assert tenant_key(tenancy, {"authorization": "Bearer alice"}) == "alice"
    with pytest.raises(APIError) as info:
        tenant_key(tenancy, {"x-api-key": "bob"})
    assert info.value.status == 401
    assert tenant_key(tenancy, {"x-api-key": "bob"}, accept_x_api_key=True) == "bob"
    assert tenant_key(tenancy, {"authorization": "Bearer alice"}, accept_x_api_key=True) == "alice"
    assert tenant_key(Tenancy(), {}) == ""  # no keys configured: the anonymous tenant


def test_the_lab_picks_a_tenant_by_number_and_stored_state_is_filed_under_a_digest():
    tenancy = Tenancy(["alice", "bob"])
    assert tenancy.key_of_tenant(2) == "bob" and Tenancy().key_of_tenant(None) == ""
    with pytest.raises(InvalidRequestError, match="this server has 2 tenants: choose tenant 1..2"):
        tenancy.key_of_tenant(3)
    assert tenant_id("alice") == tenant_id("alice") != tenant_id("bob") and "alice" not in tenant_id("alice")
