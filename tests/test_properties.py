"""Property-based tests of the real mount (Hypothesis), against a local directory and the API.

- Valid names and contents round-trip byte-exact: through the mount, into the control plane
  (path and content, read with the API), and back out of a new sidecar with a fresh cache.
  Invalid names get the errno docs/SEMANTICS.md ("Names") gives them (oracle: ``mountcheck.name_errnos``,
  written independently of ``memfuse/names.py``).
- ``MountVsLocal``: a ``RuleBasedStateMachine`` runs random create / write at offsets /
  append / O_TRUNC / ftruncate / truncate(2) / rename (over files and directories) / unlink /
  mkdir / rmdir on the mount and on a local temporary directory in lockstep, and compares the
  outcome of every call (errno names), then every file's bytes and every listing. The one
  modelled difference: the control plane takes only UTF-8 text without NUL, so closing a
  written file whose content is not (a hole from a write past the end, a multi-byte
  character split by a write at an offset) gives ``EILSEQ`` on the mount and leaves the file
  ``rejected`` with its content. At the end of each run the invalid files are fixed in place,
  the outbox drained (``.memfuse/status.json``), and the control plane must hold exactly the
  local directory's files (local-only editor names excepted; empty directories are local).
- Plain tests pin the minimal sequences of the bugs these properties found.

One module-scoped mount, a unique directory per example. CI: derandomized, bounded (see
``mountcheck.hyp_settings``); long runs: ``MEMFUSE_HYPOTHESIS_EXAMPLES`` /
``MEMFUSE_HYPOTHESIS_STEPS``.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import tempfile
import time
import unicodedata
import uuid
from pathlib import Path

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from memfuse.models import sha256_hex
from mountcheck import (FORBIDDEN, IGNORABLE, MAX_COMPONENT, MAX_COMPONENTS, MAX_PATH, MountEnv,
                        budget_seconds, hyp_settings, is_local_only, name_errnos, outcome,
                        status, utf8_text_ok, wait_drained, wait_until, write_file,
                        xattr)

pytestmark = pytest.mark.mount

OK = {"open": None, "write": None, "close": None}
EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = MountEnv(tmp_path_factory.mktemp("props"), stores={"default": {}})
    try:
        e.start()
        yield e
    finally:
        e.stop()


def fresh_dir(env: MountEnv, group: str) -> tuple[Path, str]:
    pre = f"{group}/{uuid.uuid4().hex[:8]}"
    p = env.store() / pre
    p.mkdir(parents=True)
    return p, pre


# ====================================================================== strategies
def _strip_forbidden(s: str) -> str:
    return "".join(c for c in s if ord(c) not in FORBIDDEN and ord(c) not in IGNORABLE and c != "/")


def _fit(s: str, limit: int = MAX_COMPONENT) -> str:
    """``s`` cut at a character boundary to at most ``limit`` UTF-8 bytes."""
    while len(s.encode()) > limit:
        s = s[:-1]
    return s


_name_chars = st.characters(exclude_categories=("Cs",), exclude_characters="/\x00")
valid_components = st.one_of(
    st.text(_name_chars, min_size=1, max_size=24),
    st.text(_name_chars, min_size=60, max_size=255),
    st.sampled_from(["x" * 255, "é" * 127 + "x", "用" * 85, "Notes.md", "notes.md",
                     "cafe\u0301.md", "caf\u00e9.md", "soft-hyphen", " lead", "trail ",
                     "-dash", "a:b", "a\\b", "*?[]", "...", ".hidden", "\U0001F9E0"]),
).map(_strip_forbidden).map(lambda s: unicodedata.normalize("NFC", s)).map(_fit).filter(
    # a name given is in NFC (SEMANTICS "Names"; the refusal of others: test_names_unicode)
    lambda s: s not in ("", ".", "..") and not is_local_only(s) and unicodedata.is_normalized("NFC", s))


def _paths(prefix_bytes: int):
    """Lists of valid components whose joined path, under a prefix of ``prefix_bytes``
    bytes (and 2 prefix components), stays within the path limits of docs/SEMANTICS.md."""
    def fit(parts: list[str]) -> list[str]:
        parts = parts[: MAX_COMPONENTS - 2]
        while len("/".join(parts).encode()) + prefix_bytes + 1 > MAX_PATH:
            parts = parts[1:]
        return parts
    return st.lists(valid_components, min_size=1, max_size=5).map(fit)


def _content(text: str) -> str:
    return "x" + text if text.startswith("---") else text  # no frontmatter: type rules aside


contents = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=400),
    st.builds(lambda t, n: t * n, st.text(min_size=1, max_size=50), st.integers(100, 4000)),
).map(_content).filter(lambda t: "\x00" not in t)

_forbidden_chars = st.sampled_from(sorted(c for c in FORBIDDEN - {0, 0x2F}
                                          if not 0xD800 <= c <= 0xDFFF)).map(chr)  # no lone surrogate
_bad_utf8 = st.sampled_from([b"\xff", b"\xfe", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80",
                             b"\xe2\x82", b"\xf4\x90\x80\x80"])


@st.composite
def invalid_names(draw) -> bytes:
    kind = draw(st.sampled_from(["forbidden char", "too long", "not UTF-8"]))
    base = draw(st.text(_name_chars.filter(lambda c: ord(c) not in FORBIDDEN), min_size=0, max_size=20))
    if kind == "forbidden char":
        i = draw(st.integers(0, len(base)))
        raw = (base[:i] + draw(_forbidden_chars) + base[i:]).encode()
    elif kind == "too long":  # 256 … ~560 bytes of whole characters
        unit = draw(st.sampled_from(["x", "é", "用", "\U0001F9E0", "ab"]))
        n = draw(st.integers(MAX_COMPONENT + 1, MAX_COMPONENT + 300))
        raw = (unit * (n // len(unit.encode()) + 1)).encode()
    else:
        b = base.encode()
        i = draw(st.integers(0, len(b)))
        raw = b[:i] + draw(_bad_utf8) + b[i:]
    assert b"/" not in raw and b"\0" not in raw
    return raw


# ====================================================================== control files
def test_control_file_reads_are_consistent(env):
    """One open of ``.memfuse/status.json`` shows one content: reading to EOF in several
    read calls while the sidecar's state changes must give one valid JSON document.

    Found while polling the outbox depth: content regenerated on every read request made a
    second read at offset N return bytes N… of a *newer*, longer document (``read_text``
    then saw invalid JSON). Here the inode count gains a digit between the reads."""
    d, _ = fresh_dir(env, "cf")
    n = status(env.root)["inodes"]
    grow = 10 ** len(str(n)) - n + 1
    fd = os.open(env.root / ".memfuse" / "status.json", os.O_RDONLY)
    try:
        first = os.read(fd, 1 << 20)
        json.loads(first)
        for i in range(grow):
            os.mkdir(d / f"d{i}")
        rest = os.read(fd, 1 << 20)
    finally:
        os.close(fd)
    assert status(env.root)["inodes"] >= n + grow
    assert rest == b"", f"EOF expected after the whole document; got {rest!r}"


# ====================================================================== round trip
@pytest.mark.timeout(budget_seconds(240))
def test_valid_names_and_contents_round_trip(env):
    written: dict[str, bytes] = {}
    group = "rt"
    prefix_bytes = len(f"{group}/{uuid.uuid4().hex[:8]}".encode())

    @hyp_settings(40)
    @given(parts=_paths(prefix_bytes), text=contents)
    def prop(parts: list[str], text: str) -> None:
        d, pre = fresh_dir(env, group)
        rel = "/".join(parts)
        data = text.encode()
        if len(parts) > 1:
            os.makedirs(d / "/".join(parts[:-1]))
        f = d / rel
        assert write_file(f, data, EXCL) == OK
        assert f.read_bytes() == data
        assert parts[-1].encode() in os.listdir(bytes(f.parent))
        if data:
            assert xattr(f, "state") == "clean"  # close waited for the commit
        else:  # nothing written through the descriptor: committed at release, without waiting
            wait_until(lambda: xattr(f, "state") == "clean", 10, "the empty file to commit")
        rec = env.find("default", f"{pre}/{rel}")
        assert rec is not None, f"no record at {pre}/{rel!r}: {sorted(env.contents('default', pre))!r}"
        full = env.cp.call("get_record", "default", rec.id)
        assert (full.path, full.content, full.sha256, full.size) == (
            f"{pre}/{rel}", text, sha256_hex(data), len(data))
        assert xattr(f, "sha256") == full.sha256 and xattr(f, "id") == full.id
        written[f"{pre}/{rel}"] = data

    prop()
    assert written
    wait_drained(env.root)
    env.remount()  # a new sidecar process, a fresh cache directory
    store = env.store()
    back = {p: (store / p).read_bytes() for p in written}
    assert back == written
    assert {p: c.encode() for p, c in env.contents("default").items() if p.startswith(group + "/")} == written


@pytest.mark.timeout(budget_seconds(120))
def test_invalid_names_get_the_design_errno(env):
    d, pre = fresh_dir(env, "bad")
    db = bytes(d)
    assert write_file(d / "src.md", b"src\n") == OK
    (d / "dir").mkdir()

    @hyp_settings(60)
    @given(raw=invalid_names())
    def prop(raw: bytes) -> None:
        assert 0 not in name_errnos(raw), f"the strategy made a valid name: {raw!r}"
        allowed = {errno.errorcode[e] for e in name_errnos(raw)}
        note(f"name {raw!r}, allowed {allowed}")
        target = db + b"/" + raw
        got = {"create": write_file(target, b"x\n", EXCL)["open"],
               "mkdir": outcome(lambda: os.mkdir(target)),
               "rename file": outcome(lambda: os.rename(db + b"/src.md", target)),
               "rename dir": outcome(lambda: os.rename(db + b"/dir", target)),
               "create in subdir": write_file(db + b"/dir/" + raw, b"x\n", EXCL)["open"]}
        assert all(v in allowed for v in got.values()), got
        assert sorted(os.listdir(db)) == [b"dir", b"src.md"]

    prop()
    assert os.listdir(d / "dir") == []
    wait_drained(env.root)
    assert env.contents("default", pre) == {"src.md": "src\n"}


# ====================================================================== lockstep state machine
NAMES = ["a", "b", "é", "n~"]  # "n~" is a local-only name (docs/SEMANTICS.md)
# few names, shallow: operations collide often (rename over files and directories, …)
rel_paths = st.one_of(st.sampled_from(NAMES),
                      st.lists(st.sampled_from(NAMES), min_size=2, max_size=3).map("/".join))
datas = st.one_of(st.text(alphabet="xyz\né用", min_size=1, max_size=12).map(str.encode),
                  st.text(alphabet="ab\n", min_size=1, max_size=6).map(str.encode),
                  st.binary(min_size=1, max_size=6))  # mostly not UTF-8: refused at close
small = st.integers(0, 24)


def _tree(root: Path) -> dict[str, object]:
    """relpath → "dir" | file bytes, for everything below ``root``."""
    out: dict[str, object] = {}
    for dp, dns, fns in os.walk(root):
        for n in dns:
            out[os.path.relpath(os.path.join(dp, n), root)] = "dir"
        for n in fns:
            p = os.path.join(dp, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


def _differing(a: dict, b: dict) -> list[str]:
    """The keys whose values differ between two trees (absent on one side included), files
    of the mount only (what has xattrs)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and a.get(k, "") != "dir")


def _fd_op(path: Path, flags: int, op) -> dict[str, str | None]:
    try:
        fd = os.open(path, flags)
    except OSError as e:
        return {"open": errno.errorcode[e.errno], "write": "skipped", "close": "skipped"}
    try:
        res = outcome(lambda: op(fd))
    finally:
        closed = outcome(lambda: os.close(fd))
    return {"open": None, "write": res, "close": closed}


def _tracked(fn):
    """Mark the machine broken when a step raises, so teardown only cleans up; log the
    rule's name and drawn arguments as a new step (``MountVsLocal.steps``) before it runs."""
    @functools.wraps(fn)
    def wrapper(self, *a, **kw):
        if fn.__name__ != "same_tree":
            args = ", ".join(f"{k}={v!r}" for k, v in kw.items() if k != "pick")
            self.steps.append(f"{fn.__name__}({args})")
        try:
            return fn(self, *a, **kw)
        except BaseException:
            self.broken = True
            raise
    return wrapper


STEPS_SHOWN = 30  # the steps an assertion message of MountVsLocal carries


def make_machine(env: MountEnv, local_base: Path, runs: list[str]):
    class MountVsLocal(RuleBasedStateMachine):
        """The mount and a local directory, driven in lockstep (see module docstring)."""

        def __init__(self) -> None:
            super().__init__()
            self.broken = False
            # one line a rule (name, arguments, then the paths and both outcomes as the
            # rule logs them): the last STEPS_SHOWN go into every assertion message, so a
            # failure Hypothesis cannot replay (FlakyFailure prints no steps) still shows them
            self.steps: list[str] = []
            self.run_id = uuid.uuid4().hex[:8]
            self.pre = f"sm/{self.run_id}"
            self.m = env.store() / self.pre
            self.l = local_base / self.run_id
            self.m.mkdir(parents=True)
            self.l.mkdir(parents=True)
            runs.append(self.pre)

        # --- helpers
        def _log(self, text: str) -> None:
            """Add ``text`` (paths, outcomes) to the current step's line, and note it."""
            note(text)
            self.steps[-1] += f" | {text}" if self.steps else text

        def _says(self, head: str, paths=()) -> str:
            """An assertion message: ``head``, the last STEPS_SHOWN steps, and the mount's
            ``user.memfuse.*`` state / sha256 / version of ``paths`` (relative)."""
            lines = [head, f"run {self.pre}, last {min(len(self.steps), STEPS_SHOWN)} of "
                           f"{len(self.steps)} steps:"]
            lines += [f"  {i}. {t}" for i, t in enumerate(self.steps, 1)][-STEPS_SHOWN:]
            for rel in sorted(paths):
                x = {}
                for k in ("state", "version", "sha256", "error"):
                    try:
                        x[k] = xattr(self.m / rel, k)
                    except OSError as e:
                        x[k] = errno.errorcode.get(e.errno, str(e.errno))
                lines.append(f"  mount xattrs of {rel}: {x}")
            return "\n".join(lines)

        def _content_op(self, rel: str, do, *, waits: bool = True, bare=None) -> None:
            """Run a content-changing op (``do(root)`` → outcome dict) on both sides.
            ``waits``: the close commits and waits (something was written through the
            descriptor), so ``user.memfuse.state`` is final when it returns. The mount may
            refuse the write itself (``EILSEQ`` at the write, docs/SEMANTICS.md "Refusals at
            write(2)"): only when the content it would make is refusable (checked on a copy),
            and then the write is not applied: the local side does ``bare(root)``, the same
            open and close without the write."""
            mount = do(self.m)
            if mount.get("write") == "EILSEQ":
                scratch = Path(tempfile.mkdtemp(prefix="memfuse-prop-"))
                try:
                    if os.path.isfile(self.l / rel):
                        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(self.l / rel, scratch / rel)
                    else:
                        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                    would = do(scratch)
                    after = (scratch / rel).read_bytes() if os.path.isfile(scratch / rel) else b""
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                self._log(f"{rel}: mount {mount}, refused at the write; applied it would be {after!r}")
                assert would["write"] is None and not utf8_text_ok(after), self._says(
                    f"{rel}: refused {after!r}", [rel])
                local = (bare or (lambda r: {"open": None, "write": None, "close": None}))(self.l)
                self._log(f"local (without the write) {local}")
                assert mount == {**local, "write": "EILSEQ"}, self._says(
                    f"{rel}: mount {mount}, local {local}", [rel])
                return
            local = do(self.l)
            expect = dict(local)
            committed = (local["open"] is None and local["close"] is None
                         and not is_local_only(rel.rsplit("/", 1)[-1]))
            if committed and os.path.isfile(self.l / rel):
                data = (self.l / rel).read_bytes()
                if not utf8_text_ok(data):
                    expect["close"] = "EILSEQ"
            self._log(f"{rel}: local {local}, mount {mount}")
            assert mount == expect, self._says(
                f"{rel}: mount {mount}, expected {expect} (local {local})", [rel])
            if committed and waits and os.path.isfile(self.m / rel):
                want = "rejected" if expect["close"] == "EILSEQ" else "clean"
                assert xattr(self.m / rel, "state") == want, self._says(f"{rel}: state, want {want}", [rel])

        def _both(self, what: str, fn) -> None:
            local, mount = outcome(lambda: fn(self.l)), outcome(lambda: fn(self.m))
            self._log(f"{what}: local {local}, mount {mount}")
            assert mount == local, self._says(f"{what}: mount {mount}, local {local}")

        @initialize()
        def start(self) -> None:
            pass

        def _pick(self, data, kind: str) -> str:
            """A path for the next call: mostly an existing file / directory / entry of the
            local tree (``kind``), or a new name in an existing directory ("new"); sometimes
            any path at all (absent ones, through files, …)."""
            tree = _tree(self.l)
            files = sorted(p for p, v in tree.items() if v != "dir")
            dirs = sorted(p for p, v in tree.items() if v == "dir")
            if data.draw(st.integers(0, 3), label="any path") == 3:  # 0 (simplest): existing
                return data.draw(rel_paths, label=kind)
            if kind == "new":
                parent = data.draw(st.sampled_from([""] + dirs), label="in")
                name = data.draw(st.sampled_from(NAMES), label="name")
                return f"{parent}/{name}" if parent else name
            pool = {"file": files, "dir": dirs, "any": files + dirs}[kind]
            return data.draw(st.sampled_from(pool) if pool else rel_paths, label=kind)

        # --- rules
        @rule(pick=st.data(), data=st.binary(max_size=0) | datas)
        @_tracked
        def create(self, pick, data):  # O_CREAT | O_EXCL: cp a new, mkstemp, sed -i
            rel = self._pick(pick, "new")
            self._content_op(rel, lambda r: write_file(r / rel, data, EXCL), waits=bool(data),
                             bare=lambda r: write_file(r / rel, b"", EXCL))

        @rule(pick=st.data(), data=datas, new=st.booleans())
        @_tracked
        def overwrite(self, pick, data, new):  # O_CREAT | O_TRUNC: echo > f, cp a f, tee f
            rel = self._pick(pick, "new" if new else "file")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            self._content_op(rel, lambda r: write_file(r / rel, data, flags),
                             bare=lambda r: write_file(r / rel, b"", flags))

        @rule(pick=st.data(), off=small, data=datas)
        @_tracked
        def write_at(self, pick, off, data):
            rel = self._pick(pick, "file")
            self._content_op(rel, lambda r: _fd_op(r / rel, os.O_WRONLY, lambda fd: os.pwrite(fd, data, off)),
                             bare=lambda r: _fd_op(r / rel, os.O_WRONLY, lambda fd: None))

        @rule(pick=st.data(), data=datas)
        @_tracked
        def append(self, pick, data):  # echo >> f
            rel = self._pick(pick, "file")
            self._content_op(rel, lambda r: write_file(r / rel, data, os.O_WRONLY | os.O_APPEND),
                             bare=lambda r: write_file(r / rel, b"", os.O_WRONLY | os.O_APPEND))

        @rule(pick=st.data(), size=small)
        @_tracked
        def ftruncate(self, pick, size):
            rel = self._pick(pick, "file")
            # after ftruncate(0) the descriptor holds nothing of its own until a write, so its
            # close commits nothing and the release commits without waiting, as `: > f`
            # (docs/SEMANTICS.md "Writes and close", trunc17): state is not final at once
            self._content_op(rel, lambda r: _fd_op(r / rel, os.O_WRONLY, lambda fd: os.ftruncate(fd, size)),
                             waits=size > 0, bare=lambda r: _fd_op(r / rel, os.O_WRONLY, lambda fd: None))

        @rule(pick=st.data(), size=small)
        @_tracked
        def truncate_path(self, pick, size):  # truncate(2): no open, no close
            rel = self._pick(pick, "file")
            # no close follows, so truncate itself refuses content a close would
            # (docs/SEMANTICS.md): EILSEQ, and the file is left as it was
            p = self.l / rel
            if (os.path.isfile(p) and not os.path.islink(p)
                    and not is_local_only(rel.rsplit("/", 1)[-1])):
                cur = p.read_bytes()
                after = cur[:size] + b"\0" * (size - len(cur))
                if len(cur) != size and not utf8_text_ok(after):
                    mount = outcome(lambda: os.truncate(self.m / rel, size))
                    self._log(f"truncate({rel}, {size}): mount {mount}, expected EILSEQ (unchanged)")
                    assert mount == "EILSEQ", self._says(f"truncate({rel}, {size}): mount {mount}", [rel])
                    return
            self._both(f"truncate({rel}, {size})", lambda r: os.truncate(r / rel, size))

        @rule(pick=st.data(), over=st.booleans())
        @_tracked
        def rename(self, pick, over):  # over an existing file or directory, or to a new name
            src = self._pick(pick, "any")
            dst = self._pick(pick, "any" if over else "new")
            sp, dp = self.l / src, self.l / dst
            if (os.path.isfile(sp) and not os.path.islink(sp) and is_local_only(src.rsplit("/", 1)[-1])
                    and not is_local_only(dst.rsplit("/", 1)[-1]) and os.path.isdir(dp.parent)
                    and (not os.path.lexists(dp) or (os.path.isfile(dp) and not os.path.islink(dp)))
                    and not utf8_text_ok(sp.read_bytes())):
                # a local-only file is judged under a normal name: content refused there fails
                # the rename (docs/SEMANTICS.md "Refusals at write(2)", rename(2)), nothing moves
                mount = outcome(lambda: os.rename(self.m / src, self.m / dst))
                self._log(f"rename({src}, {dst}): mount {mount}, expected EILSEQ (not renamed)")
                assert mount == "EILSEQ", self._says(f"rename({src}, {dst}): mount {mount}")
                return
            self._both(f"rename({src}, {dst})", lambda r: os.rename(r / src, r / dst))

        @rule(pick=st.data())
        @_tracked
        def unlink(self, pick):
            rel = self._pick(pick, "file")
            self._both(f"unlink({rel})", lambda r: os.unlink(r / rel))

        @rule(pick=st.data())
        @_tracked
        def mkdir(self, pick):
            rel = self._pick(pick, "new")
            self._both(f"mkdir({rel})", lambda r: os.mkdir(r / rel))

        @rule(pick=st.data())
        @_tracked
        def rmdir(self, pick):
            rel = self._pick(pick, "dir")
            self._both(f"rmdir({rel})", lambda r: os.rmdir(r / rel))

        @invariant()
        @_tracked
        def same_tree(self) -> None:
            mine, theirs = _tree(self.m), _tree(self.l)
            assert mine == theirs, self._says(
                f"mount {mine!r} != local {theirs!r}", _differing(mine, theirs))

        # --- end of run: fix what was refused, then compare with the control plane
        def teardown(self) -> None:
            if self.broken:
                return
            local = _tree(self.l)
            fixed = {}
            for rel, v in sorted(local.items()):
                if v == "dir" or is_local_only(rel.rsplit("/", 1)[-1]) or utf8_text_ok(v):
                    continue
                good = v.decode("utf-8", "replace").replace("\x00", "0").encode()
                flags = os.O_WRONLY | os.O_TRUNC
                assert write_file(self.l / rel, good, flags) == OK
                fixed[rel] = write_file(self.m / rel, good, flags)
            # files whose write session was held back by a write refused at once (valid
            # content, state rejected): written again as they are
            for rel, v in sorted(_tree(self.l).items()):
                if (v != "dir" and rel not in fixed and not is_local_only(rel.rsplit("/", 1)[-1])
                        and xattr(self.m / rel, "state") == "rejected"):
                    fixed[rel] = write_file(self.m / rel, v, os.O_WRONLY | os.O_TRUNC)
            self.steps.append(f"teardown: fixed in place {fixed}")
            note(f"fixed in place: {sorted(fixed)}")
            assert fixed == dict.fromkeys(fixed, OK), self._says("teardown: a fix refused", fixed)
            mine, theirs = _tree(self.m), _tree(self.l)
            assert mine == theirs, self._says(
                f"teardown: mount {mine!r} != local {theirs!r}", _differing(mine, theirs))
            wait_drained(env.root)
            want = {rel: v.decode() for rel, v in _tree(self.l).items()
                    if v != "dir" and not is_local_only(rel.rsplit("/", 1)[-1])}
            got = env.contents("default", self.pre)
            assert got == want, self._says(
                f"control plane != local directory after the outbox drained: control plane "
                f"{got!r}, local {want!r}", _differing(got, want))

    return MountVsLocal


@pytest.mark.timeout(budget_seconds(600))
def test_mount_matches_local_directory(env, tmp_path):
    runs: list[str] = []
    machine = make_machine(env, tmp_path / "local", runs)
    try:
        run_state_machine_as_test(machine, settings=hyp_settings(50, ci_steps=30))
    finally:
        shutil.rmtree(tmp_path / "local", ignore_errors=True)
    assert runs


# ====================================================================== minimal sequences
def test_truncate_by_path_reaches_the_control_plane(env):
    """truncate(2) changes the file with no open and no close: the change must still be
    committed (and ``state`` must not say ``clean`` while the control plane holds other
    content)."""
    d, pre = fresh_dir(env, "min")
    assert write_file(d / "t.md", b"hello world\n") == OK
    os.truncate(d / "t.md", 5)
    assert os.stat(d / "t.md").st_size == 5  # no open/read here: a reader's close commits it
    wait_drained(env.root)
    try:
        wait_until(lambda: env.contents("default", pre) == {"t.md": "hello"}, 30,
                   "the truncate to reach the control plane")
    except AssertionError:
        raise AssertionError(f"control plane holds {env.contents('default', pre)!r}, the mount "
                             f"5 bytes with state={xattr(d / 't.md', 'state')!r}") from None
    assert (d / "t.md").read_bytes() == b"hello"


def test_deleting_a_rejected_file_that_replaced_a_record(env):
    """A refused file renamed over a stored record, then deleted: the stored record must not
    survive (a remount would bring back a file the user replaced and deleted)."""
    d, pre = fresh_dir(env, "min")
    assert write_file(d / "x.md", b"x\n") == OK
    # a character cut at the end: only close refuses it, and the content is kept rejected
    assert write_file(d / "y.md", b"bad \xc3") == {"open": None, "write": None, "close": "EILSEQ"}
    os.rename(d / "y.md", d / "x.md")
    os.unlink(d / "x.md")
    assert os.listdir(d) == []
    wait_drained(env.root)
    assert env.contents("default", pre) == {}


def test_renaming_a_rejected_file_that_replaced_a_record(env):
    """Same start, then the file moves on: the old record must not stay at the old path."""
    d, pre = fresh_dir(env, "min")
    assert write_file(d / "x.md", b"x\n") == OK
    # a character cut at the end: only close refuses it, and the content is kept rejected
    assert write_file(d / "y.md", b"bad \xc3") == {"open": None, "write": None, "close": "EILSEQ"}
    os.rename(d / "y.md", d / "x.md")
    os.rename(d / "x.md", d / "z.md")
    assert write_file(d / "z.md", b"good\n") == OK  # fixed in place
    assert sorted(os.listdir(d)) == ["z.md"]
    wait_drained(env.root)
    assert env.contents("default", pre) == {"z.md": "good\n"}


def test_unlinked_file_does_not_come_back(env):
    """A file written (committed) and then unlinked at once must stay gone.

    Found by ``MountVsLocal``: the change feed fetched the page with the file's creation,
    waited for the outbox to drain (the delete commits), then applied that *stale* page; the
    unlink had forgotten the record id, so the creation was taken for a new remote record and
    the file reappeared until the next page brought the delete (10–100 ms; a write in that
    window would re-create the record for real). Timing-dependent: tried several times."""
    seen = []
    for i in range(15):
        d, _ = fresh_dir(env, "unlink")
        assert write_file(d / "x.md", b"x\n") == OK
        os.unlink(d / "x.md")
        deadline = time.monotonic() + 0.25
        while time.monotonic() < deadline:
            if os.listdir(d):
                seen.append(i)
                break
            time.sleep(0.002)
        if len(seen) >= 3:
            break
    assert seen == [], f"the unlinked file reappeared in attempts {seen}"


def test_rename_to_a_local_only_name_and_back_keeps_the_content(env):
    """``mv f f~ && mv f~ f`` (a backup name and back): the file keeps its bytes.

    Found by ``MountVsLocal``. Renaming a local-only name onto a normal one commits the file
    under the new name; for a file whose content sits in the blob cache (no write buffer) the
    commit took ``b""`` as the content, so the file became empty on the mount and on the
    control plane (a new empty version)."""
    d, pre = fresh_dir(env, "min")
    assert write_file(d / "a.md", b"important\n") == OK
    os.rename(d / "a.md", d / "a.md~")
    assert (d / "a.md~").read_bytes() == b"important\n"
    os.rename(d / "a.md~", d / "a.md")
    got = {"mount": (d / "a.md").read_bytes()}
    wait_drained(env.root)
    got["control plane"] = env.contents("default", pre)
    assert got == {"mount": b"important\n", "control plane": {"a.md": "important\n"}}


def test_close_of_a_local_only_file_reports_no_refusal(env):
    """A local-only file never goes to the control plane, so closing it never reports a
    refusal. Found by ``MountVsLocal``: a commit made under the file's previous (normal) name
    and refused later (NUL bytes from a truncate) was reported at the close of a write to
    the file under its local-only name. Timing-dependent (the refusal must still be in
    flight): tried several times."""
    got = []
    for i in range(5):
        d, _ = fresh_dir(env, "min")
        assert write_file(d / "a.md", b"abc\n") == OK
        # a character cut at the end, through a descriptor: refused at its close
        got_close = _fd_op(d / "a.md", os.O_WRONLY | os.O_APPEND, lambda fd: os.write(fd, b"\xc3"))
        assert got_close == {"open": None, "write": None, "close": "EILSEQ"}
        os.rename(d / "a.md", d / "b.md")  # the rejected content moves with the file
        os.rename(d / "b.md", d / "b.md~")  # a local-only name from now on
        got.append(write_file(d / "b.md~", b"more\n", os.O_WRONLY | os.O_APPEND))
    assert got == [OK] * 5


def test_a_file_renamed_onto_a_local_only_name_before_its_create_commits_stays(env):
    """``: > a; mv a a~; write a~`` at once: the file stays, local, and no record is left.

    Found by ``MountVsLocal`` (CI, session 18: the mount lost ``n~`` the local directory
    kept). An empty file is committed at its release, without waiting, so the rename onto
    a local-only name (which queues the record's delete) came before the create's answer;
    that answer, naming the old path, was taken for a move made elsewhere: the record was
    fetched again once the outbox was idle, found deleted (by our own delete), and the
    deletion was applied to the local-only file, still bound to the record: it vanished
    10-80 ms later, every time."""
    lost = []
    for i in range(3):
        d, pre = fresh_dir(env, "min")
        assert write_file(d / "a", b"", EXCL) == OK
        os.rename(d / "a", d / "a~")
        assert _fd_op(d / "a~", os.O_WRONLY, lambda fd: os.pwrite(fd, b"!", 3)) == OK
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and os.listdir(d) == ["a~"]:
            time.sleep(0.005)
        wait_drained(env.root)
        got = {"listing": os.listdir(d), "control plane": env.contents("default", pre)}
        if got != {"listing": ["a~"], "control plane": {}}:
            lost.append((i, got))
            continue
        assert (d / "a~").read_bytes() == b"\0\0\0!" and xattr(d / "a~", "state") == "local"
    assert lost == []
