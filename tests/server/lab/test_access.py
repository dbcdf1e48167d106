"""Who may open the lab: open without keys, shut with tenant keys alone, the admin key's only with one."""

import pytest

from kvserve.server.core.errors import APIError
from kvserve.server.lab.access import LabAccess
from tests.server.inprocess import serve_in_process, with_tiny_tokenizer

DATA_ROUTES = ["/lab/api/info", "/lab/api/snapshot", "/lab/api/models", "/lab/api/recent",
               "/lab/api/memory?model=Llama-3.1-8B"]


def test_lab_access_rules():
    LabAccess(None).check(None)  # local use: open
    with pytest.raises(APIError) as closed:
        LabAccess(None, ["tenant"]).check("Bearer tenant")
    assert closed.value.status == 403 and "--admin-key" in closed.value.message
    admin = LabAccess("root", ["tenant"])
    admin.check("Bearer root")
    admin.check("bearer root ")
    for header in (None, "", "Bearer", "Bearer tenant", "Bearer roo", "Bearer root2", "root", "Basic root"):
        with pytest.raises(APIError) as refused:
            admin.check(header)
        assert refused.value.status == 401


def test_open_server_serves_the_lab_to_anyone(lab_app):
    for path in DATA_ROUTES:
        assert lab_app.get(path).status_code == 200, path


@pytest.fixture(scope="module")
def keyed_apps(tiny_models):
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    with serve_in_process(loaded, api_keys=["tenant-key"]) as closed, \
            serve_in_process(loaded, api_keys=["tenant-key"], admin_key="admin-key") as admin:
        yield closed, admin


def test_tenant_keys_alone_keep_the_lab_shut(keyed_apps):
    closed, _ = keyed_apps
    for path in DATA_ROUTES:
        response = closed.get(path, headers={"Authorization": "Bearer tenant-key"})
        assert response.status_code == 403 and "--admin-key" in response.json()["error"]["message"], path
    assert closed.get("/lab/api/feed").status_code == 403
    assert closed.post("/lab/api/steps", json={"prompt": "The"}).status_code == 403
    # the pages are static shells with no data; they ask for the key
    assert closed.get("/lab").status_code == 200 and "kvserve lab" in closed.get("/lab").text


def test_admin_key_opens_the_lab_and_nothing_else(keyed_apps):
    _, admin = keyed_apps
    for path in DATA_ROUTES:
        assert admin.get(path).status_code == 401, path
        assert admin.get(path, headers={"Authorization": "Bearer tenant-key"}).status_code == 401, path
        assert admin.get(path, headers={"Authorization": "Bearer admin-key"}).status_code == 200, path
    assert admin.post("/lab/api/explain", json={"prompt": "The"},
                      headers={"Authorization": "Bearer tenant-key"}).status_code == 401
    # the admin key is not a tenant: it does not open the API
    assert admin.get("/v1/models", headers={"Authorization": "Bearer admin-key"}).status_code == 401
    assert admin.get("/v1/models", headers={"Authorization": "Bearer tenant-key"}).status_code == 200
