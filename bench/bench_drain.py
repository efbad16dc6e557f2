"""Drain: how long 1,000 pending writes take to reach the control plane once it is back.

    .venv/bin/python bench/bench_drain.py [--quick]

A control plane of its own (it is stopped and restarted) and one sidecar with
``--commit-wait 0.2``. The control plane is stopped; 32 writer threads create, write and close
1,000 files (each close gives up waiting after 0.2 s and returns 0: the write stays accepted in
the outbox); ``MOUNT/.memfuse/status.json`` must then show ``outbox.depth == 1000``. The control
plane is started again on the same port and the status file is polled every 20 ms until
``outbox.depth == 0``.

Figures (no target in bench/README.md): seconds from the control plane listening again until the
outbox is empty; the detail splits that into the wait before the first commit (the committer's
retry backoff still sleeping) and the drain itself, with its rate in entries/s.
"""
from __future__ import annotations

import os
import threading
import time

import trio

from common import ApiClient, ControlPlane, Mount, Row, Session, main_for

STORE = "drain"
WS = "ws-drain"


def run(s: Session) -> list[Row]:
    n = 200 if s.quick else 1000
    threads = 32
    d = s.dir / "cp-drain"
    d.mkdir()
    cp = ControlPlane(d).start()
    s.on_close(cp.stop)
    m = None
    try:
        async def setup() -> str:
            async with ApiClient(cp.url, cp.admin_token) as c:
                await c.create_workspace(WS, default_store=False)
                await c.create_store(STORE, max_records=50_000)
                await c.attach(WS, STORE)
                return (await c.create_token(workspace=WS, name="bench")).token
        tok = d / "ws.token"
        tok.write_text(trio.run(setup))
        m = Mount(s, cp, WS, tok, "drain", commit_wait=0.2)
        m.start(STORE, nonempty=False)
        root = m.mountpoint / STORE
        for k in range(10):
            (root / f"d{k}").mkdir()
        def outbox() -> dict:
            return m.status()["outbox"]

        s.say("drain: control plane stopped")
        cp.stop()
        errors: list[BaseException] = []

        def work(idx: range) -> None:
            try:
                for i in idx:
                    fd = os.open(root / f"d{i % 10}" / f"f{i:05d}.md",
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                    try:
                        os.write(fd, f"pending write {i}\nwritten while the control plane was down\n".encode())
                    finally:
                        os.close(fd)
            except BaseException as e:
                errors.append(e)

        s.say(f"drain: writing {n} files with {threads} threads")
        t0 = time.perf_counter()
        ts = [threading.Thread(target=work, args=(range(k, n, threads),)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        t_write = time.perf_counter() - t0
        if errors:
            raise errors[0]
        before = outbox()
        s.say(f"drain: {before['depth']} entries pending after {t_write:.1f} s; restarting the control plane")
        t_start = time.perf_counter()
        cp.start()
        t_listen = time.perf_counter()
        committed0 = before["committed"]
        t_first = None
        deadline = t_listen + 300
        while True:
            ob = outbox()
            now = time.perf_counter()
            if t_first is None and ob["committed"] > committed0:
                t_first = now
            if ob["depth"] == 0:
                break
            if now > deadline:
                raise RuntimeError(f"outbox did not drain in 300 s: {ob}")
            time.sleep(0.02)
        t_done = time.perf_counter()
        after = ob
    finally:
        if m is not None:
            m.stop()
        cp.stop()
    t_first = t_first or t_done
    drained = after["committed"] - committed0
    return [Row("drain", f"drain {n} pending writes after the control plane returns",
                t_done - t_listen, "s",
                detail={"pending_before": before["depth"], "write_phase_s": t_write,
                        "cp_start_s": t_listen - t_start,
                        "wait_before_first_commit_s": t_first - t_listen,
                        "drain_after_first_commit_s": t_done - t_first,
                        "drain_rate_per_s": drained / (t_done - t_first) if t_done > t_first else None,
                        "committed": drained, "retries_total": after["retries"],
                        "refused": after["refused"] - before["refused"]})]


if __name__ == "__main__":
    raise SystemExit(main_for(run, "drain"))
