"""Tokens and authentication: bearer token → ``Principal``, and the admin's token creation.

Static tokens (given to ``create_app``) are consulted on every request; database tokens are
stored as their sha256 only and remembered for ``TOKEN_CACHE_SECONDS`` after a lookup. This
room does not decide what a principal may do: the access checks are in ``base.ServiceBase``.
"""
from __future__ import annotations

import logging
import secrets
import time
import uuid

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from memfuse.models import TokenCreate, TokenCreated, sha256_hex
from memfuse.server.base import (
    _T,
    IdempotencyRequest,
    Principal,
    Reply,
    ServiceBase,
    ServiceError,
    _unauthorized,
)
from memfuse.server.db import TokenRow, WorkspaceRow, utcnow

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

TOKEN_CACHE_SECONDS = 30.0  # a database token is looked up again after this long
TOKEN_CACHE_MAX = 4096  # entries; the cache is emptied when full

_SELECT_TOKEN = select(_T.c.id, _T.c.workspace, _T.c.name).where(_T.c.token_sha256 == bindparam("digest"))


def _clean_instance(value: str | None) -> str | None:
    if not value:
        return None
    value = "".join(ch for ch in value.strip() if ch.isprintable() and ch not in "/ ")[:100]
    return value or None


class TokensMixin(ServiceBase):
    """``Service`` methods: ``authenticate``, ``authenticate_cached``, ``create_token``."""

    def authenticate(self, token: str | None, instance: str | None = None) -> Principal:
        """Resolve a bearer token. Raises ``ServiceError`` 401 ``unauthorized`` when missing
        or unknown. May read the database (see ``authenticate_cached``)."""
        p = self.authenticate_cached(token, instance)
        if p is not None:
            return p
        assert token  # authenticate_cached refused a missing one
        digest = sha256_hex(token.encode("utf-8", "surrogatepass"))
        with self.db.read_conn() as conn:
            row = conn.execute(_SELECT_TOKEN, {"digest": digest}).first()
        if row is None:
            raise _unauthorized("unknown token")
        name = row.name or row.id
        if len(self._token_cache) >= TOKEN_CACHE_MAX:
            self._token_cache.clear()
        self._token_cache[digest] = (row.workspace, name, time.monotonic() + TOKEN_CACHE_SECONDS)
        return Principal(workspace=row.workspace, name=name, instance=_clean_instance(instance))

    def authenticate_cached(self, token: str | None, instance: str | None = None) -> Principal | None:
        """Resolve a bearer token without touching the database: static tokens, and database
        tokens found in the last ``TOKEN_CACHE_SECONDS`` (only known tokens are remembered,
        never refusals). None when the database must be asked (``authenticate``). Raises
        ``ServiceError`` 401 when the token is missing. A token removed from the database by
        another process is refused within ``TOKEN_CACHE_SECONDS``."""
        if not token:
            raise _unauthorized("a bearer token is required")
        if token in self.static_tokens:
            return Principal(workspace=self.static_tokens[token], name="static", instance=_clean_instance(instance))
        hit = self._token_cache.get(sha256_hex(token.encode("utf-8", "surrogatepass")))
        if hit is None or hit[2] < time.monotonic():
            return None
        return Principal(workspace=hit[0], name=hit[1], instance=_clean_instance(instance))

    def create_token(self, p: Principal, body: TokenCreate, idem: IdempotencyRequest | None = None) -> Reply:
        """201 [TokenCreated] (the token is shown once; only its sha256 is kept);
        404 ``workspace_not_found``."""
        self._require_admin(p)

        def fn(s: Session) -> TokenCreated:
            if body.workspace is not None and s.get(WorkspaceRow, body.workspace) is None:
                raise ServiceError(404, "workspace_not_found", f"no workspace {body.workspace!r}")
            raw = "mf_" + secrets.token_urlsafe(32)
            row = TokenRow(
                id=str(uuid.uuid4()), token_sha256=sha256_hex(raw.encode()), workspace=body.workspace,
                name=body.name, created_at=utcnow(),
            )
            s.add(row)
            s.flush()
            log.info("token %s created for %s", row.id, body.workspace or "admin")
            return TokenCreated(id=row.id, workspace=row.workspace, name=row.name, token=raw)

        return self._write(p, idem, 201, fn)
