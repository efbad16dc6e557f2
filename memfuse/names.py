"""Record path and store slug rules (docs/SEMANTICS.md, "Names"), and local-only temporary names
(docs/SEMANTICS.md, "Writes and close").

One implementation for the server (which enforces) and the sidecar (which checks early so a bad
name fails at the syscall with ``EINVAL`` / ``ENAMETOOLONG``).
"""
from __future__ import annotations

import fnmatch
import functools
import re
import unicodedata
from collections.abc import Callable

MAX_COMPONENT_BYTES = 255
MAX_COMPONENTS = 32
MAX_PATH_BYTES = 1024

SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")

#: Unicode general categories no name may hold, from the Unicode database (``unicodedata``):
#: control characters (Cc: U+0000–U+001F, U+007F–U+009F), format characters (Cf: the
#: zero-width characters, every bidi control — embeddings, overrides and isolates
#: U+202A–U+202E, U+2066–U+2069, the marks U+200E, U+200F, U+061C —, U+00AD, U+180E,
#: U+FEFF, the interlinear annotation characters U+FFF9–U+FFFB, tag characters...), line and
#: paragraph separators (Zl, Zp) and surrogates (Cs, a ``str`` decoded with
#: ``surrogateescape``). No exception: ZWJ and ZWNJ (U+200D, U+200C) are refused too (they
#: are invisible, so two names that look the same would be different records). The
#: category comes from the Python running the check (its ``unicodedata.unidata_version``).
FORBIDDEN_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
# every character outside printable ASCII is looked up; printable ASCII never is
_SUSPECT_RE = re.compile(r"[^\x20-\x7e]")


def forbidden_char(name: str) -> str | None:
    """The first character of ``name`` whose general category is in
    :data:`FORBIDDEN_CATEGORIES`, or None. Printable ASCII costs one regex scan."""
    for m in _SUSPECT_RE.finditer(name):
        ch = m.group()
        if unicodedata.category(ch) in FORBIDDEN_CATEGORIES:
            return ch
    return None


DEFAULT_LOCAL_ONLY = (".*.sw?", ".*.swp", ".*.swpx", "4913", "*~", ".#*", "#*#", ".goutputstream-*", ".~lock.*#")


class NameError_(ValueError):
    """A name breaks the rules of docs/SEMANTICS.md, "Names". ``too_long`` tells ENAMETOOLONG from EINVAL."""

    def __init__(self, reason: str, *, too_long: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.too_long = too_long


def check_component(name: str | bytes) -> str:
    """Validate one path component; return it as ``str``.

    Raises ``NameError_`` (``too_long`` set when over 255 bytes) for: empty, over 255 UTF-8
    bytes, not UTF-8, ``.`` or ``..``, a ``/``, or a character of a forbidden Unicode
    category (:data:`FORBIDDEN_CATEGORIES`: control, format — every bidi control among
    them —, line / paragraph separator, surrogate).
    """
    if isinstance(name, bytes):
        raw = name
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise NameError_("name is not valid UTF-8") from None
    else:
        try:
            raw = name.encode("utf-8")
        except UnicodeEncodeError:
            raise NameError_("name is not valid UTF-8") from None
    if not raw:
        raise NameError_("empty name")
    if len(raw) > MAX_COMPONENT_BYTES:
        raise NameError_(f"name is {len(raw)} bytes, limit {MAX_COMPONENT_BYTES}", too_long=True)
    if name in (".", ".."):
        raise NameError_(f"'{name}' is not a valid name")
    if "/" in name:
        raise NameError_("name contains '/'")
    bad = forbidden_char(name)
    if bad is not None:
        raise NameError_(f"name contains forbidden character U+{ord(bad):04X} "
                         f"(Unicode category {unicodedata.category(bad)})")
    return name


def check_path(path: str) -> str:
    """Validate a record path ``a/b/c.md`` (no leading or trailing slash); return it.

    Raises ``NameError_``: bad component (see ``check_component``), more than 32 components
    (``too_long``), more than 1,024 bytes in all (``too_long``).
    """
    if not isinstance(path, str) or not path:
        raise NameError_("empty path")
    parts = path.split("/")
    if len(parts) > MAX_COMPONENTS:
        raise NameError_(f"path has {len(parts)} components, limit {MAX_COMPONENTS}", too_long=True)
    for part in parts:
        check_component(part)
    n = len(path.encode("utf-8"))
    if n > MAX_PATH_BYTES:
        raise NameError_(f"path is {n} bytes, limit {MAX_PATH_BYTES}", too_long=True)
    return path


#: the store's index (``memfuse.content.INDEX_PATH``): at the store's root it is a file, the one
#: the prompt block shows, so no directory may take its name there
INDEX_NAME = "MEMORY.md"


def check_dir_name(parent: str, name: str) -> str:
    """``name`` for a directory made (mkdir, a directory renamed there, an implied parent of
    a record path) in the directory at store-relative path ``parent`` (``""``: the store's
    root): :data:`INDEX_NAME` at the root is refused (the index would become a directory that
    no agent can write, while its prompt block says to create it). Raises ``NameError_``."""
    if name == INDEX_NAME and not parent:
        raise NameError_(f"{INDEX_NAME} at the store's root is the store's index file; it cannot "
                         f"be a directory")
    return name


#: Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt, unchanged from
#: Unicode 14.0 to 16.0; UAX #44): code points a renderer shows as nothing. Beyond the Cf
#: characters (refused in names: :data:`FORBIDDEN_CATEGORIES`) they hold the combining
#: grapheme joiner (U+034F), the variation selectors (U+FE00-FE0F, U+E0100-E01EF: "smuggled"
#: invisible text), the Mongolian free variation selectors, the Khmer inherent vowels, the
#: Hangul fillers (U+115F, U+1160, U+3164, U+FFA0) and reserved ones. ``unicodedata`` does
#: not carry the property; tests/test_names_unicode.py checks this table against Perl's
#: copy of the Unicode database (``Unicode::UCD``) where it is installed. The one list: used
#: by the prompt block (``content.prompt_text``) and the secret rules, by :func:`index_fold`
#: (TR39's skeleton drops them) and by :func:`check_new_name` (no name given holds one).
DEFAULT_IGNORABLE_RANGES: tuple[tuple[int, int], ...] = (
    (0xAD, 0xAD), (0x34F, 0x34F), (0x61C, 0x61C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)

_IGNORABLE_CLASS = "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in DEFAULT_IGNORABLE_RANGES)
#: one default-ignorable code point (:func:`check_new_name` refuses a name holding one)
_IGNORABLE_RE = re.compile("[" + _IGNORABLE_CLASS + "]")
#: what :func:`index_fold` drops: the default-ignorable code points, and U+2800 BRAILLE
#: PATTERN BLANK, which renders as a space (a name that looks like the index could hide them)
_INVISIBLE_RE = re.compile("[" + _IGNORABLE_CLASS + "\\u2800]")

#: Letters of other scripts drawn like the letters of ``memory.md`` (upper or lower case), each
#: mapped to that letter: the entries of Unicode TR39's confusables data (confusables.txt,
#: "skeleton") whose prototype is ``m``/``M``, ``e``/``E``, ``o``/``O``, ``r``/``R``,
#: ``y``/``Y``, ``d``/``D`` or ``.`` and that NFKC does not already fold (it folds the
#: fullwidth, mathematical and letterlike forms: ``ＭＥＭＯＲＹ．ｍｄ``, ``𝐌``, ``ℳ``, ``ⅾ``).
#: Greek, Cyrillic, Coptic, Armenian, Cherokee, Lisu, Canadian syllabics, small capitals,
#: the digit zeros of many scripts for ``o``; ``rn`` for ``m`` is handled in
#: :func:`index_fold`. Only the index's letters: this is not a general confusables table.
_INDEX_LOOKALIKES = {
    "m": "\u039c\u03fa\u041c\u2c98\u13b7\u15f0\u16d6\ua4df\U000102b0\U00010311\u043c\u1d0d",
    "e": "\u0395\u0415\u13ac\ua4f0\u2d39\u22ff\U00010286\u0435\u04bd\uab32\u212e",
    "o": ("0\u039f\u041e\u0555\u2c9e\u2d54\ua4f3\u07c0\u3007\u0b20\u0d20\u09e6\u0b66"
          "\u03bf\u03c3\u043e\u0585\u05e1\u2c9f\u10ff\u101d\u1040\u1d0f\u1d11\uab3d"
          "\u0966\u0a66\u0ae6\u0be6\u0c66\u0ce6\u0d66\u0e50\u0ed0\u0647\u0665\u06f5\u06d5"
          "\u0c02\u0c82\u0d02\u0d82\U00010292\U000102ab\U00010404\U0001042c\U00010516\U000114d0"),
    "r": "\u01a6\u13a1\u13d2\u1587\ua4e3\u0433\u1d26\u2c85\uab47\uab48",
    "y": "\u03a5\u04ae\u2ca8\u13a9\ua4ec\U000102b2\u0443\u04af\u0263\u028f\u03b3\u10e7\u1eff",
    "d": "\u0501\u13e7\u146f\ua4d2\u13a0\u15de\u15ea\ua4d3",
    ".": "\u0660\u06f0\u0701\u0702\ua60e\ua4f8\U00010a50\U0001d16d",
}
_END_RE = re.compile(r"^\s+|[\s.]+$")  # whitespace at the start, whitespace and dots at the end
_INDEX_FOLD_TABLE = str.maketrans({ch: to for to, chars in _INDEX_LOOKALIKES.items() for ch in chars})


def index_fold(name: str) -> str:
    """The form in which two names that a reader would take for one another (in ``ls``, the
    console, a prompt) are equal, for the index's letters: NFKC (compatibility forms:
    fullwidth, mathematical, ligatures, no-break spaces), the invisible characters
    (:data:`DEFAULT_IGNORABLE_RANGES`, U+2800) dropped, the other scripts' look-alikes of ``memory.md``'s
    letters mapped to them (:data:`_INDEX_LOOKALIKES`), case folded (``str.casefold``: a
    case-insensitive disk — macOS, Windows — or a reader takes ``memory.md`` for
    ``MEMORY.md``), combining marks dropped (``MEMORY.m`` + ``ḋ``, ``MEMORY.md`` + U+0332
    COMBINING LOW LINE: attack18 F7), ``rn`` read as ``m``, whitespace at either end and dots at the end removed
    (``"MEMORY.md "`` shows as ``MEMORY.md``; Windows drops trailing spaces and dots).
    After TR39's skeleton (Unicode Technical Standard #39, section 4), restricted to
    what :func:`looks_like_index` needs."""
    s = _INVISIBLE_RE.sub("", unicodedata.normalize("NFKC", name))
    if not s.isascii():  # combining marks dropped: ``MEMORY.md`` + U+0332 draws an underlined d
        s = "".join(c for c in unicodedata.normalize("NFD", s) if unicodedata.category(c) not in ("Mn", "Me"))
    s = s.translate(_INDEX_FOLD_TABLE).casefold().replace("rn", "m")
    return _END_RE.sub("", s)


_INDEX_FOLDED = index_fold(INDEX_NAME)


def looks_like_index(name: str) -> bool:
    """Whether ``name`` (one component) is not :data:`INDEX_NAME` but would be taken for it:
    ``index_fold`` makes them equal (``MEMORY.md `` with a trailing space or U+00A0,
    ``ＭＥＭＯＲＹ.md``, ``memory.md``, ``MEMORY.md`` with a Cyrillic ``М`` / ``Е`` / ``О``,
    ``MEM0RY.md``...). An ASCII name without ``ry`` costs a ``lower()``."""
    if name == INDEX_NAME:
        return False
    if name.isascii() and "ry" not in name.lower():
        return False  # in ASCII only case, 0 for o and rn for m fold: the "ry" stays
    return index_fold(name) == _INDEX_FOLDED


def check_root_name(name: str) -> str:
    """The rule of a name GIVEN at a store's root (create, mkdir, rename target, the first
    component of a path written on any face): it is not a look-alike of the store's index
    (:func:`looks_like_index`), whose name the prompt block and the console show: a
    ``MEMORY.md `` or ``ＭＥＭＯＲＹ.md`` beside (or instead of) the real index would be
    read as the index by an agent or a person. Raises ``NameError_``; names made before
    this rule keep working for every other operation."""
    if looks_like_index(name):
        raise NameError_(f"name {ascii(name)} looks like the store's index {INDEX_NAME} but is "
                         f"not it; the root's {INDEX_NAME} is the only name of that look")
    return name


def check_new_name(name: str) -> str:
    """The rules a name must meet to be GIVEN to a new file or directory (create, mkdir, rename
    target, on every face), beyond :func:`check_component` (which every name already met):
    it holds no default-ignorable code point (:data:`DEFAULT_IGNORABLE_RANGES`: beyond the
    format characters ``check_component`` refuses, the Hangul fillers U+3164 / U+115F /
    U+1160 / U+FFA0, the variation selectors, the Mongolian free variation selectors, U+034F,
    the Khmer inherent vowels...: drawn as nothing, so ``a\u3164b.md`` would be a twin of
    ``ab.md`` that a reader cannot tell apart, attack21), and it is in Unicode normalization
    form C. ``é`` typed as ``e`` + U+0301 (NFD, as macOS
    writes names) and ``é`` as one code point look the same in ``ls``, the console and the
    prompt, so two such names would be two records a reader cannot tell apart (the
    memory-store API refuses non-NFC paths too). Raises ``NameError_``. Names made before
    these rules keep working for every other operation (read, write, delete, rename *from*)."""
    if name.isascii():
        return name
    bad = _IGNORABLE_RE.search(name)
    if bad is not None:
        raise NameError_(f"name contains invisible character U+{ord(bad.group()):04X} (a Unicode "
                         f"default-ignorable code point, drawn as nothing)")
    if not unicodedata.is_normalized("NFC", name):
        nfc = unicodedata.normalize("NFC", name)
        raise NameError_(f"name is not in Unicode normalization form C (NFC); its NFC form "
                         f"{nfc!r} looks the same: use that")
    return name


def check_new_path(path: str) -> str:
    """:func:`check_path` plus the rules of a path a write gives a record (create, move, the
    target of a prefix move): every component meets :func:`check_new_name`, its first
    component :func:`check_root_name` (no look-alike of the index) and, when it is a
    directory, :func:`check_dir_name` (``MEMORY.md/x`` is refused).
    Raises ``NameError_``."""
    check_path(path)
    parts = path.split("/")
    check_root_name(parts[0])
    if len(parts) > 1:
        check_dir_name("", parts[0])
    for part in parts:
        check_new_name(part)
    return path


def check_new_dir_path(path: str) -> str:
    """:func:`check_new_path` for a path a write gives a DIRECTORY (the target prefix of a
    store-wide move, whose records land at ``path/...``): its first component is a directory
    even when it is the only one, so :func:`check_dir_name` applies to it (``MEMORY.md`` is
    refused; ``notes/MEMORY.md`` is not). Raises ``NameError_``."""
    check_new_path(path)
    check_dir_name("", path.split("/")[0])
    return path


def check_slug(slug: str) -> str:
    """Validate a store or workspace slug ``[a-z0-9][a-z0-9._-]{0,62}``; raise ``NameError_``."""
    if not SLUG_RE.match(slug or ""):
        raise NameError_(f"'{slug}' is not a valid slug ([a-z0-9][a-z0-9._-]{{0,62}})")
    return slug


def is_local_only(name: str, patterns: tuple[str, ...] = DEFAULT_LOCAL_ONLY) -> bool:
    """True when ``name`` (one component) is an editor or tool temporary that stays in the
    sidecar: never sent to the control plane, invisible to other workspaces (docs/SEMANTICS.md).
    ``patterns`` are ``fnmatch`` patterns, matched case-sensitively (``fnmatchcase``), all in
    one regular expression (``_local_only_re``): the sidecar asks this twice per file created."""
    return _local_only_re(patterns)(name) is not None


@functools.lru_cache(maxsize=16)
def _local_only_re(patterns: tuple[str, ...]) -> Callable[[str], re.Match[str] | None]:
    """``match`` of one regular expression that matches what any of ``patterns`` matches
    with ``fnmatch.fnmatchcase`` (each ``fnmatch.translate``d, anchored at both ends as
    there). Nothing matches an empty tuple."""
    if not patterns:
        return lambda name: None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


def client_label(value: str | None, limit: int = 100) -> str | None:
    """A client's self-chosen name (``X-Memfuse-Instance``, the memory tool's client) fit
    for an actor (``ws:<workspace>/<label>``, ``tool:<label>``): an HTTP header value arrives
    decoded as Latin-1 (ASGI), so UTF-8 bytes are decoded as UTF-8 where they are that; then
    only printable characters that are not format controls (bidirectional overrides,
    zero-width characters: Unicode category ``Cf``), ``/`` or whitespace are kept, at most
    ``limit`` of them. None when nothing is left."""
    if not value:
        return None
    try:
        value = value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        pass  # not Latin-1-decoded UTF-8: taken as it is
    kept = "".join(ch for ch in value.strip()
                   if ch.isprintable() and not ch.isspace() and ch != "/"
                   and unicodedata.category(ch) != "Cf")
    return kept[:limit] or None
