"""``memfuse serve`` ends promptly on SIGTERM while clients keep connections busy with reads
(hypercorn's path): each connection ends after its answer in flight, and the process exits
well inside the graceful timeout (5 s). A request read as the server began to terminate left
hypercorn's protocol paused on an event nothing set again, and every such connection lived
until the end of the grace period: SIGTERM with keep-alive reads took ~7 s (attack22, 9 runs
of 10). ``_HTTP11Only._maybe_recycle`` now stops the connection's reader when no next cycle
starts.
"""
from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from mountutil import ControlPlane

pytestmark = pytest.mark.timeout(120)


def _reads(port: int, token: str, until: float, answers: list[int]) -> None:
    """Send ``GET /v1/stores`` on one keep-alive connection, the next as soon as each answer
    is in, until ``until`` (monotonic) or the server closes; count the answers."""
    req = (f"GET /v1/stores HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n").encode()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        return
    with s:
        buf = b""
        while time.monotonic() < until:
            try:
                s.sendall(req)
                while b"\r\n\r\n" not in buf:
                    data = s.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                while len(buf) < length:
                    data = s.recv(65536)
                    if not data:
                        return
                    buf += data
                buf = buf[length:]
                answers.append(1)
                if b"connection: close" in head.lower():
                    return
            except OSError:
                return


def test_sigterm_with_keep_alive_reads_ends_the_server_promptly(tmp_path):
    cp = ControlPlane(tmp_path).start()
    try:
        answers: list[int] = []
        until = time.monotonic() + 30
        threads = [threading.Thread(target=_reads, args=(cp.port, cp.admin_token, until, answers), daemon=True)
                   for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(answers) < 200 and time.monotonic() < deadline:  # every connection busy
            time.sleep(0.05)
        assert len(answers) >= 200, len(answers)
        t0 = time.monotonic()
        assert cp.proc is not None
        cp.proc.send_signal(signal.SIGTERM)
        cp.proc.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(15)
        # the graceful timeout is 5 s; an idle server ends in ~1-2 s
        assert took < 4.0, f"serve took {took:.1f} s to end on SIGTERM with keep-alive reads"
    finally:
        cp.stop()
