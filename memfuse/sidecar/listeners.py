"""The listener interfaces of the sidecar's parts: what a part tells the one that assembles
it, given at construction instead of callbacks set from outside.

- ``CommitListener``: what the committer (``committer.Committer``) tells, after the ``await``
  of the HTTP call that settled an entry; the filesystem core implements it.
- ``FsListener``: what the filesystem core (``core.Filesystem``) tells the sidecar
  (``mount.Sidecar``) that assembles it; a bare core (tests, the reference model) has none.

Every method runs on the trio thread and must not block; an exception it raises is logged by
the caller, never raised into it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .journal import Entry
    from .sync import Meta

__all__ = ["CommitListener", "FsListener"]


class CommitListener(Protocol):
    """What the committer tells, on the trio thread, after the ``await`` of the HTTP call
    that settled an entry (the filesystem core implements it, and forwards to the sidecar).
    An exception raised by a method is logged, never raised into the committer."""

    def entry_finished(self, e: Entry) -> None:
        """``e`` is committed (``e.errno`` 0; ``e.record`` / ``e.moved`` / ``e.merged`` say
        what the control plane now holds) or refused for good (``e.errno``, ``e.reason``,
        ``e.code``); it has left the queue and the journal."""

    def entry_conflicted(self, e: Entry, what: str) -> None:
        """``e`` met a concurrent change and was resolved last-writer-wins (``what``: one
        sentence for ``errors.log``)."""


class FsListener(Protocol):
    """What the filesystem core tells the sidecar that assembles it, given at construction
    (``Filesystem(listener=...)``); every method runs on the trio thread and must not
    block. A bare core (tests, the reference model) has none."""

    def entry_finished(self, e: Entry) -> None:
        """An outbox entry finished, after the core applied its result to the tree (the
        sidecar updates the store's mirror)."""

    def entry_conflicted(self, e: Entry, what: str) -> None:
        """A write was resolved last-writer-wins, after the core noted it in errors.log."""

    def invalidate(self, items: list[tuple[Any, ...]]) -> None:
        """Kernel cache invalidations to make (``("inode", ino)``...): never blocks."""

    def kernel_behind(self, ino: int) -> bool:
        """True while an invalidation of inode ``ino``'s content has been handed over
        (``invalidate``) and has not reached the kernel yet: until then the kernel may serve
        a reader the pages and size of the content before that change."""

    def kernel_served_older(self, ino: int) -> None:
        """A reader of inode ``ino`` was served the older content the kernel still holds the
        size of (``kernel_behind``; ``Filesystem.read``): if the invalidation is being
        performed right now, the kernel may have dropped its pages already and keep that
        read's page, so the invalidation is made once more afterwards
        (``Invalidator.served_older``). Never blocks."""

    def committed_size(self, slug: str, record_id: str) -> int | None:
        """Bytes of the record as the control plane holds it (the store's mirror), None when
        unknown."""

    def known_record(self, slug: str, record_id: str) -> Meta | None:
        """The newest state of the record known here (the store's mirror: the control
        plane's state as of its cursor, this sidecar's commits included), None when unknown."""

    def record_stale(self, slug: str, record_id: str) -> None:
        """A commit answer named a state of the record (a path, a content) that the tree
        does not show and cannot show from what it holds (a change made elsewhere that the
        answer carries and the feed, past it, will not bring): fetch the record and apply
        it like a feed state (``StoreSync.refetch_record``). Never blocks."""

    def shadow_freed(self, slug: str) -> None:
        """A local entry that kept a record of ``slug`` from being shown went
        (``RemoteApply.shadow_freed``): once the store's outbox is empty, apply its shadowed
        records again (``Filesystem.unshadow``; ``StoreSync.shadow_freed``). Never blocks."""

    def status(self) -> dict[str, Any]:
        """The fuller status document (``.memfuse/status.json``)."""
