"""A sidecar mounted over the in-process fake control plane, with fault injection: one process.

    python tests/fake_sidecar.py MOUNTPOINT --cache-dir D [--error-rate 0.1] [--drop-rate 0.05]
        [--rate-429 0] [--seed N] [--commit-wait S] [--drain-timeout S] --dump STATE.json

pyfuse3 allows one mount per process and a test must not block the loop that serves its own
mount, so a test that wants the fake (``memfuse.fake.FakeControlPlane``) behind a real FUSE
mount runs this script as a subprocess. It builds the fake (workspace ``ws``, store
``default``), turns the faults on, and runs ``memfuse.sidecar.mount.serve_mount`` under trio
with an ``ApiClient`` over the fake's fault-injecting transport — the same code path and the
same signal handling as ``memfuse mount`` (SIGTERM / SIGINT: drain, unmount). After the unmount
it writes STATE.json, read from the fake's app over a transport *without* faults:

    {"records": [{"id", "path", "deleted", "version", "sha256", "content",
                  "versions": [{"version", "operation", "sha256", "path"}, ...]}, ...],
     "counters": {fault counter: n, ...},            # memfuse.fake.FaultCounters
     "outbox": {"depth", "committed", "refused", "retries"}}

and exits 0. The mount is ready when ``MOUNTPOINT/default`` exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memfuse.client import ApiClient  # noqa: E402
from memfuse.fake import FakeControlPlane  # noqa: E402
from memfuse.sidecar.logs import setup_logging  # noqa: E402
from memfuse.sidecar.mount import MountConfig, serve_mount  # noqa: E402
from mountutil import dump_records  # noqa: E402  (this script's own folder is on sys.path)

WORKSPACE = "ws"
STORE = "default"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint", type=Path)
    ap.add_argument("--cache-dir", type=Path, required=True)
    ap.add_argument("--dump", type=Path, required=True, help="where to write the final state (JSON)")
    ap.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered 503")
    ap.add_argument("--drop-rate", type=float, default=0.0,
                    help="fraction of requests applied whose response is lost")
    ap.add_argument("--rate-429", type=float, default=0.0, help="fraction answered 429")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit-wait", type=float, default=10.0)
    ap.add_argument("--fsync-timeout", type=float, default=60.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--debug", action="store_true")
    return ap.parse_args(argv)


async def dump_state(fake: FakeControlPlane, path: Path, outbox: dict) -> None:
    """Every record of the store (deleted ones too) with content and version list, read through
    an un-faulted transport, plus the fault counters; written atomically to ``path``."""
    api = ApiClient(fake.base_url, fake.admin_token, transport=httpx.ASGITransport(app=fake.app))
    async with api:
        out = await dump_records(api, STORE)
    state = {"records": out, "counters": dataclasses.asdict(fake.counters), "outbox": outbox}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


async def main(args: argparse.Namespace) -> int:
    fake = FakeControlPlane(seed=args.seed)
    token = await fake.setup(WORKSPACE, stores=(STORE,))
    fake.faults.error_rate = args.error_rate
    fake.faults.drop_rate = args.drop_rate
    fake.faults.rate_429 = args.rate_429
    config = MountConfig(mountpoint=args.mountpoint.resolve(), workspace=WORKSPACE,
                         cache_dir=args.cache_dir, commit_wait=args.commit_wait,
                         fsync_timeout=args.fsync_timeout, drain_timeout=args.drain_timeout,
                         admin_listen=None, debug=args.debug, log_format="json")
    config.mountpoint.mkdir(parents=True, exist_ok=True)
    rc = 0
    async with ApiClient(fake.base_url, token, transport=fake.transport, instance="fake-sidecar") as client:
        async with trio.open_nursery() as nursery:
            async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
                nonlocal rc
                rc = await serve_mount(config, client, task_status=task_status)

            started = await nursery.start(run)  # the sidecar object (it has .committer)
        # serve_mount returned: SIGTERM / SIGINT drained the outbox and unmounted
        c = started.committer
        outbox = {"depth": c.depth(), "committed": c.committed, "refused": c.refused,
                  "retries": c.retries}
    fake.faults.reset()
    await dump_state(fake, args.dump, outbox)
    await fake.aclose()
    return rc


if __name__ == "__main__":
    a = parse_args()
    setup_logging(a.debug, "json")
    sys.exit(trio.run(main, a))
