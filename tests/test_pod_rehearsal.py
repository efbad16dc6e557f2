"""The Kubernetes pod's mount topology, played on this machine with ``unshare`` (no cluster).

What the kubelet builds for ``deploy/kubernetes/`` (docs/DEPLOY.md, "Topology"):

- the node: a private mount namespace of its own (so nothing here reaches the machine's),
  where the pod's ``memory`` emptyDir is a shared mount (``mount --make-shared``);
- the memfuse sidecar: a mount namespace whose copy of that directory is a *peer* (the
  volume mount's ``mountPropagation: Bidirectional``) and a PID namespace of its own (a
  container: killing it kills every process in it, the libfuse ``auto_unmount`` helper too);
  it mounts FUSE on the directory, and the mount propagates to the node;
- the agent: a mount namespace whose mounts are all *slaves* of the node's
  (``mountPropagation: HostToContainer``), made before the sidecar mounts, so what it sees
  arrives by propagation, not by copy.

Shown: the agent sees the stores; ``kill -9`` of the sidecar gives the agent ENOTCONN
("Transport endpoint is not connected"), never a hang; a restarted sidecar cleans the stale
mount and the agent's new opens work again within a bound; SIGTERM drains the outbox (the
agent's last write reaches the control plane) and the agent then sees an empty directory.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mountutil import MEMFUSE, ControlPlane

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"),
                       reason="needs root, unshare and nsenter"),
]

RESTART_BOUND_S = 60.0  # sidecar restart (resume from the cache) until the agent's opens work


def _holder(*unshare_args: str, ns_of: int | None = None) -> subprocess.Popen:
    """A process that only holds a new mount namespace open (``sleep``)."""
    enter = ["nsenter", f"--mount=/proc/{ns_of}/ns/mnt", "--"] if ns_of else []
    return subprocess.Popen([*enter, "unshare", "--mount", *unshare_args, "--", "sleep", "600"],
                            stdin=subprocess.DEVNULL)


def _ns_pid(holder: subprocess.Popen) -> int:
    """The pid of the process running in the new namespace (``sleep``, or ``memfuse``: the
    ``unshare`` child for ``--fork``), once it has been exec'd."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = _children(holder.pid)
        # nsenter forks unshare, which execs sleep (or forks, for --fork): take the leaf
        pid = holder.pid
        while kids:
            pid = kids[0]
            kids = _children(pid)
        if _comm(pid) in ("sleep", "memfuse"):  # exec'd: the namespace is set up
            return pid
        time.sleep(0.02)
    raise AssertionError("namespace process did not start")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _in(pid: int, cmd: str, timeout: float = 15) -> subprocess.CompletedProcess:
    """Run ``cmd`` (bash) in the mount namespace of ``pid``, bounded by ``timeout`` inside and out."""
    return subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "timeout", "-s", "KILL",
                           str(timeout), "bash", "-c", cmd],
                          capture_output=True, text=True, timeout=timeout + 10, stdin=subprocess.DEVNULL)


def _wait(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"timed out ({timeout:g} s) waiting for {what}")


def test_pod_mount_topology_with_unshare(tmp_path):
    cp = ControlPlane(tmp_path).start()
    vol = tmp_path / "memory"  # the pod's emptyDir, at the same path in every namespace
    vol.mkdir()
    os.chmod(vol, 0o777)  # as an emptyDir is
    cache = tmp_path / "cache"
    token = cp.setup_workspace("agent-1", ("notes", "team"))
    node = agent = None
    sidecars: list[subprocess.Popen] = []
    logs = tmp_path / "sidecar.log"

    def start_sidecar() -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            ["nsenter", f"--mount=/proc/{node_pid}/ns/mnt", "--",
             "unshare", "--mount", "--propagation", "unchanged", "--pid", "--fork", "--",
             MEMFUSE, "mount", str(vol), "--control-plane", cp.url, "--workspace", "agent-1",
             "--token-file", str(token), "--cache-dir", str(cache), "--admin-listen", "127.0.0.1:0",
             "--log-format", "text", "--drain-timeout", "20"],
            stdout=logs.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        sidecars.append(proc)
        return proc, _ns_pid(proc)

    def agent_sees(cmd: str, expect: str) -> bool:
        p = _in(agent_pid, cmd, timeout=5)
        return p.returncode == 0 and p.stdout == expect

    try:
        node = _holder("--propagation", "private")
        node_pid = _ns_pid(node)
        r = _in(node_pid, f"mount --bind {vol} {vol} && mount --make-shared {vol} && "
                          f"findmnt -no PROPAGATION {vol}")
        assert r.returncode == 0 and r.stdout.strip() == "shared", r.stderr
        agent = _holder("--propagation", "slave", ns_of=node_pid)
        agent_pid = _ns_pid(agent)
        assert _in(agent_pid, f"findmnt -no PROPAGATION {vol}").stdout.strip() == "private,slave"
        assert _in(agent_pid, f"ls -A {vol}").stdout == ""

        # 1. the sidecar mounts; the agent sees the stores, and writes through them
        sc, sc_pid = start_sidecar()
        _wait(lambda: agent_sees(f"ls {vol}", "notes\nteam\n"), 60, "the stores in the agent's namespace")
        r = _in(agent_pid, f"echo first > {vol}/notes/a.md && cat {vol}/notes/a.md")
        assert r.returncode == 0 and r.stdout == "first\n", r.stderr
        assert "memfuse" in _in(node_pid, f"findmnt -no FSTYPE {vol}").stdout
        assert sc_pid != sc.pid and _comm(sc_pid) == "memfuse"

        # 2. kill -9 of the sidecar container: the agent gets ENOTCONN at once, never a hang
        _wait(lambda: any(p.path == "a.md" for p in cp.call("snapshot", "notes")[0]), 30, "a.md committed")
        os.kill(sc_pid, signal.SIGKILL)  # pid 1 of its PID namespace: every process in it dies
        sc.wait(30)
        t0 = time.monotonic()
        r = _in(agent_pid, f"cat {vol}/notes/a.md", timeout=10)
        assert r.returncode != 0 and "Transport endpoint is not connected" in r.stderr, (r.returncode, r.stderr)
        assert time.monotonic() - t0 < 5
        r = _in(agent_pid, f"ls {vol}", timeout=10)
        assert r.returncode != 0 and "Transport endpoint is not connected" in r.stderr

        # 3. the kubelet restarts the sidecar: it cleans the stale mount, resumes from the
        #    cache, and the agent's new opens work again within the bound
        t0 = time.monotonic()
        sc, sc_pid = start_sidecar()
        took = _wait(lambda: agent_sees(f"cat {vol}/notes/a.md", "first\n"), RESTART_BOUND_S,
                     "the agent's opens after the sidecar restarted")
        print(f"sidecar restart until the agent reads again: {took:.2f} s")
        assert "stale FUSE mount found" in logs.read_text()
        assert time.monotonic() - t0 < RESTART_BOUND_S
        # exactly one memfuse mount on the directory, in the node and in the agent
        for pid in (node_pid, agent_pid):
            fstypes = _in(pid, f"findmnt -rno FSTYPE -M {vol} --all").stdout.split()
            assert fstypes.count("fuse.memfuse") == 1, (pid, fstypes)

        # 4. SIGTERM (pod deletion): the agent's last write drains to the control plane, the
        #    mount goes, and the agent sees the empty emptyDir, not a hang
        r = _in(agent_pid, f"echo last > {vol}/team/b.md")
        assert r.returncode == 0, r.stderr
        os.kill(sc_pid, signal.SIGTERM)
        assert sc.wait(40) == 0, logs.read_text()[-3000:]
        assert [(x.path, x.content) for x in cp.call("snapshot", "team", content=True)[0]] == [("b.md", "last\n")]
        r = _in(agent_pid, f"ls -A {vol}", timeout=10)
        assert r.returncode == 0 and r.stdout == "", (r.stdout, r.stderr)
        assert "fuse" not in _in(node_pid, f"findmnt -rno FSTYPE -M {vol} --all").stdout
        # the bare directory was made 0755: other users' writes while unmounted fail (EACCES)
        assert (os.stat(vol).st_mode & 0o777) == 0o755
    finally:
        for p in sidecars:
            if p.poll() is None:
                for kid in _children(p.pid):
                    try:
                        os.kill(kid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.kill()
                p.wait(10)
        for h in (agent, node):  # the namespaces, and every mount in them, go with their last process
            if h is not None and h.poll() is None:
                for kid in _children(h.pid):
                    try:
                        os.kill(kid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                h.kill()
                h.wait(10)
        cp.stop()
