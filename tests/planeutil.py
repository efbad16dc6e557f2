"""The control plane served in the test's own process: the app (``create_app``) behind
``memfuse serve``'s server on a loopback port of the kernel's choice, in the test's trio
nursery, and the workspace ``ws`` the HTTP tests write through. One shape for the tests of the
server's front door (test_lean, test_lean_writes, test_pipelining, test_prescan,
test_early_answer); ``attach_ws`` sets the workspace up through any admin client (the app's
ASGI transport too). A real ``memfuse serve`` process is ``mountutil.ControlPlane``."""
from __future__ import annotations

from typing import Any

import httpx
import trio

from memfuse.server.serve import serve


async def serve_app(nursery: trio.Nursery, app: Any, *, lean: bool = True) -> str:
    """Serve ``app`` with ``memfuse.server.serve.serve`` on 127.0.0.1 (port 0: the kernel
    picks a free one) as a task of ``nursery`` (cancel the nursery to stop it), with the lean
    write route when ``lean`` (the default, as ``serve``'s); returns the base URL
    (``http://127.0.0.1:PORT``) once it listens."""
    url: str = await nursery.start(
        lambda task_status: serve(app, "127.0.0.1:0", lean=lean, task_status=task_status))
    return url


async def setup_ws(url: str, admin: str,
                   stores: tuple[tuple[str, str], ...] = (("default", "read_write"),),
                   token_name: str | None = None) -> str | None:
    """``attach_ws`` as the admin (bearer ``admin``) of the control plane at ``url``."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {admin}"},
                                 timeout=30) as a:
        return await attach_ws(a, stores, token_name)


async def attach_ws(admin: httpx.AsyncClient,
                    stores: tuple[tuple[str, str], ...] = (("default", "read_write"),),
                    token_name: str | None = None) -> str | None:
    """Through ``admin`` (a client with the admin's bearer, over loopback or the app's ASGI
    transport): the workspace ``ws`` without its own default store, each ``(slug, access)``
    of ``stores`` created and attached to it; with ``token_name``, a database token of
    ``ws`` by that name is created and returned (else None). Raises ``AssertionError``
    (with the answer) when a step is refused."""
    r = await admin.post("/v1/workspaces", json={"name": "ws", "default_store": False})
    assert r.status_code == 201, r.text
    for slug, access in stores:
        r = await admin.post("/v1/stores", json={"slug": slug})
        assert r.status_code == 201, r.text
        r = await admin.put(f"/v1/workspaces/ws/attachments/{slug}", json={"access": access})
        assert r.status_code == 200, r.text
    if token_name is None:
        return None
    r = await admin.post("/v1/tokens", json={"workspace": "ws", "name": token_name})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token
