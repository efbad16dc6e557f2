"""Store names per account on a real mount: a sidecar of a workspace in account ``bravo``
mounts its store ``notes`` while account ``alpha`` has a store ``notes`` of its own (made
first, so bravo's is the one whose internal key is not its name: docs/ARCHITECTURE.md,
"Accounts"). The mount shows bravo's content under ``notes/``, a shell's writes land in
bravo's store only, and a write through the API reaches the mount through the change feed."""
from __future__ import annotations

import httpx
import pytest

from mountutil import ControlPlane, Sidecar, read, sh, wait_until

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
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
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
            sc = Sidecar(cp, "bravo-ws", token_file, tmp_path / "mnt", tmp_path / "cache").start(expect="notes")
            mnt = sc.mountpoint
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
    finally:
        try:
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()
