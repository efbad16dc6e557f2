"""Two mounts create the same new path at the same moment (attack 17 F9; docs/SEMANTICS.md
"Names"): ``open(p, "w")`` / dash's ``echo > p`` (``O_CREAT | O_TRUNC``, no ``O_EXCL``) never
fails ``EEXIST``. The kernel looks the name up absent, then the other mount's create is
applied here before the kernel's CREATE comes: the create opens that file (truncating it),
and the write is last writer wins over a path created elsewhere, with a ``conflict`` line,
the other version kept in history. ``O_EXCL`` and ``mknod`` still get ``EEXIST``; a
directory made there meanwhile gives ``EISDIR``, as on a local disk.

Three layers: the filesystem core with the fake control plane (the window forced by
applying the remote create before ``Filesystem.create``); two real sidecars, one of which
holds its kernel invalidations back so that its kernel keeps the negative entry while its
sidecar applies the other's create (deterministic); and a barrier-released race of many
pairs of real tools on two real mounts.
"""
from __future__ import annotations

import errno
import os
import random
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from coreutil import core_and_other

from memfuse.sidecar.core import FsError
from memfuse.sidecar.inodes import ABSENT_BASE


async def test_a_create_of_a_name_applied_from_elsewhere_meanwhile_opens_it(tmp_path: Path):
    """``Filesystem.create`` of a name the feed made meanwhile: without ``O_EXCL`` it opens
    the file (``O_TRUNC``: emptied; the overwrite is based on no version, so it is last
    writer wins with a conflict, the other version in history); ``O_APPEND`` without
    ``O_TRUNC`` appends to it (no conflict); ``O_EXCL`` is ``EEXIST``; a directory is
    ``EISDIR``."""
    async with core_and_other(tmp_path) as core:
        fs, sm, other, feed = core.fs, core.sm, core.other, core.feed
        root = sm.root
        rec = await other.create_record("default", "f.md", "theirs\n")
        await other.create_record("default", "g.md", "theirs\n")
        await other.create_record("default", "d/inner.md", "x\n")
        await feed()  # applied here after the kernel looked the names up absent
        n = root.children["f.md"]
        lookups = n.nlookup

        with pytest.raises(FsError) as ei:
            fs.create(root.ino, b"f.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0, 0)
        assert ei.value.errno == errno.EEXIST
        with pytest.raises(FsError) as ei:
            fs.create(root.ino, b"d", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
        assert ei.value.errno == errno.EISDIR

        h = fs.create(root.ino, b"f.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
        assert h.node is n and n.nlookup == lookups + 1 and n.cur_size() == 0
        assert n.read_base == ABSENT_BASE
        fs.write(h, 0, b"mine\n")
        await fs.flush(h)
        fs.release(h.fh)

        g = root.children["g.md"]
        h = fs.create(root.ino, b"g.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0, 0)
        assert h.node is g and g.read_base == ""
        fs.write(h, 0, b"appended\n")
        await fs.flush(h)
        fs.release(h.fh)
        await fs.committer.wait_idle()

        cur = await other.get_record("default", rec.id)
        assert cur.content == "mine\n"  # last writer wins
        assert [v.version for v in await other.versions("default", rec.id)] == [1, 2]
        assert (await other.version("default", rec.id, 1)).content == "theirs\n"  # in history
        assert fs.committer.conflicts == 1  # f.md's; g.md's append is no conflict
        [line] = [e for e in fs.errors if e.get("path") == "f.md"]
        assert line.get("conflict") and "created elsewhere" in line["reason"], line
        recs, _ = await other.snapshot("default", content=True)
        assert {r.path: r.content for r in recs}["g.md"] == "theirs\nappended\n"
        fs.check_invariants()


# ---------------------------------------------------------------------------- real mounts
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two real sidecars on store ``s`` of one real ``memfuse serve``: A an ordinary one, B one
    whose kernel invalidations are held back while ``B.hold_file`` exists
    (tests/held_mount.py)."""
    from mountutil import Rig
    from test_overwrite_base import HeldSidecar

    tmp = tmp_path_factory.mktemp("cr")
    with Rig(tmp) as rig:
        rig.workspace("wa", ("s",))
        tb = rig.workspace("wb", ("s",))
        a = rig.sidecar("wa", mountpoint=tmp / "ma", cache_dir=tmp / "ca")
        b = HeldSidecar(rig.cp, "wb", tb, tmp / "mb", tmp / "cb", hold_file=tmp / "hold")
        rig.logs.append(b.log)
        rig.defer(b.stop)
        rig.defer(b.hold_file.unlink, True)  # first at teardown: B's drain is never held
        b.start(expect="s")
        yield rig.cp, a, b


def _dir_on_both(a, b) -> tuple[str, Path, Path]:
    from mountutil import sidecar_status, wait_until

    d = f"cr-{uuid.uuid4().hex[:6]}"
    os.mkdir(a.mountpoint / "s" / d)
    (a.mountpoint / "s" / d / "seed.md").write_text("seed\n")  # a directory is its records
    pb = b.mountpoint / "s" / d
    wait_until(lambda: pb.is_dir(), timeout=20, what="B shows A's directory")
    wait_until(lambda: sidecar_status(b)["invalidations"]["pending"] == 0, timeout=15,
               what="B's kernel told every change so far")
    return d, a.mountpoint / "s" / d, pb


def _history(cp, path: str) -> tuple[str, list[str]]:
    """(the live content, every version's content) of the record at ``path`` of store s."""
    from mountutil import live_records

    rec = live_records(cp, "s")[path]
    return rec.content, [cp.call("version", "s", rec.id, v.version).content
                         for v in cp.call("versions", "s", rec.id)]


@pytest.mark.mount
def test_a_create_whose_name_another_mount_made_meanwhile_opens_the_file(pair):
    """Deterministic: B's kernel looked the names up absent (negative entries), then A made
    them and B's sidecar applied that, but B's kernel was not told (invalidations held): B's
    ``open(p, "w")`` and dash's ``echo > p`` are CREATEs of names that exist. They open the
    file and replace it (last writer wins, a ``conflict`` line on B, A told it was
    overwritten, A's version in history); ``>>`` appends to A's content; ``O_EXCL`` is
    ``EEXIST``; a directory A made there is ``EISDIR``. On main every one was ``EEXIST``."""
    from mountcheck import errors_log
    from mountutil import drained, wait_until

    cp, a, b = pair
    d, pa, pb = _dir_on_both(a, b)
    files = ("py.md", "dash.md", "excl.md", "append.md")
    b.hold_file.write_text("")
    try:
        for nm in (*files, "dir.md"):
            assert not os.path.exists(pb / nm)  # B's kernel caches the absence
        for nm in files:
            (pa / nm).write_text(f"from A {nm}\n")
        os.mkdir(pa / "dir.md")
        (pa / "dir.md" / "inner.md").write_text("inner\n")
        mark = f"mark-{uuid.uuid4().hex[:6]}.md"
        (a.mountpoint / "s" / mark).write_text("m\n")  # after the others in the feed
        # (a listing of the store's root: one of B's directory would replace the entries)
        wait_until(lambda: mark in os.listdir(b.mountpoint / "s"), timeout=20,
                   what="B's sidecar applied A's creates")
        with open(pb / "py.md", "w") as f:
            f.write("from B py\n")
        r = subprocess.run(["sh", "-c", "echo from B dash > dash.md"], cwd=pb, timeout=30,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        with pytest.raises(FileExistsError):
            os.close(os.open(pb / "excl.md", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        with open(pb / "append.md", "a") as f:
            f.write("from B append\n")
        with pytest.raises(IsADirectoryError):
            open(pb / "dir.md", "w")
    finally:
        b.hold_file.unlink()
    drained(a, b)
    for nm, live in [("py.md", "from B py\n"), ("dash.md", "from B dash\n"),
                     ("excl.md", f"from A excl.md\n"),
                     ("append.md", "from A append.md\nfrom B append\n")]:
        cur, versions = _history(cp, f"{d}/{nm}")
        assert cur == live, (nm, cur)
        assert versions[0] == f"from A {nm}\n", (nm, versions)
    errs_b = [e for e in errors_log(b.mountpoint) if e["path"].startswith(d + "/")]
    assert sorted(e["path"] for e in errs_b) == [f"{d}/dash.md", f"{d}/py.md"], errs_b
    assert all(e.get("conflict") and "created elsewhere" in e["reason"] for e in errs_b), errs_b

    def told_a() -> list[str]:
        return sorted(e["path"] for e in errors_log(a.mountpoint)
                      if e.get("overwritten") and e["path"].startswith(d + "/"))
    wait_until(lambda: told_a() == [f"{d}/dash.md", f"{d}/py.md"], timeout=20,
               what="A told its two creates were overwritten")
    assert read_text(pa / "py.md") == "from B py\n"


def read_text(p: Path) -> str:
    with open(p) as f:
        return f.read()


@pytest.mark.mount
def test_two_mounts_creating_the_same_names_at_once_never_get_eexist(pair):
    """The race as tools meet it (attack 17 F9: 2-5 of 60 opens failed ``EEXIST``): A and
    B check that a name is missing, then create it at about the same moment (each pair
    released by a barrier, each writer then waiting 0-20 ms, so that one's create often
    meets the other's arriving; Python's ``open(p, "w")`` and dash's ``echo > p`` in turn).
    No open fails, and no write is lost: each writer's content is a version of the record
    (the live one, or one in its history). On main 4-7 of the 60 pairs failed ``EEXIST``
    (3 runs)."""
    from mountutil import drained

    cp, a, b = pair
    d, pa, pb = _dir_on_both(a, b)
    n = 60
    bar = threading.Barrier(2, timeout=60)
    errs: list[tuple] = []

    def writer(root: Path, tag: str) -> None:
        try:
            rng = random.Random(tag)
            for i in range(n):
                p = root / f"f{i}.md"
                assert not p.exists()  # an agent's "create it when missing"
                bar.wait()
                time.sleep(rng.uniform(0, 0.02))  # spread over a remote create's arrival
                if i % 2:
                    r = subprocess.run(["sh", "-c", f"echo from-{tag}-{i} > {p.name}"], cwd=root,
                                       capture_output=True, text=True, timeout=30)
                    if r.returncode:
                        errs.append(("sh", tag, i, r.stderr.strip()))
                else:
                    try:
                        with open(p, "w") as f:
                            f.write(f"from-{tag}-{i}\n")
                    except OSError as e:
                        errs.append(("py", tag, i, repr(e)))
        except threading.BrokenBarrierError as e:
            errs.append(("barrier", tag, -1, repr(e)))
        except BaseException as e:  # noqa: BLE001 - reported below, never lost in a thread
            errs.append(("error", tag, -1, repr(e)))
            bar.abort()

    ts = [threading.Thread(target=writer, args=(pa, "a")),
          threading.Thread(target=writer, args=(pb, "b"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts)
    assert not errs, errs
    drained(a, b)
    lost = []
    for i in range(n):
        cur, versions = _history(cp, f"{d}/f{i}.md")
        assert cur in (f"from-a-{i}\n", f"from-b-{i}\n"), (i, cur)
        lost += [(i, tag) for tag in "ab" if f"from-{tag}-{i}\n" not in versions]
    assert not lost, lost
