"""The ``.memfuse/`` control files show their real size.

``status.json``, ``errors.log`` and ``context.md`` used to show size 0 in ``ls -l`` / ``stat``
while ``cat`` returned content; tools that trust ``st_size`` got nothing (``shutil.copyfile``
copies with ``sendfile``, which the kernel cuts at the size it was told: an empty copy). Now
``st_size`` is the length of the content an open reads: on a real mount, real tools (``stat``,
``ls -l``, ``wc -c``, ``tail -c``, ``head -c``, ``cp``, Python's ``read()`` and
``shutil.copyfile``) agree with ``cat``, also right after the content grew; one open reads one
snapshot and its ``fstat`` gives that snapshot's length. Unit tests of ``ControlFiles``'
rendering rules (reuse, invalidation, the held snapshot) run without a mount.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from memfuse.sidecar import control
from memfuse.sidecar.control import ControlFiles
from mountutil import serve_and_mount, wait_for


def _out(cmd: str, cwd: Path) -> bytes:
    """stdout of ``cmd`` (bash, in ``cwd``, 30 s bound) as bytes; raises when it fails."""
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, timeout=30,
                       stdin=subprocess.DEVNULL, env=dict(os.environ, LC_ALL="C.UTF-8"))
    assert p.returncode == 0, (cmd, p.returncode, p.stderr)
    return p.stdout


def _refuse(mnt: Path, name: str) -> None:
    """Write invalid UTF-8 to ``default/name``: the close fails (EILSEQ) and ``errors.log``
    gets a line."""
    with pytest.raises(OSError) as e:
        with open(mnt / "default" / name, "wb") as f:
            f.write(b"caf\xe9\n")
    assert e.value.errno == errno.EILSEQ


def _copies(p: Path, local: Path, tag: str, n: int | None = None) -> dict[str, bytes]:
    """The content of ``p`` as each tool reads it (each one a new open); ``tail -c`` and
    ``head -c`` ask for ``n`` bytes (default: as many as ``cat`` read)."""
    got = {"cat": _out(f"cat {p}", p.parent)}
    n = len(got["cat"]) if n is None else n
    _out(f"cp {p} {local}/cp-{tag}", p.parent)
    got["cp"] = (local / f"cp-{tag}").read_bytes()
    shutil.copyfile(p, local / f"sendfile-{tag}")  # os.sendfile: cut at st_size
    got["shutil.copyfile"] = (local / f"sendfile-{tag}").read_bytes()
    got["python read"] = _out(f"python3 -c 'import sys; sys.stdout.buffer.write("
                              f"open(\"{p}\", \"rb\").read())'", p.parent)
    got["tail -c"] = _out(f"tail -c {n} {p}", p.parent)  # lseek(SEEK_END - n)
    got["head -c"] = _out(f"head -c {n} {p}", p.parent)
    return got


@pytest.mark.mount
def test_control_files_report_the_size_a_read_returns(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    with serve_and_mount(tmp_path) as (cp, sc):
        mnt = sc.mountpoint.resolve()
        ctl = mnt / ".memfuse"
        wait_for(lambda: f"## Store `default` at `{mnt}/default/`"
                 in (ctl / "context.md").read_text(), 20, "the prompt block fetched")
        _refuse(mnt, "bad1.md")

        # errors.log and context.md change only with an event: stat agrees with every reader
        for name in ("errors.log", "context.md"):
            p = ctl / name
            body = _out(f"cat {p}", mnt)
            assert len(body) > 50
            assert int(_out(f"stat -c %s {p}", mnt)) == len(body), name
            assert _out(f"ls -l {p}", mnt).split()[4] == str(len(body)).encode(), name
            assert int(_out(f"wc -c < {p}", mnt)) == len(body)
            assert _out(f"tail -c 25 {p}", mnt) == body[-25:]
            assert os.stat(p).st_size == len(p.read_bytes())
            got = _copies(p, local, name)
            assert got == dict.fromkeys(got, body), name

        # a newer, longer errors.log is never cut to a size seen before, even with an older
        # open still holding its snapshot
        p = ctl / "errors.log"
        fd0 = os.open(p, os.O_RDONLY)
        try:
            old = os.read(fd0, 1 << 20)
            assert os.fstat(fd0).st_size == len(old)
            _refuse(mnt, "bad2.md")
            new = _out(f"cat {p}", mnt)
            assert len(new) > len(old) and new.startswith(old) and b"bad2.md" in new
            assert int(_out(f"stat -c %s {p}", mnt)) == len(new)
            assert int(_out(f"wc -c < {p}", mnt)) == len(new)
            got = _copies(p, local, "grown")
            assert got == dict.fromkeys(got, new)
            assert os.read(fd0, 1 << 20) == b""  # the old open still reads its own snapshot
        finally:
            os.close(fd0)

        # status.json changes all the time: one open reads one document, of its fstat size
        p = ctl / "status.json"
        assert int(_out(f"stat -c %s {p}", mnt)) > 200
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            data = b""
            while chunk := os.read(fd, 100):  # many reads, one snapshot
                data += chunk
                os.mkdir(mnt / "default" / f"d{len(data)}")  # the status changes meanwhile
            assert len(data) == size and json.loads(data)["ready"] is True
            assert os.fstat(fd).st_size == size
            os.lseek(fd, -30, os.SEEK_END)  # the kernel asks the size again (getattr)
            assert os.read(fd, 100) == data[-30:]
        finally:
            os.close(fd)
        # (each tool is a new open: the document may have changed in between, so tail and head
        # ask for more than all of it)
        for tool, content in _copies(p, local, "status", n=1 << 20).items():
            st = json.loads(content)  # whole documents, never cut
            assert st["ready"] is True and st["workspace"] == "ws", tool
        assert all(int(x) > 0 for x in _out(f"stat -c %s {ctl}/*", mnt).split())


# ------------------------------------------------------------------ without a mount
class _Committer:
    journal = None


class _Fs:
    metrics = None
    committer = _Committer()


def test_render_reuse_and_held_snapshots(monkeypatch):
    c = ControlFiles(_Fs())
    calls = []
    doc = {"n": 1}

    def provider():
        calls.append(1)
        return dict(doc)

    c.status_provider = provider
    # status: one rendering serves size and the open that follows while nothing changed
    size = c.size("status")
    snap = c.opened("status")
    assert len(snap) == size and len(calls) == 1
    # while open, the size is the open's snapshot, whatever changes
    doc["n"] = 123456
    c.changed()
    assert c.size("status") == size and len(calls) == 1
    c.closed("status")
    assert c.size("status") == len(snap) + 5 and len(calls) == 2  # changed: rendered anew
    assert c.size("status") == len(snap) + 5 and len(calls) == 2  # current: reused
    # even with nothing changed, a rendering of status.json ages out
    monkeypatch.setattr(control, "STATUS_REUSE_S", 0.0)
    c.size("status")
    assert len(calls) == 3

    # errors.log: reused until a line is added, however old
    e0 = c.size("errors")
    assert e0 == 0
    c.note_conflict("default", "a.md", "overwritten on top of a newer version")
    line = c.render("errors")
    assert c.size("errors") == len(line) > 0
    assert c.render("errors") is line
    # two opens: the size is the newest one's until both are closed
    a = c.opened("errors")
    c.note_conflict("default", "b.md", "again")
    b = c.opened("errors")
    assert len(b) > len(a) and c.size("errors") == len(b)
    c.closed("errors")
    c.closed("errors")
    assert c.size("errors") == len(b)

    # context.md: follows the fetched block
    c.set_context("# Memory\n")
    assert c.size("context") == len(b"# Memory\n")
    c.set_context("# Memory\nmore\n")
    assert c.size("context") == len(b"# Memory\nmore\n")
