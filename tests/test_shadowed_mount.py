"""Records made elsewhere whose path local state holds on this mount (docs/SEMANTICS.md,
"Remote changes and local state"), with two real sidecars on one store of a real
``memfuse serve`` (attack 13, F16 and F5):

- a record made elsewhere under the name of a local-only file of mount A (``lo~/inner.md``
  while A has ``lo~``), at the name of one (``x.md~``), under the name of a rejected file, or
  as a file at the path of an empty directory made on A: A keeps its local state (it was
  there first), says so once in ``errors.log`` (paths and ids, never content) and in a
  WARNING, and shows the record as soon as that local state goes (``rm``, ``mv`` away,
  ``rmdir``), without a restart;
- a store deleted and made again under the same name shows none of the old store's
  empty directories.
"""
from __future__ import annotations

import json
import os
import uuid

import pytest

from mountcheck import errors_log, write_file, xattr
from mountutil import drained, live_records, read, sh, two_sidecars, wait_until

pytestmark = pytest.mark.mount

OK = {"open": None, "write": None, "close": None}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("shadow"), "s") as cp_a_b:
        yield cp_a_b


def _lines(sc, path: str) -> list[dict]:
    """A's ``errors.log`` lines about local ``path``."""
    return [e for e in errors_log(sc.mountpoint) if e.get("path") == path]


def _warnings(sc, msg: str) -> list[dict]:
    return [ln for ln in map(json.loads, (x for x in sc.log.read_text().splitlines()
                                          if x.startswith("{")))
            if ln.get("msg") == msg]


def test_a_record_under_a_local_only_file_shows_once_the_file_is_removed(pair):
    cp, a, b = pair
    lo = f"lo{uuid.uuid4().hex[:6]}~"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"echo 'my local backup' > {lo}", pa)
    assert xattr(pa / lo, "state") == "local"
    # B makes a directory of that name (on B it is a directory, not a local-only file)
    sh(f"mkdir {lo} && echo remote > {lo}/inner.md", pb)
    drained(b)
    assert live_records(cp, "s")[f"{lo}/inner.md"].content == "remote\n"
    wait_until(lambda: _lines(a, lo), timeout=20, what="A says the record is hidden")
    [line] = _lines(a, lo)
    assert line.get("shadowed") is True and line["record_path"] == f"{lo}/inner.md", line
    assert "local-only file" in line["reason"] and "remote" not in json.dumps(
        {k: v for k, v in line.items() if k != "reason"}), line
    assert (pa / lo).read_text() == "my local backup\n"  # the local file stays: it was first
    warned = _warnings(a, "shadowed: a record made elsewhere is hidden by local state here")
    assert [w["record_path"] for w in warned if w["path"] == lo] == [f"{lo}/inner.md"]
    assert all("remote\n" not in json.dumps(w) for w in warned)  # never content
    # changed elsewhere while hidden: not said again; its newest version is shown later
    sh(f"echo more >> {lo}/inner.md", pb)
    drained(b)
    wait_until(lambda: live_records(cp, "s")[f"{lo}/inner.md"].content == "remote\nmore\n",
               timeout=20, what="B's append committed")
    sh(f"rm {lo}", pa)
    wait_until(lambda: read(pa / lo / "inner.md") == "remote\nmore\n", timeout=20,
               what="A shows the record's newest version once its local file is gone")
    assert xattr(pa / lo / "inner.md", "state") == "clean"
    assert len(_lines(a, lo)) == 1  # said once


def test_a_record_at_the_name_of_a_local_only_file_shows_once_it_is_renamed_away(pair):
    cp, a, b = pair
    name = f"ls{uuid.uuid4().hex[:6]}.md~"
    pa = a.mountpoint / "s"
    sh(f"echo 'my local backup' > {name}", pa)
    cp.call("create_record", "s", name, "remote content\n")  # the API takes any name
    wait_until(lambda: _lines(a, name), timeout=20, what="A says the record is hidden")
    [line] = _lines(a, name)
    assert line.get("shadowed") is True and line["record_path"] == name, line
    assert (pa / name).read_text() == "my local backup\n"
    assert xattr(pa / name, "state") == "local"
    sh(f"mv {name} {name[:-1]}.bak~", pa)
    wait_until(lambda: read(pa / name) == "remote content\n", timeout=20,
               what="A shows the record once its local file moved away")
    assert (pa / f"{name[:-1]}.bak~").read_text() == "my local backup\n"
    assert xattr(pa / name, "state") == "clean"


def test_a_record_under_a_rejected_file_shows_once_the_file_is_removed(pair):
    cp, a, b = pair
    rj = f"rj{uuid.uuid4().hex[:6]}"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    # refused for good at close (not UTF-8): kept on A, no record
    assert write_file(pa / rj, b"caf\xc3") == {"open": None, "write": None, "close": "EILSEQ"}
    assert xattr(pa / rj, "state") == "rejected"
    sh(f"mkdir {rj} && echo remote > {rj}/inner.md", pb)
    drained(b)
    assert live_records(cp, "s")[f"{rj}/inner.md"].content == "remote\n"

    def kept() -> list[dict]:
        return [e for e in _lines(a, rj) if e.get("kept")]
    wait_until(kept, timeout=20, what="A says the record is hidden by its rejected file")
    [line] = kept()
    assert f"{rj}/inner.md" in line["reason"] and line["code"] == "invalid_content", line
    assert (pa / rj).read_bytes() == b"caf\xc3"
    sh(f"rm {rj}", pa)
    wait_until(lambda: read(pa / rj / "inner.md") == "remote\n", timeout=20,
               what="A shows the record once its rejected file is gone")


def test_a_file_at_the_path_of_an_empty_directory_made_here_shows_after_rmdir(pair):
    cp, a, b = pair
    ed = f"ed{uuid.uuid4().hex[:6]}"
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"mkdir {ed}", pa)  # local to A: B sees no directory there
    assert write_file(pb / ed, b"remote file\n") == OK
    drained(b)
    wait_until(lambda: _lines(a, ed), timeout=20, what="A says the record is hidden")
    [line] = _lines(a, ed)
    assert line.get("shadowed") is True and "directory made here" in line["reason"], line
    assert os.path.isdir(pa / ed)
    sh(f"rmdir {ed}", pa)
    wait_until(lambda: read(pa / ed) == "remote file\n", timeout=20,
               what="A shows the file once its empty directory is gone")


def test_a_store_made_again_under_the_same_name_has_no_old_directories(pair):
    cp, a, b = pair
    slug = f"ghost{uuid.uuid4().hex[:6]}"
    cp.call("create_store", slug)
    cp.call("attach", "wa", slug, access="read_write")
    root = a.mountpoint / slug
    wait_until(lambda: root.is_dir(), timeout=20, what="A mounts the store")
    sh("mkdir -p d/e empty && echo old > d/b.md", root)
    drained(a)
    cp.delete_store(slug)
    wait_until(lambda: not root.exists(), timeout=30, what="A drops the deleted store")
    cp.call("create_store", slug)
    cp.call("attach", "wa", slug, access="read_write")
    wait_until(lambda: root.is_dir(), timeout=30, what="A mounts the new store")
    drained(a)
    assert sorted(os.listdir(root)) == [], "directories of the deleted store came back"


def test_a_record_moved_elsewhere_onto_local_state_stays_at_its_old_path_until_it_goes(pair):
    """A record moved elsewhere onto the path of an empty directory made on A, or of a
    local-only file of A: A keeps its local entry (a local-only file is never replaced by
    the record: it has no other copy), shows the record at its old path meanwhile, says so
    once, and moves it once the local entry goes."""
    cp, a, b = pair
    t = uuid.uuid4().hex[:6]
    pa, pb = a.mountpoint / "s", b.mountpoint / "s"
    sh(f"echo one > one{t}.md && echo two > two{t}.md", pb)
    drained(b)
    wait_until(lambda: read(pa / f"two{t}.md") == "two\n", timeout=20, what="A shows both")
    sh(f"mkdir tgt{t} && echo 'mine only' > bak{t}~", pa)
    sh(f"mv one{t}.md tgt{t}", pb)  # onto A's empty directory
    ids = {p: r.id for p, r in live_records(cp, "s").items()}
    cp.call("move_record", "s", ids[f"two{t}.md"], f"bak{t}~")  # onto A's local-only file
    drained(b)
    wait_until(lambda: _lines(a, f"tgt{t}") and _lines(a, f"bak{t}~"), timeout=20,
               what="A says both moves wait")
    [line] = _lines(a, f"bak{t}~")
    assert line.get("shadowed") is True and line.get("shown_at") == f"two{t}.md", line
    assert (pa / f"bak{t}~").read_text() == "mine only\n"  # never replaced by the record
    assert xattr(pa / f"bak{t}~", "state") == "local"
    assert read(pa / f"one{t}.md") == "one\n" and read(pa / f"two{t}.md") == "two\n"
    assert os.path.isdir(pa / f"tgt{t}")
    sh(f"rmdir tgt{t} && rm bak{t}~", pa)
    wait_until(lambda: read(pa / f"tgt{t}") == "one\n" and read(pa / f"bak{t}~") == "two\n",
               timeout=20, what="A shows both records at their new paths")
    assert not (pa / f"one{t}.md").exists() and not (pa / f"two{t}.md").exists()
