"""The default cache directory of ``memfuse mount`` (no ``--cache-dir``; docs/CLI.md).

It is keyed by the workspace's identity, not only its name: two accounts may each have a
workspace ``agent`` (docs/API.md "Accounts"), and two sidecars of those on one host with one
``MEMFUSE_HOME`` must never share a cache (attack 17 F7: the second one's ``errors.log``
named the first one's queued paths, under a wrong reason, and dropped them). The directory is
``<root>/<workspace>-<hash>`` for the account ``default`` (what every release before this one
used, so existing caches keep working) and ``<root>/<workspace>~<account>-<hash>`` for any
other account, ``<hash>`` 8 hex digits of the control plane's URL, ``<root>``
``$MEMFUSE_HOME/cache`` or the user cache directory.

The account comes from the control plane (``Memfuse-Account`` on the workspace's attachments;
a control plane that does not send it has only ``default``). Each answer marks the directory
chosen with the token that got it (``owner.json``: a salted SHA-256 of the token, never the
token). When the account is not known — the control plane does not answer, or refuses the
token (401, 403, 404) — a directory is used only when known to be this sidecar's: marked by
this very token, else the ``<workspace>-<hash>`` of an older release that marked none; another
account's ``~<account>`` directory (or one marked by another token) never is (attack 19 F3:
a sidecar of ``default``/``a`` offline, or with a revoked or junk token, showed account
acme's files and unsent writes). With none usable the start is refused, naming the
directories there and ``--cache-dir`` (a token rotated while the control plane is down
needs that too); a refused token with no directory of the workspace at all starts with a
new one, and the sidecar says why it was refused. An older release's ``<workspace>-<hash>`` of another account than
``default`` is taken over (renamed) only when the stores it records (``dirs.json``, the
creation time of each store) are among the workspace's attachments, with the same creation
times, and no sidecar runs on it: it is then this workspace's own cache.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import trio

from memfuse.client import ApiClient
from memfuse.defs import DEFAULT_ACCOUNT
from memfuse.errors import PermanentError, TransientError

__all__ = ["LOOKUP_TIMEOUT", "OWNER_FILE", "cache_dir_for", "cache_root", "choose_cache_dir", "records_match"]

#: seconds one question to the control plane may take. When a cache directory of the
#: workspace exists already, one question is asked (the sidecar can start offline from that
#: cache); with none, it is asked again until ``--start-timeout``, as the sidecar itself
#: waits then
LOOKUP_TIMEOUT = 5.0
RETRY_S = 1.0  # s between questions while the control plane does not answer
#: the file in a cache directory naming who chose it (``_mark``): {"account", "token_sha256"}
OWNER_FILE = "owner.json"
#: the key of ``dirs.json`` holding {store slug: its creation time} (``inodes.STORE_CREATED_KEY``)
_CREATED_KEY = "_created"


def cache_root() -> Path:
    """``$MEMFUSE_HOME/cache`` when set, else the user cache directory's ``memfuse``."""
    import platformdirs

    home = os.environ.get("MEMFUSE_HOME")
    return Path(home).expanduser() / "cache" if home else Path(platformdirs.user_cache_dir("memfuse"))


def _digest(control_plane: str) -> str:
    return hashlib.sha256(control_plane.rstrip("/").encode()).hexdigest()[:8]


def cache_dir_for(control_plane: str, workspace: str, account: str = DEFAULT_ACCOUNT) -> Path:
    """The default cache directory of ``workspace`` of ``account`` on ``control_plane``
    (module docstring)."""
    name = workspace if account == DEFAULT_ACCOUNT else f"{workspace}~{account}"
    return cache_root() / f"{name}-{_digest(control_plane)}"


def _existing(control_plane: str, workspace: str) -> list[Path]:
    """The default cache directories of ``workspace`` on ``control_plane`` on this host, of
    any account, sorted."""
    root, dg = cache_root(), _digest(control_plane)
    found = [root / f"{workspace}-{dg}", *root.glob(f"{workspace}~*-{dg}")]
    return sorted(p for p in found if p.is_dir())


def records_match(cache_dir: Path, stores: dict[str, str]) -> bool:
    """Whether the stores ``cache_dir`` records (``dirs.json``: slug → creation time) are all
    among ``stores`` (slug → creation time, ISO 8601 as ``datetime.isoformat``) with the same
    creation times; False when it records none or cannot be read."""
    try:
        saved = json.loads((cache_dir / "dirs.json").read_text()).get(_CREATED_KEY)
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(saved, dict) or not saved:
        return False
    return all(stores.get(slug) == created for slug, created in saved.items())


async def _ask(control_plane: str, token: Any, workspace: str,
               wait: float) -> tuple[str, dict[str, str]] | None:
    """(the workspace's account, its stores: slug → creation time). Each question waits at
    most ``LOOKUP_TIMEOUT`` s; while the control plane does not answer it is asked again every
    ``RETRY_S`` until ``wait`` s have passed (0: one question), then ``TimeoutError``. None
    when the control plane refuses (401, 403, 404: the sidecar says why on its own)."""
    deadline = trio.current_time() + wait
    async with ApiClient(control_plane, token, lean=True, bounded=True) as c:
        while True:
            try:
                with trio.fail_after(LOOKUP_TIMEOUT):
                    atts = await c.list_attachments(workspace)
                return (c.account or DEFAULT_ACCOUNT,
                        {a.store.slug: a.store.created_at.isoformat() for a in atts})
            except PermanentError:
                return None
            except (TransientError, trio.TooSlowError):
                if trio.current_time() + RETRY_S >= deadline:
                    raise TimeoutError from None
                await trio.sleep(RETRY_S)


def _mark(token: Any) -> str | None:
    """The mark of ``token`` (a ``str``, a ``TokenFile``, or None: no mark) written into a
    cache directory: SHA-256 of the token under a prefix of its own (never the digest the
    control plane keeps, never the token)."""
    tok = getattr(token, "token", token)
    if not isinstance(tok, str) or not tok:
        return None
    return hashlib.sha256(b"memfuse cache owner\0" + tok.encode()).hexdigest()


def _marked_by(cache_dir: Path) -> str | None:
    """The token mark ``cache_dir`` records (``OWNER_FILE``); None when it records none or
    it cannot be read."""
    try:
        got = json.loads((cache_dir / OWNER_FILE).read_text()).get("token_sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return got if isinstance(got, str) else None


def _write_mark(cache_dir: Path, account: str, mark: str) -> None:
    """Record in ``cache_dir`` (made if missing, 0700) that the token of ``mark`` of
    ``account`` chose it; written whole (a temporary renamed over it), 0600. OSError
    propagates (the sidecar could not use the directory either)."""
    if _marked_by(cache_dir) == mark:
        return
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cache_dir / f".{OWNER_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"account": account, "token_sha256": mark}, f)
    os.replace(tmp, cache_dir / OWNER_FILE)


def _known_mine(existing: list[Path], default_dir: Path, mark: str | None) -> list[Path]:
    """Of ``existing``, the directories known to be of this token's account while its
    account is not known (module docstring): those marked by this token; when none is,
    ``default_dir`` if it is marked by none (an older release's)."""
    by = {d: _marked_by(d) for d in existing}
    mine = [d for d in existing if mark is not None and by[d] == mark]
    return mine or [d for d in existing if d == default_dir and by[d] is None]


def choose_cache_dir(control_plane: str, token: Any, workspace: str, start_timeout: float,
                     say: Callable[[str], None]) -> Path:
    """The cache directory of ``memfuse mount`` without ``--cache-dir`` (module docstring).
    ``token``: what ``ApiClient`` takes; ``start_timeout``: seconds to wait for the control
    plane when no cache of the workspace exists (0: no bound); ``say``: one line to the user
    (a cache taken over). Raises ``ValueError`` with the reason when the account is not known
    (the control plane does not answer, or refuses the token) and no cache directory of the
    workspace here is known to be this token's while some are (naming them), or several are;
    or when the control plane does not answer and none exists (past ``start_timeout``: the
    sidecar would have nothing to start from either). Writes ``OWNER_FILE`` into the
    directory chosen when the control plane answered."""
    existing = _existing(control_plane, workspace)
    default_dir = cache_dir_for(control_plane, workspace)
    mark = _mark(token)
    wait = 0.0 if existing else (start_timeout or math.inf)
    try:
        answer = trio.run(_ask, control_plane, token, workspace, wait)
    except TimeoutError:
        if not existing:
            raise ValueError(
                f"the control plane at {control_plane} did not answer within --start-timeout "
                f"({start_timeout:g} s) and nothing of workspace {workspace} is cached on this "
                "host to start from") from None
        return _unknown_account(existing, default_dir, mark, workspace, "did not answer")
    if answer is None:  # refused: the sidecar says why
        if not existing:
            return default_dir
        return _unknown_account(existing, default_dir, mark, workspace,
                                "refused this token or workspace")
    account, stores = answer
    mine = cache_dir_for(control_plane, workspace, account)
    if (mine != default_dir and not mine.exists() and default_dir.is_dir()
            and records_match(default_dir, stores) and not _in_use(default_dir)):
        os.rename(default_dir, mine)
        say(f"memfuse mount: the cache {default_dir} of workspace {workspace} of account "
            f"{account} (its stores match) is now {mine}")
    if mark is not None:
        _write_mark(mine, account, mark)
    return mine


def _unknown_account(existing: list[Path], default_dir: Path, mark: str | None,
                     workspace: str, why: str) -> Path:
    """The one directory of ``existing`` known to be this token's (``_known_mine``) while
    the control plane ``why`` (its account unknown); else ``ValueError`` naming them."""
    usable = _known_mine(existing, default_dir, mark)
    if len(usable) == 1:
        return usable[0]
    if usable:
        raise ValueError(
            f"the control plane {why}, and {len(usable)} cache directories of workspace "
            f"{workspace} are on this host: {', '.join(str(p) for p in usable)}; pass "
            "--cache-dir to name its own") from None
    raise ValueError(
        f"the control plane {why}, so this token's account is not known, and the cache "
        f"directories of workspace {workspace} on this host are not known to be its own "
        f"(of another account, or chosen with another token): "
        f"{', '.join(str(p) for p in existing)}; none is used; pass --cache-dir to name its "
        "own") from None


def _in_use(cache_dir: Path) -> bool:
    """Whether a sidecar runs on ``cache_dir`` (holds its ``lock``: ``mount.CacheLock``)."""
    try:
        fd = os.open(cache_dir / "lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
