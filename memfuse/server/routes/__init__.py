"""The HTTP face of the v1 API: one ``APIRouter`` per resource, assembled by
``memfuse.server.app.create_app``, each route registered from the route table
(``memfuse.server.routetable``, which the long-poll fast path, the local transport and batch
read too), their errors problem+json (``memfuse.server.problems``).

- ``deps``: what handlers share (the service, the caller, the idempotency key, responses);
- ``accounts``, ``stores``, ``workspaces``, ``tokens``, ``records``, ``feeds``,
  ``consolidations``: the routers.
"""
