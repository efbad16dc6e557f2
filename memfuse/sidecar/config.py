"""``MountConfig``: the options of one sidecar, apart from the sidecar (``mount.Sidecar``)
so its parts (``stores.StoreSync``) can name the type without importing the sidecar."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from memfuse.durations import check_seconds


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
    offline_after: float = 10.0  # s without an answer before mounting saved stores from the cache
    log_format: str = "json"
    token_check_interval: float = 5.0  # s between looks at --token-file for a rotated token
    # Mutations on the TCP admin API need this bearer token (None: refused on TCP).
    admin_token: str | None = field(default=None, repr=False)
    admin_socket: bool = True  # serve the admin API on <cache_dir>/admin.sock (mode 0600)
    # An open /dev/fuse fd already mounted by a privileged helper (libfuse >= 3.3 takes
    # /dev/fd/N as the mountpoint); None: mount MOUNTPOINT ourselves (mount(2) or fusermount3).
    fuse_fd: int | None = None
    # s without an answer from the control plane at start, with nothing cached to mount,
    # before giving up with exit status 1 (0: wait forever)
    start_timeout: float = 60.0
    # False: the control plane does not stream by design (an app reached in process through
    # httpx.ASGITransport, which buffers whole responses), so falling back to long-polling is
    # said at DEBUG, not INFO. memfuse dev serves its app over loopback HTTP: True there too
    streams_expected: bool = True

    def __post_init__(self) -> None:
        check_seconds(self, "commit_wait", "fsync_timeout", "drain_timeout", "offline_after",
                      "token_check_interval", "start_timeout",
                      positive=("fsync_timeout", "token_check_interval"), forever=("start_timeout",))
