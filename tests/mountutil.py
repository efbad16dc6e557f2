"""Helpers for tests that drive real FUSE mounts in separate processes.

A test's control plane and sidecars belong to a ``Rig`` (``with Rig(tmp_path) as rig``), whose
one teardown rule stops every process we start and unmounts every mount, each step in a
``finally``, with a lazy ``fusermount3 -uz`` as the last resort (``serve_and_mount``,
``two_sidecars`` and ``mountcheck.MountEnv`` are rigs of a fixed shape). Every shell command
against a mount has a timeout. The test process itself touches a mount only through syscalls
while the mount is served by another process, so nothing here can deadlock the serving loop.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import EllipsisType, TracebackType
from typing import Callable, Iterator

import httpx
import trio

from memfuse.client import ApiClient

VENV_BIN = Path(sys.executable).parent
MEMFUSE = str(VENV_BIN / "memfuse")


def free_port() -> int:
    """A loopback port free now. Another process may take it before the caller binds it: a
    server should listen on port 0 instead (``ControlPlane``, ``serve_listening``); where
    nothing may answer, use ``refused_port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port where every connection is refused while the block runs: bound here
    and never listening, so no other process can listen there meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def sh(cmd: str, cwd: Path | str, timeout: float = 30, check: bool = True,
       env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with bash in ``cwd``; raise on timeout, and on failure when ``check``."""
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, LC_ALL="C.UTF-8", **(env or {})))
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd!r} exited {proc.returncode}\nstdout: {proc.stdout}\n"
                             f"stderr: {proc.stderr}")
    return proc


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f)


def unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True, timeout=10)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    detail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{detail}")


def wait_until(pred, timeout: float = 30.0, what: str = "condition", poll: float = 0.01) -> float:
    """Poll ``pred()`` every ``poll`` s until it is true; return ``time.monotonic()`` at that
    moment. An ``OSError`` from ``pred`` (a file not there yet, a mount busy) counts as false.
    Raises ``AssertionError`` naming ``what`` after ``timeout`` s. The default bound is
    generous on purpose (a busy 2-CPU CI machine): the wait ends as soon as ``pred`` holds; a
    test that asserts a latency passes its own bound."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return time.monotonic()
        except OSError:
            pass
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def serve_process(args: list[str], log: Path, *, env: dict[str, str] | None = None,
                  cwd: Path | str | None = None) -> subprocess.Popen:
    """``memfuse serve`` with the options ``args`` (give it ``--listen 127.0.0.1:0``: a port
    picked here and bound later by the server could be taken meanwhile on a shared machine),
    started in ``cwd`` with ``env`` as its whole environment (this process's when None), its
    output appended to ``log``, no stdin; returns at once. ``serve_listening`` (with the
    log's size before the start as its offset) waits for its URL, ``stop`` ends it."""
    with log.open("ab") as out:
        return subprocess.Popen([MEMFUSE, "serve", *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd)


def serve_listening(proc: subprocess.Popen, log: Path, offset: int = 0, timeout: float = 120) -> str:
    """The URL a ``memfuse serve`` started with its output to ``log`` (which held ``offset``
    bytes before) listens on, from its line ``memfuse serve: listening on URL``; waits for
    it up to ``timeout`` s and fails (with the log) if the process exits first. A start costs
    ~3.5 CPU-seconds: at a load of 12-14 on 2 CPUs it passed 60 s."""
    found: list[str] = []

    def listening() -> bool:
        with log.open("rb") as f:
            f.seek(offset)
            m = re.search(rb"memfuse serve: listening on (http://\S+)", f.read())
        if m:
            found.append(m.group(1).decode())
        return bool(m)
    wait_for(listening, timeout, "memfuse serve to listen", proc, log)
    return found[0]


def read(p: Path) -> str | None:
    """The text of file ``p``, or None when it does not exist."""
    try:
        return p.read_text()
    except FileNotFoundError:
        return None


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, wait, SIGKILL as last resort; return the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class ControlPlane:
    """A real ``memfuse serve`` on loopback over a SQLite file (or the database ``db_url``),
    with an admin token."""

    def __init__(self, tmp: Path, extra_args: tuple[str, ...] = (), db_url: str | None = None) -> None:
        self.tmp = tmp
        self.extra_args = list(extra_args)  # more `memfuse serve` options, e.g. --no-streams
        self.db = tmp / "cp.db"
        self.db_url = db_url or f"sqlite:///{self.db}"
        self.port = 0  # chosen by the kernel at the first start (see start), then kept
        self.admin_token = secrets.token_urlsafe(24)
        self.token_file = tmp / "admin.token"
        self.token_file.write_text(self.admin_token)
        self.log = tmp / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.frozen = False  # SIGSTOPped by ``freeze``: ``stop`` sends SIGCONT first

    @property
    def url(self) -> str:
        assert self.port, "the control plane has not been started yet"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ControlPlane":
        """Start ``memfuse serve`` and wait until it listens. The first start listens on
        port 0 and takes the port the server reports (a port picked here and bound later
        by the server could be taken meanwhile by another process on a shared machine); a
        restart listens on the same port again, so sidecars keep their URL."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc = serve_process(
            ["--db", self.db_url, "--listen", f"127.0.0.1:{self.port}",
             "--admin-token-file", str(self.token_file), "--migrate", *self.extra_args],
            self.log, env=dict(os.environ, MEMFUSE_HOME=str(self.tmp / "home")))
        try:
            url = serve_listening(self.proc, self.log, offset)
        except BaseException:
            self.stop()  # a start that fails half-way leaves no process behind
            raise
        self.port = int(url.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        """SIGTERM (after SIGCONT when frozen), SIGKILL as the last resort; a stopped control
        plane stops at once. Idempotent."""
        if self.proc is not None:
            self.thaw()
            stop(self.proc)

    def restart(self, extra_args: tuple[str, ...] | None = None) -> "ControlPlane":
        """Stop, then start again on the same port and database (sidecars keep their URL);
        ``extra_args`` replaces the ``memfuse serve`` options when given."""
        self.stop()
        if extra_args is not None:
            self.extra_args = list(extra_args)
        return self.start()

    def kill(self) -> None:
        """SIGKILL the server (no graceful shutdown; a frozen one dies too) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.frozen = False

    def freeze(self) -> None:
        """SIGSTOP the server: its port still accepts connections, nothing answers them (a
        request in flight hangs) until ``thaw``; ``stop`` thaws it first."""
        assert self.proc is not None and self.proc.poll() is None, "the control plane is not running"
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT a server ``freeze`` stopped; nothing when it is not frozen."""
        if self.frozen and self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def call(self, method: str, *args, token: str | None = None, **kwargs):
        """Run one ``ApiClient`` method synchronously (admin token by default)."""
        async def go():
            async with ApiClient(self.url, token or self.admin_token) as c:
                return await getattr(c, method)(*args, **kwargs)
        return trio.run(go)

    def delete_store(self, slug: str) -> None:
        """Delete store ``slug`` (admin), through the face that deletes stores (the
        memory-store API: ``DELETE /v1/memory_stores/memstore_<slug>``)."""
        r = httpx.delete(f"{self.url}/v1/memory_stores/memstore_{slug}",
                         headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=30)
        assert r.status_code in (200, 204), r.text

    def setup_workspace(self, ws: str, stores: tuple[str, ...] = ("default",),
                        access: str = "read_write") -> Path:
        """Create workspace (without its same-named default store), stores and attachments;
        return a token file for the workspace."""
        async def go():
            async with ApiClient(self.url, self.admin_token) as c:
                await c.create_workspace(ws, default_store=False)
                for s in stores:
                    try:
                        await c.create_store(s)
                    except Exception:
                        pass  # already there (shared between workspaces)
                    await c.attach(ws, s, access=access)
                tok = await c.create_token(workspace=ws, name=f"test-{ws}")
                return tok.token
        f = self.tmp / f"{ws}.token"
        f.write_text(trio.run(go))
        return f


# Sidecar logs written during the current test: (path, offset at registration). The conftest
# fixture ``sidecar_logs_clean`` fails a test whose sidecar logged an ERROR or a traceback
# there, unless the test is marked ``expect_sidecar_errors``.
WATCHED_LOGS: list[tuple[Path, int]] = []


def watch_log(path: Path) -> None:
    """Check the JSON log lines ``path`` gets from now on at the end of the current test."""
    WATCHED_LOGS.append((path, path.stat().st_size if path.exists() else 0))


def unexpected_log_lines(path: Path, offset: int = 0) -> list[str]:
    """Lines after ``offset`` that are an ERROR (or worse) or carry a traceback."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    bad = []
    for line in text.splitlines():
        if line.startswith("{"):
            if '"level": "error"' in line or '"level": "critical"' in line or '"exc": ' in line:
                bad.append(line)
        elif line.startswith("Traceback (most recent call last)"):
            bad.append(line)
    return bad


class Sidecar:
    """A ``memfuse mount`` process for one workspace (its log is watched, see ``watch_log``)."""

    def __init__(self, cp: ControlPlane, ws: str, token_file: Path, mountpoint: Path,
                 cache_dir: Path, *extra: str, expect: str | None = "default") -> None:
        self.cp, self.ws, self.token_file = cp, ws, token_file
        self.mountpoint, self.cache_dir, self.extra = mountpoint, cache_dir, extra
        self.expect = expect  # the store whose directory shows that the mount is up (see start)
        self.log = cache_dir.parent / f"sidecar-{ws}-{mountpoint.name}.log"
        self.proc: subprocess.Popen | None = None
        watch_log(self.log)

    def start(self, expect: str | None | EllipsisType = ..., timeout: float = 60) -> "Sidecar":
        """Start ``memfuse mount`` and wait (``timeout`` s at most) until the mountpoint is
        mounted and shows the store ``expect`` (None: mounted is enough; left out: the one
        given last, ``default`` at first). Called again after ``stop`` or ``kill9``, it starts
        the same sidecar again (same cache directory, log and options). A start that fails
        (the process exits, or the wait times out: ``AssertionError`` with the log's tail)
        stops the process and unmounts before raising."""
        if not isinstance(expect, EllipsisType):
            self.expect = expect
        expect = self.expect
        self.launch()
        try:
            wait_for(lambda: is_mounted(self.mountpoint) and
                     (expect is None or os.path.isdir(self.mountpoint / expect)),
                     timeout, f"mount at {self.mountpoint}", self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> "Sidecar":
        """Start the ``memfuse mount`` process and return at once, without waiting for the
        mount (``start`` waits; a test of a start that cannot finish uses this)."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [MEMFUSE, "mount", str(self.mountpoint), "--control-plane", self.cp.url,
             "--workspace", self.ws, "--token-file", str(self.token_file),
             "--cache-dir", str(self.cache_dir), "--commit-wait", "10",
             "--admin-listen", "127.0.0.1:0", *self.extra],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 30 s), then a lazy unmount if the mount is still there;
        the process's exit code (0 when it never started). Idempotent."""
        code = stop(self.proc) if self.proc is not None else 0
        unmount(self.mountpoint)
        return code

    def restart(self, extra: tuple[str, ...] | None = None) -> "Sidecar":
        """``stop``, then ``start`` on the same cache directory; ``extra`` replaces the
        sidecar's extra ``memfuse mount`` options when given."""
        self.stop()
        if extra is not None:
            self.extra = extra
        return self.start()

    def kill9(self) -> None:
        """SIGKILL the sidecar (no drain: what a crash leaves in its cache directory stays),
        reap it, and unmount lazily; ``start`` brings it back on the same cache directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        unmount(self.mountpoint)


class Rig:
    """One test's control plane and sidecars, with one teardown rule: the shape of every
    mount test (``with Rig(tmp_path) as rig: sc = rig.sidecar("ws")``).

    Entering starts ``rig.cp``, a ``ControlPlane`` in ``tmp`` (``serve_args``: more ``memfuse
    serve`` options; ``db_url``: another database than ``tmp/cp.db``, e.g. PostgreSQL from
    ``pgutil.fresh_db_url``). ``sidecar`` adds a ``Sidecar`` (setting its workspace up when
    no token is given) and mounts it, or with ``start=False`` leaves the mount to the test
    (``sc.start()``), which can set store limits first. Either restarts in place:
    ``rig.cp.restart()`` (same port and database), ``sc.restart()`` / ``sc.start()`` after
    ``sc.kill9()`` (same cache directory); ``rig.cp.freeze()`` SIGSTOPs the server.

    Teardown, when the block ends (normally, by an exception, or because a start failed
    half-way: every process is registered before it starts): the control plane thawed if
    frozen; what ``defer`` registered and every sidecar (stopped and unmounted), the last
    added first; then the control plane stopped. Each step runs in a ``finally`` of the one
    before (``contextlib.ExitStack``: a failing step never skips the next, and its exception
    is chained to the test's own). When the block failed, the tail of every log (``logs``:
    the server's, the sidecars', any path the test appends) is printed: pytest shows it with
    the failure.
    """

    def __init__(self, tmp: Path, serve_args: tuple[str, ...] = (), db_url: str | None = None) -> None:
        self.tmp = tmp
        self.cp = ControlPlane(tmp, serve_args, db_url)
        self.sidecars: list[Sidecar] = []
        self.tokens: dict[str, Path] = {}  # workspace → token file, from ``workspace``
        self.stores: dict[str, tuple[str, ...]] = {}  # workspace → its stores, from ``workspace``
        self.logs: list[Path] = [self.cp.log]
        self._stack = ExitStack()

    def __enter__(self) -> "Rig":
        self._stack.callback(self.cp.stop)  # first in, last out
        try:
            self.cp.start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        failed = exc is not None
        self._stack.callback(self.cp.thaw)  # first: a frozen server would hold the sidecars' drain
        try:
            return self._stack.__exit__(typ, exc, tb)
        except BaseException:
            failed = True
            raise
        finally:
            if failed:
                for p in self.logs:
                    print(f"----- {p.name} (tail) -----\n{_tail(p)}")

    def close(self) -> None:
        """The teardown, for a rig not used as a ``with`` block (entered by hand with
        ``__enter__``, e.g. by a helper object whose ``stop`` this is)."""
        self.__exit__(None, None, None)

    def defer(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` at teardown, before the sidecars added so far are stopped (e.g.
        kill a writer process that works on a mount before its sidecar goes)."""
        self._stack.callback(fn, *args)

    def workspace(self, ws: str, stores: tuple[str, ...] = ("default",),
                  access: str = "read_write") -> Path:
        """``ControlPlane.setup_workspace``: the workspace ``ws`` with ``stores`` attached
        (``access``); its token file, kept in ``tokens``."""
        self.tokens[ws] = self.cp.setup_workspace(ws, stores, access)
        self.stores[ws] = stores
        return self.tokens[ws]

    def sidecar(self, ws: str = "ws", *extra: str, stores: tuple[str, ...] = ("default",),
                access: str = "read_write", token: Path | None = None,
                mountpoint: Path | None = None, cache_dir: Path | None = None,
                expect: str | None | EllipsisType = ..., start: bool = True,
                via: ControlPlane | None = None) -> Sidecar:
        """A sidecar of workspace ``ws`` (``extra``: more ``memfuse mount`` options) at
        ``mountpoint`` (``tmp/mnt`` unless told) with ``cache_dir`` (``tmp/cache``), stopped
        at teardown. Without ``token``, the workspace's from ``workspace``, which is called
        with ``stores`` and ``access`` the first time. Started (waiting for the store
        ``expect``; unless told, the first of the workspace's stores, or ``stores[0]`` with a
        ``token``; None for none) unless ``start`` is false. ``via``: what the sidecar is
        given as its control plane instead of ``cp`` (anything with a ``url``, e.g. a proxy
        in front of it). Raises ``ValueError`` when another sidecar of this rig runs at that
        mountpoint."""
        if token is None:
            token = self.tokens.get(ws) or self.workspace(ws, stores, access)
            stores = self.stores[ws]
        mnt = mountpoint or self.tmp / "mnt"
        if any(sc.mountpoint == mnt and sc.proc is not None and sc.proc.poll() is None
               for sc in self.sidecars):
            raise ValueError(f"a sidecar of this rig runs at {mnt}")
        sc = Sidecar(via or self.cp, ws, token, mnt, cache_dir or self.tmp / "cache", *extra,
                     expect=stores[0] if isinstance(expect, EllipsisType) else expect)
        self.sidecars.append(sc)
        self.logs.append(sc.log)
        self._stack.callback(sc.stop)  # before the start: a start that fails is stopped too
        if start:
            sc.start()
        return sc


def _tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@contextmanager
def serve_and_mount(tmp: Path, ws: str = "ws", stores: tuple[str, ...] = ("default",),
                    access: str = "read_write") -> Iterator[tuple[ControlPlane, Sidecar]]:
    """A control plane and one sidecar mounted at ``tmp/mnt`` (a ``Rig``); both stopped
    afterwards."""
    with Rig(tmp) as rig:
        yield rig.cp, rig.sidecar(ws, stores=stores, access=access)


@contextmanager
def two_sidecars(tmp: Path, store: str = "shared",
                 a_args: tuple[str, ...] = ()) -> Iterator[tuple[ControlPlane, Sidecar, Sidecar]]:
    """A control plane and two sidecars on one shared ``store`` (workspaces ``wa`` and ``wb``,
    mounted at ``tmp/ma`` and ``tmp/mb``; ``a_args``: more flags for ``wa``'s sidecar): the
    setup of every two-mount sync test (a ``Rig``); all stopped afterwards."""
    with Rig(tmp) as rig:
        rig.workspace("wa", (store,))
        rig.workspace("wb", (store,))
        a = rig.sidecar("wa", *a_args, mountpoint=tmp / "ma", cache_dir=tmp / "ca")
        b = rig.sidecar("wb", mountpoint=tmp / "mb", cache_dir=tmp / "cb")
        yield rig.cp, a, b


def written_and_seen(a: "Sidecar", b: "Sidecar", store: str, name: str, text: str,
                     timeout: float = 20) -> tuple[Path, Path]:
    """Write ``text`` to the file ``name`` of ``store`` through mount ``a`` and wait until mount
    ``b`` shows it (at most ``timeout`` s; ``AssertionError`` past it): the first step of every
    two-mount conflict test (``two_sidecars``). Returns the file's path on ``a`` and on ``b``."""
    pa, pb = a.mountpoint / store / name, b.mountpoint / store / name
    pa.write_text(text)
    wait_until(lambda: read(pb) == text, timeout=timeout,
               what=f"{name} written on {a.mountpoint.name} shown by {b.mountpoint.name}")
    return pa, pb


def wait_applied(p: Path, sha256: str, timeout: float = 20, what: str = "the version applied") -> None:
    """Wait until the mount of ``p`` holds the version of ``p`` whose content sha256 is ``sha256``
    (hex), asked by its ``user.memfuse.sha256`` attribute: a read would make that version the
    one a tool read. At most ``timeout`` s (``AssertionError`` past it)."""
    wait_until(lambda: os.getxattr(p, "user.memfuse.sha256").decode() == sha256, timeout=timeout, what=what)


def replace_like_sed(p: Path, text: str) -> None:
    """What ``sed -i`` does to ``p``: ``text`` written to a new temporary file beside it, then
    renamed over it."""
    tmp = p.with_name(f".sed{secrets.token_hex(3)}")
    tmp.write_text(text)
    os.replace(tmp, p)


def sidecar_status(sc: "Sidecar") -> dict:
    """The mount's ``.memfuse/status.json`` as a dict."""
    with open(sc.mountpoint / ".memfuse" / "status.json") as f:
        return json.load(f)


def drained(*scs: "Sidecar", timeout: float = 60) -> None:
    """Wait (at most ``timeout`` s) until every sidecar's outbox is empty."""
    wait_until(lambda: all(sidecar_status(sc)["outbox"]["depth"] == 0 for sc in scs),
               timeout=timeout, what="outboxes drained")


def live_records(cp: ControlPlane, store: str = "default") -> dict[str, object]:
    """path → Record of every live record in ``store``, read from the control plane."""
    records, _ = cp.call("snapshot", store, content=True)
    return {r.path: r for r in records}


async def dump_records(api: ApiClient, store: str) -> list[dict]:
    """Every record of ``store``, deleted ones too, with content and its version list, as
    plain dicts (for comparing what the control plane holds with what a writer wrote)."""
    records, _ = await api.snapshot(store, content=True, limit=1000, include_deleted=True)
    out = []
    for r in records:
        vs = await api.versions(store, r.id)
        out.append({"id": r.id, "path": r.path, "deleted": r.deleted, "version": r.version,
                    "sha256": r.sha256, "content": r.content,
                    "versions": [{"version": v.version, "operation": v.operation.value,
                                  "sha256": v.sha256, "path": v.path} for v in vs]})
    return out
