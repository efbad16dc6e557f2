"""Secrets in disguised and encoded forms through a real mount (attack17 F2, docs/API.md
"Secrets"): a token with a Braille blank or a no-break space inside, with a Cyrillic look-
alike letter, JSON-escaped in a JSONL memory, base64-encoded in MEMORY.md, is refused with
``EPERM`` and an ``errors.log`` line naming the kind, never the secret; nothing reaches the
control plane; ordinary notes with escapes and non-ASCII text beside them are kept.

Secret-shaped text is built at run time, never written in the repository.
"""
from __future__ import annotations

import base64
import random
import string

import pytest

from mountcheck import errors_log, wait_drained, write_file
from mountutil import live_records, serve_and_mount, sh

pytestmark = pytest.mark.mount


def _github_token() -> str:
    rnd = random.Random(17)
    return "gh" + "p_" + "".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(36))


def test_disguised_and_encoded_tokens_are_refused_on_the_mount(tmp_path):
    tok = _github_token()
    forms = {
        "braille.md": f"token {tok[:10]}\u2800{tok[10:]}\n",
        "nbsp.md": f"token {tok[:10]}\u00a0{tok[10:]}\n",
        "cyrillic.md": "token " + tok.replace("p", "\u0440", 1) + "\n",
        "log.jsonl": '{"t": "\\u0067hp_' + tok[4:] + '"}\n',
        "MEMORY.md": "# index\n\n" + base64.b64encode(tok.encode()).decode() + "\n",
    }
    with serve_and_mount(tmp_path) as (cp, sc):
        d = sc.mountpoint / "default"
        got = {name: write_file(d / name, text.encode()) for name, text in forms.items()}
        for name, r in got.items():
            assert "EPERM" in r.values(), (name, r)
        # the percent form through a shell's redirection: refused at close, which the
        # shell does not report; the file is not saved
        sh(f"printf 'token %%67{tok[1:]}\\n' > mnt/default/pct.md", tmp_path, check=False)
        ok = "caf\u00e9 na\u00efve \u2014 \\n `a\\_b` 100% R&D &amp; Gr\u00fc\u00dfe ghp_" + "x" * 36 + "\n"
        assert write_file(d / "ordinary.md", ok.encode()) == {"open": None, "write": None, "close": None}
        wait_drained(sc.mountpoint)
        assert set(live_records(cp)) == {"ordinary.md"}
        lines = {e["path"]: (e["errno"], e["code"], e["reason"]) for e in errors_log(sc.mountpoint)}
        assert set(lines) == {*forms, "pct.md"}, lines
        for errno_name, code, reason in lines.values():
            assert (errno_name, code) == ("EPERM", "secret_detected") and "GitHub token" in reason
        everything = (sc.mountpoint / ".memfuse" / "errors.log").read_text() + sc.log.read_text()
        assert tok[4:] not in everything
