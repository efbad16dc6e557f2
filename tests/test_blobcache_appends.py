"""The sidecar's blob cache stores an append as a link to the blob it extends.

- a chain of appends reads back exact, whole and by any range, and stores what it appends
  (plus one whole copy every ``APPEND_CHAIN_MAX`` links);
- ``put_append`` declines (the caller stores whole) when the base is not held, or not with
  the length given, or the suffix is empty;
- ``gc`` keeps the bases of a kept link, drops the rest; ``has`` / ``missing`` see links;
  a link whose base was removed by hand reads as absent, never as wrong bytes;
- ``kill -9`` of a process appending in a loop: on reopening, every content it had stored
  reads back exact and every link left resolves to bytes with its sha256.
"""
from __future__ import annotations

import os
import sqlite3
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memfuse.sidecar.blobcache import APPEND_CHAIN_MAX, BlobCache
from memfuse.wire import sha256_hex


def appended(b: BlobCache, base: bytes, suffix: bytes) -> tuple[str, bytes]:
    """Store ``base + suffix`` as the sidecar's commit does: a link, else whole."""
    data = base + suffix
    sha = sha256_hex(data)
    if not b.put_append(sha, sha256_hex(base), len(base), suffix):
        b.put(data, sha)
    return sha, data


def links(b: BlobCache) -> int:
    return int(b._db.execute("SELECT COUNT(*) FROM appends").fetchone()[0])


def test_a_chain_of_appends_reads_exact_and_stores_what_it_appends(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    rng = random.Random(7)
    content = ("# journal\n" + "".join(f"line {i} of the base\n" for i in range(20_000))).encode()
    first = b.put(content)
    versions = [(first, content)]
    n = 3 * APPEND_CHAIN_MAX + 5
    appended_bytes = 0
    for i in range(n):
        suffix = f"appended line {i} {'x' * rng.randrange(0, 300)}\n".encode()
        appended_bytes += len(suffix)
        versions.append(appended(b, versions[-1][1], suffix))
    # whole copies: the first, then one per APPEND_CHAIN_MAX + 1 puts
    wholes = int(b._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0])
    assert wholes == 1 + n // (APPEND_CHAIN_MAX + 1)
    assert links(b) == n + 1 - wholes
    count, stored = b.count()
    assert count == n + 1
    assert stored <= wholes * (len(content) + appended_bytes) + appended_bytes
    assert max(r[0] for r in b._db.execute("SELECT chain FROM appends")) == APPEND_CHAIN_MAX
    for sha, data in versions:
        assert b.has(sha)
        assert b.read(sha) == data
        for _ in range(20):
            off = rng.randrange(0, len(data) + 10)
            size = rng.choice([-1, 0, 1, 7, 4096, 70_000, len(data)])
            want = data[off:] if size < 0 else data[off:off + size]
            assert b.read(sha, off, size) == want, (off, size)
        # a read across the base / suffix boundary and at the very end
        assert b.read(sha, len(content) - 3, 10) == data[len(content) - 3:len(content) + 7]
        assert b.read(sha, len(data) - 1) == data[-1:]
        assert b.read(sha, len(data)) == b""
    assert b.missing([s for s, _ in versions]) == set()
    b.close()
    again = BlobCache(tmp_path / "blobs.db")
    assert all(again.read(s) == d for s, d in versions)
    again.close()


def test_put_append_declines_what_it_cannot_link(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    base = b"a base of some length\n" * 100
    held = b.put(base)
    data = base + b"more\n"
    sha = sha256_hex(data)
    assert not b.put_append(sha, sha256_hex(b"not held"), len(base), b"more\n")
    assert not b.put_append(sha, held, len(base) - 1, b"more\n")  # another length: not that base
    assert not b.put_append(held, held, len(base), b"")
    assert not b.has(sha) and b.read(sha) == b"" and links(b) == 0
    assert b.put_append(sha, held, len(base), b"more\n")
    assert b.put_append(sha, held, len(base), b"more\n")  # held already: one row
    assert links(b) == 1 and b.read(sha) == data
    b.put(data, sha)  # a whole put of a linked content is a no-op for reads
    assert b.read(sha, 3, 5) == data[3:8]
    b.close()


def test_gc_keeps_the_bases_of_kept_links_and_broken_links_read_absent(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    base = b"".join(b"entry %d\n" % i for i in range(2000))
    chain = [(b.put(base), base)]
    for i in range(5):
        chain.append(appended(b, chain[-1][1], b"appended %d\n" % i))
    other = b.put(b"another file's content")
    unrelated = appended(b, b"another file's content", b" and more")
    last_sha, last = chain[-1]
    removed = b.gc({last_sha})
    # kept: the last link and everything it rests on; dropped: the other file's two
    assert removed == 2
    assert not b.has(other) and not b.has(unrelated[0])
    assert all(b.has(s) for s, _ in chain) and b.read(last_sha) == last
    assert b.gc_digests({bytes.fromhex(last_sha)}) == 0
    assert b.gc(set()) == len(chain) and b.count() == (0, 0)
    # a link whose base is gone (removed by hand): absent, never wrong bytes
    chain = [(b.put(base), base)]
    chain.append(appended(b, base, b"one\n"))
    chain.append(appended(b, chain[-1][1], b"two\n"))
    b._db.execute("DELETE FROM blobs WHERE sha=?", (chain[0][0],))
    assert not b.has(chain[2][0]) and b.read(chain[2][0]) == b"" and b.read(chain[2][0], 5, 5) == b""
    assert b.missing([chain[2][0]]) == {chain[2][0]}  # fetched again by the loader
    b.close()


_WRITER = textwrap.dedent("""
    import sys
    from memfuse.sidecar.blobcache import BlobCache
    from memfuse.wire import sha256_hex
    b = BlobCache(__import__("pathlib").Path(sys.argv[1]))
    data = b"".join(b"base line %d\\n" % i for i in range(30_000))
    b.put(data)
    i = 0
    while True:
        suffix = b"appended %d\\n" % i
        new = data + suffix
        sha = sha256_hex(new)
        if not b.put_append(sha, sha256_hex(data), len(data), suffix):
            b.put(new, sha)
        print(sha, len(new), flush=True)
        data, i = new, i + 1
""")


def test_kill_while_appending_leaves_every_stored_content_exact(tmp_path):
    path = tmp_path / "blobs.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, env=env)
    done: list[tuple[str, int]] = []
    try:
        assert p.stdout is not None
        while len(done) < 2 * APPEND_CHAIN_MAX + 7:
            line = p.stdout.readline()
            assert line, "the writer stopped"
            sha, size = line.split()
            done.append((sha.decode(), int(size)))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    b = BlobCache(path)
    assert not b.rebuilt
    for sha, size in done:
        data = b.read(sha)
        assert len(data) == size and sha256_hex(data) == sha
    for (sha,) in b._db.execute("SELECT sha FROM appends").fetchall():
        data = b.read(sha)
        assert data and sha256_hex(data) == sha  # a link written before the kill resolves
    b.close()


def _chain(tmp_path: Path, n: int = 8) -> tuple[BlobCache, list[tuple[str, bytes]]]:
    """A cache holding a 2 KB content appended to ``n`` times (a link each)."""
    b = BlobCache(tmp_path / "blobs.db")
    data = b"H" * 2000 + b"\n"
    versions = [(b.put(data), data)]
    for i in range(1, n + 1):
        versions.append(appended(b, versions[-1][1], f"line-{i}-zzzzzzzzzzzzzzzz\n".encode()))
    assert links(b) == n
    return b, versions


@pytest.mark.parametrize("damage", ["flip", "text", "cut", "base"])
def test_a_damaged_link_reads_absent_with_every_link_on_it_and_the_rest_stays(tmp_path, damage):
    """A link of an append chain whose suffix was changed (same length), stored as TEXT
    (``TypeError`` before: EIO "unexpected error"), or cut, or whose whole base blob was
    changed: every version resting on it reads as absent (whole, by range, ``get``) and its
    rows are deleted; the versions below it still read exact (each link is checked against
    its own sha256). Checked at the first load of a fresh cache (a restart)."""
    b, versions = _chain(tmp_path)
    b.close()
    db = sqlite3.connect(tmp_path / "blobs.db")
    mid = versions[5][0]  # the link adding line-5
    if damage == "flip":
        db.execute("UPDATE appends SET suffix=CAST(replace(CAST(suffix AS TEXT), 'line', 'LINE') AS BLOB) "
                   "WHERE sha=?", (mid,))
    elif damage == "text":
        db.execute("UPDATE appends SET suffix=CAST(suffix AS TEXT) WHERE sha=?", (mid,))
    elif damage == "cut":
        db.execute("UPDATE appends SET suffix=substr(suffix, 1, 3) WHERE sha=?", (mid,))
    else:
        db.execute("UPDATE blobs SET data=CAST(replace(CAST(data AS TEXT), 'HHH', 'hhh') AS BLOB)")
    db.commit()
    db.close()
    b = BlobCache(tmp_path / "blobs.db")
    try:
        first_bad = 0 if damage == "base" else 5
        top_sha, top = versions[-1]
        assert b.read(top_sha, 2000, 10) == b""
        for sha, _ in versions[first_bad:]:
            assert b.read(sha) == b"" and b.get(sha) is None, sha
            assert not b.has(sha)
        for sha, data in versions[:first_bad]:
            assert b.read(sha) == data and b.get(sha) == data
            assert b.read(sha, 1990, 30) == data[1990:2020]
        assert links(b) == max(0, first_bad - 1)
        # fetched again (put whole, as the refetch does): exact from then on
        b.put(top, top_sha)
        assert b.read(top_sha) == top
    finally:
        b.close()


def test_reads_of_a_checked_chain_by_range_are_exact(tmp_path):
    """After the first (checked) load, range reads of a link resolve through the chain (one
    substr a row) and give the same bytes as slicing the content."""
    b, versions = _chain(tmp_path, APPEND_CHAIN_MAX)
    try:
        sha, data = versions[-1]
        assert b.read(sha) == data
        rnd = random.Random(5)
        for _ in range(200):
            off, size = rnd.randrange(len(data) + 5), rnd.randrange(-1, 300)
            want = data[off:] if size < 0 else data[off:off + size]
            assert b.read(sha, off, size) == want, (off, size)
    finally:
        b.close()


def test_a_content_held_as_a_link_is_not_stored_whole_again(tmp_path):
    """The change feed brings back the content of this sidecar's own appends (``put`` of
    each version): a content held as a link is not stored whole again, so a file appended
    to line by line keeps a link per append and a whole copy only every
    ``APPEND_CHAIN_MAX``-th (the design), not both."""
    b, versions = _chain(tmp_path)
    try:
        for sha, data in versions:
            b.put(data, sha)  # what sync.py / remote.py do with the feed's content
        whole = b._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0]
        assert (whole, links(b)) == (1, len(versions) - 1)
        for sha, data in versions:
            assert b.read(sha) == data
    finally:
        b.close()


def test_a_link_whose_base_was_deleted_gives_way_to_the_whole_content(tmp_path):
    """A link row left without its base (a middle link deleted by hand: ``atk_t2 dellink``)
    reads as absent; the content fetched again and ``put`` whole replaces it (a link that
    cannot be read never hides the whole content), and it reads exact."""
    b, versions = _chain(tmp_path)
    try:
        b._db.execute("DELETE FROM appends WHERE sha=?", (versions[5][0],))
        top_sha, top = versions[-1]
        assert b.read(top_sha) == b"" and b.get(top_sha) is None
        b.put(top, top_sha)
        assert b.read(top_sha) == top and b.get(top_sha) == top
    finally:
        b.close()
