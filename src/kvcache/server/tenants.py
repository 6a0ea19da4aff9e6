"""API keys and the tenants they stand for: `--api-keys FILE` gives each key a tenant whose
requests share no cached blocks with another tenant's, and says which keys may read /metrics.

    KEY                   a tenant of its own
    KEY NAME              tenant NAME (the keys of one name are one tenant, e.g. while rotating)
    KEY NAME admin        tenant NAME, and this key may read /metrics (every tenant's traffic)

Blank lines and lines starting with '#' are skipped. Every request of a tenant gets a cache salt
derived from the tenant (`Tenant.salt`); a request's own `cache_salt` is combined with it, never
replacing it, so no request can name another tenant's salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass

from kvcache.files import read_text

MAX_KEYS_FILE_BYTES = 1 << 20  # an --api-keys file's size at most
ADMIN = "admin"  # the third word of a key's line whose holder may read /metrics


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: `name` (for people), `identity` (what its salts derive from: its name,
    or the key's digest for a key with none) and `admin` (this key may read /metrics)."""

    name: str
    identity: str
    admin: bool

    def salt(self, requested: str | None) -> str:
        """The cache salt of a request of this tenant that asked for `requested` (its own
        `cache_salt`, or None): a digest of both, so requests of two tenants never share a salt
        whatever they ask for, and a tenant's own salts still part its requests."""
        material = json.dumps([self.identity, requested], ensure_ascii=True).encode("ascii")
        digest = hashlib.blake2b(material, digest_size=16, person=b"kvcache tenant").hexdigest()
        return f"tenant {digest}"


class ApiKeys:
    """The keys a server accepts, each with its tenant; `tenant_of(token)` compares a token with
    every key in constant time (no early return on a match)."""

    def __init__(self, tenants: dict[str, Tenant]) -> None:
        if not tenants:
            raise ValueError("an API key list needs at least one key")
        self._keys = [(_digest(key), tenant) for key, tenant in tenants.items()]

    def tenant_of(self, token: str) -> Tenant | None:
        given, found = _digest(token), None
        for digest, tenant in self._keys:
            if hmac.compare_digest(given, digest):
                found = tenant
        return found

    @property
    def tenants(self) -> list[Tenant]:
        return [tenant for _, tenant in self._keys]


def api_keys(path: str | None, api_key: str | None = None) -> ApiKeys | None:
    """The keys of an --api-keys file (None without one) and `api_key` (--api-key: an admin key of
    a tenant of its own) beside them; ValueError naming the file and line of a bad one."""
    if path is None:
        return None
    tenants = read_api_keys(path)
    if api_key:
        if api_key in tenants:
            raise ValueError(f"--api-keys {path}: holds the --api-key key too; give it once")
        tenants[api_key] = _unnamed(api_key, admin=True)
    return ApiKeys(tenants)


def read_api_keys(path: str | os.PathLike) -> dict[str, Tenant]:
    """key -> Tenant for each key line of an --api-keys file; ValueError naming the line of a bad
    one (or a file too large, not UTF-8, or without keys); OSError when it cannot be read."""
    text = read_text(path, "--api-keys file", MAX_KEYS_FILE_BYTES)
    tenants: dict[str, Tenant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"--api-keys {os.fspath(path)}, line {number}"
        if len(words) > 3 or (len(words) == 3 and words[2] != ADMIN):
            raise ValueError(f"{where}: expected 'KEY', 'KEY NAME' or 'KEY NAME {ADMIN}', got {len(words)} "
                             f"words (the third, when given, must be '{ADMIN}')")
        key = words[0]
        if not key.isascii() or not key.isprintable():
            raise ValueError(f"{where}: a key must be printable ASCII (it travels in an HTTP header)")
        if key in tenants:
            raise ValueError(f"{where}: this key is on an earlier line too")
        if len(words) == 2 and words[1] == ADMIN:
            raise ValueError(f"{where}: 'KEY {ADMIN}' names a tenant '{ADMIN}', not an admin key: write "
                             f"'KEY NAME {ADMIN}'")
        admin = len(words) == 3
        tenants[key] = Tenant(words[1], "name " + words[1], admin) if len(words) > 1 else _unnamed(key, admin)
    if not tenants:
        raise ValueError(f"--api-keys {os.fspath(path)}: no keys (one a line: KEY [NAME [{ADMIN}]])")
    return tenants


def _unnamed(key: str, admin: bool) -> Tenant:
    """The tenant of a key with no name: its own, named by its digest's first characters."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return Tenant(f"key-{digest[:8]}", "key " + digest, admin)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
