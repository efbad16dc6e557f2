"""A large content's secret scan runs before the write reaches the writer thread
(``memfuse.server.prescan``, attack18 F5: a batch of 1 MiB records made of base64 runs held the
one writer thread of a SQLite replica for ~45 s, and another workspace's 3-byte write waited
93 s). A real control plane served lean on loopback; ``content.find_secret`` is spied on to
see which thread scans each large content; the verdicts still refuse what they must."""
from __future__ import annotations

import base64
import random
import threading
from typing import Any

import httpx
import pytest
import trio
from planeutil import serve_app, setup_ws
from test_lean import ADMIN, WS

from memfuse import content
from memfuse.server import prescan
from memfuse.server.app import create_app

pytestmark = pytest.mark.timeout(120)


def _big(seed: int) -> str:
    """~80 KB of base64 runs (each decoded and scanned: the costly kind), no secret."""
    r = random.Random(seed)
    return "\n".join(base64.b64encode(r.randbytes(300)).decode() for _ in range(200)) + "\n"


def test_large_contents_are_scanned_off_the_writer_thread(tmp_path, monkeypatch) -> None:
    seen: list[str] = []
    real = content.find_secret

    def spy(text: str) -> str | None:
        if len(text) >= prescan.PRESCAN_MIN:
            seen.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(content, "find_secret", spy)
    token = "gh" + "p_" + "R8xkQ2mZp4LwT9vNc3YhJ6bF1sD7gK0aEu5W"
    answers: dict[str, Any] = {}

    async def main() -> None:
        app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws"},
                         max_body=4 * 1024 * 1024)
        async with trio.open_nursery() as nursery:
            base = await serve_app(nursery, app, lean=True)
            await setup_ws(base, ADMIN)
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                big = _big(1)
                assert len(big) >= prescan.PRESCAN_MIN
                r = await c.post("/v1/stores/default/records", json={"path": "a.md", "content": big})
                answers["create"] = r.status_code
                rid = r.json().get("id") or r.json().get("record_id")
                assert rid, r.text[:300]
                r = await c.put(f"/v1/stores/default/records/{rid}", json={"content": _big(2)})
                answers["update"] = r.status_code
                ops = [{"op": "create", "body": {"path": f"b{i}.md", "content": _big(10 + i)}} for i in range(3)]
                ops.append({"op": "create", "body": {"path": "s.md", "content": _big(20) + token + "\n"}})
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["batch"] = [x["status"] for x in r.json()["results"]]
                answers["secret"] = r.json()["results"][3]["body"]["code"]
            answers["lean_writes"] = int(app.front.lean_writes)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["create"] == 201 and answers["update"] == 200, answers
    assert answers["batch"] == [201, 201, 201, 422] and answers["secret"] == "secret_detected", answers
    assert answers["lean_writes"] >= 3, answers  # they took the lean route, whose hop is the writer thread
    assert len(seen) >= 6, seen  # each large content scanned (the refused one too)
    assert "memfuse-writer" not in seen, seen


def test_prescan_keeps_find_secrets_answers() -> None:
    """``prescan.find_secret`` answers as ``content.find_secret`` with and without kept verdicts."""
    token = "gh" + "p_" + "R8xkQ2mZp4LwT9vNc3YhJ6bF1sD7gK0aEu5W"
    texts = [_big(3), _big(4) + token + "\n", "short " + token + "\n", "short\n"]

    async def main() -> list[str | None]:
        async with prescan.prescanned(texts):
            return [prescan.find_secret(t) for t in texts]

    assert trio.run(main) == [content.find_secret(t) for t in texts]
    assert [prescan.find_secret(t) for t in texts] == [content.find_secret(t) for t in texts]
