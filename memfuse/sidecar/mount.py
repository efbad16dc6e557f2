"""Assembly of the sidecar: load the attached stores, show and replay the outbox, mount, serve, drain.

``run_mount(config, client_factory)`` is the blocking entry point used by ``memfuse mount``
and ``memfuse dev``. The order (docs/ARCHITECTURE.md): list the workspace's attachments and
load each store, show the outbox a previous process left on the tree and queue it again,
then mount and report ready (the backlog drains while the mount serves). SIGTERM / SIGINT
drain the outbox for up to ``drain_timeout`` seconds, unmount and exit 0; what did not drain
stays in the outbox for the next start.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Callable

import pyfuse3
import trio

from ..client import ApiClient
from ..content import INDEX_PATH
from ..procmem import fix_mmap_threshold, start_trimmer
from .backoff import Doubling
from .blobcache import BlobCache
from .cachedir import (START_ROOM, CacheError, DiskReserve, disk_size, free_bytes,
                       secure_cache_dir)
from .control import MOUNT_INFO, write_mount_info
from .core import Filesystem, Settings
from .fusereader import FuseReader, usable_fd
from .fuse_ops import MemfuseOps
from .logs import setup_logging
from .metrics import Metrics
from .committer import STORE_REPLACED, Committer
from .identity import RecordIds
from .journal import PUT, Entry, Journal
from .witness import WITNESS_NAME
from .config import MountConfig as MountConfig  # re-exported: callers import it from here
from .stores import StoreSync
from .interrupts import Interrupts
from .invalidator import Invalidator
from .sync import Meta, StoreState

log = logging.getLogger("memfuse.mount")
LOST_NAMED_MAX = 200  # lost writes named in the start log line (errors.log names every one)


#: the cyclic garbage collector's thresholds for the sidecar's process (``tune_gc``);
#: CPython's defaults are (700, 10, 10). The same numbers as ``memfuse serve``'s
#: (``memfuse.server.serve.GC_THRESHOLDS``), for the same reason.
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Set the garbage collector's thresholds (``gc.set_threshold``) for the sidecar's
    process; called once by ``run_mount`` (the entry point of ``memfuse mount`` and
    ``memfuse dev``: process-wide, so not from ``Sidecar``, which tests run inside their own
    process).

    Why: the sidecar keeps a large heap of long-lived objects (every file's ``Node``, the
    stores' mirrors: 60,000-75,000 tracked objects holding 1,000-2,000 files), and
    every FUSE request and commit allocates objects (coroutines, trio events, outbox
    entries) of which a few dozen per file written stay alive (the new file's node, its
    mirror entry, its key). With CPython's first threshold of 700 that live growth alone ran
    a collection every ~40 files, a second-generation one every ~350 and a full collection of
    the whole heap (37-43 ms, on the trio thread that answers the kernel) in each run of
    1,000-2,000 files: 34-59 µs of CPU per file written, 2-4 % of the sidecar's CPU per
    create-write-close, and pauses that hold every request (bench/README.md, "The close
    path, session 15: sidecar"). The requests make almost no garbage cycles (33 objects
    collected over 2,000 files), so reference counting frees nearly everything and a first
    threshold of 50,000 keeps no more memory than what is alive anyway; collections become
    rare (none in 2,000 files). Reference: the ``gc`` module documentation."""
    gc.set_threshold(*thresholds)


class StartError(Exception):
    """The sidecar cannot start; the message is one line for ``kubectl logs``."""


#: seconds ``probe_mount`` waits for a FUSE daemon's ``statfs`` answer before calling it hung
PROBE_TIMEOUT = 5.0


def probe_mount(mountpoint: Path, timeout: float = PROBE_TIMEOUT) -> str:
    """Whether the daemon behind the FUSE mount at ``mountpoint`` answers: ``"live"``,
    ``"stale"`` (its daemon is gone: ``ENOTCONN`` / ``ECONNABORTED``, "Transport endpoint is
    not connected") or ``"hung"`` (no answer within ``timeout`` seconds).

    Asks with ``statvfs(2)``, not ``stat(2)``: the kernel answers a ``stat`` of a FUSE root
    from its attribute cache (memfuse's attribute timeout is minutes), so a mount whose
    daemon was killed with ``-9`` still stats fine, while ``FUSE_STATFS`` always goes to the
    daemon (linux ``fs/fuse/inode.c``, ``fuse_statfs``). The call runs in a daemon thread so
    a hung daemon cannot hang the caller (the thread's request is killable and dies with the
    process). Any other error is raised (``OSError``)."""
    import threading

    box: dict[str, object] = {}

    def ask() -> None:
        try:
            os.statvfs(mountpoint)
            box["state"] = "live"
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=ask, name="memfuse-probe-mount", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return "hung"
    err = box.get("error")
    if isinstance(err, OSError):
        if err.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            return "stale"
        raise err
    return "live"


def clean_stale_mount(mountpoint: Path) -> bool:
    """Lazily unmount (``fusermount3 -uz``) a FUSE mount at ``mountpoint`` left by a killed
    daemon ("Transport endpoint is not connected"); True when there was one. A non-FUSE
    mountpoint (a plain directory, a Kubernetes ``emptyDir`` bind mount) is left alone."""
    if fuse_mount_at(mountpoint) is None or probe_mount(mountpoint) != "stale":
        return False
    log.warning("stale FUSE mount found (its daemon is gone); unmounting it",
                extra={"mountpoint": str(mountpoint)})
    subprocess.run(["fusermount3", "-uz", str(mountpoint)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return True


def fuse_mount_at(mountpoint: Path) -> str | None:
    """The type (``fuse.memfuse``, ``fuse.sshfs``...) of the FUSE filesystem mounted on top
    of ``mountpoint``, or None when the top mount there is not FUSE (a plain directory, or a
    Kubernetes ``emptyDir`` bind mount, which a sidecar mounts over on purpose). Read from
    ``/proc/self/mountinfo`` (proc(5): field 5 is the mount point with octal escapes, the
    type follows the `` - `` separator; a later line is mounted over an earlier one)."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    target = os.path.realpath(mountpoint)
    top = None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point == target:
            top = right.split()[0] if right.split() else None
    return top if top is not None and top.split(".")[0] in ("fuse", "fuseblk") else None


def check_mountpoint_free(mountpoint: Path) -> None:
    """Raise ``StartError`` when a live FUSE filesystem is mounted at ``mountpoint``: a second
    sidecar (or ``memfuse dev``) stacked on a running one would hide its files and serve an
    empty tree to the agent. A stale mount (its daemon gone: ``ENOTCONN``) is not refused; it
    is cleaned up before mounting (``clean_stale_mount``). Liveness comes from
    ``probe_mount`` (``statvfs``, bounded), never from a ``stat`` the kernel may answer from
    its cache for a daemon long gone. A daemon that does not answer is refused too."""
    fstype = fuse_mount_at(mountpoint)
    if fstype is None:
        return
    state = probe_mount(mountpoint)
    if state == "stale":
        return
    if state == "hung":
        raise StartError(f"{mountpoint} is mounted ({fstype}) by a daemon that does not answer "
                         f"within {PROBE_TIMEOUT:g} s; unmount it first (fusermount3 -uz "
                         f"{mountpoint}), or choose another mountpoint")
    raise StartError(f"{mountpoint} is already mounted ({fstype}): another sidecar or "
                     "memfuse dev is serving it; stop it (or unmount it) first, or choose "
                     "another mountpoint")


class CacheLock:
    """An exclusive ``flock`` on ``<cache_dir>/lock``: two sidecars never share one cache."""

    def __init__(self, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.fd = os.open(cache_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise SystemExit(f"memfuse: cache directory {cache_dir} is in use by another sidecar "
                             "(give each mount its own --cache-dir)") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        """Give the lock back (closing its file descriptor)."""
        os.close(self.fd)


#: the files of the cache directory that are the sidecar's own (the rest is someone else's)
OWN_FILES = re.compile(r"(outbox\.db|blobs\.db|accepted\.log|reserve|lock|dirs\.json|dirs\.synced\.json|"
                       r"\.dirs\.synced\.json\.\d+\.tmp|"
                       r"mount\.json|admin\.sock|stores)(-wal|-shm|-journal|\.corrupt-.*)?$")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def open_cache(cache_dir: Path, metrics: Any = None) -> tuple[DiskReserve, BlobCache, Journal]:
    """The cache directory's disk reserve, blob cache and outbox journal, opened at start
    (``metrics``: the sidecar's, or None).

    A full cache disk is not a damaged journal (attack 14 F3): the journal is never moved
    aside for it (``Journal``), and the start makes room from what the sidecar owns and can
    drop, least loss first: while the disk has less than ``START_ROOM`` bytes free, the disk
    reserve (``DiskReserve``: made again once space allows) and the blob cache's write-ahead
    log (checkpointed and truncated, when that can finish); when the journal or the blob
    cache still cannot be opened, the blob cache itself (a cache of content the control
    plane holds: fetched again as the stores load; not before, since an offline start
    reads from it). Never the journal, the witness or the store mirrors. What was given up is logged (one
    WARNING). A disk that still refuses the journal or the blob cache raises ``StartError``
    with one sentence: the cache directory, what is full, what to do (exit 1). Raises
    ``OSError`` when a file cannot be made (a symlink planted in the directory)."""
    # space held back so that a full cache disk can still give space back once the outbox
    # drains (the journal's checkpoint: DiskReserve)
    reserve = DiskReserve(cache_dir / "reserve")
    blobs_path = cache_dir / "blobs.db"
    given: dict[str, int] = {}  # what was given up to make room -> bytes it held
    blobs: BlobCache | None = None

    def make_room(drop: bool = True) -> bool:
        """Give up the next thing the sidecar can drop (the blob cache itself only when
        ``drop``); False when nothing is left."""
        nonlocal blobs
        if "reserve" not in given:
            given["reserve"] = reserve.release()
            if given["reserve"]:
                return True
        if "blob cache log" not in given and blobs is not None:
            wal = Path(f"{blobs_path}-wal")
            before = wal.stat().st_blocks * 512 if wal.exists() else 0
            blobs.checkpoint()  # failures ignored: the next step drops it whole
            given["blob cache log"] = before - (wal.stat().st_blocks * 512 if wal.exists() else 0)
            if given["blob cache log"] > 0:
                return True
        if "blob cache" not in given and drop:
            if blobs is not None:
                blobs.close()
                blobs = None
            given["blob cache"] = BlobCache.remove_files(blobs_path)
            return given["blob cache"] > 0
        return False

    def short() -> bool:
        return 0 <= free_bytes(cache_dir) < START_ROOM

    journal: Journal | None = None
    while journal is None:
        try:
            if "reserve" not in given and short():
                make_room(drop=False)  # the reserve first: it is there for this
            if blobs is None:
                blobs = BlobCache(blobs_path, metrics=metrics)
            if short():
                make_room(drop=False)  # its log, when that can be truncated
            # the contents the blob cache holds in memory are written before any journal
            # batch with an accepted write: a journal lost later recovers it from there
            journal = Journal(cache_dir / "outbox.db", metrics=metrics,
                              before_batch=blobs.write_behind, reserve=reserve,
                              on_full=blobs.checkpoint)
        except CacheError as e:
            if e.errno != errno.ENOSPC:
                raise StartError(f"the cache directory {cache_dir} cannot be used: {e.reason}; "
                                 "check its disk (the outbox journal outbox.db may hold accepted "
                                 "writes not sent yet: keep it)") from None
            if not make_room():
                if blobs is not None:
                    blobs.close()
                raise StartError(_full_sentence(cache_dir)) from None
    if any(given.values()):
        log.warning("the cache disk was full at start; space given back by the sidecar's own "
                    "files to open the outbox journal", extra={
                        "cache_dir": str(cache_dir), "free_bytes": free_bytes(cache_dir),
                        **{k.replace(" ", "_") + "_bytes": v for k, v in given.items() if v}})
    assert blobs is not None
    return reserve, blobs, journal


def journal_gone(cache_dir: Path) -> tuple[bool, bool, bool]:
    """(whether the witness of the outbox journal, ``accepted.log``, is missing or empty,
    whether the journal, ``outbox.db``, is too, whether the journal alone is) in a cache
    directory a sidecar used before
    (a store mirror is there, ``stores/*.json``: written only after the journal was opened);
    (False, False) in one never used. Called before the journal is opened. Nothing else on disk names the writes such a double loss took: the store
    mirrors hold committed versions only and the blob cache content without paths
    (docs/SEMANTICS.md "What an accepted write survives"), so the start can only say that
    accepted writes may be lost (``Sidecar.journal_missing``). An idle journal is never
    empty (its tables) and an idle witness is: the witness alone proves nothing."""
    def empty(p: Path) -> bool:
        try:
            return os.stat(p).st_size == 0
        except FileNotFoundError:
            return True
        except OSError:
            return False  # unreadable is not gone: opening it says why

    stores = cache_dir / "stores"
    try:
        used = any(e.name.endswith(".json") for e in os.scandir(stores))
    except OSError:
        used = False
    witness = used and empty(cache_dir / WITNESS_NAME)
    journal = used and empty(cache_dir / "outbox.db")
    return witness, witness and journal, journal


def _full_sentence(cache_dir: Path) -> str:
    """Why a start on a full cache disk gave up, and what to do (``open_cache``)."""
    others: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(cache_dir):
            if not OWN_FILES.match(entry.name):
                with contextlib.suppress(OSError):
                    others.append((entry.stat(follow_symlinks=False).st_blocks * 512, entry.name))
    others.sort(reverse=True)
    journal = cache_dir / "outbox.db"
    size = journal.stat().st_size if journal.exists() else 0
    named = ", ".join(f"{n} ({_mib(b)})" for b, n in others[:3])
    return (f"the cache disk of {cache_dir} is full ({free_bytes(cache_dir)} bytes free of "
            f"{_mib(disk_size(cache_dir))}; the start needs {START_ROOM // 1024} KiB): the outbox "
            "journal cannot be opened, even with the sidecar's disk reserve and blob cache given "
            f"up. Keep outbox.db ({size} bytes: accepted writes not sent yet, sent at the next "
            "start); free space on that disk"
            + (f" (files there that are not the sidecar's: {named})" if named else "")
            + " or give the cache volume more room (docs/DEPLOY.md, cache size), then start again")


class Sidecar(StoreSync):
    """One running sidecar: outbox, filesystem, sync tasks and mount (the admin API's target).

    ``run()`` does the whole life cycle; ``mount_store`` / ``unmount_store`` / ``reconcile``
    are the mount and umount signals (admin API, workspace events, SIGHUP).
    """

    def __init__(self, config: MountConfig, client: ApiClient,
                 invalidator: Invalidator | None = None, *,
                 feed_hold: Callable[[], Awaitable[None]] | None = None) -> None:
        """``invalidator``: the kernel invalidations' queue (default: a new ``Invalidator``;
        tests pass one with a fault hook). ``feed_hold``: a fault hook for tests, awaited
        before each change-feed page with changes is applied (``StoreSync._apply_page``: it
        widens the window in which the control plane holds a rival version this mount does
        not show yet); None in production."""
        self.config = config
        self.feed_hold = feed_hold
        self.client = client
        self.metrics = Metrics()
        try:
            secure_cache_dir(config.cache_dir)  # owner-only: it holds memory content
            legacy = config.cache_dir / "blobs"  # one-file-per-blob layout of earlier versions
            if legacy.is_dir():
                shutil.rmtree(legacy, ignore_errors=True)
            witness_gone, gone, journal_empty = journal_gone(config.cache_dir)
            self.reserve, blobs, self.journal = open_cache(config.cache_dir, self.metrics)
        except OSError as e:  # e.g. a symlink planted in the cache directory (refused)
            raise StartError(f"cache directory {config.cache_dir} unusable: "
                             f"{e.strerror or e}") from None
        self.leftovers, keymap = self.journal.load()
        self.states: dict[str, StoreState] = {}  # before the parts below, which read it
        # the record identity, shared by the filesystem and its committer: records loaded
        # from a snapshot are not in the key map, their sha256 is their store mirror's
        ids = RecordIds(self.journal, keymap, base_sha=self.mirror_sha)
        settings = Settings(commit_wait=config.commit_wait, fsync_timeout=config.fsync_timeout)
        if config.uid is not None:
            settings.uid = config.uid
        if config.gid is not None:
            settings.gid = config.gid
        self.journal_recovered, self.journal_lost = self._recover_journal(blobs, ids)
        self.invalidator = invalidator if invalidator is not None else Invalidator()
        #: a close or fsync waiting for the control plane ends (EINTR) when its process gets
        #: a stop signal (interrupts.py: pyfuse3 does not pass FUSE_INTERRUPT on)
        self.interrupts = Interrupts()
        self.fs = Filesystem(blobs, client, self.journal, settings, config.workspace,
                             dirs_file=config.cache_dir / "dirs.json",
                             rejected=self.journal.load_rejected(),
                             local=self.journal.load_local(), ids=ids, listener=self,
                             metrics=self.metrics, mount_root=str(config.mountpoint),
                             interrupts=self.interrupts)
        self.committer = self.fs.committer
        if self.invalidator.reading is None:  # a change waits for the file's readers
            self.invalidator.reading = self.fs.reading
            # ... and past the bound, they keep the older content (a new inode for the path)
            self.invalidator.outlasted = self.fs.readers_outlasted
        #: the outbox journal and its witness were both gone at start (``journal_gone``; or
        #: the journal moved aside as corrupt with no witness lines): what the previous
        #: process accepted and did not commit cannot be named; said in the log, errors.log
        #: and status.json (``cache.journal_missing``), never silently
        self.journal_missing: str | None = None
        damaged = self.journal.witness.damaged
        if damaged and (journal_empty or self.journal.moved_aside is not None):
            # the journal lacked entries and the witness has lines it cannot read (garbage,
            # another shape: attack17 F5): what they named cannot be told
            self._say_journal_missing(
                f"the outbox journal (outbox.db) was missing, empty or unreadable at start and "
                f"{damaged} line(s) of its witness (accepted.log) could not be read",
                "outbox journal gone and its witness damaged: accepted writes not committed may "
                "be lost and cannot all be named",
                {"cache_dir": str(config.cache_dir), "damaged_lines": damaged})
        elif gone or (witness_gone and self.journal.moved_aside is not None
                      and not self.leftovers):
            self._say_journal_missing(
                "the outbox journal (outbox.db) and its witness (accepted.log) were both "
                "missing, empty or unreadable at start in a cache directory used before",
                "outbox journal and witness both gone: accepted writes not committed may be "
                "lost and cannot be named",
                {"cache_dir": str(config.cache_dir), "moved_aside":
                 str(self.journal.moved_aside) if self.journal.moved_aside else None})
        for x in self.journal_lost:  # named in errors.log (the log and status.json: above, below)
            why = ("its line in the witness (accepted.log) is damaged, so what it wrote is not "
                   "known" if x.get("damaged") else "its content is gone from the cache")
            self.fs.note_error(None, (x.get("a") or {}).get("path", ""), errno.EIO,
                               f"an accepted {x.get('o')} was lost with the outbox journal and "
                               f"{why}: write it again", "journal_lost", x.get("s", ""))
        #: who reads the next FUSE request (fusereader.py): installed around pyfuse3.main()
        self.reader = FuseReader()
        self.ops = MemfuseOps(self.fs, self.metrics, self.invalidator, self.reader)
        self.task_failures: dict[str, int] = {}  # task name -> unexpected exceptions
        self.state_save_failing = False

        client.observer = self.metrics.api_observer()  # every commit request comes here
        self._token_changed = trio.Event()  # set (and replaced) when a new token is in use
        if client.token_file is not None:
            client.token_file.on_change = self._token_taken_up

        def auth(ok: bool) -> None:
            self.metrics.auth_ok.set(1 if ok else 0)
            if ok:  # the token works again: retry what waits now, closes wait for commits
                self.committer.auth_restored()
                self._token_changed.set()
                self._token_changed = trio.Event()
            else:
                self.metrics.auth_failures.inc()
        client.auth_listener = auth
        # a token of another workspace (a rotation mistake) is an authentication outage
        # like a 401, found before any write is sent with it (attack17 F6)
        client.expect_workspace(config.workspace)
        # The actor name (``--actor``: a pod name, USER@HOST...), stable across restarts so
        # history names the agent or pod a person recognises. Two sidecars of one workspace
        # may share it: the live change feed skips this process's own versions by its
        # writer id (below), not by the actor. A restart is safe: the catch-up at start skips
        # nothing, so versions an earlier process wrote after its last saved cursor arrive.
        self.instance = re.sub(r"[^A-Za-z0-9._@:+-]", "-", client.instance or "sidecar")[:100]
        client.set_instance(self.instance)
        # what the control plane records on our writes; the one it names in the attachments
        # answer replaces it (StoreSync.learn_actor): a control plane that does not name it
        # records this
        self.actor = f"ws:{config.workspace}/{self.instance}"
        # This process's writer id (``Memfuse-Writer`` on every write, kept on the versions
        # it makes): the control plane leaves exactly our own versions out of the feed (no
        # wake-up per own commit) by it, not by the actor, so another sidecar given the same
        # --actor still sees ours and we its (attack 16 F8); a control plane without
        # ``skip_writer`` leaves out the actor's (``skip_actor``), as before. One per process:
        # versions an earlier process wrote arrive through the catch-up at start anyway.
        self.writer = uuid.uuid4().hex
        client.set_writer(self.writer)
        self._feed_kw = {"skip_actor": self.actor, "skip_writer": self.writer}
        self.feeds: dict[str, trio.CancelScope] = {}
        self.admin_unmounted: set[str] = set()
        self.admin_address: str | None = None
        self._nursery: trio.Nursery | None = None
        self._mount_lock = trio.Lock()
        self._mounted = False
        self.offline_start = False
        #: time.monotonic() when a start found no answer within ``offline_after`` and noted
        #: the outage (``Committer.no_answer``); taken over by ``_liveness``, which ends it at
        #: the control plane's next answer. None: no such outage to hand over.
        self._offline_noted: float | None = None
        self.own_unseen: set[str] = set()  # StoreSync.own_unseen
        self.cursor_held: dict[str, int] = {}  # StoreSync.cursor_held
        self.feed_tasks = 0  # running change-feed tasks: one per mounted store
        self._no_stream_until = float("-inf")  # trio time: long-poll until then (stores.py)
        self._drain_scope: trio.CancelScope | None = None
        self.admin_socket: str | None = None
        self.last_start_error: str | None = None
        self.load_error: str | None = None  # StoreSync.load_error
        # requests for a new prompt block (.memfuse/context.md); one pending is enough
        self._context_send, self._context_recv = trio.open_memory_channel(1)
        self.metrics.bind(
            depth=lambda: self.committer.depth(), oldest=lambda: self.committer.oldest_age(),
            records=lambda: sum(len(s.records) for s in self.states.values()),
            cache_bytes=lambda: sum(r.size for s in self.states.values() for r in s.records.values()),
            stores=lambda: len(self.fs.stores), ready=lambda: 1.0 if self.ready else 0.0)
        self.metrics.control_plane_up.set_function(
            lambda: 0.0 if self.committer.unreachable is not None else 1.0)

    @property
    def ready(self) -> bool:
        """Mounted, and the control plane accepts the token (``/readyz``)."""
        return self.fs.ready and self.client.auth_failure is None

    @property
    def not_ready_reason(self) -> str | None:
        """Why ``/readyz`` fails, or ``None`` when ready."""
        reasons = []
        if not self.fs.ready:
            reasons.append("the first load and mount are not done yet"
                           + (f": {self.load_error}" if self.load_error else ""))
        if self.client.auth_failure is not None:
            tf = self.client.token_file
            reasons.append(f"authentication outage: {self.client.auth_failure}; writes are kept "
                           "in the outbox and commit once a valid token is "
                           + (f"in {tf.path}" if tf is not None else "given"))
        return "; ".join(reasons) or None

    def _say_journal_missing(self, what: str, log_msg: str, extra: dict[str, Any]) -> None:
        """Accepted writes may have been lost and nothing on disk names them (``what``: why):
        said once, loudly: ``journal_missing`` (status.json), an error log line ``log_msg``
        with ``extra``, an ``errors.log`` line (``EIO``, code ``journal_missing``)."""
        self.journal_missing = (
            f"{what}: writes accepted before this start and not committed may be lost, and "
            "nothing else on disk names them; check the files written before it")
        log.error(log_msg, extra=extra)
        self.fs.note_error(None, "", errno.EIO, self.journal_missing, "journal_missing")

    def _recover_journal(self, blobs: BlobCache, ids: RecordIds) -> tuple[int, list[dict[str, Any]]]:
        """A journal missing, emptied, cut short or corrupt (moved aside by ``Journal``) is
        never forgotten silently: every accepted write the witness names that the journal
        lacks is queued again when its content is still in the blob cache (same id and
        idempotency key), and each one that cannot be is named in the log (error), in
        ``errors.log`` and in ``status.json`` (``cache.journal_lost``). Returns (how many were
        recovered, the witness lines of the lost ones). The log names the lost ones in one
        line (the first ``LOST_NAMED_MAX``; ``errors.log`` and ``status.json`` name every
        one). ``ids`` (the record identity the filesystem and its committer will share)
        learns the key map the witness saw."""
        def content_of(sha: str) -> bytes | None:
            try:
                return blobs.get(sha)  # checked: a damaged entry is as good as gone
            except Exception:  # an unreadable cache: the content is as good as gone
                return None

        # an append row whose base the journal no longer holds: the base from the blob cache
        self.journal.resolve_bases(self.leftovers, content_of)
        back, keys, gone = self.journal.recover(content_of)
        for k, v in keys.items():
            if k not in ids.map:
                ids.map[k] = v
                self.journal.set_key(k, *v)
        # the base a queued put of a record was written on, when it is newer than what the
        # key map holds (which persists only commits): the first write of a record loaded
        # from a snapshot (RecordIds.note_default, memory only), or a write after a remote
        # change this sidecar had seen (RecordIds.note, memory only; the key map still
        # holds our own older commit, which would make the put meet a "conflict" with the
        # version it was written on). The stores load before the backlog is sent, so the
        # store mirror may already hold a rival's newer version, which must be merged, not
        # taken as the base (memory only, as note / note_default; a witness line lost with
        # a machine crash leaves the base to the key map or Filesystem.overlay_outbox: the
        # loaded version)
        for k, v in self.journal.witness.bases.items():
            if v[1]:  # an unknown base stays the key map's or the mirror's (RecordIds.get)
                ids.map[k] = v
        if back:
            self.leftovers = sorted([*self.leftovers, *back], key=lambda e: e.id)
            log.warning("outbox journal short of accepted writes; recovered them from the "
                        "witness and the blob cache", extra={"recovered": len(back),
                                                            "journal": str(self.journal.path)})
        if gone:
            # one line naming them all: repeated errors are rate-limited (logs.RepeatFilter)
            log.error("accepted writes were lost with the outbox journal; their content is gone",
                      extra={"lost": len(gone),
                             "writes": [f"{x.get('o')} {x.get('s')}/{(x.get('a') or {}).get('path')}"
                                        for x in gone[:LOST_NAMED_MAX]]})
        return len(back), gone

    # ------------------------------------------------------------------ status
    # ------------------------------------------------------------------ FsListener
    def entry_finished(self, e: Entry) -> None:
        """``FsListener``: an outbox entry finished and the tree shows it: the store's
        mirror follows (``StoreState.committed``) and is saved at once
        (``save_committed``); a store's MEMORY.md changed: a new prompt block is wanted; an
        entry refused because its store was deleted and made again (``store_replaced``)
        while the tree still shows the deleted one: the attachments are reconciled."""
        if e.code == STORE_REPLACED and self._nursery is not None:
            # the outbox learnt that the store under this slug is another one (deleted and
            # made again, e.g. during an authentication outage that hid the workspace's
            # events): the attachments are reconciled, which replaces the tree (``_replace``)
            sm = self.fs.stores.get(e.store)
            if sm is not None and sm.created != self.committer.confirmed.get(e.store):
                self._nursery.start_soon(self._reconcile_logged)
        state = self.states.get(e.store)
        if state is not None:
            state.committed(e)
            self.own_commits_done(e.store)
            if not e.errno:  # before the close waiting for it returns (no await since)
                self.save_committed(state)
        if not e.errno and INDEX_PATH in (e.args.get("path"), e.args.get("to"),
                                          e.args.get("from")):
            self.want_context()

    def entry_conflicted(self, e: Entry, what: str) -> None:
        """``FsListener``: a write was resolved last-writer-wins (the core logged it)."""

    def invalidate(self, items: list[tuple[Any, ...]]) -> None:
        """``FsListener``: kernel invalidations, made by the invalidator's worker thread."""
        self.invalidator.submit(items)

    def kernel_behind(self, ino: int) -> bool:
        """``FsListener``: an invalidation of ``ino``'s content not performed yet."""
        return self.invalidator.behind(ino)

    def reader_closed(self, ino: int) -> None:
        """``FsListener``: a handle open for reading on ``ino`` was released."""
        self.invalidator.reader_closed(ino)

    def kernel_served_older(self, ino: int) -> None:
        """``FsListener``: a reader was served the older content the kernel still shows."""
        self.invalidator.served_older(ino)

    def committed_size(self, slug: str, record_id: str) -> int | None:
        """``FsListener``: the record's size in the store's mirror, None when unknown."""
        state = self.states.get(slug)
        rec = state.records.get(record_id) if state is not None else None
        return rec.size if rec is not None else None

    def known_record(self, slug: str, record_id: str) -> Meta | None:
        """``FsListener``: the record's entry in the store's mirror (its newest version
        known here), None when unknown."""
        state = self.states.get(slug)
        return state.newest(record_id) if state is not None else None

    def mirror_sha(self, slug: str, record_id: str) -> str | None:
        """The sha256 the store's mirror holds for ``record_id`` (``RecordIds.base_sha``),
        None when unknown."""
        state = self.states.get(slug)
        return state.sha_of(record_id) if state is not None else None

    def status(self) -> dict[str, Any]:
        """The status document (``.memfuse/status.json``, admin ``/v1/status``): the
        filesystem's part plus per-store cursors and feed ages (s), the mountpoint, admin
        address, invalidations, task failures, the cache, authentication and the prompt block."""
        st = self.fs.status()
        for s in st["stores"]:
            state = self.states.get(s["slug"])
            if state is not None:
                s["cursor"] = state.cursor
                s["last_remote_change_age_s"] = (round(time.time() - state.last_change_at, 3)
                                                 if state.last_change_at else None)
        st["mountpoint"] = str(self.config.mountpoint)
        st["actor"] = self.actor  # what history and the API show as updated_by
        st["admin"] = self.admin_address
        st["admin_socket"] = self.admin_socket
        st["invalidations"] = {"done": self.invalidator.done, "failed": self.invalidator.failed,
                               "pending": self.invalidator.pending,
                               "waiting_for_readers": self.invalidator.waiting,
                               "kept_for_readers": self.invalidator.kept}
        st["errors_logged"] = len(self.fs.errors)
        st["feed_tasks"] = self.feed_tasks
        st["task_failures"] = dict(self.task_failures)
        st["cache"] = {"dir": str(self.config.cache_dir), "journal_queued": self.journal.depth(),
                       "journal_error": self.journal.error.reason if self.journal.error else None,
                       "journal_moved_aside": str(self.journal.moved_aside) if self.journal.moved_aside else None,
                       "journal_recovered": self.journal_recovered,
                       "journal_missing": self.journal_missing,
                       "journal_lost": [{"store": x.get("s"), "path": (x.get("a") or {}).get("path"),
                                         "op": x.get("o")} for x in self.journal_lost],
                       "state_save_failing": self.state_save_failing,
                       "load_error": self.load_error, "free_bytes": free_bytes(self.config.cache_dir)}
        st["offline_start"] = self.offline_start
        ctl = self.fs.controls
        st["context"] = {"fetched_age_s": round(time.time() - ctl.context_at, 3)
                         if ctl.context_at else None, "error": ctl.context_error}
        st["ready"] = self.ready
        if not st["control_plane"]["reachable"]:
            st["control_plane"]["no_answer_s"] = round(self.client.no_answer_for(), 1)
        tf = self.client.token_file
        st["auth"] = {"ok": self.client.auth_failure is None, "error": self.client.auth_failure,
                      "failures": self.client.auth_failures,
                      "commits_deferred": self.committer.auth_waits,
                      # closes return once accepted (the outbox's authentication outage)
                      "closes_wait": self.committer.auth_refused is None,
                      "token_file": str(tf.path) if tf is not None else None,
                      "token_reloads": tf.reloads if tf is not None else 0}
        return st

    # ------------------------------------------------------------------ supervision
    async def supervise(self, name: str, fn: Callable[..., Awaitable[object]], *args: Any,
                        context: dict[str, Any] | None = None) -> None:
        """Run ``fn(*args)`` until it returns; an unexpected exception is logged (with
        ``context``), counted (``memfuse_task_failures{task=name}``, ``status.task_failures``)
        and the task restarted after a backoff of 0.2 s doubling to 30 s (reset after a minute
        of running). Cancellation passes through: only a deliberate stop ends a task."""
        retry = Doubling(0.2, 30.0)
        while True:
            t0 = trio.current_time()
            try:
                await fn(*args)
                return
            except Exception:
                if trio.current_time() - t0 > 60:
                    retry.reset()
                self.task_failures[name] = self.task_failures.get(name, 0) + 1
                self.metrics.task_failures.labels(name).inc()
                log.exception("background task failed; restarting it",
                              extra={"task": name, "restart_in_s": retry.delay, **(context or {})})
                await trio.sleep(retry.next())

    def _spawn(self, name: str, fn: Callable[..., Awaitable[object]], *args: Any,
               context: dict[str, Any] | None = None) -> None:
        """Start a supervised long-lived task in the sidecar's nursery."""
        assert self._nursery is not None, "tasks start while the sidecar runs"
        self._nursery.start_soon(functools.partial(self.supervise, name, fn, *args,
                                                   context=context), name=name)

    GC_EVERY = 60.0  # s between collections of unreferenced blobs
    #: s without any answer from the control plane while a request waits, after which it
    #: counts as down (closes return once accepted); at most half of ``--commit-wait``
    NO_ANSWER_AFTER = 3.0
    LIVENESS_EVERY = 0.25  # s between looks at the waiting requests
    #: s the blob cache holds a content put behind (``BlobCache.put_behind``) at most
    BLOBS_BEHIND_EVERY = 0.5

    async def _blobs_behind(self) -> None:
        """Write what the blob cache holds in memory (``BlobCache.write_behind``: the
        contents of the last closes, stored in one transaction) every
        ``BLOBS_BEHIND_EVERY`` s, so none waits longer: a ``kill -9`` then loses at most
        that much of the cache (a cache: refetched; the outbox journal and the control
        plane hold the writes), and an offline start finds the rest in the file."""
        while True:
            await trio.sleep(self.BLOBS_BEHIND_EVERY)
            self.fs.blobs.write_behind()

    #: s between looks at the disk reserve (``_reserve_refill``)
    RESERVE_EVERY = 30.0

    async def _reserve_refill(self) -> None:
        """Make the cache disk's reserve again once space allows (``DiskReserve.fill``: the
        disk has four times its size free) every ``RESERVE_EVERY`` s: the journal refills
        it only after an idle checkpoint of its own, which a journal that writes nothing
        never runs, and a start on a full disk releases it (attack 14 F1)."""
        while True:
            await trio.sleep(self.RESERVE_EVERY)
            await trio.to_thread.run_sync(self.reserve.fill)

    async def _liveness(self) -> None:
        """Notice a control plane that has stopped answering (paused, black-holed network)
        within ``NO_ANSWER_AFTER`` s, long before a request's read timeout (30 s): the
        outbox then counts it as down (``Committer.no_answer``: status ``reachable: false``,
        error ``no_answer``, ``memfuse_control_plane_up`` 0) and a waiting ``close``
        returns once its write is accepted, as in a known outage. Any answer afterwards
        (a response, a feed heartbeat) ends it (``Committer.heard_again``). No request of
        its own: the requests already waiting are the probe, so an idle sidecar costs the
        control plane nothing."""
        after = min(self.NO_ANSWER_AFTER, max(0.5, self.config.commit_wait / 2))
        noted_at: float | None = None  # time.monotonic() when this task noted an outage
        while True:
            await trio.sleep(self.LIVENESS_EVERY)
            if noted_at is None and self._offline_noted is not None:  # the start's outage (_load_at_start)
                noted_at, self._offline_noted = self._offline_noted, None
            silent = self.client.no_answer_for()
            if silent >= after and noted_at is None:
                noted_at = time.monotonic()
                self.metrics.no_answer.inc()
                log.warning("the control plane answers nothing; counted as unreachable",
                            extra={"silent_s": round(silent, 1)})
                self.committer.no_answer(silent)
            elif noted_at is not None and self.client.last_answer > noted_at:
                noted_at = None
                self.committer.heard_again()

    async def _wait_token(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s, less if a new token is taken up meanwhile."""
        with trio.move_on_after(timeout):
            await self._token_changed.wait()

    def _token_taken_up(self) -> None:
        """A new token is in use (found by the watcher, or by the client on a 401): count it
        and retry what waits for one now."""
        self.metrics.token_reloads.inc()
        self._token_changed.set()
        self._token_changed = trio.Event()
        self.committer.auth_restored()  # worth waiting for again: retried now

    async def _token_watch(self) -> None:
        """Look at ``--token-file`` every ``token_check_interval`` s (a ``stat``; re-read when
        it changed, e.g. the kubelet swapped the Secret volume's symlink). Supervised: an
        unexpected error is logged and the loop goes on."""
        while True:
            await trio.sleep(self.config.token_check_interval)
            try:
                self.client.refresh_token()
            except Exception:
                log.exception("token file check failed; trying again")

    # ------------------------------------------------------------------ life cycle
    async def run(self, *, task_status: trio.TaskStatus[Sidecar] = trio.TASK_STATUS_IGNORED) -> int:
        """Replay, load, mount, serve until SIGTERM / SIGINT or an external unmount.

        Signals are caught for the whole run, teardown included: a second SIGTERM (``timeout``
        signals the whole process group, for one) must not kill the process half-way through
        its unmount. A second SIGINT while draining stops the drain (what is left stays in
        the outbox for the next start)."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            return await self._run(sigs, task_status)

    async def _run(self, sigs: AsyncIterator[int], task_status: trio.TaskStatus[Sidecar]) -> int:
        config = self.config
        fix_mmap_threshold()  # before the first big buffer (docs/SCALING.md, memfuse.procmem)
        start_trimmer()
        if config.fuse_fd is None:
            check_mountpoint_free(config.mountpoint)  # before anything is loaded
        lock = CacheLock(config.cache_dir)
        self.fs.remove_dirs_tmp()  # (once the cache is ours: another start's may be in flight)
        mounted = False
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._signals, sigs)
                self._spawn("journal", self.journal.run)
                await nursery.start(self.committer.run)
                self._spawn("liveness", self._liveness)
                self._spawn("blobs-behind", self._blobs_behind)
                self._spawn("reserve", self._reserve_refill)
                if self.client.token_file is not None:
                    self._spawn("token-watch", self._token_watch)
                # the admin API first, so /healthz and /readyz answer while loading
                admin_lock = trio.Lock()  # one mount change at a time, whichever listener
                if config.admin_listen:
                    from .admin import serve_admin
                    try:
                        self.admin_address = await nursery.start(functools.partial(
                            serve_admin, self, config.admin_listen, token=config.admin_token,
                            lock=admin_lock))
                    except OSError as e:
                        # a second sidecar on the host with the default 127.0.0.1:9464: fail
                        # clearly (a probe is configured against that port), never fall back
                        raise StartError(
                            f"cannot serve the admin API on {config.admin_listen} "
                            f"({e.strerror or e}); another sidecar may be using it: pass "
                            "--admin-listen HOST:PORT (port 0 picks a free one), or "
                            "--admin-listen '' to serve the admin API on the Unix socket only"
                        ) from None
                if config.admin_socket:
                    from .admin import admin_socket_path, serve_admin_unix
                    try:
                        self.admin_socket = await nursery.start(functools.partial(
                            serve_admin_unix, self, admin_socket_path(config.cache_dir), lock=admin_lock))
                    except OSError as e:  # the mount works without it; say what is missing
                        log.warning("admin Unix socket not available; mount changes only over TCP "
                                    "with the admin token", extra={"error": e.strerror or str(e)})
                self._spawn("context", self._context_loop)
                self.want_context()
                await self._load_at_start()
                # the mirrors are saved by the saver right after the mount, unreferenced blobs
                # collected GC_EVERY s later (each a pass over every record: not on the way
                # to ready)

                # the outbox a previous process left: shown on the tree just loaded, then
                # queued again; it drains while the mount serves (new writes queue behind
                # it, the feeds wait for it: StoreSync._apply_page)
                if self.leftovers:
                    shown = self.fs.overlay_outbox(self.leftovers)
                    self.committer.replay(self.leftovers)
                    log.info("replaying outbox behind the mount",
                             extra={"entries": len(self.leftovers), "shown": shown})
                    nursery.start_soon(self._backlog_drained, self.leftovers)
                self.committer.replayed({e.node_key for e in self.leftovers
                                         if e.op == PUT and e.node_key})
                self.leftovers = []

                options = set(pyfuse3.default_options)
                # fsname stays a bare "memfuse" (`mount` run where a ./memfuse exists shows
                # that path as the source: libmount resolves it, cosmetic). "memfuse:<ws>" was
                # tried and changed what kill -9 leaves: the pod rehearsal's agent then found
                # the volume unmounted (ENOENT, writes would land in the emptyDir) instead
                # of ENOTCONN (tests/test_pod_rehearsal.py)
                options |= {"fsname=memfuse", "subtype=memfuse"}
                if config.fuse_fd is not None:
                    # mounted already by a privileged helper, which also unmounts it: libfuse
                    # serves the fd and never calls mount(2) / umount(2) for /dev/fd/N
                    target = f"/dev/fd/{config.fuse_fd}"
                else:
                    # a stale mount goes only now, just before ours (check_mountpoint_free let
                    # it be): while this sidecar loads, the agent's opens keep failing with
                    # ENOTCONN instead of finding the empty volume underneath and writing there
                    clean_stale_mount(config.mountpoint)
                    target = str(config.mountpoint)
                    if config.allow_other:
                        options.add("allow_other")
                    if os.path.exists("/usr/bin/fusermount3") or os.path.exists("/bin/fusermount3"):
                        options.add("auto_unmount")
                pyfuse3.init(self.ops, target, options)
                mounted = True
                self.invalidator.active = True
                self._spawn("invalidator", self.invalidator.run)
                self._spawn("interrupts", self.interrupts.run)
                self._mounted = True
                for slug in self.fs.stores:
                    self._start_feed(slug)
                self._spawn("events", self._events)
                self._spawn("saver", self._saver)
                self.fs.ready = True
                write_mount_info(config.cache_dir, {
                    "mountpoint": str(config.mountpoint), "workspace": config.workspace,
                    "pid": os.getpid(), "admin": self.admin_address})
                log.info("mounted", extra={"mountpoint": str(config.mountpoint),
                                           "stores": len(self.fs.stores), "workspace": config.workspace,
                                           "admin": self.admin_address})
                task_status.started(self)
                fd = usable_fd(config.fuse_fd)
                with self.reader.installed(fd) if fd is not None else contextlib.nullcontext():
                    await pyfuse3.main()
                log.info("FUSE session ended")
                nursery.cancel_scope.cancel()
        finally:
            self.invalidator.active = False
            if mounted:
                pyfuse3.close(unmount=True)
                log.info("unmounted", extra={"mountpoint": str(config.mountpoint)})
                with contextlib.suppress(OSError):
                    (config.cache_dir / MOUNT_INFO).unlink()
            self.save_states()
            self.fs.sync_rejected()  # written by journal.close() below
            self.fs.sync_local()
            left = self.committer.depth()
            if left:
                log.warning("entries left in the outbox for the next start", extra={"entries": left})
            self.journal.close()
            self.fs.blobs.close()
            lock.release()
        return 0

    async def _load_at_start(self) -> None:
        """List the attachments and load every attached store, or mount from the cache.

        With stores saved in the cache, the whole of it (the listing and every store's
        catch-up or snapshot) has ``offline_after`` s: past that, the stores loaded so far
        stay and every other saved store is mounted as last seen (``_load_offline``; the
        outbox is kept and drains once the control plane answers). A control plane that
        answers slowly (one byte every 0.2 s) so delays a mount by ``offline_after`` s at
        most; each request also has its own total deadline (``client.deadline``), so the
        retries go on. With nothing cached, the listing has ``start_timeout`` s (0: no
        limit) before ``StartError``; the stores then load without a start limit (a first
        snapshot may be big; each request is bounded and retried)."""
        config = self.config
        atts = None
        saved = bool(self._saved_slugs())
        if saved:
            with trio.move_on_after(config.offline_after) as scope:
                atts = await self._retrying(
                    "listing attachments", lambda: self.client.list_attachments(config.workspace))
                self.learn_actor()
                for att in atts:
                    await self._add_attachment(att)
            if scope.cancelled_caught:
                self._load_offline(listed=atts is not None)
                # no answer within offline_after: a known outage from the first moment
                # (status ``reachable: false``, closes return once accepted) until the
                # control plane answers anything (``_liveness``), not only after a commit fails
                self._offline_noted = time.monotonic()
                self.committer.no_answer(float(config.offline_after))
            return
        with trio.move_on_after(config.start_timeout or math.inf):
            atts = await self._retrying(
                "listing attachments", lambda: self.client.list_attachments(config.workspace))
        if atts is None:
            raise StartError(
                f"no answer from the control plane {self.client.base_url} within "
                f"{config.start_timeout:g} s at start (last error: {self.last_start_error}) "
                "and nothing is cached to mount; exiting")
        self.learn_actor()
        for att in atts:
            await self._add_attachment(att)

    async def _backlog_drained(self, entries: list[Entry]) -> None:
        """Log when the replayed backlog has committed (each entry finished)."""
        t0 = time.monotonic()
        for e in entries:
            await e.done.wait()
        log.info("outbox backlog committed", extra={"entries": len(entries),
                                                    "seconds": round(time.monotonic() - t0, 3)})

    async def _signals(self, sigs: AsyncIterator[int]) -> None:
        stopping = False
        nursery = self._nursery
        assert nursery is not None  # started in it
        async for sig in sigs:
            name = signal.Signals(sig).name
            if sig == signal.SIGHUP:
                if self._mounted and not stopping:
                    log.info("SIGHUP: reconciling attachments")
                    nursery.start_soon(self._reconcile_logged)
                continue
            if stopping:
                if sig == signal.SIGINT and self._drain_scope is not None:
                    log.warning("second interrupt: stop draining; the rest stays in the outbox")
                    self._drain_scope.cancel()
                else:
                    log.info("already stopping", extra={"signal": name})
                continue
            stopping = True
            if not self._mounted:
                log.info("stopping before the mount was up; accepted writes stay in the outbox",
                         extra={"signal": name})
                nursery.cancel_scope.cancel()
                continue
            log.info("stopping: draining the outbox",
                     extra={"signal": name, "depth": self.committer.depth(),
                            "timeout_s": self.config.drain_timeout})
            nursery.start_soon(self._stop)

    async def _stop(self) -> None:
        try:
            with trio.CancelScope() as self._drain_scope:
                await drain(self.fs, self.committer, self.config.drain_timeout)
        except Exception:  # never skip the unmount; what did not drain stays in the outbox
            log.exception("drain failed; unmounting anyway")
        finally:
            self._drain_scope = None
            self.reader.terminate()  # pyfuse3.terminate(), and the reader's loop ends

async def serve_mount(config: MountConfig, client: ApiClient, *,
                      invalidator: Invalidator | None = None,
                      feed_hold: Callable[[], Awaitable[None]] | None = None,
                      task_status: trio.TaskStatus[Sidecar] = trio.TASK_STATUS_IGNORED) -> int:
    """Run one sidecar (``Sidecar.run``) until SIGTERM / SIGINT or an external unmount
    (``invalidator``, ``feed_hold``: see ``Sidecar``)."""
    return await Sidecar(config, client, invalidator, feed_hold=feed_hold).run(task_status=task_status)


async def drain(fs: Filesystem, committer: Committer, timeout: float) -> None:
    """Commit dirty files and wait up to ``timeout`` s for the outbox to empty."""
    for n in fs.dirty_nodes():
        fs.commit_quietly(n)
    with trio.move_on_after(timeout):
        await committer.wait_idle()
    left = committer.depth()
    if left:
        log.warning("drain timed out; entries stay in the outbox for the next start",
                    extra={"left": left})
    else:
        log.info("outbox drained")


def run_mount(config: MountConfig, client_factory: Callable[[], ApiClient]) -> int:
    """Blocking entry point: set up logging, run ``serve_mount`` under trio, return the exit
    code: 0 after a stop, 1 when the sidecar could not start (``StartError``, logged as one
    line)."""
    setup_logging(config.debug, config.log_format)
    tune_gc()

    async def main() -> int:
        async with client_factory() as client:
            return await serve_mount(config, client)

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        start = group.subgroup(StartError)
        if start is None:
            raise
        log.error("%s", _first_leaf(start))
        return 1
    except StartError as e:
        log.error("%s", e)
        return 1


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
