"""The sidecar admin HTTP API (memfuse/sidecar/admin.py) served for real (h11 under trio)
on a loopback port and on its Unix socket, hit with httpx; mutations need the admin token on
TCP (loopback included) and none on the 0600 socket; `memfuse status` and `memfuse mounts`
(CliRunner) against a status.json and against that admin API."""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import socket
from pathlib import Path

import httpx
import pytest
import trio
from click.testing import CliRunner

from memfuse.cli import cli
from memfuse.sidecar.admin import (
    PROBLEM_JSON,
    AdminTarget,
    admin_socket_path,
    format_status,
    is_loopback,
    parse_listen,
    read_admin_token,
    serve_admin,
    serve_admin_unix,
    token_matches,
)
from memfuse.sidecar.metrics import Metrics

SECRET = "s3cr3t-memory-content"
TOKEN = "admin-t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class StubTarget:
    """An AdminTarget with a real Metrics: stores `default` (mounted), `shared` (attached, not
    mounted) and `locked` (attached, refused)."""

    def __init__(self) -> None:
        self.ready = False
        self.metrics = Metrics()
        self.depth = 3
        self.metrics.bind(depth=lambda: self.depth, oldest=lambda: 1.5, records=lambda: 12,
                          cache_bytes=lambda: 4096, stores=lambda: len(self.mounted),
                          ready=lambda: float(self.ready))
        self.metrics.fuse_ops.labels(op="read").inc(7)
        self.attached = {"default": "read_write", "shared": "read_only", "locked": "read_write"}
        self.mounted = {"default"}
        self.calls: list[tuple[str, str]] = []
        self.fail_status = False

    def status(self) -> dict:
        if self.fail_status:
            raise RuntimeError(SECRET)
        return {
            "workspace": "team",
            "ready": self.ready,
            "uptime_s": 12.5,
            "stores": [{"slug": s, "access": self.attached[s], "records": 4} for s in sorted(self.mounted)],
            "outbox": {"depth": self.depth, "oldest_age_s": 1.5, "committed": 9, "refused": 1,
                       "retries": 2},
            "open_handles": 0,
            "not_a_number": float("nan"),
        }

    async def mount_store(self, slug: str) -> dict:
        self.calls.append(("mount", slug))
        await trio.sleep(0)
        if slug not in self.attached:
            raise LookupError(slug)
        if slug == "locked":
            raise PermissionError(slug)
        self.mounted.add(slug)
        return {"store": slug, "mounted": True, "access": self.attached[slug]}

    async def unmount_store(self, slug: str) -> dict:
        self.calls.append(("unmount", slug))
        await trio.sleep(0)
        if slug not in self.mounted:
            raise LookupError(slug)
        self.mounted.discard(slug)
        return {"store": slug, "mounted": False, "committed": 0}


@pytest.fixture
async def admin(nursery):
    """(stub target, base URL) with serve_admin running on 127.0.0.1, port 0."""
    target = StubTarget()
    assert isinstance(target, AdminTarget)
    bound = await nursery.start(functools.partial(serve_admin, target, "127.0.0.1:0", token=TOKEN))
    host, port = parse_listen(bound)
    assert host == "127.0.0.1" and port != 0
    return target, f"http://{bound}"


def assert_problem(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM_JSON
    body = r.json()
    assert body["status"] == status and body["code"] == code
    assert body["title"] and body["type"] == "about:blank"
    return body


async def test_health_ready_status(admin):
    target, url = admin
    async with httpx.AsyncClient(base_url=url) as c:
        r = await c.get("/healthz")
        assert r.status_code == 200 and r.json() == {"ok": True}

        r = await c.get("/readyz")
        assert_problem(r, 503, "not_ready")
        assert r.headers["retry-after"] == "1"
        target.ready = True
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json() == {"ready": True}

        r = await c.get("/v1/status", headers=AUTH)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        body = r.json()
        assert body["workspace"] == "team" and body["ready"] is True
        assert body["outbox"]["depth"] == 3 and body["stores"][0]["slug"] == "default"
        assert body["not_a_number"] is None  # NaN is not JSON


async def test_metrics(admin):
    target, url = admin
    async with httpx.AsyncClient(base_url=url) as c:
        r = await c.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "memfuse_outbox_depth 3.0" in r.text
        assert 'memfuse_fuse_ops_total{op="read"} 7.0' in r.text
        target.depth = 5  # gauges are computed at scrape time
        assert "memfuse_outbox_depth 5.0" in (await c.get("/metrics")).text

        r = await c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert r.headers["content-type"].startswith("application/openmetrics-text")
        assert r.text.rstrip().endswith("# EOF") and "memfuse_outbox_depth 5.0" in r.text


async def test_mount_and_unmount(admin):
    target, url = admin
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as c:
        r = await c.post("/v1/mounts/shared")
        assert r.status_code == 200
        assert r.json() == {"store": "shared", "mounted": True, "access": "read_only"}
        assert "shared" in target.mounted

        assert_problem(await c.post("/v1/mounts/nope"), 404, "store_not_attached")
        assert_problem(await c.post("/v1/mounts/locked"), 403, "store_refused")

        r = await c.delete("/v1/mounts/shared")
        assert r.status_code == 200 and r.json()["mounted"] is False
        assert "shared" not in target.mounted
        body = assert_problem(await c.delete("/v1/mounts/shared"), 404, "store_not_mounted")
        assert body["instance"] == "/v1/mounts/shared"

        # an invalid slug never reaches the target
        n = len(target.calls)
        assert_problem(await c.post("/v1/mounts/Bad..Name!"), 400, "invalid_name")
        assert_problem(await c.delete("/v1/mounts/%2E%2E"), 400, "invalid_name")
        assert len(target.calls) == n


async def test_unknown_routes_and_methods_are_problems(admin):
    _, url = admin
    async with httpx.AsyncClient(base_url=url) as c:
        assert_problem(await c.get("/nope"), 404, "not_found")
        r = await c.get("/v1/mounts/default")
        assert_problem(r, 405, "method_not_allowed")
        assert "POST" in r.headers["allow"] and "DELETE" in r.headers["allow"]
        assert_problem(await c.post("/healthz"), 405, "method_not_allowed")


async def _raw(bound: str, data: bytes) -> bytes:
    """Send ``data`` on one TCP connection, return everything answered until the server closes."""
    host, port = parse_listen(bound)
    out = b""
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(data)
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


async def test_http_framing_keep_alive_head_and_bad_requests(admin):
    """The admin server's HTTP/1.1 (h11): keep-alive, HEAD without a body, and a malformed
    request, an oversized head (431) or body (413) answered as problems on a closed
    connection, while the server keeps serving."""
    _, url = admin
    bound = url.removeprefix("http://")
    two = await _raw(bound, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"
                            b"GET /v1/status HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer " + TOKEN.encode()
                            + b"\r\nConnection: close\r\n\r\n")
    assert two.count(b"HTTP/1.1 200 ") == 2 and b'{"ok": true}' in two and b'"workspace": "team"' in two
    bad = await _raw(bound, b"NOT HTTP AT ALL\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400 ") and PROBLEM_JSON.encode() in bad
    big_head = await _raw(bound, b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
    assert big_head.startswith(b"HTTP/1.1 431 ")
    big_body = await _raw(bound, b"POST /v1/mounts/shared HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n"
                                 + b"a" * 65_600)
    assert big_body.startswith(b"HTTP/1.1 413 ") and b"body_too_large" in big_body
    async with httpx.AsyncClient(base_url=url) as c:
        r = await c.head("/healthz")
        assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == str(len(b'{"ok": true}'))
        assert (await c.get("/healthz")).json() == {"ok": True}


# ---------------------------------------------------------------- who may change mounts


async def test_tcp_mutations_need_the_token_loopback_included(admin, caplog):
    target, url = admin
    target.ready = True
    caplog.set_level(logging.INFO, logger="memfuse.admin")
    async with httpx.AsyncClient(base_url=url) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
            r = await c.delete("/v1/mounts/default", headers=headers)
            assert_problem(r, 401, "unauthorized")
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert_problem(await c.post("/v1/mounts/shared", headers=headers), 401, "unauthorized")
        assert target.calls == [] and target.mounted == {"default"}  # never reached the target
        # probes and metrics stay open, for the kubelet and Prometheus
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        r = await c.delete("/v1/mounts/default", headers={"Authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200 and target.mounted == set()
    assert TOKEN not in caplog.text and "wrong" not in caplog.text


class ContextTarget(StubTarget):
    """A StubTarget that serves a prompt block holding memory content (``SECRET``)."""

    async def prompt_block(self) -> str:
        return f"## Store `default`\n\n{SECRET}\n"


async def test_tcp_without_a_token_refuses_every_mutation(nursery):
    target = ContextTarget()
    bound = await nursery.start(serve_admin, target, "127.0.0.1:0")
    async with httpx.AsyncClient(base_url=f"http://{bound}") as c:
        body = assert_problem(await c.delete("/v1/mounts/default", headers=AUTH), 403, "admin_token_required")
        assert "admin.sock" in body["detail"] or "Unix socket" in body["detail"]
        assert_problem(await c.post("/v1/mounts/shared"), 403, "admin_token_required")
        for path in ("/v1/context", "/v1/status"):
            r = await c.get(path, headers=AUTH)
            assert_problem(r, 403, "admin_token_required")
            assert SECRET not in r.text and "default" not in r.text
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
    assert target.calls == [] and target.mounted == {"default"}


async def test_tcp_memory_needs_the_token_only_probes_and_metrics_are_open(nursery, tmp_path):
    """On TCP only /healthz, /readyz and /metrics answer without the admin token; the prompt
    block (memory content) and the status document (store names, paths) need it, loopback
    included; the Unix socket serves them without one."""
    target = ContextTarget()
    target.ready = True
    bound = await nursery.start(functools.partial(serve_admin, target, "127.0.0.1:0", token=TOKEN))
    sock = tmp_path / "admin.sock"
    await nursery.start(serve_admin_unix, target, sock)
    async with httpx.AsyncClient(base_url=f"http://{bound}") as c:
        for path in ("/healthz", "/readyz", "/metrics"):
            r = await c.get(path)
            assert r.status_code == 200, (path, r.text)
            assert SECRET not in r.text
        for path in ("/v1/context", "/v1/status"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                for method in ("GET", "HEAD"):
                    r = await c.request(method, path, headers=headers)
                    assert r.status_code == 401, (method, path, headers, r.text)
                    assert SECRET not in r.text and "team" not in r.text
        r = await c.get("/v1/context", headers=AUTH)
        assert r.status_code == 200 and SECRET in r.text
        r = await c.get("/v1/status", headers=AUTH)
        assert r.status_code == 200 and r.json()["workspace"] == "team"
        # an unknown path stays 404 (no hint which paths exist behind the token)
        assert_problem(await c.get("/v1/nothing"), 404, "not_found")
    transport = httpx.AsyncHTTPTransport(uds=str(sock))
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
        r = await c.get("/v1/context")
        assert r.status_code == 200 and SECRET in r.text
        assert (await c.get("/v1/status")).json()["workspace"] == "team"


def test_token_matching_and_token_files(tmp_path):
    assert token_matches(f"Bearer {TOKEN}", TOKEN) and token_matches(f"  bearer   {TOKEN} ", TOKEN)
    for bad in (None, "", "Bearer", f"Bearer {TOKEN[:-1]}", f"Token {TOKEN}", TOKEN, "Bearer \u00e9"):
        assert not token_matches(bad, TOKEN)
    f = tmp_path / "t"
    f.write_text(f"  {TOKEN}\n")
    assert read_admin_token(f) == TOKEN
    f.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_admin_token(f)
    with pytest.raises(ValueError, match="cannot read admin token file"):
        read_admin_token(tmp_path / "missing")


def _uds(path: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path)), base_url="http://sidecar")


async def test_unix_socket_serves_mutations_without_a_token(tmp_path):
    target = StubTarget()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)  # as a Kubernetes emptyDir is
    sock = admin_socket_path(cache)
    async with trio.open_nursery() as nursery:
        shown = await nursery.start(serve_admin_unix, target, sock)
        assert shown == str(sock)
        st = os.stat(sock)
        assert (st.st_mode & 0o777) == 0o600 and st.st_uid == os.getuid()
        assert sorted(p.name for p in cache.iterdir()) == ["admin.sock"]  # no leftover private dir
        async with _uds(sock) as c:
            assert (await c.get("/healthz")).json() == {"ok": True}
            r = await c.delete("/v1/mounts/default")
            assert r.status_code == 200 and target.mounted == set()
            r = await c.post("/v1/mounts/default")
            assert r.status_code == 200 and target.mounted == {"default"}
        nursery.cancel_scope.cancel()
    assert not sock.exists()  # removed on the way out


async def test_unix_socket_replaces_a_stale_one_never_a_file(tmp_path):
    target = StubTarget()
    sock = tmp_path / "admin.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()  # a killed sidecar's leftover
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_admin_unix, target, sock)
        async with _uds(sock) as c:
            assert (await c.get("/healthz")).status_code == 200
        nursery.cancel_scope.cancel()
    sock.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        await serve_admin_unix(target, sock)
    assert sock.read_text() == "not a socket"


async def test_unix_socket_in_a_deep_directory(tmp_path):
    """sun_path holds 107 bytes; the cache directory may be deeper than that."""
    deep = tmp_path.joinpath(*["d" * 40] * 4)
    deep.mkdir(parents=True)
    sock = admin_socket_path(deep)
    assert len(str(sock)) > 108
    target = StubTarget()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_admin_unix, target, sock)
        r = await trio.to_thread.run_sync(functools.partial(
            CliRunner().invoke, cli, ["mounts", "remove", "default", "--cache-dir", str(deep)]))
        assert r.exit_code == 0, r.output
        assert r.stdout == "default: unmounted\n" and target.mounted == set()
        nursery.cancel_scope.cancel()


async def test_mounts_command_over_socket_and_tcp(tmp_path, nursery):
    target = StubTarget()
    lock = trio.Lock()
    sock = tmp_path / "admin.sock"
    await nursery.start(functools.partial(serve_admin_unix, target, sock, lock=lock))
    bound = await nursery.start(functools.partial(serve_admin, target, "127.0.0.1:0", token=TOKEN, lock=lock))
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(cli, ["mounts", *args])

    r = await trio.to_thread.run_sync(invoke, "add", "shared", "--admin-socket", str(sock))
    assert r.exit_code == 0 and r.stdout == "shared: mounted\n" and "shared" in target.mounted
    r = await trio.to_thread.run_sync(invoke, "add", "nope", "--cache-dir", str(tmp_path))
    assert r.exit_code == 1 and r.stderr.startswith("Error: sidecar answered HTTP 404: store 'nope' is not attached")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    r = await trio.to_thread.run_sync(invoke, "remove", "shared", "--admin", f"http://{bound}",
                                      "--admin-token-file", str(token_file))
    assert r.exit_code == 0 and r.stdout == "shared: unmounted\n" and "shared" not in target.mounted
    token_file.write_text("wrong\n")
    r = await trio.to_thread.run_sync(invoke, "remove", "default", "--admin", f"http://{bound}",
                                      "--admin-token-file", str(token_file))
    assert r.exit_code == 1 and "HTTP 401" in r.stderr and "default" in target.mounted
    r = await trio.to_thread.run_sync(invoke, "remove", "default", "--admin", f"http://{bound}")
    assert r.exit_code == 2 and "needs --admin-token-file" in r.stderr
    r = await trio.to_thread.run_sync(invoke, "remove", "default")
    assert r.exit_code == 2 and "--cache-dir" in r.stderr
    r = await trio.to_thread.run_sync(invoke, "remove", "default", "--cache-dir", str(tmp_path / "none"))
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1


async def test_failures_log_one_line_without_content(admin, caplog):
    target, url = admin
    caplog.set_level(logging.INFO, logger="memfuse.admin")
    target.fail_status = True
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as c:
        body = assert_problem(await c.get("/v1/status"), 500, "internal_error")
        assert SECRET not in json.dumps(body)
        assert (await c.get("/healthz")).status_code == 200  # still serving
        assert_problem(await c.post("/v1/mounts/nope"), 404, "store_not_attached")
    failed = [r for r in caplog.records if r.name == "memfuse.admin" and "failed" in r.getMessage()]
    assert [r.getMessage() for r in failed] == [
        "admin request failed: GET /v1/status -> 500 internal_error",
        "admin request failed: POST /v1/mounts/nope -> 404 store_not_attached",
    ]
    assert failed[0].levelno == logging.ERROR
    for r in caplog.records:
        assert SECRET not in r.getMessage() and "\n" not in r.getMessage()


async def test_ipv6_loopback_and_cancellation():
    target = StubTarget()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve_admin, target, "[::1]:0")
        assert bound.startswith("[::1]:") and not bound.endswith(":0")
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"http://{bound}/healthz")).json() == {"ok": True}
        with trio.fail_after(5):  # cancelling stops the server promptly
            nursery.cancel_scope.cancel()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(f"http://{bound}/healthz")


async def test_bind_errors():
    target = StubTarget()
    with trio.fail_after(5):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            await serve_admin(target, "9464")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            with pytest.raises(OSError) as ei:  # bare, not in an exception group
                await serve_admin(target, f"127.0.0.1:{port}")
            assert ei.value.errno == errno.EADDRINUSE


def test_parse_listen():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("localhost:80") == ("localhost", 80)
    for bad in ("", "9464", ":9464", "127.0.0.1:", "127.0.0.1:x", "127.0.0.1:65536", "::1:9464",
                "[::1]", "[nope]:1", "[::1]9464"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


# ---------------------------------------------------------------- memfuse status


STATUS = {
    "workspace": "team",
    "ready": True,
    "uptime_s": 3725.0,
    "stores": [
        {"slug": "default", "access": "read_write", "records": 12},
        {"slug": "shared", "access": "read_only", "records": 3, "cursor": 88},
    ],
    "outbox": {"depth": 2, "oldest_age_s": 1.25, "committed": 40, "refused": 1, "retries": 5,
               "parked": 7},
    "open_handles": 4,
    "refusals_since_start": 6,
    "errors_logged": 9,
    "sync": {"lag_s": 0.5, "feed": "connected"},
    "future_key": "hello",
}


@pytest.fixture
def runner(monkeypatch) -> CliRunner:
    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    return CliRunner()


def fake_mount(tmp_path: Path, data: dict | str) -> Path:
    mp = tmp_path / "mnt"
    (mp / ".memfuse").mkdir(parents=True)
    text = data if isinstance(data, str) else json.dumps(data)
    (mp / ".memfuse" / "status.json").write_text(text)
    return mp


def test_status_human_output(runner, tmp_path):
    mp = fake_mount(tmp_path, STATUS)
    r = runner.invoke(cli, ["status", str(mp)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["workspace:", "team"]
    assert lines[1].split() == ["ready:", "yes"]
    assert lines[2].split() == ["uptime:", "1h", "2m", "5s"]
    assert "stores: 2" in lines
    assert ["SLUG", "ACCESS", "RECORDS", "CURSOR"] == lines[lines.index("stores: 2") + 1].split()
    assert ["default", "read_write", "12", "-"] in [ln.split() for ln in lines]
    assert ["shared", "read_only", "3", "88"] in [ln.split() for ln in lines]
    split = [ln.split() for ln in lines]
    for row in (["depth:", "2"], ["oldest", "age:", "1.2", "s"], ["committed:", "40"],
                ["refused", "by", "control", "plane:", "1"], ["retries:", "5"],
                ["refusals", "since", "start", "(sidecar", "+", "control", "plane):", "6"],
                ["errors.log", "lines:", "9"], ["parked:", "7"], ["open", "handles:", "4"],
                ["lag:", "0.5", "s"], ["feed:", "connected"], ["future", "key:", "hello"]):
        assert row in split, (row, r.stdout)
    assert "{" not in r.stdout


def test_status_json_and_odd_shapes(runner, tmp_path):
    mp = fake_mount(tmp_path, STATUS)
    r = runner.invoke(cli, ["status", str(mp), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout) == STATUS
    # shapes the formatter does not know still print, without a traceback
    odd = {"ready": False, "stores": "n/a", "outbox": 3, "list": [1, "a"], "nested": {"x": {"y": [{"z": 1}]}}}
    text = format_status(odd)
    assert "ready: no" in text and "stores: n/a" in text and "outbox: 3" in text
    assert "list:   1, a" in text and "Z" in text
    assert format_status({}) == ""
    # every value in one column, lists and empty ones too; an empty dict is "-", not a bare
    # "task failures:" (attack26 F8: "journal lost: -" out of line)
    lines = format_status({"errors_logged": 2, "journal_lost": [], "task_failures": {}, "mounts": ["a", "b"]}
                          ).splitlines()
    assert lines == ["errors.log lines: 2", "journal lost:     -", "task failures:    -", "mounts:           a, b"], lines
    # byte counts print as people read them (store list, the console), not raw
    sized = {"stores": [{"slug": "s", "local_bytes": 1536, "max_store_bytes": 67108864}],
             "cache": {"used_bytes": 12, "count": 67108864}}
    text = format_status(sized)
    assert "64 MiB" in text and "1.5 KiB" in text and "12 B" in text and "67108864" in text  # count: no unit
    assert text.count("67108864") == 1
    # a store's ``bytes`` too, and a duration in a store's row as in a field: the unit with
    # the value, not in the header (newuser25: BYTES 222150, LAST REMOTE CHANGE AGE S)
    row = format_status({"stores": [{"slug": "s", "records": 3, "bytes": 222150,
                                      "last_remote_change_age_s": 12.5}]})
    assert "216.9 KiB" in row and "222150" not in row, row
    assert "LAST REMOTE CHANGE AGE" in row and "AGE S" not in row and "12.5 s" in row, row


def test_status_errors(runner, tmp_path, monkeypatch):
    r = runner.invoke(cli, ["status", str(tmp_path / "nothing")])
    assert r.exit_code == 1 and "no memfuse mount at" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output

    mp = fake_mount(tmp_path, "{not json")
    r = runner.invoke(cli, ["status", str(mp)])
    assert r.exit_code == 1 and "not valid JSON" in r.stderr

    def dead(self, *a, **kw):
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    monkeypatch.setattr(Path, "read_text", dead)
    r = runner.invoke(cli, ["status", str(mp)])
    assert r.exit_code == 1 and "not answering" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_status_admin_not_reachable(runner):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = runner.invoke(cli, ["status", "--admin", f"http://127.0.0.1:{port}"])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: sidecar admin API not reachable at http://127.0.0.1:")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


async def test_status_via_admin(admin, runner, tmp_path):
    target, url = admin
    target.ready = True
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN)
    sock = tmp_path / "admin.sock"
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_admin_unix, target, sock)

        def invoke(*args: str, auth: bool = True):
            return runner.invoke(cli, ["status", *args, *(["--admin-token-file", str(token_file)] if auth else [])])

        # the CLI blocks: run it in a thread while this trio loop serves the admin API
        r = await trio.to_thread.run_sync(functools.partial(invoke, "--admin", url, auth=False))
        assert r.exit_code == 1 and "answered HTTP 401" in r.stderr  # the status needs the token on TCP
        r = await trio.to_thread.run_sync(functools.partial(invoke, "--admin-socket", str(sock), auth=False))
        assert r.exit_code == 0 and "workspace: team" in r.stdout, r.output
        nursery.cancel_scope.cancel()
    r = await trio.to_thread.run_sync(invoke, "--admin", url)
    assert r.exit_code == 0, r.output
    assert "workspace: team" in r.stdout and ["default", "read_write", "4"] in [
        ln.split() for ln in r.stdout.splitlines()]
    assert ["depth:", "3"] in [ln.split() for ln in r.stdout.splitlines()]

    bare = url.removeprefix("http://") + "/"
    r = await trio.to_thread.run_sync(invoke, "--admin", bare, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["outbox"]["depth"] == 3

    target.fail_status = True
    r = await trio.to_thread.run_sync(invoke, "--admin", url)
    assert r.exit_code == 1 and "answered HTTP 500" in r.stderr and SECRET not in r.output
