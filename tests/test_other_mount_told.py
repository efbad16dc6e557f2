"""What the other mount sees and is told after a change made elsewhere (docs/SEMANTICS.md,
"Layout" and "Conflicts"), with two real sidecars on one store of a real ``memfuse serve``:

- a directory moved on mount A (a prefix move of its records) leaves no empty shell of the
  source on mount B, as a local disk shows no source after ``mv``; a directory B made itself
  (``mkdir``) stays when the records under it go elsewhere;
- a write of mount A that overwrote mount B's own write by last writer wins (overlapping
  edits) is told to B: a ``conflict`` line in B's ``errors.log`` naming the path, the version
  lost and where it is kept (``memfuse history`` / ``memfuse restore``), and only to B (a mount
  whose write was not overwritten is told nothing).
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.mount

from mountcheck import errors_log
from mountutil import (drained, live_records, read, replace_like_sed, sh, two_sidecars, wait_applied, wait_until,
                       written_and_seen)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("told"), "s") as cp_a_b:
        yield cp_a_b


def _tree(p: Path) -> list[str]:
    return sorted(sh("find . -mindepth 1", p, timeout=20).stdout.split())


def test_a_directory_moved_elsewhere_leaves_no_empty_shell_here(pair):
    cp, a, b = pair
    top = f"mv-{uuid.uuid4().hex[:6]}"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"mkdir -p {top}/d1/sub/deep && echo x > {top}/d1/x.md && echo y > {top}/d1/sub/y.md"
       f" && echo z > {top}/d1/sub/deep/z.md", pa)
    before = [f"./{top}", f"./{top}/d1", f"./{top}/d1/sub", f"./{top}/d1/sub/deep",
              f"./{top}/d1/sub/deep/z.md", f"./{top}/d1/sub/y.md", f"./{top}/d1/x.md"]
    wait_until(lambda: _tree(pb) == before, timeout=20, what="B shows d1")
    sh(f"mv {top}/d1 {top}/d2", pa)
    after = [p.replace("/d1", "/d2") for p in before]
    assert _tree(pa) == sorted(after)
    wait_until(lambda: read(pb / top / "d2" / "sub" / "deep" / "z.md") == "z\n", timeout=20,
               what="B shows the moved files")
    # the records moved one by one: B may show d1's last ones for a moment, never for good
    wait_until(lambda: _tree(pb) == sorted(after), timeout=20, what="B shows no d1")
    assert not os.path.exists(pb / top / "d1")
    r = sh(f"ls {top}/d1", pb, check=False, timeout=10)  # the kernel's entry is gone too
    assert r.returncode != 0 and "No such file" in r.stderr


def test_a_directory_made_here_stays_when_the_records_under_it_go(pair):
    cp, a, b = pair
    top = f"keep-{uuid.uuid4().hex[:6]}"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"mkdir -p {top}/mine", pb)  # B's own directories
    wait_until(lambda: os.path.isdir(pb / top / "mine"), timeout=10, what="B's mkdir")
    sh(f"mkdir -p {top}/mine/sub && echo a > {top}/mine/a.md && echo b > {top}/mine/sub/b.md", pa)
    wait_until(lambda: read(pb / top / "mine" / "sub" / "b.md") == "b\n", timeout=20,
               what="B shows A's files")
    sh(f"mv {top}/mine {top}/moved", pa)
    wait_until(lambda: read(pb / top / "moved" / "sub" / "b.md") == "b\n", timeout=20,
               what="B shows the move")
    # B's own directory stays (empty: a local disk's mkdir), A's implied one goes
    wait_until(lambda: not os.path.exists(pb / top / "mine" / "sub"), timeout=20,
               what="A's implied subdirectory gone from B")
    assert os.path.isdir(pb / top / "mine") and os.listdir(pb / top / "mine") == []


def test_a_remote_delete_of_the_last_file_removes_the_implied_directory(pair):
    cp, a, b = pair
    top = f"rm-{uuid.uuid4().hex[:6]}"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"mkdir -p {top}/d && echo x > {top}/d/x.md", pa)
    wait_until(lambda: read(pb / top / "d" / "x.md") == "x\n", timeout=20, what="B shows x")
    sh(f"rm {top}/d/x.md", pa)
    assert os.path.isdir(pa / top / "d")  # the mount that removed it: a local disk's rule
    wait_until(lambda: not os.path.exists(pb / top), timeout=20, what="B shows no empty shell")


def _lww(cp, a, b, name: str) -> str:
    """A and B both edit line 1 of version 1: A commits first, then B's edit made on version
    1 overwrites A's by last writer wins. Returns the content A wrote (now in history)."""
    _, pb = written_and_seen(a, b, "s", name, "alpha\nbeta\n")
    mine = pb.read_text()  # B's tool reads version 1
    sh(f"sed -i s/alpha/FROM-A/ {name}", a.mountpoint / "s")
    wait_until(lambda: live_records(cp, "s")[name].content == "FROM-A\nbeta\n", timeout=20,
               what="A's edit committed")
    wait_applied(pb, live_records(cp, "s")[name].sha256, what="B applied A's edit")
    replace_like_sed(pb, mine.replace("alpha", "FROM-B"))  # B's edit made on version 1
    wait_until(lambda: live_records(cp, "s")[name].content == "FROM-B\nbeta\n", timeout=30,
               what="B's write is the last")
    return "FROM-A\nbeta\n"


def test_the_mount_whose_write_was_overwritten_is_told(pair):
    cp, a, b = pair
    name = f"told-{uuid.uuid4().hex[:6]}.md"
    _lww(cp, a, b, name)
    rec = live_records(cp, "s")[name]
    # B, the last writer, is told as before
    assert [e for e in errors_log(b.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
    # A, whose version 2 was overwritten, learns it from the feed
    def told() -> list[dict]:
        return [e for e in errors_log(a.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
    wait_until(lambda: told(), timeout=20, what="A told its write was overwritten")
    wait_until(lambda: read(a.mountpoint / "s" / name) == "FROM-B\nbeta\n", timeout=20,
               what="A shows the last writer's content")
    [line] = told()
    assert line["store"] == "s" and line["path"] == name, line
    assert line.get("overwritten") is True, line
    assert line.get("lost_version") == 2 and line.get("version") == rec.version, line
    assert "memfuse history" in line["reason"] and "restore" in line["reason"], line
    assert "FROM" not in json.dumps(line)  # never memory content


def test_a_mount_whose_write_was_not_overwritten_is_told_nothing(pair):
    cp, a, b = pair
    name = f"quiet-{uuid.uuid4().hex[:6]}.md"
    pa, pb = written_and_seen(a, b, "s", name, "one\ntwo\n")
    sh(f"sed -i s/one/ONE/ {name}", b.mountpoint / "s")  # B edits the version it shows
    wait_until(lambda: live_records(cp, "s")[name].version == 2, timeout=20, what="B's edit")
    wait_until(lambda: read(pa) == "ONE\ntwo\n", timeout=20, what="A shows B's edit")
    errs_a = [e for e in errors_log(a.mountpoint) if e["path"].endswith(name)]
    errs_b = [e for e in errors_log(b.mountpoint) if e["path"].endswith(name)]
    assert errs_a == [] and errs_b == [], (errs_a, errs_b)


def test_a_mount_down_while_its_write_was_overwritten_is_told_when_it_comes_back(pair):
    """The catch-up of a saved mirror at start tells as the feed does (and a directory that
    went from A's view with its records stays gone after A's restart: the directory list
    A saves is written again)."""
    cp, a, b = pair
    name = f"back-{uuid.uuid4().hex[:6]}.md"
    top = f"gone-{uuid.uuid4().hex[:6]}"
    sh(f"mkdir -p {top}/d1 && echo x > {top}/d1/x.md", b.mountpoint / "s")
    wait_until(lambda: read(a.mountpoint / "s" / top / "d1" / "x.md") == "x\n", timeout=20,
               what="A shows d1")
    sh(f"mkdir {top}/a-made", a.mountpoint / "s")  # A saves its directory list, d1 in it
    sh(f"mv {top}/d1 {top}/d2", b.mountpoint / "s")
    wait_until(lambda: not os.path.exists(a.mountpoint / "s" / top / "d1"), timeout=20,
               what="A shows no d1")
    pa, pb = written_and_seen(a, b, "s", name, "alpha\nbeta\n")
    mine = pb.read_text()  # B's tool reads version 1
    sh(f"sed -i s/alpha/FROM-A/ {name}", a.mountpoint / "s")  # A's version 2
    wait_until(lambda: live_records(cp, "s")[name].version == 2, timeout=20, what="A's edit")
    a.stop()
    try:
        replace_like_sed(pb, mine.replace("alpha", "FROM-B"))  # B's edit made on version 1 overwrites A's
        wait_until(lambda: live_records(cp, "s")[name].content == "FROM-B\nbeta\n", timeout=30,
                   what="B's write is the last")
    finally:
        a.start(expect="s")
    wait_until(lambda: read(pa) == "FROM-B\nbeta\n", timeout=20, what="A shows B's write")
    lines = [e for e in errors_log(a.mountpoint) if e.get("overwritten") and e["path"] == name]
    assert [(e["lost_version"], e["version"]) for e in lines] == [(2, 3)], lines
    assert sorted(os.listdir(a.mountpoint / "s" / top)) == ["a-made", "d2"]


def _shell_in(cwd: Path) -> subprocess.Popen:
    """A bash whose cwd is ``cwd``; it waits for one line on stdin, then runs
    ``echo x > here.md`` there and prints the create's exit status and error."""
    return subprocess.Popen(["bash", "-c", "cd \"$1\" && read _ && { echo x > here.md; echo rc=$?; } 2>&1",
                             "bash", str(cwd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, LC_ALL="C.UTF-8"))


@contextmanager
def _held_dir(cwd: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A shell sitting in ``cwd`` (``_shell_in``: its ``cd`` done before this yields; under
    load the test's ``rmdir`` came first and the ``cd`` failed) and a directory descriptor
    open on it, both let go afterwards (the shell killed if it still runs)."""
    shell = _shell_in(cwd)
    dfd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY)
    try:
        wait_until(lambda: os.readlink(f"/proc/{shell.pid}/cwd") == str(cwd), timeout=20,
                   what="the shell in its directory")
        yield shell, dfd
    finally:
        os.close(dfd)
        if shell.poll() is None:
            shell.kill()
        shell.wait(timeout=10)


def _create_in_gone_dir(cp, b, top: str, shell: subprocess.Popen, dfd: int) -> None:
    """The directory ``top/pa/sub`` is gone from B while ``shell``'s cwd and ``dfd`` hold
    it: every namespace change there fails ENOENT, and nothing reaches the control plane."""
    pb = b.mountpoint / "s"
    out, _ = shell.communicate("go\n", timeout=30)
    assert "rc=1" in out and "No such file or directory" in out, out
    for make in (lambda: os.mkdir("newdir", dir_fd=dfd),
                 lambda: os.mknod("node.md", 0o644 | stat.S_IFREG, dir_fd=dfd),
                 lambda: os.close(os.open("opened.md", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=dfd))):
        with pytest.raises(FileNotFoundError):
            make()
    (pb / f"{top}-mv.md").write_text("mv\n")
    sfd = os.open(pb, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):  # a rename into it
            os.rename(f"{top}-mv.md", "moved.md", src_dir_fd=sfd, dst_dir_fd=dfd)
    finally:
        os.close(sfd)
    assert read(pb / f"{top}-mv.md") == "mv\n"
    assert os.listdir(dfd) == []
    drained(b)
    assert not [p for p in live_records(cp, "s") if p.startswith(f"{top}/pa")]
    assert not os.path.exists(pb / top / "pa")
    # made again here, the same path is B's own new file: no conflict "created elsewhere"
    sh(f"mkdir -p {top}/pa/sub && echo again > {top}/pa/sub/here.md", pb)
    drained(b)
    assert live_records(cp, "s")[f"{top}/pa/sub/here.md"].content == "again\n"
    assert read(pb / top / "pa" / "sub" / "here.md") == "again\n"
    assert [e for e in errors_log(b.mountpoint) if top in e.get("path", "")] == []


@pytest.mark.parametrize("how", ["moved", "deleted"])
def test_a_create_in_a_directory_pruned_under_a_shell_fails_enoent(pair, how):
    """Attack 14 F4: a shell on B sits in ``pa/sub``; A moves (or deletes) the last record
    under it, B prunes ``pa/sub`` and ``pa``; the shell's ``echo x > here.md`` fails ENOENT
    (as on a local disk whose cwd was removed) instead of committing a file B never shows."""
    cp, a, b = pair
    top = f"prune-{how}-{uuid.uuid4().hex[:6]}"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"mkdir -p {top}/pa/sub && echo 1 > {top}/pa/sub/f.md", pa)
    wait_until(lambda: read(pb / top / "pa" / "sub" / "f.md") == "1\n", timeout=20, what="B shows f.md")
    with _held_dir(pb / top / "pa" / "sub") as (shell, dfd):
        if how == "moved":
            sh(f"mv {top}/pa/sub/f.md {top}-f.md", pa)
        else:
            sh(f"rm {top}/pa/sub/f.md", pa)
        wait_until(lambda: not os.path.exists(pb / top / "pa"), timeout=20, what="B pruned pa")
        _create_in_gone_dir(cp, b, top, shell, dfd)


def test_a_create_in_a_directory_removed_here_fails_enoent(pair):
    """The same rule for a directory removed on this mount (rmdir of a shell's cwd)."""
    cp, a, b = pair
    top = f"rmdir-{uuid.uuid4().hex[:6]}"
    pb = b.mountpoint / "s"
    sh(f"mkdir -p {top}/pa/sub", pb)
    with _held_dir(pb / top / "pa" / "sub") as (shell, dfd):
        sh(f"rmdir {top}/pa/sub {top}/pa", pb)
        _create_in_gone_dir(cp, b, top, shell, dfd)
