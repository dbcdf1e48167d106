"""Who is calling: the one way a request's headers become its tenant's API key.

Every route that serves a tenant depends on `api_key_dependency`; the key it
returns is what `Tenancy.cache_salt` and the Responses store derive the
tenant's salt and ownership from, so no route can name a tenant another way.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping

from fastapi import Request

from kvserve.server.core.errors import APIError, unauthorized
from kvserve.server.core.tenancy import Tenancy, tenant_id


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


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <key>` (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def pool_viewer_dependency(tenancy: Tenancy, admin_key: str | None) -> Callable[[Request], Awaitable[str | None]]:
    """A dependency for the pool's report (/v1/kv_cache): None for a caller who may see every tenant's
    share (the admin key, or anyone on a server without tenant keys), else the caller's tenant id."""

    async def viewer(request: Request) -> str | None:
        if admin_key and bearer_matches(request.headers.get("authorization"), admin_key):
            return None
        key = tenant_key(tenancy, request.headers)
        return tenant_id(key) if tenancy.requires_key else None

    return viewer


def metrics_guard(keys: list[str]) -> Callable[[Request], Awaitable[None]]:
    """A dependency for /metrics: open when `keys` is empty (as scrapers expect), else any of them."""

    async def guard(request: Request) -> None:
        authorization = request.headers.get("authorization")
        if keys and not any(bearer_matches(authorization, key) for key in keys):
            raise APIError(401, "/metrics needs the metrics key (--metrics-key) or the admin key, sent as "
                                "'Authorization: Bearer <key>'.", code="invalid_metrics_key")

    return guard
