"""A lost outbox journal is never silent (docs/SEMANTICS.md "What an accepted write
survives"). With the control plane down, writes close with 0 (accepted into ``outbox.db``);
the sidecar stops; ``outbox.db`` is deleted, emptied, its write-ahead log cut, or corrupted
(or deleted with its witness: then nothing names the writes and the start says so).
At the next start the sidecar requeues every accepted write whose content the blob cache
still holds (the witness ``accepted.log``, kept apart from the journal, names them), moves a
corrupt journal aside (kept) instead of crash-looping, and names every write it cannot
recover in the log, ``errors.log`` and ``status.json``. Real ``memfuse serve`` and
``memfuse mount`` processes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mountutil import ControlPlane, Sidecar, live_records, read, sh, wait_until

pytestmark = pytest.mark.mount

N = 12


def _status(sc: Sidecar) -> dict:
    return json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())


def _damage(cache: Path, how: str) -> None:
    db = cache / "outbox.db"
    if how == "with_witness":  # a double fault: the journal and its witness both deleted
        (cache / "accepted.log").unlink()
        how = "deleted"
    if how in ("deleted", "all_gone"):
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        if how == "all_gone":
            for suffix in ("", "-wal", "-shm"):
                Path(f"{cache / 'blobs.db'}{suffix}").unlink(missing_ok=True)
    elif how == "emptied":
        os.truncate(db, 0)
        for suffix in ("-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
    elif how == "wal_cut":
        wal = Path(f"{db}-wal")
        if wal.exists():
            os.truncate(wal, 0)
        # and what a checkpoint had moved into the main file is gone too: an older copy
        os.truncate(db, 0)
    elif how == "corrupt":
        with open(db, "r+b") as f:
            f.write(b"\xde\xad\xbe\xef" * 256)
    else:
        raise AssertionError(how)


@pytest.mark.expect_sidecar_errors("a corrupt journal and unrecoverable writes are logged as errors")
@pytest.mark.parametrize("how", ["deleted", "emptied", "wal_cut", "corrupt", "all_gone", "with_witness"])
def test_accepted_writes_survive_a_lost_journal_or_are_named(tmp_path, how):
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("s",))
        sc = Sidecar(cp, "ws", tok, tmp_path / "mnt", tmp_path / "cache", "--drain-timeout", "1",
                     "--start-timeout", "5").start(expect="s")
        m = sc.mountpoint / "s"
        sh("echo base > base.md", m)
        wait_until(lambda: "base.md" in live_records(cp, "s"), timeout=10, what="base committed")
        cp.stop()  # an outage: the writes below are accepted, not committed
        for i in range(N):
            sh(f"echo 'during the outage {i}' > f{i:02d}.md", m, timeout=30)
        sh("echo more >> base.md", m, timeout=30)
        assert _status(sc)["outbox"]["depth"] >= N + 1
        if how == "wal_cut":
            sc.kill9()  # the journal's last batches may still be in its write-ahead log
        else:
            sc.stop()
        sc.proc = None
        _damage(sc.cache_dir, how)
        cp.start()
        sc.start(expect="s")
        want = {f"f{i:02d}.md": f"during the outage {i}\n" for i in range(N)}
        want["base.md"] = "base\nmore\n"
        st = _status(sc)
        if how == "all_gone":
            # nothing to recover the content from: every accepted write is named
            lost = st["cache"]["journal_lost"]
            assert sorted(x["path"] for x in lost) == sorted(want), lost
            errors = [json.loads(ln) for ln in (sc.mountpoint / ".memfuse" / "errors.log").read_text().splitlines()]
            named = {e["path"] for e in errors if e.get("code") == "journal_lost"}
            assert named == set(want), errors
            lines = [json.loads(ln) for ln in sc.log.read_text().splitlines() if ln.startswith("{")]
            lost_lines = [x for x in lines if "lost with the outbox journal" in x.get("msg", "")]
            assert len(lost_lines) == 1 and lost_lines[0]["lost"] == len(want), lost_lines
            assert all(f"s/{p}" in lost_lines[0]["writes"] for p in want), lost_lines
            assert st["cache"]["journal_missing"] is None  # the witness named each one
            return
        if how == "with_witness":
            # nothing on disk names what was lost: the start says so, loudly, once
            assert "may be lost" in st["cache"]["journal_missing"], st["cache"]
            assert st["cache"]["journal_lost"] == [] and st["cache"]["journal_recovered"] == 0
            errors = [json.loads(ln) for ln in (sc.mountpoint / ".memfuse" / "errors.log").read_text().splitlines()]
            (line,) = [e for e in errors if e.get("code") == "journal_missing"]
            assert line["errno"] == "EIO" and "accepted.log" in line["reason"], line
            lines = [json.loads(ln) for ln in sc.log.read_text().splitlines() if ln.startswith("{")]
            gone = [x for x in lines if "journal and witness both gone" in x.get("msg", "")]
            assert len(gone) == 1 and gone[0]["level"] == "error", gone
            # the mount shows what the control plane holds (the writes are lost)
            assert read(m / "base.md") == "base\n" and read(m / "f00.md") is None
            sc.stop()
            sc.start(expect="s")  # said once: the next start has a journal again
            assert _status(sc)["cache"]["journal_missing"] is None
            return
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=60, what="outbox drained")
        recs = live_records(cp, "s")
        assert {p: r.content for p, r in recs.items()} == want
        assert all(read(m / p) == c for p, c in want.items())
        assert st["cache"]["journal_lost"] == [] and st["cache"]["journal_missing"] is None
        assert st["cache"]["journal_recovered"] >= (1 if how == "wal_cut" else N + 1)
        if how == "corrupt":
            aside = Path(st["cache"]["journal_moved_aside"])
            assert aside.exists() and aside.name.startswith("outbox.db.corrupt-")
            assert "the outbox journal is unreadable; moved aside" in sc.log.read_text()
        # the versions: each write applied once (the base record: created, appended)
        base = recs["base.md"]
        assert [v.version for v in cp.call("versions", "s", base.id)] == [1, 2]
    finally:
        if sc is not None and sc.proc is not None:
            sc.stop()
        cp.stop()


@pytest.mark.expect_sidecar_errors("a lost journal and a damaged witness are logged as errors")
def test_a_damaged_witness_is_neither_fatal_nor_silent(tmp_path):
    """attack17 F5: the journal deleted and its witness damaged (one accepted entry's line of
    another shape, another cut short after its path: a crash of the machine, an edit). The
    start used to exit (``int("x")``) on the first and forget the second silently. Now the
    sidecar starts, recovers every readable write, names the cut one (``journal_lost``, its
    path) and says that writes may be lost (``journal_missing``: a line could not be read)."""
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("s",))
        sc = Sidecar(cp, "ws", tok, tmp_path / "mnt", tmp_path / "cache", "--drain-timeout", "1",
                     "--start-timeout", "5").start(expect="s")
        m = sc.mountpoint / "s"
        sh("echo base > base.md", m)
        wait_until(lambda: "base.md" in live_records(cp, "s"), timeout=10, what="base committed")
        cp.stop()
        for i in range(6):
            sh(f"echo 'during the outage {i}' > f{i:02d}.md", m, timeout=30)
        sc.stop()
        sc.proc = None
        _damage(sc.cache_dir, "deleted")
        wit = sc.cache_dir / "accepted.log"
        lines = wit.read_text().splitlines()
        (bad,) = [i for i, ln in enumerate(lines) if '"path":"f02.md"' in ln]
        (cut,) = [i for i, ln in enumerate(lines) if '"path":"f04.md"' in ln]
        lines[bad] = '{"i":"x","k":null,"s":5}'
        lines[cut] = lines[cut][:lines[cut].index('"path":"f04.md"') + len('"path":"f04.md"')]
        wit.write_text("\n".join(lines) + "\n")
        cp.start()
        sc.start(expect="s")
        st = _status(sc)
        assert "could not be read" in (st["cache"]["journal_missing"] or ""), st["cache"]
        assert [x["path"] for x in st["cache"]["journal_lost"]] == ["f04.md"], st["cache"]
        errors = [json.loads(ln) for ln in (sc.mountpoint / ".memfuse" / "errors.log").read_text().splitlines()]
        lost = [e for e in errors if e.get("code") == "journal_lost"]
        assert [e["path"] for e in lost] == ["f04.md"] and "damaged" in lost[0]["reason"], errors
        assert [e for e in errors if e.get("code") == "journal_missing"], errors
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=60, what="outbox drained")
        recs = live_records(cp, "s")
        assert sorted(recs) == ["base.md", "f00.md", "f01.md", "f03.md", "f05.md"], sorted(recs)
    finally:
        if sc is not None and sc.proc is not None:
            sc.stop()
        cp.stop()
