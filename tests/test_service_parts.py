"""``Service`` is a facade over per-resource services built from one set of parts
(``memfuse.server.base.Parts``): every public method of every resource is offered under its
own name, the services share the parts, and a setting changed on the facade is the one every
service reads."""
from __future__ import annotations

import inspect

import pytest

from memfuse.server.base import Resource
from memfuse.server.db import Database
from memfuse.server.service import Service

# quota checks the resources call on each other, and the read the lean write path makes before
# an append's prescan (``writepath`` calls it on ``svc.records``); no other caller uses them
NOT_OFFERED = {"check_store_quota", "check_token_quota", "append_context"}


@pytest.fixture
def svc():
    s = Service(Database("sqlite://"), {"adm": None})
    yield s
    s.db.dispose()


def _resources(svc: Service) -> dict[str, Resource]:
    return {name: v for name, v in vars(svc).items() if isinstance(v, Resource)}


def test_every_public_method_of_every_resource_is_offered(svc):
    resources = _resources(svc)
    assert len(resources) == 13
    seen: dict[str, str] = {}
    for attr, res in resources.items():
        for name, fn in inspect.getmembers(type(res), inspect.isfunction):
            if name.startswith("_") or name in NOT_OFFERED:
                continue
            assert name not in seen, f"{name} offered by {seen[name]} and {attr}"
            seen[name] = attr
            bound = getattr(svc, name, None)
            assert bound is not None, f"Service offers no {name} ({attr})"
            assert getattr(bound, "__self__", None) is res and bound.__func__ is fn, name


def test_the_resources_share_one_set_of_parts(svc):
    for res in _resources(svc).values():
        assert res.db is svc.db and res.notifier is svc.notifier and res.bus is svc.bus
        assert res.settings is svc.settings and res.writer is svc.parts.writer
        assert res.access is svc.parts.access


def test_a_setting_changed_on_the_facade_reaches_every_resource(svc):
    svc.closing = True
    svc.stale_after_days = 7
    svc.mount_root = "/elsewhere"
    for res in _resources(svc).values():
        assert res.settings.closing is True
        assert res.settings.stale_after_days == 7
        assert res.settings.mount_root == "/elsewhere"
    cfg = svc.consolidation
    svc.consolidation = type(cfg)(model_url="http://model.invalid")
    assert svc.consolidations.consolidation.model_url == "http://model.invalid"
