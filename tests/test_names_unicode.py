"""The name rule over the whole Unicode database: a character is refused in a name exactly
when its general category is control (Cc), format (Cf: every bidi control among them),
line / paragraph separator (Zl, Zp) or surrogate (Cs); every other code point is accepted.
Checked for every code point, not a list, and on the faces that take names from agents:
``memfuse.names`` (the sidecar and the server), the REST API and the memory tool.
"""
from __future__ import annotations

import sys
import unicodedata

import pytest

from memfuse import names
from memfuse.names import FORBIDDEN_CATEGORIES, NameError_, check_component, check_path

# the bidi controls of Unicode's Bidi_Control property (UAX #9): all of them are Cf
BIDI_CONTROLS = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
# the characters issue 20 found accepted
REPORTED = [0x2066, 0x2067, 0x2068, 0x2069, 0x061C, 0x00AD, 0x180E, 0xFFF9, 0xFFFA, 0xFFFB]


def _refused(ch: str) -> bool:
    try:
        check_component("a" + ch + "b")
    except NameError_:
        return True
    return False


def test_every_code_point_follows_the_category_rule():
    wrong = []
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        if ch == "/":
            continue  # the separator, refused in a component for its own reason
        expect = unicodedata.category(ch) in FORBIDDEN_CATEGORIES
        if _refused(ch) != expect:
            wrong.append(f"U+{cp:04X} {unicodedata.category(ch)}")
    assert not wrong, wrong[:20]


def test_the_bidi_controls_and_the_reported_characters_are_format_characters():
    for cp in BIDI_CONTROLS + REPORTED:
        assert unicodedata.category(chr(cp)) == "Cf"
        assert _refused(chr(cp)), f"U+{cp:04X}"
        with pytest.raises(NameError_) as ei:
            check_path(f"notes/a{chr(cp)}.md")
        assert f"U+{cp:04X}" in ei.value.reason and not ei.value.too_long


def test_ordinary_names_in_any_script_pass():
    for name in ["notes.md", "日本語のメモ.md", "café-ñ.md", "заметки.md", "ملاحظات.md", "नोट्स.md",
                 "🙂.md", "a b (1).md", "Ⅻ.md", "ﬁle.md"]:
        assert check_component(name) == name


def test_printable_ascii_is_never_looked_up(monkeypatch):
    calls = []
    real = unicodedata.category
    monkeypatch.setattr(names.unicodedata, "category", lambda ch: calls.append(ch) or real(ch))
    check_component("".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "/"))
    assert calls == []


# ---------------------------------------------------------------- the same rule on other faces

CF = [chr(cp) for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp)) == "Cf"]


async def test_rest_and_memory_tool_refuse_every_format_character():
    from memfuse.client import ApiClient, ApiError
    from memfuse.fake import FakeControlPlane

    fake = FakeControlPlane()
    try:
        token = await fake.setup("ws", stores=("default",))
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="pytest") as api:
            for ch in CF:
                with pytest.raises(ApiError) as ei:
                    await api.create_record("default", f"n{ch}.md", "x")
                assert ei.value.status == 422 and ei.value.code == "invalid_path", hex(ord(ch))
                r = await api.memory_tool("ws", {"command": "create", "path": f"/memories/default/m{ch}.md",
                                                 "file_text": "x"})
                assert r.is_error, hex(ord(ch))
            await api.create_record("default", "ok.md", "x")
            r = await api.memory_tool("ws", {"command": "create", "path": "/memories/default/ok2.md",
                                             "file_text": "x"})
            assert not r.is_error, r.content
            page = await api.list_records("default")
            assert sorted(x.path for x in page.records) == ["ok.md", "ok2.md"]
    finally:
        await fake.aclose()


def test_local_only_patterns_match_exactly_as_fnmatchcase():
    """``names.is_local_only`` matches all patterns with one compiled expression; it must
    say what ``fnmatch.fnmatchcase`` says of each pattern (anchored at both ends, case
    sensitive, ``[`` unclosed read literally, a newline in a name matched by ``*``)."""
    import fnmatch
    import itertools
    import random

    from memfuse import names

    rng = random.Random(5)
    alphabet = "ab.~#-x*?[]!\n"
    samples = ["f.md", "f~", ".#x", "#x#", ".goutputstream-1", ".~lock.a#", ".x.swp", ".x.swx",
               "x.swp", "4913", "49130", "a\n~", "~", "F~", ".#", "#"]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7))) for _ in range(3000)]
    sets = [names.DEFAULT_LOCAL_ONLY, ("*.tmp*x", "a?b", "[!a]*", "[a-"), (), ("*",)]
    for patterns, name in itertools.product(sets, samples):
        want = any(fnmatch.fnmatchcase(name, p) for p in patterns)
        assert names.is_local_only(name, patterns) == want, (name, patterns)


# ---------------------------------------------------------------- names given: NFC, the index

def test_a_name_given_is_in_nfc_and_the_index_is_no_directory():
    """Two names that look the same (``é`` as one code point and as ``e`` + U+0301) would be
    two records nobody can tell apart (attack 13 F2): a name given to a new file or directory
    is in NFC. ``MEMORY.md`` at the store's root is the index file, never a directory (F1)."""
    from memfuse.names import check_new_name, check_new_path

    nfd, nfc = "e\u0301te\u0301.md", "\u00e9t\u00e9.md"
    assert check_component(nfd) == nfd  # a name that exists keeps working
    with pytest.raises(NameError_, match="normalization form C"):
        check_new_name(nfd)
    assert check_new_name(nfc) == nfc and check_new_name("plain.md") == "plain.md"
    assert check_new_name("\u65e5\u672c\u8a9e.md") and check_new_name("\u0928\u092e\u0938\u094d\u0924\u0947")
    with pytest.raises(NameError_, match="normalization form C"):
        check_new_name("\u212b.md")  # ANGSTROM SIGN: NFC is U+00C5
    with pytest.raises(NameError_, match="index file"):
        check_new_path("MEMORY.md/x.md")
    assert check_new_path("MEMORY.md") == "MEMORY.md"
    assert check_new_path("notes/MEMORY.md/x.md")  # only the store's root holds the index
    with pytest.raises(NameError_, match="normalization form C"):
        check_new_path(f"notes/{nfd}")


async def test_rest_and_memory_tool_refuse_nfd_names_and_an_index_directory():
    from memfuse.client import ApiClient, ApiError
    from memfuse.fake import FakeControlPlane

    fake = FakeControlPlane()
    try:
        token = await fake.setup("ws", stores=("default",))
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="pytest") as api:
            for path in ("e\u0301.md", "MEMORY.md/x.md", "a\u0301/x.md"):
                with pytest.raises(ApiError) as ei:
                    await api.create_record("default", path, "x")
                assert ei.value.status == 422 and ei.value.code == "invalid_path", path
                r = await api.memory_tool("ws", {"command": "create", "path": f"/memories/default/{path}",
                                                 "file_text": "x"})
                assert r.is_error, path
            rec = await api.create_record("default", "\u00e9.md", "x")
            with pytest.raises(ApiError) as ei:
                await api.move_record("default", rec.id, "MEMORY.md/\u00e9.md")
            assert ei.value.status == 422, ei.value
            # the store-wide move takes the same rule: its target prefix is a directory even
            # with one component (attack 14 F7: it made the root MEMORY.md a directory)
            await api.create_record("default", "nfc/base.md", "x")
            for to in ("MEMORY.md/", "MEMORY.md"):
                with pytest.raises(ApiError) as ei:
                    await api.move_prefix("default", "nfc/", to)
                assert ei.value.status == 422 and ei.value.code == "invalid_path", (to, ei.value)
            r = await api.memory_tool("ws", {"command": "rename", "old_path": "/memories/default/nfc",
                                             "new_path": "/memories/default/MEMORY.md"})
            assert r.is_error
            moved = await api.move_prefix("default", "nfc/", "notes/MEMORY.md/")  # not the root
            assert [x.path for x in moved.records] == ["notes/MEMORY.md/base.md"]
            page = await api.list_records("default")
            assert sorted(x.path for x in page.records) == ["notes/MEMORY.md/base.md", "\u00e9.md"]
    finally:
        await fake.aclose()


# ---------------------------------------------------------------- names given: no default-ignorable

def _ignorable() -> list[int]:
    return [cp for a, b in names.DEFAULT_IGNORABLE_RANGES for cp in range(a, b + 1)]


def test_the_default_ignorable_table_is_unicodes():
    """``names.DEFAULT_IGNORABLE_RANGES`` (the one list: names, the prompt block, the secret
    rules) is Unicode's Default_Ignorable_Code_Point, as Perl's copy of the Unicode database
    gives it (``unicodedata`` does not carry the property); skipped without Perl."""
    import shutil
    import subprocess

    if shutil.which("perl") is None:
        pytest.skip("no perl")
    out = subprocess.run(
        ["perl", "-MUnicode::UCD=prop_invlist", "-e",
         'print join(",", prop_invlist("Default_Ignorable_Code_Point")), "\n"'],
        capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.skip(f"no Unicode::UCD: {out.stderr.strip()}")
    inv = [int(x) for x in out.stdout.split(",")]
    ranges = [(inv[i], inv[i + 1] - 1) for i in range(0, len(inv), 2)]
    merged: list[tuple[int, int]] = []
    for a, b in names.DEFAULT_IGNORABLE_RANGES:
        if merged and merged[-1][1] == a - 1:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    assert merged == ranges


def test_a_name_given_holds_no_default_ignorable_code_point():
    """Attack21: ``a\\u3164b.md`` (Hangul filler) or ``a\\u180bb.md`` (Mongolian free variation
    selector) draws as ``ab.md``: every default-ignorable code point is refused in a name
    given, on its own and inside a word, naming the code point; a name that exists keeps
    working (``check_component``: only the category rule)."""
    from memfuse.names import check_new_name, check_new_path

    for cp in _ignorable():
        ch = chr(cp)
        for name in (f"a{ch}b.md", f"{ch}.md"):
            with pytest.raises(NameError_) as ei:
                check_new_name(name)
            assert f"U+{cp:04X}" in ei.value.reason and not ei.value.too_long, hex(cp)
        if unicodedata.category(ch) not in FORBIDDEN_CATEGORIES:
            assert check_component(f"a{ch}b.md")  # made before the rule: still a name
    for path in ("notes/a\u3164b.md", "a\u180bb/x.md", "x/\ufe0f"):
        with pytest.raises(NameError_, match="invisible character"):
            check_new_path(path)
    # the characters around them stay names: Hangul letters, Mongolian letters, a keycap base
    for name in ("\ud55c\uae00.md", "\u1820\u1821.md", "\u2764.md", "\u3163.md", "\u3165.md"):
        assert check_new_name(name) == name


async def test_rest_and_memory_tool_refuse_default_ignorable_names():
    from memfuse.client import ApiClient, ApiError
    from memfuse.fake import FakeControlPlane

    fake = FakeControlPlane()
    try:
        token = await fake.setup("ws", stores=("default",))
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="pytest") as api:
            for path in ("a\u3164b.md", "a\u180bb.md", "d\ufe0f/x.md", "a\u034fb.md"):
                with pytest.raises(ApiError) as ei:
                    await api.create_record("default", path, "x")
                assert ei.value.status == 422 and ei.value.code == "invalid_path", ascii(path)
                r = await api.memory_tool("ws", {"command": "create", "path": f"/memories/default/{path}",
                                                 "file_text": "x"})
                assert r.is_error, ascii(path)
            rec = await api.create_record("default", "ab.md", "x")
            with pytest.raises(ApiError) as ei:
                await api.move_record("default", rec.id, "a\u3164b.md")
            assert ei.value.status == 422, ei.value
            page = await api.list_records("default")
            assert [x.path for x in page.records] == ["ab.md"]
    finally:
        await fake.aclose()
