"""Which requests came over TLS: ``X-Forwarded-Proto`` from trusted proxies only.

``memfuse serve`` speaks plain HTTP; TLS ends at a proxy (an ingress, a load balancer) that
says how the client connected in ``X-Forwarded-Proto``. Anyone can send that header, so it is
believed only from the addresses given with ``--trusted-proxy`` (``MEMFUSE_TRUSTED_PROXY``):
``TrustedProxyScheme`` sets the ASGI ``scope["scheme"]`` from it for a request whose peer is
one of them, and leaves every other request as it came. What depends on it: the console's
session cookie is ``Secure`` (and named with the ``__Host-`` prefix) only for a request that
came over TLS (docs/CONSOLE.md). The pattern is uvicorn's and Werkzeug's ``ProxyFix``: the
header of an untrusted peer is ignored, never an error.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_trusted(values: Iterable[str]) -> tuple[Network, ...]:
    """Networks from ``--trusted-proxy`` values: addresses or CIDR blocks (``10.0.0.0/8``,
    ``::1``), each value possibly a comma-separated list. Raises ``ValueError`` naming a bad
    one."""
    nets: list[Network] = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                nets.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"not an IP address or CIDR block: {part!r}") from None
    return tuple(nets)


def is_trusted(host: str | None, trusted: tuple[Network, ...]) -> bool:
    """True when the peer address ``host`` is in one of the ``trusted`` networks."""
    if not host or not trusted:
        return False
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr.version == net.version and addr in net for net in trusted)


class TrustedProxyScheme:
    """ASGI middleware: for an HTTP request whose peer (``scope["client"]``) is a trusted
    proxy, ``scope["scheme"]`` becomes the ``X-Forwarded-Proto`` it sent (the last value of a
    list: the one the nearest proxy added; only ``http`` or ``https``). Other requests are
    untouched."""

    def __init__(self, app: ASGIApp, trusted: tuple[Network, ...]) -> None:
        self.app = app
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.trusted:
            client = scope.get("client")
            if client and is_trusted(client[0], self.trusted):
                values = [v for k, v in scope.get("headers", ()) if k == b"x-forwarded-proto"]
                if values:
                    proto = values[-1].decode("latin-1").split(",")[-1].strip().lower()
                    if proto in ("http", "https"):
                        scope = dict(scope, scheme=proto if scope["type"] == "http" else
                                     {"https": "wss", "http": "ws"}[proto])
        await self.app(scope, receive, send)
