"""``memfuse mount`` whose kernel invalidations can be held back: one process, one mount.

    python tests/held_mount.py MOUNTPOINT --control-plane URL --workspace WS
        --token-file F --cache-dir D --hold FILE

The same sidecar as ``memfuse mount`` (``memfuse.sidecar.mount.serve_mount``, its signal
handling: SIGTERM drains and unmounts), built with an ``Invalidator`` whose fault hook
(``hold``, passed at construction) keeps every batch of kernel invalidations back while FILE
exists (at most ``HOLD_MAX`` s per batch): a test widens the window in which the sidecar has
applied a remote change and the kernel still serves the older pages and size of the file
(tests/test_overwrite_base.py). The mount is ready when ``MOUNTPOINT/<store>`` exists.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    ap.add_argument("--commit-wait", type=float, default=10.0)
    return ap.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    hold_file: Path = args.hold

    async def hold() -> None:
        with trio.move_on_after(HOLD_MAX):
            while hold_file.exists():
                await trio.sleep(0.01)

    config = MountConfig(mountpoint=args.mountpoint.resolve(), workspace=args.workspace,
                         cache_dir=args.cache_dir, commit_wait=args.commit_wait,
                         admin_listen=None, log_format="json")
    config.mountpoint.mkdir(parents=True, exist_ok=True)
    actor = actor_name(default_actor(args.cache_dir))
    async with ApiClient(args.control_plane, TokenFile(args.token_file), instance=actor,
                         lean=True, bounded=True) as client:
        return await serve_mount(config, client, invalidator=Invalidator(hold=hold))


if __name__ == "__main__":
    a = parse_args()
    sidecar_process_setup()
    setup_logging(False, "json")
    sys.exit(trio.run(main, a))
