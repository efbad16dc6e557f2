"""The reference control plane: the HTTP API of docs/API.md over SQLAlchemy.

- ``db``: schema, engine, session rules;
- ``content``: frontmatter type detection and content checks;
- ``service``: the rules (no HTTP);
- ``app``: the FastAPI app (``create_app``);
- ``serve``: hypercorn under trio (``serve``).

The sidecar never imports this package; it talks to it over HTTP (or ``httpx.ASGITransport``
through ``memfuse.fake``).
"""
from __future__ import annotations

from memfuse.server.app import create_app

__all__ = ["create_app"]
