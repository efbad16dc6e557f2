"""The ``/metrics`` statement counter (``limits.StatementCount``): counted per thread without a
lock by a ``before_cursor_execute`` listener, summed at each scrape; exact across threads,
threads that ended included, and exposed as the Counter it replaced
(``memfuse_server_db_statements_total`` and ``_created``)."""
from __future__ import annotations

import threading

from sqlalchemy import event, text

from memfuse.server.db import Database
from memfuse.server.limits import ServerMetrics
from memfuse.server.rawsql import Raw

_ONE = Raw(text("SELECT 1"))


def _sample(metrics: ServerMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_statements_of_many_threads_are_counted_exactly(tmp_path):
    """Threads running statements at once (Raw and Core), threads that end before the scrape
    and new ones after: the counter equals a locked reference count of the same statements,
    in ``value()`` and in the exposition, and keeps no count per ended thread."""
    db = Database(f"sqlite:///{tmp_path}/cp.db")
    metrics = ServerMetrics()
    metrics.count_statements(db.engine)
    lock = threading.Lock()
    ref = [0]

    def spy(conn, cursor, statement, parameters, context, executemany):
        with lock:
            ref[0] += 1

    event.listen(db.engine, "before_cursor_execute", spy)
    try:
        start = metrics.db_statements.value()
        base = ref[0]

        def work(n: int) -> None:
            with db.engine.connect() as conn:
                for i in range(n):
                    if i % 10:
                        _ONE.run(conn, {})
                    else:
                        conn.execute(text("SELECT 2")).all()
                conn.rollback()

        for wave in range(3):
            threads = [threading.Thread(target=work, args=(300 + 7 * k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
                assert not t.is_alive()
            assert metrics.db_statements.value() - start == ref[0] - base > 0
        work(5)  # this thread too
        assert metrics.db_statements.value() - start == ref[0] - base
        assert _sample(metrics, "memfuse_server_db_statements_total") == metrics.db_statements.value()
        assert _sample(metrics, "memfuse_server_db_statements_created") > 0
        assert len(metrics.db_statements._counts) <= 8 + 2  # the last wave's, this thread's, another's
    finally:
        event.remove(db.engine, "before_cursor_execute", spy)
        db.dispose()


def test_core_statements_run_unchanged_under_the_counter(tmp_path):
    """The listener returns the statement and parameters (``retval``): Core runs them as given."""
    db = Database(f"sqlite:///{tmp_path}/cp.db")
    metrics = ServerMetrics()
    metrics.count_statements(db.engine)
    try:
        before = metrics.db_statements.value()
        with db.read_conn() as conn:
            assert conn.execute(text("SELECT :a + 1"), {"a": 41}).scalar() == 42
        assert metrics.db_statements.value() - before == 2  # BEGIN and the SELECT
    finally:
        db.dispose()
