"""A micro-benchmark of the control plane's hot write path (not a test, never run by pytest).

It starts ``memfuse serve`` on a SQLite file in a temporary directory, sets up a workspace
with a store and a workspace token (a database token, as a sidecar has), then drives the
server over real loopback HTTP with one keep-alive ``httpx.Client``, the way a sidecar
commits files: per round a ``POST`` create, a ``PUT`` update with ``If-Match``, a ``POST``
move with ``If-Match`` and a ``DELETE`` with ``If-Match``, each with an ``Idempotency-Key``
and ``X-Memfuse-Instance``. Optionally a second client holds the store's change-feed
long-poll open the whole time (``wait=25``, with content, as the sidecar does), passing
``skip_actor`` with the writer's own actor when asked.

Reported per operation: wall-clock ms per request (median and mean) and the server
process's CPU ms per request (user + system from ``/proc/PID/stat``, measured around each
phase, so the long-poller's work on behalf of that phase is included).

Run it from the repository root::

    .venv/bin/python bench/perfbench.py
    .venv/bin/python bench/perfbench.py --n 500 --no-poller

For a profile, start it with ``keep_server=True`` and attach ``py-spy record --pid PID``.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

__all__ = ["run", "server_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds consumed so far by process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"memfuse serve exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("memfuse serve did not listen")


class _Poller(threading.Thread):
    """Holds the store's change-feed long-poll open, as a sidecar does; counts wake-ups."""

    def __init__(self, url: str, token: str, store: str, skip_actor: str | None) -> None:
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        self.store, self.skip_actor = store, skip_actor
        self.stop = threading.Event()
        self.wakeups = 0
        self.changes = 0
        self.seq = 0

    def run(self) -> None:
        while not self.stop.is_set():
            params: dict[str, object] = {"after": self.seq, "wait": 25, "content": "true"}
            if self.skip_actor:
                params["skip_actor"] = self.skip_actor
            try:
                r = self.client.get(f"/v1/stores/{self.store}/changes", params=params)
            except httpx.HTTPError:
                if self.stop.is_set():
                    return
                raise
            if r.status_code == 200:
                page = r.json()
                self.wakeups += 1
                self.changes += len(page["changes"])
                self.seq = max(self.seq, page["seq"])

    def close(self) -> None:
        self.stop.set()
        self.client.close()


def _phase(pid: int, fn, n: int) -> dict[str, float]:
    times = []
    cpu0 = server_cpu_seconds(pid)
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    cpu = server_cpu_seconds(pid) - cpu0
    return {
        "wall_ms_p50": round(statistics.median(times) * 1000, 3),
        "wall_ms_mean": round(statistics.fmean(times) * 1000, 3),
        "server_cpu_ms": round(cpu * 1000 / n, 3),
    }


def run(
    n: int = 300,
    *,
    poller: bool = True,
    skip_actor: bool = True,
    prefill: int = 0,
    idempotency: bool = True,
    keep_server: bool = False,
    profile: str | None = None,
    profile_gil: bool = False,
    quiet: bool = False,
) -> dict[str, dict[str, float]]:
    """Run the benchmark: ``n`` files, each created, updated, moved and deleted in turn.

    ``poller``: keep a change-feed long-poll open during the run; ``skip_actor``: the poller
    passes the writer's actor as ``skip_actor`` (servers without the parameter ignore it);
    ``prefill``: records created in the store first (a store that is not empty);
    ``idempotency``: send ``Idempotency-Key`` on every write; ``keep_server``: print the
    server pid and wait for Enter before stopping (to attach a profiler); ``profile``: a file
    to write a py-spy profile of the server during the timed phases to (raw format,
    ``py-spy`` next to the interpreter); ``profile_gil``: sample only the thread holding the
    GIL (Python CPU; leaves out time in SQLite and fsync).
    Returns ``{operation: {"wall_ms_p50", "wall_ms_mean", "server_cpu_ms"}}`` (also printed
    as JSON unless ``quiet``). Raises ``RuntimeError`` when the server does not start or a
    request does not get the expected status.
    """
    tmp = Path(tempfile.mkdtemp(prefix="memfuse-perf-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    admin = secrets.token_urlsafe(24)
    (tmp / "admin.token").write_text(admin)
    exe = Path(sys.executable).with_name("memfuse")
    log = (tmp / "serve.log").open("ab")
    proc = subprocess.Popen(
        [str(exe), "serve", "--db", f"sqlite:///{tmp / 'cp.db'}", "--listen", f"127.0.0.1:{port}",
         "--admin-token-file", str(tmp / "admin.token"), "--migrate"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, MEMFUSE_HOME=str(tmp / "home")),
    )
    poll_thread: _Poller | None = None
    try:
        _wait_listening(port, proc)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as a:
            for method, path, body in [
                ("POST", "/v1/workspaces", {"name": "bench"}),
                ("POST", "/v1/stores", {"slug": "s"}),
                ("PUT", "/v1/workspaces/bench/attachments/s", {"access": "read_write"}),
            ]:
                a.request(method, path, json=body).raise_for_status()
            token = a.post("/v1/tokens", json={"workspace": "bench", "name": "perf"}).json()["token"]
        instance = "perf-" + uuid.uuid4().hex[:8]
        actor = f"ws:bench/{instance}"
        c = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}", "X-Memfuse-Instance": instance}
        )
        base = "/v1/stores/s/records"
        content = "x" * 500 + "\n"

        def call(method: str, path: str, expect: int, **kw) -> httpx.Response:
            headers = kw.pop("headers", {})
            if idempotency:
                headers["Idempotency-Key"] = uuid.uuid4().hex
            r = c.request(method, path, headers=headers, **kw)
            if r.status_code != expect:
                raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
            return r

        for i in range(prefill):
            call("POST", base, 201, json={"path": f"pre/{i // 100}/f{i}.md", "content": content})
        if poller:
            poll_thread = _Poller(url, token, "s", actor if skip_actor else None)
            poll_thread.start()
            time.sleep(0.3)
        ids: list[str] = []
        tags: list[str] = []

        def create(i: int) -> None:
            r = call("POST", base, 201, json={"path": f"d{i % 10}/note-{i}.md", "content": content})
            ids.append(r.json()["id"])
            tags.append(r.headers["etag"])

        def update(i: int) -> None:
            r = call("PUT", f"{base}/{ids[i]}", 200, json={"content": content + f"v2 {i}\n"},
                     headers={"If-Match": tags[i]})
            tags[i] = r.headers["etag"]

        def move(i: int) -> None:
            call("POST", f"{base}/{ids[i]}/move", 200, json={"path": f"m{i % 10}/note-{i}.md"},
                 headers={"If-Match": tags[i]})

        def remove(i: int) -> None:
            call("DELETE", f"{base}/{ids[i]}", 204, headers={"If-Match": tags[i]})

        spy = None
        if profile:
            spy = subprocess.Popen(
                [str(exe.with_name("py-spy")), "record", "--pid", str(proc.pid), "--rate", "500",
                 "--format", "raw", "-o", profile, *(["--gil"] if profile_gil else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        results = {}
        wake0 = 0
        for name, fn in [("create", create), ("update", update), ("move", move), ("delete", remove)]:
            results[name] = _phase(proc.pid, fn, n)
            if poll_thread is not None:
                time.sleep(0.2)
                results[name]["poller_wakeups_per_request"] = round((poll_thread.wakeups - wake0) / n, 3)
                wake0 = poll_thread.wakeups
        c.close()
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        if keep_server:
            print(f"server pid {proc.pid}, url {url}, token {token}; Enter to stop", flush=True)
            input()
        if not quiet:
            print(json.dumps({"n": n, "poller": poller, "skip_actor": skip_actor, "prefill": prefill,
                              "idempotency": idempotency, "results": results}, indent=1))
        return results
    finally:
        if poll_thread is not None:
            poll_thread.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="micro-benchmark of the control plane's write path")
    ap.add_argument("--n", type=int, default=300, help="files, each created, updated, moved, deleted")
    ap.add_argument("--no-poller", action="store_true", help="no change-feed long-poll during the run")
    ap.add_argument("--prefill", type=int, default=0, help="records created in the store first")
    args = ap.parse_args()
    run(args.n, poller=not args.no_poller, prefill=args.prefill)
