"""Append rows of the outbox journal: an append (``echo >> f``) is journaled as the bytes it
adds plus a reference to its base (``journal.APPEND_REF``), and replayed exactly after a
crash: from the earlier rows it names, from the blob cache, or, when both lost it, as an
append on the version the control plane holds (docs/SEMANTICS.md, "Appends in the outbox
journal"). A damaged row is refused (``journal_lost``), never sent as a whole content it is
not. Journal, committer and the in-process control plane; the mount's crash replay is
tests/test_append_mount.py's."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.hashstate import Sha256States
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import APPEND_REF, PUT, Entry, Journal
from memfuse.wire import sha256_hex

LINE = b'{"event": "a journal line of some agent notes"}\n'
BASE = LINE * 400  # 20 KB: above the size an append is sent as a suffix from


def _put(i: int, content: bytes, base: bytes | None = None) -> Entry:
    """A put of file ``n:a`` as ``Filesystem.commit`` makes it (an append names its base)."""
    ab = (sha256_hex(base), len(base)) if base is not None else None
    return Entry(id=i, store="default", op=PUT, node_key="n:a", args={"path": "a.md"},
                 content=content, sha=sha256_hex(content), append_base=ab)


def _rows(path: Path) -> list[tuple[int, int, dict]]:
    db = sqlite3.connect(path)
    try:
        return [(i, n, json.loads(a)) for i, n, a in
                db.execute("SELECT id, length(content), args FROM entries ORDER BY id")]
    finally:
        db.close()


async def _written(path: Path, entries: list[Entry], finished: list[Entry] = ()) -> None:
    """``entries`` journaled (and ``finished`` removed after), then the journal closed as a
    killed process leaves it."""
    j = Journal(path)
    for e in entries:
        j.add(e)
    await j.flush_pending()
    for e in finished:
        j.remove(e)
    await j.flush_pending()
    j._db.close()  # no checkpoint, no goodbye: what a kill -9 leaves
    j.witness.close()


async def test_an_append_row_holds_the_suffix_and_replays_whole(tmp_path):
    """Three appends on a queued create: the rows hold 20 KB once and then only what each
    append adds; a restart rebuilds every content exactly, the last one read at load, the
    ones coalescing absorbs on demand (``Committer.fill``)."""
    c1, c2, c3 = BASE, BASE + b"one\n", BASE + b"one\ntwo\n"
    entries = [_put(1, c1), _put(2, c2, c1), _put(3, c3, c2)]
    await _written(tmp_path / "outbox.db", entries)
    rows = _rows(tmp_path / "outbox.db")
    assert [n for _, n, _ in rows] == [len(c1), 4, 4]
    assert [a.get(APPEND_REF) for _, _, a in rows] == [
        None, {"h": sha256_hex(c1), "n": len(c1), "e": 1}, {"h": sha256_hex(c2), "n": len(c2), "e": 2}]
    j = Journal(tmp_path / "outbox.db")
    loaded, _ = j.load()
    assert [e.args for e in loaded] == [{"path": "a.md"}] * 3  # the reference stays on disk
    assert loaded[2].content == c3 and loaded[2].suffix_only is None
    c = Committer(None, j, {})  # type: ignore[arg-type]  # nothing is sent here
    for e, want in zip(loaded, (c1, c2)):
        if e.deferred:
            c.fill(e)
        assert e.content == want
    j.close()


async def test_a_finished_base_is_taken_from_the_blob_cache(tmp_path):
    """The base's row finished (committed, deleted) before the crash: the append is rebuilt
    from the blob cache, checked against the base's sha256; a blob that does not match is
    not used."""
    c1, c2 = BASE, BASE + b"one\n"
    e1, e2 = _put(1, c1), _put(2, c2, c1)
    await _written(tmp_path / "outbox.db", [e1, e2], finished=[e1])
    j = Journal(tmp_path / "outbox.db")
    (e,), _ = j.load()
    assert e.content is None and e.suffix_only == (sha256_hex(c1), b"one\n")
    assert Journal.resolve_bases([e], {sha256_hex(c1): b"not it"}.get) == 0
    assert e.content is None
    assert Journal.resolve_bases([e], {sha256_hex(c1): c1}.get) == 1
    assert e.content == c2 and e.suffix_only is None
    j.close()


async def _replay(tmp_path: Path, api: ApiClient, ids: dict, blobs: dict) -> list[Entry]:
    j = Journal(tmp_path / "outbox.db")
    entries, _ = j.load()
    Journal.resolve_bases(entries, blobs.get)
    c = Committer(api, j, ids, base_content=blobs.get)
    c.replay(entries)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(j.run)
        await nursery.start(c.run)
        with trio.fail_after(30):
            await c.wait_idle()
        nursery.cancel_scope.cancel()
    j.close()
    return entries


async def test_a_base_lost_everywhere_is_appended_on_the_version_the_control_plane_holds(tmp_path):
    """Base row finished and blob cache lost (a machine crash): the base is read back from
    the control plane (the current record; after a rival change, the version with that
    sha256 in its history), the queued append is sent as an append on that version (exact),
    and after the rival change rebased onto the current content as an append is; the file
    is then shown what the control plane holds (``merged``). One version per replayed
    append."""
    fake = FakeControlPlane(seed=5)
    token = await fake.setup("ws")
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        rec = await api.create_record("default", "a.md", BASE.decode())
        e1, e2 = _put(1, BASE + b"x\n"), _put(2, BASE + b"x\ny\n", BASE + b"x\n")
        e1.append_base = (rec.sha256, len(BASE))
        await _written(tmp_path / "outbox.db", [e1, e2])
        # e1 committed (and its row deleted) before the crash: the control plane holds it
        e1rec = await api.append_record("default", rec.id, "x\n", if_match=rec.sha256,
                                        idempotency_key=e1.key + "-append")
        db = sqlite3.connect(tmp_path / "outbox.db")
        db.execute("DELETE FROM entries WHERE id = 1")
        db.commit()
        db.close()
        (e,) = await _replay(tmp_path, api, {"n:a": (rec.id, e1rec.sha256)}, {})
        assert e.errno == 0, e.reason
        got = await api.get_record("default", rec.id)
        assert got.content == (BASE + b"x\ny\n").decode() and e.merged == BASE + b"x\ny\n"
        assert len(await api.versions("default", rec.id)) == 3

        # the same again after a rival append: the bytes go after what it holds now
        e3 = _put(3, BASE + b"x\ny\nz\n", BASE + b"x\ny\n")
        await _written(tmp_path / "outbox.db", [e3])
        await api.append_record("default", rec.id, "rival\n", if_match=got.sha256)
        (e,) = await _replay(tmp_path, api, {"n:a": (rec.id, got.sha256)}, {})
        assert e.errno == 0, e.reason
        got = await api.get_record("default", rec.id)
        assert got.content == (BASE + b"x\ny\nrival\nz\n").decode()
        assert e.merged == got.content.encode()


async def test_a_damaged_append_row_is_refused_and_nothing_is_sent(tmp_path):
    """An append row whose reference is damaged (not the shape the journal writes) or whose
    rebuilt base does not match its sha256 is never sent as the whole content: a damaged
    reference is refused (``journal_lost``, the record unchanged); a base that does not
    check out is sent as an append on the version it names (a 412 there: appended to the
    current content, never replacing it)."""
    fake = FakeControlPlane(seed=9)
    token = await fake.setup("ws")
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        rec = await api.create_record("default", "a.md", BASE.decode())
        e1 = _put(1, BASE + b"x\n", BASE)
        e1.append_base = (rec.sha256, len(BASE))
        await _written(tmp_path / "outbox.db", [e1])
        db = sqlite3.connect(tmp_path / "outbox.db")
        db.execute("UPDATE entries SET args = ? WHERE id = 1",
                   (json.dumps({"path": "a.md", APPEND_REF: "garbage"}),))
        db.commit()
        db.close()
        (e,) = await _replay(tmp_path, api, {"n:a": (rec.id, rec.sha256)}, {rec.sha256: BASE})
        assert e.errno != 0 and e.code == "journal_lost"
        assert (await api.get_record("default", rec.id)).sha256 == rec.sha256

        # a chain whose base row was altered: the check fails, the append goes on its version
        c1, c2 = BASE + b"a\n", BASE + b"a\nb\n"
        e1, e2 = _put(1, c1), _put(2, c2, c1)
        await _written(tmp_path / "outbox2.db", [e1, e2])
        db = sqlite3.connect(tmp_path / "outbox2.db")
        db.execute("UPDATE entries SET content = ? WHERE id = 1", (b"tampered",))
        db.commit()
        db.close()
        j = Journal(tmp_path / "outbox2.db")
        entries, _ = j.load()
        assert entries[1].content is None and entries[1].suffix_only == (sha256_hex(c1), b"b\n")
        j.close()


def test_hash_states_give_the_digest_of_the_whole():
    """``Sha256States``: the sha256 of an append from its base's state equals the whole
    content's, chained; a base without a kept state is hashed whole; states are bounded."""
    h = Sha256States(max_states=3, min_bytes=0)
    data = BASE
    sha = h.digest(data)
    for i in range(10):
        suffix = f"line {i}\n".encode()
        got = h.of(data + suffix, sha, len(data))
        data += suffix
        assert got == sha256_hex(data)
        sha = got
    assert h.hits == 10 and len(h._states) == 3
    assert h.extend(sha256_hex(b"never seen"), b"x") is None
    assert h.of(b"abc", sha256_hex(b"never seen"), 1) == sha256_hex(b"abc")
