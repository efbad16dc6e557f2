"""JSON of a page in pieces: ``json_list_pieces`` yields an object's JSON whose list member holds
items encoded one by one, so a route can send a page of much content as it is encoded
(``memfuse.server.routes.deps.pieces_response``) without holding the whole JSON."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["json_list_pieces"]


def json_list_pieces(head: bytes, items: Iterable[bytes], tail: bytes) -> Iterator[bytes]:
    """``head``, the encoded ``items`` separated by commas, ``tail``: the JSON of an object
    whose list member (opened by ``head``, closed by ``tail``) holds ``items``; e.g. ``head``
    ``{"changes":[`` and ``tail`` ``],"seq":7}``. Lazy: an item is encoded when reached."""
    yield head
    for i, item in enumerate(items):
        yield b"," + item if i else item
    yield tail
