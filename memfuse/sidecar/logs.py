"""Logging of the sidecar, ``memfuse serve`` and the CLI: one JSON object a line on stderr.

``setup_logging(debug, fmt)`` installs the handler on the root logger; ``JsonFormatter``
writes ``time`` (UTC, ms), ``level``, ``logger``, ``msg`` and every ``extra={...}`` field of
the record (non-scalar values as ``str``), plus ``exc`` with a traceback; ``TextFormatter``
(``memfuse dev``'s default) writes the same fields on one line as ``key=value`` after the
message, so a console line names what the JSON line names. Callers never put
tokens or memory content in ``extra`` (project rule: logs say what failed and what was done).

Repeated failures are rate-limited (``RepeatFilter``, installed by ``setup_logging``): a
warning or error whose logger, level, message template and exception type were logged in the
last ``REPEAT_WINDOW_SECONDS`` is dropped and counted; the next one of that kind that is
written carries ``repeated`` (how many were dropped since the last line of the kind). A
database outage of 20 s in which every request fails then writes a few lines, not thousands.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable

REPEAT_WINDOW_SECONDS = 10.0  # one line per kind of warning or error per this long
REPEAT_KEYS_MAX = 1024  # kinds remembered; the table is emptied when full


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message and the record's ``extra`` fields."""

    _std = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        """One JSON object (one line) for ``record``."""
        out: dict[str, object] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
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


class RepeatFilter(logging.Filter):
    """A handler filter that rate-limits repeated warnings and errors: one line per kind
    (logger, level, message template, exception type, and the ``store`` and ``path`` fields
    when the line has them) per ``window`` seconds; the ones in
    between are dropped and counted, and the next line of that kind gets the count as its
    ``repeated`` field. INFO and DEBUG lines always pass. Thread-safe (the control plane logs
    from worker threads)."""

    def __init__(self, window: float = REPEAT_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[object, ...], list[float]] = {}  # kind → [monotonic time of the last line, dropped since]

    def filter(self, record: logging.LogRecord) -> bool:
        """True to write ``record`` (then maybe with ``record.repeated``), False to drop it."""
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        # a line about one file (a refusal names its store and path) is its own kind: an
        # operator needs every refused path, and errors.log keeps one line per refusal too
        key = (record.name, record.levelno, str(record.msg), exc,
               getattr(record, "store", None), getattr(record, "path", None))
        now = self.clock()
        with self._lock:
            hit = self._seen.get(key)
            if hit is not None and now - hit[0] < self.window:
                hit[1] += 1
                return False
            if len(self._seen) >= REPEAT_KEYS_MAX:
                self._seen.clear()
            self._seen[key] = [now, 0]
        if hit is not None and hit[1]:
            record.repeated = hit[1]
        return True


def setup_logging(debug: bool = False, fmt: str = "json") -> None:
    """Log to stderr at INFO (DEBUG when ``debug``), as JSON lines (``fmt="json"``) or text
    lines with ``key=value`` fields (any other ``fmt``), repeated warnings and errors
    rate-limited (``RepeatFilter``); httpx, httpcore, hypercorn and pyfuse3 only from WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("httpx", "httpcore", "hypercorn", "pyfuse3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
