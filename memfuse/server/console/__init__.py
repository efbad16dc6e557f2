"""The memory console: web pages for people, served by the control plane under ``/ui/``.

Stores with their usage and limits, records (filter by type, search by path and content),
a record's content rendered safely, its history with diffs, restore, redact and delete, an
editor with the four types, the store's ``MEMORY.md`` as one document, workspaces with their
attachments (attach, detach, read-only / read-write), and the prompt preview of a workspace.
Same process and same tokens as the API; see docs/CONSOLE.md.

``install_console(app)`` mounts it on the control-plane app; ``login_url(app, token, base)``
makes a one-time login link (``memfuse dev`` prints one at start).
"""
from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import RedirectResponse

from memfuse.server.console.session import LoginCodes
from memfuse.server.console.web import create_console

__all__ = ["PREFIX", "install_console", "login_url"]

PREFIX = "/ui"


def install_console(app: FastAPI) -> None:
    """Mount the console at ``/ui`` of the control-plane ``app`` (a FastAPI app whose
    ``state.service`` is the ``Service``); ``/ui`` redirects to ``/ui/``. The one-time login
    codes live in ``app.state.login_codes``."""
    codes = LoginCodes()
    app.state.login_codes = codes

    async def to_console(request: Request) -> RedirectResponse:
        return RedirectResponse(PREFIX + "/", status_code=308)

    app.add_route(PREFIX, to_console, include_in_schema=False)
    app.mount(PREFIX, create_console(app.state.service, codes))


def login_url(app: FastAPI, token: str, base_url: str) -> str:
    """A one-time login link to the console of ``app`` for ``token`` (admin or workspace):
    ``<base_url>/ui/login/<code>``. The first visit logs the browser in and uses the code up."""
    codes: LoginCodes = app.state.login_codes
    return f"{base_url.rstrip('/')}{PREFIX}/login/{codes.issue(token)}"
