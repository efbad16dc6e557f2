"""Ctrl-C of a process blocked in fsync(2) / close(2) on the mount (docs/SEMANTICS.md, "Writes
and close"; attack 14 F8): the wait ends with EINTR within a poll of the signal, the write
stays queued and lands once the control plane answers. pyfuse3 does not pass FUSE_INTERRUPT
on, so the sidecar watches the opener's pending signals (memfuse/sidecar/interrupts.py).
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import trio

from memfuse.sidecar.interrupts import Interrupts, signal_pending

# writes, says so, then fsyncs (or closes); a KeyboardInterrupt is printed with the time it took
# and the time it was printed at (``time.monotonic()``, the system's clock: the test's own)
#: the writer takes Ctrl-C as a shell's foreground program does, even when this test runs
#: with SIGINT ignored (started in the background by a non-interactive shell: POSIX has its
#: asynchronous commands ignore SIGINT and SIGQUIT, and exec keeps an ignored signal ignored)
_WRITER = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"kept\n")
print("waiting", flush=True)
t0 = time.monotonic()
try:
    os.fsync(fd) if sys.argv[2] == "fsync" else os.close(fd)
except KeyboardInterrupt:
    print(f"interrupted {time.monotonic() - t0:.2f} at {time.monotonic():.6f}", flush=True)
    sys.exit(3)
except OSError as e:
    print(f"error {e.errno} {time.monotonic() - t0:.2f}", flush=True)
    sys.exit(4)
print(f"returned {time.monotonic() - t0:.2f}", flush=True)
"""


def test_signal_pending_reads_the_pending_stop_signals_a_thread_does_not_block():
    """A stopped process keeps the signals sent to it pending: one of the stop signals
    (SIGINT...) counts, SIGUSR1 only when asked for; a signal the thread blocks never counts
    (the kernel does not interrupt it either); no such thread: False."""
    # SIGINT at its default disposition in the child (an ignored one is discarded, never
    # pending; this test may run with it ignored: see _WRITER)
    p = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        os.kill(p.pid, signal.SIGSTOP)
        with open(f"/proc/{p.pid}/stat") as f:
            for _ in range(1000):
                f.seek(0)
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
                time.sleep(0.01)
        assert not signal_pending(p.pid)
        os.kill(p.pid, signal.SIGUSR1)
        assert not signal_pending(p.pid) and signal_pending(p.pid, {signal.SIGUSR1})
        os.kill(p.pid, signal.SIGINT)
        assert signal_pending(p.pid)
    finally:
        p.kill()
        p.wait(10)
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    me, usr1 = threading.get_native_id(), {signal.SIGUSR1}
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, usr1)
        try:
            # to this thread: a process-directed signal goes to any thread that does not
            # block it (pytest's process has others: the watchdog, earlier tests' workers)
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            assert signal.SIGUSR1 in signal.sigpending()
            assert not signal_pending(me, usr1)  # pending, blocked
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, usr1)
        assert got == [1] and not signal_pending(me, usr1)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert not signal_pending(0) and not signal_pending(2**22 + 12345)  # no such thread


async def test_a_watched_wait_ends_when_its_opener_is_signalled():
    signalled: set[int] = set()
    ints = Interrupts(pending=lambda pid: pid in signalled, poll=0.02)
    ints.opened(7, 4242)
    ints.opened(8, 0)  # no pid known: never interrupted
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ints.run)
        with trio.move_on_after(0.2) as scope, ints.watch(7, scope) as w:
            await trio.sleep(10)  # not signalled: the deadline ends it
        assert scope.cancelled_caught and not w.interrupted
        with trio.move_on_after(5) as scope, ints.watch(7, scope) as w:
            signalled.add(4242)
            await trio.sleep(10)
        assert w.interrupted and scope.cancelled_caught
        signalled.add(0)
        with trio.move_on_after(0.2) as scope, ints.watch(8, scope) as w8:
            await trio.sleep(10)
        assert not w8.interrupted
        ints.released(7)
        assert ints.openers == {} and not ints._waiting
        nursery.cancel_scope.cancel()


def _start_writer(path, how: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), how], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = _readline(p, 30)
    assert line == "waiting\n", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def _interrupt_writer(path, how: str, after: float) -> tuple[str, float]:
    """Start ``_WRITER`` on ``path`` (``how``: ``fsync`` or ``close``), check it still waits
    ``after`` s later, send it SIGINT; return its line and the seconds from the signal to
    that line, by the writer's clock (CLOCK_MONOTONIC, the system's: a pause of this
    process while it waits for the line is not counted). The writer must have exited 3
    (its KeyboardInterrupt); killed if left."""
    p = _start_writer(path, how)
    try:
        time.sleep(after)
        assert p.poll() is None, f"{how} returned while the control plane is stopped"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        line = _readline(p, 40)
        at = line.split(" at ")
        took = (float(at[1]) if len(at) == 2 else time.monotonic()) - t0
        assert p.wait(30) == 3, (line, p.stderr.read())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return line, took


def _readline(p: subprocess.Popen, timeout: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ""


@pytest.mark.mount
def test_ctrl_c_of_an_fsync_blocked_on_a_stopped_control_plane_returns_at_once(tmp_path):
    from mountutil import Rig, live_records, sh, sidecar_status, wait_until

    with Rig(tmp_path) as rig:
        sc = rig.sidecar("ws", "--fsync-timeout", "25")
        d = sc.mountpoint / "default"
        rig.cp.freeze()
        try:
            sh("echo x > first.md", d, timeout=30)  # the outbox learns the control plane is down
            wait_until(lambda: sidecar_status(sc)["control_plane"]["reachable"] is False, timeout=30,
                       what="the control plane seen down")
            line, took = _interrupt_writer(d / "f.md", "fsync", after=1.5)
            assert line.startswith("interrupted"), line
            assert took < 2.5, f"fsync went on {took:.1f} s after SIGINT ({line.strip()})"
            assert "was interrupted by a signal to its process" in sc.log.read_text()
            # the write stays queued and the file shows it
            assert (d / "f.md").read_bytes() == b"kept\n"
            assert os.getxattr(d / "f.md", "user.memfuse.state") == b"pending"
        finally:
            rig.cp.thaw()
        wait_until(lambda: sidecar_status(sc)["outbox"]["depth"] == 0, timeout=60, what="outbox drained")
        recs = live_records(rig.cp)
        assert {k: r.content for k, r in recs.items()} == {"first.md": "x\n", "f.md": "kept\n"}


@pytest.mark.mount
def test_ctrl_c_of_a_close_waiting_for_its_commit_returns_at_once(tmp_path):
    """A close waits for the commit (``--commit-wait``) until the outbox learns that the
    control plane is down (3 s of silence): the first close after it stopped waits ~3 s.
    SIGINT 0.5 s into it ends it within a poll; the write stays queued and lands."""
    from mountutil import Rig, live_records, sidecar_status, wait_until

    with Rig(tmp_path) as rig:
        sc = rig.sidecar("ws", "--commit-wait", "30")
        d = sc.mountpoint / "default"
        rig.cp.freeze()
        try:
            line, took = _interrupt_writer(d / "c.md", "close", after=0.5)
            assert line.startswith("interrupted"), line
            # on main the close ran its 3 s (the control plane seen down) before the signal
            assert took < 1.5 and float(line.split()[1]) < 2.0, (took, line)
            assert "was interrupted by a signal to its process" in sc.log.read_text()
            assert (d / "c.md").read_bytes() == b"kept\n"
        finally:
            rig.cp.thaw()
        wait_until(lambda: sidecar_status(sc)["outbox"]["depth"] == 0, timeout=60, what="outbox drained")
        assert {k: r.content for k, r in live_records(rig.cp).items()} == {"c.md": "kept\n"}
