"""``memfuse mount`` whose kernel invalidations can be held back: one process, one mount.

    python tests/held_mount.py MOUNTPOINT --control-plane URL --workspace WS
        --token-file F --cache-dir D --hold FILE [--hold-feed FILE2]

The same sidecar as ``memfuse mount`` (``memfuse.sidecar.mount.serve_mount``, its signal
handling: SIGTERM drains and unmounts), built with an ``Invalidator`` whose fault hook
(``hold``, passed at construction) keeps every batch of kernel invalidations back while FILE
exists (at most ``HOLD_MAX`` s per batch): a test widens the window in which the sidecar has
applied a remote change and the kernel still serves the older pages and size of the file
(tests/test_overwrite_base.py). With ``--hold-feed``, the sidecar's change feed (its
``feed_hold`` hook) applies no page of changes while FILE2 exists (at most ``HOLD_MAX`` s per
page): the control plane holds a rival version this mount does not show yet
(tests/test_overwrite_base.py, the own-append tests). With ``--hold-after-write FILE3``, every
record write the control plane answered (create, update, append) returns to the sidecar only
once FILE3 is gone (at most ``HOLD_MAX`` s): the outbox's next entry waits while another mount
writes (tests/test_overwrite_base.py, the outage test). The mount is ready when
``MOUNTPOINT/<store>`` exists.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memfuse.cli.run import actor_name, default_actor, sidecar_process_setup  # noqa: E402
from memfuse.client import ApiClient  # noqa: E402
from memfuse.sidecar.config import MountConfig  # noqa: E402
from memfuse.sidecar.invalidator import Invalidator  # noqa: E402
from memfuse.sidecar.logs import setup_logging  # noqa: E402
from memfuse.sidecar.mount import serve_mount  # noqa: E402
from memfuse.tokenfile import TokenFile  # noqa: E402

HOLD_MAX = 60.0  # s a batch is held at most (a test that forgets its file still ends)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint", type=Path)
    ap.add_argument("--control-plane", required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--token-file", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, required=True)
    ap.add_argument("--hold", type=Path, required=True,
                    help="while this file exists, kernel invalidations are held back")
    ap.add_argument("--hold-feed", type=Path, default=None,
                    help="while this file exists, the change feed applies no page")
    ap.add_argument("--hold-after-write", type=Path, default=None,
                    help="while this file exists, an answered record write does not return")
    ap.add_argument("--commit-wait", type=float, default=10.0)
    return ap.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    def holder(path: Path) -> Callable[[], Awaitable[None]]:
        async def hold() -> None:
            with trio.move_on_after(HOLD_MAX):
                while path.exists():
                    await trio.sleep(0.01)
        return hold

    feed_file: Path | None = args.hold_feed
    write_file: Path | None = args.hold_after_write

    class Client(ApiClient):
        """The API client whose answered record writes wait for ``write_file`` to go."""

        async def create_record(self, *a: Any, **kw: Any) -> Any:
            rec = await super().create_record(*a, **kw)
            await after_write()
            return rec

        async def update_record(self, *a: Any, **kw: Any) -> Any:
            rec = await super().update_record(*a, **kw)
            await after_write()
            return rec

        async def append_record(self, *a: Any, **kw: Any) -> Any:
            rec = await super().append_record(*a, **kw)
            await after_write()
            return rec

    async def after_write() -> None:
        if write_file is not None:
            await holder(write_file)()

    config = MountConfig(mountpoint=args.mountpoint.resolve(), workspace=args.workspace,
                         cache_dir=args.cache_dir, commit_wait=args.commit_wait,
                         admin_listen=None, log_format="json")
    config.mountpoint.mkdir(parents=True, exist_ok=True)
    actor = actor_name(default_actor(args.cache_dir))
    async with Client(args.control_plane, TokenFile(args.token_file), instance=actor,
                         lean=True, bounded=True) as client:
        return await serve_mount(config, client, invalidator=Invalidator(hold=holder(args.hold)),
                                 feed_hold=holder(feed_file) if feed_file is not None else None)


if __name__ == "__main__":
    a = parse_args()
    sidecar_process_setup()
    setup_logging(False, "json")
    sys.exit(trio.run(main, a))
