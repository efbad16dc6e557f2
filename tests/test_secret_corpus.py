"""The secret detector against what an agent would write: a generated corpus of ordinary
notes (no secret may be found in them: the false-positive figure), and every kind of secret
hidden the way the prompt block would undo (a format character inside it, full-width
letters): the detector reads the text as the prompt renders it (``content.secret_view``).

Secret samples are built at run time from pieces, so no credential-shaped literal sits in
the repository.
"""
from __future__ import annotations

import base64
import hashlib
import random
import string
import sys
import unicodedata
import uuid

import pytest

from memfuse import content
from memfuse.content import find_secret, prompt_text, secret_view

ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "_-"
HEX = "0123456789abcdef"

# How many generated notes the false-positive corpus holds, and of which kinds.
NOTES = 3000


def _rnd(r: random.Random, n: int, alphabet: str = ALNUM) -> str:
    while True:
        s = "".join(r.choice(alphabet) for _ in range(n))
        if alphabet != ALNUM or (any(c.isupper() for c in s) and any(c.islower() for c in s)
                                 and any(c.isdigit() for c in s)):
            return s


WORDS = ("the deploy pipeline uses staging before prod; remember to check the dashboards and "
         "ask the user before rotating keys or tokens; password policy requires twelve characters "
         "secret santa is on friday api key rotation happens monthly access token lifetimes are "
         "short database url lives in the vault client secret is managed by the platform team "
         "prefers tabs over spaces likes concise answers meeting notes action items follow up").split()


def _prose(r: random.Random) -> str:
    lines = []
    for _ in range(r.randint(2, 8)):
        lines.append(" ".join(r.choices(WORDS, k=r.randint(6, 18))).capitalize() + ".")
    return "\n".join(lines)


def _note(r: random.Random, i: int) -> str:
    """One ordinary note: Markdown with frontmatter, prose and one or more of hashes, UUIDs,
    base64 images, URLs, code, config with references, JSONL."""
    parts = [f"---\nname: note {i}\ndescription: generated note\ntype: project\n---\n", _prose(r)]
    kinds = r.sample(range(12), k=r.randint(1, 4))
    for k in kinds:
        if k == 0:  # hashes
            data = r.randbytes(32)
            parts.append(f"sha256 {hashlib.sha256(data).hexdigest()}, sha1 {hashlib.sha1(data).hexdigest()}, "
                         f"md5 {hashlib.md5(data).hexdigest()}, commit {hashlib.sha1(data[:9]).hexdigest()[:12]}")
        elif k == 1:  # UUIDs and ids
            parts.append("\n".join(f"- record {uuid.UUID(bytes=r.randbytes(16), version=4)}" for _ in range(r.randint(1, 6))))
        elif k == 2:  # a base64 image
            parts.append(f"![diagram](data:image/png;base64,{base64.b64encode(r.randbytes(r.randint(200, 3000))).decode()})")
        elif k == 3:  # URLs
            host = r.choice(["github.com", "docs.python.org", "example.com", "grafana.internal:3000", "10.0.0.12:8080"])
            parts.append(
                f"See https://{host}/{_rnd(r, 8, string.ascii_lowercase)}/{r.randint(1, 9999)}"
                f"?utm_source=x&sig={_rnd(r, 32)}&page={r.randint(1, 9)}#L{r.randint(1, 300)} "
                f"and ssh://git@{host.split(':')[0]}/team/repo.git and https://user@{host}/login "
                f"and postgresql://app@db.internal:5432/app and redis://localhost:6379/0")
        elif k == 4:  # Python code
            parts.append(
                "```python\nimport os, getpass, secrets\n"
                "password = os.environ['DB_PASSWORD']\n"
                "token = secrets.token_urlsafe(32)\n"
                "api_key = os.getenv('OPENAI_API_KEY')\n"
                f"def check_{_rnd(r, 6, string.ascii_lowercase)}(user, password):\n"
                "    if not password:\n        password = getpass.getpass()\n"
                "    return hashlib.sha256(password.encode()).hexdigest()\n"
                f"HASH = '{hashlib.sha256(r.randbytes(8)).hexdigest()}'\n```")
        elif k == 5:  # config with references and placeholders
            parts.append(
                "```yaml\ndatabase:\n  url: postgresql://${DB_USER}:${DB_PASSWORD}@db:5432/app\n"
                "  password: <from the vault>\n  password_min_length: 12\nsecret_ref: vault:kv/app\n"
                f"api_key: YOUR_API_KEY\nrequest_id: {uuid.UUID(bytes=r.randbytes(16))}\n```")
        elif k == 6:  # JSONL journal
            parts.append("\n".join(
                '{"ts": "2025-%02d-%02dT10:00:00Z", "event": "%s", "id": "%s", "ok": true}'
                % (r.randint(1, 12), r.randint(1, 28), r.choice(["login", "deploy", "token_refresh"]),
                   uuid.UUID(bytes=r.randbytes(16))) for _ in range(r.randint(2, 10))))
        elif k == 7:  # shell and JS
            parts.append(
                "```sh\nexport PGPASSWORD=\"$(vault read -field=password db/creds)\"\n"
                f"curl -H \"Authorization: Bearer $TOKEN\" https://api.example.com/v1/items/{r.randint(1, 99999)}\n"
                "docker run -e POSTGRES_PASSWORD=$POSTGRES_PASSWORD postgres:16\n```\n"
                "```js\nconst secret = process.env.CLIENT_SECRET;\nconst password = form.password.value;\n```")
        elif k == 8:  # prose about credentials
            parts.append("The password: required for prod. The secret: ask Ana. Rotate the api_key: monthly. "
                         "Tokens look like ghp_xxxx or sk_live_xxxx; never paste them here. "
                         "hf_hub_download fetches models; SKU SK-1234 ships Monday.")
        elif k == 9:  # long base64 / hex blobs and identifiers
            parts.append(base64.b64encode(r.randbytes(r.randint(48, 600))).decode())
            parts.append(r.randbytes(40).hex())
        elif k == 10:  # non-ASCII prose
            parts.append("Ünïcödé notes 🙂 日本語のテキスト, ＡＢＣ full-width, ﬁ ligature, café — fine.")
        else:  # a table
            parts.append("| key | value |\n|---|---|\n" + "\n".join(
                f"| {r.choice(['region', 'owner', 'tier'])} | {_rnd(r, 10, string.ascii_lowercase)} |" for _ in range(5)))
    return "\n\n".join(parts) + "\n"


def test_ordinary_notes_hold_no_secret():
    """The false-positive figure: 0 of NOTES generated notes (about 2.5 MB) flagged."""
    r = random.Random(20)
    flagged = []
    total = 0
    for i in range(NOTES):
        note = _note(r, i)
        total += len(note)
        found = find_secret(note)
        if found is not None:
            flagged.append((i, found, note))
    rate = len(flagged) / NOTES
    print(f"\nsecret detector: {len(flagged)} of {NOTES} ordinary notes flagged "
          f"({rate:.2%}), {total / 1e6:.1f} MB", file=sys.stderr)
    assert not flagged, flagged[:3]


def _samples() -> list[tuple[str, str]]:
    """One secret of every kind, as a bare string (no surrounding prose)."""
    from tests.test_content import POSITIVE  # one table of samples

    return POSITIVE


# Format characters an attacker would use to split a token: every Cf character in the Unicode
# database that the prompt block strips (all of them), taken from the database.
CF_CHARS = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]


def test_prompt_text_strips_every_format_character():
    text = "a" + "".join(CF_CHARS) + "b"
    assert prompt_text(text) == "ab"
    assert secret_view("x\u200by") == "xy"


@pytest.mark.parametrize("index", range(0, 60, 3))
def test_a_format_character_inside_any_secret_does_not_hide_it(index: int):
    """Each sample with a format character (cycling over the whole category) inserted in the
    middle of its secret part is still found, as the prompt block would reassemble it."""
    samples = _samples()
    for j, (kind, text) in enumerate(samples):
        cf = CF_CHARS[(index + j) % len(CF_CHARS)]
        mid = len(text) - 10  # inside the secret: every sample ends with its secret part
        hidden = text[:mid] + cf + text[mid:]
        found = find_secret(hidden)
        assert found is not None and found.startswith(kind), (kind, hex(ord(cf)), found)


#: default-ignorable code points that are not Cf (attack 15 F2): the combining grapheme
#: joiner, variation selectors (U+FE0F, U+FE00, a supplementary one), the Mongolian free
#: variation selector, the Khmer inherent vowel, the Hangul fillers: invisible, so a token
#: split by them reads and copies as the token
IGNORABLE = ["\u034f", "\ufe0f", "\ufe00", "\U000e0100", "\u180b", "\u17b4", "\u3164", "\uffa0",
             "\u115f", "\u1160"]


@pytest.mark.parametrize("mark", IGNORABLE, ids=[f"U+{ord(c):04X}" for c in IGNORABLE])
def test_an_invisible_mark_that_is_not_a_format_character_does_not_hide_a_secret(mark: str):
    """Each sample with ``mark`` inserted at three places of its secret part is still found,
    and the prompt block's text drops the mark (fails before attack 15 F2's fix)."""
    for kind, text in _samples():
        n = len(text)
        hidden = text[:n - 12] + mark + text[n - 12:n - 7] + mark + text[n - 7:n - 3] + mark + text[n - 3:]
        found = find_secret(hidden)
        assert found is not None and found.startswith(kind), (kind, found)
        assert mark not in prompt_text(hidden)


def test_full_width_letters_do_not_hide_a_secret():
    for kind, text in _samples():
        wide = "".join(chr(ord(ch) + 0xFEE0) if "!" <= ch <= "~" else ch for ch in text)
        found = find_secret(wide)
        assert found is not None and found.startswith(kind), (kind, found)


def test_the_prompt_block_and_the_detector_share_one_normalisation():
    from memfuse.server import context

    assert context.strip_controls is content.prompt_text
