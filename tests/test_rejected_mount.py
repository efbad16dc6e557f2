"""Rejected files through a real mount and a real restart of ``memfuse mount`` on the same
cache directory (docs/SEMANTICS.md, "Writes and close" and "Cache directory"):

- a file refused for good (a key refused as a secret, a bad type or too large at its write,
  not UTF-8 at close) is still there after the restart with its content (what the accepted
  writes left: nothing for a write refused at once), ``state=rejected`` and its reason; nothing
  is sent again; a fix in place commits it, an unlink drops it, a rename keeps it;
  ``.memfuse/errors.log`` still holds the lines saying why;
- ``status.json`` counts rejected files apart from ``records`` / ``bytes``;
- the sidecar's log line for a refusal names store, path, errno and reason code (never content);
- the cache directory is owner-only (directories 0700, files 0600), also when it existed with
  looser modes.

Secrets used here are built at run time, never written in the repository.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import stat

import pytest

from mountcheck import errors_log, status, wait_drained, write_file, xattr
from mountutil import ControlPlane, Sidecar, live_records, wait_until

pytestmark = pytest.mark.mount

OK = {"open": None, "write": None, "close": None}


def _pem_private_key() -> bytes:
    dashes, label = "-" * 5, "EC " + "PRIVATE" + " KEY"
    body = base64.b64encode(secrets.token_bytes(120)).decode()
    return f"{dashes}BEGIN {label}{dashes}\n{body}\n{dashes}END {label}{dashes}\n".encode()


def modes(path) -> dict[str, int]:
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, path)] = stat.S_IMODE(os.lstat(p).st_mode)
    out["."] = stat.S_IMODE(os.stat(path).st_mode)
    return out


def store_counts(root, slug: str = "default") -> dict:
    (st,) = [s for s in status(root)["stores"] if s["slug"] == slug]
    return {k: st[k] for k in ("records", "bytes", "rejected", "rejected_bytes")}


def test_rejected_files_survive_restart_and_cache_is_private(tmp_path):
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("default", "small"))
        cp.call("update_store", "small", max_record_bytes=64)
        cache = tmp_path / "cache"
        cache.mkdir(mode=0o755)
        os.chmod(cache, 0o755)
        (cache / "stores").mkdir(mode=0o755)
        os.chmod(cache / "stores", 0o755)
        (cache / "stray.json").write_text("{}")
        os.chmod(cache / "stray.json", 0o644)
        mnt = tmp_path / "mnt"
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        d, small = mnt / "default", mnt / "small"
        key = _pem_private_key()
        assert write_file(d / "old.md", b"v1\n") == OK
        (d / "sub").mkdir()
        got = {"secret": write_file(d / "sub" / "key.md", b"deploy key:\n" + key),
               # a UTF-8 sequence cut at the end: only the whole file shows it, at close
               "utf8 over a record": write_file(d / "old.md", b"caf\xc3"),
               "type": write_file(d / "typ.md", b"---\ntype: diary\n---\nbody\n"),
               "size": write_file(small / "big.md", b"x" * 100)}
        assert got == {"secret": {"open": None, "write": "EPERM", "close": None},
                       "utf8 over a record": {"open": None, "write": None, "close": "EILSEQ"},
                       "type": {"open": None, "write": "EINVAL", "close": None},
                       "size": {"open": None, "write": "EFBIG", "close": None}}
        wait_drained(mnt)
        assert xattr(small / "big.md", "state") == "rejected"  # the refused write held back
        # refused at the write: not applied, the new files held back empty
        rejected = {"sub/key.md": b"", "old.md": b"caf\xc3", "typ.md": b""}
        # status.json: records / bytes are what the control plane holds (old.md, 3 bytes)
        expect = {"records": 1, "bytes": 3, "rejected": 3,
                  "rejected_bytes": sum(len(v) for v in rejected.values())}
        assert store_counts(mnt) == expect
        assert store_counts(mnt, "small") == {"records": 0, "bytes": 0, "rejected": 1,
                                              "rejected_bytes": 0}

        # the sidecar's log line for each refusal: store, path, errno name, reason code
        lines = [json.loads(ln) for ln in sc.log.read_text().splitlines() if ln.startswith("{")]
        refused = {(ln.get("store"), ln.get("path"), ln.get("errno"), ln.get("code"))
                   for ln in lines if ln["msg"] == "refused"}
        assert {("default", "sub/key.md", "EPERM", "secret_detected"),
                ("default", "old.md", "EILSEQ", "invalid_content"),
                ("default", "typ.md", "EINVAL", "invalid_type"),
                ("small", "big.md", "EFBIG", "record_too_large")} <= refused, refused
        body = key.decode().splitlines()[1]
        assert body not in sc.log.read_text()

        # the cache directory: owner-only, the loose entries made before the start tightened
        m = modes(cache)
        loose = {p: oct(v) for p, v in m.items() if v & 0o077}
        assert loose == {}, loose
        assert m["."] == 0o700 and m["stores"] == 0o700 and m["blobs.db"] == 0o600
        assert m["outbox.db"] == 0o600 and m["stray.json"] == 0o600
        assert "cache directory permissions tightened" in sc.log.read_text()

        # restart on the same cache
        log_before = errors_log(mnt)
        assert sc.stop() == 0
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        for path, data in rejected.items():
            assert ((d / path).read_bytes(), xattr(d / path, "state")) == (data, "rejected"), path
            assert xattr(d / path, "error"), path
        assert xattr(small / "big.md", "state") == "rejected"
        assert store_counts(mnt) == expect
        wait_drained(mnt)
        st = status(mnt)["outbox"]
        assert (st["committed"], st["refused"]) == (0, 0)  # nothing was sent again
        assert {p: r.content for p, r in live_records(cp).items()} == {"old.md": "v1\n"}
        # errors.log still says why each file is rejected: the same lines as before the restart
        assert errors_log(mnt) == log_before
        assert {(e["store"], e["path"], e["errno"], e["code"]) for e in log_before} >= {
            ("default", "sub/key.md", "EPERM", "secret_detected"),
            ("default", "old.md", "EILSEQ", "invalid_content"),
            ("default", "typ.md", "EINVAL", "invalid_type"),
            ("small", "big.md", "EFBIG", "record_too_large")}
        for path in rejected:
            (why,) = {e["reason"] for e in log_before if e["path"] == path}
            assert why == xattr(d / path, "error"), path
        assert all(v & 0o077 == 0 for v in modes(cache).values())

        # fixed in place, unlinked, renamed
        assert write_file(d / "typ.md", b"---\ntype: user\n---\nbody\n") == OK
        assert xattr(d / "typ.md", "state") == "clean"
        os.unlink(d / "old.md")
        os.rename(d / "sub" / "key.md", d / "sub" / "moved.md")
        wait_drained(mnt)
        assert store_counts(mnt) == {"records": 1, "bytes": len(b"---\ntype: user\n---\nbody\n"),
                                     "rejected": 1, "rejected_bytes": len(rejected["sub/key.md"])}
        assert sc.stop() == 0
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        assert sorted(p.name for p in d.iterdir()) == ["sub", "typ.md"]
        assert (d / "sub" / "moved.md").read_bytes() == rejected["sub/key.md"]
        assert xattr(d / "sub" / "moved.md", "state") == "rejected"
        assert xattr(d / "typ.md", "state") == "clean"
        wait_until(lambda: status(mnt)["outbox"]["depth"] == 0, 10, "outbox drained")
        assert {p: r.content for p, r in live_records(cp).items()} == {
            "typ.md": "---\ntype: user\n---\nbody\n"}
    finally:
        try:
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()
