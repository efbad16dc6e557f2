"""Reading the console's HTML forms (``application/x-www-form-urlencoded``), strictly.

Browsers submit forms as UTF-8 (every console page is UTF-8 and its forms say
``accept-charset="utf-8"``). A value that is not valid UTF-8 is kept as bytes-in-surrogates so
the caller can refuse it with the same reason the mount gives (``memfuse.content.check_utf8``)
instead of silently replacing characters. Bodies are bounded.
"""
from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.requests import Request

from memfuse.content import ContentError, check_utf8

MAX_FORM_BYTES = 16 << 20  # percent-encoding can triple a 1 MiB record, plus the other fields
MAX_FIELDS = 64


class FormError(Exception):
    """The body is not a form the console accepts: ``status`` 413 (too large) or 415 (not
    urlencoded) or 400 (malformed), ``detail`` says why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


async def read_form(request: Request) -> dict[str, str]:
    """The request's form fields (last value wins). Values that were not valid UTF-8 hold
    lone surrogates (``surrogateescape``); see :func:`field_text`. Raises :class:`FormError`."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        if not ctype and request.headers.get("content-length", "0") == "0":
            return {}  # a form without fields (a script's POST with no body)
        raise FormError(415, "the console takes application/x-www-form-urlencoded forms")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise FormError(413, f"the form is larger than {MAX_FORM_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise FormError(413, f"the form is larger than {MAX_FORM_BYTES} bytes")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("ascii")
    except UnicodeDecodeError:
        raise FormError(400, "a urlencoded form is ASCII") from None
    try:
        pairs = parse_qsl(
            text, keep_blank_values=True, encoding="utf-8", errors="surrogateescape", max_num_fields=MAX_FIELDS
        )
    except ValueError as err:
        raise FormError(400, f"malformed form: {err}") from None
    return dict(pairs)


def newline_style(text: str) -> str:
    """How ``text`` ends its lines: ``"lf"`` (no CR at all), ``"crlf"`` (every line break is
    CRLF) or ``"mixed"`` (both, or a lone CR). A textarea submits every line break as CRLF
    (HTML's form submission), so the editor needs this to give a record its own line endings
    back (:func:`with_newlines`); a ``"mixed"`` record cannot be edited as text without
    changing some of them, which the edit page says."""
    if "\r" not in text:
        return "lf"
    if text.count("\r") == text.count("\r\n") == text.count("\n"):
        return "crlf"
    return "mixed"


def with_newlines(text: str, style: str) -> str:
    """``text`` (LF line breaks, as :func:`field_text` returns it) with the line breaks of
    ``style`` (:func:`newline_style`): CRLF for ``"crlf"``, else LF."""
    return text.replace("\n", "\r\n") if style == "crlf" else text


def field_text(form: dict[str, str], name: str, default: str = "") -> str:
    """A text field, with line endings as browsers send them (CRLF) turned into LF (memory
    files use LF; a textarea always submits CRLF). Raises ``memfuse.content.ContentError``
    (``InvalidContent``, the mount's EILSEQ reason) when the value was not valid UTF-8."""
    value = form.get(name, default)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        check_utf8(value.encode("utf-8", "surrogateescape"))  # raises with the byte offset
        raise ContentError("content is not valid UTF-8") from None  # pragma: no cover
    return value.replace("\r\n", "\n")
