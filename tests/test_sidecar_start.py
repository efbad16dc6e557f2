"""How the sidecar starts in a pod: bad input at start is one clear line and a non-zero exit
(what ``kubectl logs`` and the container's last state show), never a crash loop without a
reason; and ``--fuse-fd``: a privileged helper (``tests/fuse_fd_helper.py``, as a CSI node
plugin would) opens ``/dev/fuse`` and mounts, and a sidecar without any capability serves
the descriptor it was handed over a Unix socket."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mountutil import MEMFUSE, ControlPlane, is_mounted, refused_port, serve_and_mount, sh, stop, wait_for

HERE = Path(__file__).resolve().parent


def _mount(args: list[str], tmp: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([MEMFUSE, "mount", str(tmp / "mnt"), "--cache-dir", str(tmp / "cache"),
                           "--admin-listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")})


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    return errors[0]


def test_bad_input_at_start_is_one_line_and_a_nonzero_exit(tmp_path):
    token = tmp_path / "token"
    token.write_text("mfw_not-checked-before-the-control-plane\n")
    cp = ["--control-plane", "http://127.0.0.1:9"]

    # what an unset fieldRef / env value gives: an empty --workspace
    p = _mount([*cp, "--workspace=", "--token-file", str(token)], tmp_path)
    assert p.returncode == 2
    assert "--workspace is empty" in _one_error_line(p) and "MEMFUSE_WORKSPACE" in p.stderr

    p = _mount([*cp, "--workspace", "ws", "--token-file", str(tmp_path / "missing")], tmp_path)
    assert p.returncode == 2 and "cannot read token file" in _one_error_line(p)

    p = _mount([*cp, "--workspace", "ws", "--token-file", str(token),
                "--admin-token-file", str(tmp_path / "missing-admin")], tmp_path)
    assert p.returncode == 2 and "cannot read admin token file" in _one_error_line(p)

    p = _mount([*cp, "--workspace", "ws", "--token-file", str(token), "--fuse-fd", "987"], tmp_path)
    assert p.returncode == 2 and "descriptor 987 is not open" in _one_error_line(p)

    # nothing answers at the control plane's address, nothing is cached: give up with the reason
    with refused_port() as port:
        t0 = time.monotonic()
        p = _mount(["--control-plane", f"http://127.0.0.1:{port}", "--workspace", "ws",
                    "--token-file", str(token), "--start-timeout", "1.5"], tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    errors = [json.loads(ln) for ln in p.stderr.splitlines() if ln.startswith("{") and '"error"' in ln]
    assert len(errors) == 1, p.stderr[-2000:]
    msg = errors[0]["msg"]
    assert "no answer from the control plane" in msg and "within 1.5 s at start" in msg
    assert "connect_error" in msg
    assert "Traceback" not in p.stderr
    assert not is_mounted(tmp_path / "mnt")


def test_admin_address_in_use_is_one_clear_line(tmp_path):
    """A second ``memfuse mount`` on a host whose admin address is taken (the first one's
    default 127.0.0.1:9464) fails at once with the address and the flag to change, exit 1,
    nothing mounted."""
    import socket

    token = tmp_path / "token"
    token.write_text("mfw_not-checked-before-the-control-plane\n")
    with socket.socket() as taken, refused_port() as port:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        addr = "127.0.0.1:%d" % taken.getsockname()[1]
        t0 = time.monotonic()
        p = _mount(["--control-plane", f"http://127.0.0.1:{port}", "--workspace", "ws",
                    "--token-file", str(token), "--admin-listen", addr, "--start-timeout", "20"],
                   tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]
    assert time.monotonic() - t0 < 15  # before waiting for the control plane
    errors = [json.loads(ln) for ln in p.stderr.splitlines() if ln.startswith("{") and '"error"' in ln]
    assert len(errors) == 1, p.stderr[-2000:]
    msg = errors[0]["msg"]
    assert f"cannot serve the admin API on {addr} (Address already in use)" in msg, msg
    assert "--admin-listen HOST:PORT" in msg and "--admin-listen ''" in msg
    assert "Traceback" not in p.stderr
    assert not is_mounted(tmp_path / "mnt")


def test_a_second_sidecar_never_stacks_on_a_live_mount(tmp_path):
    """A second ``memfuse mount`` at the mountpoint of a running one (its own cache and
    admin address) exits 1 at once with one line saying the mountpoint is mounted already,
    before loading anything; the first mount goes on serving its files. Stacked, the second
    would hide the first's files and show the agent an empty tree."""
    from memfuse.sidecar.mount import fuse_mount_at

    with serve_and_mount(tmp_path) as (cp, sc):
        sh(f"printf 'still here\\n' > {sc.mountpoint}/default/kept.md", tmp_path)
        assert fuse_mount_at(sc.mountpoint) == "fuse.memfuse"
        assert fuse_mount_at(tmp_path) is None  # a plain directory
        second = tmp_path / "second"
        second.mkdir()
        t0 = time.monotonic()
        p = subprocess.run([MEMFUSE, "mount", str(sc.mountpoint), "--control-plane", cp.url,
                            "--workspace", "ws", "--token-file", str(sc.token_file),
                            "--cache-dir", str(second / "cache"), "--admin-listen", "127.0.0.1:0"],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env={k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")})
        assert p.returncode == 1, p.stderr[-2000:]
        assert time.monotonic() - t0 < 20
        errors = [json.loads(ln) for ln in p.stderr.splitlines() if ln.startswith("{") and '"error"' in ln]
        assert len(errors) == 1, p.stderr[-2000:]
        assert f"{sc.mountpoint} is already mounted (fuse.memfuse)" in errors[0]["msg"], errors[0]
        assert "Traceback" not in p.stderr
        with open("/proc/self/mountinfo") as f:  # one memfuse mount there, not two
            assert sum(1 for ln in f if ln.split()[4] == str(sc.mountpoint)) == 1
        assert sh(f"cat {sc.mountpoint}/default/kept.md", tmp_path).stdout == "still here\n"


def _auto_unmount_helpers(mountpoint: Path) -> list[int]:
    """pids of the ``fusermount3`` processes libfuse's ``auto_unmount`` left watching
    ``mountpoint`` (each unmounts it when its daemon's /dev/fuse descriptor closes)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"fusermount3") and str(mountpoint).encode() in argv:
            pids.append(int(d.name))
    return pids


def test_a_mount_left_by_a_killed_sidecar_is_cleaned_not_refused(tmp_path):
    """``kill -9`` of the sidecar together with its ``auto_unmount`` helper (a container killed
    at once, an OOM kill of the group) leaves a dead mount whose root the kernel still stats
    from its attribute cache. The next start must see that the daemon is gone (``statvfs``
    answers ENOTCONN), unmount it and serve, not refuse it as "already mounted"; the file
    whose close returned 0 before the kill is there."""
    from memfuse.sidecar.mount import fuse_mount_at, probe_mount

    with serve_and_mount(tmp_path) as (cp, sc):
        sh(f"printf 'before the kill\\n' > {sc.mountpoint}/default/kept.md", tmp_path)
        os.stat(sc.mountpoint)  # the root's attributes are in the kernel's cache now
        helpers = _auto_unmount_helpers(sc.mountpoint)
        assert helpers, "libfuse's auto_unmount helper (fusermount3) is not running"
        for pid in helpers:
            os.kill(pid, 9)
        sc.proc.kill()
        sc.proc.wait(10)
        try:
            assert fuse_mount_at(sc.mountpoint) == "fuse.memfuse"  # left behind, dead
            os.stat(sc.mountpoint)  # still answered from the cache: the case that misled us
            assert probe_mount(sc.mountpoint) == "stale"
            sc.start()
            assert sh(f"cat {sc.mountpoint}/default/kept.md", tmp_path).stdout == "before the kill\n"
            with open("/proc/self/mountinfo") as f:  # the dead mount is gone, one live one left
                assert sum(1 for ln in f if ln.split()[4] == str(sc.mountpoint)) == 1
            assert probe_mount(sc.mountpoint) == "live"
        finally:
            if sc.proc.poll() is not None:  # the restart failed: do not leave the dead mount
                subprocess.run(["fusermount3", "-uz", str(sc.mountpoint)], check=False)


def _listed(path: Path) -> bool:
    """``path`` is a mount point in /proc/mounts, found without touching it (a FUSE mount
    whose daemon has not started yet would block a stat)."""
    with open("/proc/mounts") as f:
        return any(line.split()[1] == os.path.abspath(path) for line in f)


def _capabilities(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapEff line")


RECEIVER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
_, fds, _, _ = socket.recv_fds(s, 16, 1)
s.close()
os.set_inheritable(fds[0], True)
os.execv(sys.argv[2], [sys.argv[2], "mount", *sys.argv[3:], "--fuse-fd", str(fds[0])])
"""


@pytest.mark.mount
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="the helper needs CAP_SYS_ADMIN (root) and setpriv")
def test_unprivileged_sidecar_serves_a_fuse_fd_mounted_by_a_helper(tmp_path):
    cp = ControlPlane(tmp_path).start()
    helper = sidecar = None
    mnt, sock = tmp_path / "mnt", tmp_path / "fuse.sock"
    mnt.mkdir()
    try:
        token = cp.setup_workspace("agent", ("notes",))
        helper = subprocess.Popen([sys.executable, str(HERE / "fuse_fd_helper.py"), str(mnt), str(sock)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert helper.stdout.readline().strip() == "listening", helper.stderr.read()
        assert _listed(mnt)
        log = tmp_path / "sidecar.log"
        # no capability at all, and none to gain from a setuid fusermount3: mount(2) is impossible
        sidecar = subprocess.Popen(
            ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
             sys.executable, "-c", RECEIVER, str(sock), MEMFUSE, str(mnt),
             "--control-plane", cp.url, "--workspace", "agent", "--token-file", str(token),
             "--cache-dir", str(tmp_path / "cache"), "--admin-listen", "127.0.0.1:0", "--log-format", "text"],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert helper.stdout.readline().strip() == "mounted"
        wait_for(lambda: (tmp_path / "cache" / "admin.sock").exists(), 60, "sidecar admin socket", sidecar, log)
        wait_for(lambda: sh(f"timeout 5 test -d {mnt}/notes", tmp_path, check=False).returncode == 0,
                 60, "the store in the fd-served mount", sidecar, log)
        assert _capabilities(sidecar.pid) == 0
        sh(f"timeout 10 bash -c 'echo from-fd > {mnt}/notes/a.md && cat {mnt}/notes/a.md'", tmp_path)
        assert stop(sidecar) == 0  # drains, closes the fd; it does not (cannot) unmount
        records, _ = cp.call("snapshot", "notes", content=True)
        assert [(r.path, r.content) for r in records] == [("a.md", "from-fd\n")]
        assert "mounted" in log.read_text()
        helper.stdin.write("unmount\n")
        helper.stdin.flush()
        assert helper.stdout.readline().strip() == "unmounted"
        assert helper.wait(10) == 0
        assert not _listed(mnt)
    finally:
        if sidecar is not None:
            stop(sidecar)
        if helper is not None and helper.poll() is None:
            helper.kill()
            helper.wait(10)
        if _listed(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)
        cp.stop()


@pytest.mark.mount
def test_real_sidecar_admin_api_needs_the_token_for_mount_changes(tmp_path):
    """A real sidecar with --admin-token-file: DELETE /v1/mounts/<store> over TCP without the
    token is refused and the store stays mounted; with it, the store goes; /readyz answers
    either way. `memfuse mounts add` over the 0600 Unix socket brings it back, no token."""
    import httpx

    from memfuse.sidecar.admin import read_status_file
    from mountutil import Rig

    with Rig(tmp_path) as rig:
        rig.workspace("ws", ("notes", "team"))
        admin_token = tmp_path / "admin.token"
        admin_token.write_text("sidecar-admin-secret\n")
        sc = rig.sidecar("ws", "--admin-token-file", str(admin_token))
        mnt = sc.mountpoint
        url = "http://" + read_status_file(mnt)["admin"]

        def stores() -> list[str]:
            return sorted(n for n in os.listdir(mnt) if not n.startswith("."))

        sock = tmp_path / "cache" / "admin.sock"
        assert (os.stat(sock).st_mode & 0o777) == 0o600
        with httpx.Client(base_url=url, timeout=30) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = c.delete("/v1/mounts/notes", headers=headers)
                assert r.status_code == 401 and r.json()["code"] == "unauthorized"
                assert c.get("/readyz").status_code == 200
            assert stores() == ["notes", "team"]
            r = c.delete("/v1/mounts/notes", headers={"Authorization": "Bearer sidecar-admin-secret"})
            assert r.status_code == 200 and r.json()["mounted"] is False
            assert c.get("/readyz").status_code == 200
        wait_for(lambda: stores() == ["team"], 10, "notes gone from the mount")
        p = subprocess.run([MEMFUSE, "mounts", "add", "notes", "--cache-dir", str(tmp_path / "cache")],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout == "notes: mounted\n", p.stderr
        wait_for(lambda: stores() == ["notes", "team"], 10, "notes back")
        assert sc.stop() == 0
        assert not sock.exists()


def test_the_sidecar_process_raises_the_collectors_first_threshold(tmp_path, monkeypatch):
    """``run_mount`` (the entry point of ``memfuse mount``) sets the sidecar's garbage
    collector thresholds (``mount.tune_gc``) before the sidecar runs: with CPython's first
    threshold of 700, the live growth of a write (a node, a mirror entry) ran a collection
    every ~25 files and a full one of the whole heap every 1,000-2,000 (bench/README.md,
    "The close path, session 15: sidecar")."""
    import gc

    from memfuse.sidecar import mount as mount_mod

    seen: list[tuple[int, ...]] = []

    def run(main, *args, **kwargs):  # trio.run: the thresholds the sidecar would run with
        main().close()  # (never started)
        seen.append(gc.get_threshold())
        return 0

    before = gc.get_threshold()
    monkeypatch.setattr(mount_mod, "setup_logging", lambda *a, **k: None)  # process-wide
    monkeypatch.setattr(mount_mod.trio, "run", run)
    try:
        config = mount_mod.MountConfig(mountpoint=tmp_path / "mnt", workspace="ws",
                                       cache_dir=tmp_path / "cache")
        assert mount_mod.run_mount(config, lambda: None) == 0
    finally:
        gc.set_threshold(*before)
    assert len(seen) == 1 and seen[0][0] >= 50_000, seen  # CPython's default: 700
