"""An in-place save (vim's: open ``O_WRONLY|O_CREAT``, ``ftruncate(0)``, write, fsync, close) on
mount A while mount B appends (attack17 F10), with two real sidecars on one store of a real
``memfuse serve`` (docs/SEMANTICS.md "Writes and close", "Conflicts").

The writer forks a child between its ``ftruncate(0)`` and its write (``sh -c 'echo … >> f'``,
any ``subprocess``): the child's exec closes its copy of the descriptor, a FUSE flush of the
open file. On main that flush committed the emptied file as a version while A still held it
open for writing; B's append was then merged onto the empty version (the file's lines gone)
and A's save replaced it: B's line lost, no line in either ``errors.log``. Now a flush after an
``ftruncate(0)`` with no write since commits nothing (as after an ``O_TRUNC`` open): the save
commits at its fsync, on the version it read, merged with B's append.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.mount

from mountcheck import errors_log
from mountutil import drained, live_records, two_sidecars, wait_until, written_and_seen


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("inplace"), "s") as cp_a_b:
        yield cp_a_b


def contents(cp, name: str) -> list[str]:
    """Every version's content of the record at ``name`` in store ``s``, oldest first."""
    rec = live_records(cp, "s")[name]
    return [cp.call("version", "s", rec.id, v.version).content
            for v in sorted(cp.call("versions", "s", rec.id), key=lambda v: v.version)]


def named(a, b, name: str) -> list[dict]:
    return [e for e in errors_log(a.mountpoint) + errors_log(b.mountpoint) if e.get("path") == name]


def inplace_save(p, text: str, between=None) -> None:
    """vim's in-place save of ``text`` to ``p``; ``between()`` runs after the ftruncate(0)."""
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, 0)
        if between is not None:
            between()
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def test_an_append_from_another_mount_during_an_inplace_save_is_kept(pair):
    cp, a, b = pair
    name = f"tw-{uuid.uuid4().hex[:6]}.md"
    pa, pb = written_and_seen(a, b, "s", name, "line one\nline two\n")
    old = pa.read_text()

    def append_on_b() -> None:  # forked by the writer while A's file is emptied and open
        subprocess.run(["sh", "-c", f"echo appended-on-b >> {pb}"], timeout=30, check=True)
        time.sleep(1.0)  # B's append committed and on its way to A meanwhile

    inplace_save(pa, old.replace("line two", "line two EDITED"), append_on_b)
    drained(a, b)
    vs = contents(cp, name)
    assert "" not in vs, vs  # the emptied file, mid-save, is never a version
    final = live_records(cp, "s")[name].content
    # both kept (merged), or the loss named in an errors.log
    if not named(a, b, name):
        assert final == "line one\nline two EDITED\nappended-on-b\n", vs
    wait_until(lambda: pb.read_text() == final and pa.read_text() == final, timeout=20,
               what="both mounts show the last version")


def test_inplace_saves_against_appends_from_another_mount_are_all_kept_or_named(pair):
    """A vim-like loop: 20 in-place saves on A, each editing another line and forking a child
    after its ftruncate(0), against 40 ``echo >>`` on B: every save's edit is in some version
    (or named in an errors.log), every appended line is in the last version, and no version
    lacks the file's own lines."""
    cp, a, b = pair
    name = f"loop-{uuid.uuid4().hex[:6]}.md"
    base = "".join(f"L{i:03d} text\n" for i in range(30))
    pa, pb = written_and_seen(a, b, "s", name, base)
    stop = threading.Event()
    appended: list[str] = []

    def appender() -> None:
        for k in range(40):
            if stop.is_set():
                break
            subprocess.run(["sh", "-c", f"echo B{k} >> {pb}"], timeout=30, check=True)
            appended.append(f"B{k}")
            time.sleep(0.05)

    t = threading.Thread(target=appender)
    t.start()
    try:
        for i in range(20):
            cur = pa.read_text()
            new = cur.replace(f"L{i:03d} text", f"L{i:03d} text a{i}")
            inplace_save(pa, new, lambda: subprocess.run(["true"], timeout=30))
    finally:
        t.join(timeout=120)
        stop.set()
    drained(a, b)
    vs = contents(cp, name)
    told = named(a, b, name)
    missing = [i for i in range(20) if not any(f"L{i:03d} text a{i}" in v for v in vs)]
    assert len(missing) <= len(told), (missing, told, vs[-1])  # a save in no version is named
    torn = [v for v in vs if sum(1 for ln in v.splitlines() if ln.startswith("L")) != 30]
    assert torn == [], torn[:3]  # no version without the file's own lines (an emptied save)
    if not told:
        final = live_records(cp, "s")[name].content
        assert [k for k in appended if f"{k}\n" not in final] == [], final
        assert all(f"L{i:03d} text a{i}\n" in final for i in range(20)), final


@pytest.mark.parametrize("other", ["reader", "writer"])
def test_another_descriptor_closed_mid_save_commits_no_emptied_file(pair, other):
    """Another descriptor of the file closed between an in-place save's ftruncate(0) and its
    write — a reader's, or a writer's that wrote before the save (under load the kernel's
    late release of the previous save's or of a reader's descriptor arrives there) — commits
    nothing: the emptied file is never a version another mount or the prompt could see
    (on main its release, or its flush, committed the emptied file: the flake of
    test_inplace_saves_against_appends_from_another_mount_are_all_kept_or_named)."""
    cp, a, b = pair
    name = f"cl-{other}-{uuid.uuid4().hex[:6]}.md"
    pa, pb = written_and_seen(a, b, "s", name, "line one\nline two\n")
    if other == "reader":
        held = os.open(pa, os.O_RDONLY)
        assert os.read(held, 100) == b"line one\nline two\n"
    else:
        held = os.open(pa, os.O_WRONLY | os.O_APPEND)
        os.write(held, b"line three\n")  # the save below replaces it (it read no version with it)
    closed = False
    try:
        inplace_save(pa, "line one EDITED\n", lambda: os.close(held))
        closed = True
    finally:
        if not closed:
            os.close(held)
    drained(a, b)
    vs = contents(cp, name)
    assert "" not in vs, vs
    assert vs[-1] == "line one EDITED\n", vs
    wait_until(lambda: pb.read_text() == "line one EDITED\n", timeout=20, what="B shows the save")


def test_a_shell_rewrite_while_a_reader_holds_the_file_is_one_version_and_an_emptied_one_is_kept(pair):
    """``sh``: ``> f`` (an ``O_TRUNC`` open) while another descriptor of the file is open,
    closed before the write: one new version, the written one, no empty one; a file really
    closed empty (``: > f``, an ``O_TRUNC`` open closed with nothing written) is committed
    empty, with a reader open or not."""
    cp, a, b = pair
    name = f"sh-{uuid.uuid4().hex[:6]}.md"
    pa, pb = written_and_seen(a, b, "s", name, "old text\n")
    subprocess.run(["sh", "-c", 'exec 3< "$1"; { exec 3<&-; echo new text; } > "$1"', "sh", str(pa)],
                   timeout=30, check=True)
    drained(a, b)
    assert contents(cp, name) == ["old text\n", "new text\n"]
    subprocess.run(["sh", "-c", 'exec 3< "$1"; : > "$1"; exec 3<&-', "sh", str(pa)],
                   timeout=30, check=True)
    drained(a, b)
    assert contents(cp, name) == ["old text\n", "new text\n", ""]
    wait_until(lambda: pb.read_text() == "", timeout=20, what="B shows the file closed empty")


def test_a_save_in_several_writes_is_one_version_when_other_descriptors_close_between(pair):
    """A save made of several writes (ftruncate(0), write, write, fsync, close) while other
    descriptors of the file close between its writes (a reader's, an earlier save's, whose
    release the kernel sends late): one new version, the whole save; on main the release
    committed the save's first write alone (a version with half the file)."""
    cp, a, b = pair
    name = f"mw-{uuid.uuid4().hex[:6]}.md"
    pa, pb = written_and_seen(a, b, "s", name, "first\nsecond\n")
    readers = [os.open(pa, os.O_RDONLY) for _ in range(2)]
    fd = os.open(pa, os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, 0)
        os.close(readers.pop())  # before the first write
        os.write(fd, b"first EDITED\n")
        os.close(readers.pop())  # between the writes
        os.write(fd, b"second EDITED\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        for r in readers:
            os.close(r)
    drained(a, b)
    assert contents(cp, name) == ["first\nsecond\n", "first EDITED\nsecond EDITED\n"]
    wait_until(lambda: pb.read_text() == "first EDITED\nsecond EDITED\n", timeout=20,
               what="B shows the save")
