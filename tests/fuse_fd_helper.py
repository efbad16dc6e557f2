"""A privileged FUSE mount helper, as a CSI node plugin would be (gcs-fuse-csi-driver,
mountpoint-s3 CSI v2): open ``/dev/fuse``, ``mount(2)`` it at MOUNTPOINT, hand the open
descriptor to an unprivileged FUSE daemon over a Unix socket (``SCM_RIGHTS``), and unmount
when told to.

    python fuse_fd_helper.py MOUNTPOINT SOCKET [--allow-other]

Listens on SOCKET, sends the descriptor to the first client, prints ``mounted`` on stdout,
then waits for a line on stdin (or EOF) and lazily unmounts (``umount2(MNT_DETACH)``). Needs
CAP_SYS_ADMIN (root). The kernel's FUSE mount options are documented in the Linux kernel's
``Documentation/filesystems/fuse.rst`` ("Mount options").
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import sys

MNT_DETACH = 2
MS_NOSUID = 2
MS_NODEV = 4


def main() -> int:
    mountpoint, sock_path = sys.argv[1], sys.argv[2]
    allow_other = "--allow-other" in sys.argv[3:]
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    opts = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},default_permissions"
    if allow_other:
        opts += ",allow_other"
    if libc.mount(b"memfuse", mountpoint.encode(), b"fuse.memfuse", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        print(f"mount failed: {os.strerror(err)}", file=sys.stderr)
        return 1
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
            srv.bind(sock_path)
            srv.listen(1)
            print("listening", flush=True)
            conn, _ = srv.accept()
            with conn:
                socket.send_fds(conn, [b"fuse"], [fd])
        os.close(fd)  # the daemon holds its own copy now
        print("mounted", flush=True)
        sys.stdin.readline()
    finally:
        libc.umount2(mountpoint.encode(), MNT_DETACH)
        print("unmounted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
