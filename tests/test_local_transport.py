"""The CLI's local mode (``memfuse.server.local.LocalTransport``): the record reads it serves
from the service layer get the bytes and headers the FastAPI app sends, everything else (and
every refusal) is the app's own answer, and a read command does not import FastAPI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from memfuse.client import ApiClient
from memfuse.devenv import LOCAL_BASE_URL, dev_app, ensure_dev_setup
from memfuse.server.local import LocalTransport

ADMIN = "mfa_local-transport-test-token"
TOKENS: dict[str, str | None] = {ADMIN: None}


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'dev.db'}"


async def _fill(api: ApiClient) -> dict[str, str]:
    await ensure_dev_setup(api)
    a = await api.create_record("default", "notes/a b.md", "Äpfel\nline two äpfel\n", type="user")
    await api.update_record("default", a.id, "Äpfel\nline two äpfel\nthree\n", if_match=a.sha256)
    await api.move_record("default", a.id, "notes/ä.md")
    b = await api.create_record("default", "MEMORY.md", "- [a](notes/ä.md)\n")
    await api.delete_record("default", b.id)
    return {"a": a.id, "b": b.id}


READS = [
    "/v1/stores/default/records",
    "/v1/stores/default/records?limit=1",
    "/v1/stores/default/records?path=notes%2F%C3%A4.md&include_deleted=true&content=true",
    "/v1/stores/default/records?path=MEMORY.md&include_deleted=true&limit=1000",
    "/v1/stores/default/records/{a}",
    "/v1/stores/default/records/{a}?content=false",
    "/v1/stores/default/records/{b}",
    "/v1/stores/default/records/{a}/versions",
    "/v1/stores/default/records/{a}/versions/2",
    "/v1/stores/default/search?q=%C3%84PFEL",
    "/v1/stores/default/search?q=pfel&match=content&prefix=notes&case_sensitive=true&limit=1&max_lines=1",
    "/v1/stores/default/search?q=notes&match=path&type=user",
    "/v1/stores",
    "/v1/stores/default",
    "/v1/workspaces",
    "/v1/workspaces/dev/attachments",
]

FALLBACK = [  # not served plainly: the app answers (refusals, validation, other routes)
    "/v1/stores/nostore/records",
    "/v1/stores/default/records/nope",
    "/v1/stores/default/records/{a}/versions/9",
    "/v1/stores/default/records?limit=0",
    "/v1/stores/default/records?content=yes",
    "/v1/stores/default/search?q=",
    "/v1/stores/default/search?q=a&match=everything",
    "/v1/stores/default/search?q=a&cursor=bogus",
    "/v1/stores/nostore",
    "/v1/workspaces/nows/attachments",
    "/v1/workspaces/dev/context",
    "/v1/stores?x=1",
]


def test_served_reads_are_the_apps_bytes(db_url):
    async def main() -> None:
        app = dev_app(db_url, faces=False, admin_token=ADMIN).app
        ref = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=LOCAL_BASE_URL,
                                headers={"Authorization": f"Bearer {ADMIN}"})
        local = LocalTransport(db_url, TOKENS, lambda: dev_app(db_url, faces=False, admin_token=ADMIN).app)
        mine = httpx.AsyncClient(transport=local, base_url=LOCAL_BASE_URL,
                                 headers={"Authorization": f"Bearer {ADMIN}"})
        async with ApiClient(LOCAL_BASE_URL, ADMIN, transport=httpx.ASGITransport(app=app)) as api:
            ids = await _fill(api)
        async with ref, mine:
            for i, url in enumerate(READS + FALLBACK):
                url = url.format(**ids)
                want, got = await ref.get(url), await mine.get(url)
                assert got.status_code == want.status_code, url
                assert got.content == want.content, url
                for h in ("content-type", "etag", "content-length"):
                    assert got.headers.get(h) == want.headers.get(h), (url, h)
                if i == len(READS) - 1:
                    assert (local.served, local.passed) == (len(READS), 0)
            assert local.passed == len(FALLBACK)
            # a record's search hit holds the Unicode case-insensitive match
            hits = json.loads((await mine.get("/v1/stores/default/search?q=%C3%84PFEL")).content)["hits"]
            assert [h["line_matches"] for h in hits] == [2]
            # writes go to the app, and reads see them at once
            r = await mine.post("/v1/stores/default/records", json={"path": "new.md", "content": "x"})
            assert r.status_code == 201
            assert (await mine.get(f"/v1/stores/default/records/{r.json()['id']}")).json()["content"] == "x"
            # a token that is not the static one: the app's 401
            bad = await mine.get("/v1/stores/default/records", headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401 and bad.headers["content-type"] == "application/problem+json"

    trio.run(main)


def test_read_commands_do_not_import_fastapi(tmp_path):
    """``memfuse history`` / ``show`` / ``search`` / ``store list`` in local mode never build
    the web app."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")}
    env["MEMFUSE_HOME"] = str(tmp_path / "home")

    async def fill() -> None:
        from memfuse.devenv import local_client

        async with local_client() as api:
            await ensure_dev_setup(api)
            await api.create_record("default", "MEMORY.md", "- index\n")

    os.environ["MEMFUSE_HOME"] = env["MEMFUSE_HOME"]
    try:
        trio.run(fill)
    finally:
        del os.environ["MEMFUSE_HOME"]
    probe = (
        "import sys\n"
        "from memfuse.cli import cli\n"
        "try:\n"
        "    cli.main(sys.argv[1:], prog_name='memfuse', standalone_mode=False)\n"
        "finally:\n"
        "    print('FASTAPI' if 'fastapi' in sys.modules else 'NO-FASTAPI', file=sys.stderr)\n"
    )
    for args, shown in ((["history", "default", "MEMORY.md"], b"created"),
                        (["show", "default", "MEMORY.md"], b"- index\n"),
                        (["search", "default", "index"], b"MEMORY.md:1:- index\n"),
                        (["store", "list"], b"default memory store")):
        p = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True,
                           timeout=120, cwd=Path(__file__).parent.parent)
        assert p.returncode == 0, p.stderr
        assert p.stderr.decode().strip().endswith("NO-FASTAPI"), (args, p.stderr)
        assert shown in p.stdout, (args, p.stdout)
