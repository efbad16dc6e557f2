"""The client side of a sidecar's status and admin API (``memfuse status``, ``memfuse mounts``):
read a mount's ``.memfuse/status.json``, call the admin API over its Unix socket or TCP,
and format a status document for people. Apart from :mod:`memfuse.sidecar.admin` (the
server side, which re-exports these names) so that ``memfuse status`` does not import trio.
"""
from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STATUS_TIMEOUT = 5.0  # seconds `memfuse status --admin URL` waits for an answer


def _short(dir_fd: int, name: str) -> str:
    """A path to ``name`` in the directory open as ``dir_fd`` that fits ``sun_path`` however
    deep the directory is (``/proc/self/fd/N/name``; the full path where /proc is missing)."""
    proc = f"/proc/self/fd/{dir_fd}"
    return f"{proc}/{name}" if os.path.isdir(proc) else os.path.join(os.readlink(proc), name)


class StatusUnavailable(Exception):
    """Nothing answered with a status document; the message is one line for people."""


def read_status_file(mountpoint: Path) -> dict[str, Any]:
    """The status document at ``MOUNTPOINT/.memfuse/status.json``.

    Raises ``StatusUnavailable`` when there is no mount there, the mount does not answer
    (sidecar gone) or the file is not a JSON object.
    """
    path = mountpoint / ".memfuse" / "status.json"
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise StatusUnavailable(f"no memfuse mount at {mountpoint} ({path} not found)") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise StatusUnavailable(f"the memfuse mount at {mountpoint} is not answering "
                                    "(sidecar stopped?); unmount it with fusermount3 -u") from None
        raise StatusUnavailable(f"cannot read {path}: {e.strerror or e}") from None
    return _status_object(text, str(path))


class AdminRequestFailed(Exception):
    """An admin call did not succeed; the message is one line for people. ``status`` is the
    HTTP status (None when nothing answered), ``code`` the problem's ``code`` member."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _request(method: str, path: str, *, socket_path: Path | None, url: str, headers: dict[str, str],
             timeout: float, fail: type[Exception]) -> tuple[Any, str]:
    """One request to a sidecar's admin API: over the Unix socket at ``socket_path`` (its
    directory opened first, so a deep path still fits ``sun_path``), else to ``url`` (TCP; a
    bare ``HOST:PORT`` gets ``http://``). Returns ``(httpx.Response, where)``, ``where`` the
    socket path or base URL for messages. Raises ``fail(message)`` when there is no socket
    or nothing answers within ``timeout`` s; ``httpx.InvalidURL`` passes through."""
    import httpx

    dir_fd = None
    try:
        if socket_path is not None:
            socket_path = Path(socket_path)
            try:
                dir_fd = os.open(socket_path.parent, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as e:
                raise fail(f"no sidecar admin socket at {socket_path} ({e.strerror})") from None
            transport, base, where = httpx.HTTPTransport(uds=_short(dir_fd, socket_path.name)), \
                "http://sidecar", str(socket_path)
        else:
            base = url.strip().rstrip("/")
            if "://" not in base:
                base = "http://" + base
            transport, where = None, base
        try:
            with httpx.Client(transport=transport, timeout=timeout) as client:
                return client.request(method, base + path, headers=headers), where
        except httpx.TimeoutException:
            raise fail(f"sidecar admin API at {where} did not answer within {timeout:g} s") from None
        except httpx.HTTPError as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise fail(f"sidecar admin API not reachable at {where} ({reason})") from None
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def admin_call(method: str, path: str, *, socket_path: Path | None = None, url: str | None = None,
               token: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """One admin API call, over the Unix socket at ``socket_path`` or to ``url`` (TCP, with
    ``token`` as a bearer token for mutations). Returns the JSON object answered; waits at most
    ``timeout`` s (an unmount commits dirty files first, up to the sidecar's --commit-wait).

    Raises ``AdminRequestFailed`` when nothing answers or the answer is an error.
    """
    if socket_path is None and not url:
        raise AdminRequestFailed("no admin socket or URL given")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r, where = _request(method, path, socket_path=socket_path, url=url or "", headers=headers, timeout=timeout,
                        fail=AdminRequestFailed)
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code >= 400:
        detail = code = None
        if isinstance(body, dict):
            detail, code = body.get("detail") or body.get("title"), body.get("code")
        msg = f"sidecar answered HTTP {r.status_code}" + (f": {' '.join(str(detail).split())}" if detail else "")
        raise AdminRequestFailed(msg, r.status_code, code)
    if not isinstance(body, dict):
        raise AdminRequestFailed(f"sidecar admin API at {where} did not answer a JSON object", r.status_code)
    return body


def fetch_status(admin_url: str | None = None, timeout: float = STATUS_TIMEOUT, *, token: str | None = None,
                 socket_path: Path | None = None) -> dict[str, Any]:
    """``GET /v1/status`` of a sidecar: at ``admin_url`` (TCP, like ``http://127.0.0.1:9464``; a
    bare ``HOST:PORT`` gets ``http://``) with ``token`` as the admin bearer token (on TCP the
    status needs it), or over its Unix socket ``socket_path`` (no token). Waits at most
    ``timeout`` seconds.

    Raises ``StatusUnavailable`` when nothing answers, the answer is an error, or not a JSON
    object.
    """
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r, where = _request("GET", "/v1/status", socket_path=socket_path, url=admin_url or "", headers=headers,
                            timeout=timeout, fail=StatusUnavailable)
    except httpx.InvalidURL as e:
        raise StatusUnavailable(f"invalid admin URL {admin_url!r}: {e}") from None
    url = ("http://sidecar" if socket_path is not None else where) + "/v1/status"
    if r.status_code != 200:
        detail = ""
        try:
            body = r.json()
            if isinstance(body, dict):
                detail = str(body.get("detail") or body.get("title") or "")
        except ValueError:
            pass
        raise StatusUnavailable(f"sidecar admin API at {where} answered HTTP {r.status_code}"
                                + (f": {' '.join(detail.split())}" if detail else ""))
    return _status_object(r.text, url)


def _status_object(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        raise StatusUnavailable(f"{where} is not valid JSON") from None
    if not isinstance(data, dict):
        raise StatusUnavailable(f"{where} is not a JSON object")
    return data


def _duration(seconds: Any) -> str:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return str(seconds)
    if not math.isfinite(s):
        return str(seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h {m}m"
    if h:
        return f"{h}h {m}m {sec}s"
    return f"{m}m {sec}s"


def _scalar(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return " ".join(str(value).split())


def _table(rows: list[list[str]], headers: list[str], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def _dict_table(items: list[dict[str, Any]], first: list[str], indent: str = "  ") -> list[str]:
    cols = [c for c in first if any(c in it for it in items)]
    for it in items:
        cols += [k for k in it if k not in cols]
    # a duration (``*_s``) as ``_fields`` shows it: the label without the unit, the value
    # with it (``last_remote_change_age_s`` 12.5 → LAST REMOTE CHANGE AGE, ``12.5s``)
    durations = {c for c in cols if str(c).endswith("_s")}
    rows = [[_duration(it[c]) if c in durations and it.get(c) is not None else _scalar(it.get(c))
             for c in cols] for it in items]
    return _table(rows, [_label(c[:-2] if c in durations else c).upper() for c in cols], indent)


def _fields(d: Mapping[str, Any], first: list[str], indent: str, durations: tuple[str, ...] = (),
            names: dict[str, str] | None = None) -> list[str]:
    """``key: value`` lines (known keys first, then the rest), nesting dicts and lists;
    ``names`` gives a key a label other than its own words."""
    keys = [k for k in first if k in d] + [k for k in d if k not in first]
    labels = {k: (names or {}).get(k) or _label(k[:-2] if k in durations else k) for k in keys}
    width = max((len(x) for x in labels.values()), default=0)
    out: list[str] = []
    for k in keys:
        v, label = d[k], labels[k]
        head = f"{indent}{(label + ':').ljust(width + 1)}"  # every value in one column
        if isinstance(v, dict) and v:
            out.append(f"{indent}{label}:")
            out += _fields(v, [], indent + "  ", tuple(x for x in v if str(x).endswith("_s")))
        elif isinstance(v, dict):  # an empty one: "-", as an empty list (was a bare "task failures:")
            out.append(f"{head} -")
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out.append(f"{head} {len(v)}")
            out += _dict_table(v, [], indent + "  ")
        elif isinstance(v, list):
            out.append(f"{head} " + (", ".join(_scalar(x) for x in v) if v else "-"))
        else:
            shown = _duration(v) if k in durations else _scalar(v)
            out.append(f"{head} {shown}")
    return out


def _is_bytes(key: Any) -> bool:
    """A status key whose value is a byte count: ``bytes`` (a store's) or ``*_bytes``."""
    return str(key) == "bytes" or str(key).endswith("_bytes")


def _label(key: Any) -> str:
    return " ".join(str(key).replace("_", " ").split())


# labels that say what a count counts, where the key alone is ambiguous: the outbox's
# ``refused`` counts only changes the control plane refused when they were sent (a refusal
# the sidecar decides before the outbox is in ``refusals_since_start``), ``errors_logged`` is
# the lines in errors.log (refusals and conflicts, kept across restarts, the last 200)
OUTBOX_LABELS = {"refused": "refused by control plane"}
STATUS_LABELS = {"errors_logged": "errors.log lines",
                 "refusals_since_start": "refusals since start (sidecar + control plane)"}


def format_status(data: dict[str, Any]) -> str:
    """The status document for people: workspace, ready, uptime, one row per store (slug,
    access, records, then any other store keys), the outbox (depth, oldest age, committed,
    refused by the control plane, retries, then any other keys), then every other key,
    nested ones indented (labels: ``OUTBOX_LABELS``, ``STATUS_LABELS``, else the key's
    words). Keys ending in ``_s`` are durations in seconds and print as such; ``bytes`` and keys
    ending in ``_bytes`` are byte counts and print in binary units, as ``store list`` and the console do
    (``67108864`` → ``64 MiB``, ``1536`` → ``1.5 KiB``, ``12`` → ``12 B``)."""

    def human(n: int) -> str:
        value = float(n)
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024 or unit == "TiB":
                return f"{n} B" if unit == "B" else f"{value:.1f} {unit}".replace(".0 ", " ")
            value /= 1024
        return f"{n} B"  # pragma: no cover

    def sizes(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: human(x) if _is_bytes(k) and type(x) is int else sizes(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sizes(x) for x in v]
        return v

    data = sizes(data)
    out: list[str] = []
    head: dict[str, Any] = {k: data[k] for k in ("workspace", "ready", "uptime_s") if k in data}
    out += _fields(head, ["workspace", "ready", "uptime_s"], "", ("uptime_s",))
    stores = data.get("stores")
    if isinstance(stores, list) and all(isinstance(s, dict) for s in stores):
        out.append(f"stores: {len(stores)}")
        if stores:
            out += _dict_table(stores, ["slug", "access", "records"])
    elif "stores" in data:
        out += _fields({"stores": stores}, [], "")
    outbox = data.get("outbox")
    if isinstance(outbox, dict):
        out.append("outbox:")
        out += _fields(outbox, ["depth", "oldest_age_s", "committed", "refused", "retries"], "  ",
                       tuple(k for k in outbox if k.endswith("_s")), OUTBOX_LABELS)
    elif "outbox" in data:
        out += _fields({"outbox": outbox}, [], "")
    rest = {k: v for k, v in data.items() if k not in ("workspace", "ready", "uptime_s", "stores", "outbox")}
    out += _fields(rest, [], "", tuple(k for k in rest if k.endswith("_s")), STATUS_LABELS)
    return "\n".join(out)
