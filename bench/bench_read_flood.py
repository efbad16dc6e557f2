"""One token's heavy reads against the rest (attack 16 F4): a well-behaved client's
``/healthz`` and ``GET records?limit=5`` (another token) p50 / p99 while 16 keep-alive
connections of one token loop a heavy read, well within its share of the request slots.

    .venv/bin/python bench/bench_read_flood.py [--seconds 10] [--out bench/results-read-flood.json]

One ``memfuse serve`` (SQLite file, default limits) from this tree on loopback; workspace
``evil`` holds 300 records of 20 KB, ``good`` 20. Windows, each ``--seconds`` s of the good
client asking one after the other: no flood (baseline), then floods of
``records?limit=1000&content=true``, ``search?q=x&order=relevance``, and the two with
``/v1/workspaces/evil/context`` mixed over the 16 connections. The flood runs in a process of
its own (``--nice``, default 0; raw sockets, answers read without parsing their bodies); the good client here. Section "Hostile clients,
session 16" of bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
FLOODS = {
    "records?limit=1000&content=true": ["/v1/stores/evil/records?limit=1000&content=true"],
    "search?q=x&order=relevance": ["/v1/stores/evil/search?q=x&order=relevance"],
    "mix of the three": ["/v1/stores/evil/search?q=x&order=relevance",
                         "/v1/stores/evil/records?limit=1000&content=true", "/v1/workspaces/evil/context"],
}


def flood(port: int, token: str, paths: list[str], n: int, seconds: float) -> None:
    """``n`` keep-alive connections asking ``paths`` (round robin over the connections) in a
    loop for ``seconds``; prints the answers by status as JSON."""
    import trio

    answers: dict[str, int] = {}

    async def one(path: str) -> None:
        end = time.monotonic() + seconds
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        while time.monotonic() < end:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.1)
                continue
            try:
                buf = b""
                while time.monotonic() < end:
                    await stream.send_all(request)
                    # the answer read cheaply (the flood's CPU is not the server's): its head,
                    # then its Content-Length or its chunks up to the last one
                    while b"\r\n\r\n" not in buf:
                        data = await stream.receive_some(1 << 20)
                        if not data:
                            raise OSError("closed")
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    status = head.split(b" ", 2)[1].decode()
                    answers[status] = answers.get(status, 0) + 1
                    length = [int(x.split(b":", 1)[1]) for x in head.split(b"\r\n")
                              if x.lower().startswith(b"content-length:")]
                    pieces = [buf]
                    size = len(buf)
                    tail = buf[-5:]
                    while (size < length[0]) if length else not tail.endswith(b"0\r\n\r\n"):
                        data = await stream.receive_some(1 << 20)
                        if not data:
                            raise OSError("closed")
                        pieces.append(data)
                        size += len(data)
                        tail = (tail + data)[-5:]
                    buf = b"".join(pieces)[length[0]:] if length else b""
            except (OSError, trio.BrokenResourceError):
                answers["failed"] = answers.get("failed", 0) + 1
            finally:
                await stream.aclose()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, paths[i % len(paths)])

    trio.run(main)
    print(json.dumps(answers))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=HERE / "results-read-flood.json")
    ap.add_argument("--nice", type=int, default=0, help="the flood's nice (default 0: at 10, on a loaded "
                    "2-CPU machine, it cannot keep 16 reads in flight and measures itself)")
    ap.add_argument("--flood", nargs=4, metavar=("PORT", "TOKEN_FILE", "PATHS", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood:
        port, token_file, paths, seconds = args.flood
        flood(int(port), Path(token_file).read_text().strip(), paths.split(","), 16, float(seconds))
        return
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="memfuse-read-flood-"))
    (tmp / "admin.token").write_text("bench-read-flood-admin")
    env = dict(os.environ, PYTHONPATH=str(TREE), MEMFUSE_HOME=str(tmp / "home"))
    code = "import sys\nfrom memfuse.cli import main\nsys.argv = ['memfuse', *sys.argv[1:]]\nmain()"
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = subprocess.Popen([sys.executable, "-c", code, "serve", "--db", f"sqlite:///{tmp}/cp.db", "--listen",
                              f"127.0.0.1:{port}", "--admin-token-file", str(tmp / "admin.token"), "--migrate"],
                             env=env, stdout=(tmp / "serve.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the server listens (a loaded machine: a start may take seconds)
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise
            time.sleep(0.2)
        tokens = {}
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer bench-read-flood-admin"}, timeout=60) as a:
            for name, n in (("evil", 300), ("good", 20)):
                a.post("/v1/workspaces", json={"name": name, "default_store": False}).raise_for_status()
                a.post("/v1/stores", json={"slug": name}).raise_for_status()
                a.put(f"/v1/workspaces/{name}/attachments/{name}", json={"access": "read_write"}).raise_for_status()
                tokens[name] = a.post("/v1/tokens", json={"workspace": name, "name": name}).json()["token"]
                with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens[name]}"}, timeout=60) as c:
                    for i in range(n):
                        c.post(f"/v1/stores/{name}/records",
                               json={"path": f"d/r{i:04}.md", "content": f"x word{i} " * 2200}).raise_for_status()
        (tmp / "evil.token").write_text(tokens["evil"])

        def window(name: str, paths: list[str] | None) -> dict:
            attacker = None
            if paths:
                attacker = subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, __file__, "--flood", str(port),
                                             str(tmp / "evil.token"), ",".join(paths), str(args.seconds + 4)],
                                            stdout=subprocess.PIPE, text=True)
                time.sleep(2)
            hz: list[float] = []
            rd: list[float] = []
            with httpx.Client(base_url=url, timeout=30) as p, \
                    httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens['good']}"}, timeout=30) as g:
                end = time.monotonic() + args.seconds
                while time.monotonic() < end:
                    t0 = time.monotonic()
                    assert p.get("/healthz").status_code == 200
                    hz.append(time.monotonic() - t0)
                    t0 = time.monotonic()
                    assert g.get("/v1/stores/good/records?limit=5").status_code == 200
                    rd.append(time.monotonic() - t0)
                    time.sleep(0.02)
            flood_answers = json.loads(attacker.communicate(timeout=120)[0].strip().splitlines()[-1]) if attacker else {}
            row = {"flood": name, "healthz_p50_ms": round(statistics.median(hz) * 1e3, 1),
                   "healthz_p99_ms": round(pct(hz, 99) * 1e3, 1),
                   "read_p50_ms": round(statistics.median(rd) * 1e3, 1), "read_p99_ms": round(pct(rd, 99) * 1e3, 1),
                   "asked": len(hz), "flood_answers": flood_answers}
            print(row, flush=True)
            return row

        load = os.getloadavg()[0]
        rows = [window("none", None)] + [window(k, v) for k, v in FLOODS.items()]
        args.out.write_text(json.dumps({"load_before": load, "rows": rows}, indent=1) + "\n")
    finally:
        serve.terminate()
        serve.wait(10)


if __name__ == "__main__":
    main()
