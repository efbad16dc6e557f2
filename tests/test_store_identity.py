"""A store deleted and made again under the same slug is another store (docs/SEMANTICS.md,
"Store lifecycle"; attack 16 F7 and F5), with real sidecars on one real ``memfuse serve``:

- F7: mounts that had read the deleted store's files show none of them once the new store
  is attached (not after a restart either), and a write to such a file never brings the
  old content into the new store;
- F5: writes queued for the deleted store (the control plane refused the token meanwhile)
  are never committed into the new store: each is refused and named in ``errors.log``;
  so are those a previous process left in the journal (no mount: the committer alone);
  and so is one already on its way when the store is deleted and made again (held by a
  proxy between the sidecar's check and the control plane): the control plane refuses it
  (``Memfuse-Store-Created``, 412 ``store_replaced``).
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import threading
import time
import uuid

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
import trio

from memfuse.sidecar.committer import STORE_CREATED, Committer
from memfuse.sidecar.journal import DELETE, PUT, Journal
from mountcheck import errors_log
from mountutil import Rig, drained, live_records, read, sh, sidecar_status, wait_until


def _remake(cp, slug: str, ws: str = "ws") -> None:
    """Delete the store and make it again under its slug, attached again, at once (no wait
    between: the sidecars may see only the end state)."""
    cp.delete_store(slug)
    cp.call("create_store", slug)
    cp.call("attach", ws, slug, access="read_write")


def _sidecar_with_own_token(rig, tmp_path, prefix: str, *extra: str):
    """Sidecar C of workspace ``ws`` on a token file of its own (re-read every second, so a
    test can make the control plane refuse it), and a new store ``<prefix><4 hex>`` attached
    read-write and mounted: ``(c, token file, slug, the store's directory)``."""
    tok = rig.workspace("ws")
    ctok = tmp_path / "c.token"
    shutil.copy(tok, ctok)
    os.chmod(ctok, 0o600)
    c = rig.sidecar("ws", "--token-check-interval", "1", *extra, token=ctok,
                    mountpoint=tmp_path / "mc", cache_dir=tmp_path / "cc")
    slug = f"{prefix}{uuid.uuid4().hex[:4]}"
    rig.cp.call("create_store", slug)
    rig.cp.call("attach", "ws", slug, access="read_write")
    root = c.mountpoint / slug
    wait_until(lambda: root.is_dir(), timeout=30, what="C mounts the store")
    return c, ctok, slug, root


def _refuse_token(ctok) -> str:
    """Put an unknown token in ``ctok`` (an authentication outage) and wait until the
    sidecar took it up; returns the good token, to be written back."""
    good = ctok.read_text()
    ctok.write_text("mf_" + "0" * 40 + "\n")
    time.sleep(3)  # taken up within --token-check-interval (1 s)
    return good


def _listing(root) -> list[str] | None:
    try:
        return sorted(os.listdir(root))
    except OSError:
        return None


@pytest.mark.mount
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


@pytest.mark.mount
def test_writes_queued_for_a_deleted_store_are_refused_not_sent_to_the_new_one(tmp_path):
    with Rig(tmp_path) as rig:
        c, ctok, slug, root = _sidecar_with_own_token(rig, tmp_path, "tmpx")
        cp = rig.cp
        sh("echo before > before.md", root)
        drained(c)
        good = _refuse_token(ctok)
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


class _HoldProxy:
    """A TCP proxy in front of the control plane that, while ``hold`` is set, holds every
    write request (not a GET) whose path starts with ``hold``, with the rest of its
    connection, until ``release`` (60 s at most); ``held`` counts those held. Threads;
    ``close`` stops everything."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.hold: bytes | None = None
        self.held = 0
        self.released = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                return
            server.settimeout(None)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(65536):
                if up and self.hold is not None:
                    method, _, rest = data.partition(b" ")
                    if method in (b"POST", b"PUT", b"PATCH", b"DELETE") and rest.startswith(self.hold):
                        with self._lock:
                            self.held += 1
                        self.released.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.released.set()
        self.listener.close()
        with self._lock:
            for s in self._socks:
                s.close()


@pytest.mark.mount
def test_a_write_on_its_way_when_its_store_is_made_again_is_refused_by_the_control_plane(tmp_path):
    """The window the sidecar's own check leaves (attack 16 F5, ghost16's leftover): a write
    checked against the store's identity and sent, held by a proxy while the store is
    deleted and made again, then let through. The control plane refuses it (the store it
    names is gone: 412 ``store_replaced``), nothing lands in the new store, the write is
    named in ``errors.log`` (``ESTALE``), and so is the write queued behind it (refused
    without being sent)."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        proxy = _HoldProxy(int(cp.url.rsplit(":", 1)[1]))
        rig.defer(proxy.close)
        rig.workspace("ws")
        c = rig.sidecar("ws", "--commit-wait", "0.5", via=proxy, mountpoint=tmp_path / "mc",
                        cache_dir=tmp_path / "cc")
        slug = f"tmph{uuid.uuid4().hex[:4]}"
        cp.call("create_store", slug)
        cp.call("attach", "ws", slug, access="read_write")
        root = c.mountpoint / slug
        wait_until(lambda: root.is_dir(), timeout=30, what="C mounts the store")
        sh("echo before > before.md", root)
        drained(c)
        proxy.hold = f"/v1/stores/{slug}/".encode()
        sh("echo held > held.md", root)  # close returns after --commit-wait: pending
        wait_until(lambda: proxy.held >= 1, timeout=30, what="the write reaches the proxy")
        sh("echo behind >> before.md", root)  # queued behind the held write
        _remake(cp, slug)
        proxy.hold = None
        proxy.released.set()
        wait_until(lambda: sidecar_status(c)["outbox"]["depth"] == 0, timeout=60,
                   what="C's outbox finished")
        assert live_records(cp, slug) == {}, "a write of the deleted store landed in the new one"
        refused = {e.get("path"): e for e in errors_log(c.mountpoint) if e.get("code") == "store_replaced"}
        assert {"held.md", "before.md"} <= set(refused), errors_log(c.mountpoint)
        wait_until(lambda: _listing(root) == [], timeout=30, what="C shows the new, empty store")
        sh("echo fresh > fresh.md", root)
        drained(c)
        assert {p: r.content for p, r in live_records(cp, slug).items()} == {"fresh.md": "fresh\n"}


@pytest.mark.mount
def test_writes_of_a_deleted_store_replayed_at_a_start_never_show_in_the_new_one(tmp_path):
    """A sidecar stopped with writes queued for a store that is then deleted and made again
    under its slug starts on the same cache directory: its journal's writes of the deleted
    store are shown at the start (replayed), then refused (``store_replaced``) and must leave
    the new store's tree, not stay as rejected files showing the deleted store's content.
    This is also the path of attack 16 F9, where the cache directory was another account's
    workspace of the same name: its private file showed in the other account's mount."""
    with Rig(tmp_path) as rig:
        c, ctok, slug, root = _sidecar_with_own_token(rig, tmp_path, "tmpr", "--drain-timeout", "1")
        cp = rig.cp
        good = _refuse_token(ctok)
        sh("echo PRIVATE > secret-plan.md", root, timeout=60)
        assert sidecar_status(c)["outbox"]["depth"] >= 1
        c.stop()  # the write stays in the journal (its drain cannot commit it)
        _remake(cp, slug)
        ctok.write_text(good)
        c.expect = slug
        c.start()
        wait_until(lambda: sidecar_status(c)["outbox"]["depth"] == 0, timeout=60,
                   what="C's outbox finished")
        assert live_records(cp, slug) == {}, "a write of the deleted store landed in the new one"
        wait_until(lambda: _listing(root) == [], timeout=30,
                   what="C shows the new, empty store (not the deleted store's file)")
        assert read(root / "secret-plan.md") is None
        refused = {e.get("path") for e in errors_log(c.mountpoint) if e.get("code") == "store_replaced"}
        assert "secret-plan.md" in refused, errors_log(c.mountpoint)


class _StoreOnly:
    """A client stand-in that answers only ``get_store`` (the store under the slug now: made
    at ``created``); any send fails the test."""

    def __init__(self, created: datetime) -> None:
        self.created, self.asked = created, 0

    async def get_store(self, slug: str) -> SimpleNamespace:
        self.asked += 1
        return SimpleNamespace(slug=slug, created_at=self.created)

    def __getattr__(self, name):
        raise AssertionError(f"sent to the control plane: {name}")


async def test_the_outbox_never_sends_a_replayed_write_of_a_deleted_store(tmp_path):
    """Entries a previous process left (stamped with the store they were written in) are
    refused, never sent, once the control plane names another store under their slug."""
    old = datetime(2026, 1, 1, tzinfo=timezone.utc)
    j = Journal(tmp_path / "outbox.db")
    c1 = Committer(_StoreOnly(old), j, {}, store_created=lambda slug: old.isoformat())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(j.run)
        left = [c1.submit("s", PUT, "n:1", {"path": "a.md"}, b"purge me"),
                c1.submit("s", DELETE, "n:2", {"path": "b.md"})]
        with trio.fail_after(10):
            for e in left:
                await e.durable.wait()
        nursery.cancel_scope.cancel()
    j.close()
    j2 = Journal(tmp_path / "outbox.db")
    entries, _ = j2.load()
    assert [e.args.get(STORE_CREATED) for e in entries] == [old.isoformat()] * 2  # kept
    client = _StoreOnly(datetime(2026, 2, 1, tzinfo=timezone.utc))  # made again since
    c2 = Committer(client, j2, {})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(j2.run)
        await nursery.start(c2.run)
        c2.replay(entries)
        with trio.fail_after(10):
            await c2.wait_idle()
        nursery.cancel_scope.cancel()
    assert client.asked == 1
    assert [(e.errno, e.code) for e in entries] == [(errno.ESTALE, "store_replaced")] * 2
    assert c2.refused == 2 and c2.committed == 0
    j2.close()
