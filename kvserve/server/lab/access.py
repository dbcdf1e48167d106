"""Who may open the lab: it shows every tenant's requests and blocks, so it is an operator's tool.

- No key configured at all (local use): the lab is open, as the API is.
- `--admin-key`: the lab's data needs that key (`Authorization: Bearer`), and tenant keys never open it.
- `--api-key` without `--admin-key`: the lab stays shut (403), since no key may see across tenants.

Only the lab's data is guarded (its JSON endpoints and the live feed); the pages themselves are
static files with no data in them, which ask for the key and send it with every request.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.server.core.auth import bearer_matches
from kvserve.server.core.errors import APIError


class LabAccess:
    def __init__(self, admin_key: str | None, api_keys: Sequence[str] = ()) -> None:
        self.admin_key = admin_key or None
        self.has_tenant_keys = any(api_keys)

    @property
    def requires_key(self) -> bool:
        return self.admin_key is not None

    @property
    def closed(self) -> bool:
        """Tenants are configured but no admin key is: nobody may see across tenants."""
        return self.admin_key is None and self.has_tenant_keys

    def check(self, authorization: str | None) -> None:
        """Raise APIError unless `authorization` (an HTTP header value) opens the lab."""
        if self.closed:
            raise APIError(403, "The lab shows every tenant's requests, so with --api-key set it needs its own "
                                "key: start the server with --admin-key KEY.", code="lab_disabled")
        if self.admin_key is None:
            return
        if not bearer_matches(authorization, self.admin_key):
            raise APIError(401, "The lab needs the admin key (--admin-key), sent as 'Authorization: Bearer <key>'.",
                           code="invalid_admin_key")
