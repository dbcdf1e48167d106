"""The pages and their static files: served by the app, complete, and with nothing fetched from elsewhere."""

import re

import pytest

from kvserve.server.lab.routes import PAGES, STATIC_DIR


@pytest.mark.parametrize("path", ["/lab", "/lab/", "/lab/memory", "/lab/steps", "/lab/explain"])
def test_pages_are_served(lab_app, path):
    response = lab_app.get(path)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "<nav>" in response.text


def test_every_referenced_static_file_exists_and_nothing_is_remote(lab_app):
    for filename in PAGES.values():
        html = (STATIC_DIR / filename).read_text()
        assets = re.findall(r'(?:src|href)="(/lab/static/[^"]+)"', html)
        assert {"/lab/static/lab.css", "/lab/static/common.js"} <= set(assets), filename
        for asset in assets:
            assert lab_app.get(asset).status_code == 200, asset
    for path in STATIC_DIR.iterdir():  # offline: no CDN, no remote font, no external script
        assert not re.search(r'(?:src|href)="(?:https?:)?//', path.read_text()), path.name
        assert "import(" not in path.read_text() and "@import" not in path.read_text(), path.name
