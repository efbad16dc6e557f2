"""Assembly of the sidecar: replay the outbox, load the attached stores, mount, serve, drain.

``run_mount(config, client_factory)`` is the blocking entry point used by ``memfuse mount``
and ``memfuse dev``. The order follows DESIGN.md §6: replay the outbox first, then list the
workspace's attachments and load each store, then mount and report ready. SIGTERM / SIGINT
drain the outbox for up to ``drain_timeout`` seconds, unmount and exit 0; what did not drain
stays in the outbox for the next start.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyfuse3
import trio

from ..client import ApiClient, TransientError
from .core import BlobCache, Filesystem, Settings
from .fuse_ops import MemfuseOps
from .outbox import Committer, Journal

log = logging.getLogger("memfuse.mount")


@dataclass
class MountConfig:
    """Options of one sidecar (``memfuse mount --help``). Times in seconds."""

    mountpoint: Path
    workspace: str
    cache_dir: Path
    uid: int | None = None
    gid: int | None = None
    allow_other: bool = False
    commit_wait: float = 10.0
    fsync_timeout: float = 60.0
    drain_timeout: float = 20.0
    admin_listen: str | None = None
    debug: bool = False
    log_format: str = "json"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message and the record's ``extra`` fields."""

    _std = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                       + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for k, v in record.__dict__.items():
            if k not in self._std and not k.startswith("_"):
                out[k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(debug: bool = False, fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("httpx", "httpcore", "hypercorn", "pyfuse3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def clean_stale_mount(mountpoint: Path) -> None:
    """Lazily unmount a mount left by a killed daemon ("Transport endpoint is not connected")."""
    try:
        os.stat(mountpoint)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            raise
    log.warning("stale FUSE mount found; unmounting it", extra={"mountpoint": str(mountpoint)})
    subprocess.run(["fusermount3", "-uz", str(mountpoint)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class CacheLock:
    """An exclusive ``flock`` on ``<cache_dir>/lock``: two sidecars never share one cache."""

    def __init__(self, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
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
        os.close(self.fd)


async def load_workspace(fs: Filesystem, client: ApiClient, workspace: str) -> None:
    """List the attachments and load every store's snapshot into ``fs``, retrying transient
    failures (the control plane may still be starting) with capped backoff."""
    delay = 0.2
    while True:
        try:
            attachments = await client.list_attachments(workspace)
            for att in attachments:
                records, _seq = await client.snapshot(att.store.slug, content=True)
                limits = {"max_record_bytes": att.store.max_record_bytes,
                          "max_store_bytes": att.store.max_store_bytes,
                          "max_records": att.store.max_records}
                fs.add_store(att.store.slug, att.access.value, records, limits=limits)
                log.info("store loaded", extra={"store": att.store.slug, "records": len(records),
                                                "access": att.access.value})
            return
        except TransientError as e:
            log.warning("control plane unreachable while loading; retrying",
                        extra={"status": e.status, "retry_in_s": delay})
            await trio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def serve_mount(config: MountConfig, client: ApiClient, *,
                      task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Run one mount until SIGTERM / SIGINT or an external unmount; return the exit code."""
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    lock = CacheLock(config.cache_dir)
    journal = Journal(config.cache_dir / "outbox.db")
    leftovers, keymap = journal.load()
    committer = Committer(client, journal, keymap)
    settings = Settings(commit_wait=config.commit_wait, fsync_timeout=config.fsync_timeout)
    if config.uid is not None:
        settings.uid = config.uid
    if config.gid is not None:
        settings.gid = config.gid
    fs = Filesystem(BlobCache(config.cache_dir / "blobs"), committer, settings, config.workspace,
                    dirs_file=config.cache_dir / "dirs.json")
    ops = MemfuseOps(fs)
    mounted = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.run)
            await nursery.start(committer.run)
            if leftovers:
                log.info("replaying outbox", extra={"entries": len(leftovers)})
                committer.replay(leftovers)
                await committer.wait_idle()
                log.info("outbox replayed", extra={"entries": len(leftovers)})
            await load_workspace(fs, client, config.workspace)

            clean_stale_mount(config.mountpoint)
            options = set(pyfuse3.default_options)
            options |= {"fsname=memfuse", "subtype=memfuse"}
            if config.allow_other:
                options.add("allow_other")
            if os.path.exists("/usr/bin/fusermount3") or os.path.exists("/bin/fusermount3"):
                options.add("auto_unmount")
            pyfuse3.init(ops, str(config.mountpoint), options)
            mounted = True
            fs.ready = True
            log.info("mounted", extra={"mountpoint": str(config.mountpoint),
                                       "stores": len(fs.stores), "workspace": config.workspace})
            task_status.started(fs)

            async def signals() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                    async for sig in sigs:
                        if sig == signal.SIGHUP:
                            log.info("SIGHUP: attachment reconcile is not implemented yet")
                            continue
                        log.info("stopping: draining the outbox",
                                 extra={"signal": signal.Signals(sig).name,
                                        "depth": committer.depth(), "timeout_s": config.drain_timeout})
                        await drain(fs, committer, config.drain_timeout)
                        pyfuse3.terminate()
                        return

            nursery.start_soon(signals)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()
    finally:
        if mounted:
            pyfuse3.close(unmount=True)
            log.info("unmounted", extra={"mountpoint": str(config.mountpoint)})
        journal.close()
        lock.release()
    return 0


async def drain(fs: Filesystem, committer: Committer, timeout: float) -> None:
    """Commit dirty files and wait up to ``timeout`` s for the outbox to empty."""
    for n in list(fs.inodes.values()):
        if n.dirty:
            fs.commit(n)
    with trio.move_on_after(timeout):
        await committer.wait_idle()
    left = committer.depth()
    if left:
        log.warning("drain timed out; entries stay in the outbox for the next start",
                    extra={"left": left})
    else:
        log.info("outbox drained")


def run_mount(config: MountConfig, client_factory: Callable[[], ApiClient]) -> int:
    """Blocking entry point: set up logging, run ``serve_mount`` under trio, return exit code."""
    setup_logging(config.debug, config.log_format)

    async def main() -> int:
        async with client_factory() as client:
            return await serve_mount(config, client)

    return trio.run(main)
