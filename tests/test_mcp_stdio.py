"""``memfuse mcp`` on stdio as a real subprocess: the end of input is the client's shutdown.

The MCP specification (2025-06-18, Lifecycle, "Shutdown", stdio) has a client close the
server's stdin and then wait for it to exit. Requests the server read before EOF are finished
and answered (they used to be cancelled and answered "Connection closed", though a write could
already have reached the store); the wait is bounded (``--drain-timeout``) and the exit code
is 0 either way.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mountutil import MEMFUSE, ControlPlane

INIT = [{"jsonrpc": "2.0", "id": 0, "method": "initialize",
         "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "pipe", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"}]


def _call(i: int, name: str, **args) -> dict:
    return {"jsonrpc": "2.0", "id": i, "method": "tools/call",
            "params": {"name": name, "arguments": args}}


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture
def cp(tmp_path):
    c = ControlPlane(tmp_path).start()
    try:
        yield c
    finally:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGCONT)  # stopped by a test: let it stop
        c.stop()


def test_requests_written_before_eof_are_all_answered(cp, tmp_path):
    """``cat requests | memfuse mcp``: every request gets its real answer, then exit 0."""
    tok = cp.setup_workspace("ws", ("default",))
    calls = [_call(i, "memory_create", path=f"/memories/default/n{i}.md", file_text=f"note {i}\n")
             for i in range(1, 11)]
    calls += [_call(11, "memory_view", path="/memories/default"),
              _call(12, "memory_search", query="note"),
              {"jsonrpc": "2.0", "id": 13, "method": "tools/list"}]
    reqs = tmp_path / "requests.jsonl"
    reqs.write_text("".join(json.dumps(m) + "\n" for m in INIT + calls))
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", "-c", f'cat "$1" | "$2" mcp --control-plane "$3" --workspace ws '
                       f'--token-file "$4"', "-", str(reqs), MEMFUSE, cp.url, str(tok)],
        capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    got = _lines(p.stdout)
    by_id = {m["id"]: m for m in got}
    assert sorted(m["id"] for m in got) == list(range(14)), p.stdout  # each once
    errors = {i: m["error"] for i, m in by_id.items() if "error" in m}
    assert not errors, errors  # before: {1: 'Connection closed', ...}
    for i in range(1, 11):
        r = by_id[i]["result"]
        assert r["isError"] is False
        assert r["content"][0]["text"] == f"File created successfully at: /memories/default/n{i}.md"
    # the server runs requests concurrently: view and search see some of the creates
    assert by_id[11]["result"]["isError"] is False
    assert "/memories/default" in by_id[11]["result"]["content"][0]["text"]
    assert by_id[12]["result"]["isError"] is False
    assert by_id[13]["result"]["tools"]
    records = cp.call("list_records", "default").records
    assert sorted(r.path for r in records) == sorted(f"n{i}.md" for i in range(1, 11))
    assert took < 60


def _read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """One JSON line from ``proc``'s stdout within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"no line from memfuse mcp within {timeout} s (got {buf!r})"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1)
            assert chunk, "memfuse mcp closed stdout"
            buf += chunk
    return json.loads(buf)


def test_drain_at_eof_is_bounded(cp, tmp_path):
    """A request that cannot finish (the control plane frozen with SIGSTOP) holds the exit
    back only for ``--drain-timeout``: it is answered "Connection closed", exit code 0."""
    tok = cp.setup_workspace("ws", ("default",))
    err = (tmp_path / "mcp.err").open("wb")
    proc = subprocess.Popen(
        [MEMFUSE, "mcp", "--control-plane", cp.url, "--workspace", "ws", "--token-file", str(tok),
         "--drain-timeout", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    try:
        proc.stdin.write(json.dumps(INIT[0]).encode() + b"\n")
        proc.stdin.flush()
        assert _read_line(proc, 60)["id"] == 0
        cp.proc.send_signal(signal.SIGSTOP)
        proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in (
            INIT[1], _call(1, "memory_view", path="/memories/default"))))
        proc.stdin.close()
        t0 = time.monotonic()
        answer = _read_line(proc, 30)
        code = proc.wait(30)
        took = time.monotonic() - t0
    finally:
        cp.proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
    assert answer == {"jsonrpc": "2.0", "id": 1,
                      "error": {"code": -32000, "message": "Connection closed"}}
    assert code == 0
    assert 1.5 < took < 15, took
    log = (tmp_path / "mcp.err").read_text()
    assert "still running after 2 s" in log, log
