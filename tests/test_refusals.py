"""The refusal errnos of docs/API.md and the name rules of docs/SEMANTICS.md, row by row, through a real mount.

Each test drives ``memfuse mount`` (served by another process, ``memfuse serve`` on SQLite
behind it) with syscalls from Python — errno checked at the exact call that must fail:
write / truncate for size limits, ``close()`` for commit-time refusals — and, where a shell
tool shows the refusal, with that tool (exit status and the strerror text on stderr). After
each refusal the control plane is read through the API: nothing stored before is lost, and
nothing refused was stored.

Store limits are set with the admin API before the mount (the sidecar reads them at mount):

- ``small``: ``max_record_bytes=64``
- ``fewrec``: ``max_records=3``
- ``fewbytes``: ``max_store_bytes=1000``
- ``gone``: detached and re-attached by ``test_detached_store``
- ``elsewhere``: exists, never attached to the workspace

Secrets used here are built at run time, never written in the repository.
"""
from __future__ import annotations

import base64
import errno
import os
import re
import secrets
import string
import subprocess
import uuid
from pathlib import Path

import pytest

from mountcheck import (MountEnv, errors_log, errors_log_text, outcome, status, wait_drained, wait_until,
                        write_file, xattr)
from mountutil import MEMFUSE, live_records, serve_and_mount, sh

pytestmark = pytest.mark.mount

SMALL_LIMIT = 64
STORE_BYTES = 1000
OK = {"open": None, "write": None, "close": None}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = MountEnv(tmp_path_factory.mktemp("refusals"),
                 stores={"default": {}, "small": {"max_record_bytes": SMALL_LIMIT},
                         "fewrec": {"max_records": 3}, "fewbytes": {"max_store_bytes": STORE_BYTES},
                         "gone": {}},
                 unattached=("elsewhere",))
    try:
        e.start()
        yield e
    finally:
        e.stop()


def fresh_dir(env: MountEnv, store: str = "default") -> tuple[Path, str]:
    """A new directory in ``store`` on the mount, and its store-relative path."""
    pre = "t-" + uuid.uuid4().hex[:8]
    p = env.store(store) / pre
    p.mkdir()
    return p, pre


def fd_op(path: Path, flags: int, op) -> dict[str, str | None]:
    """open, ``op(fd)``, close: each step's outcome (errno name or None)."""
    try:
        fd = os.open(path, flags)
    except OSError as e:
        return {"open": errno.errorcode[e.errno], "op": "skipped", "close": "skipped"}
    try:
        res = outcome(lambda: op(fd))
    finally:
        closed = outcome(lambda: os.close(fd))
    return {"open": None, "op": res, "close": closed}


def logged(env: MountEnv, store: str, path: str, err: int) -> list[dict]:
    """``errors.log`` entries for ``store``/``path`` with errno ``err``."""
    name = errno.errorcode[err]
    return [e for e in errors_log(env.root)
            if e["store"] == store and e["path"] == path and e["errno"] == name]


def shell_refused(cmd: str, cwd: Path, err: int) -> str:
    """Run ``cmd``; return '' when it failed with the strerror of ``err`` on stderr, else a
    description of what happened (so assertions show it)."""
    r = sh(cmd, cwd, check=False)
    if r.returncode != 0 and os.strerror(err) in r.stderr:
        return ""
    return f"{cmd!r}: exit {r.returncode}, stderr {r.stderr!r}"


def sh_quote_bytes(raw: bytes) -> str:
    """``raw`` as a bash ``$'...'`` word, every byte escaped."""
    return "$'" + "".join(f"\\x{b:02x}" for b in raw) + "'"


# ====================================================================== EFBIG
def test_efbig_at_the_write_or_truncate_that_crosses_the_limit(env):
    d, pre = fresh_dir(env, "small")
    f = d / "a.md"
    assert write_file(f, b"hello\n") == OK
    rec0 = env.find("small", f"{pre}/a.md")
    wr, ap = os.O_WRONLY, os.O_WRONLY | os.O_APPEND
    got = {
        "pwrite 100 bytes at 0": fd_op(f, wr, lambda fd: os.pwrite(fd, b"y" * 100, 0)),
        "append to 65 bytes": fd_op(f, ap, lambda fd: os.write(fd, b"y" * (SMALL_LIMIT + 1 - 6))),
        "pwrite 1 byte at offset 64": fd_op(f, wr, lambda fd: os.pwrite(fd, b"z", SMALL_LIMIT)),
        "ftruncate to 65": fd_op(f, wr, lambda fd: os.ftruncate(fd, SMALL_LIMIT + 1)),
        "truncate(2) to 1 MiB": outcome(lambda: os.truncate(f, 1 << 20)),
    }
    refused = {"open": None, "op": "EFBIG", "close": None}
    assert got == {"pwrite 100 bytes at 0": refused, "append to 65 bytes": refused,
                   "pwrite 1 byte at offset 64": refused, "ftruncate to 65": refused,
                   "truncate(2) to 1 MiB": "EFBIG"}
    # shell: appending crosses the limit; the record is not truncated first
    assert shell_refused(f"/bin/echo {'x' * 70} >> a.md", d, errno.EFBIG) == ""
    assert shell_refused(f"echo {'x' * 70} >> a.md", d, errno.EFBIG) == ""  # bash builtin
    # exactly at the limit is fine
    exact = b"e" * (SMALL_LIMIT - 1) + b"\n"
    assert write_file(d / "exact.md", exact) == OK

    assert f.read_bytes() == b"hello\n"
    assert xattr(f, "state") == "clean"
    assert logged(env, "small", f"{pre}/a.md", errno.EFBIG)
    wait_drained(env.root)
    rec = env.find("small", f"{pre}/a.md")
    assert (rec.id, rec.version, rec.sha256) == (rec0.id, 1, rec0.sha256)
    assert env.contents("small", pre) == {"a.md": "hello\n", "exact.md": exact.decode()}
    assert len(env.versions("small", rec.id)) == 1

    env.remount()  # a fresh cache: what the mount shows now comes from the control plane
    f = env.store("small") / pre / "a.md"
    assert f.read_bytes() == b"hello\n"
    assert (env.store("small") / pre / "exact.md").read_bytes() == exact


def test_one_oversized_write_is_one_refusal_line(env):
    """A 2 MiB write(2) over the 1 MiB limit: the kernel splits it, the first chunks are
    taken and the writer (dd, Python) retries the rest, which is refused for the same
    reason: one refusal, one ``errors.log`` line and one ``refused`` log line per file."""
    d, pre = fresh_dir(env)
    before = env.sc.log.read_text().count('"msg": "refused"')
    # text, not /dev/zero: NUL bytes are refused (EILSEQ) at the first chunk already
    r = sh("dd if=<(yes a | head -c 2097152) iflag=fullblock of=dd.md bs=2M count=1", d,
           timeout=30, check=False)
    assert r.returncode != 0 and os.strerror(errno.EFBIG) in r.stderr, r.stderr
    got = write_file(d / "py.md", b"x" * (2 << 20))
    assert got == {"open": None, "write": "EFBIG", "close": "EFBIG"}  # close: held back
    # cp of a 2.7 MB file: small writes; the one refused reaches just past the limit, and
    # the reason says so (not "record would be <that> bytes": the file is larger)
    src = env.tmp / f"{pre}-big.txt"
    src.write_bytes(b"y" * 2_700_000)
    r = sh(f"cp {src} cp.md", d, timeout=30, check=False)
    assert r.returncode != 0 and os.strerror(errno.EFBIG) in r.stderr, r.stderr
    limit = 1 << 20
    for name in ("dd.md", "py.md", "cp.md"):
        lines = logged(env, "default", f"{pre}/{name}", errno.EFBIG)
        assert len(lines) == 1, (name, lines)
        m = re.fullmatch(r"a write reaching byte (\d+) exceeds the store's max_record_bytes (\d+)",
                         lines[0]["reason"])
        assert m and int(m[2]) == limit and limit < int(m[1]) <= (2 << 20), (name, lines)
        assert xattr(d / name, "state") == "rejected"
        assert xattr(d / name, "error") == lines[0]["reason"]
    assert env.sc.log.read_text().count('"msg": "refused"') - before == 3
    # a new write session is a new refusal, logged again
    assert write_file(d / "py.md", b"x" * (2 << 20))["write"] == "EFBIG"
    assert len(logged(env, "default", f"{pre}/py.md", errno.EFBIG)) == 2


def test_efbig_truncating_redirect_keeps_the_stored_record(env):
    """``echo big > f`` over a stored record: the write is refused with EFBIG, and the record
    the control plane holds is untouched (no empty version from the O_TRUNC at open)."""
    d, pre = fresh_dir(env, "small")
    assert write_file(d / "b.md", b"hello\n") == OK
    rec0 = env.find("small", f"{pre}/b.md")
    assert shell_refused(f"/bin/echo {'x' * 100} > b.md", d, errno.EFBIG) == ""
    flags = os.O_WRONLY | os.O_TRUNC
    assert write_file(d / "b.md", b"y" * 100, flags) == {"open": None, "write": "EFBIG", "close": None}
    wait_drained(env.root)
    rec = env.find("small", f"{pre}/b.md")
    assert env.contents("small", pre) == {"b.md": "hello\n"}, \
        "a write refused with EFBIG replaced the stored record"
    assert (rec.id, rec.version) == (rec0.id, 1)


# ====================================================================== ENOSPC
def test_enospc_when_the_store_holds_max_records(env):
    d, pre = fresh_dir(env, "fewrec")
    for i in (1, 2, 3):
        assert write_file(d / f"r{i}.md", f"record {i}\n".encode()) == OK
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    got = {"create r4": write_file(d / "r4.md", b"four\n", flags)["open"],
           "shell >": shell_refused("echo five > r5.md", d, errno.ENOSPC),
           "shell touch": shell_refused("touch r6.md", d, errno.ENOSPC),
           "rename (no new record)": outcome(lambda: os.rename(d / "r1.md", d / "r1b.md")),
           "mkdir (directories are not records)": outcome(lambda: os.mkdir(d / "sub"))}
    assert got == {"create r4": "ENOSPC", "shell >": "", "shell touch": "",
                   "rename (no new record)": None, "mkdir (directories are not records)": None}
    assert sorted(os.listdir(d)) == ["r1b.md", "r2.md", "r3.md", "sub"]
    assert logged(env, "fewrec", f"{pre}/r4.md", errno.ENOSPC)
    wait_drained(env.root)
    assert env.contents("fewrec", pre) == {"r1b.md": "record 1\n", "r2.md": "record 2\n",
                                           "r3.md": "record 3\n"}
    # room again after a delete
    os.unlink(d / "r2.md")
    assert write_file(d / "r4.md", b"four\n", flags) == OK
    wait_drained(env.root)
    assert env.contents("fewrec", pre) == {"r1b.md": "record 1\n", "r3.md": "record 3\n",
                                           "r4.md": "four\n"}


def test_enospc_at_the_write_that_passes_max_store_bytes(env):
    d, pre = fresh_dir(env, "fewbytes")
    assert write_file(d / "one.md", b"a" * 600) == OK
    got = {
        "new file, 600 more bytes": write_file(d / "two.md", b"b" * 600),
        "append 500 bytes": write_file(d / "one.md", b"c" * 500, os.O_WRONLY | os.O_APPEND),
    }
    refused = {"open": None, "write": "ENOSPC", "close": None}
    shell = shell_refused(f"/bin/echo {'d' * 600} > three.md", d, errno.ENOSPC)
    wait_drained(env.root)
    stored = env.contents("fewbytes", pre)
    # nothing stored before is lost, nothing refused was stored
    assert stored.get("one.md") == "a" * 600
    assert not any(c and c[0] in "bcd" for c in stored.values()), stored
    assert shell == ""
    assert any(e["errno"] == "ENOSPC" for e in errors_log(env.root) if e["store"] == "fewbytes")
    # docs/SEMANTICS.md: "store over max_store_bytes → ENOSPC at write/create"
    assert got == {"new file, 600 more bytes": refused, "append 500 bytes": refused}


# ====================================================================== refused at close
def _pem_private_key() -> bytes:
    """A PEM private-key block, built at run time (random body)."""
    dashes, label = "-" * 5, "RSA " + "PRIVATE" + " KEY"
    body = base64.b64encode(secrets.token_bytes(600)).decode()
    lines = [body[i:i + 64] for i in range(0, len(body), 64)]
    return "\n".join([f"{dashes}BEGIN {label}{dashes}", *lines, f"{dashes}END {label}{dashes}", ""]).encode()


def _aws_access_key() -> bytes:
    """An AWS access key id and secret key pair in a config-file shape, built at run time."""
    key_id = "AK" + "IA" + "".join(secrets.choice(string.ascii_uppercase + "234567") for _ in range(16))
    secret = base64.b64encode(secrets.token_bytes(30)).decode()
    return f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n".encode()


CONTENT_REFUSALS = {
    # kind: (errno, refused content factory, fixed content, type the fixed record gets,
    #        where it is refused: "write" (the write(2) that makes the content refusable:
    #        not applied, the write session held back) or "close" (only the whole file shows it))
    "not UTF-8": (errno.EILSEQ, lambda: b"notes: caf\xe9 \xff\xfe\n", b"notes: caf\xc3\xa9\n", "project",
                  "write"),
    "NUL byte": (errno.EILSEQ, lambda: b"line one\n\x00line two\n", b"line one\nline two\n", "project",
                 "write"),
    "frontmatter type": (errno.EINVAL, lambda: b"---\ntype: bogus\n---\nbody\n",
                         b"---\ntype: user\n---\nbody\n", "user", "write"),
    "frontmatter metadata.type": (errno.EINVAL, lambda: b"---\nmetadata:\n  type: diary\n---\nbody\n",
                                  b"---\nmetadata:\n  type: reference\n---\nbody\n", "reference", "write"),
    "secret: PEM private key": (errno.EPERM, lambda: b"deploy key:\n" + _pem_private_key(),
                                b"deploy key: in the vault\n", "project", "write"),
    "secret: AWS access key": (errno.EPERM, _aws_access_key, b"aws: use the instance role\n", "project",
                               "write"),
    # a UTF-8 sequence cut at the end of the file waits for a next write, which never comes
    "cut UTF-8 at the end": (errno.EILSEQ, lambda: "notes: café €".encode()[:-1],
                             "notes: café €\n".encode(), "project", "close"),
}


@pytest.mark.parametrize("kind", list(CONTENT_REFUSALS))
def test_refused_content_is_reported_and_nothing_stored_then_fix_in_place(env, kind, tmp_path):
    err, make_bad, fixed, fixed_type, where = CONTENT_REFUSALS[kind]
    bad = make_bad()
    d, pre = fresh_dir(env)
    ename = errno.errorcode[err]
    assert write_file(d / "old.md", b"v1\n") == OK
    old0 = env.find("default", f"{pre}/old.md")

    got = {"new file": write_file(d / "new.md", bad),
           "over a stored record": write_file(d / "old.md", bad)}
    if where == "write":
        refused = {"open": None, "write": ename, "close": None}
        # the refused write is not applied; what the session left (the truncation at open)
        # is held back: the stored record is untouched
        left = b""
    else:
        refused = {"open": None, "write": None, "close": ename}
        left = bad  # kept locally to fix in place
    src = tmp_path / "refused.txt"
    src.write_bytes(bad)
    shell = {"cp": shell_refused(f"cp {src} cp.md", d, err),
             "cat >": shell_refused(f"cat {src} > cat.md", d, err),
             "tee": shell_refused(f"tee tee.md < {src} > /dev/null", d, err)}
    assert got == {"new file": refused, "over a stored record": refused}
    assert shell == {"cp": "", "cat >": "", "tee": ""}

    names = ("new.md", "old.md", "cp.md", "cat.md", "tee.md")
    for n in names:  # the local file is marked rejected with a reason
        p = d / n
        assert (n, p.read_bytes()) == (n, left)
        assert (n, xattr(p, "state")) == (n, "rejected")
        assert xattr(p, "error"), f"{n}: user.memfuse.error is empty"
        entries = logged(env, "default", f"{pre}/{n}", err)
        assert entries and entries[-1]["reason"], f"{n}: no {ename} line in errors.log"
    if err == errno.EPERM:  # the secret itself is never echoed back into logs or xattrs
        material = [w for w in bad.decode().split() if len(w) >= 16 and "_" not in w
                    and not w.startswith("-")]
        assert material
        log_text = errors_log_text(env.root)
        reasons = log_text + "".join(xattr(d / n, "error") or "" for n in names)
        assert [w for w in material if w in reasons] == []

    wait_drained(env.root)
    assert env.contents("default", pre) == {"old.md": "v1\n"}
    assert len(env.versions("default", old0.id)) == 1

    # fix in place: rewrite valid content; it commits and the file is clean again
    fixes = {n: write_file(d / n, fixed) for n in names}
    assert fixes == {n: OK for n in names}
    for n in names:
        assert (n, xattr(d / n, "state"), xattr(d / n, "error")) == (n, "clean", "")
    wait_drained(env.root)
    assert env.contents("default", pre) == {n: fixed.decode() for n in names}
    old = env.find("default", f"{pre}/old.md")
    assert (old.id, old.version, old.type) == (old0.id, 2, fixed_type)


def test_appends_to_a_journal_are_refused_at_write_and_a_rejected_journal_stays_refused(env):
    """The journal case: a line holding a secret appended with ``>>`` fails at its write(2)
    (the shell's exit status and stderr say so) and is not applied: the journal stays clean
    and later appends commit. A line cut inside a UTF-8 character (only the whole file shows
    it: refused at close) leaves the journal rejected; every later append is refused at its
    write, each with its own ``errors.log`` line, never a silent success; the agent's fix
    (rewrite it) saves it."""
    d, pre = fresh_dir(env)
    j = d / "J.jsonl"
    secret_line = b'{"text":"' + _aws_access_key().replace(b"\n", b" ") + b'"}\n'
    assert write_file(j, b'{"text":"first"}\n') == OK
    st0 = status(env.root)
    ap = os.O_WRONLY | os.O_APPEND
    assert write_file(j, secret_line, ap) == {"open": None, "write": "EPERM", "close": None}
    assert sh('echo \'{"text":"clean"}\' >> J.jsonl; echo $?', d, timeout=30).stdout == "0\n"
    src = env.tmp / f"{pre}-secret.txt"
    src.write_bytes(secret_line)
    assert shell_refused(f"cat {src} >> J.jsonl", d, errno.EPERM) == ""
    assert xattr(j, "state") == "clean"
    assert j.read_bytes() == b'{"text":"first"}\n{"text":"clean"}\n'
    assert write_file(j, b'{"text":"caf\xc3', ap) == {"open": None, "write": None, "close": "EILSEQ"}
    assert xattr(j, "state") == "rejected"
    assert write_file(j, b'{"text":"clean 2"}\n', ap) == {"open": None, "write": "EILSEQ", "close": None}
    assert shell_refused('echo \'{"text":"clean 3"}\' >> J.jsonl', d, errno.EILSEQ) == ""
    assert len(logged(env, "default", f"{pre}/J.jsonl", errno.EPERM)) == 2
    assert len(logged(env, "default", f"{pre}/J.jsonl", errno.EILSEQ)) == 3
    # status counts them where they were decided: here, before the outbox (not in the
    # outbox's refused, which counts what the control plane refused when sent)
    st = status(env.root)
    assert st["refusals_since_start"] - st0["refusals_since_start"] == 5
    assert st["outbox"]["refused"] == st0["outbox"]["refused"]
    human = sh(f"{MEMFUSE} status {env.root}", env.tmp, timeout=30).stdout
    assert f"refused by control plane: {st['outbox']['refused']}" in " ".join(human.split())
    assert "refusals since start (sidecar + control plane):" in human
    assert "errors.log lines:" in human
    fixed = b'{"text":"first"}\n{"text":"clean"}\n{"text":"clean 2"}\n'
    assert write_file(j, fixed) == OK
    wait_drained(env.root)
    assert env.contents("default", pre) == {"J.jsonl": fixed.decode()}


def test_invisible_padding_does_not_hide_a_secret_from_the_write_check(env):
    """Attack21 F3: ``printf 'note: ghp_%s' "$ZWSP_x1000" >> f`` then ``printf '%s\\n' "$K" >>
    f``: the second write completes a token the rules read whole (they drop zero-width
    spaces), 3,000 bytes of the file past its start: it fails with EPERM, as without the
    padding, and is not applied. The same with no-break spaces (a gap a view drops between
    token characters) written with ``os.write``."""
    d, pre = fresh_dir(env)
    key = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(36))
    for name, pad in (("zw.md", "\u200b"), ("nb.md", "\u00a0")):
        head = ("note: gh" + "p_" + pad * 1000).encode()
        vars_ = {"PAD": pad * 1000, "KEY": key}
        # bash's printf builtin: the exit status is write(2)'s (close's result is ignored)
        assert sh(f"printf 'note: gh''p_%s' \"$PAD\" >> {name}; echo $?", d, timeout=30,
                  env=vars_).stdout == "0\n"
        r = sh(f"printf '%s\\n' \"$KEY\" >> {name}; echo $?", d, timeout=30, env=vars_)
        assert r.stdout == "1\n" and os.strerror(errno.EPERM) in r.stderr, (name, r)
        assert (d / name).read_bytes() == head
        assert xattr(d / name, "state") == "clean"
        assert write_file(d / name, key.encode(), os.O_WRONLY | os.O_APPEND) == {
            "open": None, "write": "EPERM", "close": None}
        assert len(logged(env, "default", f"{pre}/{name}", errno.EPERM)) == 2
    wait_drained(env.root)
    stored = env.contents("default", pre)
    assert stored == {"zw.md": "note: gh" + "p_" + "\u200b" * 1000, "nb.md": "note: gh" + "p_" + "\u00a0" * 1000}


# ====================================================================== detached / not attached
def test_detached_store(env):
    root = env.root
    g = env.store("gone")
    d, pre = fresh_dir(env, "gone")
    assert write_file(d / "keep.md", b"keep me\n") == OK
    fd = os.open(d / "keep.md", os.O_RDWR)
    try:
        env.cp.call("detach", env.ws, "gone")
        wait_until(lambda: not os.path.lexists(g), 10, "the store directory to go away")
        got = {
            "listed at the root": "gone" in os.listdir(root),
            "stat the store": outcome(lambda: os.stat(g)),
            "stat a file": outcome(lambda: os.stat(d / "keep.md")),
            "create a file": write_file(d / "new.md", b"x\n")["open"],
            "mkdir the store again": outcome(lambda: os.mkdir(g)),
            "write an open handle": outcome(lambda: os.write(fd, b"late\n")),
            "read an open handle": outcome(lambda: os.pread(fd, 10, 0)),
        }
    finally:
        closed = outcome(lambda: os.close(fd))
    shell = {"ls": shell_refused("ls gone", root, errno.ENOENT),
             "echo >": shell_refused("echo x > gone/x.md", root, errno.ENOENT)}
    assert got == {"listed at the root": False, "stat the store": "ENOENT",
                   "stat a file": "ENOENT", "create a file": "ENOENT",
                   "mkdir the store again": "EACCES", "write an open handle": "ESTALE",
                   "read an open handle": "ESTALE"}
    assert closed is None
    assert shell == {"ls": "", "echo >": ""}
    # nothing stored is lost: the control plane still has it, and it comes back on re-attach
    assert env.contents("gone", pre) == {"keep.md": "keep me\n"}
    env.cp.call("attach", env.ws, "gone")
    wait_until(lambda: os.path.isdir(g), 10, "the store directory to come back")
    wait_until(lambda: (d / "keep.md").exists(), 10, "the store's files to come back")
    assert (d / "keep.md").read_bytes() == b"keep me\n"
    assert write_file(d / "after.md", b"after\n") == OK
    wait_drained(env.root)
    assert env.contents("gone", pre) == {"keep.md": "keep me\n", "after.md": "after\n"}


def test_store_not_attached(env):
    root = env.root
    other = root / "elsewhere"
    got = {"stat": outcome(lambda: os.stat(other)),
           "create inside": write_file(other / "x.md", b"x\n")["open"],
           "mkdir at the root": outcome(lambda: os.mkdir(other)),
           "create at the root": write_file(root / "elsewhere.md", b"x\n")["open"]}
    assert got == {"stat": "ENOENT", "create inside": "ENOENT", "mkdir at the root": "EACCES",
                   "create at the root": "EACCES"}
    assert "elsewhere" not in os.listdir(root)
    assert shell_refused("ls elsewhere", root, errno.ENOENT) == ""
    assert shell_refused("mkdir elsewhere", root, errno.EACCES) == ""
    assert env.records("elsewhere") == {}


# ====================================================================== names
BAD_NAMES = {
    "C0 control U+0001": ("a\x01b.md".encode(), errno.EINVAL),
    "newline": (b"a\nb.md", errno.EINVAL),
    "tab": (b"a\tb.md", errno.EINVAL),
    "DEL U+007F": (b"a\x7fb.md", errno.EINVAL),
    "C1 control U+0085": ("a\u0085b.md".encode(), errno.EINVAL),
    "zero width space U+200B": ("a\u200bb.md".encode(), errno.EINVAL),
    "byte order mark U+FEFF": ("\ufeffa.md".encode(), errno.EINVAL),
    "RTL override U+202E": ("a\u202edm.txt".encode(), errno.EINVAL),
    "line separator U+2028": ("a\u2028b.md".encode(), errno.EINVAL),
    "word joiner U+2060": ("a\u2060b.md".encode(), errno.EINVAL),
    "bidi isolate U+2066 (Trojan Source)": ("a\u2066b.md".encode(), errno.EINVAL),
    "soft hyphen U+00AD": ("soft\u00adhyphen.md".encode(), errno.EINVAL),
    # default-ignorable, not format characters: drawn as nothing (attack21)
    "Hangul filler U+3164": ("a\u3164b.md".encode(), errno.EINVAL),
    "Mongolian variation selector U+180B": ("a\u180bb.md".encode(), errno.EINVAL),
    "variation selector U+FE0F": ("a\ufe0fb.md".encode(), errno.EINVAL),
    "not UTF-8": (b"caf\xe9.md", errno.EINVAL),
    "256 bytes": (b"x" * 256, errno.ENAMETOOLONG),
    "256 bytes of 2-byte characters": ("é".encode() * 128, errno.ENAMETOOLONG),
}


@pytest.mark.parametrize("label", list(BAD_NAMES))
def test_bad_name_refused_for_create_mkdir_rename(env, label):
    raw, err = BAD_NAMES[label]
    ename = errno.errorcode[err]
    d, pre = fresh_dir(env)
    db = bytes(d)
    assert write_file(d / "src.md", b"source\n") == OK
    (d / "srcdir").mkdir()
    assert write_file(d / "srcdir" / "in.md", b"inside\n") == OK
    (d / "sub").mkdir()
    bad = db + b"/" + raw
    got = {
        "create": write_file(bad, b"x\n", os.O_WRONLY | os.O_CREAT | os.O_EXCL)["open"],
        "mkdir": outcome(lambda: os.mkdir(bad)),
        "mkdir in a subdirectory": outcome(lambda: os.mkdir(db + b"/sub/" + raw)),
        "rename a file": outcome(lambda: os.rename(db + b"/src.md", bad)),
        "rename a file into a subdirectory": outcome(lambda: os.rename(db + b"/src.md", db + b"/sub/" + raw)),
        "rename a directory": outcome(lambda: os.rename(db + b"/srcdir", bad)),
    }
    q = sh_quote_bytes(raw)
    shell = {"touch": shell_refused(f"touch {q}", d, err),
             "mkdir": shell_refused(f"mkdir {q}", d, err),
             "mv": "" if sh(f"mv src.md {q}", d, check=False).returncode != 0 else "mv succeeded"}
    assert got == dict.fromkeys(got, ename)
    assert shell == {"touch": "", "mkdir": "", "mv": ""}
    assert sorted(os.listdir(d)) == ["src.md", "srcdir", "sub"]
    assert os.listdir(d / "sub") == []
    assert any(e["errno"] == ename and e["path"].startswith(pre + "/") for e in errors_log(env.root))
    wait_drained(env.root)
    assert env.contents("default", pre) == {"src.md": "source\n", "srcdir/in.md": "inside\n"}


def test_names_at_the_limits_are_accepted(env):
    """The edges of the name rules (docs/SEMANTICS.md) that are valid: 255-byte names, other
    scripts and emoji, case-distinct names kept byte-exact; a decomposed (NFD) name given is
    refused EINVAL, its NFC twin is not."""
    d, pre = fresh_dir(env)
    assert write_file(d / "cafe\u0301.md", b"x")["open"] == "EINVAL"
    good = ["x" * 255, "é" * 127 + "x", "caf\u00e9.md",
            "Notes.md", "notes.md", "emoji \U0001F9E0.md", "a b.md"]
    got = {n: write_file(d / n, n.encode()) for n in good}
    assert got == {n: OK for n in good}
    assert outcome(lambda: os.mkdir(d / ("y" * 255))) is None
    assert sorted(os.listdir(bytes(d))) == sorted([n.encode() for n in good] + [b"y" * 255])
    wait_drained(env.root)
    assert env.contents("default", pre) == {n: n for n in good}


def _chain(base: Path, comps: list[str]) -> Path:
    p = base
    for c in comps:
        p = p / c
        os.mkdir(p)
    return p


def test_path_longer_than_1024_bytes_refused(env):
    d, pre = fresh_dir(env)
    plen = len(pre.encode())
    # four 200-byte directories: pre/A…/B…/C…/D…  ->  plen + 4 * 201 bytes
    deep = _chain(d, [c * 200 for c in "ABCD"])
    used = plen + 4 * 201
    room = 1024 - used - 1  # bytes left for one more component at the 1,024-byte limit
    assert 0 < room <= 255
    assert write_file(d / "src.md", b"src\n") == OK
    fit, over = "f" * room, "g" * (room + 1)
    got = {
        "create at 1,025 bytes": write_file(deep / over, b"x\n")["open"],
        "mkdir at 1,025 bytes": outcome(lambda: os.mkdir(deep / over)),
        "rename a file to 1,025 bytes": outcome(lambda: os.rename(d / "src.md", deep / over)),
    }
    shell = {"touch": shell_refused(f"touch {over}", deep, errno.ENAMETOOLONG),
             "mkdir": shell_refused(f"mkdir {over}", deep, errno.ENAMETOOLONG)}
    assert got == dict.fromkeys(got, "ENAMETOOLONG")
    assert shell == {"touch": "", "mkdir": ""}
    assert os.listdir(deep) == []
    # exactly 1,024 bytes is fine
    assert write_file(deep / fit, b"fits\n") == OK
    assert len(f"{pre}/{'/'.join(c * 200 for c in 'ABCD')}/{fit}".encode()) == 1024

    # renaming a directory must not push a record below it past 1,024 bytes
    r = _chain(d, ["r"] + [c * 200 for c in "PQRS"])
    assert write_file(r / "leaf.md", b"leaf\n") == OK
    leaf_len = len(f"{pre}/r/{'/'.join(c * 200 for c in 'PQRS')}/leaf.md".encode())
    longer = "s" * (1 + 1024 - leaf_len + 1)  # replaces "r": the leaf's path becomes 1,025 bytes
    assert len(longer) <= 255
    got2 = {"rename a directory so a record below passes 1,024 bytes":
            outcome(lambda: os.rename(d / "r", d / longer))}
    assert got2 == dict.fromkeys(got2, "ENAMETOOLONG")
    wait_drained(env.root)
    leaf_key = f"r/{'/'.join(c * 200 for c in 'PQRS')}/leaf.md"
    fit_key = f"{'/'.join(c * 200 for c in 'ABCD')}/{fit}"
    assert env.contents("default", pre) == {"src.md": "src\n", fit_key: "fits\n", leaf_key: "leaf\n"}
    assert (d / leaf_key).read_bytes() == b"leaf\n"


def test_more_than_32_components_refused(env):
    d, pre = fresh_dir(env)  # component 1
    deep = _chain(d, ["x"] * 31)  # components 2..32
    assert write_file(d / "src.md", b"src\n") == OK
    got = {
        "create as component 33": write_file(deep / "f.md", b"x\n")["open"],
        "mkdir as component 33": outcome(lambda: os.mkdir(deep / "y")),
        "rename a file to component 33": outcome(lambda: os.rename(d / "src.md", deep / "f.md")),
    }
    shell = {"touch": shell_refused("touch f.md", deep, errno.ENAMETOOLONG),
             "mkdir": shell_refused("mkdir y", deep, errno.ENAMETOOLONG)}
    assert got == dict.fromkeys(got, "ENAMETOOLONG")
    assert shell == {"touch": "", "mkdir": ""}
    assert os.listdir(deep) == []
    # 32 components hold a record
    assert write_file(deep.parent / "ok.md", b"ok\n") == OK

    # moving a directory one level down must not push a record below it past 32 components
    y = _chain(d, ["y"] + ["x"] * 29)  # pre/y/x…x = 31 components, the file is the 32nd
    assert write_file(y / "leaf.md", b"leaf\n") == OK
    (d / "z").mkdir()
    got2 = {"rename a directory so a record below has 33 components":
            outcome(lambda: os.rename(d / "y", d / "z" / "y"))}
    assert got2 == dict.fromkeys(got2, "ENAMETOOLONG")
    wait_drained(env.root)
    ok_key = "/".join(["x"] * 30) + "/ok.md"
    leaf_key = "y/" + "/".join(["x"] * 29) + "/leaf.md"
    assert env.contents("default", pre) == {"src.md": "src\n", ok_key: "ok\n", leaf_key: "leaf\n"}
    assert (d / leaf_key).read_bytes() == b"leaf\n"


def test_a_write_refused_at_write2_leaves_no_stale_buffer_behind(tmp_path):
    """Seen once: ``invariant broken: store default count/used (5, 55) != recount`` after an
    append was refused with ``ENOSPC`` under a lowered quota. The refused write had read the
    file into a write buffer, and the session, having changed nothing, was never committed:
    the buffer stayed on a clean file, and a later change from elsewhere set the file's size
    and content underneath it. The file then read the old bytes and the store's usage no
    longer added up. A refused write leaves the file as it was, and a clean state applied
    from the control plane replaces any buffer (``RemoteApply._set_clean``)."""
    with serve_and_mount(tmp_path, stores=("default",)) as (cp, sc):
        m = sc.mountpoint / "default"
        for i in range(5):
            (m / f"f{i}.md").write_text("0123456789\n")  # 5 files, 55 bytes
        wait_until(lambda: len(live_records(cp)) == 5, timeout=30, what="5 records committed")
        cp.call("update_store", "default", max_store_bytes=58)

        def quota() -> int:
            return {s["slug"]: s for s in status(sc.mountpoint)["stores"]}["default"]["max_store_bytes"]

        wait_until(lambda: quota() == 58, timeout=30, what="the sidecar told the new quota")
        r = subprocess.run(["bash", "-c", "echo more-bytes >> f0.md"], cwd=m, timeout=20,
                           capture_output=True, text=True)
        assert r.returncode != 0 and "No space left on device" in r.stderr, r
        assert (m / "f0.md").read_text() == "0123456789\n"
        # another writer shortens the file: the feed brings it here
        rid = live_records(cp)["f0.md"].id
        cp.call("update_record", "default", rid, "short\n")
        wait_until(lambda: (m / "f0.md").read_text() == "short\n", timeout=30,
                   what="the remote change shown")
        sh("echo ok >> f1.md", m)  # 50 + 3 bytes: within the quota
        assert (m / "f1.md").read_text() == "0123456789\nok\n"
        wait_drained(sc.mountpoint)
        bad = [line for line in sc.log.read_text().splitlines() if "invariant broken" in line]
        assert bad == [], bad
        st = {s["slug"]: s for s in status(sc.mountpoint)["stores"]}["default"]
        assert (st["records"], st["bytes"]) == (5, 6 + 11 * 3 + 14), st
