"""Logging of the sidecar and the CLI: one JSON object a line on stderr.

``setup_logging(debug, fmt)`` installs the handler on the root logger; ``JsonFormatter``
writes ``time`` (UTC, ms), ``level``, ``logger``, ``msg`` and every ``extra={...}`` field of
the record (non-scalar values as ``str``), plus ``exc`` with a traceback; ``TextFormatter``
(``memfuse dev``'s default) writes the same fields on one line as ``key=value`` after the
message, so a console line names what the JSON line names. Callers never put
tokens or memory content in ``extra`` (project rule: logs say what failed and what was done).
"""
from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message and the record's ``extra`` fields."""

    _std = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        """One JSON object (one line) for ``record``."""
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                       + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for k, v in record.__dict__.items():
            if k not in self._std and not k.startswith("_"):
                out[k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: message key=value ...``: the message, then the record's ``extra``
    fields (strings with spaces or quotes JSON-quoted), then a traceback if any."""

    _std = JsonFormatter._std

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """One line (plus a traceback) for ``record``."""
        exc, record.exc_info, text = record.exc_info, None, record.exc_text
        record.exc_text = None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text = exc, text
        fields = []
        for k, v in record.__dict__.items():
            if k in self._std or k.startswith("_"):
                continue
            v = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (int, float, bool, type(None))) else str(v)
            if not v or any(c in v for c in ' "=\n\t'):
                v = json.dumps(v, ensure_ascii=False)
            fields.append(f"{k}={v}")
        if fields:
            line += " " + " ".join(fields)
        if exc:
            line += "\n" + self.formatException(exc)
        return line


def setup_logging(debug: bool = False, fmt: str = "json") -> None:
    """Log to stderr at INFO (DEBUG when ``debug``), as JSON lines (``fmt="json"``) or text
    lines with ``key=value`` fields (any other ``fmt``); httpx, httpcore, hypercorn and pyfuse3 only from WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("httpx", "httpcore", "hypercorn", "pyfuse3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
