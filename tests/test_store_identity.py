"""A store deleted and made again under the same slug is another store (docs/SEMANTICS.md,
"Store lifecycle"; attack 16 F7 and F5), with real sidecars on one real ``memfuse serve``:

- F7: mounts that had read the deleted store's files show none of them once the new store
  is attached (not after a restart either), and a write to such a file never brings the
  old content into the new store;
- F5: writes queued for the deleted store (the control plane refused the token meanwhile)
  are never committed into the new store: each is refused and named in ``errors.log``.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
import uuid

import httpx
import pytest

from mountcheck import errors_log
from mountutil import Rig, drained, live_records, read, sh, sidecar_status, wait_until

pytestmark = pytest.mark.mount


def _delete_store(cp, slug: str) -> None:
    r = httpx.delete(f"{cp.url}/v1/memory_stores/memstore_{slug}",
                     headers={"Authorization": f"Bearer {cp.admin_token}"}, timeout=30)
    assert r.status_code in (200, 204), r.text


def _remake(cp, slug: str, ws: str = "ws") -> None:
    """Delete the store and make it again under its slug, attached again, at once (no wait
    between: the sidecars may see only the end state)."""
    _delete_store(cp, slug)
    cp.call("create_store", slug)
    cp.call("attach", ws, slug, access="read_write")


def _listing(root) -> list[str] | None:
    try:
        return sorted(os.listdir(root))
    except OSError:
        return None


def test_readers_of_a_deleted_store_show_none_of_its_files_once_it_is_made_again(tmp_path):
    with Rig(tmp_path) as rig:
        a = rig.sidecar("ws", mountpoint=tmp_path / "ma", cache_dir=tmp_path / "ca")
        b = rig.sidecar("ws", mountpoint=tmp_path / "mb", cache_dir=tmp_path / "cb")
        cp = rig.cp
        slug = f"tmpz{uuid.uuid4().hex[:4]}"
        cp.call("create_store", slug)
        cp.call("attach", "ws", slug, access="read_write")
        ra, rb = a.mountpoint / slug, b.mountpoint / slug
        wait_until(lambda: ra.is_dir() and rb.is_dir(), timeout=30, what="both mount the store")
        sh("echo zcontent > z.md && mkdir -p d && echo deep > d/y.md", ra)
        drained(a)
        wait_until(lambda: read(rb / "z.md") == "zcontent\n" and read(rb / "d" / "y.md") == "deep\n",
                   timeout=30, what="B read the files")
        # B sees only the end state (the attach of the new store): frozen meanwhile, as a
        # sidecar whose events come late (a loaded machine, a slow link)
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            _remake(cp, slug)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        for sc in (a, b):
            wait_until(lambda: _listing(sc.mountpoint / slug) == [], timeout=30,
                       what=f"{sc.mountpoint.name} shows the new, empty store")
        assert read(rb / "z.md") is None
        # a write at the old path makes a new file: the old content never comes back
        sh("echo B-append >> z.md", rb)
        drained(b)
        assert {p: r.content for p, r in live_records(cp, slug).items()} == {"z.md": "B-append\n"}
        b.expect = slug
        b.restart()
        wait_until(lambda: _listing(rb) == ["z.md"], timeout=30, what="B restarted")
        assert read(rb / "z.md") == "B-append\n"
        [st] = [s for s in sidecar_status(b)["stores"] if s["slug"] == slug]
        assert st["records"] == 1, st


def test_writes_queued_for_a_deleted_store_are_refused_not_sent_to_the_new_one(tmp_path):
    with Rig(tmp_path) as rig:
        tok = rig.workspace("ws")
        ctok = tmp_path / "c.token"
        shutil.copy(tok, ctok)
        os.chmod(ctok, 0o600)
        c = rig.sidecar("ws", "--token-check-interval", "1", token=ctok,
                        mountpoint=tmp_path / "mc", cache_dir=tmp_path / "cc")
        cp = rig.cp
        slug = f"tmpx{uuid.uuid4().hex[:4]}"
        cp.call("create_store", slug)
        cp.call("attach", "ws", slug, access="read_write")
        root = c.mountpoint / slug
        wait_until(lambda: root.is_dir(), timeout=30, what="C mounts the store")
        sh("echo before > before.md", root)
        drained(c)
        good = ctok.read_text()
        ctok.write_text("mf_" + "0" * 40 + "\n")  # an unknown token: an authentication outage
        time.sleep(3)  # taken up within --token-check-interval (1 s)
        sh("echo queued1 > q1.md && echo q2 >> before.md && echo n0 > new0.md", root, timeout=60)
        assert sidecar_status(c)["outbox"]["depth"] >= 1
        _remake(cp, slug)
        ctok.write_text(good)
        wait_until(lambda: sidecar_status(c)["outbox"]["depth"] == 0, timeout=60,
                   what="C's outbox finished")
        assert live_records(cp, slug) == {}, "writes of the deleted store landed in the new one"
        wait_until(lambda: _listing(root) == [], timeout=30, what="C shows the new, empty store")
        refused = {e.get("path") for e in errors_log(c.mountpoint) if e.get("code") == "store_replaced"}
        assert {"q1.md", "before.md", "new0.md"} <= refused, errors_log(c.mountpoint)
        # the new store works as usual from C
        sh("echo fresh > fresh.md", root)
        drained(c)
        assert {p: r.content for p, r in live_records(cp, slug).items()} == {"fresh.md": "fresh\n"}
