"""memfuse.transfer without click: walking a directory to import, importing into the
in-process fake control plane (memfuse.fake) with its refusals, dry run, a path created
meanwhile and lost responses, and exporting records to a directory (the ``memfuse import`` /
``export`` commands on top are covered by tests/test_import_export.py)."""
from __future__ import annotations

import os
import random
import string
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.wire import Record, RecordPage, sha256_hex
from memfuse.transfer import (
    ExportReport,
    ImportReport,
    export_records,
    import_files,
    import_walk,
    new_key,
    one_line,
    shown,
)


def fake_token() -> str:
    rnd = random.Random(7)
    return "gh" + "p_" + "".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(36))


def write_tree(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


@pytest.fixture
async def fake():
    fcp = FakeControlPlane(seed=3)
    try:
        yield fcp
    finally:
        await fcp.aclose()


@pytest.fixture
async def api(fake):
    token = await fake.setup("ws", stores=("default", "copy"))
    async with ApiClient(fake.base_url, token, transport=fake.transport, instance="transfer") as c:
        yield c


async def live(api: ApiClient, store: str = "default") -> dict[str, Record]:
    records, _ = await api.snapshot(store, content=True)
    return {r.path: r for r in records}


# ---------------------------------------------------------------- helpers


def test_helpers():
    assert one_line("a\n  b\tc \n") == "a b c"
    assert shown("caf\udce9.md") == "caf\ufffd.md"
    k1, k2 = new_key(), new_key()
    assert k1.startswith("cli-") and len(k1) == 36 and k1 != k2


# ---------------------------------------------------------------- import_walk


def test_import_walk_skips_hidden_temporaries_and_links(tmp_path):
    write_tree(tmp_path, {
        "b.md": "b", "a/z.md": "z", "a/b.md": "ab", ".hidden": "h", ".git/config": "c",
        "notes.md~": "t", ".#lock": "l", "#draft#": "s", "4913": "v",
    })
    (tmp_path / "link.md").symlink_to(tmp_path / "b.md")
    (tmp_path / "linkdir").symlink_to(tmp_path / "a")
    files, skipped = import_walk(tmp_path)
    assert [p for p, _ in files] == ["a/b.md", "a/z.md", "b.md"]
    assert all(f == tmp_path / p for p, f in files)
    assert sorted(skipped) == sorted([".git/", "linkdir/", ".#lock", ".hidden", "4913", "link.md", "notes.md~", "#draft#"])


def test_import_walk_orders_by_utf8_bytes(tmp_path):
    write_tree(tmp_path, {"Z.md": "1", "a.md": "2", "é.md": "3", "_.md": "4"})
    files, skipped = import_walk(tmp_path)
    assert [p for p, _ in files] == ["Z.md", "_.md", "a.md", "é.md"] and skipped == []


# ---------------------------------------------------------------- import_files


async def test_import_creates_updates_and_leaves_identical_files(api, tmp_path):
    write_tree(tmp_path, {
        "MEMORY.md": "- [a](a.md)\n",
        "a.md": "---\ntype: user\n---\nsenior engineer\n",
        "notes/b.md": "plain notes\n",
    })
    files, _ = import_walk(tmp_path)
    lines: list[str] = []
    report = await import_files(api, "default", files, False, lines.append)
    assert isinstance(report, ImportReport)
    assert report.done == [("created", "MEMORY.md", None), ("created", "a.md", "user"), ("created", "notes/b.md", "project")]
    assert report.refused == [] and report.skipped == []
    assert lines == ["created MEMORY.md (index)", "created a.md (user)", "created notes/b.md (project)"]
    got = await live(api)
    assert {p: r.content for p, r in got.items()} == {
        "MEMORY.md": "- [a](a.md)\n", "a.md": "---\ntype: user\n---\nsenior engineer\n", "notes/b.md": "plain notes\n",
    }

    (tmp_path / "notes/b.md").write_text("plain notes, edited\n")
    report = await import_files(api, "default", files, False, lambda _: None)
    assert report.done == [("unchanged", "MEMORY.md", None), ("unchanged", "a.md", "user"), ("updated", "notes/b.md", "project")]
    assert report.counts() == {"unchanged": 2, "updated": 1}
    after = await live(api)
    assert after["notes/b.md"].version == 2 and after["a.md"].version == 1


async def test_import_refusals_are_collected_and_the_rest_imported(api, tmp_path):
    write_tree(tmp_path, {
        "ok.md": "fine\n",
        "latin1.md": b"caf\xe9\n",
        "secret.md": f"token {fake_token()}\n",
        "badtype.md": "---\ntype: diary\n---\nx\n",
    })
    files, _ = import_walk(tmp_path)
    files.append(("bad//name.md", tmp_path / "ok.md"))
    files.append(("gone.md", tmp_path / "does-not-exist.md"))
    report = await import_files(api, "default", files, False, lambda _: None)
    assert report.done == [("created", "ok.md", "project")]
    refused = dict(report.refused)
    assert set(refused) == {"latin1.md", "secret.md", "badtype.md", "bad//name.md", "gone.md"}
    assert refused["latin1.md"].endswith("[invalid_content]")
    assert refused["secret.md"].endswith("[secret_detected]") and fake_token() not in refused["secret.md"]
    assert refused["badtype.md"].endswith("[invalid_type]")
    assert refused["bad//name.md"].endswith("[invalid_path]")
    assert refused["gone.md"].startswith("cannot read:")
    assert all("\n" not in r for r in refused.values())
    assert set(await live(api)) == {"ok.md"}


async def test_dry_run_checks_the_rules_and_writes_nothing(api, tmp_path):
    await api.create_record("default", "old.md", "old\n")
    write_tree(tmp_path, {"old.md": "new\n", "new.md": "---\ntype: feedback\n---\nx\n", "secret.md": f"{fake_token()}\n"})
    files, _ = import_walk(tmp_path)
    report = await import_files(api, "default", files, True, lambda _: None)
    assert report.done == [("would create", "new.md", "feedback"), ("would update", "old.md", "project")]
    assert [p for p, _ in report.refused] == ["secret.md"] and report.refused[0][1].endswith("[secret_detected]")
    got = await live(api)
    assert set(got) == {"old.md"} and got["old.md"].content == "old\n"


async def test_dry_run_refuses_a_file_over_the_store_limit(api, fake, tmp_path):
    async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport) as admin:
        await admin.update_store("default", max_record_bytes=1024)
    write_tree(tmp_path, {"big.md": "x" * 2000})
    files, _ = import_walk(tmp_path)
    report = await import_files(api, "default", files, True, lambda _: None)
    assert report.done == [] and report.refused == [("big.md", "record is 2000 bytes, the store allows 1024 [record_too_large]")]


class _StaleListing:
    """An ApiClient whose snapshot pages show no records: the store as listed before another
    writer created a path (every other call goes to the real client)."""

    def __init__(self, api: ApiClient) -> None:
        self._api = api

    def __getattr__(self, name: str):
        return getattr(self._api, name)

    async def list_records(self, store: str, **kw) -> RecordPage:
        page = await self._api.list_records(store, **kw)
        return RecordPage(records=[], next_cursor=None, seq=page.seq)

    async def snapshot(self, store: str, **kw) -> tuple[list[Record], int]:
        page = await self.list_records(store)
        return [], page.seq


async def test_a_path_created_meanwhile_is_updated(api, tmp_path):
    other = await api.create_record("default", "a.md", "someone else's\n")
    write_tree(tmp_path, {"a.md": "mine\n"})
    files, _ = import_walk(tmp_path)
    report = await import_files(_StaleListing(api), "default", files, False, lambda _: None)  # type: ignore[arg-type]
    assert report.done == [("updated", "a.md", "project")] and report.refused == []
    got = (await live(api))["a.md"]
    assert got.id == other.id and got.content == "mine\n" and got.version == 2


async def test_import_survives_lost_responses_without_writing_twice(api, fake, tmp_path):
    write_tree(tmp_path, {f"f{i}.md": f"file {i}\n" for i in range(4)})
    files, _ = import_walk(tmp_path)
    fake.faults.drop_rate = 0.4  # applied by the server, response lost: retried with the same key
    try:
        report = await import_files(api, "default", files, False, lambda _: None)
    finally:
        fake.faults.reset()
    assert fake.counters.dropped > 0
    assert report.refused == [] and [a for a, _, _ in report.done] == ["created"] * 4
    got = await live(api)
    assert {p: (r.content, r.version) for p, r in got.items()} == {f"f{i}.md": (f"file {i}\n", 1) for i in range(4)}


# ---------------------------------------------------------------- export_records


def _rec(path: str, content: str, when: datetime) -> Record:
    raw = content.encode()
    return Record(
        id=f"id-{path}", store="s", path=path, type="project", version=1, sha256=sha256_hex(raw),
        size=len(raw), deleted=False, created_at=when, updated_at=when, updated_by="t", seq=1, content=content,
    )


def test_export_writes_bytes_and_times_and_leaves_other_files(tmp_path):
    when = datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
    out = tmp_path / "out"
    write_tree(out, {"keep.txt": "mine", "a.md": "old"})
    report = export_records([_rec("a.md", "new é\n", when), _rec("d/e/f.md", "deep\n", when)], out)
    assert report == ExportReport(written=2, bytes=len("new é\n".encode()) + 5, failed=[])
    assert (out / "a.md").read_bytes() == "new é\n".encode() and (out / "d/e/f.md").read_text() == "deep\n"
    assert (out / "keep.txt").read_text() == "mine"
    assert os.stat(out / "a.md").st_mtime == when.timestamp()
    assert not [p for p in out.rglob(".memfuse-export-*")]
    script = msgspec.structs.replace(_rec("s.sh", "#!/bin/sh\n", when), mode=0o750, mtime_ns=1577923200_123456789)
    assert export_records([script], out).written == 1
    st = os.stat(out / "s.sh")
    assert (st.st_mode & 0o7777, st.st_mtime_ns) == (0o750, 1577923200_123456789)
    assert os.stat(out / "a.md").st_mode & 0o7777 == 0o644


def test_export_failures_are_listed_and_the_rest_written(tmp_path):
    when = datetime(2025, 1, 1, tzinfo=timezone.utc)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "dir.md").mkdir(parents=True)
    (out / "escape").symlink_to(elsewhere)
    report = export_records(
        [_rec("dir.md", "x", when), _rec("escape/x.md", "x", when), _rec("../up.md", "x", when), _rec("ok.md", "ok", when)],
        out,
    )
    assert report.written == 1 and report.bytes == 2 and (out / "ok.md").read_text() == "ok"
    failed = dict(report.failed)
    assert set(failed) == {"dir.md", "escape/x.md", "../up.md"}
    assert failed["dir.md"] == "a directory is in the way" and "leads outside" in failed["escape/x.md"]
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "up.md").exists()


async def test_export_then_import_gives_the_same_store(api, tmp_path):
    src = {"MEMORY.md": "- [u](u.md)\n", "u.md": "---\ntype: user\n---\nu\n", "n/x.md": "x\n"}
    for path, text in src.items():
        await api.create_record("default", path, text)
    records, _ = await api.snapshot("default", content=True)
    assert export_records(records, tmp_path).failed == []
    files, _ = import_walk(tmp_path)
    report = await import_files(api, "copy", files, False, lambda _: None)
    assert [a for a, _, _ in report.done] == ["created"] * 3
    copied = await live(api, "copy")
    assert {p: (r.type, r.content) for p, r in copied.items()} == {p: (r.type, r.content) for p, r in (await live(api)).items()}
    assert {p: (r.mode, r.mtime_effective_ns()) for p, r in copied.items()} == {
        p: (r.mode, r.mtime_effective_ns()) for p, r in (await live(api)).items()}
    again = await import_files(api, "default", files, False, lambda _: None)
    assert [a for a, _, _ in again.done] == ["unchanged"] * 3


async def test_import_keeps_file_modes_and_times_and_sends_only_changed_attributes(api, tmp_path):
    write_tree(tmp_path, {"a.md": "a\n", "b.md": "b\n"})
    os.chmod(tmp_path / "a.md", 0o600)
    os.utime(tmp_path / "a.md", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    files, _ = import_walk(tmp_path)
    await import_files(api, "default", files, False, lambda _: None)
    got = await live(api)
    assert (got["a.md"].mode, got["a.md"].mtime_ns) == (0o600, 1_600_000_000_123_456_789)
    assert got["b.md"].mtime_ns == (tmp_path / "b.md").stat().st_mtime_ns
    # only b's mode changes: its content is not sent again, a' is left alone
    os.chmod(tmp_path / "b.md", 0o640)
    again = await import_files(api, "default", files, False, lambda _: None)
    assert sorted((a, p) for a, p, _ in again.done) == [("unchanged", "a.md"), ("updated", "b.md")]
    after = await live(api)
    assert after["b.md"].mode == 0o640 and after["b.md"].sha256 == got["b.md"].sha256
    assert after["b.md"].version == got["b.md"].version + 1 and after["b.md"].content == "b\n"
