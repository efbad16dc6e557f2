"""``AppendBuffer`` (the write buffer of a file being appended to: its base by reference
plus a tail) behaves as the ``bytearray`` it replaces for every operation the core and the
write checker make, and ``RecentContents`` keeps what it is given within its bound."""
from __future__ import annotations

import random

import pytest

from memfuse.sidecar.appendbuf import AppendBuffer
from memfuse.sidecar.recent import RecentContents


def _check_same(a: AppendBuffer, b: bytearray) -> None:
    assert bytes(a) == bytes(b) and len(a) == len(b)
    for k in range(-len(b) - 2, len(b) + 2):
        try:
            want: int | None = b[k]
        except IndexError:
            want = None
        try:
            got: int | None = a[k]
        except IndexError:
            got = None
        assert got == want, k
    for p in range(-3, len(b) + 3):
        for q in range(-3, len(b) + 3, 3):
            assert a[p:q] == bytes(b[p:q]), (p, q)
        assert a[p:] == bytes(b[p:]) and a[:p] == bytes(b[:p])
    assert a[::2] == bytes(b[::2])


@pytest.mark.parametrize("seed", range(4))
def test_an_append_buffer_is_a_bytearray_for_every_change(seed):
    """Random writes (at the end, past it, into the base), truncations and extensions on an
    ``AppendBuffer`` and on a ``bytearray`` of the same bytes leave the same bytes; the
    buffer names its base (``appended_to``) only while it holds the base plus what was
    written after it, and always after appends alone."""
    rnd = random.Random(seed)
    for _ in range(60):
        base = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 30)))
        a, b = AppendBuffer(base, "ab" * 32), bytearray(base)
        appends_only = True
        for _ in range(8):
            size = len(b)
            i, j = sorted(rnd.randrange(-4, size + 5) for _ in range(2))
            data = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 6)))
            op = rnd.randrange(5)
            if op == 0:  # a write at offset i (what Filesystem.write does)
                a[i:j] = data
                b[i:j] = data
                appends_only = False
            elif op == 1:  # an append (O_APPEND: Filesystem.write at the end)
                a[size:size + len(data)] = data
                b[size:size + len(data)] = data
            elif op == 2:  # a truncation
                del a[i:]
                del b[i:]
                appends_only = False
            elif op == 3:  # an extension (truncate up, a hole)
                a.extend(data)
                b.extend(data)
            else:
                del a[i:j]
                del b[i:j]
                appends_only = False
            _check_same(a, b)
            if a.appended_to is not None:
                assert a.appended_to == ("ab" * 32, base) and bytes(b).startswith(base)
            assert a.appended_to is not None or not appends_only


def test_recent_contents_are_bounded_and_least_recently_used_go_first():
    r = RecentContents(max_bytes=100, min_bytes=10)
    r.keep("a", b"x" * 40)
    r.keep("b", b"y" * 40)
    r.keep("small", b"z" * 9)  # shorter than min_bytes: not kept
    r.keep("huge", b"w" * 101)  # longer than the whole bound: not kept
    assert r.get("small") is None and r.get("huge") is None
    assert r.get("a") == b"x" * 40  # now the most recently used
    r.keep("c", b"v" * 40)  # 120 bytes: "b" (least recently used) goes
    assert r.get("b") is None and r.get("a") is not None and r.get("c") is not None
    assert r.size == 80
    r.keep("a", b"x" * 40)  # kept again: counted once
    assert r.size == 80
    r.drop("a")
    r.drop("absent")
    assert r.size == 40 and r.get("a") is None


class _FakeNode:
    type_override = None

    def __init__(self, path: str) -> None:
        self._path = path

    def path(self) -> str:
        return self._path


@pytest.mark.parametrize("path", ["notes/j.md", "MEMORY.md"])
def test_an_appends_type_check_from_the_head_is_the_whole_texts(path):
    """``Filesystem._precheck`` of an append (``checked``: the base passed already) reads the
    type from the first ``HEAD_BYTES`` only: the verdict is the one of the whole text, for
    frontmatters opened by ``---`` (with a BOM, CRLF), closed or not, with a bad or good
    type, bases around ``HEAD_BYTES`` and 4-byte characters cut at it."""
    from types import SimpleNamespace

    from memfuse.secretscan import AppendScans
    from memfuse.sidecar.core import Filesystem
    from memfuse.sidecar.writecheck import HEAD_BYTES

    fs = SimpleNamespace(scans=AppendScans())  # the one attribute _precheck reads

    def verdict(data: bytes, checked: int) -> tuple[str, int] | None:
        r = Filesystem._precheck(fs, _FakeNode(path), data, checked=checked)  # type: ignore[arg-type]
        return None if r is None else (r.code, r.errno)

    heads = [b"", b"---\ntype: user\n---\n", b"---\ntype: bogus\n---\n", b"\xef\xbb\xbf---\r\ntype: bogus\r\n...\r\n",
             b"---\ntype: bogus\n", b"--- \ntype: bogus\n---\n", b"# title\n---\ntype: bogus\n---\n"]
    line = b"a line of notes\n"
    fills = [line * 130, ("\U0001F600" * 15 + "\n").encode() * (HEAD_BYTES // 61 + 1),
             line * ((HEAD_BYTES - 40) // len(line))]
    suffixes = [b"more\n", b"---\n", b"...\n"]
    seen = set()
    for head in heads:
        for fill in fills:
            base = head + fill
            for suffix in suffixes:
                data = base + suffix
                whole = verdict(data, 0)
                assert verdict(data, len(base)) == whole, (head, len(fill), suffix)
                seen.add(whole)
    # both verdicts were exercised (the root index has no type: never refused for one)
    assert seen == ({None} if path == "MEMORY.md" else {None, ("invalid_type", 22)})
