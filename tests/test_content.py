"""The shared content rules of memfuse.content: types, UTF-8, secrets.

Secret samples are built at run time from pieces (a prefix plus generated characters), so no
literal credential-shaped string sits in the repository for a scanner to find.
"""
from __future__ import annotations

import base64
import json
import random
import string
import time

import pytest

from memfuse import content
from memfuse.content import (
    SECRET_KINDS,
    ContentError,
    InvalidContent,
    InvalidType,
    SecretDetected,
    check_secrets,
    check_type,
    check_utf8,
    find_secret,
    frontmatter_type,
    record_type,
)

ALNUM = string.ascii_letters + string.digits
UPPER_DIGITS = string.ascii_uppercase + string.digits
URLSAFE = ALNUM + "_-"


def rnd(n: int, alphabet: str = ALNUM, seed: int = 0) -> str:
    """``n`` characters that look random (deterministic per seed), with every class of the
    alphabet present."""
    r = random.Random(f"{seed}-{n}-{alphabet}")
    while True:
        s = "".join(r.choice(alphabet) for _ in range(n))
        if not any(c.isalpha() for c in alphabet) or (
            (not any(c.isupper() for c in alphabet) or any(c.isupper() for c in s))
            and (not any(c.islower() for c in alphabet) or any(c.islower() for c in s))
            and (not any(c.isdigit() for c in alphabet) or any(c.isdigit() for c in s))
        ):
            return s


def b64(nbytes: int, seed: int = 0) -> str:
    r = random.Random(seed)
    return base64.b64encode(r.randbytes(nbytes)).decode()


def b64url_json(obj: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def pem(label: str, lines: int = 8, seed: int = 1) -> str:
    body = b64(48 * lines, seed)
    return (
        f"-----BEGIN {label}-----\n"
        + "\n".join(body[i : i + 64] for i in range(0, len(body), 64))
        + f"\n-----END {label}-----\n"
    )


def jwt() -> str:
    return ".".join(
        [b64url_json({"alg": "HS256", "typ": "JWT"}), b64url_json({"sub": "42", "iat": 1700000000}), rnd(43, URLSAFE)]
    )


# kind reported → sample text (each embedded in a little context)
POSITIVE: list[tuple[str, str]] = [
    ("private key", "my deploy key:\n" + pem("RSA " + "PRIVATE KEY")),
    ("private key", pem("EC " + "PRIVATE KEY", 3)),
    ("private key", pem("OPENSSH " + "PRIVATE KEY", 6)),
    ("private key", pem("PRIVATE" + " KEY", 10)),
    ("private key", pem("ENCRYPTED " + "PRIVATE KEY", 10)),
    (
        "private key",
        "-----BEGIN PGP " + "PRIVATE KEY BLOCK-----\nVersion: GnuPG v2\nComment: test\n\n"
        + b64(300, 4)[:64] + "\n" + b64(300, 5)[:64] + "\n-----END PGP PRIVATE KEY BLOCK-----\n",
    ),
    (
        "private key",
        "-----BEGIN RSA " + "PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,00FF\n\n"
        + b64(48, 6) + "\n-----END RSA PRIVATE KEY-----\n",
    ),
    (
        "private key (PuTTY)",
        "PuTTY-User-Key-File-" + "2: ssh-rsa\nEncryption: none\nComment: k\nPublic-Lines: 1\n" + b64(60, 7)
        + "\nPrivate-Lines: 1\n" + b64(60, 8) + "\n",
    ),
    (
        "GCP service-account private key",
        json.dumps(
            {"type": "service_account", "project_id": "p", "private_key_id": rnd(40, "0123456789abcdef"),
             "private_key": pem("PRIVATE" + " KEY", 10), "client_email": "x@p.iam.gserviceaccount.com"},
            indent=2,
        ),
    ),
    ("GCP API key", "maps key: " + "AI" + "za" + rnd(35, URLSAFE)),
    ("GCP OAuth client secret", "client_secret=" + "GOC" + "SPX-" + rnd(28, URLSAFE)),
    ("AWS access key id", "aws_access_key_id = " + "AK" + "IA" + rnd(16, UPPER_DIGITS)),
    ("AWS access key id", "temporary: " + "AS" + "IA" + rnd(16, UPPER_DIGITS) + "."),
    ("AWS secret access key", "aws_secret_access_key = " + b64(30, 9)),
    ("AWS secret access key", "export AWS_SECRET_ACCESS_KEY=" + b64(30, 10) + "\n"),
    ("AWS secret access key", '{"SecretAccessKey": "' + b64(30, 11) + '"}'),
    (
        "Azure storage or service-bus key",
        "DefaultEndpointsProtocol=https;AccountName=acct;Account" + "Key=" + b64(64, 12) + ";EndpointSuffix=core.windows.net",
    ),
    (
        "Azure storage or service-bus key",
        "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=root;SharedAccess" + "Key=" + b64(32, 13),
    ),
    ("GitHub token", "GITHUB_TOKEN=" + "gh" + "p_" + rnd(36)),
    ("GitHub token", "oauth " + "gh" + "o_" + rnd(36)),
    ("GitHub token", "gh" + "u_" + rnd(36)),
    ("GitHub token", "installation token " + "gh" + "s_" + rnd(36)),
    ("GitHub token", "gh" + "r_" + rnd(76)),
    ("GitHub fine-grained token", "github" + "_pat_" + rnd(22) + "_" + rnd(59)),
    ("GitLab token", "token: " + "gl" + "pat-" + rnd(20, URLSAFE)),
    ("GitLab token", "runner " + "gl" + "rt-" + rnd(20, URLSAFE)),
    ("GitLab runner registration token", "--registration-token " + "GR134" + "8941" + rnd(20, URLSAFE)),
    ("Slack token", "bot: " + "xo" + "xb-" + rnd(12, string.digits) + "-" + rnd(13, string.digits) + "-" + rnd(24)),
    ("Slack token", "xo" + "xp-" + "-".join(rnd(n, string.digits, i) for i, n in enumerate((12, 12, 13))) + "-" + rnd(32, "0123456789abcdef")),
    ("Slack token", "xo" + "xa-2-" + rnd(12, string.digits) + "-" + rnd(30)),
    ("Slack app token", "xa" + "pp-1-A" + rnd(10, UPPER_DIGITS) + "-" + rnd(13, string.digits) + "-" + rnd(64, "0123456789abcdef")),
    (
        "Slack webhook URL",
        "post to https://hooks.slack.com/" + "services/T" + rnd(8, UPPER_DIGITS) + "/B" + rnd(10, UPPER_DIGITS) + "/" + rnd(24),
    ),
    ("OpenAI API key", "OPENAI_API_KEY=" + "s" + "k-" + rnd(48)),
    ("OpenAI API key", "key = '" + "s" + "k-proj-" + rnd(156, URLSAFE) + "'"),
    ("OpenAI API key", "s" + "k-svcacct-" + rnd(120, URLSAFE)),
    ("Anthropic API key", "ANTHROPIC_API_KEY=" + "s" + "k-ant-api03-" + rnd(93, URLSAFE) + "AA"),
    ("Anthropic API key", "s" + "k-ant-admin01-" + rnd(93, URLSAFE) + "AA"),
    ("memfuse token", "MEMFUSE_TOKEN=" + "m" + "f_" + rnd(43, URLSAFE)),
    ("memfuse token", "admin token: " + "m" + "fa_" + rnd(43, URLSAFE)),
    ("memfuse token", "m" + "fw_" + rnd(43, URLSAFE) + " is the workspace token"),
    ("Stripe key", "api_key=" + "s" + "k_live_" + rnd(24)),
    ("Stripe key", "r" + "k_test_" + rnd(99)),
    ("npm token", "//registry.npmjs.org/:_authToken=" + "n" + "pm_" + rnd(36)),
    ("PyPI token", "password = " + "py" + "pi-AgEIcHlwaS5vcmc" + rnd(120, URLSAFE)),
    ("Hugging Face token", "HF_TOKEN=" + "h" + "f_" + rnd(34, string.ascii_letters)),
    ("SendGrid API key", "S" + "G." + rnd(22, URLSAFE) + "." + rnd(43, URLSAFE)),
    ("Twilio API key", "twilio " + "S" + "K" + rnd(32, "0123456789abcdef")),
    ("DigitalOcean token", "d" + "op_v1_" + rnd(64, "0123456789abcdef")),
    ("Google OAuth access token", "Authorization: Bearer " + "ya" + "29." + rnd(150, URLSAFE)),
    ("URL with a password", "DATABASE_URL=postgresql://app:" + "Zq8vR2kLm" + "@db.internal:5432/app"),
    ("URL with a password", "mongodb+srv://svc:" + rnd(20) + "@cluster0.mongodb.net/prod"),
    ("URL with a password", "REDIS_URL=redis://:" + "Tr0ub4dor3xyzQ9" + "@cache:6379/0"),  # attack18 F3
    ("URL with a password", "postgresql://app:" + "S3cr3tP4ssw0rdXyz%40" + "@db.internal/app"),
    ("password assignment", "password = " + "Tr0ub4dor&3"),
    ("password assignment", 'POSTGRES_PASSWORD: "' + rnd(12) + '"'),
    ("secret assignment", "client_secret = " + rnd(32)),
    ("JSON Web Token", "Authorization: Bearer " + jwt()),
    ("JSON Web Token", "the session cookie was " + jwt() + ". Then it expired."),
]


@pytest.mark.parametrize(("kind", "text"), POSITIVE, ids=[f"{k}-{i}" for i, (k, _) in enumerate(POSITIVE)])
def test_secret_found(kind: str, text: str):
    assert kind in SECRET_KINDS
    reason = find_secret(text)
    assert reason is not None and reason.startswith(kind + " on line "), reason
    # embedded in a larger Markdown file it is still found, on the right line
    doc = "# Notes\n\nSome text.\n\n" + text + "\n\nMore text.\n"
    found = find_secret(doc)
    assert found is not None and found.startswith(kind + " on line ")
    assert int(found.rsplit(" ", 1)[1]) >= 5
    # the reason never carries the secret's characters beyond the kind and line
    assert len(reason) < 60
    with pytest.raises(SecretDetected) as ei:
        check_secrets(text)
    assert kind in ei.value.reason and ei.value.code == "secret_detected"


def test_every_kind_has_a_sample():
    assert {k for k, _ in POSITIVE} == set(SECRET_KINDS)


def test_reason_names_the_line():
    text = "a\nb\n\nkey " + "gh" + "p_" + rnd(36) + "\n"
    assert find_secret(text) == "GitHub token on line 4"


NEGATIVE = [
    # prose
    "We decided to rotate the API token every 90 days. The password policy needs 12 characters.",
    "Remember: never paste your private key, access key or token into chat.",
    "The user prefers tabs. Their GitHub handle is @octo-cat; ask before force-pushing.",
    "Discussed the secret santa list; Anna's key takeaway: ship on Friday.",
    "The AWS docs use AKIAIOSFODNN7EXAMPLE as their sample access key id.",
    "A PEM file starts with -----BEGIN RSA PRIVATE KEY----- and ends with -----END RSA PRIVATE KEY-----.",
    # Markdown, with placeholders as documentation shows them
    "# Setup\n\n1. Export `GITHUB_TOKEN=ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx`\n2. Run `make`.\n",
    "| name | value |\n|---|---|\n| password | <placeholder> |\n| token | `<your token>` |\n",
    "password: <your password here>\napi_key: ${OPENAI_API_KEY}\ntoken: REDACTED\n",
    "OPENAI_API_KEY=sk-...\nANTHROPIC_API_KEY=sk-ant-...\nAWS_SECRET_ACCESS_KEY=<secret>\n",
    "OPENAI_API_KEY=sk-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n",
    "aws_access_key_id = AKIAXXXXXXXXXXXXXXXX\n",
    "-----BEGIN OPENSSH PRIVATE KEY-----\n<paste your key here>\n-----END OPENSSH PRIVATE KEY-----\n",
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC...\n-----END PRIVATE KEY-----\n",
    "Webhook: https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX\n",
    "See https://github.com/octo/repo/pull/123 and https://example.com/path?token=abc&sig=xyz.\n",
    "DSN = 'postgresql://app:%(password)s@db.internal/app' and redis://:${REDIS_PASSWORD}@cache:6379/0\n",
    "redis://:%3Cpassword%3E@cache:6379 (fill in), http://[::1]:8080/ and ws://:443@x\n",
    "- [user role](user_role.md): senior engineer, prefers short answers\n- [testing](feedback_testing.md)\n",
    "---\nname: testing\ndescription: integration tests hit a real database\nmetadata:\n  type: feedback\n---\n\nBody.\n",
    # code
    "def get_token(user):\n    token = secrets.token_urlsafe(32)\n    password = getpass.getpass()\n    return token\n",
    "const apiKey = process.env.OPENAI_API_KEY;\nconst secret = config.get('secret');\n",
    "class TaskRunner:\n    task_queue_worker_pool_size_limit_default = 32  # sk-learn style names\n",
    ".sk-spinner-double-bounce-container-wrapper-element { display: none; }\n",
    'headers = {"Authorization": f"Bearer {token}"}\nAKIA = "prefix constant"\n',
    "SELECT * FROM users WHERE api_key = :api_key AND secret_access_key IS NOT NULL;\n",
    "jwt = encode({'alg': 'HS256'}, key)\n# a JWT looks like xxxxx.yyyyy.zzzzz\n",
    # identifiers and hashes
    "id 123e4567-e89b-12d3-a456-426614174000, trace 550e8400-e29b-41d4-a716-446655440000\n",
    "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n",
    "git commit 34ce53721fa7c2a8e1f3d5b7a9c0e2f4a6b8d0c1, md5 d41d8cd98f00b204e9800998ecf8427e\n",
    # base64 of non-secrets (text, JSON, random bytes)
    base64.b64encode(("Lorem ipsum dolor sit amet, " * 40).encode()).decode(),
    base64.b64encode(json.dumps({"hello": "world", "n": list(range(50))}).encode()).decode(),
    "data:image/png;base64," + b64(3000, 99),
    "\n".join(b64(48, s) for s in range(40)),
    # JSONL journal
    '{"ts": "2024-05-01T10:00:00Z", "event": "login", "user": "ana", "token_used": false}\n' * 20,
    # non-ASCII
    "Ünïcödé prose with emoji 🙂 and 日本語のテキスト, key: value\n",
]


@pytest.mark.parametrize("text", NEGATIVE, ids=[f"neg-{i}" for i in range(len(NEGATIVE))])
def test_no_false_positive(text: str):
    assert find_secret(text) is None


def test_placeholders_with_vendor_prefixes_are_not_secrets():
    for text in [
        "gh" + "p_" + "x" * 36,
        "AK" + "IA" + "X" * 16,
        "s" + "k-" + "0" * 48,
        "s" + "k-proj-" + "x" * 60,
        "gl" + "pat-" + "x" * 20,
        "xo" + "xb-0000-0000-" + "x" * 24,
        "AI" + "za" + "X" * 35,
    ]:
        assert find_secret(text) is None, text


def test_secret_inside_a_longer_word_is_not_a_vendor_prefix():
    assert find_secret("mask" + "ghp_" + rnd(36)) is None
    assert find_secret("TASK-" + rnd(48)) is None


def test_secret_scan_is_fast_on_1_mib():
    r = random.Random(3)
    words = ["".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(2, 9))) for _ in range(3000)]
    prose = ""
    while len(prose) < 1 << 20:
        prose += " ".join(r.choices(words, k=12)) + ".\n"
    adversarial = [
        prose,
        b64(786432, 5),
        ("eyJ" + "a" * 20 + ".") * 40000,
        ("xo" + "xb-" + "1-" * 50) * 8000,
        ("-----BEGIN RSA " + "PRIVATE KEY-----\n") * 30000,
        "aws_secret=" * 100000,
        ("s" + "k-") * 300000,
        "A" * (1 << 20),
    ]
    for text in adversarial:
        t0 = time.thread_time()
        assert find_secret(text) is None
        # CPU time, which a busy machine does not inflate as it does wall time (2.3 s of wall
        # time were seen at a load of 17): about 50-150 ms here; a regression to quadratic
        # time would take minutes
        assert time.thread_time() - t0 < 3.0
    big = prose + "\n" + "gh" + "p_" + rnd(36) + "\n"
    assert find_secret(big) is not None and find_secret(big).startswith("GitHub token on line ")


def _forms(tok: str) -> dict[str, str]:
    """A token disguised or encoded (attack17 F2), on line 2 of a note."""
    rot = tok.translate(str.maketrans(string.ascii_letters, string.ascii_lowercase[13:] + string.ascii_lowercase[:13]
                                      + string.ascii_uppercase[13:] + string.ascii_uppercase[:13]))
    forms = {f"gap U+{c:04X}": f"{tok[:10]}{chr(c)}{tok[10:]}"
             for c in (0x2800, 0x0301, 0x20E3, 0x00A0, 0x2007, 0x3000, 0x200A, 0x202F, 0x1680)}
    forms.update({
        "two gaps": f"{tok[:6]}\u00a0\u0301{tok[6:20]}\u2800{tok[20:]}",
        "cyrillic p": tok.replace("p", "\u0440", 1),
        "full-width g and cyrillic p": "\uff47h\u0440" + tok[3:],
        "armenian h": tok.replace("h", "\u0570", 1),
        "double low line": tok.replace("_", "\u2017", 1),
        "modifier low macron": tok.replace("_", "\u02cd", 1),
        "json escape": '{"t": "\\u0067hp_' + tok[4:] + '"}',
        "json surrogate pair and escapes": '{"e": "\\ud83d\\ude00\\n", "t": "gh\\u0070\\u005f' + tok[4:] + '"}',
        "python hex escape": "gh\\x70_" + tok[4:],
        "percent": "%67" + tok[1:],
        "percent in a URL": "https://x.example/?t=gh%70%5F" + tok[4:],
        "html decimal": "&#103;" + tok[1:],
        "html hex": "&#x67;&#x68;" + tok[2:],
        "html named": "ghp&lowbar;" + tok[4:],
        "stray backslash": "gh\\p_" + tok[4:],
        "markdown escape": "ghp\\_" + tok[4:],
        "base64": base64.b64encode(tok.encode()).decode(),
        "base64 of a line": base64.b64encode(f"export GITHUB_TOKEN={tok}\n".encode()).decode(),
        "base64url": base64.urlsafe_b64encode(f"t={tok}".encode()).decode().rstrip("="),
        "hex": tok.encode().hex(),
        "hex upper case": tok.encode().hex().upper(),
        "rot13": rot,
    })
    return {name: f"# notes\ntoken: {form} (kept)\n" for name, form in forms.items()}


@pytest.mark.parametrize("name", list(_forms("x")))
def test_disguised_and_encoded_tokens_are_found_and_never_named(name: str) -> None:
    """Each form is a GitHub token on line 2; the reason holds no part of it, and
    ``redact_secrets`` leaves none of it either (attack17 F2)."""
    tok = "gh" + "p_" + rnd(36)
    text = _forms(tok)[name]
    reason = find_secret(text)
    assert reason is not None and reason.startswith("GitHub token") and reason.endswith(" on line 2"), (name, reason)
    assert tok[4:12] not in reason
    red = content.redact_secrets(text)
    assert tok[4:] not in red and tok[12:] not in red and find_secret(red) is None, red


@pytest.mark.parametrize("dash", ["\u2010", "\u2011", "\u2012", "\u2013", "\u2212", "\ufe63", "\uff0d"])
def test_an_anthropic_key_with_look_alike_hyphens_is_found(dash: str) -> None:
    """attack18 F1: ``sk-ant-api03-…`` with its hyphens swapped for a look-alike (U+2011
    non-breaking hyphen, U+2212 minus, …) reads as the key in the prompt: refused."""
    key = "s" + "k-ant-api03-" + rnd(93, URLSAFE) + "AA"
    text = "# notes\nkey: " + key.replace("-", dash) + "\n"
    reason = find_secret(text)
    assert reason is not None and reason.startswith("Anthropic API key") and reason.endswith("on line 2"), reason


def test_dashes_in_prose_are_not_secrets() -> None:
    """Dashes read as hyphens make no secret of ordinary prose."""
    assert find_secret("Plans \u2014 the sk\u2013ant idea \u2212 was dropped; ghp\u2017 is a prefix.\n") is None


def test_base64_of_a_bare_aws_key_id_is_found() -> None:
    """attack18 F4: a 20-character AWS access key id is 27 base64 characters and a ``=``."""
    kid = "AKIA" + "Q3EGRVNUZ7XK2M5P"
    enc = base64.b64encode(kid.encode()).decode()
    assert len(enc.rstrip("=")) == 27
    reason = find_secret("# keys\nid: " + enc + "\n")
    assert reason is not None and reason.startswith("AWS access key id") and reason.endswith("on line 2"), reason
    assert find_secret("id: " + base64.urlsafe_b64encode(kid.encode()).decode().rstrip("=") + "\n") is not None


def test_a_reversed_token_after_a_right_to_left_override_is_found() -> None:
    """attack18 F2: ``\\u202e`` + the token written backwards is drawn as the token."""
    tok = "gh" + "p_" + rnd(36)
    reason = find_secret("# notes\nsee \u202e" + tok[::-1] + " here\nmore\n")
    assert reason is not None and reason.startswith("GitHub token") and reason.endswith("on line 2"), reason
    assert find_secret("plain " + tok[::-1] + "\n") is None  # backwards without the override: drawn backwards
    assert find_secret("\u202eordinary text, reversed\n") is None


def test_gaps_are_dropped_only_between_token_characters() -> None:
    """The scan view drops a blank-looking character or a combining mark inside a run of
    token characters, keeps it elsewhere (NFKC then makes a no-break space a space), keeps
    every line, and reads look-alike letters as ASCII; ASCII text is returned as is."""
    assert content.secret_view("a\u00a0b c\u00a0 d\u00a0\n") == "ab c  d \n"
    assert content.secret_view("cafe\u0301 x\u2800y") == "caf\u00e9 xy"
    assert content.secret_view("\u0440\u0430\u0441 \u03bf") == "pac o"
    ascii_text = "plain: 100% R&D \\n\n"
    assert content.secret_view(ascii_text) is ascii_text


def test_decoded_view_keeps_lines_and_undoes_one_level() -> None:
    assert content.decoded_view("a\\nb %0A c &#10; d\n\\u0041%2541&amp;lt;") == "a b   c   d\nA%41&lt;"
    assert content.decoded_view("no escapes here") == "no escapes here"


def test_the_new_passes_find_nothing_in_the_repositorys_docs_and_code() -> None:
    """False positives of the escaped / base64 / hex / rot13 passes and of the gap and
    look-alike view over the project's own prose, Markdown, JSON and code: none."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    files = [*root.glob("docs/**/*.md"), root / "README.md", root / "bench" / "README.md",
             *root.glob("memfuse/**/*.py"), *root.glob("bench/*.py"), *root.glob("**/*.json")]
    scanned = 0
    for f in files:
        if not f.is_file() or ".venv" in f.parts:
            continue
        text = f.read_text(encoding="utf-8")
        view = content.secret_view(text)
        if content._first_secret(view) is None:  # (docs/API.md's example password: as before)
            assert content._encoded_secret(view) is None, f
        else:  # what the gap / look-alike view finds, the session-15 view finds too
            assert content._first_secret(content._nfkc_view(text)) is not None, f
        scanned += len(text)
    assert scanned > 1 << 20


def test_the_new_passes_stay_linear_on_adversarial_text() -> None:
    """A quarter MiB made of what each new pass works on: escapes (one Python call per run),
    base64-looking runs (one decode each), gaps, look-alikes. Generous bound: ~0.05-0.2 s
    here; a quadratic pass would take minutes."""
    adversarial = [
        "&#65;x" * 45000,
        "\\u0041 " * 33000,
        "%41 " * 65000,
        "\\p" * 125000,
        ("Z2hw" * 8 + " ") * 8000,
        ("0a" * 20 + " ") * 6400,
        "a\u00a0" * 125000,
        "e\u0301" * 125000,
        "\u0440\u0430 " * 90000,
    ]
    for text in adversarial:
        t0 = time.perf_counter()
        assert find_secret(text) is None
        assert time.perf_counter() - t0 < 3.0


# ---------------------------------------------------------------- types


def test_record_type_rules():
    assert record_type("a.md", "---\ntype: user\n---\nbody", None, "project") == "user"
    assert record_type("a.md", "---\nname: x\nmetadata:\n  type: feedback\n---\n", None, "project") == "feedback"
    assert record_type("a.md", "---\ntype: user\nmetadata:\n  type: feedback\n---\n", None, "project") == "user"
    assert record_type("a.md", "---\ntype: user\n---\n", "reference", "project") == "reference"
    assert record_type("a.md", "no frontmatter", None, "project") == "project"
    assert record_type("a.md", "no frontmatter", None, "user") == "user"  # e.g. the current type on update
    assert record_type("a.md", "---\r\ntype: user\r\n---\r\nbody", None, "project") == "user"
    assert record_type("a.md", "\ufeff---\ntype: reference\n---\n", None, "project") == "reference"
    assert record_type("a.md", "---\ntype: user\n...\nbody", None, "project") == "user"
    assert record_type("a.md", "text\n---\ntype: user\n---\n", None, "project") == "project"  # not at the start
    assert record_type("a.md", "---\ntype: user\n", None, "project") == "project"  # never closed
    assert record_type("a.md", "---\ntype: null\n---\n", None, "project") == "project"
    assert record_type("MEMORY.md", "---\ntype: user\n---\n", "user", "project") is None
    assert record_type("sub/MEMORY.md", "x", None, "project") == "project"
    # not validated: check_type refuses
    assert record_type("a.md", "---\ntype: diary\n---\n", None, "project") == "diary"


@pytest.mark.parametrize(
    "bad_yaml",
    [
        "---\ntype: [unclosed\n---\n",
        "---\n: : :\n---\n",
        "---\n- a list\n- not a mapping\n---\n",
        "---\njust a string\n---\n",
        "---\n\tbad: indent\n---\n",
        "---\na: &a [*a]\n---\n",
        "---\n!!python/object:os.system {}\n---\n",
        "---\n" + "[" * 5000 + "\n---\n",
        "---\n" + "x: y\n" * 20000 + "---\n",  # closing fence beyond 64 KiB: not frontmatter
    ],
)
def test_bad_frontmatter_is_ignored(bad_yaml: str):
    assert frontmatter_type(bad_yaml) is None
    assert record_type("a.md", bad_yaml, None, "project") == "project"


@pytest.mark.parametrize("value", ["2026-02-30", "0000-01-01", "2026-13-01", "2026-01-01T25:00:00Z",
                                   "2026-02-29 10:00:00", "!!timestamp hello", "!!timestamp 2026-02-30"])
def test_a_date_that_is_none_leaves_the_rest_of_the_frontmatter(value: str):
    """A value that looks like a date and is none is its text; the type beside it still
    counts (attack26: the whole frontmatter was dropped, so ``type:`` was silently ignored)."""
    text = f"---\ntype: user\nreview_after: {value}\nwhen: {value}\n---\nbody\n"
    assert frontmatter_type(text) == "user"
    assert record_type("a.md", text, None, "project") == "user"
    assert content.frontmatter(text)["when"] == value.removeprefix("!!timestamp ")
    # a real date is still a date
    real = content.frontmatter("---\nwhen: 2028-02-29\n---\n")
    assert real is not None and str(real["when"]) == "2028-02-29" and not isinstance(real["when"], str)


def test_non_string_type_is_described_not_expanded():
    assert frontmatter_type("---\ntype: 5\n---\n") == "<int 5>"
    assert frontmatter_type("---\ntype: [a, b]\n---\n") == "<list>"
    bomb = "---\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi")
    ) + "type: *i\n---\n"
    t0 = time.thread_time()  # CPU time, as in the secret scan's test above
    t = frontmatter_type(bomb)
    assert t == "<list>" and time.thread_time() - t0 < 2
    with pytest.raises(InvalidType):
        check_type(t)


def test_check_type():
    for t in ("user", "feedback", "project", "reference", None):
        check_type(t)
    for bad in ("diary", "User", "", " user", "<int 5>", "x" * 1000):
        with pytest.raises(InvalidType) as ei:
            check_type(bad)
        assert isinstance(ei.value, ValueError) and isinstance(ei.value, ContentError)
        assert ei.value.code == "invalid_type"
        assert "is not one of user, feedback, project, reference" in ei.value.reason
        assert len(ei.value.reason) < 120
        if bad.strip() not in ("", "user"):
            assert bad not in ei.value.reason  # the value is content: never shown


# ---------------------------------------------------------------- UTF-8


def test_check_utf8():
    assert check_utf8("héllo — 日本\n".encode()) == "héllo — 日本\n"
    assert check_utf8(b"") == ""
    for data, where in [(b"ok\xff", 2), (b"\xc3", 0), (b"abc\xed\xa0\x80", 3), (b"\xc0\xaf", 0)]:
        with pytest.raises(InvalidContent) as ei:
            check_utf8(data)
        assert ei.value.code == "invalid_content" and f"offset {where}" in ei.value.reason
    with pytest.raises(InvalidContent) as ei:
        check_utf8("é\x00".encode())
    assert "NUL" in ei.value.reason and "offset 2" in ei.value.reason


def test_check_text():
    assert content.check_text("é") == "é".encode()
    with pytest.raises(InvalidContent):
        content.check_text("lone \ud800")
    with pytest.raises(InvalidContent):
        content.check_text("nul\x00")


def test_module_has_no_server_imports():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(content))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith(("memfuse.server", "memfuse.sidecar")), node.module
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith(("memfuse.server", "memfuse.sidecar", "fastapi", "sqlalchemy")) for a in node.names)


# ---------------------------------------------------------------- secrets in names

AWS_ID_CHARS = string.ascii_uppercase + "234567"  # base32, as AWS issues key ids

# name or path holding a secret → (kind, component, redacted form)
NAME_SECRETS: list[tuple[str, tuple[str, int, str]]] = [
    ("AK" + "IA" + rnd(16, AWS_ID_CHARS, 3) + ".md", ("AWS access key id", 1, "AKIA[REDACTED].md")),
    ("creds/key_" + "AS" + "IA" + rnd(16, AWS_ID_CHARS, 4) + ".txt",
     ("AWS access key id", 2, "creds/key_ASIA[REDACTED].txt")),
    ("gh" + "p_" + rnd(36), ("GitHub token", 1, "ghp_[REDACTED]")),
    ("notes/" + "gh" + "o_" + rnd(36, seed=2) + "/todo.md", ("GitHub token", 2, "notes/gho_[REDACTED]/todo.md")),
    ("x" + "oxb-" + "730294618253-" + rnd(24, seed=5) + ".md", ("Slack token", 1, "xoxb[REDACTED].md")),
    ("sk-" + "proj-" + rnd(48, URLSAFE, 6), ("OpenAI API key", 1, "sk-p[REDACTED]")),
    ("AI" + "za" + rnd(35, URLSAFE, 7) + ".json", ("GCP API key", 1, "AIza[REDACTED].json")),
    ("gl" + "pat-" + rnd(20, seed=8), ("GitLab token", 1, "glpa[REDACTED]")),
    (jwt() + ".txt", ("JSON Web Token", 1, "eyJh[REDACTED].txt")),
]

# names people and tools give memory files: none holds a secret
ORDINARY_NAMES = [
    "MEMORY.md", "prefs.md", "draft.md.bak~", "4913", ".notes.md.swp", "#autosave#",
    ".goutputstream-ABC123", ".~lock.report.odt#", "tickets/4913", "2024-06-01-standup.md",
    "project-notes_2024.md", "JIRA-12345.md", "PROJ_4711_design.md", "v1.2.3-release-notes.md",
    "550e8400-e29b-41d4-a716-446655440000.json",  # a UUID
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855.blob",  # a sha256
    "9fceb02d0ae598e95dc970b74767f19372d61af8.patch",  # a git commit id
    "ASIA-pacific.md", "ASIAPACIFICOVERVIEW.md", "ASIAPACIFICSALES2025.md", "AKIA.md",
    "sk-learn-notes.md", "sk-" + "x" * 40 + ".md", "ghp_" + "x" * 36, "gho_token_rotation.md",
    "xoxb-bot-setup.md", "eyJhbGciOiJIUzI1NiJ9.md", "aws_secret_access_key.md",
    "how-to-rotate-aws-keys.md", "AWS_ACCESS_KEY_ID_rotation.md", "github_pat_docs.md",
    "glpat-howto.md", "dGhpcyBpcyBiYXNlNjQgdGV4dCB0aGF0IGlzIGxvbmcgZW5vdWdo.txt",
    "IMG_20240601_123456789.jpg", "Screenshot 2024-06-01 at 12.34.56.png",
    "feedback/user-prefers-tabs.md", "reference/API_KEYS_README.md", "données/café.md",
    "日本語のメモ.md", "a" * 255,
]


@pytest.mark.parametrize("path,expect", NAME_SECRETS, ids=[e[0] for _, e in NAME_SECRETS])
def test_secret_in_a_name_is_found_and_redacted(path: str, expect: tuple[str, int, str]):
    found = content.find_secret_in_path(path)
    assert found is not None and (found.kind, found.component, found.redacted) == expect
    secret_part = path.split("/")[expect[1] - 1]
    assert secret_part not in found.reason and expect[2] in found.reason


@pytest.mark.parametrize("path", ORDINARY_NAMES)
def test_ordinary_names_hold_no_secret(path: str):
    assert content.find_secret_in_path(path) is None


def test_two_secrets_in_one_path_are_both_redacted():
    a, b = "AK" + "IA" + rnd(16, AWS_ID_CHARS, 9), "gh" + "p_" + rnd(36, seed=9)
    found = content.find_secret_in_path(f"{a}/{b}.md")
    assert found is not None and found.redacted == "AKIA[REDACTED]/ghp_[REDACTED].md"


def test_prompt_text_removes_exactly_the_control_and_format_characters_in_one_pass():
    """``prompt_text`` removes its categories' code points with one character class (a
    removal in C, not a Python call per non-ASCII character: a MiB of them cost most of a
    second per scan): the class is what ``unicodedata`` says for this Python, and the result
    is the per-character rule's on random text."""
    import random
    import sys
    import unicodedata

    if unicodedata.unidata_version == content._STRIP_UNICODE:
        assert list(content._STRIP_RANGES) == content._strip_ranges()
    cats = content._STRIP_CATEGORIES

    def ignorable(ch: str) -> bool:
        return any(a <= ord(ch) <= b for a, b in content._IGNORABLE_RANGES)

    def by_character(text: str) -> str:
        text = text.replace("\r\n", "\n")
        return "".join(ch for ch in text
                       if ch in "\t\n" or (unicodedata.category(ch) not in cats and not ignorable(ch)))

    rnd = random.Random(12)
    for _ in range(2000):
        text = "".join(chr(rnd.choice([rnd.randint(0, 0x80), rnd.randint(0, 0x3000), rnd.randint(0, sys.maxunicode),
                                       rnd.choice([0x200B, 0x2028, 0x2029, 0xD800, 0xE0041, 0xFEFF, 0x85, 13, 10, 9,
                                   0x34F, 0xFE0F, 0x3164, 0xFFA0, 0x115F, 0xE0100, 0x17B4, 0x180B])]))
                       for _ in range(rnd.randint(0, 40)))
        assert content.prompt_text(text) == by_character(text), ascii(text)


def test_redact_secrets_cuts_every_secret_and_keeps_the_rest():
    from memfuse.content import REDACT_MAX, redact_secrets
    key = "AKIA" + "Q3ZK7W2N5T8VXJ4M"
    gh = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    assert redact_secrets("nothing here") == "nothing here"
    out = redact_secrets(f"aws {key} then {gh} end")
    assert key[4:] not in out and gh[4:] not in out
    assert out == "aws AKIA[REDACTED] then ghp_[REDACTED] end"
    # hidden by a zero-width space: found in the prompt's view, redacted there
    out = redact_secrets(f"x ghp_\u200b{gh[4:]}")
    assert gh[4:] not in out and "ghp_[REDACTED]" in out
    many = " ".join(gh[:-2] + f"{i:02d}" for i in range(REDACT_MAX + 1))
    assert redact_secrets(many).startswith("[REDACTED: ")


@pytest.mark.parametrize("split", ["<!-- x -->", "<!---->", "**", "*", "***", "~~", "**<!-- a -->**"])
def test_a_token_split_by_markup_drawn_as_nothing_is_found_and_redacted(split: str) -> None:
    """attack18 F2: an HTML comment, or emphasis / strike-through markers, inside a token:
    the console's Markdown draws the whole token. Found (on its line), and ``redact_secrets``
    cuts it; the same markup between words of prose is no secret."""
    tok = "gh" + "p_" + rnd(36)
    text = f"# notes\nsee {tok[:10]}{split}{tok[10:]}{split.rstrip('-> x<!a')} here\nmore\n"
    reason = find_secret(text)
    assert reason is not None and reason.startswith("GitHub token") and reason.endswith("on line 2"), (split, reason)
    red = content.redact_secrets(text)
    assert tok[10:] not in red and find_secret(red) is None and "ghp_[REDACTED]" in red, red
    assert red.startswith("# notes\nsee ") and red.endswith(" here\nmore\n"), red
    assert find_secret(f"a{split}b, x{split}y and **bold** and 2*3*4 ghp{split}is a prefix\n") is None


@pytest.mark.timeout(20)
def test_a_run_of_markup_not_followed_by_a_token_is_linear() -> None:
    """Session 21: the markup view's run ``(?:\\*{1,3}|...)*`` tried every way to cut a run
    of ``*`` that no token character follows (``a`` and 30 ``*``: 5 s, each ``*`` more ~1.7x:
    one short record held a server's scan thread for ever). Now linear: 100,000 markers in
    well under a second, and the view is unchanged where a token follows."""
    import time

    tok = "gh" + "p_" + rnd(36)
    for run in ("*" * 100_000, "~~" * 50_000 + "~", "<!-- x -->" * 10_000, "*~~<!---->" * 10_000):
        t = time.perf_counter()
        assert find_secret("a" + run) is None and find_secret(f"{tok[:8]}{run}\n") is None
        assert content.markup_view("a" + run + " b") == "a" + run + " b"
        assert time.perf_counter() - t < 2.0, run[:12]
    assert content.markup_view("a" + "*" * 1000 + "b") == "ab"
    assert find_secret(f"see {tok[:8]}{'*' * 1000}{tok[8:]}\n") is not None
    # a comment ends at its first ``-->`` (HTML, CommonMark): ``-->b`` after it is text
    assert content.markup_view("a<!-- x --> -->b") == "a<!-- x --> -->b"


def test_redact_secrets_reads_a_reversed_token_after_an_override_as_find_secret_does() -> None:
    """attack18 F2 (rlo18's rest): ``redact_secrets`` cut nothing of a token written backwards
    after U+202E (``find_secret`` found it): it cuts it now, other lines kept."""
    tok = "gh" + "p_" + rnd(36)
    text = "# notes\nsee \u202e" + tok[::-1] + " here\nmore\n"
    red = content.redact_secrets(text)
    assert tok[4:12] not in red and tok[4:12][::-1] not in red, red
    assert find_secret(red) is None and red.startswith("# notes\n") and red.endswith("\nmore\n"), red
    assert "[REDACTED]" in red.split("\n")[1], red
