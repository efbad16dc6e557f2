"""The prompt block names the real mountpoint (issue 7 item 6).

On a real mount: ``MOUNT/.memfuse/context.md`` and the sidecar admin API's ``/v1/context`` carry
the block rendered for the mount's own path, and follow attach / detach and ``MEMORY.md``
changes made here or elsewhere. During ``memfuse dev``, ``memfuse context`` names the dev
mountpoint (and the server default again once the dev mount has stopped). Unit tests of the
pieces (placeholder, mount info and its lock) run without a mount.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import httpx
import pytest

from memfuse.sidecar.control import MOUNT_INFO, running_mount, write_mount_info
from mountutil import MEMFUSE, serve_and_mount, sh, stop, unmount, wait_for
from test_dev import interrupt, start_dev


def _context(mnt: Path) -> str:
    return sh("cat .memfuse/context.md", mnt, timeout=10).stdout


# ------------------------------------------------------------------ without a mount
def test_running_mount_needs_the_held_cache_lock(tmp_path):
    """mount.json alone is not a running mount: the cache lock must be held (a killed sidecar
    leaves the file behind but not the lock)."""
    assert running_mount(tmp_path) is None
    write_mount_info(tmp_path, {"mountpoint": "/x/memory", "workspace": "dev", "pid": 1})
    assert json.loads((tmp_path / MOUNT_INFO).read_text())["mountpoint"] == "/x/memory"
    (tmp_path / "lock").touch()
    assert running_mount(tmp_path) is None  # nobody holds the lock
    fd = os.open(tmp_path / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert running_mount(tmp_path)["mountpoint"] == "/x/memory"
    finally:
        os.close(fd)
    assert running_mount(tmp_path) is None


def test_context_placeholder_names_the_mountpoint():
    from memfuse.sidecar.control import ControlFiles

    class FsStub:
        metrics = None
        committer = None

    c = ControlFiles(FsStub())
    c.mount_root = "/srv/agent/memory"
    text = c.content("context").decode()
    assert "`/srv/agent/memory/`" in text and "not available yet" in text
    assert "listed with the reason in `/srv/agent/memory/.memfuse/errors.log`" in text
    c.set_context("# Memory\nblock\n")
    assert c.content("context") == b"# Memory\nblock\n"
    c.set_context(None, "the control plane answered 503")  # a failed refresh keeps the block
    assert c.content("context") == b"# Memory\nblock\n"
    assert c.context_error == "the control plane answered 503"


# ------------------------------------------------------------------ real mounts
@pytest.mark.mount
def test_context_md_follows_the_mount(tmp_path):
    with serve_and_mount(tmp_path) as (cp, sc):
        mnt = sc.mountpoint.resolve()
        assert "context.md" in os.listdir(mnt / ".memfuse")
        wait_for(lambda: f"## Store `default` at `{mnt}/default/`" in _context(mnt), 20,
                 "context.md naming the mountpoint")
        assert "/mnt/memory" not in _context(mnt)
        assert f"`{mnt}/default/MEMORY.md` does not exist yet" in _context(mnt)
        assert f"listed with the reason in `{mnt}/.memfuse/errors.log`" in _context(mnt)

        # MEMORY.md written here: the block follows once it is committed
        sh('echo "- prefs.md: prefers tea" > default/MEMORY.md', mnt)
        wait_for(lambda: "prefers tea" in _context(mnt), 20, "local MEMORY.md in context.md")

        # MEMORY.md changed elsewhere (another writer, through the API)
        rec = next(r for r in cp.call("snapshot", "default", content=False)[0]
                   if r.path == "MEMORY.md")
        cp.call("update_record", "default", rec.id, "- prefs.md: prefers coffee\n")
        wait_for(lambda: "prefers coffee" in _context(mnt), 30, "remote MEMORY.md in context.md")

        # attach a second store: it is mounted and the block lists it
        cp.call("create_store", "team", description="shared notes")
        cp.call("attach", "ws", "team", access="read_only")
        wait_for(lambda: f"## Store `team` at `{mnt}/team/` (read-only)" in _context(mnt), 30,
                 "attached store in context.md")

        # the admin API serves the same block on its Unix socket; on TCP (no admin token
        # here) memory is refused, probes stay open
        status = json.loads((mnt / ".memfuse" / "status.json").read_text())
        r = httpx.get(f"http://{status['admin']}/v1/context", timeout=15)
        assert r.status_code == 403 and "prefers coffee" not in r.text
        assert httpx.get(f"http://{status['admin']}/healthz", timeout=15).status_code == 200
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sc.cache_dir / "admin.sock")), timeout=15) as c:
            r = c.get("http://sidecar/v1/context")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/markdown")
        assert f"`{mnt}/team/`" in r.text and "prefers coffee" in r.text

        # detach: gone from the block too
        cp.call("detach", "ws", "team")
        wait_for(lambda: "`team`" not in _context(mnt), 30, "detached store left context.md")
        # the mount info names this mount while it runs
        assert running_mount(sc.cache_dir)["mountpoint"] == str(mnt)
    assert running_mount(sc.cache_dir) is None


@pytest.mark.mount
def test_memfuse_context_names_the_dev_mount(tmp_path):
    env = {"MEMFUSE_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    mnt, log = tmp_path / "memory", tmp_path / "dev.log"
    proc = start_dev(mnt, env, log)
    try:
        out = sh(f"{MEMFUSE} context --workspace dev", tmp_path, env=env).stdout
        assert f"## Store `default` at `{mnt.resolve()}/default/`" in out, out
        assert "/mnt/memory" not in out
        wait_for(lambda: f"`{mnt.resolve()}/default/`" in _context(mnt), 20,
                 "context.md of the dev mount")
        # an explicit --mount-root still wins
        out = sh(f"{MEMFUSE} context --workspace dev --mount-root /agents/mem", tmp_path,
                 env=env).stdout
        assert "`/agents/mem/default/`" in out
        assert interrupt(proc) == 0
        # no dev mount running: the server's default again
        out = sh(f"{MEMFUSE} context --workspace dev", tmp_path, env=env).stdout
        assert "`/mnt/memory/default/`" in out, out
    finally:
        stop(proc)
        unmount(mnt)
