"""The route table (``memfuse.server.routetable``) is the app's: the routers register exactly
its routes, and its ``match`` picks the route the app's own router picks for any path, so the
long-poll fast path, the local transport and batch (which read the table without FastAPI)
agree with the app on what a request is."""
from __future__ import annotations

import itertools

import pytest
from fastapi.routing import APIRoute
from starlette.routing import Match

from memfuse.server import routetable
from memfuse.server.app import create_app
from memfuse.server.routes import accounts, consolidations, feeds, records, stores, tokens, workspaces

ROUTERS = (accounts, stores, workspaces, tokens, records, feeds, consolidations)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def _api_routes() -> list[APIRoute]:
    out = []
    for module in ROUTERS:
        out.extend(r for r in module.router.routes if isinstance(r, APIRoute))
    return out


def _app_match(method: str, path: str) -> str | None:
    """The name of the route the app's router would run for ``method`` ``path`` (a full
    match: path and method), or None."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"",
             "headers": []}
    for r in _api_routes():
        match, _ = r.matches(scope)
        if match == Match.FULL:
            return r.name
    return None


def test_the_routers_register_exactly_the_table():
    registered = sorted((next(iter(r.methods)), r.path, r.name) for r in _api_routes())
    assert all(len(r.methods) == 1 for r in _api_routes())
    assert registered == sorted((r.method, r.path, r.name) for r in routetable.ROUTES)
    assert len({(r.method, r.path) for r in routetable.ROUTES}) == len(routetable.ROUTES)


def test_the_openapi_document_has_every_route_of_the_table():
    app = create_app("sqlite://", faces=False)
    doc = app.openapi()
    for r in routetable.ROUTES:
        op = doc["paths"][r.path][r.method.lower()]
        assert op["operationId"].startswith(r.name + "_"), (r, op["operationId"])


def _paths() -> list[str]:
    """Concrete paths: every template filled in, and near misses of each (a trailing slash,
    an empty or extra segment, a segment cut off, another literal)."""
    out: set[str] = set()
    for r in routetable.ROUTES:
        filled = "/".join(f"x{i}" if s.startswith("{") else s for i, s in enumerate(r.segments))
        out.add("/" + filled)
        out.add("/" + filled + "/")
        out.add("/" + filled + "/extra")
        out.add("/" + filled.rsplit("/", 1)[0])
        out.add("/" + "/".join("" if s.startswith("{") else s for s in r.segments))
        out.add("/" + filled.replace("v1", "v2", 1))
    out.update({"/", "/v1", "/v1/", "/v1/stores/s/changes/x", "/v1/workspaces//events", "/ui/stores/s"})
    return sorted(out)


@pytest.mark.parametrize("method", METHODS)
def test_match_picks_the_route_the_app_picks(method):
    checked = 0
    for path in _paths():
        m = routetable.match(method, path)
        assert (m.route.name if m else None) == _app_match(method, path), (method, path)
        checked += m is not None
    assert checked > 0


def test_match_gives_the_path_parameters():
    m = routetable.match("GET", "/v1/stores/notes/records/r1/versions/3")
    assert m is not None and m.route is routetable.GET_VERSION
    assert m.params == {"store": "notes", "record_id": "r1", "n": "3"}
    assert routetable.GET_VERSION.url(store="notes", record_id="r1", n="3") == \
        "/v1/stores/notes/records/r1/versions/3"
    m = routetable.match("GET", "/v1/workspaces/w/events")
    assert m is not None and m.route is routetable.EVENTS and m.params == {"ws": "w"}


def test_no_two_routes_take_the_same_request():
    for a, b in itertools.combinations(routetable.ROUTES, 2):
        if a.method != b.method or len(a.segments) != len(b.segments):
            continue
        probe = ["p" if x.startswith("{") or y.startswith("{") else x for x, y in zip(a.segments, b.segments)]
        assert a.match(probe) is None or b.match(probe) is None, (a, b)
