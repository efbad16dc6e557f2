"""`memfuse import` / `memfuse export` round trips, refusals during import, `store update`,
restore of a deleted record by path and the prompt block through the CLI (local mode:
the reference control plane in-process on a dev database under a tmp MEMFUSE_HOME)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from memfuse.cli import cli
from memfuse.devenv import ensure_dev_setup, local_client
from memfuse.transfer import MANIFEST_PATH

MEMFUSE = Path(sys.executable).with_name("memfuse")


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def ok(*args: str):
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    return r


def write_tree(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def read_tree(root: Path) -> dict[str, bytes]:
    """path → bytes of every file under ``root`` but an export's manifest."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            full = Path(dirpath, f)
            rel = full.relative_to(root).as_posix()
            if rel != MANIFEST_PATH:
                out[rel] = full.read_bytes()
    return out


def store_records(slug: str) -> dict[str, tuple[str | None, str]]:
    """path → (type, content) of every live record of ``slug``."""

    async def main():
        async with local_client() as api:
            recs, _ = await api.snapshot(slug, content=True)
            return {r.path: (r.type, r.content) for r in recs}

    return trio.run(main)


def fake_token() -> str:
    rnd = random.Random(11)
    return "gh" + "p_" + "".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(36))


CLAUDE = {
    "MEMORY.md": "- [User role](user_role.md) — senior engineer, terse answers\n"
    "- [Testing](feedback_testing.md) — real database in integration tests\n"
    "- [Release](project_release.md)\n- [Links](reference_links.md)\n",
    "user_role.md": "---\nname: user role\ndescription: who the user is\ntype: user\n---\n\n"
    "The user is a senior backend engineer; prefers short answers.\n",
    "feedback_testing.md": "---\nname: testing\ndescription: how to test\nmetadata:\n  type: feedback\n---\n\n"
    "Integration tests must hit a real database, not mocks.\n**Why:** a mocked migration hid a bug.\n",
    "project_release.md": "Release freeze starts 2026-03-05; no merges to main after that.",  # no newline at end
    "reference_links.md": "---\ntype: reference\n---\r\nBugs are tracked in Linear project INGEST.\r\n",  # CRLF body
    "notes/café — ünïcode.md": "---\ntype: user\n---\nLikes crème brûlée 🍮\n",
    "日本語/メモ.md": "メモ: 東京オフィスは金曜日休み\n",
    "notes/empty.md": "",
}
WORKSPACE = {
    "FACT.md": "# Facts\n\n- The API lives in services/api.\n- Deploys go through CI only.\n",
    "JOURNAL.jsonl": "".join(
        json.dumps({"ts": f"2026-01-0{i}T10:00:00Z", "event": "note", "text": f"entry {i} — ü"}, ensure_ascii=False) + "\n"
        for i in range(1, 6)
    ),
}
PROFILE = {"user_profile.md": "Name: Ana\nRole: data engineer\nTimezone: Europe/Lisbon\n"}
JUNK = {
    ".DS_Store": b"\x00\x01junk",
    ".git/config": "[core]\n",
    "user_role.md~": "backup",
    ".#user_role.md": "lock",
    "#user_role.md#": "autosave",
    ".user_role.md.swp": b"\x00swap",
    "4913": "vim probe",
    ".memfuse/status.json": "{}",
}


def test_round_trip_is_byte_exact_with_types(home, tmp_path):
    src = tmp_path / "src"
    write_tree(src / "claude", {**CLAUDE, **JUNK})
    os.symlink("user_role.md", src / "claude" / "link.md")
    write_tree(src / "workspace", WORKSPACE)
    write_tree(src / "profile", PROFILE)
    ok("store", "create", "claude")
    ok("store", "create", "work", "--default-type", "reference")
    ok("store", "create", "profile", "--default-type", "user")

    r = ok("import", "claude", str(src / "claude"))
    assert f"imported {len(CLAUDE)} file(s) into claude ({len(CLAUDE)} created); 0 unchanged, 0 refused, 9 skipped" in r.stdout
    for name in (".DS_Store", ".git/", "user_role.md~", ".#user_role.md", "#user_role.md#", ".user_role.md.swp",
                 "4913", ".memfuse/", "link.md"):
        assert name in r.stdout.split("skipped: ", 1)[1], name
    assert "created user_role.md (user)" in r.stdout and "created MEMORY.md (index)" in r.stdout
    r = ok("import", "work", str(src / "workspace"), "--quiet")  # the summary alone
    assert r.stdout.startswith(f"imported {len(WORKSPACE)} file(s) into work"), r.stdout
    assert "created " not in r.stdout and len(r.stdout.splitlines()) == 1, r.stdout
    ok("import", "profile", str(src / "profile"))

    recs = store_records("claude")
    assert {p: t for p, (t, _) in recs.items()} == {
        "MEMORY.md": None,
        "user_role.md": "user",
        "feedback_testing.md": "feedback",
        "project_release.md": "project",  # the store's default type
        "reference_links.md": "reference",
        "notes/café — ünïcode.md": "user",
        "日本語/メモ.md": "project",
        "notes/empty.md": "project",
    }
    assert {p: t for p, (t, _) in store_records("work").items()} == {"FACT.md": "reference", "JOURNAL.jsonl": "reference"}
    assert {p: t for p, (t, _) in store_records("profile").items()} == {"user_profile.md": "user"}

    for slug, expected in (("claude", CLAUDE), ("work", WORKSPACE), ("profile", PROFILE)):
        out = tmp_path / "out" / slug
        r = ok("export", slug, str(out))
        assert f"exported {len(expected)} record(s)" in r.stdout
        assert read_tree(out) == {k: v.encode() for k, v in expected.items()}

    # export → import again: nothing changes (no new versions)
    r = ok("import", "claude", str(tmp_path / "out" / "claude"))
    assert f"{len(CLAUDE)} unchanged" in r.stdout and "created" not in r.stdout.split("imported", 1)[1]
    # the summary says nothing was imported (newuser26: "imported 5 of 7 file(s) ...: 5 unchanged")
    assert f"imported 0 file(s) into claude; {len(CLAUDE)} unchanged, 0 refused, 0 skipped" in r.stdout


def test_export_through_the_console_script(home, tmp_path):
    """The real executable (its own process and stdout encoding) with unicode names."""
    src = tmp_path / "src"
    write_tree(src, CLAUDE)
    ok("store", "create", "claude")
    env = dict(os.environ)
    p = subprocess.run([str(MEMFUSE), "import", "claude", str(src)], env=env, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "created 日本語/メモ.md (project)".encode() in p.stdout
    p = subprocess.run([str(MEMFUSE), "export", "claude", str(tmp_path / "out")], env=env, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert read_tree(tmp_path / "out") == {k: v.encode() for k, v in CLAUDE.items()}


def test_import_updates_by_path_and_keeps_types(home, tmp_path):
    src = tmp_path / "src"
    write_tree(src, {"a.md": "---\ntype: feedback\n---\nv1\n", "b.md": "plain\n"})
    ok("store", "create", "s")
    ok("import", "s", str(src))
    write_tree(src, {"a.md": "now without frontmatter\n", "c.md": "new\n"})
    r = ok("import", "s", str(src))
    assert "updated a.md (feedback)" in r.stdout  # the record's current type is kept
    assert "unchanged b.md (project)" in r.stdout and "created c.md (project)" in r.stdout
    assert "imported 2 file(s) into s (1 created, 1 updated); 1 unchanged, 0 refused, 0 skipped" in r.stdout


def test_import_lists_refusals_and_goes_on(home, tmp_path):
    src = tmp_path / "bad"
    write_tree(src, {
        "ok.md": "fine\n",
        "binary.bin": b"\x89PNG\r\n\x1a\n\xff\xfe",
        "nul.md": b"a\x00b",
        "diary.md": "---\ntype: diary\n---\nDear diary\n",
        "keys.md": f"# Keys\n\nci token: {fake_token()}\n",
        "big.md": "x" * 2000 + "\n",
        "bad\x01name.md": "control character in the name\n",
    })
    ok("store", "create", "strict", "--max-record-bytes", "1K")

    r = ok("import", "strict", str(src), "--dry-run")
    assert "would create ok.md (project)" in r.stdout
    assert "would import 1 file(s) into strict (1 to create); 0 unchanged, 6 refused, 0 skipped (dry run: nothing written)" in r.stdout
    assert store_records("strict") == {}

    r = ok("import", "strict", str(src))  # exit 0: something was imported
    out = r.stdout
    assert "imported 1 file(s) into strict (1 created); 0 unchanged, 6 refused, 0 skipped" in out
    refused = out.split("refused:\n", 1)[1]
    assert "binary.bin: content is not valid UTF-8 (bad byte at offset 0) [invalid_content]" in refused
    assert "nul.md: content contains a NUL character (at offset 1) [invalid_content]" in refused
    assert "diary.md: the type is not one of user, feedback, project, reference [invalid_type]" in refused
    assert "keys.md: content holds a secret (GitHub token on line 3)" in refused and "[secret_detected]" in refused
    assert "big.md: record is 2001 bytes, the store allows 1024 [record_too_large]" in refused
    assert "bad\x01name.md: name contains forbidden character U+0001 (Unicode category Cc) [invalid_path]" in refused
    assert fake_token() not in out
    assert set(store_records("strict")) == {"ok.md"}

    only_bad = tmp_path / "only_bad"
    write_tree(only_bad, {"diary.md": "---\ntype: diary\n---\n", "bin": b"\xff"})
    r = invoke("import", "strict", str(only_bad))
    assert r.exit_code == 1
    assert "Error: nothing imported: all 2 file(s) were refused" in r.stderr
    assert "refused:" in r.stdout


def test_import_into_a_full_store_lists_each_refusal(home, tmp_path):
    src = tmp_path / "src"
    write_tree(src, {f"n{i}.md": f"note {i}\n" for i in range(5)})
    ok("store", "create", "tiny", "--max-records", "3")
    r = ok("import", "tiny", str(src))
    assert "imported 3 file(s) into tiny (3 created); 0 unchanged, 2 refused" in r.stdout
    assert r.stdout.count("[store_full]") == 2


def test_store_update_limits_and_default_type(home, tmp_path):
    ok("store", "create", "notes")
    r = ok("store", "update", "notes", "--max-record-bytes", "2K", "--default-type", "reference",
           "--max-store-bytes", "1MiB", "--max-records", "50")
    assert "reference" in r.stdout and "2 KiB" in r.stdout
    s = json.loads(ok("store", "show", "notes").stdout)
    assert (s["max_record_bytes"], s["default_type"], s["max_store_bytes"], s["max_records"]) == (2048, "reference", 1 << 20, 50)
    src = tmp_path / "src"
    write_tree(src, {"plain.md": "no frontmatter\n", "big.md": "y" * 3000})
    r = ok("import", "notes", str(src))
    assert "created plain.md (reference)" in r.stdout
    assert "big.md: record is 3000 bytes, the store allows 2048 [record_too_large]" in r.stdout
    assert invoke("store", "update", "notes", "--default-type", "diary").exit_code == 2
    assert invoke("store", "update", "notes", "--max-record-bytes", "0").exit_code == 2


def test_restore_a_deleted_record_by_path_and_history_types(home, tmp_path):
    async def setup():
        async with local_client() as api:
            await api.create_store("mem")
            r = await api.create_record("mem", "prefs.md", "---\ntype: user\n---\ntabs\n")
            await api.update_record("mem", r.id, "---\ntype: feedback\n---\nspaces\n")
            await api.delete_record("mem", r.id)

    trio.run(setup)
    assert store_records("mem") == {}
    r = ok("history", "mem", "prefs.md")
    rows = [ln.split() for ln in r.stdout.splitlines()[2:]]
    assert [(x[0], x[1], x[5]) for x in rows] == [("1", "created", "user"), ("2", "modified", "feedback"),
                                                  ("3", "deleted", "feedback")]
    r = ok("restore", "mem", "prefs.md", "--version", "1")
    assert "now version 4" in r.stdout
    assert store_records("mem") == {"prefs.md": ("user", "---\ntype: user\n---\ntabs\n")}
    r = ok("history", "mem", "prefs.md")
    assert r.stdout.splitlines()[-1].split()[:2] == ["4", "restored"] and " user " in r.stdout.splitlines()[-1]


def test_context_of_a_300_line_index_through_the_cli(home, tmp_path):
    async def setup():
        async with local_client() as api:
            await ensure_dev_setup(api)

    trio.run(setup)
    lines = [f"- [note {i}](notes/n{i}.md) — détail {i}\n" for i in range(300)]
    src = tmp_path / "src"
    write_tree(src, {"MEMORY.md": "".join(lines)})
    ok("import", "default", str(src))
    r = ok("context", "--workspace", "dev")
    left = len("".join(lines[200:]).encode())
    assert f"[memfuse: MEMORY.md is cut here: 100 more line(s) ({left} bytes) are not shown;" in r.stdout
    assert "Compact MEMORY.md" in r.stdout
    assert lines[199].strip() in r.stdout and lines[200].strip() not in r.stdout


def test_export_refuses_to_write_outside_and_reports(home, tmp_path):
    async def setup():
        async with local_client() as api:
            await api.create_store("x")
            await api.create_record("x", "a", "file a\n")
            await api.create_record("x", "d/e.md", "e\n")

    trio.run(setup)
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").mkdir()  # a directory where a record's file goes
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, out / "d")  # a link leading out of DIR
    r = invoke("export", "x", str(out))
    assert r.exit_code == 1
    assert "a: a directory is in the way" in r.stdout
    assert "d/e.md:" in r.stdout and "leads outside" in r.stdout
    assert "Error: 2 record(s) could not be written" in r.stderr
    assert list(outside.iterdir()) == []


# ---------------------------------------------------------------- export → import, every field

#: path → (content, explicit type or None, mode, explicit mtime_ns or None); the store's
#: default type is `user`, the importing store's `project`
FAITHFUL = {
    "MEMORY.md": ("- [prefs](prefs.md)\n", None, 0o644, None),
    ".hidden.md": ("h\n", None, 0o644, None),  # a dot-file record
    ".notes/deep/x.md": ("in a hidden directory\n", "reference", 0o600, None),
    "prefs.md": ("likes tabs\n", "feedback", 0o644, None),  # typed by xattr / console, no frontmatter
    "fm.md": ("---\ntype: user\n---\nfrontmatter typed\n", None, 0o644, 1_600_000_000_123_456_789),
    "override.md": ("---\ntype: user\n---\nthe xattr wins\n", "reference", 0o640, None),
    "default-typed.md": ("the source store's default type\n", None, 0o644, None),
    "bin/run.sh": ("#!/bin/sh\necho hi\n", None, 0o750, 1_500_000_000_000_000_001),
    "locked.md": ("nobody may read this\n", "project", 0o000, None),
    "ro/only.md": ("read only\n", None, 0o444, None),
    "a/b/c/d/e.md": ("deeply nested", "user", 0o644, None),  # no newline at end
    "日本語/メモ.md": ("メモ: 金曜日休み\n", None, 0o644, None),
    "notes/café — ü 🍮.md": ("crème brûlée\r\nCRLF\r\n", "feedback", 0o644, 1_700_000_000_000_000_000),
    "empty.md": ("", None, 0o644, None),
}
FIELDS = ("path", "type", "content", "sha256", "size", "mode", "deleted")


async def _make_faithful_store() -> None:
    async with local_client() as api:
        await api.create_store("src", default_type="user")
        for path, (content, rtype, mode, mtime_ns) in FAITHFUL.items():
            await api.create_record("src", path, content, rtype, mode=mode, mtime_ns=mtime_ns)


def _fields(slug: str) -> dict[str, tuple]:
    """path → every field a user can set, through the API (mtime as the file shows it)."""

    async def main():
        async with local_client() as api:
            recs, _ = await api.snapshot(slug, content=True)
            return {r.path: tuple(getattr(r, f) for f in FIELDS) + (r.mtime_effective_ns(),) for r in recs}

    return trio.run(main)


def test_export_then_import_gives_the_same_records_field_by_field(home, tmp_path):
    trio.run(_make_faithful_store)
    src = _fields("src")
    assert set(src) == set(FAITHFUL)
    assert src["default-typed.md"][1] == "user" and src["prefs.md"][1] == "feedback"
    assert src["override.md"][1] == "reference" and src["locked.md"][5] == 0

    out = tmp_path / "export"
    r = ok("export", "src", str(out))
    assert f"exported {len(FAITHFUL)} record(s)" in r.stdout
    assert read_tree(out) == {p: c.encode() for p, (c, _, _, _) in FAITHFUL.items()}
    manifest = json.loads((out / MANIFEST_PATH).read_text(encoding="utf-8"))
    assert (manifest["format"], manifest["version"], manifest["store"]) == ("memfuse-export", 1, "src")
    assert [e["path"] for e in manifest["records"]] == sorted(FAITHFUL, key=lambda p: p.encode())
    assert {e["path"]: (e["type"], e["mode"], e["mtime_ns"], e["sha256"], e["size"]) for e in manifest["records"]} == {
        p: (v[1], v[5], v[7], v[3], v[4]) for p, v in src.items()}

    ok("store", "create", "rt")  # default type project
    r = ok("import", "rt", str(out))
    assert f"imported {len(FAITHFUL)} file(s) into rt ({len(FAITHFUL)} created); 0 unchanged, 0 refused, 0 skipped" in r.stdout
    assert "skipped:" not in r.stdout
    assert _fields("rt") == src

    # imported again: nothing to do; into the source store: nothing either
    r = ok("import", "rt", str(out))
    assert f"{len(FAITHFUL)} unchanged" in r.stdout and "updated" not in r.stdout
    r = ok("import", "src", str(out))
    assert f"{len(FAITHFUL)} unchanged" in r.stdout

    # copied without modes and times (cp -r): the manifest still gives them back
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, copy_function=shutil.copyfile)
    ok("store", "create", "rt2")
    r = ok("import", "rt2", str(copy))
    assert "0 refused, 0 skipped" in r.stdout
    assert _fields("rt2") == src

    # a file edited after the export is imported as a plain file: frontmatter / default type,
    # the file's own mode and time; the others keep the exported attributes
    (copy / "prefs.md").write_text("---\ntype: user\n---\nnow spaces\n")
    os.chmod(copy / "prefs.md", 0o600)
    (copy / "empty.md").unlink()
    ok("store", "create", "rt3")
    r = ok("import", "rt3", str(copy))
    assert "empty.md: listed in .memfuse/export.json but not a regular file in DIR [missing]" in r.stdout
    got = _fields("rt3")
    assert got["prefs.md"][1:3] == ("user", "---\ntype: user\n---\nnow spaces\n") and got["prefs.md"][5] == 0o600
    assert {p: v for p, v in got.items() if p != "prefs.md"} == {p: v for p, v in src.items() if p not in ("prefs.md", "empty.md")}


def test_import_of_a_directory_with_a_bad_manifest_fails_clearly(home, tmp_path):
    ok("store", "create", "s")
    write_tree(tmp_path / "d", {"a.md": "a\n", MANIFEST_PATH: "{not json"})
    r = invoke("import", "s", str(tmp_path / "d"))
    assert r.exit_code == 1 and "export.json is not JSON" in r.stderr
    write_tree(tmp_path / "d", {MANIFEST_PATH: json.dumps({"format": "memfuse-export", "version": 2, "records": []})})
    r = invoke("import", "s", str(tmp_path / "d"))
    assert r.exit_code == 1 and "has version 2; this memfuse reads version 1" in r.stderr
    assert store_records("s") == {}


def _on_a_terminal(args: list[str], timeout: float = 120) -> tuple[int, bytes]:
    """Run the real executable with stdout and stderr on a pseudo-terminal (as in a shell
    window); (exit status, everything it wrote there)."""
    import pty
    import select
    import time

    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # rows, columns
    env = dict(os.environ, COLUMNS="100", TERM="xterm")
    proc = subprocess.Popen([str(MEMFUSE), *args], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env=env, close_fds=True)
    os.close(follower)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the process closed its side (exited)
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), bytes(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def test_import_and_export_show_a_progress_bar_on_a_terminal_only(home, tmp_path):
    """On a terminal, `memfuse import` and `export` draw a progress bar (tqdm, on stderr,
    redrawn in place with carriage returns, cleared at the end); piped they print their lines
    and nothing else."""
    files = {f"notes/n{i:03d}.md": f"note {i}\n" for i in range(60)}
    src = tmp_path / "src"
    write_tree(src, files)
    ok("store", "create", "bars")
    code, shown = _on_a_terminal(["import", "bars", str(src)])
    text = shown.decode("utf-8", "replace")
    assert code == 0, text
    assert re.search(r"importing: +\d+%\|", text), text  # the bar, with its percentage
    assert re.search(r"\b[1-9]\d*/60\b", text) and "\r" in text  # it moved on (redrawn in place)
    assert "created notes/n059.md (project)" in text  # the per-file lines still show
    assert "imported 60 file(s) into bars (60 created)" in text

    code, shown = _on_a_terminal(["export", "bars", str(tmp_path / "out")])
    text = shown.decode("utf-8", "replace")
    assert code == 0, text
    assert re.search(r"(reading|writing): +\d+%\|", text) and re.search(r"\b\d+/60\b", text), text
    assert "exported 60 record(s)" in text
    assert read_tree(tmp_path / "out") == {k: v.encode() for k, v in files.items()}

    # piped (stdout and stderr): the same lines, no bar, no carriage return
    write_tree(src, {"notes/n000.md": "changed\n"})
    p = subprocess.run([str(MEMFUSE), "import", "bars", str(src)], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert b"updated notes/n000.md (project)" in p.stdout and b"(1 updated); 59 unchanged" in p.stdout
    assert p.stderr == b"" and b"\r" not in p.stdout and b"%|" not in p.stdout
    p = subprocess.run([str(MEMFUSE), "export", "bars", str(tmp_path / "out2")], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(b"exported 60 record(s)") and p.stderr == b""
