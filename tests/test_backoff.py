"""The sidecar loops' retry delay (``memfuse.sidecar.backoff.Doubling``): the waits the feeds,
store loading, the prompt block and supervised tasks make between attempts."""
from __future__ import annotations

import pytest

from memfuse.sidecar.backoff import Doubling


def test_doubles_up_to_the_cap_and_resets():
    r = Doubling(0.2, 5.0)
    waits = [r.next() for _ in range(8)]
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert r.delay == 5.0  # what the next log line says
    r.reset()
    assert (r.delay, r.next(), r.delay) == (0.2, 0.2, 0.4)


def test_a_cap_not_on_the_doubling_path_is_reached_exactly():
    r = Doubling(1.0, 60.0)
    assert [r.next() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]


@pytest.mark.parametrize("first, cap", [(0, 5), (-1, 5), (6, 5)])
def test_refuses_a_delay_that_cannot_grow(first, cap):
    with pytest.raises(ValueError):
        Doubling(first, cap)


def test_a_servers_retry_after_is_waited_out_up_to_its_bound():
    """A feed answered 429 / 503 with ``Retry-After`` waits at least that long, at most
    ``RETRY_AFTER_MAX``; the doubling goes on underneath (attack26 F6: the change feed retried
    every 5 s against ``Retry-After: 20``)."""
    from memfuse.sidecar.backoff import RETRY_AFTER_MAX
    r = Doubling(0.2, 5.0)
    assert r.next(20.0) == 20.0
    assert r.delay == 0.4  # the doubling is unchanged by the server's ask
    assert r.next(None) == 0.4
    assert r.next(0.1) == 0.8  # a shorter ask never shortens the backoff
    assert r.next(1e9) == RETRY_AFTER_MAX
    assert r.next(float("nan")) == 3.2
    assert r.next(float("inf")) == RETRY_AFTER_MAX
