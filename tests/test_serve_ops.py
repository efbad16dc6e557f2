"""Operating ``memfuse serve``: JSON log lines by default (one per event, the exception as a
field), repeated failures rate-limited with a count (a 20 s database outage under load writes a
few lines, not thousands), ``--log-format text``, the database URL from ``--db-file`` (a
mounted Secret; the password never logged), ``http_request_duration_seconds`` by route
template and status, and the process collectors of both processes.

The outage is real: ``memfuse serve`` on PostgreSQL (tests/pgutil.py) reaches the database
through a TCP relay in this process that, for 20 s, cuts every connection and refuses new ones,
while clients keep calling the API and the readiness probe.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from memfuse.sidecar.logs import JsonFormatter, RepeatFilter
from mountutil import serve_listening, serve_process, stop
from pgutil import pg_bindir, pg_cluster, pg_url

MEMFUSE = Path(sys.executable).with_name("memfuse")
OUTAGE_SECONDS = 20.0


# ---------------------------------------------------------------- the rate limit itself


def test_repeat_filter_counts_what_it_drops():
    """One line per kind per window; the next line of the kind carries how many were
    dropped; other kinds and INFO lines are never held back."""
    now = [0.0]
    flt = RepeatFilter(window=10.0, clock=lambda: now[0])
    log = logging.getLogger("memfuse.test.repeat")

    def record(msg: str, level: int = logging.ERROR, exc: BaseException | None = None) -> logging.LogRecord:
        exc_info = (type(exc), exc, None) if exc is not None else None
        return log.makeRecord(log.name, level, __file__, 1, msg, ("GET", "/v1/stores"), exc_info)

    err = OSError("connection refused")
    assert flt.filter(record("database error on %s %s", exc=err))
    dropped = [flt.filter(record("database error on %s %s", exc=err)) for _ in range(500)]
    assert not any(dropped)
    assert flt.filter(record("database error on %s %s", exc=ValueError("other kind")))  # another kind
    assert all(flt.filter(record("served %s %s", logging.INFO)) for _ in range(5))
    now[0] = 10.5
    r = record("database error on %s %s", exc=err)
    assert flt.filter(r) and r.repeated == 500
    line = json.loads(JsonFormatter().format(r))
    assert line["repeated"] == 500 and line["level"] == "error" and "OSError: connection refused" in line["exc"]
    r = record("database error on %s %s", exc=err)
    assert not flt.filter(r)  # a new window started at 10.5


def test_process_collectors_in_the_sidecar_registry():
    from prometheus_client import generate_latest

    from memfuse.sidecar.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                 "python_gc_objects_collected_total", "python_info"):
        assert f"\n{name}" in text or text.startswith(name), name


def test_db_file_errors_name_the_file_never_its_content(tmp_path):
    secret = tmp_path / "db-url"
    env = dict(os.environ, MEMFUSE_HOME=str(tmp_path / "home"))
    for k in list(env):
        if k.startswith("MEMFUSE_") and k != "MEMFUSE_HOME":
            del env[k]
    cases = [(["--db-file", str(tmp_path / "missing")], "cannot read --db-file"),
             (["--db-file", str(secret)], "is empty"),
             (["--db-file", str(secret), "--db", "sqlite://"], "not both")]
    secret.write_text("\n")
    for args, msg in cases:
        p = subprocess.run([MEMFUSE, "serve", "--listen", "127.0.0.1:0", *args], env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
    secret.write_text("postgresql://u:hunter2@127.0.0.1:1/x\nsqlite://\n")
    p = subprocess.run([MEMFUSE, "serve", "--listen", "127.0.0.1:0", "--db-file", str(secret)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "one line" in p.stderr and "hunter2" not in p.stderr
    # MEMFUSE_DB_FILE is the same option
    secret.write_text("")
    p = subprocess.run([MEMFUSE, "serve", "--listen", "127.0.0.1:0"], env=dict(env, MEMFUSE_DB_FILE=str(secret)),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "is empty" in p.stderr


# ---------------------------------------------------------------- a real outage


class Relay:
    """A TCP relay 127.0.0.1:port → ``target`` that can be cut (``down()``: every connection
    closed, new ones refused at once) and restored (``up()``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.is_down = False
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                if self.is_down:
                    client.close()
                    continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def down(self) -> None:
        with self.lock:
            self.is_down = True
            pairs, self.pairs = self.pairs, []
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def up(self) -> None:
        with self.lock:
            self.is_down = False

    def close(self) -> None:
        self.closed = True
        self.down()
        self.sock.close()


@pytest.fixture(scope="module")
def postgres():
    if pg_url() is not None:
        yield pg_url()
        return
    if pg_bindir() is None:
        pytest.skip("PostgreSQL or psycopg not installed (./scripts/setup --test installs them)")
    with pg_cluster(max_connections=100) as url:
        yield url


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name{labels...}`` in a Prometheus text exposition (0 if absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_database_outage_is_a_few_json_lines_and_metrics(postgres, tmp_path):
    from sqlalchemy.engine import make_url

    url = make_url(postgres)
    relay = Relay((url.host, url.port))
    db_file = tmp_path / "db-url"  # as a mounted Secret would hold it
    db_file.write_text(url.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False) + "\n")
    password = url.password
    token = tmp_path / "admin.token"
    token.write_text("ops-admin-token")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")}
    env.update(MEMFUSE_HOME=str(tmp_path / "home"), MEMFUSE_DB_FILE=str(db_file))
    proc = serve_process(["--listen", "127.0.0.1:0", "--admin-token-file", str(token), "--migrate"], log,
                         env=env)
    try:
        base = serve_listening(proc, log)
        auth = {"Authorization": "Bearer ops-admin-token"}
        with httpx.Client(base_url=base, headers=auth, timeout=10) as c:
            assert c.post("/v1/stores", json={"slug": "ops"}).status_code == 201
            assert c.get("/v1/stores").status_code == 200
            assert c.get("/readyz").status_code == 200
        before = len(log.read_bytes().splitlines())
        stop_at = [0.0]
        counts = {"requests": 0, "503": 0, "500": 0}
        lock = threading.Lock()

        def hammer(path: str, headers: dict) -> None:
            with httpx.Client(base_url=base, headers=headers, timeout=10) as c:
                while time.monotonic() < stop_at[0]:
                    try:
                        r = c.get(path)
                    except httpx.HTTPError:
                        continue
                    with lock:
                        counts["requests"] += 1
                        if r.status_code in (500, 503):
                            counts[str(r.status_code)] += 1

        relay.down()
        stop_at[0] = time.monotonic() + OUTAGE_SECONDS
        workers = [threading.Thread(target=hammer, args=(p, auth)) for p in
                   ("/v1/stores", "/v1/stores/ops", "/v1/stores/ops/records", "/readyz")]
        for w in workers:
            w.start()
        for w in workers:
            w.join(OUTAGE_SECONDS + 30)
        relay.up()
        lines = log.read_bytes().splitlines()[before:]
        with httpx.Client(base_url=base, headers=auth, timeout=10) as c:
            deadline = time.monotonic() + 30
            while c.get("/readyz").status_code != 200:  # back once the database answers
                assert time.monotonic() < deadline, "not ready again after the outage"
                time.sleep(0.2)
            assert c.get("/v1/stores/ops").status_code == 200
            metrics = c.get("/metrics").text
        # the outage was felt by the clients (hundreds of failed requests) ...
        assert counts["503"] + counts["500"] >= 200, counts
        assert counts["500"] == 0, counts  # a database error is 503 with Retry-After, never 500
        # ... but written as a few lines: each kind once per 10 s, with the count it stands for
        parsed = [json.loads(ln) for ln in lines]  # every line is one JSON object
        print(f"outage of {OUTAGE_SECONDS:g} s: {counts['requests']} requests, {counts['503']} answered 503, "
              f"{len(parsed)} log lines")
        assert len(parsed) <= 60, f"{len(parsed)} lines for {counts}:\n" + "\n".join(
            ln.decode()[:200] for ln in lines[:80])
        assert any(p.get("repeated", 0) >= 10 for p in parsed), [p.get("msg") for p in parsed]
        assert all("\n" not in ln.decode() for ln in lines)
        with_exc = [p for p in parsed if "exc" in p]
        assert with_exc and all(p["exc"].startswith("Traceback") for p in with_exc)  # the exception a field
        text = log.read_text()
        assert password and f":{password}@" not in text  # --db-file: the password is never logged
        # request latency by route template and status, and the process collectors
        assert _metric(metrics, "http_request_duration_seconds_count", route="/v1/stores/{store}",
                       method="GET", status="200") >= 1
        assert _metric(metrics, "http_request_duration_seconds_count", route="/v1/stores/{store}",
                       method="GET", status="503") >= 10
        assert _metric(metrics, "http_request_duration_seconds_count", route="/v1/stores/{store}/records",
                       method="GET", status="503") >= 10
        assert "/v1/stores/ops" not in metrics  # templates, never raw paths
        assert _metric(metrics, "process_resident_memory_bytes") > 10e6
        assert _metric(metrics, "process_open_fds") > 0
    finally:
        stop(proc)
        relay.close()


def test_log_format_text(tmp_path):
    token = tmp_path / "admin.token"
    token.write_text("ops-admin-token")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")}
    env.update(MEMFUSE_HOME=str(tmp_path / "home"), MEMFUSE_LOG_FORMAT="text")
    proc = serve_process(["--db", f"sqlite:///{tmp_path / 'cp.db'}", "--listen", "127.0.0.1:0",
                          "--admin-token-file", str(token), "--migrate"], log, env=env)
    try:
        serve_listening(proc, log)
    finally:
        stop(proc)
    lines = log.read_text().splitlines()
    assert lines and not any(ln.startswith("{") for ln in lines)
    assert any(" INFO memfuse.serve: memfuse serve: listening on http://127.0.0.1:" in ln for ln in lines)
