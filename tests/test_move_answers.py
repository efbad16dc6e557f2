"""Commit answers that carry a change made elsewhere (attack finding 4): a put answered at
the path another writer moved the record to, a move answered with content another writer
appended before it. The file must come to show the version the control plane stored (path
and content: the newest version wins, ``Filesystem._reconcile_answer``), no dead name stays
listed, and a later append keeps the other writer's lines.

``test_a_commit_answer_carrying_a_live_rival_change_is_shown`` is the deterministic case
(fails without the fix): the sidecar's core on the fake control plane, whose ``latency``
lets the rival change land between the local change's base and its request.
``test_a_commit_answer_carrying_a_rival_change_is_shown`` is the same on a real mount across
a restart (the control plane frozen while the local change is accepted, sidecar and frozen
request killed, the rival change made through the API, the sidecar restarted): a guard of
the restart path, which shows the rival change from the start (it passed before the fix).
"""
from __future__ import annotations

import os
import signal
import sqlite3
import uuid
from pathlib import Path

import pytest

from mountutil import drained, sidecar_status, ControlPlane, Sidecar, read, sh, wait_until

pytestmark = pytest.mark.mount

BASE = "# journal\n" + "j" * 1100 + "\n"




def _queued(cache: Path) -> int:
    db = sqlite3.connect(f"file:{cache / 'outbox.db'}?mode=ro", uri=True, timeout=30)
    try:
        return len(db.execute("SELECT id FROM entries").fetchall())
    finally:
        db.close()


def _listed(d: Path) -> set[str]:
    return set(os.listdir(d))


@pytest.mark.parametrize("local", ["append", "move"])
def test_a_commit_answer_carrying_a_rival_change_is_shown(tmp_path, local):
    """``append``: this mount appends to J.log while another writer moves it to K.log; the
    append is answered at K.log: the mount lists K.log (with the line) and no J.log (it
    kept the dead J.log before). ``move``: this mount moves J.log to K.log while another
    writer appends a line; the move is answered with that content: the mount shows it (it
    kept the older content before), and its next append keeps the rival's line (it was
    written over it, through If-Match, before)."""
    cp = ControlPlane(tmp_path).start()
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    sc = None
    frozen = False
    try:
        tok = cp.setup_workspace("ws")
        sc = Sidecar(cp, "ws", tok, mnt, cache, "--commit-wait", "0.5").start()
        d = mnt / "default"
        j, k = d / "J.log", d / "K.log"
        j.write_text(BASE)
        drained(sc)
        rec = cp.call("find_record", "default", "J.log")
        os.kill(cp.proc.pid, signal.SIGSTOP)
        frozen = True
        if local == "append":
            sh(f"echo mine >> {j}", d, timeout=60)  # accepted: its journal row is written
        else:
            sh(f"mv {j} {k}", d, timeout=60)
        wait_until(lambda: _queued(cache) == 1, timeout=30, what="the local change journaled")
        sc.kill9()
        cp.proc.kill()  # the frozen request dies with it, never applied
        cp.proc.wait(30)
        frozen = False
        cp.start()
        assert _queued(cache) == 1
        if local == "append":  # another writer moves the record meanwhile
            cp.call("move_record", "default", rec.id, "K.log", idempotency_key=uuid.uuid4().hex)
            want = BASE + "mine\n"
        else:  # another writer appends to it meanwhile
            cp.call("append_record", "default", rec.id, "rival\n", if_match=rec.sha256,
                    idempotency_key=uuid.uuid4().hex)
            want = BASE + "rival\n"
        sc = Sidecar(cp, "ws", tok, mnt, cache, "--commit-wait", "0.5").start()
        drained(sc)
        cur = cp.call("get_record", "default", rec.id)
        assert (cur.path, cur.content) == ("K.log", want)
        wait_until(lambda: read(k) == want and "J.log" not in _listed(d), timeout=30,
                   what="the mount shows the record as the control plane holds it")
        sh(f"echo after >> {k}", d, timeout=60)
        drained(sc)
        want += "after\n"
        got = cp.call("get_record", "default", rec.id).content
        assert got == want, got[len(BASE):]
        wait_until(lambda: read(k) == want, timeout=30, what="the mount shows the append")
        assert _listed(d) == {"K.log"}
    finally:
        try:
            if frozen:
                os.kill(cp.proc.pid, signal.SIGCONT)
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()


@pytest.mark.parametrize("local_change", ["append", "move"])
async def test_a_commit_answer_carrying_a_live_rival_change_is_shown(tmp_path, local_change):
    """Live, through the core (the fake's ``latency`` delays this sidecar's requests only, so
    the rival change lands between the local change's base and its request; the feed's
    state of the rival version waits for the outbox, then is skipped as older than the
    answer). ``append``: the append is answered at the path the rival moved the record to:
    the file must be listed there only (before: the dead name stayed, attack finding 4b).
    ``move``: the move is answered with content the rival appended: the file must show it
    (before: it kept the older content), and the next append keeps the rival's line (before:
    written over it through If-Match, attack finding 4a)."""
    import trio

    from memfuse.client import ApiClient
    from memfuse.fake import FakeControlPlane
    from test_faults import local, make_sidecar, remote, start, write
    from test_faults import wait_until as wait_until_async

    fake = FakeControlPlane(seed=4)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery, \
            ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
        await start(sc, nursery)
        n = await write(sc, "J.log", BASE.encode())
        rid, sha = n.record_id, n.sha
        fake.faults.latency = 0.5
        if local_change == "append":
            async with trio.open_nursery() as inner:
                inner.start_soon(lambda: write(sc, "J.log", b"mine\n", append=True))
                await trio.sleep(0.1)
                await adm.move_record("default", rid, "K.log")  # the rival, first
            want = (BASE + "mine\n").encode()
        else:
            sm = sc.fs.stores["default"]
            sc.fs.rename(sm.root.ino, b"J.log", sm.root.ino, b"K.log", 0)
            await trio.sleep(0.1)
            await adm.append_record("default", rid, "rival\n", if_match=sha)  # the rival, first
            with trio.fail_after(20):
                while sc.committer.depth():
                    await trio.sleep(0.01)
            want = (BASE + "rival\n").encode()
        fake.faults.latency = 0.0
        assert await remote(fake) == {"K.log": want}
        await wait_until_async(lambda: local(sc) == {"K.log": want}, timeout=20)
        await write(sc, "K.log", b"after\n", append=True)
        want += b"after\n"
        assert await remote(fake) == {"K.log": want}
        await wait_until_async(lambda: local(sc) == {"K.log": want}, timeout=20)
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()
