"""The sidecar's token source: ``--token-file`` re-read when it changes, and a 401 treated as
an authentication outage by the client and the outbox (never as a refusal of the write).

In process, over the fake control plane (its static tokens are revoked and handed out at
will). The same behaviour through real mounts and a real ``memfuse serve`` is in
``tests/test_token_lifecycle.py``.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient, Forbidden, TransientError, Unauthorized
from memfuse.fake import FakeControlPlane
from memfuse.models import sha256_hex
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import PUT, Journal
from memfuse.tokenfile import TokenFile, TokenFileError


def kubelet_secret(dir_: Path, token: str, generation: int) -> Path:
    """Write ``token`` the way the kubelet updates a Secret volume: the files go into a new
    timestamped directory, ``..data`` is swapped to it atomically (rename of a new symlink),
    and ``token`` is a symlink to ``..data/token``. Returns the ``token`` path."""
    ts = dir_ / f"..2026_12_01_00_00_{generation:02d}.{os.getpid()}"
    ts.mkdir()
    (ts / "token").write_text(token + "\n")
    tmp = dir_ / "..data_tmp"
    os.symlink(ts.name, tmp)
    os.replace(tmp, dir_ / "..data")
    link = dir_ / "token"
    if not link.is_symlink():
        os.symlink("..data/token", link)
    return link


def test_token_file_follows_a_kubelet_symlink_swap(tmp_path):
    path = kubelet_secret(tmp_path, "tok-1", 1)
    tf = TokenFile(path)
    assert tf.token == "tok-1" and tf.generation == 0
    assert tf.refresh() is False  # unchanged: a stat, no re-read
    kubelet_secret(tmp_path, "tok-2", 2)
    assert tf.refresh() is True and tf.token == "tok-2" and tf.generation == 1
    assert tf.refresh() is False and "tok-2" not in repr(tf)


def test_token_file_rewrites_and_bad_states(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("first\n")
    tf = TokenFile(path)
    path.write_text("second-longer\n")  # in place (size and mtime change)
    assert tf.refresh() and tf.token == "second-longer"
    path.write_text("")  # a writer between truncate and write: the token in use stays
    assert not tf.refresh() and tf.token == "second-longer"
    path.write_text("third\n")
    assert tf.refresh() and tf.token == "third"
    path.unlink()  # missing: the token in use stays, one warning
    assert not tf.refresh() and not tf.refresh() and tf.token == "third"
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 2
    new = tmp_path / "new"
    new.write_text("fourth")
    os.replace(new, path)  # mv over it
    assert tf.refresh() and tf.token == "fourth" and tf.generation == 3
    assert all("fourth" not in r.getMessage() and "third" not in str(r.__dict__)
               for r in caplog.records)
    path.write_text("  \n")
    with pytest.raises(TokenFileError, match="is empty"):
        TokenFile(path)
    with pytest.raises(TokenFileError, match="cannot read"):
        TokenFile(tmp_path / "absent")


@pytest.fixture
async def fake():
    f = FakeControlPlane(seed=0)
    yield f
    await f.aclose()


async def test_client_resends_once_with_a_rotated_token(fake, tmp_path):
    old = await fake.setup("ws", stores=("default",))
    path = tmp_path / "token"
    path.write_text(old)
    seen: list[bool] = []
    async with ApiClient(fake.base_url, TokenFile(path), transport=fake.transport) as api:
        api.auth_listener = seen.append
        assert [a.store.slug for a in await api.list_attachments("ws")] == ["default"]
        # rotation: a new token is written, the old one revoked; the next call gets a 401,
        # re-reads the file and succeeds with one resend, without an authentication outage
        path.write_text(fake.new_token("ws"))
        fake.revoke(old)
        before = fake.counters.forwarded
        rec = await api.create_record("default", "a.md", "x", idempotency_key="k1")
        assert fake.counters.forwarded - before == 2
        assert rec.path == "a.md" and api.auth_failure is None and seen == []
        # revoked with no replacement: 401 → Unauthorized, the outage is recorded
        fake.revoke(api.token_file.token)
        with pytest.raises(Unauthorized):
            await api.get_record("default", rec.id)
        assert api.auth_failure and "401" in api.auth_failure and api.auth_failures == 1
        assert seen == [False]
        path.write_text(fake.new_token("ws"))  # put back: the next call works, outage over
        assert (await api.get_record("default", rec.id)).id == rec.id
        assert api.auth_failure is None and seen == [False, True]


async def test_outbox_keeps_writes_through_an_auth_outage(fake, tmp_path):
    """401 on commit (one by one or in a batch): entries stay queued in order (no refusal, no
    errno), and every one finishes when a valid token is back, none twice; a 403 stays a
    refusal."""
    tok = await fake.setup("ws", stores=("default",))
    ro = await fake.setup("reader", stores=("default",), access="read_only")
    path = tmp_path / "token"
    path.write_text(tok)
    client = ApiClient(fake.base_url, TokenFile(path), transport=fake.transport, instance="t")
    journal = Journal(tmp_path / "outbox.db")
    committer = Committer(client, journal, {}, backoff_max=2.0)
    async with client, trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(committer.run)
        first = committer.submit("default", PUT, "n:1", {"path": "a.md"}, b"v0")
        with trio.fail_after(30):
            await first.done.wait()
        assert first.errno == 0
        fake.revoke(tok)
        contents = [f"v{i}".encode() for i in range(1, 6)]
        entries = [committer.submit("default", PUT, "n:1", {"path": "a.md"}, c) for c in contents]
        entries.append(committer.submit("default", PUT, "n:2", {"path": "b.md"}, b"b"))
        with trio.fail_after(30):
            while committer.auth_waits < 3:
                await trio.sleep(0.05)
        assert not any(e.done.is_set() for e in entries)
        assert committer.refused == 0 and committer.depth() == len(entries)
        assert client.auth_failure is not None
        path.write_text(fake.new_token("ws"))
        committer.poke()  # what the sidecar's token watcher does on a change
        with trio.fail_after(30):
            await committer.wait_idle()
        assert [e.errno for e in entries] == [0] * len(entries)
        assert client.auth_failure is None and committer.refused == 0
        # history: v0, then an in-order subset of v1..v5 ending with v5 (a queued backlog
        # coalesces, docs/SEMANTICS.md), each exactly once
        vs = [v.sha256 for v in await client.versions("default", first.record.id)]
        order = [sha256_hex(c) for c in [b"v0", *contents]]
        assert vs[0] == order[0] and vs[-1] == order[-1], vs
        assert all(h in order for h in vs) and [order.index(h) for h in vs] == sorted(
            {order.index(h) for h in vs}), vs
        # a 403 (read-only attachment) is still a refusal with EROFS
        client.token_file.path.write_text(ro)
        client.token_file.refresh()
        bad = committer.submit("default", PUT, "n:3", {"path": "c.md"}, b"c")
        with trio.fail_after(30):
            await bad.done.wait()
        assert bad.errno == errno.EROFS and committer.refused == 1
        nursery.cancel_scope.cancel()
    journal.close()


async def test_forbidden_is_not_an_auth_outage(fake, tmp_path):
    ro = await fake.setup("reader", stores=("default",), access="read_only")
    async with ApiClient(fake.base_url, ro, transport=fake.transport) as api:
        with pytest.raises(Forbidden):
            await api.create_record("default", "x.md", "x")
        assert api.auth_failure is None and api.auth_failures == 0


async def test_a_token_of_another_workspace_is_checked_before_any_write_is_sent(fake, tmp_path):
    """attack17 F6, in process: a client acting for ``ws`` (``expect_workspace``) given a
    token of ``att`` checks it once and sends nothing with it (the write raises
    ``Unauthorized`` ``wrong_workspace`` unsent: an authentication outage, never the
    ``store_not_attached`` refusal of the write); a token of ``ws`` taken up resumes."""
    await fake.setup("ws", stores=("default",))
    wrong = await fake.setup("att", stores=("other",))
    path = tmp_path / "token"
    path.write_text(wrong)
    seen: list[bool] = []
    async with ApiClient(fake.base_url, TokenFile(path), transport=fake.transport,
                         bounded=True) as api:
        api.expect_workspace("ws")
        api.auth_listener = seen.append
        before = fake.counters.forwarded
        for _ in range(3):
            with pytest.raises(Unauthorized) as exc:
                await api.create_record("default", "a.md", "x", idempotency_key="k1")
            assert exc.value.code == "wrong_workspace"
        assert fake.counters.forwarded - before == 1  # the check alone, once
        reason = "the token is for workspace att, this sidecar is for ws"
        assert api.auth_failure == reason and seen == [False]
        path.write_text(fake.new_token("ws"))
        api.refresh_token()
        rec = await api.create_record("default", "a.md", "x", idempotency_key="k1")
        assert rec.path == "a.md" and api.auth_failure is None and seen == [False, True]


async def test_callers_waiting_for_an_unanswered_token_check_fail_with_it(fake, tmp_path):
    """The control plane down while a token is unchecked: callers that waited for that
    check fail with its ``TransientError`` rather than each trying again in turn (which,
    with a black-holed network, would serialize their timeouts)."""
    token = await fake.setup("ws", stores=("default",))
    async with ApiClient(fake.base_url, token, transport=fake.transport, bounded=True) as api:
        api.expect_workspace("ws")
        fake.faults.outage = True
        failed: list[str] = []

        async def one(i: int) -> None:
            try:
                await api.create_record("default", f"{i}.md", "x", idempotency_key=f"k{i}")
            except TransientError as e:
                failed.append(e.code)

        async with trio.open_nursery() as n:
            for i in range(5):
                n.start_soon(one, i)
        assert len(failed) == 5 and fake.counters.outage_refused == 1
        fake.faults.outage = False
        before = fake.counters.forwarded
        assert (await api.create_record("default", "a.md", "x", idempotency_key="k9")).path == "a.md"
        assert fake.counters.forwarded - before == 2 and api.auth_failure is None
