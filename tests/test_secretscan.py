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


def test_rules_skipped_by_length_are_exactly_those_that_cannot_match(monkeypatch):
    """``_first_secret`` skips a rule whose shortest hint is longer than the text (``lower``
    rules: than the lower-cased text, which ``str.lower`` can lengthen): it finds what the scan
    without the skip finds, for every rule's secrets and names cut at every length, with
    characters that change length or case when lower-cased in front."""
    samples = [h for r in content._RULES for h in r.hints]
    samples += ["ghp_" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3kM5", "AKIA2E3F4G5H6J7K2L3M", "password=Xy7#kLm2pQ",
                "sk-ant-api03-" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3kM5oQ7", "mf_" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3kM5oQ7sU9wY"]
    texts = [p + s[:n] for s in samples for n in range(len(s) + 1) for p in ("", "İ", "K", "_")]
    found = [content._first_secret(t) for t in texts]
    present = [content.hints_in(t) for t in texts]
    unskipped = tuple((r, h, lower, 0) for r, h, lower, _ in content._HINTED)
    monkeypatch.setattr(content, "_HINTED", unskipped)
    for t, f, p in zip(texts, found, present, strict=True):
        ref = content._first_secret(t)
        assert (None if f is None else (f[0].kind, f[1].span())) == (None if ref is None else (ref[0].kind, ref[1].span())), t
        assert p == content.hints_in(t), t
    assert sum(f is not None for f in found) >= 4  # the full secrets are found
