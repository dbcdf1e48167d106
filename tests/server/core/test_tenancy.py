"""API-key checks and the salts they derive (no server needed)."""

from kvserve.server.core.tenancy import Tenancy


def test_without_keys_everyone_is_the_anonymous_tenant():
    tenancy = Tenancy()
    assert tenancy.authenticate(None) == "" and tenancy.authenticate("Bearer anything") == ""
    assert tenancy.cache_salt("", None) is None  # everyone shares
    assert tenancy.cache_salt("", "a") == tenancy.cache_salt("", "a") != tenancy.cache_salt("", "b")


def test_keys_are_checked_exactly():
    tenancy = Tenancy(["alice", "bob"])
    assert tenancy.authenticate("Bearer alice") == "alice"
    assert tenancy.authenticate("bearer bob") == "bob"
    for header in (None, "", "Bearer", "Bearer alic", "Bearer alice2", "alice", "Basic alice"):
        assert tenancy.authenticate(header) is None


def test_salts_separate_tenants_and_client_salts_cannot_reach_across():
    tenancy = Tenancy(["alice", "bob"])
    alice, bob = tenancy.cache_salt("alice", None), tenancy.cache_salt("bob", None)
    assert alice != bob and alice is not None
    # Whatever bob sends, including alice's derived salt, he stays in his own space.
    reachable_by_bob = {tenancy.cache_salt("bob", s) for s in (None, "x", alice, "alice")}
    assert alice not in reachable_by_bob
    assert tenancy.cache_salt("alice", "x") not in {alice, tenancy.cache_salt("bob", "x")}
