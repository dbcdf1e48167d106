"""Sealed compaction items: what a client carries back (`encrypted_content`) and kvserve alone can read.

The payload (the summary's text, the tenant it belongs to, the model that wrote it) is encrypted and then
signed: a keystream of HMAC-SHA256 blocks over a random nonce (a PRF in counter mode), and an HMAC-SHA256
tag over the nonce and the ciphertext, each with its own key derived from the server's secret. A changed
byte, another server's item or another tenant's is refused (a 400), never read. The client learns nothing
of the text from the item itself (the summary is the model's own words, not a secret from the client:
opacity keeps clients from editing it, so the prefix it renders is the one the cache holds).

The secret: `--compaction-secret` / KVSERVE_COMPACTION_SECRET, or else one kept (owner-only) in the
Responses store's directory so items outlive a restart, or else a random one for this process.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import InvalidRequestError

log = logging.getLogger(__name__)

_VERSION = b"kvc1"
_NONCE_BYTES = 16
_TAG_BYTES = 32
SECRET_FILE = "compaction-secret"


@dataclass(frozen=True)
class Compaction:
    """What a sealed item carries: enough to render the compacted history exactly."""

    summary: str
    tenant: str
    model: str


class Sealer:
    """Seals and opens compaction items with one server secret (thread-safe: no state but the keys)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the compaction secret must be at least 16 bytes")
        self._cipher_key = hmac.new(secret, b"kvserve-compaction-cipher", hashlib.sha256).digest()
        self._tag_key = hmac.new(secret, b"kvserve-compaction-tag", hashlib.sha256).digest()

    def _keystream(self, nonce: bytes, length: int) -> bytes:
        blocks = (hmac.new(self._cipher_key, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
                  for counter in range(-(-length // 32)))
        return b"".join(blocks)[:length]

    def _tag(self, nonce: bytes, ciphertext: bytes) -> bytes:
        return hmac.new(self._tag_key, _VERSION + nonce + ciphertext, hashlib.sha256).digest()

    def seal(self, compaction: Compaction) -> str:
        plain = json.dumps({"s": compaction.summary, "t": compaction.tenant, "m": compaction.model},
                           ensure_ascii=False).encode()
        nonce = secrets.token_bytes(_NONCE_BYTES)
        cipher = bytes(a ^ b for a, b in zip(plain, self._keystream(nonce, len(plain))))
        return base64.urlsafe_b64encode(_VERSION + nonce + cipher + self._tag(nonce, cipher)).decode()

    def open(self, sealed: str, tenant: str, model: str, param: str = "input") -> Compaction:
        """The compaction in `sealed` if this server sealed it for `tenant` and `model`; else a 400."""
        try:
            raw = base64.urlsafe_b64decode(sealed.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            raw = b""
        head, body = raw[:len(_VERSION) + _NONCE_BYTES], raw[len(_VERSION) + _NONCE_BYTES:]
        if len(body) < _TAG_BYTES or not head.startswith(_VERSION):
            raise _refused(param)
        nonce, cipher, tag = head[len(_VERSION):], body[:-_TAG_BYTES], body[-_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(nonce, cipher)):
            raise _refused(param)
        data = json.loads(bytes(a ^ b for a, b in zip(cipher, self._keystream(nonce, len(cipher)))))
        # Another tenant's item reads exactly like a forged one: it says nothing about that tenant.
        if data["t"] != tenant or data["m"] != model:
            raise _refused(param)
        return Compaction(data["s"], data["t"], data["m"])


def _refused(param: str) -> InvalidRequestError:
    return InvalidRequestError("the compaction item's encrypted_content is not one this server issued to this API "
                               "key for this model (changed, forged, or another key's)", param=param)


def server_secret(configured: str | None, directory: Path | None) -> bytes:
    """The secret items are sealed with (see the module doc)."""
    if configured:
        return configured.encode()
    if directory is not None:
        path = directory / SECRET_FILE
        try:
            if not path.exists():
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:  # a replica sharing the directory wrote it first
                    pass
                else:
                    with os.fdopen(fd, "w") as file:
                        file.write(secrets.token_bytes(32).hex())
            return bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError) as exc:
            log.error("compaction: cannot keep a secret in %s (%s); items will not outlive this process", path, exc)
    return secrets.token_bytes(32)
