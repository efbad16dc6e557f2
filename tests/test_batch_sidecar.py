"""The sidecar's committer sends a store's backlog in batches (``POST .../batch``), each entry
finished exactly as alone: refusals get their errno and ``state=rejected`` while the rest
commit, a 412 gets the same follow-up (re-read, last writer wins), a lost response retries the
batch with the same keys, a server without the endpoint gets single requests, ``kill -9``
loses nothing. In process against the fake control plane, and on a real FUSE mount.
"""
from __future__ import annotations

import errno
import json
import subprocess
import types
from pathlib import Path

import httpx
import pytest
import trio

from memfuse import content as content_rules
from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.server import prescan as server_prescan
from memfuse.server import records as server_records
from memfuse.sidecar.inodes import CLEAN, REJECTED
from mountutil import Rig
from test_durability import NO_ADMIN, all_clean, outbox_depth, poll, timed
from test_faults import local, make_sidecar, remote, start, wait_until, write
from test_token_lifecycle import admin_url, metric

MARKER = "SERVER-ONLY-SECRET"


def _server_only_secret(monkeypatch) -> None:
    """The control plane's secret rules know a pattern the sidecar's do not (a newer
    detector): its refusal arrives inside a batch."""
    def find_secret(text: str):
        return "test marker (line 1)" if MARKER in text else content_rules.find_secret(text)
    server_rules = types.SimpleNamespace(**{k: getattr(content_rules, k) for k in dir(content_rules)
                                            if not k.startswith("__")} | {"find_secret": find_secret})
    # the write path scans through memfuse.server.prescan (large contents on a worker thread)
    monkeypatch.setattr(server_records, "content_rules", server_rules)
    monkeypatch.setattr(server_prescan, "content_rules", server_rules)


async def test_backlog_commits_in_batches_each_entry_as_alone(tmp_path, monkeypatch):
    _server_only_secret(monkeypatch)
    fake = FakeControlPlane(seed=3)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token, commit_wait=5)
    calls: list[str] = []
    observe = sc.client.observer
    sc.client.observer = lambda ep, status, dt: (calls.append(f"{ep} {status}"), observe and observe(ep, status, dt))
    finished: dict[str, int] = {}
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        entry_finished = sc.entry_finished  # the sidecar hears of every finished entry
        sc.entry_finished = lambda e: (finished.__setitem__(e.args.get("path"), e.errno), entry_finished(e))
        for i in range(4):
            await write(sc, f"old{i}.md", f"old {i}\n".encode())
        await wait_until(lambda: sc.committer.depth() == 0)
        fake.faults.outage = True  # the backlog builds up
        for i in range(40):
            await write(sc, f"new{i:02d}.md", f"new {i}\n".encode(), wait=False)
            if i == 20:
                await write(sc, "refused.md", f"{MARKER}\n".encode(), wait=False)
        for i in range(4):
            await write(sc, f"old{i}.md", f"old {i}, edited here\n".encode(), wait=False)
        await wait_until(lambda: sc.committer.depth() == 45)
        # meanwhile someone else edits old1.md: its update in the batch gets 412
        async with ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
            rec = await adm.find_record("default", "old1.md")
            await adm.update_record("default", rec.id, "old 1, edited elsewhere\n")
        calls.clear()
        fake.faults.drop_rate = 1.0  # the first batch is applied, its response lost
        fake.faults.outage = False
        sc.committer.poke()
        await wait_until(lambda: fake.counters.dropped >= 1)
        fake.faults.drop_rate = 0.0
        await wait_until(lambda: sc.committer.depth() == 0, timeout=60)
        batches = [c for c in calls if c.startswith("POST /v1/stores/{}/batch 200")]
        singles = [c for c in calls if c.startswith(("POST /v1/stores/{}/records ", "PUT /v1/stores/{}/records/{} "))]
        assert batches and sc.committer.batches == len(batches)
        assert len(singles) <= 3, calls  # the 412's last-writer-wins update and little else
        # the refused file: its errno and state, the rest committed
        sm = sc.fs.stores["default"]
        n = sc.fs.lookup(sm.root.ino, b"refused.md")
        assert n.state == REJECTED and "secret" in n.error and finished["refused.md"] == errno.EPERM
        assert sum(1 for v in finished.values() if v) == 1
        want = await remote(fake)
        got = local(sc)
        assert "refused.md" not in want
        del got["refused.md"]
        assert got == want
        assert want["old1.md"] == b"old 1, edited here\n" and sc.committer.conflicts == 1
        assert all(sc.fs.lookup(sm.root.ino, p.encode()).state == CLEAN for p in want)
        # exactly once, although the first batch was sent twice
        async with ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
            recs, _ = await adm.snapshot("default", content=False)
            assert all(r.version == 1 for r in recs if r.path.startswith("new"))
            assert len([r for r in recs if r.path.startswith("new")]) == 40
            st = await adm.get_store("default")
            assert st.record_count == 44
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_without_the_endpoint_entries_go_one_by_one(tmp_path):
    fake = FakeControlPlane(seed=4)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token, commit_wait=5)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fake.faults.outage = True
        for i in range(10):
            await write(sc, f"f{i}.md", f"{i}\n".encode(), wait=False)
        fake.faults.outage = False
        fake.faults.inject.append(("POST", r"/batch$", 404))  # an older control plane
        sc.committer.poke()
        await wait_until(lambda: sc.committer.depth() == 0, timeout=60)
        assert not sc.committer.batching and sc.committer.batches == 0
        assert local(sc) == await remote(fake)
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


@pytest.mark.timeout(180)
def test_cp_r_of_200_files_commits_in_batches(tmp_path):
    """``cp -r`` of 200 small files onto a real mount by 8 copiers at once (each close waits
    for its commit, so the others' files queue meanwhile): committed in batches, the same
    tree on the control plane, every file clean."""
    src = tmp_path / "src"
    for d in range(8):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(25):
            (src / f"d{d}" / f"f{i:02d}.md").write_text(f"# file {d}/{i}\n" + "x" * (i * 7) + "\n")
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws")
        mnt = sc.mountpoint
        store = mnt / "default"
        copiers = [subprocess.Popen(["cp", "-r", str(src / f"d{d}"), str(store)]) for d in range(8)]
        assert [c.wait(120) for c in copiers] == [0] * 8
        poll(lambda: outbox_depth(mnt) == 0, 90, "the outbox to drain", sc.log)
        admin = admin_url(mnt)
        batches = metric(admin, "memfuse_outbox_batches_total")
        text = httpx.get(f"{admin}/metrics", timeout=10).text
        singles = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith('memfuse_api_calls_total{endpoint="POST /v1/stores/{}/records"'))
        assert batches >= 1 and singles < 100, (batches, singles)
        files = sorted(p.relative_to(src) for p in src.rglob("*.md"))
        recs = {r.path: r for r in cp.call("snapshot", "default", content=True)[0]}
        assert sorted(recs) == sorted(str(f) for f in files)
        for f in files:
            assert recs[str(f)].content == (src / f).read_text() and recs[str(f)].version == 1
        assert all_clean([store / f for f in files])


@pytest.mark.timeout(180)
def test_kill9_with_a_batch_in_flight_loses_nothing(tmp_path):
    """30 files accepted while the control plane is frozen (SIGSTOP); the sidecar is killed
    (-9), restarted (its outbox replay sends the backlog as a batch, which hangs on the frozen
    control plane) and killed again; the control plane resumes and applies that batch, whose
    response is lost; the third sidecar replays the same batch: every file exactly once."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", "--commit-wait", "0.2", *NO_ADMIN)
        mnt = sc.mountpoint
        store = mnt / "default"
        cp.freeze()
        for i in range(30):
            timed((store / f"k{i:02d}.md").write_text, f"kept {i}\n")
        sc.kill9()  # SIGKILL + lazy unmount
        seen = sc.log.read_text().count("replaying outbox")
        sc.launch()  # started without waiting for its mount (the control plane is frozen)
        poll(lambda: sc.log.read_text().count("replaying outbox") > seen, 60, "the outbox replay", sc.log)
        trio.run(trio.sleep, 1.0)  # its batch is sent and hangs
        sc.kill9()
        cp.thaw()
        sc.start()  # same cache directory and options
        poll(lambda: outbox_depth(mnt) == 0, 60, "the outbox to drain", sc.log)
        recs = {r.path: r for r in cp.call("snapshot", "default", content=True)[0]}
        assert sorted(recs) == [f"k{i:02d}.md" for i in range(30)]
        assert all(r.version == 1 and r.content == f"kept {int(p[1:3])}\n" for p, r in recs.items())
        assert cp.call("get_store", "default").record_count == 30
