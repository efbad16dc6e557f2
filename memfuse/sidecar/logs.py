"""Logging of the sidecar and the CLI: one JSON object a line on stderr.

``setup_logging(debug, fmt)`` installs the handler on the root logger; ``JsonFormatter``
writes ``time`` (UTC, ms), ``level``, ``logger``, ``msg`` and every ``extra={...}`` field of
the record (non-scalar values as ``str``), plus ``exc`` with a traceback. Callers never put
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


def setup_logging(debug: bool = False, fmt: str = "json") -> None:
    """Log to stderr at INFO (DEBUG when ``debug``), as JSON lines (``fmt="json"``) or plain
    text (any other ``fmt``); httpx, httpcore, hypercorn and pyfuse3 only from WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("httpx", "httpcore", "hypercorn", "pyfuse3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
