"""API keys for every /v1 route: `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
(Anthropic clients). /health and /metrics stay open for probes and scrapers.

Each key is a tenant: its requests carry a cache salt of their own, so a prefix one tenant cached
is never a hit for another (hit timing alone would tell one user what another sent). A server for
a single user can share the cache among its keys instead. What the server records of a tenant's
sessions (rewind.server.sessions) is filed under its tenant id; only an admin key (--admin-key)
sees every tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from rewind.config import ServerConfig
from rewind.server.errors import ApiError, error_response, flavor_for_path


@dataclass(frozen=True)
class ApiKey:
    secret: str
    name: str
    admin: bool = False  # sees every tenant's sessions, not only its own
    # May change what is on the server's disk (pull a model): the admin key, and --api-key on
    # a server without --api-key-file (its one user). Tenants of a key file may not: a pull
    # fills a disk they share.
    operator: bool = False

    @property
    def tenant_id(self) -> str:
        """Who a request is, for what the server records per tenant: from the secret, not the
        name (two keys may share a name), and one-way (it is shown in the API)."""
        return hashlib.sha256(b"rewind-tenant-id\x00" + self.secret.encode()).hexdigest()[:16]


class KeyRing:
    """The keys a server accepts, and the cache salt of each."""

    def __init__(self, keys: list[ApiKey], shared_cache: bool = False) -> None:
        secrets = [key.secret for key in keys]
        if len(set(secrets)) != len(secrets):
            raise ValueError("the same API key is listed twice")
        self.keys = keys
        self.shared_cache = shared_cache

    @classmethod
    def from_file(cls, path: Path, shared_cache: bool = False) -> "KeyRing":
        """One key per line, optionally followed by a name (`sk-... alice`); # starts a comment."""
        keys = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) > 2:
                raise ValueError(f"{path}:{number}: expected `KEY [NAME]`, got {len(words)} words")
            keys.append(ApiKey(words[0], words[1] if len(words) == 2 else f"key-{number}"))
        if not keys:
            raise ValueError(f"{path} lists no API key")
        return cls(keys, shared_cache)

    def match(self, presented: str | None) -> ApiKey | None:
        """The key presented, compared with every key in constant time (no early exit, so the
        time taken tells nothing about which key or how much of one matched)."""
        if presented is None:
            return None
        found = None
        candidate = presented.encode()
        for key in self.keys:
            if hmac.compare_digest(candidate, key.secret.encode()):
                found = key
        return found

    def cache_salt(self, key: ApiKey) -> str:
        if self.shared_cache:
            return ""
        return hashlib.sha256(b"rewind-tenant\x00" + key.secret.encode()).hexdigest()


def key_ring(config: ServerConfig) -> KeyRing | None:
    """The keys of --api-key and --api-key-file; None when neither is set (an open server)."""
    keys = []
    if config.api_key:
        keys.append(ApiKey(config.api_key, "api-key", operator=config.api_key_file is None))
    if config.api_key_file is not None:
        keys.extend(KeyRing.from_file(Path(config.api_key_file)).keys)
    if config.admin_key:
        keys.append(ApiKey(config.admin_key, "admin", admin=True, operator=True))
    return KeyRing(keys, config.shared_cache) if keys else None


def presented_key(headers: dict[str, str]) -> str | None:
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def request_cache_salt(scope: Scope) -> str:
    """The tenant's cache salt the middleware put in the request's state ("" without keys)."""
    return str(scope.get("state", {}).get("cache_salt", ""))


def request_tenant(scope: Scope) -> tuple[str, bool]:
    """(tenant id, admin) of the request: ("", True) on a server without keys, where the one
    user is everyone."""
    state = scope.get("state", {})
    if "tenant_id" not in state:
        return "", True
    return str(state["tenant_id"]), bool(state.get("admin"))


def request_operator(scope: Scope) -> bool:
    """Whether the request may change the server's disk (ApiKey.operator); True on a server
    without keys."""
    state = scope.get("state", {})
    return "tenant_id" not in state or bool(state.get("operator"))


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyRing | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or self.keys is None or not path.startswith("/v1"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        presented = presented_key(headers)
        key = self.keys.match(presented)
        if key is not None:
            state = scope.setdefault("state", {})
            state["tenant"] = key.name
            state["cache_salt"] = self.keys.cache_salt(key)
            state["tenant_id"] = key.tenant_id
            state["admin"] = key.admin
            state["operator"] = key.operator
            await self.app(scope, receive, send)
            return
        message = "missing API key" if presented is None else "invalid API key"
        error = ApiError(401, "authentication", f"{message}: send `Authorization: Bearer <key>` "
                         "or `x-api-key: <key>`", code="invalid_api_key")
        await error_response(error, flavor_for_path(path))(scope, receive, send)
