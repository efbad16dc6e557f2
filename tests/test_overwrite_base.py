"""The base of an overwrite is the version the writer could have read (docs/SEMANTICS.md,
"Conflicts"): a tool that reads a file, then replaces it whole (``sed -i`` and ``os.replace``:
a temporary renamed over it; ``open(O_TRUNC)`` / ``cp`` / ``tee``; vim's ``ftruncate(0)``),
while the change feed brings a rival version in between, has its write sent ``If-Match``
the version it read, not the newer one the mount shows by then: the rival change is merged
three-way (disjoint lines) or the overwrite is reported (``conflict`` line), never lost
silently.

Two real sidecars on one store of a real ``memfuse serve``. Deterministic: the writer reads
version 1 in mount B, mount A commits version 2, B's mount applies it (seen through the
``user.memfuse.sha256`` attribute: no reader is served it), then B writes its edit made on
version 1 (attack report 1, findings 1 and 2).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.mount

from mountcheck import errors_log
from mountutil import (ControlPlane, Sidecar, live_records, read, sh, sidecar_status, two_sidecars, wait_applied,
                       wait_until, written_and_seen)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("ob"), "s") as cp_a_b:
        yield cp_a_b


def _depth(sc: Sidecar) -> int:
    return json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())["outbox"]["depth"]


def _shown(p: Path, content: str, timeout: float = 15) -> None:
    """Wait (at most ``timeout`` s) until the mount shows ``content`` at ``p`` by its sha256
    attribute (no open, no read: nothing is served to a reader)."""
    wait_applied(p, hashlib.sha256(content.encode()).hexdigest(), timeout=timeout,
                 what=f"{p.name} applied from the feed")


def _settled(cp, a, b, name: str) -> str:
    wait_until(lambda: _depth(a) == 0 and _depth(b) == 0, timeout=60, what="both outboxes drained")
    cur = live_records(cp, "s")[name].content
    wait_until(lambda: read(a.mountpoint / "s" / name) == cur and read(b.mountpoint / "s" / name) == cur,
               timeout=15, what="both mounts show the stored content")
    return cur


def _rewrite(path: Path, content: str, style: str) -> None:
    """Replace ``path``'s content whole as tools do: ``rename`` (sed -i, os.replace: a new
    file renamed over it), ``trunc`` (open O_TRUNC: cp, tee, python's open('w')), ``ftrunc``
    (vim: open O_WRONLY, ftruncate 0, write)."""
    if style == "rename":
        tmp = path.with_name(f"sed{uuid.uuid4().hex[:6]}")
        tmp.write_text(content)
        os.replace(tmp, path)
    elif style == "trunc":
        path.write_text(content)
    else:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, content.encode())
            os.fsync(fd)
        finally:
            os.close(fd)


@pytest.mark.parametrize("style", ["rename", "trunc", "ftrunc"])
def test_an_overwrite_made_on_the_version_read_merges_a_rival_change_applied_since(pair, style):
    cp, a, b = pair
    name = f"base-{style}-{uuid.uuid4().hex[:6]}.md"
    v1 = "".join(f"k{i}=v{i}\n" for i in range(1, 11))
    _, pb = written_and_seen(a, b, "s", name, v1, timeout=15)
    mine = pb.read_text()  # B's tool reads version 1
    errs = len(errors_log(a.mountpoint)) + len(errors_log(b.mountpoint))
    sh(f"sed -i s/^k3=.*/k3=EDIT_A/ {name}", a.mountpoint / "s")  # A commits version 2
    v2 = v1.replace("k3=v3", "k3=EDIT_A")
    _shown(pb, v2)  # B's mount applied it from the feed
    _rewrite(pb, mine.replace("k7=v7", "k7=EDIT_B"), style)  # B's edit, made on version 1
    cur = _settled(cp, a, b, name)
    assert cur == v1.replace("k3=v3", "k3=EDIT_A").replace("k7=v7", "k7=EDIT_B"), cur
    assert len(errors_log(a.mountpoint)) + len(errors_log(b.mountpoint)) == errs  # merged: no conflict


def test_an_overlapping_overwrite_on_an_older_version_is_reported(pair):
    cp, a, b = pair
    name = f"clash-{uuid.uuid4().hex[:6]}.md"
    v1 = "alpha\nbeta\n"
    _, pb = written_and_seen(a, b, "s", name, v1, timeout=15)
    mine = pb.read_text()
    sh(f"sed -i s/alpha/FROM-A/ {name}", a.mountpoint / "s")
    _shown(pb, "FROM-A\nbeta\n")
    _rewrite(pb, mine.replace("alpha", "FROM-B"), "rename")
    assert _settled(cp, a, b, name) == "FROM-B\nbeta\n"  # last writer wins...
    conflicts = [e for e in errors_log(b.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
    assert len(conflicts) == 1, errors_log(b.mountpoint)  # ... and says so
    rec = live_records(cp, "s")[name]
    history = [cp.call("version", "s", rec.id, v.version).content for v in cp.call("versions", "s", rec.id)]
    assert "FROM-A\nbeta\n" in history


def test_a_reader_served_the_new_version_bases_the_overwrite_on_it(pair):
    """A tool that read the version the feed brought writes on it: a plain overwrite, no
    merge of its own deletion back (the base is the version last served, not an older one)."""
    cp, a, b = pair
    name = f"served-{uuid.uuid4().hex[:6]}.md"
    v1 = "one\ntwo\n"
    _, pb = written_and_seen(a, b, "s", name, v1, timeout=15)
    sh(f"echo added >> {name}", a.mountpoint / "s")
    wait_until(lambda: read(pb) == "one\ntwo\nadded\n", timeout=15, what="v2 read in B")
    errs = len(errors_log(b.mountpoint))
    _rewrite(pb, "one\n", "rename")  # B deletes lines it saw, "added" among them
    assert _settled(cp, a, b, name) == "one\n"
    assert len(errors_log(b.mountpoint)) == errs


def test_sed_on_a_header_while_another_mount_appends_keeps_every_line(pair):
    """Attack report 1, finding 2 (atk_t10): mount A appends line after line while mount B
    rewrites the first line with ``sed -i`` again and again: every appended line survives,
    and the last header too."""
    cp, a, b = pair
    name = f"journal-{uuid.uuid4().hex[:6]}.log"
    (a.mountpoint / "s" / name).write_text("counter=0\n" + "h" * 1100 + "\n")
    wait_until(lambda: (read(b.mountpoint / "s" / name) or "").startswith("counter=0"),
               timeout=15, what="the journal in B")
    n_lines = 40
    failed: list[BaseException] = []

    def appender() -> None:
        try:
            for i in range(1, n_lines + 1):
                sh(f"echo A-{i} >> {name}", a.mountpoint / "s")
        except BaseException as e:  # reported below
            failed.append(e)

    t = threading.Thread(target=appender)
    t.start()
    try:
        for k in range(1, 13):
            sh(f"sed -i s/^counter=.*/counter={k}/ {name}", b.mountpoint / "s")
    finally:
        t.join(timeout=120)
    assert not t.is_alive() and not failed, failed
    cur = _settled(cp, a, b, name)
    lines = cur.splitlines()
    assert lines[0] == "counter=12", lines[:2]
    missing = [i for i in range(1, n_lines + 1) if f"A-{i}" not in lines]
    assert not missing, f"appended lines lost: {missing}"
    assert [ln for ln in lines if ln.startswith("A-")] == [f"A-{i}" for i in range(1, n_lines + 1)]


HELD = Path(__file__).resolve().parent / "held_mount.py"


class HeldSidecar(Sidecar):
    """A sidecar whose kernel invalidations are held back while ``hold_file`` exists, and
    whose change feed applies nothing while ``feed_file`` exists (tests/held_mount.py: its
    ``Invalidator`` and its feed get fault hooks at construction)."""

    def __init__(self, *args, hold_file: Path) -> None:
        super().__init__(*args)
        self.hold_file = hold_file
        self.feed_file = hold_file.with_name(hold_file.name + "-feed")
        self.write_file = hold_file.with_name(hold_file.name + "-write")

    def start(self, expect: str | None = "default") -> "HeldSidecar":
        import subprocess
        import sys

        from mountutil import is_mounted, wait_for

        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, str(HELD), str(self.mountpoint), "--control-plane", self.cp.url,
             "--workspace", self.ws, "--token-file", str(self.token_file),
             "--cache-dir", str(self.cache_dir), "--hold", str(self.hold_file),
             "--hold-feed", str(self.feed_file), "--hold-after-write", str(self.write_file)],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: is_mounted(self.mountpoint) and
                 (expect is None or os.path.isdir(self.mountpoint / expect)),
                 60, f"mount at {self.mountpoint}", self.proc, self.log)
        return self


@pytest.fixture(scope="module")
def held(pair, tmp_path_factory):
    """A third mount C of the pair's store whose kernel invalidations the test holds back
    (``C.hold_file``)."""
    cp, a, _ = pair
    tmp = tmp_path_factory.mktemp("held")
    tc = cp.setup_workspace("wc", ("s",))
    c = HeldSidecar(cp, "wc", tc, tmp / "mc", tmp / "cc", hold_file=tmp / "hold")
    c.start(expect="s")
    try:
        yield cp, a, c
    finally:
        c.hold_file.unlink(missing_ok=True)
        c.feed_file.unlink(missing_ok=True)
        c.stop()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sed_while_the_kernel_shows_the_older_version(cp, a, c, name: str, seen: str, k: int,
                                                  read_first: bool) -> str:
    """Mount C's kernel holds ``seen`` (its pages or its size); C's invalidations are held
    while A appends a line and C's sidecar applies it; then ``sed -i`` in C rewrites the
    first line: it reads ``seen`` from the kernel. ``read_first``: C reads ``seen`` before
    (its pages are cached), else C's kernel holds only its size. Returns the stored content
    afterwards."""
    pc = c.mountpoint / "s" / name
    wait_until(lambda: sidecar_status(c)["invalidations"]["pending"] == 0, timeout=15,
               what="C's kernel told every change so far")
    if read_first:
        assert read(pc) == seen  # in C's page cache now
    # its size in C's kernel (a read marks the atime stale: this stat refreshes it, so a
    # later stat does not fetch the new size, which would drop the pages)
    assert os.stat(pc).st_size == len(seen)
    c.hold_file.write_text("")
    try:
        sh(f"echo A-{k} >> {name}", a.mountpoint / "s")
        _shown(pc, seen + f"A-{k}\n")  # C's sidecar applied it; its kernel was not told
        sh(f"sed -i s/^counter=.*/counter={k}/ {name}", c.mountpoint / "s")
    finally:
        c.hold_file.unlink()
    wait_until(lambda: _depth(a) == 0 and _depth(c) == 0, timeout=60, what="both outboxes drained")
    cur = live_records(cp, "s")[name].content
    wait_until(lambda: read(a.mountpoint / "s" / name) == cur and read(pc) == cur,
               timeout=15, what="both mounts show the stored content")
    return cur


def test_sed_reading_the_page_cache_before_a_remote_append_reaches_it_keeps_the_append(held):
    """The kernel of mount C still serves the pages of the version its readers read while
    C's sidecar has applied a rival append (the invalidation has not reached the kernel):
    ``sed -i`` reads the older pages, so its rewrite is based on them and the append is
    merged back, never deleted (the base is what the reader got, not what the sidecar
    holds)."""
    cp, a, c = held
    name = f"pages-{uuid.uuid4().hex[:6]}.log"
    v1 = "counter=0\n" + "x" * 100 + "\n"
    _, pc = written_and_seen(a, c, "s", name, v1, timeout=15)
    cur = _sed_while_the_kernel_shows_the_older_version(cp, a, c, name, v1, 1, read_first=True)
    assert cur == "counter=1\n" + "x" * 100 + "\nA-1\n", cur


def test_sed_over_its_own_write_before_a_remote_append_reaches_the_kernel_keeps_the_append(held):
    """Mount C's own write (no reader served it since: ``Node.unread``) is what C's kernel
    shows (its size, its pages) until the invalidation of a rival append reaches it: a
    ``sed -i`` meanwhile reads C's own version, and its rewrite is based on it."""
    cp, a, c = held
    name = f"own-{uuid.uuid4().hex[:6]}.log"
    v1 = "counter=0\n" + "y" * 100 + "\n"
    _, pc = written_and_seen(a, c, "s", name, v1, timeout=15)
    sh(f"sed -i s/^counter=.*/counter=1/ {name}", c.mountpoint / "s")  # C's own version
    mine = v1.replace("counter=0", "counter=1")
    wait_until(lambda: _depth(c) == 0 and read(a.mountpoint / "s" / name) == mine,
               timeout=30, what="C's write committed and seen in A")
    cur = _sed_while_the_kernel_shows_the_older_version(cp, a, c, name, mine, 2, read_first=False)
    assert cur == "counter=2\n" + "y" * 100 + "\nA-2\n", cur


def test_sed_on_a_mount_that_is_itself_appending_keeps_the_other_mounts_lines(pair):
    """Attack report 11, finding 3 (atk11/t_tail_race.sh): mounts A and B both append 1 KB
    lines to one file while B also rewrites its first line with ``sed -i``. B's own appends
    are rebased onto A's (the control plane answers versions holding A's lines) while B
    still shows its own content (its feed waits for its outbox): B's sed read that
    content, so its rewrite is based on it and A's lines are merged in, never dropped."""
    cp, a, b = pair
    name = f"tail-{uuid.uuid4().hex[:6]}.log"
    (a.mountpoint / "s" / name).write_text("counter=0\n" + "".join(f"base {i}\n" for i in range(10)))
    wait_until(lambda: (read(b.mountpoint / "s" / name) or "").startswith("counter=0"),
               timeout=15, what="the file in B")
    n_lines, pad = 15, "p" * 1000
    failed: list[BaseException] = []

    def appender(sc: Sidecar, who: str) -> None:
        try:
            for i in range(1, n_lines + 1):
                sh(f"echo {who}-{i} {pad} >> {name}", sc.mountpoint / "s")
        except BaseException as e:  # reported below
            failed.append(e)

    threads = [threading.Thread(target=appender, args=(a, "A")),
               threading.Thread(target=appender, args=(b, "B"))]
    for t in threads:
        t.start()
    try:
        for k in range(1, 4):
            sh(f"sed -i s/^counter=.*/counter={k}/ {name}", b.mountpoint / "s")
    finally:
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not failed, failed
    cur = _settled(cp, a, b, name)
    lines = cur.splitlines()
    # A's lines are all committed and B's sed never read some of them: each is merged in
    # (or the rewrite that overwrote it is reported as a conflict)
    missing = [f"A-{i}" for i in range(1, n_lines + 1) if not any(ln.startswith(f"A-{i} ") for ln in lines)]
    conflicts = [e for e in errors_log(b.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
    assert not missing or conflicts, f"A's lines lost silently: {missing}"
    assert not missing, f"A's lines lost (reported): {missing}; {conflicts}"


@pytest.mark.parametrize("style", ["rename", "trunc"])
def test_an_overwrite_after_an_own_append_committed_cleanly_merges_the_other_mounts_line(held, style):
    """verify 11, "F3 with three mounts" / "at a higher edit rate": ``sed -i`` in mount C
    reads version 1; C's own ``echo >>`` then commits cleanly (no rival yet: version 2 is
    C's own, its content never served to a reader); mount A appends a line (version 3) that
    C's feed has not applied (held) when the editor writes its output, made on version 1.
    The overwrite is based on version 1, what the editor read: A's line is merged in, with
    no conflict. (Based on version 2, the editor's output deletes C's own line where A's
    was added after it: overlapping edits, last writer wins, A's line dropped.)"""
    cp, a, c = held
    name = f"ownapp-{style}-{uuid.uuid4().hex[:6]}.log"
    v1 = "counter=0\n" + "".join(f"base {i:02d} {'b' * 88}\n" for i in range(12))
    _, pc = written_and_seen(a, c, "s", name, v1, timeout=15)
    mine = pc.read_text()  # the editor in C reads version 1
    errs = len(errors_log(a.mountpoint)) + len(errors_log(c.mountpoint))
    c.feed_file.write_text("")
    try:
        sh(f"echo C-1 >> {name}", c.mountpoint / "s")  # C's own version 2, committed cleanly
        wait_until(lambda: _depth(c) == 0, timeout=30, what="C's append committed")
        sh(f"echo A-1 >> {name}", a.mountpoint / "s")  # version 3, not applied in C
        wait_until(lambda: _depth(a) == 0, timeout=30, what="A's append committed")
        assert live_records(cp, "s")[name].content == v1 + "C-1\nA-1\n"
        assert os.getxattr(pc, "user.memfuse.sha256").decode() == _sha(v1 + "C-1\n")
        _rewrite(pc, mine.replace("counter=0", "counter=1"), style)  # made on version 1
    finally:
        c.feed_file.unlink()
    wait_until(lambda: _depth(a) == 0 and _depth(c) == 0, timeout=60, what="both outboxes drained")
    cur = live_records(cp, "s")[name].content
    assert cur == v1.replace("counter=0", "counter=1") + "C-1\nA-1\n", cur
    wait_until(lambda: read(a.mountpoint / "s" / name) == cur and read(pc) == cur,
               timeout=15, what="both mounts show the stored content")
    assert len(errors_log(a.mountpoint)) + len(errors_log(c.mountpoint)) == errs  # merged: no conflict


def test_a_reader_whose_reads_straddle_a_remote_change_makes_the_overwrite_a_reported_conflict(held):
    """verify 11, "F3 at a higher edit rate" (the silent merge): a reader in mount C reads
    the first part of version 1, mount A inserts a line (version 2), C applies it and its
    kernel drops the pages (once the reader held the file open past ``READER_LINGER``:
    the invalidation waits for it that long, torn16b); the reader's next read gets version 2's bytes from there on, so
    it holds parts of both (a line twice, A's line missing). Its rewrite was based on
    version 2 (the read "served the current content"): sent as a clean write, the duplicate
    and the loss were silent. No version is what the reader holds: last writer wins, with
    a conflict line."""
    cp, a, c = held
    name = f"torn-{uuid.uuid4().hex[:6]}.log"
    v1 = "counter=0\n" + "".join(f"line {i:02d} {'x' * 92}\n" for i in range(1, 30))
    # the setup's waits end at their event; their bounds are generous for a loaded machine
    # (15 s, a bound on the feed's delay, was the only timing this setup assumed)
    _, pc = written_and_seen(a, c, "s", name, v1, timeout=60)
    errs = len([e for e in errors_log(c.mountpoint) if e.get("conflict")])
    # open for reading and writing: a writer holding the file keeps these rules (a reader
    # alone keeps the older version whole: the next tests)
    with open(pc, "r+b", buffering=0) as f:
        first = f.read(1500)  # the reader in C: version 1 up to byte 1500
        done = sidecar_status(c)["invalidations"]["done"]
        v2 = v1.replace("line 05", "A-1 inserted\nline 05")
        sh(f"sed -i 's/^line 05/A-1 inserted\\nline 05/' {name}", a.mountpoint / "s")
        wait_until(lambda: live_records(cp, "s")[name].content == v2, timeout=60,
                   what="A's version 2 committed")
        _shown(pc, v2, timeout=60)  # C applied version 2 (no reader served it)
        # the invalidation waits for this reader (torn16b), READER_LINGER s at most (counted
        # in "pending" meanwhile): a reader open longer than that straddles the change; the
        # file's sha256 attribute may show version 2 before its invalidation is queued, so
        # the wait is for one performed since (``done``) and none left
        wait_until(lambda: (lambda st: st["done"] > done and st["pending"] == 0)(
                       sidecar_status(c)["invalidations"]), timeout=60,
                   what="C's kernel dropped version 1's pages")
        inv = sidecar_status(c)["invalidations"]
        got = first + f.read()  # version 2 from byte 1500 on
    assert got != v1.encode() and got != v2.encode(), (len(got), got == v1.encode(), inv)
    ours = got.decode().replace("counter=0", "counter=1")
    _rewrite(pc, ours, "rename")
    wait_until(lambda: _depth(a) == 0 and _depth(c) == 0, timeout=60, what="both outboxes drained")
    cur = live_records(cp, "s")[name].content
    conflicts = [e for e in errors_log(c.mountpoint) if e.get("conflict")]
    assert len(conflicts) == errs + 1 and conflicts[-1]["path"].endswith(name), conflicts
    assert cur == ours, cur  # last writer wins; version 2 stays in history


def _outlasting_reader(cp, a, c, prefix: str, mode: str, meanwhile: bool = False,
                       append: bool = False) -> tuple[str, Path, bytes, str, str]:
    """attack 17 F1: a reader in C (``open(..., mode)``) reads the first 8 KiB of version 1
    (300 lines, 26 KB); A replaces the file (a temporary renamed over it) by a shorter
    version 2 (60 lines, 5 KB); C's sidecar applies it, and the kernel invalidation waits
    for the reader ``READER_LINGER`` s at most: the reader is still open past it; then it
    reads on to its EOF (``meanwhile``: then another open in C, still reading it, reads
    version 2; ``append``: A appends a line instead, version 2 extends version 1). Returns ``(name, its path in C, what the reader got, v1, v2)``."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}.md"
    v1 = "".join(f"v1 line {i:04d} {'x' * 70}\n" for i in range(300))
    v2 = "".join(f"v2 line {i:04d} {'x' * 70}\n" for i in range(60))
    if append:
        v2 = v1 + "A appended\n"
    _, pc = written_and_seen(a, c, "s", name, v1, timeout=60)
    with open(pc, mode, buffering=0) as f:
        got = f.read(8192)
        done = sidecar_status(c)["invalidations"]["done"]
        if append:
            with open(a.mountpoint / "s" / name, "a") as w:
                w.write("A appended\n")
        else:
            _rewrite(a.mountpoint / "s" / name, v2, "rename")
        wait_until(lambda: live_records(cp, "s")[name].content == v2, timeout=60,
                   what="A's version 2 committed")
        _shown(pc, v2, timeout=60)  # C applied version 2 (no reader served it)
        # past the linger: what the invalidation does (made, or the name's entry instead)
        wait_until(lambda: (lambda st: st["done"] > done and st["pending"] == 0)(
                       sidecar_status(c)["invalidations"]), timeout=60,
                   what="C's invalidation of version 1 made past the linger")
        while True:
            b = f.read(4096)
            if not b:
                break
            got += b
        if meanwhile:  # a new open, the reader still open: the name's current version
            assert read(pc) == v2
    return name, pc, got, v1, v2


def test_a_reader_open_past_the_linger_across_a_remote_replace_reads_the_older_version_whole(held):
    """attack 17 F1: a reader open for reading only, past ``READER_LINGER``, while another
    mount replaces the file by a shorter version: on main the invalidation was made then,
    the kernel learnt the shorter size and answered the reader's next read with EOF: it
    held version 1 cut at 8 KiB, no version (a slow ``sed -i`` committed it). As on a local
    disk (a descriptor opened before a rename over the file), it reads version 1 whole: the
    file moved to a new inode, the old one kept for it. An open meanwhile reads version 2,
    and the reader's edit written back is based on version 1 (merged onto version 2), not
    on the version 2 that open was served."""
    cp, a, c = held
    kept = sidecar_status(c)["invalidations"].get("kept_for_readers", 0)
    name, pc, got, v1, v2 = _outlasting_reader(cp, a, c, "keep", "rb", meanwhile=True)
    assert got == v1.encode(), (len(got), len(v1), got[-40:])
    assert sidecar_status(c)["invalidations"].get("kept_for_readers", 0) == kept + 1
    errs = len(errors_log(c.mountpoint))
    _rewrite(pc, got.decode() + "C edit\n", "rename")
    wait_until(lambda: _depth(a) == 0 and _depth(c) == 0, timeout=60, what="both outboxes drained")
    assert live_records(cp, "s")[name].content == v2 + "C edit\n"
    assert len(errors_log(c.mountpoint)) == errs  # merged: no conflict


def test_a_reader_open_past_the_linger_across_a_remote_append_reads_the_appended_line(held):
    """A reader open for reading only past ``READER_LINGER`` while another mount appends to
    the file (``tail -f`` on a journal): the file keeps its inode (no older content kept
    for the reader), and the reader's next reads get the appended line, as on a local
    disk."""
    cp, a, c = held
    kept = sidecar_status(c)["invalidations"].get("kept_for_readers", 0)
    name, pc, got, v1, v2 = _outlasting_reader(cp, a, c, "append", "rb", append=True)
    assert got == v2.encode(), (len(got), len(v1), got[-40:])
    assert sidecar_status(c)["invalidations"].get("kept_for_readers", 0) == kept


def test_a_reader_open_for_writing_cut_past_the_linger_makes_its_overwrite_a_straddle_conflict(held):
    """attack 17 F1, a handle open for writing (``r+b``: today's rules, no inode kept):
    the kernel answers the reader's read past version 2's size with EOF, without asking
    the sidecar, so it holds version 1 cut at 8 KiB; written back, that content is no
    version. On main the overwrite was named by the generic conflict line only; it is
    named by the straddle line (``a reader of this file was served parts of two
    versions``), and A, whose version it replaced, is told (``overwritten``)."""
    cp, a, c = held
    errs = len(errors_log(c.mountpoint))
    name, pc, got, v1, v2 = _outlasting_reader(cp, a, c, "cut", "r+b")
    assert got == v1.encode()[:8192], len(got)  # cut by the kernel at version 2's size
    ours = got.decode() + "C edit\n"
    _rewrite(pc, ours, "rename")
    wait_until(lambda: _depth(a) == 0 and _depth(c) == 0, timeout=60, what="both outboxes drained")
    assert live_records(cp, "s")[name].content == ours  # last writer wins
    lines = [e for e in errors_log(c.mountpoint)[errs:] if e.get("path", "").endswith(name)]
    assert lines and "parts of two versions" in lines[-1]["reason"], lines
    wait_until(lambda: any(e.get("overwritten") and e.get("path", "").endswith(name)
                           for e in errors_log(a.mountpoint)),
               timeout=60, what="A told its version was overwritten")


def _tail_case(a, c, prefix: str) -> tuple[str, Path, str, str]:
    """The file of the "tails" tests (torn16b): version 1 (42 lines) written on A and read in
    C; version 2 its first line made 4 bytes longer (``sed -i 's/^A 0$/A 1zzzz/'``).
    Returns ``(name, its path in C, v1, v2)``."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}.log"
    v1 = "A 0\n" + "".join(f"b {i} {'x' * 32}\n" for i in range(1, 41)) + "B 0\n"
    (a.mountpoint / "s" / name).write_text(v1)
    pc = c.mountpoint / "s" / name
    wait_until(lambda: read(pc) == v1, timeout=15, what="v1 in C")
    return name, pc, v1, v1.replace("A 0\n", "A 1zzzz\n")


def test_a_reader_whose_next_read_comes_after_a_longer_change_gets_no_byte_of_it(held):
    """torn16b (attack 16 F1, the "tails"): a reader in C read version 1 whole (its first
    read(2)); A's longer version 2 reaches C. On main the kernel was told at once, and the
    reader's next read(2), past version 1's end, refreshed the size and got version 2's
    bytes past it: version 1 followed by the tail of version 2, which ``sed -i`` committed.
    The invalidation waits for the reader to close: its next read is the end of version 1;
    once it closed, C reads version 2."""
    cp, a, c = held
    name, pc, v1, v2 = _tail_case(a, c, "tail")
    with open(pc, "rb", buffering=0) as f:
        got = f.read(4096)  # version 1 whole, as sed's first read
        assert got == v1.encode()
        sh(f"sed -i 's/^A 0$/A 1zzzz/' {name}", a.mountpoint / "s")
        _shown(pc, v2)  # C's sidecar applied version 2 (getxattr: no reader served it)

        def told_or_waiting() -> bool:
            inv = sidecar_status(c)["invalidations"]
            return inv["pending"] == 0 or inv.get("waiting_for_readers", 0) > 0
        wait_until(told_or_waiting, timeout=15, what="C's invalidation made or waiting")
        got += f.read(4096)  # sed's next read, past version 1's end
    assert got == v1.encode(), got[len(v1) - 10:]
    wait_until(lambda: read(pc) == v2, timeout=15, what="version 2 read in C once closed")


def test_a_listing_while_a_reader_is_open_keeps_the_older_size_for_it(held):
    """torn16b: as above, with ``ls -l`` in C while the reader is open and C's kernel not
    told yet (invalidations held): the listing's attributes (readdirplus) gave the kernel
    version 2's size, and the reader's next read got version 2's tail. The kernel is given
    the size of the version the reader reads until the reader closes."""
    cp, a, c = held
    name, pc, v1, v2 = _tail_case(a, c, "tail-ls")
    with open(pc, "rb", buffering=0) as f:
        got = f.read(4096)
        assert got == v1.encode()
        c.hold_file.write_text("")
        try:
            sh(f"sed -i 's/^A 0$/A 1zzzz/' {name}", a.mountpoint / "s")
            _shown(pc, v2)
            sh("ls -l >/dev/null", c.mountpoint / "s")
            got += f.read(4096)
        finally:
            c.hold_file.unlink(missing_ok=True)
    assert got == v1.encode(), got[len(v1) - 10:]
    wait_until(lambda: read(pc) == v2, timeout=15, what="version 2 read in C once closed")


def _v1_sized_in_cs_kernel(a, c, name: str) -> str:
    """Version 1 of ``name``, written by A, whose size C's kernel holds (a stat; no reader in
    C read it: no page cached). Returns it."""
    v1 = "counter=0\n" + "".join(f"line {i} {'x' * 40}\n" for i in range(1, 9)) + "the end\n"
    (a.mountpoint / "s" / name).write_text(v1)
    pc = c.mountpoint / "s" / name
    _shown(pc, v1)
    wait_until(lambda: sidecar_status(c)["invalidations"]["pending"] == 0, timeout=15,
               what="C's kernel told every change so far")
    assert os.stat(pc).st_size == len(v1)  # version 1's size in C's kernel
    return v1


def _longer_v2_held_from_cs_kernel(a, c, name: str, v1: str) -> str:
    """A's ``sed -i`` makes the first line of ``name`` longer (version 2, returned); C's
    sidecar applies it while C's invalidations are held (the test removes ``c.hold_file``):
    C's kernel still holds version 1's size."""
    c.hold_file.write_text("")
    sh(f"sed -i s/^counter=0/counter=123456/ {name}", a.mountpoint / "s")
    v2 = v1.replace("counter=0", "counter=123456")
    _shown(c.mountpoint / "s" / name, v2)  # C's sidecar applied version 2; its kernel was not told
    return v2


def test_a_reader_open_when_a_longer_version_arrives_reads_the_older_one_whole(held):
    """Attack 15 F1 (two mounts' ``sed -i`` committed a version cut at the older size): a
    reader in C opened version 1; C's sidecar applies A's longer version 2 and its kernel,
    not told yet, still holds version 1's size. The reader's reads reach the sidecar (no
    page cached) and the kernel cuts what they return at that size: served version 2 (on
    main), it got version 2 without its last bytes, content no one wrote. It is served the
    version whose size the kernel holds, whole, until the kernel is told."""
    cp, a, c = held
    name = f"size-{uuid.uuid4().hex[:6]}.log"
    pc = c.mountpoint / "s" / name
    v1 = _v1_sized_in_cs_kernel(a, c, name)
    with open(pc, "rb", buffering=0) as f:
        try:
            v2 = _longer_v2_held_from_cs_kernel(a, c, name, v1)
            got = f.read()
        finally:
            c.hold_file.unlink(missing_ok=True)
    assert got == v1.encode(), (got[-30:], len(got), len(v1), len(v2))
    wait_until(lambda: read(pc) == v2, timeout=15, what="version 2 read in C once told")


def test_sed_on_a_longer_version_the_kernel_was_not_told_of_keeps_the_last_line(held):
    """Attack 15 F1: ``sed -i`` in C while C's kernel holds version 1's size and C's sidecar
    version 2 (A's longer first line): on main its reads were served version 2 cut at
    version 1's size, and the merge of its rewrite (based on version 1, what the kernel
    showed) committed a version with the last line cut. It reads version 1 whole: its edit
    is merged onto version 2, every line kept."""
    cp, a, c = held
    name = f"sed-size-{uuid.uuid4().hex[:6]}.log"
    v1 = _v1_sized_in_cs_kernel(a, c, name)
    try:
        v2 = _longer_v2_held_from_cs_kernel(a, c, name, v1)
        sh(f"sed -i 's/^line 3 .*/line 3 C/' {name}", c.mountpoint / "s")
    finally:
        c.hold_file.unlink(missing_ok=True)
    wait_until(lambda: _depth(a) == 0 and _depth(c) == 0, timeout=60, what="both outboxes drained")
    cur = live_records(cp, "s")[name].content
    want = "\n".join("line 3 C" if ln.startswith("line 3 ") else ln for ln in v2.split("\n"))
    assert cur == want, cur[-60:]


def test_a_listing_that_tells_the_kernel_a_shorter_version_s_size_serves_that_version(held):
    """The other way round (attack 15 F1): while C's invalidations are held, ``ls -l`` in C
    sends the kernel the attributes of A's shorter version 2 (readdirplus): the kernel now
    cuts reads at version 2's size, so a reader there is served version 2, not version 1
    (which it would get cut at that size: bytes no one wrote)."""
    cp, a, c = held
    name = f"ls-{uuid.uuid4().hex[:6]}.log"
    pc = c.mountpoint / "s" / name
    v1 = _v1_sized_in_cs_kernel(a, c, name)
    v2 = v1.replace("line 1 ", "l1 ")
    c.hold_file.write_text("")
    try:
        sh(f"sed -i 's/^line 1 /l1 /' {name}", a.mountpoint / "s")
        _shown(pc, v2)
        listed = [ln for ln in sh("ls -l", c.mountpoint / "s").stdout.splitlines()
                  if ln.endswith(" " + name)]
        assert len(listed) == 1 and f" {len(v2)} " in listed[0], listed
        got = pc.read_bytes()
    finally:
        c.hold_file.unlink(missing_ok=True)
    assert got == v2.encode(), (got[-30:], len(got), len(v1), len(v2))


def test_sed_after_an_outage_on_a_mount_with_queued_own_appends_keeps_the_other_mounts_lines(tmp_path):
    """Attack report 12, A9 (atk12/t_chaos.py): while the control plane is down, mount B
    appends lines (its first one is retried at the head of its outbox, the next ones queue)
    and rewrites the first line with ``sed -i``: its queued appends and the rename-over
    coalesce into one put. Mount A appends too. When the control plane is back, B's first
    append lands, then a line of A (B's outbox is held after that write), then B's put:
    written on B's first append, it meets A's lines after it, so the three-way merge sees
    two additions at the end of the file (A's, and B's own queued lines), which is what two
    appenders make, never a conflict. Every acknowledged line of both mounts is kept, with
    B's edit, and no conflict is reported. (On main: last writer wins, A's lines are
    dropped, a conflict line on B only.)"""
    cp = ControlPlane(tmp_path).start()
    a = b = None
    try:
        ta = cp.setup_workspace("wa", ("s",))
        tb = cp.setup_workspace("wb", ("s",))
        a = Sidecar(cp, "wa", ta, tmp_path / "ma", tmp_path / "ca").start(expect="s")
        b = HeldSidecar(cp, "wb", tb, tmp_path / "mb", tmp_path / "cb",
                        hold_file=tmp_path / "hold").start(expect="s")
        name = "J.log"
        v1 = "counter=0\n" + "".join(f"base {i:02d} {'b' * 88}\n" for i in range(12))
        _, pb = written_and_seen(a, b, "s", name, v1, timeout=15)
        cp.stop()  # the outage: every close below is accepted into its mount's journal
        sh(f"timeout 60 sh -c 'echo B-1 >> {name}'", b.mountpoint / "s")
        sh(f"timeout 60 sh -c 'echo A-1 >> {name}'", a.mountpoint / "s")
        sh(f"timeout 60 sh -c 'echo B-2 >> {name}'", b.mountpoint / "s")
        sh(f"timeout 60 sed -i s/^counter=.*/counter=1/ {name}", b.mountpoint / "s")
        sh(f"timeout 60 sh -c 'echo A-2 >> {name}'", a.mountpoint / "s")
        assert read(pb) == v1.replace("counter=0", "counter=1") + "B-1\nB-2\n"
        b.write_file.write_text("")  # B's outbox waits after its first write lands
        b.feed_file.write_text("")  # (and B's feed applies nothing meanwhile, as in the run)
        try:
            cp.start()
            wait_until(lambda: _depth(a) == 0 and "B-1\n" in live_records(cp, "s")[name].content,
                       timeout=60, what="A's queue and B's first append landed")
            sh(f"timeout 60 sh -c 'echo A-3 >> {name}'", a.mountpoint / "s")  # after B-1
            assert live_records(cp, "s")[name].content.endswith("A-3\n")
        finally:
            b.write_file.unlink(missing_ok=True)
            b.feed_file.unlink(missing_ok=True)
        cur = _settled(cp, a, b, name)
        conflicts = [e for e in errors_log(a.mountpoint) + errors_log(b.mountpoint) if e.get("conflict")]
        lines = cur.splitlines()
        missing = [w for w in ("A-1", "A-2", "A-3", "B-1", "B-2") if w not in lines]
        assert not missing, f"acknowledged lines lost: {missing} (conflicts reported: {conflicts})"
        assert lines[0] == "counter=1" and lines[-2:] == ["A-3", "B-2"], cur
        assert cur.startswith(v1.replace("counter=0", "counter=1")), cur
        assert not conflicts, conflicts
    finally:
        for sc in (b, a):
            if sc is not None:
                sc.stop()
        cp.stop()
