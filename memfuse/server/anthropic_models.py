"""Bodies of the Anthropic memory-store API (``/v1/memory_stores``), as pydantic models.

Field names, types, optionality and the ``type`` discriminators are those of the anthropic
Python SDK's own types (``anthropic.types.beta``: ``BetaManagedAgentsMemoryStore``,
``...DeletedMemoryStore``, ``memory_stores.BetaManagedAgentsMemory``, ``...MemoryPrefix``,
``...MemoryVersion``, ``...DeletedMemory``, the four actor types, and the request params
``MemoryStoreCreateParams`` / ``...UpdateParams``, ``MemoryCreateParams`` /
``MemoryUpdateParams`` with ``BetaManagedAgentsPreconditionParam``), release 2.15.0. How
memfuse fills them is in ``memfuse.server.anthropic_api`` and docs/ANTHROPIC-API.md.

Request models forbid unknown members: a field memfuse does not know would otherwise be
ignored silently, and the Anthropic API answers 400 for it too.
"""
from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# Limits the SDK's docstrings give (anthropic 2.15.0, types/beta/memory_store_*_params.py and
# memory_stores/memory_*_params.py).
NAME_MAX_CHARS = 255
DESCRIPTION_MAX_CHARS = 1024
METADATA_MAX_PAIRS = 16
METADATA_KEY_MAX_CHARS = 64
METADATA_VALUE_MAX_CHARS = 512
PATH_MAX_BYTES = 1024
PATH_MAX_SEGMENTS = 20
LIST_LIMIT_DEFAULT = 20
LIST_LIMIT_MAX = 100
FULL_VIEW_LIMIT_MAX = 20  # "with view=full, a page holds at most 20 items"

View = Literal["basic", "full"]
VersionOperation = Literal["created", "modified", "deleted"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemoryStoreCreate(_Request):
    """``POST /v1/memory_stores``."""

    name: str
    description: str | None = None
    metadata: dict[str, str] | None = None


class MemoryStoreUpdate(_Request):
    """``POST /v1/memory_stores/{id}``: members left out are kept; ``metadata`` is a patch
    (a key set to null is removed)."""

    name: str | None = None
    description: str | None = None
    metadata: dict[str, str | None] | None = None


class Precondition(_Request):
    """``{"type": "content_sha256", "content_sha256": "<64 hex>"}``: the memory's current
    content must hash to this, else 409."""

    type: Literal["content_sha256"]
    content_sha256: str | None = None


class MemoryCreate(_Request):
    """``POST /v1/memory_stores/{id}/memories``: ``content`` may be ``""`` (an empty memory);
    the SDK types it ``Optional[str]``, so null is read as ``""`` too."""

    path: str
    content: str | None


class MemoryUpdate(_Request):
    """``POST /v1/memory_stores/{id}/memories/{mem}``: new ``content`` and / or ``path``
    (a rename keeps the id), under an optional ``precondition``."""

    content: str | None = None
    path: str | None = None
    precondition: Precondition | None = None


class MemoryStoreOut(BaseModel):
    """``BetaManagedAgentsMemoryStore``."""

    type: Literal["memory_store"] = "memory_store"
    id: str
    name: str
    description: str
    metadata: dict[str, str]
    created_at: datetime
    updated_at: datetime
    archived_at: datetime | None = None


class DeletedMemoryStore(BaseModel):
    type: Literal["memory_store_deleted"] = "memory_store_deleted"
    id: str


class MemoryOut(BaseModel):
    """``BetaManagedAgentsMemory``: ``content`` is null with ``view=basic``."""

    type: Literal["memory"] = "memory"
    id: str
    memory_store_id: str
    memory_version_id: str
    path: str
    content_sha256: str
    content_size_bytes: int
    created_at: datetime
    updated_at: datetime
    content: str | None = None


class MemoryPrefix(BaseModel):
    """``BetaManagedAgentsMemoryPrefix``: memories deeper than ``depth`` rolled up."""

    type: Literal["memory_prefix"] = "memory_prefix"
    path: str


class DeletedMemory(BaseModel):
    type: Literal["memory_deleted"] = "memory_deleted"
    id: str


class SessionActor(BaseModel):
    type: Literal["session_actor"] = "session_actor"
    session_id: str


class APIActor(BaseModel):
    type: Literal["api_actor"] = "api_actor"
    api_key_id: str


class UserActor(BaseModel):
    type: Literal["user_actor"] = "user_actor"
    user_id: str


class ServiceAccountActor(BaseModel):
    type: Literal["service_account_actor"] = "service_account_actor"
    service_account_id: str


Actor = Annotated[Union[SessionActor, APIActor, UserActor, ServiceAccountActor], Field(discriminator="type")]


class MemoryVersionOut(BaseModel):
    """``BetaManagedAgentsMemoryVersion``: content, path, size and sha are null when the
    version is redacted; content, size and sha when it is a ``deleted`` version; content
    with ``view=basic``."""

    type: Literal["memory_version"] = "memory_version"
    id: str
    memory_id: str
    memory_store_id: str
    operation: VersionOperation
    created_at: datetime
    created_by: Actor | None = None
    path: str | None = None
    content: str | None = None
    content_sha256: str | None = None
    content_size_bytes: int | None = None
    redacted_at: datetime | None = None
    redacted_by: Actor | None = None


class MemoryStorePage(BaseModel):
    """``SyncPageCursor[BetaManagedAgentsMemoryStore]``: ``next_page`` is null on the last."""

    data: list[MemoryStoreOut]
    next_page: str | None = None


class MemoryPage(BaseModel):
    data: list[Annotated[Union[MemoryOut, MemoryPrefix], Field(discriminator="type")]]
    next_page: str | None = None


class MemoryVersionPage(BaseModel):
    data: list[MemoryVersionOut]
    next_page: str | None = None


class ErrorObject(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}``."""

    type: Literal["error"] = "error"
    error: ErrorObject
    request_id: str | None = None
