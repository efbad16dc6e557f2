"""A mount's own delete or directory move racing another mount's write of the same records
(attack 18 F9, F11; docs/SEMANTICS.md "Sharing and sync").

The change feed leaves this sidecar's own versions out (``skip_writer``), so a feed page
can hold another writer's version that is *older* than one of ours: fetched before our
delete / move committed (the page waits for the store's outbox, then applies), or fetched
after it (ours left out, theirs not). Applied as it is, that older state undid ours: the
deleter showed the file again with the other mount's content, clean, for good (F9); the
mover showed the other mount's new file at the old path, or its own move undone (F11).

Three layers: two sidecars in process on the fake control plane whose first one holds a
feed page (``feed_hold``) until its own delete / move is answered (deterministic); and a
race of real tools (``rm`` against ``echo >>``) on two real mounts of one real ``memfuse
serve``, after which every mount agrees with the control plane.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.config import MountConfig
from memfuse.sidecar.mount import Sidecar


class Hold:
    """A ``feed_hold`` hook: while ``on``, the feed page about to be applied waits
    (``entered`` is set) until ``release``."""

    def __init__(self) -> None:
        self.on = False
        self.entered = trio.Event()
        self._go = trio.Event()

    async def __call__(self) -> None:
        if not self.on:
            return
        self.entered.set()
        with trio.fail_after(30):
            await self._go.wait()

    def release(self) -> None:
        self.on = False
        self._go.set()


def sidecar(tmp: Path, fake: FakeControlPlane, ws: str, token: str, hold: Hold | None = None) -> Sidecar:
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance=f"race-{ws}")
    cfg = MountConfig(mountpoint=tmp / f"mnt-{ws}", workspace=ws, cache_dir=tmp / f"cache-{ws}",
                      commit_wait=5)
    return Sidecar(cfg, client, feed_hold=hold)


async def start(sc: Sidecar, nursery: trio.Nursery) -> None:
    """What ``Sidecar.run`` does before and after the mount, minus FUSE."""
    sc._nursery = nursery
    sc._spawn("journal", sc.journal.run)
    await nursery.start(sc.committer.run)
    for att in await sc.client.list_attachments(sc.config.workspace):
        await sc._add_attachment(att)
    sc._mounted = True
    for slug in sc.fs.stores:
        sc._start_feed(slug)
    sc.fs.ready = True


@contextlib.asynccontextmanager
async def two_mounts(tmp: Path, hold: Hold) -> AsyncIterator[tuple[FakeControlPlane, Sidecar, Sidecar]]:
    """The fake control plane and two started sidecars on its store ``default``: A (workspace
    ``wa``, its feed held by ``hold``) and B (``wb``); stopped when the block ends."""
    fake = FakeControlPlane(seed=0)
    ta = await fake.setup("wa")
    tb = await fake.setup("wb")
    a = sidecar(tmp, fake, "wa", ta, hold)
    b = sidecar(tmp, fake, "wb", tb)
    async with trio.open_nursery() as nursery:
        await start(a, nursery)
        await start(b, nursery)
        yield fake, a, b
        nursery.cancel_scope.cancel()


async def own_change_while_held(hold: Hold, a: Sidecar, change: Callable[[], object]) -> None:
    """Once A's feed holds a page (with B's versions), make A's own ``change`` through its
    core and wait (bounded) until it is committed; then let the page be applied."""
    with trio.fail_after(20):
        await hold.entered.wait()
    change()
    with trio.fail_after(20):
        await a.committer.wait_store_idle("default")
    hold.release()


def lookup(sc: Sidecar, path: str):
    """The node at ``path`` of store ``default``, None when absent."""
    n = sc.fs.stores["default"].root
    for comp in path.split("/"):
        n = n.children.get(comp) if n is not None and n.children is not None else None
    return n


async def write(sc: Sidecar, path: str, data: bytes, append: bool = False) -> None:
    """``echo > path`` (or ``>>`` with ``append``) through the core; returns once committed."""
    parts = path.split("/")
    parent = sc.fs.stores["default"].root
    for comp in parts[:-1]:
        child = parent.children.get(comp)
        if child is None:
            child = sc.fs.mkdir(parent.ino, comp.encode(), 0o755, 0, 0)
        parent = child
    n = parent.children.get(parts[-1])
    if n is None:
        h = sc.fs.create(parent.ino, parts[-1].encode(), 0o644, os.O_WRONLY, 0, 0)
    else:
        h = sc.fs.open(n.ino, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
    try:
        sc.fs.write(h, n.size if append and n is not None else 0, data)
        await sc.fs.flush(h)
    finally:
        sc.fs.release(h.fh)
    await sc.committer.wait_store_idle("default")


def files(sc: Sidecar) -> dict[str, bytes]:
    """The files of store ``default`` this sidecar shows as records (path -> content)."""
    sm = sc.fs.stores["default"]
    return {n.path(): sc.fs._content(n) for n in sc.fs._walk_files(sm.root) if not n.local_only}


def local_files(sc: Sidecar) -> dict[str, bytes]:
    """The local-only files of store ``default`` (``f~``...): path -> content."""
    sm = sc.fs.stores["default"]
    return {n.path(): sc.fs._content(n) for n in sc.fs._walk_files(sm.root) if n.local_only}


async def server(fake: FakeControlPlane, *scs: Sidecar) -> tuple[dict[str, bytes], list[int]]:
    """The store's live records (path -> content) and, for each of ``scs``, the seq of the
    last version its feed brings it (one not its own; 0 when none)."""
    async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport) as api:
        recs, _ = await api.snapshot("default", content=True)
        last = [max((ch.seq for ch in (await api.changes("default", 0, skip_writer=sc.writer)).changes),
                    default=0) for sc in scs]
    return {r.path: r.content.encode() for r in recs}, last


async def settled(fake: FakeControlPlane, *scs: Sidecar, timeout: float = 20) -> dict[str, bytes]:
    """Wait (bounded) until every sidecar's feed has applied the last version it brings it
    and its tree equals the control plane's records; returns those records. Fails naming
    what each shows when they do not agree within ``timeout`` s."""
    want: dict[str, bytes] = {}
    try:
        with trio.fail_after(timeout):
            while True:
                want, last = await server(fake, *scs)
                if all(sc.states["default"].cursor >= seq and files(sc) == want
                       for sc, seq in zip(scs, last)):
                    return want
                await trio.sleep(0.02)
    except trio.TooSlowError:
        shown = {sc.config.workspace: files(sc) for sc in scs}
        raise AssertionError(f"mounts disagree with the control plane {want}: {shown}") from None


@pytest.mark.parametrize("how", ["append", "overwrite"])
async def test_a_delete_answered_after_another_mounts_write_stays_deleted_here(tmp_path, how):
    """F9: mount B appends to (or overwrites) f.md, then mount A's ``rm f.md`` commits after
    it (the control plane ends with the record deleted), while A holds a feed page with B's
    version, fetched before its delete was answered. A must not show f.md again (nor keep it
    in its mirror), and a later feed page (long after) must not bring it back either."""
    hold = Hold()
    async with two_mounts(tmp_path, hold) as (fake, a, b):
        await write(a, "f.md", b"base\n")
        await settled(fake, a, b)

        hold.on = True
        await write(b, "f.md", b"B wrote\n", append=how == "append")
        await own_change_while_held(hold, a, lambda: a.fs.unlink(a.fs.stores["default"].root.ino, b"f.md"))

        assert await settled(fake, a, b) == {}
        await trio.sleep(0.3)  # a stale state applied late (a refetch) would show by now
        assert "f.md" not in files(a)
        assert lookup(a, "f.md") is None
        assert not [m for m in a.states["default"].records.values() if m.path == "f.md"]
        # A writes again: a new record, its content only (not B's from a revived copy)
        await write(a, "f.md", b"again\n")
        assert (await settled(fake, a, b)) == {"f.md": b"again\n"}
        a.fs.check_invariants()
        b.fs.check_invariants()


@pytest.mark.parametrize("how", ["append", "overwrite"])
async def test_a_rename_onto_a_local_only_name_answered_after_another_mounts_write(tmp_path, how):
    """attack 19 F2: mount B appends to (or overwrites) f.md, then mount A's ``mv f.md
    f.md~`` (a local-only name: the record is deleted, the file kept here) commits after it,
    while A holds a feed page with B's version fetched before its delete was answered. A
    must show f.md~ only, with what A had when it moved it, never f.md again (B's version
    of a record A deleted), nor B's content in its f.md~; the control plane and B end with
    no f.md."""
    hold = Hold()
    async with two_mounts(tmp_path, hold) as (fake, a, b):
        await write(a, "f.md", b"base\n")
        await settled(fake, a, b)

        hold.on = True
        await write(b, "f.md", b"B wrote\n", append=how == "append")
        root = a.fs.stores["default"].root
        await own_change_while_held(hold, a, lambda: a.fs.rename(root.ino, b"f.md", root.ino, b"f.md~", 0))

        assert await settled(fake, a, b) == {}
        await trio.sleep(0.3)  # a stale state applied late (a refetch) would show by now
        assert files(a) == {} and lookup(a, "f.md") is None
        assert local_files(a) == {"f.md~": b"base\n"}
        assert local_files(b) == {}
        assert not [m for m in a.states["default"].records.values() if m.path == "f.md"]
        a.fs.check_invariants()
        b.fs.check_invariants()


async def test_a_directory_move_answered_after_another_mounts_writes_shows_them_moved(tmp_path):
    """F11: mount B creates dd/new.md and appends to dd/one.md, then mount A's ``mv dd ee``
    commits (the control plane moves both, B's changes with them), while A holds a feed page
    with B's versions at the old path. A must show ``ee/new.md`` and ``ee/one.md`` with B's
    content, nothing left under ``dd``, as the control plane and B do."""
    hold = Hold()
    async with two_mounts(tmp_path, hold) as (fake, a, b):
        await write(a, "dd/one.md", b"one\n")
        await settled(fake, a, b)

        hold.on = True
        await write(b, "dd/new.md", b"new\n")
        await write(b, "dd/one.md", b"more\n", append=True)
        root = a.fs.stores["default"].root
        await own_change_while_held(hold, a, lambda: a.fs.rename(root.ino, b"dd", root.ino, b"ee", 0))

        want = {"ee/new.md": b"new\n", "ee/one.md": b"one\nmore\n"}
        assert await settled(fake, a, b) == want
        await trio.sleep(0.3)
        assert files(a) == want and lookup(a, "dd") is None
        a.fs.check_invariants()
        b.fs.check_invariants()


async def test_a_delete_and_a_directory_move_without_a_race_fetch_nothing(tmp_path):
    """Outside the race nothing more is asked: a delete and a directory move whose records
    no other mount changed meanwhile fetch no record (no ``GET .../records/{id}``), and
    leave nothing noted once the feed has passed them."""
    fake = FakeControlPlane(seed=0)
    ta = await fake.setup("wa")
    tb = await fake.setup("wb")
    a = sidecar(tmp_path, fake, "wa", ta)
    b = sidecar(tmp_path, fake, "wb", tb)
    fetched: list[str] = []
    get_record = a.client.get_record

    async def counting(store, rid, *args, **kw):
        fetched.append(rid)
        return await get_record(store, rid, *args, **kw)

    a.client.get_record = counting  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await start(a, nursery)
        await start(b, nursery)
        for i in range(3):
            await write(a, f"dd/f{i}.md", b"%d\n" % i)
        await write(a, "gone.md", b"x\n")
        await settled(fake, a, b)
        root = a.fs.stores["default"].root
        a.fs.rename(root.ino, b"dd", root.ino, b"ee", 0)
        a.fs.unlink(root.ino, b"gone.md")
        await a.committer.wait_store_idle("default")
        assert a.states["default"].own_newer  # noted until the feed passes them
        await write(b, "other.md", b"b\n")  # the feed moves on past them
        want = {f"ee/f{i}.md": b"%d\n" % i for i in range(3)} | {"other.md": b"b\n"}
        assert await settled(fake, a, b) == want
        assert fetched == []
        assert a.states["default"].own_newer == {}
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------- real mounts
def _rounds_against_b_writing(tmp_path: Path, prefix: str, a_argv: Callable[[Path], list[str]],
                              after: Callable[[int, Path, Path, str], None] | None = None) -> None:
    """Six rounds on two real mounts A and B of store ``s``: A runs ``a_argv(A / name)`` at
    the same moment B runs ``echo 'B wrote' >> name`` (``>`` every other round); both mounts
    then end showing what the control plane holds of ``name`` (bounded polls), still so
    0.5 s later; ``after(k, A, B, name)`` checks more."""
    from mountutil import live_records, read, two_sidecars, wait_until

    with two_sidecars(tmp_path, "s") as (cp, a, b):
        A, B = a.mountpoint / "s", b.mountpoint / "s"
        for k in range(6):
            name = f"{prefix}{k}.md"
            subprocess.run(["sh", "-c", f"echo base > {A / name}"], check=True, timeout=30)
            wait_until(lambda: read(B / name) == "base\n", timeout=20, what=f"B shows {name}")
            op = ">>" if k % 2 == 0 else ">"
            procs = [subprocess.Popen(a_argv(A / name)),
                     subprocess.Popen(["sh", "-c", f"echo 'B wrote' {op} {B / name}"])]
            for p in procs:
                p.wait(timeout=30)

            def agree() -> bool:
                rec = live_records(cp, "s").get(name)
                want = rec.content if rec is not None else None
                return read(A / name) == want and read(B / name) == want

            wait_until(agree, timeout=30, what=f"round {k}: both mounts show what the control "
                                               f"plane holds of {name}")
            time.sleep(0.5)  # a stale state applied late would show by now
            assert agree(), f"round {k}: a mount changed {name} after agreeing"
            if after is not None:
                after(k, A, B, name)


def test_rm_on_one_mount_racing_a_write_on_the_other_ends_with_every_mount_agreeing(tmp_path):
    """F9 with real tools: mount A ``rm f`` at the same moment mount B ``echo ... >> f`` (or
    ``>``), six rounds. Whatever order the control plane took them in (the record deleted,
    or B's write re-creating it), both mounts end showing what the control plane holds:
    no file where it has none, its content where it has one (bounded polls)."""
    _rounds_against_b_writing(tmp_path, "del", lambda f: ["rm", str(f)])


def test_mv_onto_a_local_only_name_racing_a_write_on_the_other_ends_with_every_mount_agreeing(tmp_path):
    """attack 19 F2 with real tools: mount A ``mv f f~`` (a local-only name: the record is
    deleted, the file kept on A) at the same moment mount B ``echo ... >> f`` (or ``>``),
    six rounds. Both mounts end showing what the control plane holds of ``f`` (nothing, or
    B's re-created record), A keeps ``f~`` (local-only), B has no ``f~`` (bounded polls)."""
    from mountutil import read

    def local_only_kept_on_a(k: int, A: Path, B: Path, name: str) -> None:
        assert read(A / (name + "~")) is not None, f"round {k}: A lost its {name}~"
        assert read(B / (name + "~")) is None, f"round {k}: B shows A's local-only {name}~"

    _rounds_against_b_writing(tmp_path, "lo", lambda f: ["mv", str(f), f"{f}~"], local_only_kept_on_a)


def test_mv_dir_on_one_mount_racing_writes_in_it_on_the_other_ends_with_every_mount_agreeing(tmp_path):
    """F11 with real tools: mount A ``mv dd ee`` while mount B writes ``dd/new.md`` and
    appends to ``dd/one.md``, four rounds: both mounts end showing the files the control
    plane holds, where it holds them, with its content (bounded polls)."""
    from mountutil import live_records, two_sidecars, wait_until

    def tree(root: Path, *tops: str) -> dict[str, str]:
        out = {}
        for top in tops:
            for dirpath, _, names in os.walk(root / top):
                for n in names:
                    p = Path(dirpath) / n
                    out[str(p.relative_to(root))] = p.read_text()
        return out

    with two_sidecars(tmp_path, "s") as (cp, a, b):
        A, B = a.mountpoint / "s", b.mountpoint / "s"
        for k in range(4):
            dd, ee = f"dd{k}", f"ee{k}"
            subprocess.run(["sh", "-c", f"mkdir -p {A / dd} && echo one > {A / dd}/one.md"],
                           check=True, timeout=30)
            wait_until(lambda: (B / dd / "one.md").exists(), timeout=20, what=f"B shows {dd}")
            procs = [subprocess.Popen(["mv", str(A / dd), str(A / ee)]),
                     subprocess.Popen(["sh", "-c", f"echo new > {B / dd}/new.md; "
                                                   f"echo more >> {B / dd}/one.md"])]
            for p in procs:
                p.wait(timeout=30)

            def agree() -> bool:
                want = {path: r.content for path, r in live_records(cp, "s").items()
                        if path.startswith((dd + "/", ee + "/"))}
                return tree(A, dd, ee) == want and tree(B, dd, ee) == want

            wait_until(agree, timeout=30, what=f"round {k}: both mounts show what the control "
                                               f"plane holds under {dd} and {ee}")
            time.sleep(0.5)
            assert agree(), f"round {k}: a mount changed after agreeing"
