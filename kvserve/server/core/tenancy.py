"""Who is calling: API-key checks and the prefix-cache salt derived from the key.

Each API key is a tenant (core/auth.py reads it from a request's headers).
The salt that roots a request's prefix-cache chain is derived here, on the
server, from the key; a client-sent `cache_salt` is mixed into it, so a client
can split its own traffic further (narrow sharing) but can never name another
tenant's salt (widen it). Stored state (Responses) is filed under `tenant_id`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from kvserve.errors import ConfigError, InvalidRequestError


def tenant_id(api_key: str) -> str:
    """The tenant's stable id, what its stored state (Responses) is filed under: a digest, never the key."""
    return hashlib.sha256(b"kvserve-responses\0" + api_key.encode()).hexdigest()[:32]


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


class Tenancy:
    def __init__(self, api_keys: Sequence[str] = ()) -> None:
        self.api_keys = [key for key in api_keys if key]

    @property
    def requires_key(self) -> bool:
        return bool(self.api_keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The caller's key from an `Authorization: Bearer` header, or None if it is not accepted.

        Without configured keys everyone is accepted (as the anonymous tenant "").
        """
        if not self.requires_key:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        token = token.strip()
        # Compare against every key in constant time: no early exit that leaks which prefix matched.
        matched = [key for key in self.api_keys if hmac.compare_digest(token.encode(), key.encode())]
        return matched[0] if matched else None

    def weights(self, weights: Sequence[float]) -> dict[str | None, float]:
        """Each tenant's weight by its id (`tenant_id`), from weights in --api-key order (missing ones: 1)."""
        if len(weights) > len(self.api_keys):
            raise ConfigError(f"--tenant-weights gives {len(weights)} weights for {len(self.api_keys)} API keys")
        if any(not weight > 0 for weight in weights):
            raise ConfigError("--tenant-weights must be positive numbers")
        padded = [*weights, *[1.0] * (len(self.api_keys) - len(weights))]
        return {tenant_id(key): float(weight) for key, weight in zip(self.api_keys, padded)}

    def key_of_tenant(self, tenant: int | None) -> str:
        """The key of tenant number `tenant` (1-based, in --api-key order), for the lab's operator."""
        if not self.api_keys:
            return ""
        if tenant is None or not 1 <= tenant <= len(self.api_keys):
            raise InvalidRequestError(f"this server has {len(self.api_keys)} tenants: choose tenant "
                                      f"1..{len(self.api_keys)}", param="tenant")
        return self.api_keys[tenant - 1]

    def cache_salt(self, api_key: str, client_salt: str | None) -> str | None:
        """The prefix-cache salt for a request from `api_key` carrying `client_salt`."""
        if not api_key:  # no tenants: the client's salt alone (None shares with everyone)
            return None if client_salt is None else _digest("client", client_salt)
        tenant = _digest("tenant", api_key)
        return tenant if client_salt is None else _digest(tenant, client_salt)
