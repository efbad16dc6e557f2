"""The sidecar sends an append as an append (docs/SEMANTICS.md "Append versions"): a close
whose content is its base plus a suffix goes as ``POST .../append`` with only the suffix and
``If-Match`` the base; a rival change is rebased as for a whole write; an append whose answer
was lost, retried or replayed after a crash from the journal, is applied once. Through the
core and the committer against the in-process fake control plane (no FUSE)."""
from __future__ import annotations

import trio

from memfuse.errors import TransientError
from memfuse.fake import RACE_MARKER, FakeControlPlane
from memfuse.sidecar.conflict import APPEND_MIN_BYTES

from test_faults import append, conflict_lines, make_sidecar, remote, start, write

BASE = b"# journal\n" + b"x" * (2 * APPEND_MIN_BYTES) + b"\n"


def _spy(sc) -> list[tuple[str, int]]:
    """Record each append / update request the sidecar's client makes: (kind, bytes of
    content sent)."""
    calls: list[tuple[str, int]] = []
    real_append, real_update = sc.client.append_record, sc.client.update_record

    async def appending(store, rid, suffix, *a, **kw):
        calls.append(("append", len(suffix.encode())))
        return await real_append(store, rid, suffix, *a, **kw)

    async def updating(store, rid, content, *a, **kw):
        calls.append(("update", len(content.encode())))
        return await real_update(store, rid, content, *a, **kw)

    sc.client.append_record, sc.client.update_record = appending, updating
    return calls


async def test_appends_are_sent_as_their_suffix_and_small_files_whole(tmp_path):
    fake = FakeControlPlane(seed=21)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    calls = _spy(sc)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", BASE)
        want = BASE
        for i in range(20):
            line = f"line {i}\n".encode()
            await append(sc, "j.md", line)
            want += line
        assert (await remote(fake))["j.md"] == want
        assert [k for k, _ in calls] == ["append"] * 20
        assert sum(n for _, n in calls) == len(want) - len(BASE)  # only the suffixes went
        # the blob cache holds them as links to their bases (a whole copy every
        # APPEND_CHAIN_MAX links), and the file reads back exact through them
        from memfuse.sidecar.blobcache import APPEND_CHAIN_MAX

        links = sc.fs.blobs._db.execute("SELECT count(*), sum(length(suffix)) FROM appends").fetchone()
        assert links[0] == 20 - 20 // (APPEND_CHAIN_MAX + 1) and links[1] < len(want) - len(BASE)
        n = sc.fs.lookup(sc.fs.stores["default"].root.ino, b"j.md")
        assert n is not None and n.buf is None and sc.fs.blobs.read(n.sha) == want
        assert sc.fs.blobs.read(n.sha, len(BASE) - 2, 9) == want[len(BASE) - 2:len(BASE) + 7]
        reads = []
        real_read, real_get = sc.fs.blobs.read, sc.fs.blobs.get
        sc.fs.blobs.read = lambda sha, off=0, size=-1: reads.append((off, size)) or real_read(sha, off, size)
        sc.fs.blobs.get = lambda sha: reads.append((0, -1)) or real_get(sha)  # whole, checked
        await append(sc, "j.md", b"one more\n")
        sc.fs.blobs.read, sc.fs.blobs.get = real_read, real_get
        want += b"one more\n"
        # the base is the content this sidecar held last, in memory (recent): no blob read,
        # neither at the open nor at the close's check
        assert reads == [] and sc.fs.recent.hits
        # not in memory (another process wrote it, or it was evicted): read once, at the
        # open, and kept for the close's check
        for sha in list(sc.fs.recent._items):
            sc.fs.recent.drop(sha)
        sc.fs.blobs.read = lambda sha, off=0, size=-1: reads.append((off, size)) or real_read(sha, off, size)
        sc.fs.blobs.get = lambda sha: reads.append((0, -1)) or real_get(sha)  # whole, checked
        await append(sc, "j.md", b"and one\n")
        sc.fs.blobs.read, sc.fs.blobs.get = real_read, real_get
        want += b"and one\n"
        assert reads == [(0, -1)]
        assert (await remote(fake))["j.md"] == want
        n = sc.fs.lookup(sc.fs.stores["default"].root.ino, b"j.md")
        assert n is not None and sc.fs.blobs.read(n.sha) == want
        calls.clear()
        # a small file is sent whole; a rewrite too
        calls.clear()
        await write(sc, "small.md", b"a\n")
        await append(sc, "small.md", b"b\n")
        await write(sc, "j.md", b"rewritten\n" * 300)
        assert [k for k, _ in calls] == ["update", "update"]
        # a backlog of appends coalesces into one append of every line
        calls.clear()
        await write(sc, "k.md", BASE)
        calls.clear()
        fake.faults.latency = 0.3
        n = None
        for i in range(10):
            n = await append(sc, "k.md", f"k{i}\n".encode(), wait=False)
        with trio.fail_after(30):
            await n.last_put.done.wait()
        fake.faults.latency = 0
        assert (await remote(fake))["k.md"] == BASE + b"".join(f"k{i}\n".encode() for i in range(10))
        assert all(k == "append" for k, _ in calls) and len(calls) < 10
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_an_append_meeting_a_rival_change_is_rebased(tmp_path):
    fake = FakeControlPlane(seed=22)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    calls = _spy(sc)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", BASE)
        fake.faults.precondition_race = 1  # the append meets another writer's change: 412
        n = await append(sc, "j.md", b"mine\n")
        want = BASE + RACE_MARKER.encode() + b"mine\n"
        assert (await remote(fake))["j.md"] == want
        assert sc.fs._content(n) == want and n.state == "clean"
        assert sc.committer.merges == 1 and sc.committer.conflicts == 0 and conflict_lines(sc) == []
        assert calls[0][0] == "append"
        # the next append goes from the merged content, as a suffix again
        calls.clear()
        await append(sc, "j.md", b"next\n")
        assert (await remote(fake))["j.md"] == want + b"next\n" and calls == [("append", 5)]
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_an_append_whose_answer_was_lost_is_applied_once(tmp_path):
    fake = FakeControlPlane(seed=23)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    real = sc.client.append_record
    lost: list[object] = []

    async def losing(*args, **kw):
        rec = await real(*args, **kw)
        if not lost:
            lost.append(rec)
            raise TransientError("answer lost", code="read_error")
        return rec

    sc.client.append_record = losing
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", BASE)
        await append(sc, "j.md", b"once\n")
        assert lost and (await remote(fake))["j.md"] == BASE + b"once\n"
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def _crash_after_applied_append(tmp_path, fake, token) -> None:
    """A sidecar whose append reaches the control plane, whose answer is lost, and which
    then stops (the control plane unreachable) with the entry still in its journal."""
    sc = await make_sidecar(tmp_path, fake, token)
    real = sc.client.append_record

    async def applied_then_cut(*args, **kw):
        await real(*args, **kw)
        fake.faults.outage = True
        raise TransientError("answer lost", code="read_error")

    sc.client.append_record = applied_then_cut
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", BASE)
        n = await append(sc, "j.md", b"once\n", wait=False)
        with trio.fail_after(20):
            while not fake.faults.outage:
                await trio.sleep(0.01)
        assert n.state == "pending" and sc.committer.depth() == 1
        nursery.cancel_scope.cancel()
    sc.journal.close()  # the entry stays, as at a crash
    await sc.client.aclose()
    fake.faults.reset()


async def _replay(tmp_path, fake, token, *, lose_base: bool) -> list[tuple[str, int]]:
    sc2 = await make_sidecar(tmp_path, fake, token)
    assert len(sc2.leftovers) == 1
    if lose_base:  # the blob cache no longer has the base: the entry goes whole
        sc2.committer.resolver.base_content = lambda sha: None
    calls = _spy(sc2)
    async with trio.open_nursery() as nursery:
        sc2._nursery = nursery
        sc2._spawn("journal", sc2.journal.run)
        await nursery.start(sc2.committer.run)
        sc2.committer.replay(sc2.leftovers)
        with trio.fail_after(30):
            await sc2.committer.wait_idle()
        assert (await remote(fake))["j.md"] == BASE + b"once\n"
        assert sc2.committer.conflicts == 0
        nursery.cancel_scope.cancel()
    sc2.journal.close()
    await sc2.client.aclose()
    return calls


async def test_a_replayed_append_after_a_crash_is_applied_once(tmp_path):
    fake = FakeControlPlane(seed=24)
    token = await fake.setup("ws")
    await _crash_after_applied_append(tmp_path, fake, token)
    calls = await _replay(tmp_path, fake, token, lose_base=False)
    assert calls == [("append", 5)]  # the same request again: answered by its key


async def test_a_replayed_append_without_its_base_is_applied_once(tmp_path):
    fake = FakeControlPlane(seed=25)
    token = await fake.setup("ws")
    await _crash_after_applied_append(tmp_path, fake, token)
    calls = await _replay(tmp_path, fake, token, lose_base=True)
    # whole, 412, the record already holds it; then one probe of the entry's own keys (its
    # "-append" key was used: the write was applied before, ConflictResolver.applied_before)
    assert calls == [("update", len(BASE) + 5), ("update", 0)]


async def test_a_file_appended_to_keeps_only_its_last_put_in_memory(tmp_path):
    """Each put of a file records what the file showed before it (``Entry.before``, to undo
    a write its close withdraws), the file's previous put among it. Once a put is on disk or
    committed it can no longer be withdrawn and lets that go (``Entry.settle``): kept, every
    put held the one before it, so every version of a journal appended to stayed in memory
    (1 MiB a line at 1 MiB, faulted in afresh; bench/README.md, "Appends, session 23")."""
    import gc

    from memfuse.sidecar.journal import Entry

    fake = FakeControlPlane(seed=23)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        n = await write(sc, "j.md", BASE)
        for i in range(12):
            await append(sc, "j.md", f"line {i}\n".encode())
            e = n.last_put
            assert e is not None and (e.durable.is_set() or e.done.is_set())
            assert e.before is None  # on disk or committed: never withdrawn, nothing kept for it
        await sc.committer.wait_idle()
        gc.collect()
        puts = [o for o in gc.get_objects() if isinstance(o, Entry) and o.node_key == n.key]
        assert puts == [n.last_put]
        assert n.last_put.done.is_set() and n.last_put.before is None
        # nor its content once finished (``Entry.finished_with``): the blob cache holds it
        assert n.last_put.content is None and n.last_put.sha == n.sha
        # the versions an append superseded are not kept as bases either (``recent``): the
        # file's last content only, which the next append starts from
        assert list(sc.fs.recent._items) == [n.sha]
        await append(sc, "j.md", b"one more\n")
        assert list(sc.fs.recent._items) == [n.sha] and sc.fs.recent.hits
        # no finished put of any file holds its content: a session does not keep the last
        # content of every file it wrote
        for i in range(5):
            await write(sc, f"other{i}.md", BASE + str(i).encode())
        await sc.committer.wait_idle()
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, Entry) and o.content is not None]
        nursery.cancel_scope.cancel()
