"""Token rotation, revocation and expiry seen from a real mount (docs/TOKENS.md).

A real ``memfuse serve`` on SQLite and a real ``memfuse mount`` whose ``--token-file`` is a
Kubernetes-style Secret volume (``token -> ..data/token``, ``..data`` swapped atomically by
``kubelet_secret``):

- rotation under load: writers keep closing files while a new token is written and the old
  one revoked; nothing is lost, nothing committed twice, the sidecar is never restarted;
- revocation with no replacement: close returns 0 with the write pending (at once, once
  accepted: an authentication outage, not after ``--commit-wait``), the file stays on the mount, ``/readyz`` is 503 with the reason, the metrics count
  it; a token put back commits everything in order; an expired token behaves the same.

Every process is stopped and every mount unmounted in a ``finally``; every syscall against
the mount runs in a thread with a timeout.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from mountutil import ControlPlane, Rig, Sidecar, live_records
from test_durability import check_store, cp_state, poll, state, timed, write
from test_token_source import kubelet_secret

pytestmark = pytest.mark.mount

WS = "ws"


def admin_url(mnt: Path) -> str:
    st = json.loads(timed((mnt / ".memfuse" / "status.json").read_text))
    return st["admin"] if st["admin"].startswith("http") else "http://" + st["admin"]


def status(mnt: Path) -> dict:
    return json.loads(timed((mnt / ".memfuse" / "status.json").read_text))


def metric(admin: str, name: str) -> float:
    for line in httpx.get(f"{admin}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not exposed")


def token_id(cp: ControlPlane, name: str) -> str:
    return next(t.id for t in cp.call("list_tokens", workspace=WS) if t.name == name)


def start(rig: Rig, token: str) -> tuple[Sidecar, Path]:
    """The rig's sidecar of ``WS`` mounted with ``token`` in a Secret volume; the volume."""
    secret = rig.tmp / "secret"
    secret.mkdir()
    link = kubelet_secret(secret, token, 1)
    sc = rig.sidecar(WS, "--commit-wait", "2", "--token-check-interval", "0.5", token=link)
    return sc, secret


@pytest.mark.timeout(240)
def test_rotation_under_load_loses_nothing(tmp_path):
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace(WS)
        old = cp.call("create_token", workspace=WS, name="old")
        sc, secret = start(rig, old.token)
        pid = sc.proc.pid
        mnt = sc.mountpoint / "default"
        expected: dict[str, list[str]] = {}
        lock = threading.Lock()
        progress = [0] * 4
        rotated = threading.Event()

        def writer(w: int) -> None:
            r, after = 0, 0
            while after < 3:  # until 3 rounds were written after the rotations
                if rotated.is_set():
                    after += 1
                for i in range(4):
                    path = f"w{w}/f{i}.md"
                    data = f"writer {w} file {i} round {r}\n"
                    timed(write, mnt / path, data, r % 2 == 1, timeout=60)
                    with lock:
                        seq = expected.setdefault(path, [])
                        seq.append((seq[-1] if seq else "") + data if r % 2 == 1 else data)
                r += 1
                progress[w] = r

        for w in range(4):
            (mnt / f"w{w}").mkdir()
        threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()
        poll(lambda: min(progress) >= 2, 120, "writers under way", sc.log)
        # 1. the usual order: the kubelet updates the Secret volume, then the old token is
        #    revoked (writes in flight may meet a 401 and are sent again with the new token)
        new = cp.call("create_token", workspace=WS, name="new")
        kubelet_secret(secret, new.token, 2)
        cp.call("revoke_token", token_id(cp, "old"))
        mark = min(progress)
        poll(lambda: min(progress) >= mark + 2, 120, "writers after the first rotation", sc.log)
        # 2. the other order: revoked first, the new token arrives a moment later (writes
        #    in flight meet an authentication outage and wait in the outbox)
        failures = metric(admin_url(sc.mountpoint), "memfuse_auth_failures_total")
        cp.call("revoke_token", token_id(cp, "new"))
        poll(lambda: metric(admin_url(sc.mountpoint), "memfuse_auth_failures_total") > failures,
             60, "a 401 seen by the sidecar", sc.log)
        newer = cp.call("create_token", workspace=WS, name="newer")
        kubelet_secret(secret, newer.token, 3)
        rotated.set()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "writers hung"
        assert sc.proc.poll() is None and sc.proc.pid == pid  # no restart
        files = [mnt / p for p in expected]
        poll(lambda: status(sc.mountpoint)["outbox"]["depth"] == 0
             and all(timed(state, f) == "clean" for f in files), 60, "everything committed", sc.log)
        check_store(cp_state(cp), expected)  # nothing lost, nothing applied twice
        st = status(sc.mountpoint)
        assert st["auth"]["ok"] and st["auth"]["token_reloads"] == 2 and st["ready"]
        assert st["outbox"]["refused"] == 0
        admin = admin_url(sc.mountpoint)
        assert metric(admin, "memfuse_token_reloads_total") == 2.0
        assert httpx.get(f"{admin}/readyz", timeout=10).status_code == 200
        assert "commit refused" not in sc.log.read_text()
        used = {t.name: t for t in cp.call("list_tokens", workspace=WS, include_revoked=True)}
        assert used["old"].state == used["new"].state == "revoked"
        assert used["newer"].state == "active" and used["newer"].last_used_at is not None


@pytest.mark.timeout(240)
def test_revoked_then_expired_token_keeps_writes_pending_until_a_token_is_back(tmp_path):
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace(WS)
        first = cp.call("create_token", workspace=WS, name="first")
        sc, secret = start(rig, first.token)
        mnt = sc.mountpoint / "default"
        admin = admin_url(sc.mountpoint)
        timed(write, mnt / "x.md", "before\n", False)
        timed(write, mnt / "gone.md", "to be removed\n", False)
        assert timed(state, mnt / "x.md") == "clean"

        # --- revoked, no replacement
        cp.call("revoke_token", first.id)
        timed(write, mnt / "y.md", "after\n", False)  # close returns 0, the write pending
        assert timed(state, mnt / "y.md") == "pending"
        timed(write, mnt / "x.md", "more\n", True)
        timed(os.rename, mnt / "x.md", mnt / "x2.md")
        timed(os.unlink, mnt / "gone.md")
        r = httpx.get(f"{admin}/readyz", timeout=10)
        assert r.status_code == 503, r.text
        assert "authentication outage" in r.json()["detail"] and "revoked" in r.json()["detail"]
        assert metric(admin, "memfuse_auth_ok") == 0.0
        assert metric(admin, "memfuse_auth_failures_total") >= 1
        # the outbox keeps retrying; nothing is refused and the files stay as written
        poll(lambda: status(sc.mountpoint)["auth"]["commits_deferred"] >= 3, 60,
             "commits deferred", sc.log)
        st = status(sc.mountpoint)
        assert not st["auth"]["ok"] and "revoked" in st["auth"]["error"] and not st["ready"]
        assert st["outbox"]["refused"] == 0 and st["outbox"]["depth"] >= 4
        assert timed((mnt / "y.md").read_text) == "after\n"
        assert timed((mnt / "x2.md").read_text) == "before\nmore\n"
        assert not (mnt / "gone.md").exists()
        assert set(live_records(cp)) == {"x.md", "gone.md"}  # nothing of it reached the server

        # --- a token is back: everything commits, in order
        second = cp.call("create_token", workspace=WS, name="second")
        kubelet_secret(secret, second.token, 2)
        poll(lambda: status(sc.mountpoint)["outbox"]["depth"] == 0, 60, "outbox drained", sc.log)
        assert timed(state, mnt / "y.md") == "clean"
        recs = live_records(cp)
        assert set(recs) == {"x2.md", "y.md"}
        assert recs["x2.md"].content == "before\nmore\n" and recs["y.md"].content == "after\n"
        poll(lambda: httpx.get(f"{admin}/readyz", timeout=10).status_code == 200, 30, "ready",
             sc.log)
        assert metric(admin, "memfuse_auth_ok") == 1.0

        # --- the token in the volume has expired: the same outage. The token is expired
        #     before the sidecar is given it (the control plane refuses it), so no drain on a
        #     busy machine can outlast a short lifetime (a 6 s token, used to drain first,
        #     had 4.2 s left at load 11).
        reloads = status(sc.mountpoint)["auth"]["token_reloads"]
        expiring = cp.call("create_token", workspace=WS, name="expiring", ttl_seconds=1)
        poll(lambda: httpx.get(f"{cp.url}/v1/stores/default/records", params={"limit": 1}, timeout=10,
                               headers={"Authorization": f"Bearer {expiring.token}"}).status_code == 401,
             30, "the 1 s token refused as expired", sc.log)
        kubelet_secret(secret, expiring.token, 3)
        poll(lambda: status(sc.mountpoint)["auth"]["token_reloads"] > reloads, 60,
             "the expired token taken up", sc.log)
        timed(write, mnt / "z.md", "expired\n", False)
        assert timed(state, mnt / "z.md") == "pending"
        r = httpx.get(f"{admin}/readyz", timeout=10)
        assert r.status_code == 503 and "expired" in r.json()["detail"], r.text
        third = cp.call("create_token", workspace=WS, name="third")
        kubelet_secret(secret, third.token, 4)
        poll(lambda: "z.md" in live_records(cp), 60, "z.md committed", sc.log)
        poll(lambda: httpx.get(f"{admin}/readyz", timeout=10).status_code == 200, 30, "ready",
             sc.log)
        # each change exactly once, in the order made
        got = {r["path"]: r for r in cp_state(cp)}
        assert set(got) == {"x2.md", "gone.md", "y.md", "z.md"}
        assert [(v["operation"], v["path"]) for v in got["x2.md"]["versions"]] == [
            ("created", "x.md"), ("modified", "x.md"), ("moved", "x2.md")]
        assert got["gone.md"]["deleted"]
        assert [v["operation"] for v in got["gone.md"]["versions"]] == ["created", "deleted"]
        assert [v["operation"] for v in got["y.md"]["versions"]] == ["created"]
        assert got["z.md"]["content"] == "expired\n" and len(got["z.md"]["versions"]) == 1
        assert status(sc.mountpoint)["outbox"]["refused"] == 0


@pytest.mark.timeout(240)
def test_closes_return_once_accepted_while_the_token_is_refused_and_wait_again_after_rotation(tmp_path):
    """An expired or revoked token with no replacement in the token file: each close returns
    once its write is accepted (pending), not after ``--commit-wait`` (attack 15: 20 files,
    200 s); a rotated token commits everything at once and closes wait for commits again."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace(WS)
        first = cp.call("create_token", workspace=WS, name="first")
        secret = rig.tmp / "secret"
        secret.mkdir()
        link = kubelet_secret(secret, first.token, 1)
        # --commit-wait 60: a close that waited it out would be far past the bound below
        sc = rig.sidecar(WS, "--commit-wait", "60", "--token-check-interval", "0.5", token=link)
        mnt = sc.mountpoint / "default"
        timed(write, mnt / "a.md", "before\n", False)
        assert timed(state, mnt / "a.md") == "clean"

        cp.call("revoke_token", first.id)
        t0 = time.monotonic()
        for i in range(4):
            timed(write, mnt / f"n{i}.md", f"note {i}\n", False, timeout=90)
        took = time.monotonic() - t0
        # on main each close waits out --commit-wait: 4 x 60 s; here once accepted (0.3 s
        # quiet, a few s at load 11)
        assert took < 30, f"4 closes took {took:.1f} s with the token refused"
        assert all(timed(state, mnt / f"n{i}.md") == "pending" for i in range(4))
        st = status(sc.mountpoint)
        assert not st["auth"]["ok"] and "revoked" in st["auth"]["error"]
        assert not st["auth"]["closes_wait"] and st["control_plane"]["reachable"]
        assert st["outbox"]["refused"] == 0 and st["outbox"]["depth"] >= 4
        assert set(live_records(cp)) == {"a.md"}

        # a rotated token: everything commits at once, and closes wait for commits again
        second = cp.call("create_token", workspace=WS, name="second")
        kubelet_secret(secret, second.token, 2)
        poll(lambda: status(sc.mountpoint)["outbox"]["depth"] == 0, 30, "outbox drained", sc.log)
        assert status(sc.mountpoint)["auth"]["closes_wait"]
        timed(write, mnt / "b.md", "after\n", False)
        assert timed(state, mnt / "b.md") == "clean"  # the close waited for its commit
        recs = live_records(cp)
        assert set(recs) == {"a.md", "b.md"} | {f"n{i}.md" for i in range(4)}
        assert all(recs[f"n{i}.md"].content == f"note {i}\n" for i in range(4))
        assert status(sc.mountpoint)["outbox"]["refused"] == 0


@pytest.mark.timeout(240)
def test_a_token_of_another_workspace_is_an_outage_not_a_refusal(tmp_path):
    """attack17 F6: the token file of ``ws``'s sidecar gets a valid token of workspace
    ``att`` (a rotation mistake) while writes wait for an expired token: status
    ``auth.ok: false`` naming both workspaces, ``/readyz`` 503, the writes kept pending (on
    main they were refused for good, ``store_not_attached``) and none sent with that token;
    the right token back commits them all."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace(WS)
        rig.workspace("att", ("other",))
        first = cp.call("create_token", workspace=WS, name="first")
        sc, secret = start(rig, first.token)
        mnt = sc.mountpoint / "default"
        admin = admin_url(sc.mountpoint)
        timed(write, mnt / "a.md", "before\n", False)
        assert timed(state, mnt / "a.md") == "clean"

        cp.call("revoke_token", first.id)  # the outage of attack17's repro (expired)
        timed(write, mnt / "q0.md", "queued 0\n", False)
        assert timed(state, mnt / "q0.md") == "pending"

        wrong = cp.call("create_token", workspace="att", name="wrong")
        kubelet_secret(secret, wrong.token, 2)
        poll(lambda: status(sc.mountpoint)["auth"]["token_reloads"] >= 1, 30, "token reload",
             sc.log)
        for i in (1, 2):
            timed(write, mnt / f"q{i}.md", f"queued {i}\n", False, timeout=60)
        reason = "the token is for workspace att, this sidecar is for ws"
        poll(lambda: status(sc.mountpoint)["auth"]["error"] == reason, 30, "wrong workspace named",
             sc.log)
        time.sleep(2)  # the outbox retries meanwhile: with the wrong token, nothing goes
        st = status(sc.mountpoint)
        assert not st["auth"]["ok"] and not st["ready"], st["auth"]
        assert st["outbox"]["refused"] == 0 and st["outbox"]["depth"] == 3, st["outbox"]
        assert all(timed(state, mnt / f"q{i}.md") == "pending" for i in range(3))
        r = httpx.get(f"{admin}/readyz", timeout=10)
        assert r.status_code == 503 and reason in r.json()["detail"], r.text
        assert metric(admin, "memfuse_auth_ok") == 0.0
        errors = sc.mountpoint / ".memfuse" / "errors.log"
        assert "store_not_attached" not in (timed(errors.read_text) if errors.exists() else "")
        assert sc.log.read_text().count("the token is for another workspace") == 1  # logged once
        assert set(live_records(cp)) == {"a.md"}

        right = cp.call("create_token", workspace=WS, name="right")
        kubelet_secret(secret, right.token, 3)
        poll(lambda: status(sc.mountpoint)["outbox"]["depth"] == 0, 60, "outbox drained", sc.log)
        recs = live_records(cp)
        assert set(recs) == {"a.md", "q0.md", "q1.md", "q2.md"}
        assert all(recs[f"q{i}.md"].content == f"queued {i}\n" for i in range(3))
        assert all(timed(state, mnt / f"q{i}.md") == "clean" for i in range(3))
        st = status(sc.mountpoint)
        assert st["auth"]["ok"] and st["outbox"]["refused"] == 0
        poll(lambda: httpx.get(f"{admin}/readyz", timeout=10).status_code == 200, 30, "ready",
             sc.log)
