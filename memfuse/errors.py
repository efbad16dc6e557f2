"""The control-plane API's errors as the client raises them, and their errno at the FUSE border.

:class:`ApiError` and its classes: :class:`TransientError` (the request may succeed later)
and :class:`PermanentError` (refused for good) with one subclass per refusal a caller tells
apart (:class:`Unauthorized` 401, :class:`Forbidden` 403, :class:`NotFound` 404,
:class:`Conflict` 409, :class:`Gone` 410, :class:`PreconditionFailed` 412,
:class:`StoreReplaced` 412 ``store_replaced``, :class:`StoreFull` 507). ``ERRNO_BY_CODE`` maps a refusal's problem ``code`` to the errno a
system call returns (the table in docs/API.md); every other view of that table is derived
from it here (``errno_for``, ``errno_of``, ``ERRNO_NAME_BY_CODE``, ``CODE_BY_ERRNO``).

This room holds no HTTP: turning a response or an httpx exception into one of these is
:mod:`memfuse.client`'s job (``_http_error``, ``_transport_error``); the sidecar's committer
applies ``errno_for``. Secrets: no exception here carries a token or
record content.
"""
from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "ERRNO_BY_CODE",
    "ERRNO_BY_STATUS",
    "ERRNO_NAME_BY_CODE",
    "CODE_BY_ERRNO",
    "REQUEST_CODES",
    "errno_for",
    "errno_of",
    "ApiError",
    "TransientError",
    "PermanentError",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "Conflict",
    "Gone",
    "PreconditionFailed",
    "StoreReplaced",
    "StoreFull",
]


class ApiError(Exception):
    """A call to the control plane failed.

    Attributes:
        status: HTTP status, or ``None`` when no response arrived (connect error, timeout,
            lost response).
        code: memfuse's machine reason from the problem body (``path_exists``,
            ``precondition_failed``, ...), or a client-side reason for transport failures
            (``connect_error``, ``timeout``, ``read_error``, ``bad_response``, ...).
        detail: the problem's human-readable detail (may be empty).
        title: the problem's title (or the HTTP reason phrase).
        problem: the whole RFC 9457 problem body as a dict (extra fields such as ``record_id``
            on 409 ``path_exists`` or ``sha256`` on 412 included); ``{}`` when none.
        retry_after: seconds the server asked to wait (``Retry-After``), else ``None``.
        method, path: the request's method and URL path (no host, no query, no token).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "",
        detail: str = "",
        title: str = "",
        problem: dict[str, Any] | None = None,
        retry_after: float | None = None,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.detail = detail
        self.title = title
        self.problem: dict[str, Any] = problem or {}
        self.retry_after = retry_after
        self.method = method
        self.path = path

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class TransientError(ApiError):
    """The request may succeed if repeated: connect error, timeout, lost or garbled response,
    5xx or 429. Writes carrying an ``Idempotency-Key`` are safe to repeat."""


class PermanentError(ApiError):
    """The control plane refused the request for good (a 4xx other than 429); repeating the
    same request gives the same answer."""


class Unauthorized(PermanentError):
    """401: missing, unknown or revoked token."""


class Forbidden(PermanentError):
    """403: the token may not do this (``forbidden``; ``read_only`` attachment)."""


class NotFound(PermanentError):
    """404: store, workspace, record, version or token not found, or store not attached."""


class Conflict(PermanentError):
    """409: ``path_exists`` (see :attr:`record_id`), ``parent_is_file``,
    ``path_is_directory`` (a file and a directory of one name), ``exists``, ``redacted``,
    ``current_version``."""

    @property
    def record_id(self) -> str | None:
        """The id of the live record holding the path, for ``path_exists``."""
        rid = self.problem.get("record_id")
        return rid if isinstance(rid, str) else None


class StoreFull(PermanentError):
    """507 ``store_full``: the store is over ``max_store_bytes`` or ``max_records``. A 5xx, but
    a refusal (ENOSPC in the errno table of docs/API.md), not an outage: repeating it only helps once space is
    freed, so it is permanent."""


class Gone(PermanentError):
    """410: ``cursor_expired`` — the change-feed cursor is unknown; take a full snapshot."""


class PreconditionFailed(PermanentError):
    """412: ``If-Match`` did not match; :attr:`current_sha256` is the record's current sha256."""

    @property
    def current_sha256(self) -> str | None:
        """The record's current content sha256 as reported by the server, if any."""
        sha = self.problem.get("sha256")
        return sha if isinstance(sha, str) else None


class StoreReplaced(PermanentError):
    """412 ``store_replaced``: the write named (``Memfuse-Store-Created``) a store that was
    deleted since, and another store has its slug now; nothing was written. Not a
    :class:`PreconditionFailed`: no newer version of the record to merge with exists."""


# The one refusal → errno table (the errno table of docs/API.md): a refusal's problem ``code``
# → the errno a system call on the mount returns for it. Every other view is derived from it:
# ``errno_for`` (an ``ApiError``'s errno: the sidecar's committer), ``errno_of`` (the errno of
# a refusal the sidecar finds itself, by code: ``inodes.FsError.of``), ``ERRNO_NAME_BY_CODE``
# (the names the memory tool shows) and ``CODE_BY_ERRNO`` (the usual code of an errno:
# errors.log). For an errno with several codes, the first listed is its usual one.
ERRNO_BY_CODE: dict[str, int] = {
    "invalid_path": errno.EINVAL,
    "path_too_long": errno.ENAMETOOLONG,
    "invalid_type": errno.EINVAL,
    "validation_error": errno.EINVAL,
    "invalid_content": errno.EILSEQ,
    "secret_detected": errno.EPERM,
    "record_too_large": errno.EFBIG,
    "store_full": errno.ENOSPC,
    "account_full": errno.ENOSPC,  # the account's max_bytes (docs/API.md "Accounts")
    "forbidden": errno.EACCES,
    "unauthorized": errno.EACCES,
    "read_only": errno.EROFS,
    "store_archived": errno.EACCES,  # archived through the memory-store API (docs/ANTHROPIC-API.md)
    "store_not_found": errno.ENOENT,
    "store_not_attached": errno.ENOENT,
    "store_replaced": errno.ESTALE,  # the write's store was deleted; another has its slug now
    "path_exists": errno.EEXIST,
    "parent_is_file": errno.ENOTDIR,
    "path_is_directory": errno.EISDIR,
    "move_too_large": errno.EXDEV,  # a prefix move past PREFIX_MOVE_MAX records: mv copies instead
    "idempotency_key_reused": errno.EINVAL,
}

#: codes of the table that refuse the *request* (its form, its credentials, a name taken, a
#: replayed key) rather than the write under the store's rules; the memory tool lets these
#: pass to its caller instead of answering ``Cannot write ...``
REQUEST_CODES = frozenset({"validation_error", "unauthorized", "path_exists", "idempotency_key_reused"})

#: problem code → errno name (``"EFBIG"``) of the refusals of the store's rules: what the
#: memory tool shows (``Cannot write <path>: <reason> (EFBIG)``)
ERRNO_NAME_BY_CODE: dict[str, str] = {
    code: errno.errorcode[err] for code, err in ERRNO_BY_CODE.items() if code not in REQUEST_CODES}

#: reason codes of refusals only the sidecar finds (no problem code of the control plane)
LOCAL_CODE_BY_ERRNO: dict[int, str] = {
    errno.EINVAL: "invalid_request", errno.ENOENT: "not_found", errno.EIO: "io_error"}

#: errno → the usual reason code of a refusal with that errno (errors.log, when the refusing
#: code does not give one): the first code of ``ERRNO_BY_CODE`` of the store's rules, else
#: ``LOCAL_CODE_BY_ERRNO``
CODE_BY_ERRNO: dict[int, str] = {
    **{err: code for code, err in reversed(ERRNO_BY_CODE.items())
       if code not in REQUEST_CODES and err not in LOCAL_CODE_BY_ERRNO},
    **LOCAL_CODE_BY_ERRNO,
}

#: HTTP status → errno of a refusal whose code the table does not know
ERRNO_BY_STATUS: dict[int, int] = {401: errno.EACCES, 403: errno.EACCES, 404: errno.ENOENT,
                                   409: errno.EEXIST, 413: errno.EFBIG, 507: errno.ENOSPC}


def errno_of(code: str) -> int:
    """The errno of a refusal with problem ``code`` (``ERRNO_BY_CODE``). Raises ``KeyError``
    for a code the table does not hold."""
    return ERRNO_BY_CODE[code]


def errno_for(err: ApiError) -> int:
    """The errno a system call returns for the permanent API refusal ``err``: by its code
    (``ERRNO_BY_CODE``), else by its HTTP status (``ERRNO_BY_STATUS``), else ``EIO``."""
    if err.code in ERRNO_BY_CODE:
        return ERRNO_BY_CODE[err.code]
    return ERRNO_BY_STATUS.get(err.status or 0, errno.EIO)
