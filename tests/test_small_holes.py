"""Small holes that lose or expose data, closed on every face:

- a file and a directory never share a name: a record ``fd`` beside a record ``fd/child.md``
  is refused (409 ``parent_is_file`` / ``path_is_directory``) by create, move, prefix move,
  restore and batch over REST, and by the memory tool and MCP (they run the same service);
- setuid / setgid / sticky bits are never kept: refused on PATCH / PUT / create (422),
  stripped by ``memfuse export`` from a record an older release stored with them, refused by
  chmod on the mount;
- the sidecar's cache directory never follows a planted symlink (``O_NOFOLLOW``): its target
  is neither chmod-ed nor opened, and ``memfuse mount`` refuses to start with one line.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import anyio
import pytest
from mcp import Client

from memfuse import wire
from memfuse.client import ApiClient
from memfuse.errors import Conflict, PermanentError
from memfuse.fake import FakeControlPlane
from memfuse.mcp_server import HttpBackend, build_server
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.cachedir import private_file, write_private
from memfuse.transfer import export_records

from mountutil import MEMFUSE

STORE = "s"


@pytest.fixture
async def api(fake):
    token = await fake.setup("ws", stores=(STORE,))
    async with ApiClient(fake.base_url, token, transport=fake.transport, instance="pytest") as client:
        yield client


async def _paths(api) -> list[str]:
    page = await api.list_records(STORE, limit=1000)
    return sorted(r.path for r in page.records)


async def _refused(coro, code: str) -> Conflict:
    with pytest.raises(Conflict) as info:
        await coro
    assert info.value.status == 409 and info.value.code == code, info.value
    return info.value


async def test_a_file_and_a_directory_never_share_a_name_over_rest_and_batch(api):
    fd = await api.create_record(STORE, "fd", "a file\n")
    # a file under a file: create, either depth
    e = await _refused(api.create_record(STORE, "fd/child.md", "x\n"), "parent_is_file")
    assert "'fd' is a file" in e.detail
    await _refused(api.create_record(STORE, "fd/deeper/child.md", "x\n"), "parent_is_file")
    # the reverse: a file where records already sit below
    await api.create_record(STORE, "dir/child.md", "x\n")
    e = await _refused(api.create_record(STORE, "dir", "x\n"), "path_is_directory")
    assert "dir/child.md" in e.detail
    # a look-alike prefix is no directory: "dir.md" and "dirx/a" are fine
    await api.create_record(STORE, "dir.md", "x\n")
    await api.create_record(STORE, "dirx/a", "x\n")
    await api.create_record(STORE, "fd.d/child.md", "x\n")

    # move a file onto a directory name, or under a file
    other = await api.create_record(STORE, "other.md", "o\n")
    await _refused(api.move_record(STORE, other.id, "dir"), "path_is_directory")
    await _refused(api.move_record(STORE, other.id, "fd/other.md"), "parent_is_file")
    # a file may move under its own old name's directory once it is out of the way
    r = await api.move_record(STORE, fd.id, "fd/self.md")
    assert r.records[0].path == "fd/self.md"
    await api.move_record(STORE, r.records[0].id, "fd")

    # prefix move: the target prefix is a file, or sits under one
    await _refused(api.move_prefix(STORE, "dir", "fd"), "parent_is_file")
    await _refused(api.move_prefix(STORE, "dir", "fd/sub"), "parent_is_file")

    # restore: version 1 of a deleted record at a path that is now a directory
    gone = await api.create_record(STORE, "was-a-file", "v1\n")
    await api.delete_record(STORE, gone.id)
    await api.create_record(STORE, "was-a-file/now.md", "x\n")
    await _refused(api.restore(STORE, gone.id, 1), "path_is_directory")

    before = await _paths(api)
    # batch: against the database, and within the batch itself (deferred creates)
    out = await api.batch(STORE, [
        ApiClient.batch_create("fd/in-batch.md", "x\n"),
        ApiClient.batch_create("newdir/a.md", "x\n"),
        ApiClient.batch_create("newdir", "x\n"),
        ApiClient.batch_create("newfile", "x\n"),
        ApiClient.batch_create("newfile/b.md", "x\n"),
        ApiClient.batch_move(other.id, "dir"),
    ])
    codes = [o.code if isinstance(o, PermanentError) else "ok" for o in out]
    assert codes == ["parent_is_file", "ok", "path_is_directory", "ok", "parent_is_file",
                     "path_is_directory"], out
    assert await _paths(api) == sorted(before + ["newdir/a.md", "newfile"])


async def test_memory_tool_and_mcp_refuse_the_clash(fake, api):
    await api.create_record(STORE, "fd", "a file\n")
    await api.create_record(STORE, "dir/child.md", "x\n")
    r = await api.memory_tool("ws", {"command": "create", "path": f"/memories/{STORE}/fd/child.md",
                                     "file_text": "x\n"})
    assert r.is_error and "ENOTDIR" in r.content, r.content
    r = await api.memory_tool("ws", {"command": "rename", "old_path": f"/memories/{STORE}/fd",
                                     "new_path": f"/memories/{STORE}/dir/child.md/x"})
    assert r.is_error, r.content

    backend = HttpBackend(api, "ws")
    server = build_server(lambda: backend, instructions=await backend.instructions())
    async with Client(server) as client:
        res = await client.call_tool("memory_create", {"path": f"/memories/{STORE}/fd/child.md",
                                                       "file_text": "x\n"})
        assert res.is_error and "ENOTDIR" in res.content[0].text, res.content
        res = await client.call_tool("memory_create", {"path": f"/memories/{STORE}/dir",
                                                       "file_text": "x\n"})
        assert res.is_error, res.content
    assert await _paths(api) == ["dir/child.md", "fd"]


async def test_setuid_setgid_sticky_are_refused_and_stripped_on_export(fake, api, tmp_path):
    rec = await api.create_record(STORE, "a.md", "x\n", mode=0o640)
    for bad in (0o4755, 0o2644, 0o1777):
        with pytest.raises(ValueError):  # the client checks before sending
            await api.set_attributes(STORE, rec.id, mode=bad)
    # the raw requests, past the client's own check: the server refuses them (422)
    async with fake.client(fake.token_for("ws")) as http:
        for bad in (0o4755, 0o2644, 0o1777):
            r = await http.patch(f"/v1/stores/{STORE}/records/{rec.id}", json={"mode": bad})
            assert r.status_code == 422, r.text
            assert r.headers["content-type"].startswith("application/problem+json")
        r = await http.put(f"/v1/stores/{STORE}/records/{rec.id}", json={"content": "y\n", "mode": 0o4755})
        assert r.status_code == 422, r.text
        r = await http.post(f"/v1/stores/{STORE}/records", json={"path": "b.md", "content": "y\n",
                                                                 "mode": 0o2755})
        assert r.status_code == 422, r.text
    r2 = await api.get_record(STORE, rec.id)
    assert r2.mode == 0o640 and r2.version == 1

    # a record an older release stored with them: export writes the permission bits only
    old = wire.Record(id="r1", store=STORE, path="tool.sh", type="project", version=1, sha256="0" * 64,
                      size=3, created_at=datetime.now(timezone.utc), updated_at=datetime.now(timezone.utc),
                      updated_by="ws:w", seq=1, content="x\n", mode=0o6755)
    report = export_records([old], tmp_path / "out", store=STORE)
    assert not report.failed
    st = os.stat(tmp_path / "out" / "tool.sh")
    assert stat.S_IMODE(st.st_mode) == 0o755
    manifest = json.loads((tmp_path / "out" / ".memfuse" / "export.json").read_text())
    assert [r["mode"] for r in manifest["records"]] == [0o755]


def test_cache_files_never_follow_a_planted_symlink(tmp_path):
    target = tmp_path / "victim"
    target.write_text("not the sidecar's\n")
    os.chmod(target, 0o644)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    link = cache / "blobs.db"
    link.symlink_to(target)
    with pytest.raises(OSError) as info:
        private_file(link)
    assert info.value.errno == errno.ELOOP and "symbolic link" in str(info.value)
    with pytest.raises(OSError):
        BlobCache(link)
    with pytest.raises(OSError) as info:
        write_private(link, "x")
    assert info.value.errno == errno.ELOOP
    assert target.read_text() == "not the sidecar's\n"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644  # never chmod-ed

    # a real sidecar start: one line naming the file, exit 1, the target untouched
    (cache / "blobs.db").unlink()
    (cache / "outbox.db").symlink_to(target)
    token = tmp_path / "token"
    token.write_text("mfw_unused\n")
    p = subprocess.run([MEMFUSE, "mount", str(tmp_path / "mnt"), "--cache-dir", str(cache),
                        "--control-plane", "http://127.0.0.1:9", "--workspace", "ws",
                        "--token-file", str(token), "--admin-listen", "127.0.0.1:0",
                        "--start-timeout", "2"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")})
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "outbox.db is a symbolic link" in p.stderr, p.stderr[-2000:]
    assert target.read_text() == "not the sidecar's\n"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


async def test_chmod_with_setuid_setgid_or_sticky_is_eperm_on_the_mount(tmp_path):
    """The mount's core: chmod u+s / g+s / +t of a file is EPERM with a reason (no record
    keeps those bits); plain permission bits change as before; a create asking for them gets
    the permission bits only."""
    import trio

    from memfuse.sidecar.inodes import FsError
    from test_faults import make_sidecar, start, write

    f = FakeControlPlane(seed=5)
    try:
        token = await f.setup("ws")
        sc = await make_sidecar(tmp_path, f, token)
        async with trio.open_nursery() as nursery:
            await start(sc, nursery)
            n = await write(sc, "x.sh", b"echo hi\n")
            for bad in (0o4755, 0o2755, 0o1755):
                with pytest.raises(FsError) as info:
                    sc.fs.setattr(n, mode=bad)
                assert info.value.errno == errno.EPERM and "setuid" in info.value.reason
            sc.fs.setattr(n, mode=0o750)
            assert stat.S_IMODE(n.mode) == 0o750
            sm = sc.fs.stores["default"]
            h = sc.fs.create(sm.root.ino, b"y.sh", 0o6755, os.O_WRONLY, 0, 0)
            sc.fs.release(h.fh)
            assert stat.S_IMODE(h.node.mode) == 0o755
            nursery.cancel_scope.cancel()
        sc.journal.close()
        await sc.client.aclose()
    finally:
        await f.aclose()
