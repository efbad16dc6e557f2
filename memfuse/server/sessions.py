"""Web-console sessions: a random session id in the browser's cookie instead of the token.

A person logs in to the console with a token (admin or workspace). ``create_session`` checks
the token (``authenticate``) and makes a session: 256 random bits, given to the browser once
(the cookie's value) and stored only as their sha256 in ``console_sessions``, with the token
it was made from and its end (``SESSION_SECONDS`` after login, or the token's own expiry if
sooner). Every console request resolves the cookie with ``session_principal``: one indexed
read that joins the session with its token, so a session is refused at once (on every
replica: the row is in the shared database) when

- the person logged out (``end_session`` deletes the row),
- it expired,
- its token was revoked, expired or deleted (``token_id`` joins ``tokens``; the row goes with
  the token), or, for a static token given to ``create_app``, that token is no longer given.

What the browser holds is then worth less than the token: it opens the console only (the API
does not take it), for at most ``SESSION_SECONDS``, and logging out ends it for good. The
pattern is OWASP's "Session Management Cheat Sheet" (server-side session, random id of at
least 64 bits of entropy, absolute timeout, invalidated at log-out).
"""
from __future__ import annotations

import hmac
import logging
import secrets
from datetime import datetime
from typing import Protocol, cast

from sqlalchemy import Table, delete, insert, select

from memfuse.models import sha256_hex
from memfuse.server.base import Parts, Principal, Resource, _unauthorized
from memfuse.server.db import ConsoleSessionRow, TokenRow, utc_shift, utcnow

log = logging.getLogger("memfuse.server.service")

SESSION_SECONDS = 12 * 3600  # a console session ends this long after login at the latest
#: console sessions one token keeps at most (browsers, profiles, devices of its person); a
#: login past it ends that token's oldest: a token logging in in a loop cannot grow the table
#: (attack21: 300 logins in 15 s made 300 rows of 12 hours)
MAX_SESSIONS_PER_TOKEN = 32
_CS = cast(Table, ConsoleSessionRow.__table__)
_TK = cast(Table, TokenRow.__table__)

_SELECT_SESSION = (
    select(_CS.c.token_id, _CS.c.token_sha256, _CS.c.workspace, _CS.c.expires_at, _CS.c.account,
           _TK.c.id.label("t_id"), _TK.c.name.label("t_name"), _TK.c.workspace.label("t_workspace"),
           _TK.c.account.label("t_account"),
           _TK.c.expires_at.label("t_expires_at"), _TK.c.revoked_at.label("t_revoked_at"))
    .select_from(_CS.outerjoin(_TK, _TK.c.id == _CS.c.token_id))
)


def session_digest(session_id: str) -> str:
    """The stored form of a session id (hex sha256 of its UTF-8 bytes)."""
    return sha256_hex(session_id.encode("utf-8", "surrogatepass"))


class _Tokens(Protocol):
    """What console sessions need of the tokens (``memfuse.server.tokens.TokensService``)."""

    static_tokens: dict[str, str | None]

    def authenticate(self, token: str | None, instance: str | None = None) -> Principal: ...


class SessionsService(Resource):
    """``Service`` methods of console sessions: ``create_session``, ``session_principal``,
    ``end_session``."""

    tokens: _Tokens  # a session is opened with a token, and ends when its token does

    def __init__(self, parts: Parts, tokens: _Tokens) -> None:
        super().__init__(parts)
        self.tokens = tokens

    def create_session(self, token: str, instance: str | None = None,
                       seconds: float = SESSION_SECONDS) -> tuple[str, Principal, datetime]:
        """Log in with ``token``: returns (session id for the cookie, the principal, when the
        session ends). Expired sessions of every token are deleted on the way, and the token's
        oldest sessions past ``MAX_SESSIONS_PER_TOKEN`` (the new one counted) end. Raises
        ``ServiceError`` 401 when the token is not valid (``authenticate``). Worker thread."""
        p = self.tokens.authenticate(token, instance)
        digest = sha256_hex(token.encode("utf-8", "surrogatepass"))
        now = utcnow()
        ends = utc_shift(now, seconds)
        token_id = None
        if not any(hmac.compare_digest(k.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))
                   for k in list(self.tokens.static_tokens)):
            with self.db.read_conn() as conn:
                row = conn.execute(select(_TK.c.id, _TK.c.expires_at).where(_TK.c.token_sha256 == digest)).first()
            if row is None:  # deleted between the two reads
                raise _unauthorized("unknown token")
            token_id = row.id
            if row.expires_at is not None:
                ends = min(ends, row.expires_at)
        session_id = secrets.token_urlsafe(32)
        new = session_digest(session_id)
        # the token's sessions (a database token's by its indexed id; a static token's by digest)
        mine = _CS.c.token_id == token_id if token_id is not None else _CS.c.token_sha256 == digest
        kept = (select(_CS.c.id_sha256).where(mine, _CS.c.id_sha256 != new)
                .order_by(_CS.c.created_at.desc(), _CS.c.id_sha256).limit(MAX_SESSIONS_PER_TOKEN - 1))
        with self.db.write_conn() as conn:
            conn.execute(delete(_CS).where(_CS.c.expires_at <= now))
            conn.execute(insert(_CS).values(id_sha256=new, token_id=token_id,
                                            token_sha256=digest, workspace=p.workspace, created_at=now,
                                            expires_at=ends))
            # INVARIANT: a token has at most MAX_SESSIONS_PER_TOKEN sessions: the new one and its
            # newest others; the oldest past it end here (logged out as by ``end_session``)
            conn.execute(delete(_CS).where(mine, _CS.c.id_sha256 != new, _CS.c.id_sha256.not_in(kept)))
        return session_id, p, ends

    def session_principal(self, session_id: str | None, instance: str | None = None) -> Principal:
        """Who the console session ``session_id`` (the cookie's value) is. Raises
        ``ServiceError`` 401 when it is missing, unknown (logged out), expired, or its token
        is revoked, expired, deleted or (static) no longer given. One database read; worker
        thread."""
        if not session_id:
            raise _unauthorized("no console session")
        with self.db.read_conn() as conn:
            row = conn.execute(_SELECT_SESSION.where(_CS.c.id_sha256 == session_digest(session_id))).first()
        now = utcnow()
        if row is None:
            raise _unauthorized("unknown console session")
        if row.expires_at <= now:
            raise _unauthorized("console session expired")
        if row.token_id is None:  # a static token: still given, for the same workspace?
            for known, workspace in list(self.tokens.static_tokens.items()):
                if (hmac.compare_digest(sha256_hex(known.encode("utf-8", "surrogatepass")), row.token_sha256)
                        and workspace == row.workspace):
                    return Principal(workspace=workspace, name="static", instance=instance,
                                     account=row.account if workspace is None else None,
                                     root_token=workspace is None,
                                     expires_at=row.expires_at.timestamp())
            raise _unauthorized("the console session's token is no longer valid")
        if row.t_id is None or row.t_revoked_at is not None or (
                row.t_expires_at is not None and row.t_expires_at <= now):
            raise _unauthorized("the console session's token is no longer valid")
        # token_id: a revocation of the token ends the session's live pages too
        # (memfuse.server.streamclass); expires_at: the session's end (never after the token's)
        root = row.t_workspace is None and row.t_account is None
        # a root admin's session acts in the account it switched to (the console's switch)
        account = row.account if root else row.t_account
        return Principal(workspace=row.t_workspace, name=row.t_name or row.t_id, instance=instance,
                         account=account, root_token=root, token_id=row.t_id, expires_at=row.expires_at.timestamp())

    def end_session(self, session_id: str | None) -> bool:
        """Log out: delete the session ``session_id``. True when there was one. Worker thread."""
        if not session_id:
            return False
        with self.db.write_conn() as conn:
            n = conn.execute(delete(_CS).where(_CS.c.id_sha256 == session_digest(session_id))).rowcount
        return bool(n)
