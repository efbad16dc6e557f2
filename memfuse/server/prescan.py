"""Secret scans of large contents run before a write reaches the writer thread (attack18 F5).

``memfuse.server.writerthread.WriterThread`` runs every lean record write of a replica, one at a
time. A write's secret scan (``memfuse.content.find_secret``: each base64 / hex run decoded and
scanned again) costs about 1.1 s per MiB of adversarial content, so a batch of forty 1 MiB
records made of base64 runs held that one thread for ~45 s and another workspace's 3-byte write
waited 93 s. ``prescanned(texts)`` scans the contents of ``PRESCAN_MIN`` characters or more in a
worker thread of anyio's pool first and keeps the verdicts in a context variable for the write
(the writer thread runs a job in a copy of the submitter's context); ``find_secret(text)`` is
what the write path calls instead of ``content.find_secret``: the verdict kept for that text,
else the scan. The scan still holds the GIL, so the writer thread shares the interpreter with it
(a switch every ``sys.getswitchinterval()``, 5 ms) instead of waiting for the whole of it.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from contextvars import ContextVar

import anyio

from memfuse import content as content_rules

#: contents shorter than this (characters) are scanned where they are written: a hop to a
#: worker thread costs more than their scan (~11 ms per MiB of prose, 50 ms for the worst)
PRESCAN_MIN = 64 * 1024

#: the verdicts of the current write's large contents, content → ``find_secret``'s answer
_VERDICTS: ContextVar[dict[str, str | None] | None] = ContextVar("memfuse_prescanned", default=None)


def find_secret(text: str) -> str | None:
    """``memfuse.content.find_secret(text)``, taken from the verdicts :func:`prescanned`
    kept when it scanned ``text`` (same answer: the same function on the same text)."""
    verdicts = _VERDICTS.get()
    if verdicts is not None and len(text) >= PRESCAN_MIN:
        try:
            return verdicts[text]
        except KeyError:
            pass
    return content_rules.find_secret(text)


def _scan_all(texts: list[str]) -> dict[str, str | None]:
    return {t: content_rules.find_secret(t) for t in texts}


@contextlib.asynccontextmanager
async def prescanned(texts: Iterable[object]) -> AsyncIterator[None]:
    """Scan the strings of ``texts`` with ``PRESCAN_MIN`` characters or more in a worker
    thread (``anyio.to_thread.run_sync``, cancellable: the scan is abandoned, not waited for,
    when the request is cancelled) and keep their verdicts for :func:`find_secret` inside the
    ``async with``. Other items (None, dicts, short strings) are skipped. Raises nothing of
    its own."""
    big = [t for t in texts if isinstance(t, str) and len(t) >= PRESCAN_MIN]
    if not big:
        yield
        return
    verdicts = await anyio.to_thread.run_sync(_scan_all, big, abandon_on_cancel=True)
    token = _VERDICTS.set(verdicts)
    try:
        yield
    finally:
        _VERDICTS.reset(token)
