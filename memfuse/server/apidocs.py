"""The interactive API documentation, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served
with every asset from the control plane itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN and ReDoc's fonts from Google Fonts,
so on an air-gapped cluster they are blank. Here the scripts, the stylesheet and the favicon
come from the ``fastapi-offline`` package (it ships Swagger UI's and ReDoc's release bundles
and is kept in step with FastAPI; pinned in requirements.lock), served under
``ASSETS_PATH``; the HTML is FastAPI's own (``get_swagger_ui_html``, ``get_redoc_html``)
pointed at them, with ReDoc's Google Fonts link and Swagger UI's validator badge left out,
and a Content-Security-Policy that lets both pages load from and connect to this origin only
(``CONTENT_SECURITY_POLICY``). ``tests/test_apidocs_browser.py`` loads both in headless Chromium with every
non-loopback request blocked.
"""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS_PATH = "/docs/assets"  # swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png
# Both pages may load and connect to this origin only (ReDoc's bundle links the "API docs by
# Redocly" logo from its CDN: the browser does not even ask for it). Inline script and style:
# Swagger UI is started by an inline script, ReDoc styles itself inline; search runs in a
# blob: worker.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


def _local_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    page.headers["X-Content-Type-Options"] = "nosniff"
    return page


def assets_dir() -> str:
    """The directory of the Swagger UI and ReDoc bundles shipped by ``fastapi-offline``."""
    return str(files("fastapi_offline") / "static")


def install_docs(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve ``docs_url`` (Swagger UI, with its OAuth2 redirect page) and ``redoc_url`` on
    ``app`` (built with ``docs_url=None, redoc_url=None``), and their assets under
    ``ASSETS_PATH``; none of the routes is in the OpenAPI document."""
    app.mount(ASSETS_PATH, StaticFiles(directory=assets_dir()), name="api-docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect = app.swagger_ui_oauth2_redirect_url

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _local_only(get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}", title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=oauth2_redirect,
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon.png",
            # validatorUrl null: Swagger UI would otherwise fetch a badge from validator.swagger.io
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
        ))

    if oauth2_redirect:
        @app.get(oauth2_redirect, include_in_schema=False)
        async def swagger_ui_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _local_only(get_redoc_html(
            openapi_url=f"{root}{openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_PATH}/favicon.png",
            with_google_fonts=False,
        ))
