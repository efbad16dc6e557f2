"""A commit that failed transiently waits out its backoff, or less when poked
(``Committer.poke``: the control plane answered someone, e.g. a change-feed page): a failure
that got no answer (connection refused, timeout) is retried at the poke, one the control
plane answered (500, 429: up, and "not now") only at an urgent poke (a new token, a withdrawn
entry, a close that must learn now) — attack24 F4: a feed page every second made a commit
refused with 500 go again every second whatever its backoff, with two log lines each time."""
from __future__ import annotations

import trio

from memfuse.errors import TransientError
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import PUT, Journal


class Failing:
    """``create_record`` always fails transiently: with an HTTP ``status`` (an answer) or none
    (no answer), asking to wait ``retry_after`` s."""

    def __init__(self, status: int | None, retry_after: float) -> None:
        self.status, self.retry_after = status, retry_after
        self.calls = 0

    async def create_record(self, store, path, content, type=None, idempotency_key=None, *,
                            mode=None, mtime_ns=None):
        self.calls += 1
        await trio.lowlevel.checkpoint()
        raise TransientError("down", status=self.status, code="internal_error" if self.status else "connect_error",
                             retry_after=self.retry_after)


class _Fixed:
    """A backoff of 20 s after any failure (the pokes, 0.1 s apart, come well within it)."""

    def delay(self, attempts: int, retry_after: float | None = None, floor: float = 0.0) -> float:
        return 20.0


async def _attempts_after_pokes(tmp_path, status: int | None, urgent: bool,
                                retry_after: float | None = 20.0) -> int:
    """Attempts of one entry whose first failed (its backoff 20 s), after 5 pokes 0.1 s
    apart."""
    journal = Journal(tmp_path / f"outbox-{status}-{urgent}-{retry_after}.db")
    client = Failing(status, retry_after=retry_after)
    c = Committer(client, journal, {})
    c.backoff = _Fixed()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.run)
            await nursery.start(c.run)
            c.submit("s", PUT, "n:1", {"path": "a.md"}, b"x\n")
            with trio.fail_after(10):
                while client.calls < 1:
                    await trio.sleep(0.01)
            for _ in range(5):
                await trio.sleep(0.1)
                c.poke(urgent=urgent)
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    finally:
        journal.close()
    return client.calls


async def test_an_answered_failure_waits_its_backoff_through_pokes(tmp_path):
    assert await _attempts_after_pokes(tmp_path, 500, urgent=False) == 1
    assert await _attempts_after_pokes(tmp_path, 429, urgent=False) == 1  # its Retry-After kept


async def test_a_failure_without_an_answer_goes_again_at_each_poke(tmp_path):
    assert await _attempts_after_pokes(tmp_path, None, urgent=False) >= 5
    # a proxy's "the control plane is down" (502 / 503 / 504 without Retry-After) likewise
    assert await _attempts_after_pokes(tmp_path, 502, urgent=False, retry_after=None) >= 5
    assert await _attempts_after_pokes(tmp_path, 503, urgent=False, retry_after=20.0) == 1


async def test_an_urgent_poke_ends_any_wait(tmp_path):
    assert await _attempts_after_pokes(tmp_path, 500, urgent=True) >= 5
