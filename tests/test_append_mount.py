"""Appends on a real mount (docs/SEMANTICS.md "Append versions"): ``echo >>`` many times to a
file is sent as appends (the control plane's idempotency store holds ``.../append``
requests) and stored as what it adds; every version reads back exact through the CLI
(``memfuse show --version``, ``diff`` of two versions, ``restore``, ``export``); two sidecars
appending to one journal keep every line; an append against a rival rewrite lands on it."""
from __future__ import annotations

import json
import os
import sqlite3
import uuid

import pytest

from mountutil import drained, sidecar_status, MEMFUSE, ControlPlane, Rig, read, serve_and_mount, sh, two_sidecars, wait_until

pytestmark = pytest.mark.mount

BASE = "# journal\n" + "x" * 8000 + "\n"




def _db(cp: ControlPlane) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{cp.db}?mode=ro", uri=True, timeout=30)


def _cli(cp: ControlPlane, *args: str, cwd) -> str:
    cmd = " ".join([MEMFUSE, *args, "--control-plane", cp.url, "--token-file", str(cp.token_file)])
    return sh(cmd, cwd, timeout=60).stdout


def test_echo_appends_are_sent_and_stored_as_suffixes(tmp_path):
    with serve_and_mount(tmp_path) as (cp, sc):
        f = sc.mountpoint / "default" / "JOURNAL.md"
        f.write_text(BASE)
        n = 60
        sh(f'for i in $(seq {n}); do echo "line $i" >> {f}; done', f.parent, timeout=120)
        want = BASE + "".join(f"line {i}\n" for i in range(1, n + 1))
        assert read(f) == want
        drained(sc)
        rec = cp.call("find_record", "default", "JOURNAL.md")
        assert cp.call("get_record", "default", rec.id).content == want
        with _db(cp) as db:
            appends = db.execute("SELECT COUNT(*) FROM idempotency_keys WHERE url_path LIKE ?",
                                 (f"%/records/{rec.id}/append",)).fetchone()[0]
            rows = db.execute("SELECT version, base_version, length(CAST(content AS BLOB)) FROM versions"
                              " WHERE record_id = ? ORDER BY version", (rec.id,)).fetchall()
        assert appends >= 1 and appends == len(rows) - 1  # every close after the first went as a suffix
        whole = [v for v, base, _ in rows if base is None]
        stored = sum(size or 0 for _, _, size in rows)
        appended = len(want) - len(BASE)
        assert stored <= 2 * appended + len(want.encode()) * len(whole), (stored, rows)
        assert stored < len(BASE) * n / 10  # whole versions would hold n copies of the base
        # every version reads back exact: show, diff of two versions, restore, export
        versions = cp.call("versions", "default", rec.id)
        last, mid = versions[-1].version, versions[len(versions) // 2].version
        assert _cli(cp, "show", "default", "JOURNAL.md", "--version", str(last), cwd=tmp_path) == want
        mid_text = cp.call("version", "default", rec.id, mid).content
        assert mid_text.startswith(BASE) and want.startswith(mid_text)
        (tmp_path / "mid.md").write_text(_cli(cp, "show", "default", "JOURNAL.md", "--version", str(mid),
                                              cwd=tmp_path))
        (tmp_path / "last.md").write_text(_cli(cp, "show", "default", "JOURNAL.md", cwd=tmp_path))
        d = sh("diff mid.md last.md", tmp_path, check=False)
        assert d.returncode == 1
        added = [x[2:] for x in d.stdout.splitlines() if x.startswith("> ")]
        assert "\n".join(added) + "\n" == want[len(mid_text):]
        _cli(cp, "restore", "default", "JOURNAL.md", "--version", str(mid), cwd=tmp_path)
        wait_until(lambda: read(f) == mid_text, timeout=30, what="the restored version on the mount")
        sh(f"echo after-restore >> {f}", f.parent, timeout=30)
        drained(sc)
        _cli(cp, "export", "default", str(tmp_path / "out"), cwd=tmp_path)
        assert (tmp_path / "out" / "JOURNAL.md").read_text() == mid_text + "after-restore\n"


@pytest.mark.parametrize("blobs", ["kept", "lost"])
def test_appends_journaled_as_suffixes_survive_kill9(tmp_path, blobs):
    """With the control plane frozen, each ``echo >>`` close is accepted with an outbox row
    holding only the line it adds; the sidecar is killed (-9) and, ``lost``, its blob cache
    deleted (what a machine crash may do to its last writes); the control plane resumes
    (the first append, in flight, applies; its answer is lost). The restarted sidecar
    rebuilds the queued appends (from the blob cache, or from the control plane's version)
    and the control plane and the file hold every line once."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", "--commit-wait", "0.5")
        mnt, cache = sc.mountpoint, sc.cache_dir
        f = mnt / "default" / "JOURNAL.md"
        f.write_text(BASE)
        drained(sc)
        cp.freeze()
        sh(f'for i in $(seq 5); do echo "line $i" >> {f}; done', f.parent, timeout=120)
        want = BASE + "".join(f"line {i}\n" for i in range(1, 6))
        assert read(f) == want
        db = sqlite3.connect(f"file:{cache / 'outbox.db'}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute("SELECT length(content), args FROM entries ORDER BY id").fetchall()
        finally:
            db.close()
        assert len(rows) == 5 and all(n < 100 and "~append" in a for n, a in rows), rows
        sc.kill9()
        if blobs == "lost":
            for p in cache.glob("blobs.db*"):
                p.unlink()
        cp.thaw()
        sc.start()  # same cache directory and options
        drained(sc)
        rec = cp.call("find_record", "default", "JOURNAL.md")
        assert cp.call("get_record", "default", rec.id).content == want
        wait_until(lambda: read(f) == want, timeout=30, what="the file shows every line once")


def test_a_replayed_append_answered_as_of_an_older_version_shows_the_newest(tmp_path):
    """The state a ``kill -9`` during an append loop may leave (a committed entry's journal
    delete is lazy): the journal holds an append the control plane already has (here: the
    control plane is frozen while ``echo >>`` is accepted, the sidecar killed, the control
    plane killed too so the frozen request is never applied, then the append applied with
    the journal's idempotency key, as the lost answer would have had it), and a newer
    version by the same workspace follows it. The restarted sidecar catches the newer
    version up, replays the leftover, and the control plane answers it by its key with the
    record as of that older version: the file must still show the newest version, clean
    (it stayed stale until the next write before), and so must the store's mirror on the
    next start."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", "--commit-wait", "0.5")
        mnt, cache = sc.mountpoint, sc.cache_dir
        ws_token = sc.token_file.read_text().strip()
        f = mnt / "default" / "JOURNAL.md"
        f.write_text(BASE)
        drained(sc)
        rec = cp.call("find_record", "default", "JOURNAL.md")
        cp.freeze()
        sh(f'echo "line 1" >> {f}', f.parent, timeout=60)  # accepted: its journal row is written
        sc.kill9()
        cp.kill()  # the frozen request dies with it, never applied
        cp.start()
        db = sqlite3.connect(f"file:{cache / 'outbox.db'}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute("SELECT key, args FROM entries ORDER BY id").fetchall()
        finally:
            db.close()
        assert len(rows) == 1, rows
        key, args = rows[0][0], json.loads(rows[0][1])
        # the control plane has the leftover's commit (its answer was lost) ...
        v2 = cp.call("append_record", "default", rec.id, "line 1\n", if_match=rec.sha256,
                     type=args.get("type"), idempotency_key=key + "-append",
                     mode=args.get("mode"), mtime_ns=args.get("mtime_ns"), token=ws_token)
        # ... and a newer version by the same workspace after it (another of its sidecars)
        v3 = cp.call("append_record", "default", rec.id, "line 2\n", if_match=v2.sha256,
                     idempotency_key=uuid.uuid4().hex, token=ws_token)
        want = BASE + "line 1\nline 2\n"
        assert v3.version > v2.version and cp.call("get_record", "default", rec.id).content == want

        sc.start()  # same cache directory and options
        drained(sc)
        assert len(cp.call("versions", "default", rec.id)) == 3  # the replay added none
        wait_until(lambda: read(f) == want, timeout=30, what="the file shows the newest version")
        assert os.getxattr(f, "user.memfuse.version").decode() == str(v3.version)
        assert os.getxattr(f, "user.memfuse.state").decode() == "clean"
        sc.stop()

        sc.start()  # the mirror's state
        assert read(f) == want
        assert os.getxattr(f, "user.memfuse.version").decode() == str(v3.version)
        sh(f'echo "line 3" >> {f}', f.parent, timeout=60)  # the next write lands on the newest, once
        drained(sc)
        want += "line 3\n"
        assert cp.call("get_record", "default", rec.id).content == want
        assert read(f) == want


def test_a_replayed_leftover_older_than_the_mirror_never_shows(tmp_path):
    """The state of the test above, read before the replay's answer: the restarted sidecar
    mounts from its cache (the control plane is frozen, so the replay cannot be answered)
    with a mirror that holds the newest version (v3, which extends the leftover's content:
    the leftover committed as v2, then an append followed). From the first read, the file
    shows v3, not the leftover's older content; once the control plane answers, the replay
    adds no version and the file stays at v3."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", "--commit-wait", "0.5")
        mnt, cache = sc.mountpoint, sc.cache_dir
        ws_token = sc.token_file.read_text().strip()
        f = mnt / "default" / "JOURNAL.md"
        f.write_text(BASE)
        drained(sc)
        rec = cp.call("find_record", "default", "JOURNAL.md")
        cp.freeze()
        sh(f'echo "line 1" >> {f}', f.parent, timeout=60)  # accepted: its journal row is written
        sc.kill9()
        cp.kill()  # the frozen request dies with it, never applied
        cp.start()
        journal = {p.name: p.read_bytes() for p in cache.glob("outbox.db*")}  # the leftover
        db = sqlite3.connect(f"file:{cache / 'outbox.db'}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute("SELECT key, args FROM entries ORDER BY id").fetchall()
        finally:
            db.close()
        assert len(rows) == 1, rows
        key, args = rows[0][0], json.loads(rows[0][1])
        v2 = cp.call("append_record", "default", rec.id, "line 1\n", if_match=rec.sha256,
                     type=args.get("type"), idempotency_key=key + "-append",
                     mode=args.get("mode"), mtime_ns=args.get("mtime_ns"), token=ws_token)
        v3 = cp.call("append_record", "default", rec.id, "line 2\n", if_match=v2.sha256,
                     idempotency_key=uuid.uuid4().hex, token=ws_token)
        want = BASE + "line 1\nline 2\n"
        # one run catches the mirror up to v3 (and replays the leftover); stopped, the cache
        # keeps that mirror; the journal is put back as the kill -9 left it
        sc.start()  # same cache directory and options
        drained(sc)
        wait_until(lambda: read(f) == want, timeout=30, what="the newest version")
        sc.stop()
        for p in cache.glob("outbox.db*"):
            p.unlink()
        for name, data in journal.items():
            (cache / name).write_bytes(data)
        cp.freeze()
        sc.restart(("--commit-wait", "0.5", "--offline-after", "1"))
        assert sidecar_status(sc)["outbox"]["depth"] == 1  # the leftover, replayed, not answered
        assert read(f) == want  # the first read: the newest, not the leftover's content
        assert os.getxattr(f, "user.memfuse.version").decode() == str(v3.version)
        cp.thaw()
        drained(sc)
        assert read(f) == want
        assert os.getxattr(f, "user.memfuse.state").decode() == "clean"
        assert len(cp.call("versions", "default", rec.id)) == 3  # the replay added none
        sh(f'echo "line 3" >> {f}', f.parent, timeout=60)
        drained(sc)
        assert cp.call("get_record", "default", rec.id).content == want + "line 3\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("pair")) as cp_a_b:
        yield cp_a_b


def test_two_sidecars_appending_to_one_journal_keep_every_line(pair):
    cp, a, b = pair
    name = "j-" + uuid.uuid4().hex[:6] + ".md"
    pa, pb = a.mountpoint / "shared" / name, b.mountpoint / "shared" / name
    pa.write_text(BASE)
    wait_until(lambda: read(pb) == BASE, what="journal visible in B")
    n = 25
    sh(f'(for i in $(seq {n}); do echo "A $i" >> {pa}; done) & '
       f'(for i in $(seq {n}); do echo "B $i" >> {pb}; done) & wait', pa.parent, timeout=180)
    drained(a, b)
    rec = cp.call("find_record", "shared", name)
    final = cp.call("get_record", "shared", rec.id).content
    assert final.startswith(BASE)
    lines = final[len(BASE):].splitlines()
    assert [x for x in lines if x.startswith("A ")] == [f"A {i}" for i in range(1, n + 1)], final
    assert [x for x in lines if x.startswith("B ")] == [f"B {i}" for i in range(1, n + 1)], final
    assert len(lines) == 2 * n
    wait_until(lambda: read(pa) == final and read(pb) == final, timeout=30,
               what="both sidecars show the journal")
    # every version of the record reads back whole and each extends the one before
    prev = None
    for v in cp.call("versions", "shared", rec.id):
        text = cp.call("version", "shared", rec.id, v.version).content
        assert text is not None and (prev is None or text.startswith(prev))
        prev = text
    assert prev == final


def test_an_append_against_a_rival_rewrite_lands_on_the_rewrite(pair):
    """Another writer (an API client) rewrites the journal while this mount appends: the
    appended line lands on the rewrite (rebased when the append met it), nothing is lost."""
    cp, a, b = pair
    name = "r-" + uuid.uuid4().hex[:6] + ".md"
    pa = a.mountpoint / "shared" / name
    pa.write_text(BASE)
    drained(a)
    rec = cp.call("find_record", "shared", name)
    for i in range(5):
        rival = f"# rewritten {i}\n" + "y" * 5000 + "\n"
        cp.call("update_record", "shared", rec.id, rival)
        sh(f'echo "mine {i}" >> {pa}', pa.parent, timeout=30)
        drained(a)
        final = cp.call("get_record", "shared", rec.id).content
        assert final == rival + f"mine {i}\n", (i, final[:80])
        wait_until(lambda: read(pa) == final, timeout=30, what="the mount shows the merged journal")
    assert os.path.exists(pa)


def _flip_on_disk(cache, needle: bytes, to: bytes) -> int:
    """Overwrite every ``needle`` in the blob cache's files with ``to`` (same length), as
    ``dd`` would (SQLite keeps no page checksum: it reads the changed bytes back)."""
    flips = 0
    for p in cache.glob("blobs.db*"):
        raw = p.read_bytes()
        i = raw.find(needle)
        with open(p, "r+b") as fh:
            while i >= 0:
                fh.seek(i)
                fh.write(to)
                flips += 1
                i = raw.find(needle, i + 1)
    return flips


def test_bytes_damaged_in_the_blob_cache_while_stopped_are_never_served(tmp_path):
    """Attack finding 5 (``atk_t2.sh rawflip``): a 2 KB file appended to line by line, the
    sidecar stopped, ``line-5`` turned into ``LINE-5`` by raw byte writes on ``blobs.db``
    (inside the append link's suffix, and in any whole copy). After each restart (twice:
    the first one's catch-up may bring the newest content whole) the file reads exact (the
    damaged entry is dropped with a warning and the content fetched again from the control
    plane), and the next append and a ``sed -i`` commit exact content. The blob cache
    holds a link per append and one whole copy, not both."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws")
        mnt, cache = sc.mountpoint, sc.cache_dir
        f = mnt / "default" / "C.md"
        f.write_text("H" * 2000 + "\n")
        sh(f"for i in $(seq 1 10); do echo line-$i-zzzzzzzzzzzzzzzz >> {f}; done", f.parent, timeout=60)
        want = "H" * 2000 + "\n" + "".join(f"line-{i}-zzzzzzzzzzzzzzzz\n" for i in range(1, 11))
        assert read(f) == want
        drained(sc)
        db = sqlite3.connect(f"file:{cache / 'blobs.db'}?mode=ro", uri=True)
        try:
            stored = (db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0],
                      db.execute("SELECT COUNT(*) FROM appends").fetchone()[0])
        finally:
            db.close()
        assert stored == (1, 10)  # the 2 KB base whole, a link per append
        for _ in range(2):
            sc.stop()
            assert _flip_on_disk(cache, b"line-5-zz", b"LINE-5-zz") >= 1
            sc.start()
            assert read(f) == want  # exact: never LINE-5
        log = sc.log.read_text()
        assert "damaged; dropped" in log and "fetched again from the control plane" in log
        assert "zzzz" not in "".join(x for x in log.splitlines() if "damaged" in x)  # no content
        sh(f"echo line-11-zzzzzzzzzzzzzzzz >> {f}", f.parent, timeout=30)
        sh(f"sed -i s/line-11/line-11b/ {f}", f.parent, timeout=30)
        want += "line-11b-zzzzzzzzzzzzzzzz\n"
        drained(sc)
        rec = cp.call("find_record", "default", "C.md")
        assert cp.call("get_record", "default", rec.id).content == want
        assert read(f) == want
