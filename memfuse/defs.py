"""Constants, enums and pure helpers of the control-plane API v1 (docs/API.md).

Shared by the server's pydantic models (:mod:`memfuse.models`, which re-exports all of this)
and the client's msgspec Structs (:mod:`memfuse.wire`). Imports only the standard library, so
the sidecar, which never loads pydantic, can use them.
"""
from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from enum import Enum

__all__ = [
    "RECORD_TYPES",
    "DEFAULT_MODE",
    "MODE_MASK",
    "MTIME_NS_MIN",
    "MTIME_NS_MAX",
    "SLUG_PATTERN",
    "MAX_TOKEN_TTL_SECONDS",
    "BATCH_MAX_OPERATIONS",
    "BATCH_MAX_BYTES",
    "Access",
    "Operation",
    "sha256_hex",
    "datetime_ns",
    "mtime_effective_ns",
]

RECORD_TYPES = ("user", "feedback", "project", "reference")
DEFAULT_MODE = 0o644  # permission bits of a record whose mode was never set
MODE_MASK = 0o7777  # the bits a record keeps (chmod(2)); the file type is not one of them
MTIME_NS_MIN, MTIME_NS_MAX = -(1 << 63), (1 << 63) - 1  # a signed 64-bit ns count
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
MAX_TOKEN_TTL_SECONDS = 10 * 366 * 86400  # ten years
BATCH_MAX_OPERATIONS = 100  # operations in one POST /v1/stores/{store}/batch
BATCH_MAX_BYTES = 16 * 1024 * 1024  # bytes of one batch request body
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def sha256_hex(data: bytes) -> str:
    """Return the lowercase hex sha256 of ``data`` (the record ETag)."""
    return hashlib.sha256(data).hexdigest()


def datetime_ns(t: datetime) -> int:
    """An aware ``datetime`` as integer nanoseconds since the epoch (µs precision, exact).
    Raises ``TypeError`` for a naive one."""
    delta = t - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


def mtime_effective_ns(mtime_ns: int | None, updated_at: datetime) -> int:
    """The mtime a record's file shows, in ns since the epoch: its explicit ``mtime_ns``,
    else ``updated_at``."""
    if mtime_ns is not None:
        return mtime_ns
    return datetime_ns(updated_at)


class Access(str, Enum):
    """How a workspace may use an attached store."""

    read_write = "read_write"
    read_only = "read_only"


class Operation(str, Enum):
    """What one version did to its record (docs/API.md)."""

    created = "created"
    modified = "modified"
    moved = "moved"
    deleted = "deleted"
    restored = "restored"
