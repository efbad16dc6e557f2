"""The sidecar's blob cache in bulk mode (a snapshot's fill) and after crashes.

- a bulk fill writes the content once (journal in memory: no write-ahead log, no journal
  file grows), reads work meanwhile, and WAL with ``synchronous=NORMAL`` is back after it,
  with no marker left;
- ``kill -9`` in the middle of a bulk fill (one page committed, the next half written): the
  next open finds the marker, makes the file anew, empty, and ``rebuilt`` says so (a torn
  file is never trusted); a file SQLite cannot read is made anew too;
- a full disk during a bulk fill raises ``CacheError(ENOSPC)``, keeps what was committed,
  and the cache writes again once there is room, back in WAL.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.cachedir import CacheError
from memfuse.wire import sha256_hex


def blobs(tag: str, n: int, size: int = 3000) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        data = (f"{tag} {i} ".encode() * (size // 8 + 1))[:size]
        out.append((sha256_hex(data), data))
    return out


def mode_of(b: BlobCache) -> tuple[str, int, list]:
    return (b._db.execute("PRAGMA journal_mode").fetchone()[0], b._db.execute("PRAGMA synchronous").fetchone()[0],
            b._db.execute("SELECT what FROM fill").fetchall())


def test_bulk_fill_writes_once_reads_meanwhile_and_returns_to_wal(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    before = b.put(b"held before")
    assert mode_of(b) == ("wal", 1, [])
    wal = Path(f"{b.path}-wal")
    page1, page2 = blobs("one", 400), blobs("two", 400)
    with b.bulk():
        with b.bulk():  # nested (two stores loading): one fill
            with b.batch():
                b.put_many(page1)
            for f in (wal, Path(f"{b.path}-journal")):  # content went to the file only
                assert not f.exists() or f.stat().st_size == 0
            assert b.read(page1[7][0]) == page1[7][1] and b.read(before) == b"held before"
            assert mode_of(b) == ("memory", 0, [("filling",)])
        assert mode_of(b)[0] == "memory"  # the outer fill goes on
        b.put_many(page2)  # outside a batch: its own transaction
    assert mode_of(b) == ("wal", 1, [])
    assert b.missing([s for s, _ in page1 + page2] + [before]) == set()
    assert b.read(page2[-1][0], 5, 10) == page2[-1][1][5:15]
    b.close()
    again = BlobCache(tmp_path / "blobs.db")
    assert not again.rebuilt and again.count()[0] == 801


CRASH = r"""
import os, sys
from pathlib import Path
from memfuse.sidecar.blobcache import BlobCache
from memfuse.wire import sha256_hex
b = BlobCache(Path(sys.argv[1]))
b.put(b"held before")
def page(tag):
    return [(sha256_hex(d), d) for d in ((f"{tag} {i} ".encode() * 400)[:3000] for i in range(300))]
with b.bulk():
    with b.batch():
        b.put_many(page("one"))
    with b.batch():
        b.put_many(page("two"))
        print("half", flush=True)
        os.kill(os.getpid(), 9)  # mid-transaction, the marker still set
"""


def crash_in_bulk(path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", CRASH, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9 and "half" in proc.stdout, proc.stderr


def test_crash_in_bulk_fill_starts_the_file_anew(tmp_path):
    path = tmp_path / "blobs.db"
    crash_in_bulk(path)
    b = BlobCache(path)
    assert b.rebuilt and b.count() == (0, 0) and mode_of(b) == ("wal", 1, [])
    assert not Path(f"{path}-journal").exists()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    sha = b.put(b"works again")
    assert b.read(sha) == b"works again"
    b.close()
    again = BlobCache(path)  # a clean file is trusted as it is
    assert not again.rebuilt and again.read(sha) == b"works again"


def test_unreadable_file_starts_anew(tmp_path):
    path = tmp_path / "blobs.db"
    path.write_bytes(b"not a database at all " * 500)
    b = BlobCache(path)
    assert b.rebuilt and b.count() == (0, 0)
    assert b.read(b.put(b"x")) == b"x"


def test_full_disk_in_bulk_fill_raises_enospc_keeps_what_committed_and_recovers(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    first, big = blobs("first", 50), blobs("big", 2000)
    b._db.execute("PRAGMA max_page_count=400")  # ~1.6 MB: the second page does not fit
    with pytest.raises(CacheError) as err:
        with b.bulk():
            with b.batch():
                b.put_many(first)
            with b.batch():
                b.put_many(big)
    assert err.value.errno == errno.ENOSPC
    assert mode_of(b) == ("wal", 1, [])  # the fill was closed: marker gone, WAL back
    assert b.missing([s for s, _ in first]) == set()
    assert b.missing([s for s, _ in big]) == {s for s, _ in big}
    b._db.execute("PRAGMA max_page_count=1073741823")  # room again
    with b.bulk():
        b.put_many(big)
    assert b.missing([s for s, _ in big]) == set() and mode_of(b) == ("wal", 1, [])
    assert os.path.exists(b.path)


def test_a_file_of_an_earlier_release_is_used_and_filled_in_bulk(tmp_path):
    import sqlite3

    path = tmp_path / "blobs.db"
    old = sqlite3.connect(str(path), isolation_level=None)
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE blobs (sha TEXT PRIMARY KEY, data BLOB NOT NULL)")
    old.execute("INSERT INTO blobs VALUES (?, ?)", (sha256_hex(b"kept"), b"kept"))
    old.close()
    b = BlobCache(path)
    assert not b.rebuilt and b._db.execute("PRAGMA page_size").fetchone()[0] == 4096
    assert b.read(sha256_hex(b"kept")) == b"kept"
    page = blobs("p", 500)
    with b.bulk():
        b.put_many(page)
    assert b.missing([s for s, _ in page]) == set() and mode_of(b) == ("wal", 1, [])


def test_snapshot_into_a_full_cache_raises_cache_error_not_a_group_and_fills_when_room(tmp_path):
    """``StoreSync._snapshot_metas`` with a blob cache that fills up: ``CacheError(ENOSPC)``
    as is (the loader's retry catches it; inside an exception group it would not), the fill
    closed (WAL back, no marker); once there is room the same snapshot stores every page."""
    import types
    from datetime import datetime, timezone

    import trio

    from memfuse.sidecar.stores import StoreSync
    from memfuse.wire import Record, RecordPage

    t = datetime(2026, 12, 1, tzinfo=timezone.utc)

    def page(k: int, last: bool) -> RecordPage:
        recs = []
        for i in range(100):
            text = (f"page {k} record {i} " * 200)[:3000]
            recs.append(Record(id=f"r{k:02d}{i:03d}", store="s", path=f"p{k:02d}/{i:03d}.md", type="project",
                               version=1, sha256=sha256_hex(text.encode()), size=3000, created_at=t,
                               updated_at=t, updated_by="t", seq=1, content=text))
        return RecordPage(records=recs, next_cursor=None if last else f"c{k}", seq=42)

    class Client:
        async def iter_pages(self, slug, content, limit):
            for k in range(6):
                yield page(k, k == 5)

    b = BlobCache(tmp_path / "blobs.db")
    s = StoreSync()
    s.client, s.fs = Client(), types.SimpleNamespace(blobs=b)
    b._db.execute("PRAGMA max_page_count=40")  # 640 KiB: the first page of 300 KB fits, not all
    with pytest.raises(CacheError) as err:
        trio.run(s._snapshot_metas, "s", 100)
    assert err.value.errno == errno.ENOSPC
    assert mode_of(b) == ("wal", 1, [])
    b._db.execute("PRAGMA max_page_count=1073741823")
    metas, seq = trio.run(s._snapshot_metas, "s", 100)
    assert seq == 42 and len(metas) == 600
    assert b.missing([m.sha256 for m in metas]) == set()
    assert b.read(page(3, False).records[7].sha256) == page(3, False).records[7].content.encode()


def _flip_on_disk(path: Path, needle: bytes, to: bytes) -> int:
    """Overwrite every occurrence of ``needle`` in the file at ``path`` (closed) with ``to``
    (same length), as ``dd`` would: SQLite keeps no checksum of a page, so it reads back
    the changed bytes. Returns how many were changed."""
    raw = path.read_bytes()
    n, i = 0, raw.find(needle)
    with open(path, "r+b") as f:
        while i >= 0:
            f.seek(i)
            f.write(to)
            n += 1
            i = raw.find(needle, i + 1)
    return n


def test_bytes_damaged_on_disk_are_never_served_and_the_entry_is_dropped(tmp_path, caplog):
    """A whole blob whose bytes were changed on disk while the cache was closed reads as
    absent (whole, by range, with ``get``) and is deleted with a warning naming its sha256,
    never its content; an undamaged blob beside it reads exact, by range too, from the
    first read and after it (the check is once per load: later ranges are one substr)."""
    p = tmp_path / "blobs.db"
    bad = b"# notes\n" + b"the-secret-word-damaged " * 200
    good = b"# other\n" + b"fine line\n" * 300
    b = BlobCache(p)
    bad_sha, good_sha = b.put(bad), b.put(good)
    b.checkpoint()
    b.close()
    assert _flip_on_disk(p, b"secret-word", b"SECRET-WORD") > 0
    b = BlobCache(p)
    try:
        with caplog.at_level("WARNING", logger="memfuse.mount"):
            assert b.read(bad_sha, 100, 50) == b""
        warned = [r for r in caplog.records if "damaged" in r.getMessage()]
        assert warned and warned[0].sha256 == bad_sha  # type: ignore[attr-defined]
        assert all(b"secret" not in r.getMessage().encode().lower() for r in caplog.records)
        assert b.read(bad_sha) == b"" and b.get(bad_sha) is None and not b.has(bad_sha)
        assert b.dropped == 1
        assert b.read(good_sha, 7, 13) == good[7:20]
        for off in range(0, len(good), 1000):  # ranges after the check: the fast path
            assert b.read(good_sha, off, 1000) == good[off:off + 1000]
        assert b.get(good_sha) == good
        b.put(bad, bad_sha)  # fetched again: held and exact
        assert b.read(bad_sha) == bad
    finally:
        b.close()


def _rows_in_file(path: Path) -> set[str]:
    """The sha256s of the blobs in the file, as another connection reads them."""
    import sqlite3

    db = sqlite3.connect(str(path))
    try:
        return {r[0] for r in db.execute("SELECT sha FROM blobs")}
    finally:
        db.close()


def test_contents_put_behind_are_served_from_memory_and_written_together(tmp_path, monkeypatch):
    """``put_behind`` (a close's content, hashed by the sidecar): nothing is written at once;
    ``read`` / ``get`` / ``has`` serve it from memory; any other method writes what waits
    first, in one transaction (so ``missing`` counts it held and ``gc`` sees it); so do
    ``write_behind``, the next ``batch``, ``BEHIND_MAX`` contents waiting, and ``close``."""
    import memfuse.sidecar.blobcache as bc

    b = BlobCache(tmp_path / "blobs.db")
    (s1, d1), (s2, d2), (s3, d3) = blobs("behind", 3, 600)
    b.put_behind(d1, s1)
    b.put_behind(d1, s1)  # twice: held once
    assert _rows_in_file(b.path) == set()
    assert b.read(s1) == d1 and b.read(s1, 10, 5) == d1[10:15] and b.read(s1, 590) == d1[590:]
    assert b.get(s1) == d1 and b.has(s1)
    assert _rows_in_file(b.path) == set()  # reads wrote nothing
    assert b.missing([s1, s2]) == {s2}  # written first
    assert _rows_in_file(b.path) == {s1}
    b.put_behind(d2, s2)
    with b.batch():
        b.put(d3, s3)
    assert _rows_in_file(b.path) == {s1, s2, s3}  # with the batch
    assert b.gc({s2}) == 2  # what waited is written before a collection, then judged
    monkeypatch.setattr(bc, "BEHIND_MAX", 3)
    more = blobs("more", 4, 100)
    for sha, data in more[:2]:
        b.put_behind(data, sha)
    assert _rows_in_file(b.path) == {s2}
    b.put_behind(more[2][1], more[2][0])  # the third: all three written
    assert _rows_in_file(b.path) == {s2} | {s for s, _ in more[:3]}
    b.put_behind(more[3][1], more[3][0])
    b.write_behind()
    assert more[3][0] in _rows_in_file(b.path)
    b.put_behind(d1, s1)
    b.close()  # written before the file is closed
    assert s1 in _rows_in_file(b.path)
    b2 = BlobCache(tmp_path / "blobs.db")
    assert b2.get(s1) == d1 and b2.read(more[3][0]) == more[3][1]  # checked at this load


def test_contents_put_behind_stay_served_while_the_disk_refuses_them(tmp_path, monkeypatch):
    """A full disk when what waits must be written: ``put_behind`` raises ``CacheError`` and
    does not hold the new content (its caller keeps it in memory, as for ``put``); what
    waited before stays in memory, served, and is written once there is room; a method
    that had to write it first logs and goes on."""
    import memfuse.sidecar.blobcache as bc

    monkeypatch.setattr(bc, "BEHIND_MAX", 2)
    b = BlobCache(tmp_path / "blobs.db")
    pages = b._db.execute("PRAGMA page_count").fetchone()[0]
    b._db.execute(f"PRAGMA max_page_count={pages}")  # nothing more fits
    (s1, d1), (s2, d2) = blobs("full", 2, 9000)
    b.put_behind(d1, s1)
    with pytest.raises(CacheError) as err:
        b.put_behind(d2, s2)
    assert err.value.errno == errno.ENOSPC
    assert b.read(s1) == d1 and b.get(s2) is None and not b.has(s2)
    assert b.missing([s1, s2]) == {s2}  # its write failed again (logged): held in memory
    assert b.get(s1) == d1 and _rows_in_file(b.path) == set()
    b._db.execute("PRAGMA max_page_count=1073741823")  # room again
    b.write_behind()
    assert _rows_in_file(b.path) == {s1}
    b.close()


def test_a_write_behind_is_a_few_statements_whatever_it_holds(tmp_path, monkeypatch):
    """The write of the contents put behind (``BEHIND_MAX`` of them, on the close that
    fills it: the trio thread) is one ``SELECT`` of the append links among them and one
    multi-row ``INSERT``, not two statements per content (130 for 64 contents before:
    bench/README.md, "The close path, session 18: sidecar"); ``batch`` writes what waits the
    same way. Each content still follows ``put``'s rule: one held as an append link whose
    chain resolves is not stored whole again; a link whose chain is broken gives way to the
    whole content, which reads exact."""
    import memfuse.sidecar.blobcache as bc
    from test_blobcache_appends import appended

    b = BlobCache(tmp_path / "blobs.db")
    base = b"H" * 2000 + b"\n"
    base_sha = b.put(base)
    kept_sha, kept = appended(b, base, b"kept link\n")  # a link that resolves
    broken_sha, broken = appended(b, kept, b"broken link\n")
    b._db.execute("DELETE FROM appends WHERE sha=?", (kept_sha,))  # breaks ``broken``'s chain
    kept_sha, kept = appended(b, base, b"kept again\n")
    assert b.read(broken_sha) == b""
    statements: list[str] = []
    b._db.set_trace_callback(statements.append)
    n = bc.BEHIND_MAX
    items = blobs("behind", n - 2, 550) + [(kept_sha, kept), (broken_sha, broken)]
    for sha, data in items:
        b.put_behind(data, sha)  # the last one writes them all
    b._db.set_trace_callback(None)
    writes = [s for s in statements if not s.startswith(("PRAGMA", "SELECT base, base_len",
                                                           "SELECT length(data)"))]
    assert len(writes) <= 5, writes[:8]  # BEGIN, SELECT links, DELETE broken, INSERT, COMMIT
    assert _rows_in_file(b.path) >= {s for s, _ in items if s != kept_sha}
    assert kept_sha not in _rows_in_file(b.path)  # held as a link: not stored whole
    assert b._db.execute("SELECT COUNT(*) FROM appends WHERE sha=?", (broken_sha,)).fetchone()[0] == 0
    for sha, data in items:
        assert b.read(sha) == data and b.get(sha) == data
    # ``batch`` writes what waits with it, the same way
    more = blobs("batch", 10, 300)
    for sha, data in more:
        b.put_behind(data, sha)
    statements.clear()
    b._db.set_trace_callback(statements.append)
    with b.batch():
        pass
    b._db.set_trace_callback(None)
    assert len(statements) <= 4, statements[:8]
    assert _rows_in_file(b.path) >= {s for s, _ in more}
    b.close()
    b2 = BlobCache(tmp_path / "blobs.db")
    for sha, data in items + more:
        assert b2.get(sha) == data
    b2.close()


def test_a_write_behind_past_put_rows_goes_in_chunks(tmp_path, monkeypatch):
    """More contents behind than one statement takes (``PUT_ROWS``): one ``SELECT`` and one
    ``INSERT`` per ``PUT_ROWS`` of them, every content stored and read back exact."""
    import memfuse.sidecar.blobcache as bc

    monkeypatch.setattr(bc, "BEHIND_MAX", bc.PUT_ROWS + 50)
    b = BlobCache(tmp_path / "blobs.db")
    items = blobs("many", bc.PUT_ROWS + 50, 40)
    statements: list[str] = []
    b._db.set_trace_callback(statements.append)
    for sha, data in items:
        b.put_behind(data, sha)
    b._db.set_trace_callback(None)
    assert sum(s.startswith("INSERT") for s in statements) == 2
    assert sum(s.startswith("SELECT sha FROM appends") for s in statements) == 2
    assert _rows_in_file(b.path) == {s for s, _ in items}
    assert all(b.get(sha) == data for sha, data in items)
    b.close()
