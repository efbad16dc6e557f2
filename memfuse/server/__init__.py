"""The reference control plane: the HTTP API of docs/API.md over SQLAlchemy.

- ``db``: schema, engine, session rules;
- ``service``: the rules (no HTTP), ``Service`` composed from one room per resource:
  ``base`` (refusals, callers, the write transaction), ``tokens``, ``stores`` (workspaces,
  stores, attachments), ``records``, ``changes`` (feeds and the long-poll ``Notifier``),
  ``context`` (the prompt block); content rules come from ``memfuse.content``;
- ``app``: the FastAPI app (``create_app``);
- ``serve``: hypercorn under trio (``serve``).

The sidecar never imports this package; it talks to it over HTTP (or ``httpx.ASGITransport``
through ``memfuse.fake``).
"""
from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # ``create_app`` on first use (PEP 562): importing a submodule (``memfuse.server.service``
    # for the CLI's local mode, ``memfuse.server.db`` for migrations) must not import FastAPI
    # and build its models, half a second of every such process.
    if name == "create_app":
        from memfuse.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
