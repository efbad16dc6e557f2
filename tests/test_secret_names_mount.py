"""Secrets in file and directory names through a real mount (docs/SEMANTICS.md, "Names"):
create, mkdir and rename to a name holding a credential fail at once with ``EPERM``; the
``errors.log`` line and the sidecar's log name the kind and a redacted form, never the
secret; nothing reaches the control plane; names that merely look alike work.

Secret-shaped names are built at run time, never written in the repository.
"""
from __future__ import annotations

import random
import string

import pytest

from mountcheck import errors_log, outcome, wait_drained, write_file
from mountutil import live_records, serve_and_mount, sh

pytestmark = pytest.mark.mount


def _aws_key_id() -> str:
    rnd = random.Random(11)
    return "AK" + "IA" + "".join(rnd.choice(string.ascii_uppercase + "234567") for _ in range(15)) + "3"


def _github_token() -> str:
    rnd = random.Random(12)
    return "gh" + "p_" + "".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(36))


def test_secret_names_are_refused_at_once_and_never_logged(tmp_path):
    key, tok = _aws_key_id(), _github_token()
    with serve_and_mount(tmp_path) as (cp, sc):
        d = sc.mountpoint / "default"
        # the commands, through a shell
        r = sh(f"echo hi > mnt/default/{key}.md", tmp_path, check=False)
        assert r.returncode != 0 and "Operation not permitted" in r.stderr, r.stderr
        r = sh(f"mkdir mnt/default/{tok}", tmp_path, check=False)
        assert r.returncode != 0 and "Operation not permitted" in r.stderr, r.stderr
        assert write_file(d / "notes.md", b"n\n") == {"open": None, "write": None, "close": None}
        (d / "sub").mkdir()
        got = {"rename": outcome(lambda: (d / "notes.md").rename(d / "sub" / f"{key}")),
               "local-only": outcome(lambda: (d / f".{tok}.swp").write_bytes(b"")),
               "key_ prefix": outcome(lambda: (d / f"creds_{key}.txt").write_bytes(b"x")),
               "look-alike": outcome(lambda: (d / "ASIA-pacific.md").write_bytes(b"a\n")),
               "caps look-alike": outcome(lambda: (d / "ASIAPACIFICOVERVIEW.md").write_bytes(b"b\n")),
               "placeholder": outcome(lambda: (d / ("gh" + "p_" + "x" * 36)).mkdir())}
        assert got == {"rename": "EPERM", "local-only": "EPERM", "key_ prefix": "EPERM",
                       "look-alike": None, "caps look-alike": None, "placeholder": None}
        assert sorted(p.name for p in d.iterdir()) == [
            "ASIA-pacific.md", "ASIAPACIFICOVERVIEW.md", "gh" + "p_" + "x" * 36, "notes.md", "sub"]
        wait_drained(sc.mountpoint)
        assert set(live_records(cp)) == {"notes.md", "ASIA-pacific.md", "ASIAPACIFICOVERVIEW.md"}
        lines = [(e["path"], e["errno"], e["code"]) for e in errors_log(sc.mountpoint)]
        assert lines == [("AKIA[REDACTED].md", "EPERM", "secret_detected"),
                         ("ghp_[REDACTED]", "EPERM", "secret_detected"),
                         ("sub/AKIA[REDACTED]", "EPERM", "secret_detected"),
                         (".ghp_[REDACTED].swp", "EPERM", "secret_detected"),
                         ("creds_AKIA[REDACTED].txt", "EPERM", "secret_detected")], lines
        assert "AWS access key id" in errors_log(sc.mountpoint)[0]["reason"]
        everything = (sc.mountpoint / ".memfuse" / "errors.log").read_text() + sc.log.read_text()
        assert key not in everything and tok not in everything and key[4:] not in everything


def test_nfd_names_and_an_index_directory_are_einval_on_the_mount(tmp_path):
    """A name given on the mount is in NFC (``é`` typed as ``e`` + U+0301 would be a second
    record that looks like the first: attack 13 F2), and ``MEMORY.md`` at a store's root is
    never a directory (mkdir or a directory renamed there: F1); each refusal is EINVAL at
    once with an errors.log line, nothing is sent; the index file itself works."""
    with serve_and_mount(tmp_path) as (cp, sc):
        d = sc.mountpoint / "default"
        (d / "sub").mkdir()
        got = {"nfd file": outcome(lambda: (d / "e\u0301.md").write_bytes(b"x\n")),
               "nfd dir": outcome(lambda: (d / "a\u0301").mkdir()),
               "index dir": outcome(lambda: (d / "MEMORY.md").mkdir()),
               "index by rename": outcome(lambda: (d / "sub").rename(d / "MEMORY.md")),
               "nested index dir": outcome(lambda: (d / "sub" / "MEMORY.md").mkdir()),
               "nfc file": outcome(lambda: (d / "\u00e9.md").write_bytes(b"y\n")),
               "index file": outcome(lambda: (d / "MEMORY.md").write_bytes(b"# index\n"))}
        assert got == {"nfd file": "EINVAL", "nfd dir": "EINVAL", "index dir": "EINVAL",
                       "index by rename": "EINVAL", "nested index dir": None, "nfc file": None,
                       "index file": None}, got
        wait_drained(sc.mountpoint)
        assert set(live_records(cp)) == {"\u00e9.md", "MEMORY.md"}
        codes = [(e["errno"], e["code"]) for e in errors_log(sc.mountpoint)]
        assert codes == [("EINVAL", "invalid_path")] * 4, codes
