"""Store and workspace names per account on a real mount: a sidecar of a workspace in account
``bravo`` mounts its store ``notes`` while account ``alpha`` has a store ``notes`` of its own
(made first, so bravo's is the one whose internal key is not its name: docs/ARCHITECTURE.md,
"Accounts"). The mount shows bravo's content under ``notes/``, a shell's writes land in
bravo's store only, and a write through the API reaches the mount through the change feed.
Then two sidecars at once, one per account, both of a workspace ``agent`` and both with the
actor name ``pod-1``: each mounts and writes its own account's ``notes``, each follows its
own store's writes by others and skips only its own, and an attachment to one account's
``agent`` reaches only that account's sidecar."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from mountutil import ControlPlane, Rig, Sidecar, read, sh, wait_until

pytestmark = pytest.mark.timeout(180)


def _admin(cp: ControlPlane, account: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {cp.admin_token}"}
    if account:
        headers["X-Memfuse-Account"] = account
    return httpx.Client(base_url=cp.url, headers=headers, timeout=30)


def _content(c: httpx.Client, store: str, path: str) -> str | None:
    recs = c.get(f"/v1/stores/{store}/records", params={"content": "true", "path": path}).json()["records"]
    live = [r for r in recs if r["path"] == path and not r["deleted"]]
    return live[0]["content"] if live else None


def test_a_mount_in_bravo_shows_and_writes_bravos_notes(tmp_path):
    with Rig(tmp_path) as rig:
        cp = rig.cp
        with _admin(cp) as root:
            for acct in ("alpha", "bravo"):
                assert root.post("/v1/accounts", json={"slug": acct}).status_code == 201
        clients = {acct: _admin(cp, acct) for acct in ("alpha", "bravo")}
        try:
            for acct, c in clients.items():
                assert c.post("/v1/workspaces", json={"name": f"{acct}-ws", "default_store": False}).status_code == 201
                s = c.post("/v1/stores", json={"slug": "notes"})
                assert s.status_code == 201 and s.json()["slug"] == "notes", s.text
                assert c.put(f"/v1/workspaces/{acct}-ws/attachments/notes", json={}).status_code == 200
                r = c.post("/v1/stores/notes/records", json={"path": "a.md", "content": f"{acct} says hi\n"})
                assert r.status_code == 201, r.text
            alpha, bravo = clients["alpha"], clients["bravo"]
            tok = bravo.post("/v1/tokens", json={"workspace": "bravo-ws"}).json()["token"]
            token_file = tmp_path / "bravo.token"
            token_file.write_text(tok)
            mnt = rig.sidecar("bravo-ws", token=token_file, expect="notes").mountpoint
            assert sorted(p.name for p in mnt.iterdir() if not p.name.startswith(".")) == ["notes"]
            assert read(mnt / "notes" / "a.md") == "bravo says hi\n"
            # a shell writes through the mount: bravo's notes change, alpha's do not
            sh("printf 'bravo line\\n' >> notes/a.md && sed -i 's/hi/hello/' notes/a.md && "
               "printf 'new\\n' > notes/b.md", cwd=mnt)
            wait_until(lambda: _content(bravo, "notes", "a.md") == "bravo says hello\nbravo line\n"
                       and _content(bravo, "notes", "b.md") == "new\n", 30, "the mount's writes committed")
            assert _content(alpha, "notes", "a.md") == "alpha says hi\n"
            assert _content(alpha, "notes", "b.md") is None
            # writes through the API: bravo's reaches the mount (its change feed), alpha's never
            alpha.post("/v1/stores/notes/records", json={"path": "c.md", "content": "alpha only\n"})
            r = bravo.post("/v1/stores/notes/records", json={"path": "d.md", "content": "from the api\n"})
            assert r.status_code == 201, r.text
            wait_until(lambda: read(mnt / "notes" / "d.md") == "from the api\n", 30, "bravo's API write on the mount")
            assert not (mnt / "notes" / "c.md").exists()
            assert "~" not in sh("ls -a notes; cat notes/*.md", cwd=mnt).stdout
        finally:
            for c in clients.values():
                c.close()


def test_two_sidecars_of_workspace_agent_in_two_accounts(tmp_path):
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sidecars: dict[str, Sidecar] = {}
        with _admin(cp) as root:
            for acct in ("bravo", "alpha"):
                assert root.post("/v1/accounts", json={"slug": acct}).status_code == 201
        clients = {acct: _admin(cp, acct) for acct in ("bravo", "alpha")}
        try:
            for acct, c in clients.items():  # bravo's first: alpha's keys are agent~alpha, notes~alpha
                w = c.post("/v1/workspaces", json={"name": "agent", "default_store": False})
                assert w.status_code == 201 and w.json()["name"] == "agent", w.text
                assert c.post("/v1/stores", json={"slug": "notes"}).status_code == 201
                assert c.put("/v1/workspaces/agent/attachments/notes", json={}).status_code == 200
                r = c.post("/v1/stores/notes/records", json={"path": "a.md", "content": f"{acct} says hi\n"})
                assert r.status_code == 201, r.text
                tok = c.post("/v1/tokens", json={"workspace": "agent"}).json()["token"]
                token_file = tmp_path / f"{acct}.token"
                token_file.write_text(tok)
                sidecars[acct] = rig.sidecar("agent", "--actor", "pod-1", token=token_file, expect="notes",
                                             mountpoint=tmp_path / f"mnt-{acct}",
                                             cache_dir=tmp_path / f"cache-{acct}")
            for acct, sc in sidecars.items():
                assert read(sc.mountpoint / "notes" / "a.md") == f"{acct} says hi\n"
            # a shell writes through each mount: each account's notes change, never the other's
            for acct, sc in sidecars.items():
                sh(f"printf '{acct} line\\n' >> notes/a.md && sed -i 's/hi/hello/' notes/a.md && "
                   f"printf '{acct} new\\n' > notes/{acct}.md", cwd=sc.mountpoint)
            for acct, c in clients.items():
                other = "alpha" if acct == "bravo" else "bravo"
                wait_until(lambda: _content(c, "notes", "a.md") == f"{acct} says hello\n{acct} line\n"
                           and _content(c, "notes", f"{acct}.md") == f"{acct} new\n", 30,
                           f"{acct}'s mount writes committed")
                assert _content(c, "notes", f"{other}.md") is None
                # the actor is the workspace's name and the sidecar's: what the sidecar skips
                rec = c.get("/v1/stores/notes/records", params={"path": f"{acct}.md"}).json()["records"][0]
                assert rec["updated_by"] == "ws:agent/pod-1", rec
            # writes by others reach each mount through its own change feed: the account admin,
            # and the same workspace through the API (actor ws:agent/api: not the sidecar's own)
            for acct, c in clients.items():
                assert c.post("/v1/stores/notes/records",
                              json={"path": "admin.md", "content": f"{acct} admin\n"}).status_code == 201
                tok = (tmp_path / f"{acct}.token").read_text()
                with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {tok}"}, timeout=30) as w:
                    r = w.post("/v1/stores/notes/records", json={"path": "api.md", "content": f"{acct} via api\n"})
                    assert r.status_code == 201 and r.json()["updated_by"] == "ws:agent/api", r.text
            for acct, sc in sidecars.items():
                mnt = sc.mountpoint
                wait_until(lambda: read(mnt / "notes" / "admin.md") == f"{acct} admin\n"
                           and read(mnt / "notes" / "api.md") == f"{acct} via api\n", 30,
                           f"{acct}'s API writes on its mount")
                out = sh("ls -a notes; cat notes/*.md", cwd=mnt).stdout
                other = "alpha" if acct == "bravo" else "bravo"
                assert other not in out and "~" not in out, out
                # the sidecar's own writes were not applied back as remote changes: the file it
                # wrote is as the shell left it, and nothing it wrote is shown twice
                assert read(mnt / "notes" / f"{acct}.md") == f"{acct} new\n"
                assert sorted(p.name for p in (mnt / "notes").iterdir()) == sorted(
                    ["a.md", f"{acct}.md", "admin.md", "api.md"])
                # the feed brought exactly the two writes by others (none of the sidecar's own)
                status = json.loads(read(mnt / ".memfuse" / "status.json"))
                assert status["actor"] == "ws:agent/pod-1"
                admin = status["admin"]
                metrics = httpx.get(f"http://{admin}/metrics", timeout=10).text
                applied = re.search(r'^memfuse_sync_changes_applied_total\{store="notes"\} (\S+)$', metrics, re.M)
                assert applied is not None and float(applied.group(1)) == 2, metrics[:2000]
            # a store attached to alpha's agent (key agent~alpha) reaches alpha's mount through
            # the workspace's events, and never bravo's
            alpha = clients["alpha"]
            assert alpha.post("/v1/stores", json={"slug": "extra"}).status_code == 201
            assert alpha.put("/v1/workspaces/agent/attachments/extra", json={}).status_code == 200
            wait_until(lambda: (sidecars["alpha"].mountpoint / "extra").is_dir(), 30, "alpha's new store mounted")
            assert not (sidecars["bravo"].mountpoint / "extra").exists()
        finally:
            for c in clients.values():
                c.close()
