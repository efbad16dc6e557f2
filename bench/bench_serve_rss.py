"""``memfuse serve``'s resident memory after big batches, idle (attack18 F10: 140 MB → 1.04 GB
idle after big bodies, never given back). One server (SQLite file, loopback, ``--migrate``);
two rounds of three parallel batches of 30 records of ~1 MB each; VmRSS (MiB) at start and 3 s
after each round. Section "serve's memory after big bodies" of bench/README.md.

    .venv/bin/python bench/bench_serve_rss.py TREE PORT

``TREE``: the source tree to run (``PYTHONPATH``), e.g. ``.`` or a ``git archive`` of main.
"""
import json, os, re, subprocess, sys, time, tempfile, threading, httpx, random
tree, port = sys.argv[1], int(sys.argv[2])
d = tempfile.mkdtemp(prefix="rss-")
env = dict(os.environ, PYTHONPATH=tree, MEMFUSE_HOME=d)
tokf = os.path.join(d, "admin.token"); open(tokf, "w").write("rss-admin-token-0123456789abcdef\n")
p = subprocess.Popen([sys.executable, "-c", "import sys; from memfuse.cli import main; sys.argv=[\"memfuse\"]+sys.argv[1:]; main()", "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{d}/cp.db", "--admin-token-file", tokf, "--migrate"],
                     env=env, stdout=subprocess.DEVNULL, stderr=open(f"{d}/serve.log", "w"))
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{p.pid}/status").read()).group(1)) // 1024
try:
    base = f"http://127.0.0.1:{port}"
    h = {"Authorization": "Bearer rss-admin-token-0123456789abcdef"}
    for _ in range(100):
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200: break
        except Exception: pass
        time.sleep(0.2)
    c = httpx.Client(base_url=base, headers=h, timeout=120)
    assert c.post("/v1/workspaces", json={"name": "w", "default_store": False}).status_code == 201
    r = c.post("/v1/stores", json={"slug": "s", "max_store_bytes": 2 << 30}); assert r.status_code == 201, r.text
    assert c.put("/v1/workspaces/w/attachments/s", json={"access": "read_write"}).status_code == 200
    t = c.post("/v1/tokens", json={"workspace": "w", "name": "t"}).json()["token"]
    wc = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {t}"}, timeout=300)
    print("start", rss())
    rnd = random.Random(1)
    def batch(b):
        ops = [{"op": "create", "body": {"path": f"b{b}/{i}.md", "content": ("".join(rnd.choice("abcdefgh ") for _ in range(1000)) + "\n") * 1000}} for i in range(30)]
        r = wc.post("/v1/stores/s/batch", json={"operations": ops}); print("batch", r.status_code, flush=True)
    for rnd_ in range(2):
        ths = [threading.Thread(target=batch, args=(rnd_ * 10 + i,)) for i in range(3)]
        [x.start() for x in ths]; [x.join() for x in ths]
        time.sleep(3); print("after round", rnd_, rss(), flush=True)
finally:
    p.terminate(); p.wait(10)
