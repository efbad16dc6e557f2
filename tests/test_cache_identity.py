"""The default ``--cache-dir`` is keyed by the workspace's account (attack 17 F7;
docs/CLI.md, ``memfuse.cli.mountcache``): accounts alpha and bravo each have a workspace
``agent`` with a store ``notes``; their sidecars run on one host with one ``MEMFUSE_HOME`` and
no ``--cache-dir``. Alpha queues two writes while the control plane is down and is killed;
bravo starts: it gets a cache of its own, its ``errors.log`` never names alpha's paths, and
alpha, started again, commits its queued writes. On main both took ``agent-<hash>``: bravo
dropped alpha's writes and named them in its ``errors.log`` as writes of a deleted store."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from mountcheck import errors_log
from mountutil import MEMFUSE, Rig, Sidecar, is_mounted, read, wait_for, wait_until

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]


class DefaultCacheSidecar(Sidecar):
    """A ``memfuse mount`` without ``--cache-dir``, its ``MEMFUSE_HOME`` ``home``."""

    def __init__(self, *args, home: Path, **kw) -> None:
        super().__init__(*args, **kw)
        self.home = home

    def launch(self) -> "DefaultCacheSidecar":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [MEMFUSE, "mount", str(self.mountpoint), "--control-plane", self.cp.url,
             "--workspace", self.ws, "--token-file", str(self.token_file),
             "--commit-wait", "0", "--admin-listen", "127.0.0.1:0", "--offline-after", "3",
             *self.extra],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, MEMFUSE_HOME=str(self.home)))
        return self


def _content(c: httpx.Client, path: str) -> str | None:
    recs = c.get("/v1/stores/notes/records", params={"content": "true", "path": path}).json()["records"]
    live = [r for r in recs if r["path"] == path and not r["deleted"]]
    return live[0]["content"] if live else None


def test_two_accounts_workspaces_of_one_name_never_share_the_default_cache(tmp_path):
    home = tmp_path / "home"
    with Rig(tmp_path) as rig:
        cp = rig.cp
        root = {"Authorization": f"Bearer {cp.admin_token}"}
        clients, sidecars = {}, {}
        for acct in ("alpha", "bravo"):
            assert httpx.post(f"{cp.url}/v1/accounts", json={"slug": acct}, headers=root).status_code == 201
            c = clients[acct] = httpx.Client(base_url=cp.url, timeout=30,
                                             headers={**root, "X-Memfuse-Account": acct})
            assert c.post("/v1/workspaces", json={"name": "agent", "default_store": False}).status_code == 201
            assert c.post("/v1/stores", json={"slug": "notes"}).status_code == 201
            assert c.put("/v1/workspaces/agent/attachments/notes", json={}).status_code == 200
            tok = tmp_path / f"{acct}.token"
            tok.write_text(c.post("/v1/tokens", json={"workspace": "agent"}).json()["token"])
            sc = sidecars[acct] = DefaultCacheSidecar(
                cp, "agent", tok, tmp_path / f"mnt-{acct}", tmp_path / f"logs-{acct}" / "cache",
                home=home, expect="notes")
            sc.cache_dir.parent.mkdir()
            rig.sidecars.append(sc)
            rig.logs.append(sc.log)
            rig._stack.callback(sc.stop)
        try:
            alpha, bravo = sidecars["alpha"], sidecars["bravo"]
            alpha.start()
            (alpha.mountpoint / "notes" / "a-first.md").write_text("alpha first\n")
            wait_until(lambda: _content(clients["alpha"], "a-first.md") == "alpha first\n", 30,
                       "alpha's first write committed")
            cp.stop()  # alpha's next writes queue in its outbox
            for nm in ("a-queued1.md", "a-queued2.md"):
                (alpha.mountpoint / "notes" / nm).write_text(f"alpha {nm}\n")
            alpha.kill9()
            cp.start()
            bravo.start()
            (bravo.mountpoint / "notes" / "b.md").write_text("bravo\n")
            wait_until(lambda: _content(clients["bravo"], "b.md") == "bravo\n", 30,
                       "bravo's write committed")
            named = [e for e in errors_log(bravo.mountpoint) if "a-" in e.get("path", "")]
            assert not named, named
            assert sorted(p.name for p in (bravo.mountpoint / "notes").iterdir()) == ["b.md"]
            alpha.start()
            for nm in ("a-queued1.md", "a-queued2.md"):
                wait_until(lambda: _content(clients["alpha"], nm) == f"alpha {nm}\n", 30,
                           f"alpha's queued {nm} committed")
            assert read(alpha.mountpoint / "notes" / "a-queued2.md") == "alpha a-queued2.md\n"
            assert _content(clients["bravo"], "a-queued1.md") is None
            assert not [e for e in errors_log(alpha.mountpoint) if e.get("path", "").startswith("a-")]
            caches = sorted(p.name.rsplit("-", 1)[0] for p in (home / "cache").iterdir())
            assert caches == ["agent~alpha", "agent~bravo"], caches
        finally:
            for c in clients.values():
                c.close()


def _accounts_with_agent(cp, tmp_path: Path) -> dict[str, tuple[httpx.Client, Path]]:
    """Accounts alpha and bravo, each with workspace ``agent`` and store ``notes``: per
    account, (its admin client, a token file of its ``agent``)."""
    root = {"Authorization": f"Bearer {cp.admin_token}"}
    out = {}
    for acct in ("alpha", "bravo"):
        assert httpx.post(f"{cp.url}/v1/accounts", json={"slug": acct}, headers=root).status_code == 201
        c = httpx.Client(base_url=cp.url, timeout=30, headers={**root, "X-Memfuse-Account": acct})
        assert c.post("/v1/workspaces", json={"name": "agent", "default_store": False}).status_code == 201
        assert c.post("/v1/stores", json={"slug": "notes"}).status_code == 201
        assert c.put("/v1/workspaces/agent/attachments/notes", json={}).status_code == 200
        tok = tmp_path / f"{acct}.token"
        tok.write_text(c.post("/v1/tokens", json={"workspace": "agent"}).json()["token"])
        out[acct] = (c, tok)
    return out


def test_an_older_releases_cache_is_taken_over_only_by_the_account_whose_stores_it_holds(
        tmp_path, monkeypatch):
    """``agent-<hash>`` left by an older release (which keyed the cache by the name only)
    recording bravo's ``notes`` (by its creation time): alpha's sidecar does not take it
    (alpha's ``notes`` was made at another time) and gets ``agent~alpha-<hash>``; bravo's
    renames it to ``agent~bravo-<hash>``, its queued writes with it. The answer of the
    attachments carries the account (``Memfuse-Account``)."""
    from memfuse.cli.mountcache import cache_dir_for, choose_cache_dir
    from memfuse.tokenfile import TokenFile

    monkeypatch.setenv("MEMFUSE_HOME", str(tmp_path / "home"))
    with Rig(tmp_path) as rig:
        cp = rig.cp
        accts = _accounts_with_agent(cp, tmp_path)
        try:
            tok = accts["bravo"][1].read_text()
            r = httpx.get(f"{cp.url}/v1/workspaces/agent/attachments",
                          headers={"Authorization": f"Bearer {tok}"})
            assert r.headers["Memfuse-Account"] == "bravo", r.headers
            created = r.json()[0]["store"]["created_at"]
            from datetime import datetime
            created = datetime.fromisoformat(created.replace("Z", "+00:00")).isoformat()
            old = cache_dir_for(cp.url, "agent")
            old.mkdir(parents=True)
            (old / "dirs.json").write_text(f'{{"_created": {{"notes": "{created}"}}}}')
            (old / "outbox.db").write_text("bravo's queued writes")
            said: list[str] = []
            got = choose_cache_dir(cp.url, TokenFile(accts["alpha"][1]), "agent", 10, said.append)
            assert got == cache_dir_for(cp.url, "agent", "alpha") and not said and old.is_dir()
            got = choose_cache_dir(cp.url, TokenFile(accts["bravo"][1]), "agent", 10, said.append)
            assert got == cache_dir_for(cp.url, "agent", "bravo") and len(said) == 1, said
            assert not old.exists() and (got / "outbox.db").read_text() == "bravo's queued writes"
        finally:
            for c, _ in accts.values():
                c.close()


def test_offline_only_a_cache_known_to_be_the_tokens_is_used(tmp_path, monkeypatch):
    """The control plane does not answer, so the token's account is not known (attack 19
    F3): a cache directory is used only when this token chose it (its mark,
    ``owner.json``), or it is the ``<workspace>-<hash>`` of an older release that marked
    none. Another account's ``agent~bravo`` is never used by another token: refused, naming
    it and ``--cache-dir``; none at all: refused past ``--start-timeout`` (as the sidecar
    would be). On main the one cache of the workspace was used, of whatever account."""
    from mountutil import refused_port

    from memfuse.cli import mountcache
    from memfuse.cli.mountcache import cache_dir_for, choose_cache_dir

    monkeypatch.setenv("MEMFUSE_HOME", str(tmp_path / "home"))
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(ValueError, match="did not answer within --start-timeout"):
            choose_cache_dir(url, "tok-default", "agent", 1.5, print)
        bravo = cache_dir_for(url, "agent", "bravo")
        bravo.mkdir(parents=True)
        mountcache._write_mark(bravo, "bravo", mountcache._mark("tok-bravo"))
        with pytest.raises(ValueError, match="--cache-dir") as ei:
            choose_cache_dir(url, "tok-default", "agent", 0.5, print)
        assert "agent~bravo" in str(ei.value) and "not known to be its own" in str(ei.value)
        assert choose_cache_dir(url, "tok-bravo", "agent", 0.5, print) == bravo
        legacy = cache_dir_for(url, "agent")
        legacy.mkdir()  # an older release's, marked by no token
        assert choose_cache_dir(url, "tok-default", "agent", 0.5, print) == legacy
        assert choose_cache_dir(url, "tok-bravo", "agent", 0.5, print) == bravo
        mountcache._write_mark(legacy, "default", mountcache._mark("tok-default"))
        with pytest.raises(ValueError, match="not known to be its own"):
            choose_cache_dir(url, "tok-acme", "agent", 0.5, print)


def test_a_refused_token_never_takes_another_accounts_cache(tmp_path, monkeypatch):
    """With the control plane up, a token it refuses (junk, or revoked: 401) says nothing of
    its account (attack 19 F3): bravo's ``agent~bravo`` (chosen and marked by bravo's token
    when it answered) is not taken by it (on main it was, and showed bravo's files and
    unsent writes); bravo's own token still gets it, and bravo's token once revoked too (it
    chose it: the sidecar then says why it is refused)."""
    from memfuse.cli.mountcache import OWNER_FILE, cache_dir_for, choose_cache_dir
    from memfuse.tokenfile import TokenFile

    monkeypatch.setenv("MEMFUSE_HOME", str(tmp_path / "home"))
    with Rig(tmp_path) as rig:
        cp = rig.cp
        accts = _accounts_with_agent(cp, tmp_path)
        try:
            bravo_tok = TokenFile(accts["bravo"][1])
            got = choose_cache_dir(cp.url, bravo_tok, "agent", 10, print)
            assert got == cache_dir_for(cp.url, "agent", "bravo")
            owner = (got / OWNER_FILE).read_text()
            assert bravo_tok.token not in owner and '"account": "bravo"' in owner
            (got / "outbox.db").write_text("bravo's queued writes")
            junk = tmp_path / "junk.token"
            junk.write_text("mf_thisisnotatoken0000000000000000000000")
            with pytest.raises(ValueError, match="refused") as ei:
                choose_cache_dir(cp.url, TokenFile(junk), "agent", 10, print)
            assert str(got) in str(ei.value) and "--cache-dir" in str(ei.value)
            c = accts["bravo"][0]
            tokens = c.get("/v1/tokens").json()
            tokens = tokens.get("tokens", tokens) if isinstance(tokens, dict) else tokens
            for t in tokens:
                assert c.delete(f"/v1/tokens/{t['id']}").status_code in (200, 204)
            assert choose_cache_dir(cp.url, bravo_tok, "agent", 10, print) == got
            assert (got / "outbox.db").read_text() == "bravo's queued writes"
        finally:
            for c, _ in accts.values():
                c.close()
