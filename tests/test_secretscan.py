"""``memfuse.secretscan.AppendScans``: the secret scan of an append from the last one's hints
gives ``content.find_secret``'s answer, hit or miss.

Random appends of fragments that make secrets split across appends (a token's prefix in one
append and its rest in the next, a PEM header before its body, ``password =`` before its
value), hint words kept in the context for many appends, and text that is not its own
``secret_view`` (zero-width characters, ``\\r``, full-width letters, combining marks, other
non-ASCII) are scanned both ways, with the control plane's context
(``tails.scan_context``) and a short one that slides at nearly every append."""
from __future__ import annotations

import hashlib
import random
import string
import unicodedata

import pytest

from memfuse import content
from memfuse.secretscan import AppendScans
from memfuse.server.tails import scan_context


def _tok(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _fragments(rng: random.Random, clean: bool = False) -> list[str]:
    """Fragments to append; ``clean``: only text that is its own ``secret_view``."""
    gh = "ghp_" + _tok(rng, 36)
    aws = "AKIA" + _tok(rng, 16, string.ascii_uppercase + "234567")
    pw = _tok(rng, 12, string.ascii_letters + string.digits + "#!")
    pem_body = "".join(_tok(rng, 64, string.ascii_letters + string.digits + "+/") + "\n" for _ in range(4))
    frags = [
        "a plain line of notes about the build and the deploy\n",
        '{"event": "an agent wrote this line", "n": 3}\n',
        "the api is documented; access rules and auth flows below\n",
        "secret handshake (not a credential)\n",
        gh[:2], gh[2:9], gh[9:] + "\n", gh + "\n",
        aws[:3], aws[3:] + "\n",
        "password = ", pw + "\n", "password: required\n",
        "-----BEGIN PRIVATE KEY-----\n", pem_body, "-----END PRIVATE KEY-----\n",
        "sk-", "ant-api03-" + _tok(rng, 40) + "\n",
        "caf\u00e9 \u2014 na\u00efve\n", "x" * 300, "\n",
    ]
    if not clean:
        frags += ["zero\u200bwidth gh\u200bp_" + _tok(rng, 36) + "\n", "carriage\r\nreturn\r",
                  "\uff47\uff48\uff50\uff3f" + _tok(rng, 36) + "\n", "e\u0301 combining\n", "\u0301"]
    return frags


def _run(rng: random.Random, steps: int, context, clean: bool = False) -> AppendScans:  # type: ignore[no-untyped-def]
    scans = AppendScans()
    frags = _fragments(rng, clean)
    text = ""
    for _ in range(steps):
        if rng.random() < 0.02:
            text = ""  # a new file (its first append scans whole)
        suffix = "".join(rng.choice(frags) for _ in range(rng.randint(1, 3)))
        ctx = context(text)
        base = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() if text else ""
        new_text = text + suffix
        new = hashlib.sha256(new_text.encode("utf-8", "surrogatepass")).hexdigest()
        got = scans.find_secret(ctx, suffix, base, new)
        assert got == content.find_secret(ctx + suffix), (ctx[-80:], suffix)
        text = new_text
    return scans


def _short(text: str, size: int = 120) -> str:
    """``scan_context`` with a context of ``size`` characters (the rule's shape)."""
    start = max(0, len(text) - size)
    if start:
        nl = text.rfind("\n", 0, start)
        start = nl + 1 if nl >= 0 else 0
    return text[start:]


@pytest.mark.parametrize("seed", range(6))
def test_short_context_matches_find_secret(seed: int) -> None:
    scans = _run(random.Random(seed), 1500, _short)
    assert scans.hits > 200  # the kept hints were used, not only whole scans


@pytest.mark.parametrize("seed", range(2))
def test_control_plane_context_matches_find_secret(seed: int) -> None:
    scans = _run(random.Random(100 + seed), 400, scan_context, clean=True)
    assert scans.hits > 50


def test_a_split_token_is_found_at_its_end() -> None:
    scans = AppendScans()
    token = "ghp_R8xkQ2mZp4LwT9vNc3YhJ6bF1sD7gK0aEu5W"
    base = "notes\n" * 10 + token[:6]
    assert scans.find_secret(base, "", "", "s0") is None  # kept under s0
    assert scans.find_secret(base, token[6:] + "\n", "s0", "s1") == content.find_secret(base + token[6:] + "\n")
    assert scans.hits == 1
    assert content.find_secret(base + token[6:] + "\n") is not None


def test_a_context_that_is_not_the_kept_windows_end_is_scanned_whole() -> None:
    scans = AppendScans()
    assert scans.find_secret("plain notes\n", "more\n", "", "s0") is None
    other = "AKIA" + "QW3RT5YU7IO2PA4SD6FG" + "\n"  # same key, another text: not a suffix of it
    assert scans.find_secret(other, "x\n", "s0", "s1") == content.find_secret(other + "x\n")
    assert scans.hits == 0


# ---------------------------------------------------------------- the scan before its gates
# (session 15): every rule tried whose hint is in the text, one ``in`` per hint, and the
# regex test of ``prompt_text``; the reference the gated scan must agree with, answer for answer


def _old_first_secret(text: str, in_name: bool = False):  # type: ignore[no-untyped-def]
    low = text.lower()
    for rule in content._RULES:
        if not any(h in (low if rule.lower else text) for h in rule.hints):
            continue
        for m in content._matches(rule, text, low):
            if rule.check(m, text) and (not in_name or content._name_check(rule, m)):
                return rule, m
    return None


def _old_view(text: str) -> str:
    text = text.replace("\r\n", "\n")
    if content._SUSPECT_RE.search(text) is not None:
        text = content._stripper().sub("", text)
    return text if text.isascii() else unicodedata.normalize("NFKC", text)


def _old_find_secret(text: str) -> str | None:
    # the views of session 17 (gaps, look-alikes: content.secret_view), then session 15's
    view = content.secret_view(text)
    found = _old_first_secret(view)
    for alt in (_old_view(text), text):
        if found is None and alt != view:
            found = _old_first_secret(alt)
            if found is not None:
                return content._secret_reason(found, alt)
    return content._encoded_secret(view) if found is None else content._secret_reason(found, view)


def _old_find_secret_in_path(path: str) -> tuple[str, int, str] | None:
    """(kind, component, redacted path), or None."""
    parts = path.split("/")
    for i, comp in enumerate(parts):
        view = content.secret_view(comp)
        bases = [comp, view] if view != comp else [comp]
        for text, base in [(b, b) for b in bases] + [(b.replace("_", " "), b) for b in bases if "_" in b]:
            found = _old_first_secret(text, in_name=True)
            if found is not None:
                red = content._redact_at(base, found[1])
                rest = [(_old_find_secret_in_path(c) or ("", 0, c))[2] for c in parts[i + 1:]]
                return found[0].kind, i + 1, "/".join(parts[:i] + [red] + rest)
    return None


def _old_hints_in(text: str) -> frozenset[content.Hint]:
    low = text.lower()
    return frozenset((r.lower, h) for r in content._RULES for h in r.hints if h in (low if r.lower else text))


_SECRETS = ["ghp_" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3kM5", "AKIA2E3F4G5H6J7K2L3M", "password=Xy7#kLm2pQ",
            "sk-ant-api03-" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3kM5oQ7", "mf_" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3kM5oQ7sU9wY",
            "xoxb-2345678901-2345678901234-aB3dE5gH7jK9mN1pQ3sT5vX7", "api_key = 'aB3dE5gH7jK9mN1pQ3sT5vX7'",
            "postgresql://app:Xy7kLm2pQz9@db/app", "-----BEGIN PRIVATE KEY-----\n" + "QUJD" * 30 + "\n",
            "glpat-aB3dE5gH7jK9mN1pQ3sT", "AIza" + "SyaB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3k"]


def _pieces(rng: random.Random) -> list[str]:
    """Fragments for texts and names: every hint, hints in other cases, secrets whole and cut,
    characters that lower-casing lengthens or changes (``İ``, the Kelvin sign), that
    ``prompt_text`` removes (controls, zero-width, ``\\r``) and that NFKC folds (full-width)."""
    hints = [h for r in content._RULES for h in r.hints]
    out = hints + [h.upper() for h in hints] + [h.title() for h in hints] + _SECRETS
    out += [s[:rng.randint(1, len(s))] for s in _SECRETS] + [s[rng.randint(0, len(s) - 1):] for s in _SECRETS]
    out += ["İ", "\u212a", "K", "_", "-", ".", ":", "/", " ", "\n", "\t", "\r\n", "\r", "\x7f", "\x01", "\u200b",
            "\ufeff", "\uff47\uff48\uff50\uff3f", "caf\u00e9", "e\u0301", "notes", "the agent prefers tea",
            "2026-12-03", "r0", "d7", "123.md", "ASIA-pacific.md", "sk-learn.md", "my_plan"]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_gated_scan_gives_the_old_scans_answers(seed: int) -> None:
    """``find_secret``, ``find_secret_in_path``, ``hints_in`` and ``prompt_text`` answer as the
    scan before its gates (one ``in`` per hint, the regex test of ``prompt_text``, no test of
    the whole path first) for random texts and paths made of hints, secrets whole and cut,
    and characters that lower-casing, ``prompt_text`` or NFKC change (the sidecar and the
    control plane both call these: their verdicts stay the old ones)."""
    rng = random.Random(seed)
    pieces = _pieces(rng)
    found = in_text = 0
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        reason = content.find_secret(text)
        assert reason == _old_find_secret(text), repr(text)
        in_text += reason is not None
        assert content.hints_in(text) == _old_hints_in(text), repr(text)
        view = text.replace("\r\n", "\n")
        assert content.prompt_text(text) == (view if content._SUSPECT_RE.search(view) is None
                                             else content._stripper().sub("", view)), repr(text)
        path = "/".join(rng.choice(pieces).replace("/", "") or "x" for _ in range(rng.randint(1, 4)))
        got = content.find_secret_in_path(path)
        assert (None if got is None else (got.kind, got.component, got.redacted)) == _old_find_secret_in_path(path), repr(path)
        found += got is not None
    assert found > 100 and in_text > 100  # texts and names with secrets were among them


def test_the_gated_scan_fails_when_a_hint_is_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference catches a gate that loses a hint (the scan above is not vacuous)."""
    gated = content._GATED
    broken = (tuple((g, hs) for g, hs in gated[0] if g != "_"), gated[1])
    monkeypatch.setattr(content, "_GATED", broken)
    text = _SECRETS[0]
    assert content.find_secret(text) is None and _old_find_secret(text) is not None
