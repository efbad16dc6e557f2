"""The write-time judge (memfuse.sidecar.writecheck) without FUSE: what a write(2) or
ftruncate(2) is refused for, at chunk boundaries, and that it never rescans a file whole.
The mount-level behaviour (exit status and stderr of real tools) is in
tests/scenarios/cases/*refus*.
"""
from __future__ import annotations

import errno
import random

import pytest

from memfuse import content as content_rules
from memfuse.sidecar import writecheck
from memfuse.sidecar.writecheck import HEAD_BYTES, WINDOW, WINDOW_CAP, Refusal, WriteChecker

GH = "gh" + "p_" + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5"  # built from pieces: a GitHub token shape


def type_rule(text: str) -> Refusal | None:
    try:
        content_rules.check_type(content_rules.record_type("n.md", text, None, "project"))
    except ValueError as e:
        return Refusal("invalid_type", str(e))
    return None


class File:
    """A file being written, as core.Filesystem holds it: the checker is asked first, the
    write applied only when accepted."""

    def __init__(self, content: bytes = b"", trusted: bool = True) -> None:
        self.buf = bytearray(content)
        self.ck = WriteChecker(self.buf, trusted=trusted, type_rule=type_rule)

    def write(self, data: bytes | str, off: int | None = None) -> Refusal | None:
        data = data.encode() if isinstance(data, str) else data
        off = len(self.buf) if off is None else off
        r = self.ck.check_write(self.buf, off, data)
        if r is None:
            if off > len(self.buf):
                self.buf.extend(b"\0" * (off - len(self.buf)))
            self.buf[off:off + len(data)] = data
        return r

    def truncate(self, size: int) -> Refusal | None:
        r = self.ck.check_truncate(self.buf, size)
        if r is None:
            del self.buf[size:]
            self.buf.extend(b"\0" * (size - len(self.buf)))
        return r


def test_a_four_byte_character_split_across_two_writes_waits_for_the_second():
    f = File()
    ch = "😀".encode()
    assert f.write(b"note " + ch[:2]) is None  # cut at the write's end: waits
    assert f.write(ch[2:] + b"\n") is None
    assert f.buf.decode() == "note 😀\n"
    # a byte that cannot continue a cut sequence is refused, and not applied
    assert f.write(ch[:3]) is None
    r = f.write(b"x")
    assert r is not None and r.errno == errno.EILSEQ and r.code == "invalid_content"
    assert bytes(f.buf).endswith(ch[:3])
    assert f.write(ch[3:]) is None and f.buf.decode().endswith("😀")


@pytest.mark.parametrize("bad", [b"a\0b", b"\xff\xfe\n", b"\xc3\x28", b"\xed\xa0\x80"])
def test_nul_and_invalid_utf8_are_refused_and_not_applied(bad: bytes):
    f = File(b"kept\n")
    r = f.write(bad)
    assert r is not None and r.errno == errno.EILSEQ
    assert bytes(f.buf) == b"kept\n"
    assert f.write(b"more\n") is None  # the file is still writable


def test_a_write_past_the_end_leaves_a_hole_of_nuls():
    f = File(b"abc")
    r = f.write(b"x", off=10)
    assert r is not None and r.errno == errno.EILSEQ and "NUL" in r.reason
    assert f.truncate(10) is not None and bytes(f.buf) == b"abc"


def test_writes_in_the_middle_are_judged_with_their_neighbours():
    f = File("é and more text\n".encode())
    assert f.write(b"\xc3", off=0) is None  # same lead byte: still é
    r = f.write(b"\x41", off=1)  # cuts é in two: the lead byte is left alone
    assert r is not None and r.errno == errno.EILSEQ
    assert f.write("ü".encode(), off=0) is None and f.buf.decode().startswith("ü and")


def test_a_secret_split_across_two_writes_is_refused_at_the_second():
    f = File(b"# notes\n")
    assert f.write("token: " + GH[:20]) is None
    r = f.write(GH[20:] + "\n")
    assert r is not None and r.errno == errno.EPERM and r.code == "secret_detected"
    assert "GitHub token" in r.reason and GH[20:] not in r.reason
    assert bytes(f.buf) == ("# notes\ntoken: " + GH[:20]).encode()


def test_a_secret_hidden_by_a_format_character_is_refused():
    f = File()
    r = f.write(GH[:10] + "\u200b" + GH[10:])
    assert r is not None and r.errno == errno.EPERM


def test_a_secret_hidden_by_a_variation_selector_or_a_hangul_filler_is_refused():
    """Attack 15 F2: ``ghp_69`` + U+034F + ... + U+3164 + ... closed with 0 on the mount."""
    for mark in ("\u034f", "\ufe0f", "\u3164", "\U000e0100"):
        f = File()
        r = f.write(GH[:6] + mark + GH[6:20] + mark + GH[20:])
        assert r is not None and r.errno == errno.EPERM, ascii(mark)


#: padding the secret rules do not read (each a view removes it between a token's halves),
#: repeated to fill 3 * WINDOW bytes of the file (attack21 F3)
PADS = {
    "zero width space": "\u200b", "variation selector": "\ufe0f", "Hangul filler": "\u3164",
    "soft hyphen": "\u00ad", "no-break space": "\u00a0", "combining mark": "\u0301",
    "escaped zero width space": "\\u200b", "HTML reference": "&#8203;", "emphasis": "*",
    "strike-through": "~~", "HTML comment": "<!-- -->",
}


@pytest.mark.parametrize("pad", list(PADS))
def test_padding_the_rules_do_not_read_does_not_push_a_secret_out_of_the_window(pad):
    """Attack21 F3: ``printf 'note: ghp_%s' "$ZWSP_x1000" >> f`` then the token's rest: the
    second write completes the secret and fails with EPERM (the window holds WINDOW bytes as
    the rules read them, not as the file holds them); and the same with the token's start
    written last, before the padding (the window after the write)."""
    padding = PADS[pad] * (3 * WINDOW // len(PADS[pad].encode()) + 1)
    f = File()
    assert f.write("note: " + GH[:4] + padding) is None
    r = f.write(GH[4:] + "\n")
    assert r is not None and r.errno == errno.EPERM and r.code == "secret_detected", pad
    assert bytes(f.buf) == ("note: " + GH[:4] + padding).encode()
    g = File(("note: ____" + padding + GH[4:] + "\n").encode())
    r = g.write(GH[:4], off=6)
    assert r is not None and r.errno == errno.EPERM, pad


def test_a_long_comment_opened_or_closed_by_the_write_is_read_whole():
    """An HTML comment inside a token, longer than the window, hides it from the markup view
    only whole: the write that closes it (or opens it, written last) reads back (on) to the
    comment's other end on its line."""
    f = File(("# t\nnote: " + GH[:6] + "<!--" + "x" * 3 * WINDOW).encode())
    r = f.write("-->" + GH[6:] + "\n")
    assert r is not None and r.errno == errno.EPERM
    g = File(("# t\nnote: " + "_" * 10 + "x" * 3 * WINDOW + "-->" + GH[6:] + "\nmore\n").encode())
    r = g.write(GH[:6] + "<!--", off=10)
    assert r is not None and r.errno == errno.EPERM
    # on another line, a comment is prose: nothing to refuse
    h = File(("# t\n<!--" + "x" * 3 * WINDOW + "\n").encode())
    assert h.write("--> done\n") is None


def test_padding_past_the_cap_is_left_to_close_and_costs_the_cap():
    """The window takes at most WINDOW_CAP bytes of the file on each side: more padding than
    that is not read at the write (the close reads the file whole and refuses it), so a file
    of padding written in 4 KiB chunks costs each write a bounded window, not the file."""
    padding = "\u200b" * (WINDOW_CAP // 3 + 10)
    f = File()
    assert f.write("note: " + GH[:4] + padding) is None
    assert f.write(GH[4:] + "\n") is None  # past the cap: judged at close
    assert f.ck.clean_len == -1
    assert content_rules.find_secret(f.buf.decode()) is not None


def test_a_file_of_padding_written_in_chunks_reads_a_bounded_window(monkeypatch):
    scanned = {"floor": 0, "secret": 0}
    real_floor, real_find = content_rules.scan_floor, content_rules.find_secret

    def floor(text):
        scanned["floor"] += len(text.encode())
        return real_floor(text)

    def find(text):
        scanned["secret"] += len(text.encode())
        return real_find(text)

    monkeypatch.setattr(writecheck.content_rules, "scan_floor", floor)
    monkeypatch.setattr(writecheck.content_rules, "find_secret", find)
    f = File()
    chunk = ("\u200b" * 1365).encode()
    writes = 256
    for _ in range(writes):
        assert f.write(chunk) is None
    # each write: its bytes and at most WINDOW_CAP before them, in the rules' scans (twice: the
    # window after the write, and before it only when it found a secret), and the floor's
    # rounds (each at least half again the one before: at most 3x the cap)
    assert scanned["secret"] <= writes * (len(chunk) + WINDOW_CAP)
    assert scanned["floor"] <= writes * 3 * WINDOW_CAP


def test_a_file_holding_a_secret_already_is_judged_at_close_not_at_each_write():
    f = File(("key " + GH + "\n").encode(), trusted=False)
    assert f.write(b"a clean line\n") is None


def test_a_frontmatter_type_is_judged_once_the_frontmatter_is_closed():
    f = File()
    assert f.write("---\nname: x\ntype: notes\n") is None  # not closed yet
    r = f.write("---\nbody\n")
    assert r is not None and r.errno == errno.EINVAL and "not one of" in r.reason
    assert "notes" not in r.reason  # the refused value is content: never shown (attack 13 F13)
    assert f.write("...\n") is not None  # the other closing fence too
    assert f.write("description: d\n") is None
    g = File()
    assert g.write("---\ntype: feedback\n---\nbody\n") is None
    r = g.write("xxxxx", off=10)  # "type: xxxxxback"
    assert r is not None and r.errno == errno.EINVAL
    assert g.write("user    ", off=10) is None  # "type: user    " is fine


def test_an_index_or_an_explicit_type_is_not_judged_by_its_frontmatter():
    ck = WriteChecker(b"", trusted=True, type_rule=lambda text: None)
    assert ck.check_write(b"", 0, b"---\ntype: notes\n---\n") is None


def test_truncate_cutting_a_character_waits_for_the_next_write():
    f = File("ab€".encode())
    assert f.truncate(3) is None  # "ab" + the first byte of €
    assert f.write("€".encode()[1:]) is None and f.buf.decode() == "ab€"


def test_content_refused_before_the_session_does_not_fail_writes():
    f = File(b"bad \xff here\n", trusted=False)
    assert f.write(b"append\n") is None


def test_writing_a_mebibyte_in_4_kib_chunks_never_rescans_the_file(monkeypatch):
    scanned = {"utf8": 0, "secret": 0}
    real_scan, real_find = WriteChecker._scan, content_rules.find_secret

    def scan(region, tail_ok):
        scanned["utf8"] += len(region)
        return real_scan(region, tail_ok)

    def find(text):
        scanned["secret"] += len(text)
        return real_find(text)

    monkeypatch.setattr(WriteChecker, "_scan", staticmethod(scan))
    monkeypatch.setattr(writecheck.content_rules, "find_secret", find)
    r = random.Random(1)
    f = File()
    chunk = ("---\ntype: project\n---\n" + "word " * 900).encode()[:4096]
    total = 1 << 20
    while len(f.buf) < total:
        assert f.write(chunk) is None
        chunk = bytes(r.choice(b"abcdefgh \n") for _ in range(4096))
    # linear: each write scans its own bytes (+ a few for UTF-8) and a bounded window
    assert scanned["utf8"] <= total + 4 * (total // 4096)
    assert scanned["secret"] <= total + WINDOW * (total // 4096) + 4096
    assert HEAD_BYTES < total


def _full_verdict(data: bytes) -> str | None:
    """What a close would refuse ``data`` for, ignoring a cut sequence at its very end."""
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and e.end == len(data):
            text = data[:e.start].decode()
        else:
            return "utf8"
    if "\0" in text:
        return "utf8"
    if content_rules.find_secret(text):
        return "secret"
    if type_rule(text):
        return "type"
    return None


def test_random_writes_agree_with_a_full_check():
    """Soundness and completeness against the close-time rules on small files: a refused
    write leaves a file that a close would refuse, and an accepted one a file a close
    accepts (a cut sequence at the end aside), whenever the file was acceptable before."""
    r = random.Random(20)
    pieces = [b"a", b"hello ", b"\n", "é".encode(), "😀".encode(), b"\0", b"\xff", b"---\n",
              b"type: notes\n", b"type: user\n", GH[:12].encode(), GH[12:30].encode(), GH[30:].encode(),
              b"key: ", b"\xf0\x9f", b"\x98\x80"]
    seen = {"refused": 0, "accepted": 0}
    for _ in range(300):
        f = File()
        for _ in range(r.randint(1, 12)):
            before = _full_verdict(bytes(f.buf))
            data = b"".join(r.choices(pieces, k=r.randint(1, 3)))
            off = len(f.buf) if r.random() < 0.7 else r.randint(0, len(f.buf))
            after_buf = bytearray(f.buf)
            after_buf[off:off + len(data)] = data
            after = _full_verdict(bytes(after_buf))
            refused = f.write(data, off)
            seen["refused" if refused else "accepted"] += 1
            if refused is not None:
                assert after is not None, (bytes(f.buf), off, data, refused)
            elif before is None:
                assert after is None, (bytes(after_buf), off, data)
            if before is not None:
                break  # refusable already: close judges it
    assert seen["refused"] > 50 and seen["accepted"] > 50, seen


def test_clean_len_names_a_content_whose_every_byte_a_clean_scan_read():
    """``clean_len`` (the close then scans no more: ``Filesystem.commit``) is the content's
    length only when the last change was a write whose window was the whole content and held
    no secret: not after a truncate, not for a content past the window, not when the content
    held a secret already, never for a refused write."""
    f = File()
    assert f.write("# notes\nline one\n") is None and f.ck.clean_len == len(f.buf)
    assert f.write("line two\n") is None and f.ck.clean_len == len(f.buf)
    assert f.write("LINE", 8) is None and f.ck.clean_len == len(f.buf)  # in the middle
    assert f.truncate(5) is None and f.ck.clean_len == -1
    assert f.write("x") is None and f.ck.clean_len == len(f.buf)
    before = f.ck.clean_len
    assert f.write("token: " + GH + "\n") is not None and f.ck.clean_len == before  # refused
    big = File(b"a" * (WINDOW + 10))
    assert big.write("b", WINDOW + 10) is None and big.ck.clean_len == -1  # window: a part
    assert big.write("c", 0) is None and big.ck.clean_len == -1  # its end past the window
    held = File(("key " + GH + "\n").encode(), trusted=False)
    assert held.write(b"a clean line\n") is None and held.ck.clean_len == -1


async def test_a_file_written_in_one_go_is_scanned_for_secrets_once(tmp_path, monkeypatch):
    """create, one write, close: the content is scanned once (at the write), not again at
    the close; a second write past the window, or a truncate, makes the close scan it; a
    secret is refused as before (at the write)."""
    import os

    import trio

    from memfuse.client import ApiClient
    from memfuse.fake import FakeControlPlane
    from memfuse.sidecar.blobcache import BlobCache
    from memfuse.sidecar.core import Filesystem, FsError, Settings
    from memfuse.sidecar.journal import Journal

    import sys

    scans: list[int] = []
    real = content_rules.find_secret

    def counted(text: str) -> str | None:  # the sidecar's scans (the fake control plane scans too)
        if sys._getframe(1).f_globals["__name__"].startswith("memfuse.sidecar."):
            scans.append(len(text))
        return real(text)

    monkeypatch.setattr(content_rules, "find_secret", counted)
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="wc-test")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        text = b"# notes\n" + b"a line of notes\n" * 20

        async def one(name: bytes, *steps: tuple[str, int, bytes]) -> int:
            h = fs.create(sm.root.ino, name, 0o600, os.O_WRONLY, 0, 0)
            del scans[:]
            for what, off, data in steps:
                if what == "w":
                    fs.write(h, off, data)
                else:
                    fs.truncate(h.node, off)
            await fs.flush(h)
            fs.release(h.fh)
            return len(scans)

        assert await one(b"a.md", ("w", 0, text)) == 1
        assert await one(b"b.md", ("w", 0, text), ("t", 100, b"")) == 2
        big = b"# big\n" + b"x" * (WINDOW * 2) + b"\n"
        assert await one(b"c.md", ("w", 0, big), ("w", len(big), b"more\n")) == 3
        h = fs.create(sm.root.ino, b"d.md", 0o600, os.O_WRONLY, 0, 0)
        with pytest.raises(FsError) as err:
            fs.write(h, 0, ("token: " + GH + "\n").encode())
        assert err.value.errno == errno.EPERM
        await fs.committer.wait_idle()
        nursery.cancel_scope.cancel()
