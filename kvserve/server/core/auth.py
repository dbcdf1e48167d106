"""Who is calling: the one way a request's headers become its tenant's API key.

Every route that serves a tenant depends on `api_key_dependency`; the key it
returns is what `Tenancy.cache_salt` and the Responses store derive the
tenant's salt and ownership from, so no route can name a tenant another way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import Request

from kvserve.server.core.errors import unauthorized
from kvserve.server.core.tenancy import Tenancy


def tenant_key(tenancy: Tenancy, headers: Mapping[str, str], *, accept_x_api_key: bool = False) -> str:
    """The caller's API key (its tenant; "" when the server has no keys), or a 401 APIError.

    `accept_x_api_key`: Anthropic's clients send `x-api-key: KEY`; a Bearer header works there too.
    Both name the same tenants.
    """
    x_api_key = headers.get("x-api-key") if accept_x_api_key else None
    key = tenancy.authenticate(f"Bearer {x_api_key}" if x_api_key else headers.get("authorization"))
    if key is None:
        raise unauthorized()
    return key


def api_key_dependency(tenancy: Tenancy, *, accept_x_api_key: bool = False) -> Callable[[Request], Awaitable[str]]:
    """A FastAPI dependency giving the route the caller's key (`tenant_key`)."""

    async def api_key(request: Request) -> str:
        return tenant_key(tenancy, request.headers, accept_x_api_key=accept_x_api_key)

    return api_key
