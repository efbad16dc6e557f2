"""Helpers shared by ``test_refusals.py`` and ``test_properties.py`` (no conftest involved).

- ``MountEnv``: one ``memfuse serve`` and one ``memfuse mount`` for a workspace, with store
  limits set through the admin API *before* the mount (the sidecar reads limits at mount), and
  ``remount()``: a new sidecar process with a fresh cache directory, so everything it shows
  comes from the control plane.
- ``outcome()``: run a syscall and return the errno's name (``"EFBIG"``) or ``None``; tests
  compare dicts of outcomes so one failure message shows every step.
- ``name_errnos()`` / ``path_errnos()``: the name rules of docs/SEMANTICS.md written out again here, independently of
  ``memfuse/names.py``, as the oracle the mount is checked against.
- Hypothesis budget: CI runs are derandomized and bounded. For long runs set
  ``MEMFUSE_HYPOTHESIS_EXAMPLES=N`` (examples per property, random exploration, example
  database on) and optionally ``MEMFUSE_HYPOTHESIS_STEPS=N`` (steps per state-machine run)::

      MEMFUSE_HYPOTHESIS_EXAMPLES=500 MEMFUSE_HYPOTHESIS_STEPS=60 \\
          .venv/bin/python -m pytest tests/test_properties.py --timeout 0
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time
import unicodedata
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, settings

from memfuse import names
from mountutil import ControlPlane, Rig, Sidecar, live_records, wait_until

# ------------------------------------------------------------------ hypothesis budget
LONG_EXAMPLES = int(os.environ.get("MEMFUSE_HYPOTHESIS_EXAMPLES", "0") or 0)
LONG_STEPS = int(os.environ.get("MEMFUSE_HYPOTHESIS_STEPS", "0") or 0)
LONG_RUN = LONG_EXAMPLES > 0


def hyp_settings(ci_examples: int, *, ci_steps: int | None = None) -> settings:
    """Settings for one property: ``ci_examples`` derandomized examples in CI, or the long-run
    budget from the environment (see module docstring)."""
    kw: dict = dict(deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])
    if LONG_RUN:
        kw.update(max_examples=LONG_EXAMPLES, derandomize=False)
    else:
        kw.update(max_examples=ci_examples, derandomize=True, database=None)
    if ci_steps is not None:
        kw["stateful_step_count"] = LONG_STEPS or ci_steps
    return settings(**kw)


def budget_seconds(ci_seconds: float) -> float:
    """A pytest-timeout for a property test: the CI figure, scaled up for long runs."""
    if not LONG_RUN:
        return ci_seconds
    return ci_seconds * max(1.0, LONG_EXAMPLES / 20) * max(1.0, (LONG_STEPS or 30) / 30)


# ------------------------------------------------------------------ outcomes
def outcome(fn: Callable[[], object]) -> str | None:
    """Run ``fn``; ``None`` when it succeeds, else the ``errno`` name of its ``OSError``."""
    try:
        fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    return None


def write_file(path: Path | bytes, data: bytes, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
               ) -> dict[str, str | None]:
    """open / write / close with each step's outcome: ``{"open":…, "write":…, "close":…}``.
    A step after a failed open is not run (reported as ``"skipped"``)."""
    out: dict[str, str | None] = {"open": None, "write": "skipped", "close": "skipped"}
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        out["open"] = errno.errorcode[e.errno]
        return out
    try:
        out["write"] = outcome(lambda: _write_all(fd, data))
    finally:
        out["close"] = outcome(lambda: os.close(fd))
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def xattr(path: Path, key: str) -> str | None:
    """``user.memfuse.<key>`` of ``path`` as text; None when absent (ENODATA)."""
    try:
        return os.getxattr(path, f"user.memfuse.{key}").decode()
    except OSError as e:
        if e.errno == errno.ENODATA:
            return None
        raise


def read_control(path: Path) -> bytes:
    """A ``.memfuse`` control file's content in ONE read(2), so a poll loop never depends on
    how the sidecar serves several reads of a changing file (that is checked on its own by
    ``test_properties.test_control_file_reads_are_consistent``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 22)
    finally:
        os.close(fd)


def errors_log(root: Path) -> list[dict]:
    """The entries of ``MOUNT/.memfuse/errors.log``."""
    text = read_control(root / ".memfuse" / "errors.log").decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def errors_log_text(root: Path) -> str:
    return read_control(root / ".memfuse" / "errors.log").decode()


def status(root: Path) -> dict:
    return json.loads(read_control(root / ".memfuse" / "status.json"))


def wait_drained(root: Path, timeout: float = 30.0) -> None:
    """Wait until the sidecar's outbox is empty (``status.json`` → outbox depth 0)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(root)
        if st["outbox"]["depth"] == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"outbox did not drain within {timeout} s: {st['outbox']}")
        time.sleep(0.02)


# ------------------------------------------------------------------ name-rule oracle
MAX_COMPONENT = 255
MAX_PATH = 1024
MAX_COMPONENTS = 32
# docs/SEMANTICS.md "Names": control, format, line / paragraph separator and surrogate
# characters, from the Unicode database (not memfuse.names: an independent oracle)
FORBIDDEN = frozenset(cp for cp in range(sys.maxunicode + 1)
                      if unicodedata.category(chr(cp)) in ("Cc", "Cf", "Zl", "Zp", "Cs"))
# ... and, in a name given (create, mkdir, rename target), Unicode's
# Default_Ignorable_Code_Point (DerivedCoreProperties.txt, written out here again: the
# oracle's own copy; memfuse's is checked against Perl's Unicode::UCD in test_names_unicode)
IGNORABLE = frozenset(cp for a, b in (
    (0xAD, 0xAD), (0x34F, 0x34F), (0x61C, 0x61C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF)) for cp in range(a, b + 1))


def name_errnos(raw: bytes) -> set[int]:
    """The errnos docs/SEMANTICS.md ("Names") allows for creating one component named ``raw``; ``{0}`` when
    the name is valid. A name both too long and malformed may get either errno."""
    bad: set[int] = set()
    if len(raw) > MAX_COMPONENT:
        bad.add(errno.ENAMETOOLONG)
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        bad.add(errno.EINVAL)
    else:
        if not s or s in (".", "..") or "/" in s or any(ord(c) in FORBIDDEN for c in s):
            bad.add(errno.EINVAL)
        elif any(ord(c) in IGNORABLE for c in s):  # a name given holds none
            bad.add(errno.EINVAL)
        elif not unicodedata.is_normalized("NFC", s):  # a name given is in NFC
            bad.add(errno.EINVAL)
    return bad or {0}


def path_errnos(path: str) -> set[int]:
    """Like ``name_errnos`` for a whole store-relative path ``a/b/c``."""
    parts = path.split("/")
    bad: set[int] = set()
    for p in parts:
        bad |= name_errnos(p.encode("utf-8", "surrogateescape")) - {0}
    if len(parts) > MAX_COMPONENTS or len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        bad.add(errno.ENAMETOOLONG)
    return bad or {0}


def is_local_only(name: str) -> bool:
    """Editor temporaries the sidecar keeps to itself (docs/SEMANTICS.md; default configuration)."""
    return names.is_local_only(name)


def utf8_text_ok(data: bytes) -> bool:
    """Content the control plane takes: UTF-8 without NUL (docs/API.md ``invalid_content``)."""
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ------------------------------------------------------------------ the environment
class MountEnv:
    """A control plane plus one sidecar of workspace ``ws`` mounted at ``tmp/mnt`` (a
    ``mountutil.Rig``: ``stop`` is its teardown).

    ``stores`` maps slug → limits (``update_store`` keyword arguments) applied before the
    mount; ``unattached`` stores exist on the control plane but are not attached to ``ws``.
    """

    def __init__(self, tmp: Path, stores: dict[str, dict], unattached: tuple[str, ...] = (),
                 ws: str = "ws") -> None:
        self.tmp, self.stores, self.unattached, self.ws = tmp, stores, unattached, ws
        self.rig = Rig(tmp)
        self.cp: ControlPlane | None = None
        self.sc: Sidecar | None = None
        self.token_file: Path | None = None
        self.generation = 0

    @property
    def root(self) -> Path:
        return self.tmp / "mnt"

    def store(self, slug: str = "default") -> Path:
        return self.root / slug

    def start(self) -> "MountEnv":
        self.cp = self.rig.__enter__().cp
        self.token_file = self.rig.workspace(self.ws, tuple(self.stores))
        for slug, limits in self.stores.items():
            if limits:
                self.cp.call("update_store", slug, **limits)
        for slug in self.unattached:
            self.cp.call("create_store", slug)
        self._mount()
        return self

    def _mount(self) -> None:
        self.generation += 1
        self.sc = self.rig.sidecar(self.ws, token=self.token_file, mountpoint=self.root,
                                   cache_dir=self.tmp / f"cache{self.generation}",
                                   expect=next(iter(self.stores)))

    def remount(self) -> None:
        """Stop the sidecar (it drains) and mount again with a fresh cache directory."""
        sc, self.sc = self.sc, None
        if sc is not None:
            code = sc.stop()
            assert code == 0, f"sidecar exited {code}"
        self._mount()

    def stop(self) -> None:
        self.rig.close()

    # --- control-plane views
    def records(self, store: str = "default") -> dict[str, object]:
        """path → Record (with content) of every live record of ``store``."""
        return live_records(self.cp, store)

    def contents(self, store: str = "default", prefix: str = "") -> dict[str, str]:
        """path → content of the live records under ``prefix/`` (paths without the prefix)."""
        out = {}
        for path, r in self.records(store).items():
            if not prefix:
                out[path] = r.content
            elif path.startswith(prefix + "/"):
                out[path[len(prefix) + 1:]] = r.content
        return out

    def find(self, store: str, path: str):
        return self.cp.call("find_record", store, path)

    def versions(self, store: str, record_id: str) -> list:
        return self.cp.call("versions", store, record_id)
