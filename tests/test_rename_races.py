"""A rename over a record (``sed -i``, ``os.replace``, ``mv`` over a file) is a write of that
record under the rules of an in-place write: its base is the version this sidecar last saw,
a rival change since then is merged (append rebase, three-way line merge), and only
overlapping edits fall back to last writer wins, with a ``conflict`` line in ``errors.log``,
``memfuse_conflicts`` and the losing content kept as a version in history. Never a blind
replace.

Two real mounts on one store through a real ``memfuse serve``: the control plane is paused
(SIGSTOP, always SIGCONT in a ``finally``) while both sidecars edit, so both edits are really
concurrent (both based on the same version) in every run; plus the fake's fault injection
(a rival version lands between the base and the put).
"""
from __future__ import annotations

import json
import os
import signal
import uuid

import pytest
import trio

pytestmark = pytest.mark.mount

from mountcheck import errors_log
from mountutil import ControlPlane, Sidecar, live_records, read, sh, two_sidecars, wait_until
from test_faults import conflict_lines, local, make_sidecar, remote, start, write
from test_faults import wait_until as wait_until_async

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("rr"), "s") as cp_a_b:
        yield cp_a_b


def _depth(sc: Sidecar) -> int:
    return json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())["outbox"]["depth"]


def _concurrently(cp: ControlPlane, *jobs: tuple[str, os.PathLike]) -> None:
    """Run the shell commands ``jobs`` (command, cwd) while the control plane is paused, so
    every one is based on the versions its sidecar saw before; then let it answer."""
    os.kill(cp.proc.pid, signal.SIGSTOP)
    try:
        for cmd, cwd in jobs:
            sh(cmd, cwd, timeout=30)  # a close returns once accepted (no answer: ~3 s)
    finally:
        os.kill(cp.proc.pid, signal.SIGCONT)


def _seed(cp, a, b, name: str, content: str):
    (a.mountpoint / "s" / name).write_text(content)
    wait_until(lambda: read(b.mountpoint / "s" / name) == content, timeout=10, what=f"{name} in B")


def _settled(cp, a, b, name: str, want: str | None = None) -> str:
    wait_until(lambda: _depth(a) == 0 and _depth(b) == 0, timeout=60, what="both outboxes drained")
    cur = live_records(cp, "s")[name].content
    if want is not None:
        assert cur == want
    wait_until(lambda: read(a.mountpoint / "s" / name) == cur and read(b.mountpoint / "s" / name) == cur,
               timeout=15, what="both mounts show the stored content")
    return cur


def _versions(cp, name: str) -> list[str]:
    rec = live_records(cp, "s")[name]
    return [cp.call("version", "s", rec.id, v.version).content for v in cp.call("versions", "s", rec.id)]


def test_disjoint_sed_edits_on_two_mounts_both_survive(pair):
    cp, a, b = pair
    for i in range(3):
        name = f"race-{uuid.uuid4().hex[:6]}.md"
        _seed(cp, a, b, name, "alpha\nbeta\ngamma\n")
        _concurrently(cp, (f"sed -i s/alpha/ALPHA{i}/ {name}", a.mountpoint / "s"),
                      (f"sed -i s/gamma/GAMMA{i}/ {name}", b.mountpoint / "s"))
        _settled(cp, a, b, name, f"ALPHA{i}\nbeta\nGAMMA{i}\n")
        assert not [e for e in errors_log(a.mountpoint) + errors_log(b.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
        # one record, no stray temporaries
        assert not [p for p in live_records(cp, "s") if p.startswith("sed")]


def test_overlapping_sed_edits_are_last_writer_wins_with_a_conflict_line(pair):
    cp, a, b = pair
    name = f"clash-{uuid.uuid4().hex[:6]}.md"
    _seed(cp, a, b, name, "alpha\nbeta\n")
    _concurrently(cp, (f"sed -i s/alpha/FROM-A/ {name}", a.mountpoint / "s"),
                  (f"sed -i s/alpha/FROM-B/ {name}", b.mountpoint / "s"))
    cur = _settled(cp, a, b, name)
    assert cur in ("FROM-A\nbeta\n", "FROM-B\nbeta\n")
    # the writer that lost the race overwrote the other (last writer wins) and said so; the
    # mount whose write was overwritten is told by its feed (docs/SEMANTICS.md, "Conflicts")
    def lines(sc) -> list[dict]:
        return [e for e in errors_log(sc.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
    wait_until(lambda: len(lines(a)) + len(lines(b)) == 2, timeout=15, what="both mounts told")
    won, lost = (b, a) if cur == "FROM-B\nbeta\n" else (a, b)
    assert [e.get("overwritten", False) for e in lines(won)] == [False], lines(won)
    assert [e.get("overwritten", False) for e in lines(lost)] == [True], lines(lost)
    # the overwritten content is kept as a version in history
    history = _versions(cp, name)
    assert "FROM-A\nbeta\n" in history and "FROM-B\nbeta\n" in history


def test_an_append_survives_a_rival_rename_over(pair):
    cp, a, b = pair
    name = f"app-{uuid.uuid4().hex[:6]}.md"
    _seed(cp, a, b, name, "one\ntwo\n")
    _concurrently(cp, (f"echo three >> {name}", a.mountpoint / "s"),
                  (f"sed -i 1s/one/ONE/ {name}", b.mountpoint / "s"))
    _settled(cp, a, b, name, "ONE\ntwo\nthree\n")

    # python's os.replace (atomic write) and mv over a file take the same road
    _concurrently(cp, (f"echo four >> {name}", a.mountpoint / "s"),
                  ("python3 -c \"import os; open('t.tmp','w').write('ONE\\ntwo!\\nthree\\n'); "
                   f"os.replace('t.tmp', '{name}')\"", b.mountpoint / "s"))
    _settled(cp, a, b, name, "ONE\ntwo!\nthree\nfour\n")
    _concurrently(cp, (f"echo five >> {name}", a.mountpoint / "s"),
                  (f"printf 'ONE!\\ntwo!\\nthree\\nfour\\n' > mv.tmp && mv -f mv.tmp {name}",
                   b.mountpoint / "s"))
    _settled(cp, a, b, name, "ONE!\ntwo!\nthree\nfour\nfive\n")


def test_a_memory_tool_write_racing_a_rename_over_is_merged(pair):
    cp, a, b = pair
    name = f"tool-{uuid.uuid4().hex[:6]}.md"
    _seed(cp, a, b, name, "first\nmiddle\nsecond\n")  # adjacent lines would overlap (diff3)
    os.kill(cp.proc.pid, signal.SIGSTOP)
    try:
        sh(f"sed -i s/first/FIRST/ {name}", a.mountpoint / "s", timeout=30)
    finally:
        os.kill(cp.proc.pid, signal.SIGCONT)
    # the memory tool edits line 3 while A's queued put (based on the seed) drains:
    # whichever lands first, the other is merged onto it
    r = cp.call("memory_tool", "wb", {"command": "str_replace", "path": f"/memories/s/{name}",
                                      "old_str": "second", "new_str": "SECOND"},
                token=(cp.tmp / "wb.token").read_text())
    assert not r.is_error, r.content
    _settled(cp, a, b, name, "FIRST\nmiddle\nSECOND\n")


# ------------------------------------------------------------------ the fake's fault injection
def _rename(sc, src: str, dst: str) -> None:
    sm = sc.fs.stores["default"]
    sc.fs.rename(sm.root.ino, src.encode(), sm.root.ino, dst.encode(), 0)


async def test_a_rename_over_meeting_a_rival_version_is_merged_not_replaced(tmp_path):
    """sed -i through the core: create a temporary, write, close, rename it over the file,
    while a rival version lands first (the fake's ``latency`` delays the sidecar's requests
    only): a disjoint rival edit is merged (no conflict line), an overlapping one is last
    writer wins with a conflict line and the rival kept in history; the temporary leaves no
    live record and the target keeps its id."""
    fake = FakeControlPlane(seed=21)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery, \
            ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
        await start(sc, nursery)
        n = await write(sc, "m.md", b"a\nb\nc\n")
        rid = n.record_id

        await write(sc, "sedAbC123", b"A\nb\nc\n")
        fake.faults.latency = 0.5
        _rename(sc, "sedAbC123", "m.md")
        await adm.update_record("default", rid, "a\nb\nc\nd\n")  # the rival, disjoint
        await wait_until_idle(sc)
        fake.faults.latency = 0.0
        want = b"A\nb\nc\nd\n"
        assert await remote(fake) == {"m.md": want}
        assert conflict_lines(sc) == [] and sc.committer.merges == 1
        await wait_until_async(lambda: local(sc) == {"m.md": want})
        assert (await adm.find_record("default", "m.md")).id == rid

        await write(sc, "sedXyZ999", b"A\nB-local\nc\nd\n")
        fake.faults.latency = 0.5
        _rename(sc, "sedXyZ999", "m.md")
        await adm.update_record("default", rid, "A\nB-remote\nc\nd\n")  # the rival, same line
        await wait_until_idle(sc)
        fake.faults.latency = 0.0
        assert await remote(fake) == {"m.md": b"A\nB-local\nc\nd\n"}
        assert len(conflict_lines(sc)) == 1 and sc.committer.conflicts == 1
        kept = [(await adm.version("default", rid, v.version)).content
                for v in await adm.versions("default", rid)]
        assert "A\nB-remote\nc\nd\n" in kept
        assert (await adm.find_record("default", "m.md")).id == rid
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def wait_until_idle(sc, timeout: float = 20) -> None:
    with trio.fail_after(timeout):
        while sc.committer.depth():
            await trio.sleep(0.01)


# ------------------------------------------------------------------ a backlog of one file
async def test_a_backlog_of_one_file_coalesces_and_keeps_every_close(tmp_path):
    """During an outage 200 appends to two files queue up; once the control plane is back
    they commit as one put per file (the last content holds every append, in order), each
    queued entry finishes with it, and a rival change made meanwhile is merged, not lost."""
    fake = FakeControlPlane(seed=31)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery, \
            ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
        await start(sc, nursery)
        a = await write(sc, "a.md", b"a0\n")
        await write(sc, "b.md", b"b0\n")
        fake.faults.outage = True
        for i in range(1, 101):
            await write(sc, "a.md", f"a{i}\n".encode(), append=True, wait=False)
            await write(sc, "b.md", f"b{i}\n".encode(), append=True, wait=False)
        assert sc.committer.depth() == 200
        await adm.update_record("default", a.record_id, "RIVAL\na0\n")  # a rival edit, line 1
        before = len(await adm.versions("default", a.record_id))
        fake.faults.outage = False
        sc.committer.poke()
        await wait_until_idle(sc, timeout=60)
        got = await remote(fake)
        assert got["b.md"] == b"".join(f"b{i}\n".encode() for i in range(101))
        assert got["a.md"] == b"RIVAL\n" + b"".join(f"a{i}\n".encode() for i in range(101))
        assert sc.committer.coalesced >= 190 and conflict_lines(sc) == []
        assert len(await adm.versions("default", a.record_id)) <= before + 2
        await wait_until_async(lambda: local(sc) == got)
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()
