"""`memfuse dev`, the README's run command, end to end: the issue's done-criteria flow, a restart,
the CLI's history on the dev database, and the same as a normal (non-root) user."""
from __future__ import annotations

import os
import pwd
import resource
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from mountutil import MEMFUSE, is_mounted, sh, stop, unmount, wait_for

pytestmark = pytest.mark.mount


def start_dev(mnt: Path, env: dict, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([MEMFUSE, "dev", str(mnt)], stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, **env))
    wait_for(lambda: is_mounted(mnt) and (mnt / "default").is_dir(), 60,
             "memfuse dev", proc, log)
    return proc


def interrupt(proc: subprocess.Popen, timeout: float = 30) -> int:
    """Ctrl-C: SIGINT and wait for a clean exit."""
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout)


def _console_login(log: Path, mnt: Path | None = None) -> None:
    """The one-time console link `memfuse dev` printed logs a browser in, once; with ``mnt``,
    the prompt preview shows the paths the agents get (the real mountpoint)."""
    import re

    import httpx

    links = re.findall(r"http://127\.0\.0\.1:\d+/ui/login/[A-Za-z0-9_-]+", log.read_text())
    assert links, log.read_text()
    with httpx.Client(timeout=30) as browser:
        r = browser.get(links[-1], follow_redirects=True)
        assert r.status_code == 200 and "/ui/stores/default" in r.text  # logged in: the stores page
        assert "memfuse_session" in browser.cookies
        if mnt is not None:
            base = links[-1].split("/ui/")[0]
            page = browser.get(f"{base}/ui/workspaces/dev/context").text
            assert f"{mnt}/default/" in page and "/mnt/memory" not in page, page[-3000:]
    with httpx.Client(timeout=30) as other:
        r = other.get(links[-1], follow_redirects=True)
        assert "already used" in r.text and "memfuse_session" not in other.cookies


def _streams_open(log: Path) -> float:
    """``memfuse_server_streams`` (streams open now) from the /metrics of the control plane
    `memfuse dev` serves at the console address it printed last."""
    import re

    import httpx

    base = re.findall(r"console at (http://127\.0\.0\.1:\d+)/ui/", log.read_text())[-1]
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(ln.split()[-1]) for ln in text.splitlines()
              if ln.startswith("memfuse_server_streams ")]
    assert values, text
    return values[0]


@pytest.mark.timeout(300)  # two starts and a dozen CLI runs: 125 s were seen on a busy 2-CPU machine
def test_readme_flow_restart_and_history(tmp_path):
    env = {"MEMFUSE_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "MEMFUSE_CONSOLE_LISTEN": "127.0.0.1:0"}
    mnt, log = tmp_path / "memory", tmp_path / "dev.log"
    proc = start_dev(mnt, env, log)
    try:
        _console_login(log, mnt.resolve())
        sh('echo "prefers tea" > memory/default/prefs.md', tmp_path)
        assert sh("grep -r tea memory/", tmp_path).stdout == "memory/default/prefs.md:prefers tea\n"
        sh("sed -i s/tea/coffee/ memory/default/prefs.md", tmp_path)
        # a refusal's console line names store, path, errno and reason code (not content)
        # (refused at the write: printf fails with the errno)
        r = sh(r"printf 'caf\xe9\n' > memory/default/bad.md", tmp_path, check=False)
        assert r.returncode == 1 and "Invalid or incomplete multibyte" in r.stderr, r.stderr
        wait_for(lambda: "refused store=default path=bad.md errno=EILSEQ code=invalid_content"
                 in log.read_text(), 30, "the refusal's log line")
        sh("rm memory/default/bad.md", tmp_path)
        # files with local-only names (a backup, a ticket named like vim's probe) are kept
        sh("echo backup > memory/default/draft.md.bak~ && mkdir -p memory/default/tickets && "
           "echo body > memory/default/tickets/4913", tmp_path)
        assert interrupt(proc) == 0
        assert not is_mounted(mnt)
        # a clean stop closes the database: its WAL is checkpointed into dev.db and removed
        assert not (tmp_path / "home" / "dev.db-wal").exists()
        assert not (tmp_path / "home" / "dev.db-shm").exists()
        proc = start_dev(mnt, env, log)
        assert (mnt / "default" / "prefs.md").read_text() == "prefers coffee\n"
        assert (mnt / "default" / "draft.md.bak~").read_text() == "backup\n"
        assert (mnt / "default" / "tickets" / "4913").read_text() == "body\n"
        assert os.getxattr(mnt / "default" / "tickets" / "4913", "user.memfuse.state") == b"local"
        # a second memfuse dev on the same database is refused at once, in plain words. The
        # lock is taken without waiting (LOCK_NB), so what "at once" can lose is work done
        # before the check: measured as the process's CPU time, which a busy machine does
        # not inflate as it does wall time (17 s were seen under load for a ~2 s start)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        second = subprocess.run([MEMFUSE, "dev", str(tmp_path / "memory2")], env=dict(os.environ, **env),
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        dev_db = (tmp_path / "home" / "dev.db").resolve()
        assert second.returncode == 1, second.stderr
        assert second.stderr.strip() == (f"Error: another memfuse dev (pid {proc.pid}) is using {dev_db}; "
                                         "stop it first"), second.stderr
        # ~1.5 s of CPU here (the CLI and its imports; a whole start with the mount is ~3.3 s)
        assert took < 4, took
        # another memfuse dev (its own MEMFUSE_HOME) on this live mountpoint: one line, before
        # it builds, prints or mounts anything (no console link, no "unmounted" it never did)
        other = {**os.environ, **env, "MEMFUSE_HOME": str(tmp_path / "home2")}
        third = subprocess.run([MEMFUSE, "dev", str(mnt)], env=other, capture_output=True, text=True,
                               timeout=60, stdin=subprocess.DEVNULL)
        assert third.returncode == 1, third.stderr
        assert third.stderr.strip() == (f"Error: {mnt} is already mounted (fuse.memfuse): another "
                                        "sidecar or memfuse dev is serving it; stop it (or unmount "
                                        "it) first, or choose another mountpoint"), third.stderr
        assert (mnt / "default" / "prefs.md").read_text() == "prefers coffee\n"  # still served
        hist = sh(f"{MEMFUSE} history default prefs.md", tmp_path, env=env).stdout
        lines = [ln for ln in hist.splitlines() if ln.strip()]
        assert any("created" in ln for ln in lines) and any("modified" in ln for ln in lines), hist
        assert sum(1 for ln in lines if "created" in ln or "modified" in ln) == 2, hist
        # the actor names the user and host, the same before and after the restart
        import getpass
        import socket
        actor = f"ws:dev/{getpass.getuser()}@{socket.gethostname()}"
        assert all(actor in ln for ln in lines if "created" in ln or "modified" in ln), hist
        assert sh(f"{MEMFUSE} show default prefs.md --version 1", tmp_path, env=env).stdout == "prefers tea\n"
        # a restore through the CLI reaches the running mount through the change feed
        sh(f"{MEMFUSE} restore default prefs.md --version 1", tmp_path, env=env)
        wait_for(lambda: (mnt / "default" / "prefs.md").read_text() == "prefers tea\n", 30,
                 "restored content on the mount")
        # dev serves its app on loopback like `memfuse serve`: the sidecar's feeds stream (the
        # workspace events and the store's changes), no long-poll fallback
        assert _streams_open(log) >= 2
        assert "does not stream" not in log.read_text()
    finally:
        stop(proc)
        unmount(mnt)


def test_dev_refuses_a_nonempty_mountpoint_unless_asked(tmp_path):
    """An existing ``memory/existing.txt`` would be hidden while dev runs: refused with the
    reason and the flag (nothing mounted, the file untouched); ``--nonempty`` mounts over it
    with a warning, and the file is there again after Ctrl-C."""
    env = {"MEMFUSE_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "MEMFUSE_CONSOLE_LISTEN": "off"}
    mnt, log = tmp_path / "memory", tmp_path / "dev.log"
    mnt.mkdir()
    (mnt / "existing.txt").write_text("mine\n")
    p = subprocess.run([MEMFUSE, "dev", str(mnt)], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, env=dict(os.environ, **env))
    assert p.returncode == 1, p.stderr
    assert f"Error: {mnt} is not empty (1 entries: existing.txt)" in p.stderr
    assert "--nonempty" in p.stderr and "Traceback" not in p.stderr
    assert not is_mounted(mnt) and (mnt / "existing.txt").read_text() == "mine\n"
    proc = subprocess.Popen([MEMFUSE, "dev", str(mnt), "--nonempty"], stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, **env))
    try:
        wait_for(lambda: is_mounted(mnt) and (mnt / "default").is_dir(), 60, "memfuse dev",
                 proc, log)
        assert "warning: " + f"{mnt} is not empty (1 entries: existing.txt)" in log.read_text()
        assert not (mnt / "existing.txt").exists()  # hidden by the mount
        # with the console off the app still listens on loopback, for the sidecar only: a
        # write commits through it
        (mnt / "default" / "n.md").write_text("noted\n")
        assert os.getxattr(mnt / "default" / "n.md", "user.memfuse.state") == b"clean"
        assert "console at" not in log.read_text()
        assert interrupt(proc) == 0
    finally:
        stop(proc)
        unmount(mnt)
    assert (mnt / "existing.txt").read_text() == "mine\n"


def _blocked_dirs(uid: int, reach: list[Path]) -> dict[Path, set[str]]:
    """The directories on the way to the paths ``reach`` (resolved) that user ``uid`` may not
    search (not its own, no o+x), each with the names of its entries on the way."""
    blocked: dict[Path, set[str]] = {}
    for p in reach:
        p = p.resolve()
        for parent, child in zip(p.parents, [p, *p.parents]):
            st = parent.stat()
            if st.st_uid != uid and not st.st_mode & 0o001:
                blocked.setdefault(parent, set()).add(child.name)
    return blocked


@contextmanager
def _user_view(priv: Path, uid: int, reach: list[Path]) -> Iterator[int]:
    """A mount namespace of this test's own, held by a root ``sleep`` (its pid yielded; enter
    it with ``nsenter -t PID -m``), in which the normal user ``uid`` reaches every path of
    ``reach`` and may open /dev/fuse, as on a normal Debian machine, with nothing shared
    changed: this image keeps Python under /root (0700) and may have /dev/fuse 0600, and
    chmodding those (as this test once did, restoring them afterwards) let two runs at once
    undo each other's modes (attack18 F8). In the namespace each directory on the way that
    the user may not search (``_blocked_dirs``) is covered by a tmpfs (0755) holding only
    its entries on the way, bind-mounted from the real ones, and /dev/fuse by a 0666 node of
    the same device (on a tmpfs at ``priv/stash``, an empty directory here). A FUSE mount
    made inside lives in the namespace only; the namespace ends with the holder (stopped on
    leaving) and the processes started in it."""
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                               "sleep", "1800"], stdin=subprocess.DEVNULL)
    try:
        mine = os.readlink("/proc/self/ns/mnt")
        wait_for(lambda: os.readlink(f"/proc/{holder.pid}/ns/mnt") != mine, 30,
                 "the test's mount namespace", holder)
        q = lambda p: shlex.quote(str(p))
        stash = priv / "stash"
        stash.mkdir()
        dev = os.stat("/dev/fuse").st_rdev
        script = ["set -eu", f"mount -t tmpfs -o mode=0700 tmpfs {q(stash)}",
                  f"mknod -m 0666 {q(stash / 'fuse')} c {os.major(dev)} {os.minor(dev)}",
                  f"mount --bind {q(stash / 'fuse')} /dev/fuse"]
        blocked = _blocked_dirs(uid, reach)
        for i, d in enumerate(sorted(blocked, key=lambda d: len(d.parts))):  # outer ones first
            ways = [(d / name, stash / f"{i}-{name}", "mkdir" if (d / name).is_dir() else "touch")
                    for name in sorted(blocked[d])]
            script += [f"{make} {q(kept)} && mount --bind {q(real)} {q(kept)}"
                       for real, kept, make in ways]
            script.append(f"mount -t tmpfs -o mode=0755 tmpfs {q(d)}")
            script += [f"{make} {q(real)} && mount --bind {q(kept)} {q(real)}"
                       for real, kept, make in ways]
        subprocess.run(["nsenter", "-t", str(holder.pid), "-m", "--", "sh", "-c",
                        "\n".join(script)], check=True, capture_output=True, timeout=60)
        yield holder.pid
    finally:
        stop(holder)


def _mounted_in(pid: int, path: Path) -> bool:
    """Whether ``path`` is a mountpoint in the mount namespace of process ``pid``."""
    with open(f"/proc/{pid}/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test user")
def test_dev_as_normal_user(tmp_path):
    """``memfuse dev`` run by a normal user: it mounts (fusermount3), the user's tools write
    and edit through it, files are the user's, Ctrl-C unmounts. The user's home is a private
    directory of this run under /tmp (not under pytest's root-only one), and what the user
    must reach on this image is made reachable in a mount namespace of the test's own
    (``_user_view``), so two runs at once never touch each other's modes."""
    user = "memfuse-test"
    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", user],
                       check=True, capture_output=True)
    pw = pwd.getpwnam(user)
    priv = Path(tempfile.mkdtemp(prefix="memfuse-normal-user-"))  # this run's, 0700
    try:
        os.chmod(priv, 0o755)
        home = priv / "u"
        home.mkdir()
        os.chown(home, pw.pw_uid, pw.pw_gid)
        reach = [Path(sys.executable), Path(MEMFUSE), Path(__file__).parent, home]
        with _user_view(priv, pw.pw_uid, reach) as ns:
            # the console on a port of the kernel's choice: the default one's "a free port
            # when taken" is probed before the bind, which another dev can take meanwhile
            env = {"HOME": str(home), "MEMFUSE_HOME": str(home / "data"),
                   "MEMFUSE_CONSOLE_LISTEN": "127.0.0.1:0"}
            mnt, log = home / "memory", tmp_path / "dev-user.log"
            as_user = ["nsenter", "-t", str(ns), "-m", f"--wd={home}", "--", "setpriv",
                       f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--"]
            # without allow_other only the mounting user may enter the mount (root included),
            # so every check runs as that user, in the namespace
            mounted = lambda: _mounted_in(ns, mnt) and subprocess.run(
                [*as_user, "test", "-d", str(mnt / "default")], timeout=30).returncode == 0
            proc = subprocess.Popen([*as_user, MEMFUSE, "dev", str(mnt)], stdout=log.open("ab"),
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, **env))
            try:  # nsenter and setpriv exec: proc is memfuse dev itself, signals reach it
                wait_for(mounted, 60, "memfuse dev", proc, log)
                out = sh(shlex.join(as_user) + f" bash -c 'echo \"prefers tea\" > "
                         f"{mnt}/default/prefs.md && sed -i s/tea/coffee/ {mnt}/default/prefs.md"
                         f" && grep -r coffee {mnt} && stat -c %u {mnt}/default/prefs.md'",
                         home).stdout
                assert out == f"{mnt}/default/prefs.md:prefers coffee\n{pw.pw_uid}\n"
                assert interrupt(proc) == 0, log.read_text()[-2000:]
                assert not _mounted_in(ns, mnt)
            finally:
                stop(proc)
    finally:
        shutil.rmtree(priv, ignore_errors=True)
