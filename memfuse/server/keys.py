"""The internal key of a store or a workspace and its public name (docs/ARCHITECTURE.md,
"Accounts").

Store names (revision ``0014_store_names``) and workspace names (revision
``0017_workspace_names``) are unique within an account: two accounts may each have a store
``notes`` and a workspace ``agent``. Every table keeps referring to a store by
``stores.slug`` and to a workspace by ``workspaces.name``, its *key*; the name an account
sees and uses is ``public(key)``:

- a key is the name when no other store (workspace) holds that key (every one made before
  the revision, every one of a database with one account, the first ``notes`` of all);
- otherwise ``<name>~<account>`` (``store_key`` / ``workspace_key``): ``~`` is a character a
  slug can never hold (``names.SLUG_RE``), so the name is the key up to its first ``~``, with
  no lookup, and a key of that form is never a name anyone can type.

Resolution (a name a request gives → the key) is in ``AccessRules.store`` /
``AccessRules.workspace`` and the creates; every answer, event, feed entry, path and id
shows ``public(key)``. The key is never shown.

The root admin, which sees every account, also names a store by its *reference*
(``ref``): the name for a store of the account ``default``, ``<name>~<account>`` for any
other (``notes~bravo``: the store ``notes`` of ``bravo``, whatever its key). It has the form
of a key, but is read as (name, account) (``split``): stable for the store's life, the same
on every database, and unambiguous where two accounts hold the same name. The root admin's
views over every account (the console's rows and links, the Anthropic API's ids) show it.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Connection

from memfuse.names import SLUG_RE
from memfuse.server.db import DEFAULT_ACCOUNT, StoreRow, WorkspaceRow

_S = StoreRow.__table__
_W = WorkspaceRow.__table__

#: separates a store's name from its account in a key of a name taken by another account
SEP = "~"
#: the widest key: a slug (63), ``~``, an account slug (63)
KEY_MAX = 127


def public(key: str) -> str:
    """The public name of the store whose key is ``key`` (the key itself for a key without
    ``~``). Pure: safe on any string, e.g. ``public("notes~bravo") == "notes"``."""
    return key.split(SEP, 1)[0]


def ref(name: str, account: str) -> str:
    """The root admin's reference of store ``name`` (a public name) of ``account``: ``name``
    in the account ``default`` (as before accounts), else ``<name>~<account>``. Pure."""
    return name if account == DEFAULT_ACCOUNT else store_key(name, account)


def split(slug: str) -> tuple[str, str | None]:
    """(name, account) of a reference or key ``slug``: ``("notes", "bravo")`` for
    ``notes~bravo``, ``("notes", None)`` for a plain name. Pure."""
    name, sep, account = slug.partition(SEP)
    return (name, account) if sep else (name, None)


def possible(name: str) -> bool:
    """Whether some store could be named or keyed ``name``: a slug (``names.SLUG_RE``), or
    a slug ``~`` a slug (a key). Anything else (a NUL byte, which PostgreSQL refuses in a
    query; spaces; upper case) names no store, and is answered as a missing one without
    asking the database."""
    head, sep, tail = name.partition(SEP)
    return bool(SLUG_RE.match(head)) and (not sep or bool(SLUG_RE.match(tail)))


def store_key(name: str, account: str) -> str:
    """The key of store ``name`` of ``account`` when the key ``name`` is held by a store of
    another account: ``<name>~<account>`` (at most ``KEY_MAX`` characters for slugs)."""
    return f"{name}{SEP}{account}"


def candidates(name: str, account: str) -> tuple[str, str]:
    """The two keys the store ``name`` of ``account`` can have: ``name`` (when it was free at
    creation) and ``store_key(name, account)``. At most one of them is a store of
    ``account`` (``ux_stores_account_name``)."""
    return name, store_key(name, account)


def new_key(conn: Connection, name: str, account: str) -> str | None:
    """The key a new store ``name`` of ``account`` gets: ``name`` when no store holds that
    key, else ``store_key(name, account)``; None when ``account`` already has a store
    ``name`` (the caller's 409 ``exists``). Read in the creating transaction; a create racing
    it fails on the primary key or on ``ux_stores_account_public_slug`` (``IntegrityError``:
    ``Writer.write`` runs it again, and it then sees the winner)."""
    rows = conn.execute(select(_S.c.slug, _S.c.account).where(
        _S.c.slug.in_(candidates(name, account)))).all()
    if any(r.account == account for r in rows):
        return None
    return store_key(name, account) if any(r.slug == name for r in rows) else name


def workspace_key(name: str, account: str) -> str:
    """The key of workspace ``name`` of ``account`` when the key ``name`` is held by a
    workspace of another account: ``<name>~<account>`` (the form of ``store_key``)."""
    return f"{name}{SEP}{account}"


def workspace_candidates(name: str, account: str) -> tuple[str, str]:
    """The two keys the workspace ``name`` of ``account`` can have: ``name`` and
    ``workspace_key(name, account)``. At most one of them is a workspace of ``account``
    (``ux_workspaces_account_public_name``)."""
    return name, workspace_key(name, account)


def new_workspace_key(conn: Connection, name: str, account: str) -> str | None:
    """``new_key`` for a workspace: the key a new workspace ``name`` of ``account`` gets
    (``name`` when free, else ``workspace_key(name, account)``); None when ``account``
    already has a workspace ``name`` (409 ``exists``). A racing create fails on the primary
    key or on ``ux_workspaces_account_public_name`` and is run again by ``Writer.write``."""
    rows = conn.execute(select(_W.c.name, _W.c.account).where(
        _W.c.name.in_(workspace_candidates(name, account)))).all()
    if any(r.account == account for r in rows):
        return None
    return workspace_key(name, account) if any(r.name == name for r in rows) else name
