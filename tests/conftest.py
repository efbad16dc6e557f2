"""Suite-wide rules.

- In CI (``CI`` set), a skipped test that needs a real FUSE mount or a real browser (markers
  ``mount`` and ``browser``) fails the run: a skipped mount or browser test proves nothing.
- A test whose sidecar (``mountutil.Sidecar``, or any log passed to ``mountutil.watch_log``)
  logged an ERROR or a traceback fails, unless it is marked ``expect_sidecar_errors`` (with the
  reason as the marker's argument). The same holds for the in-process layer tests
  (``IN_PROCESS``: the sidecar runs in the test's own process), whose ``memfuse.*`` log
  records at ERROR or above are caught by a handler.
- ``home``: a fresh ``MEMFUSE_HOME`` (and ``XDG_CACHE_HOME``) under the test's tmp dir, every
  other ``MEMFUSE_*`` variable removed (but ``MEMFUSE_CHECK_INVARIANTS``), for tests of the
  CLI's local mode.
- Every sidecar the tests start (in process or as a subprocess, which inherits the
  environment) checks the filesystem core's invariants after every modifying FUSE operation
  (``MEMFUSE_CHECK_INVARIANTS=1``, ``InodeTable.check_invariants``); a broken one is logged
  as an ERROR (failing the test as above) and, in process, kept in
  ``inodes.BROKEN_INVARIANTS``, which fails the test too.
- Any FUSE mount a test left behind under this session's temporary directory is lazily
  unmounted at the end of the session, so a failing test cannot leave the machine with a dead mount.
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

# before any memfuse.sidecar module is imported: read once at import (inodes.CHECK_INVARIANTS)
os.environ.setdefault("MEMFUSE_CHECK_INVARIANTS", "1")

_skipped_mount_tests: list[str] = []
# modules whose sidecar layers run in the test process (their memfuse.* ERROR records count)
IN_PROCESS = {"test_core", "test_faults", "test_layers"}


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
async def fake():
    """The in-process fake control plane (``memfuse.fake.FakeControlPlane``, no fault seed),
    closed after the test. Modules that want a seeded one define their own ``fake``."""
    from memfuse.fake import FakeControlPlane

    f = FakeControlPlane()
    try:
        yield f
    finally:
        await f.aclose()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """MEMFUSE_HOME in a tmp dir and no other MEMFUSE_* variable in the environment."""
    for k in list(os.environ):
        if k.startswith("MEMFUSE_") and k != "MEMFUSE_CHECK_INVARIANTS":
            monkeypatch.delenv(k)
    h = tmp_path / "home"
    monkeypatch.setenv("MEMFUSE_HOME", str(h))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return h


def pytest_configure(config):
    config.addinivalue_line("markers", "expect_sidecar_errors(reason): the test's sidecar may "
                                       "log an ERROR or a traceback on purpose")


@pytest.fixture(autouse=True)
def invariants_kept():
    """Fail the test when an in-process sidecar found one of its invariants broken."""
    from memfuse.sidecar import inodes

    del inodes.BROKEN_INVARIANTS[:]
    yield
    broken, inodes.BROKEN_INVARIANTS[:] = list(inodes.BROKEN_INVARIANTS), []
    assert not broken, f"sidecar invariants broken: {broken[:5]}"


@pytest.fixture(autouse=True)
def sidecar_logs_clean(request):
    """Fail the test when a watched sidecar log got an unexpected ERROR or traceback."""
    try:
        import mountutil
    except ImportError:  # pragma: no cover
        yield
        return
    mountutil.WATCHED_LOGS.clear()
    errors = None
    if request.module.__name__ in IN_PROCESS:
        errors = _ErrorRecords()
        logging.getLogger("memfuse").addHandler(errors)
    try:
        yield
    finally:
        if errors is not None:
            logging.getLogger("memfuse").removeHandler(errors)
    watched, mountutil.WATCHED_LOGS[:] = list(mountutil.WATCHED_LOGS), []
    if request.node.get_closest_marker("expect_sidecar_errors"):
        return
    bad = [f"{path.name}: {line[:600]}" for path, off in watched
           for line in mountutil.unexpected_log_lines(path, off)]
    bad += [f"{r.name}: {r.getMessage()[:600]}" + (" (with traceback)" if r.exc_info else "")
            for r in (errors.records if errors is not None else [])]
    if bad:
        pytest.fail("the sidecar logged unexpected errors:\n" + "\n".join(bad[:10]),
                    pytrace=False)


def pytest_runtest_logreport(report):
    if report.skipped and ("mount" in report.keywords or "browser" in report.keywords):
        _skipped_mount_tests.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    try:
        base = str(session.config._tmp_path_factory.getbasetemp())
    except Exception:
        base = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                # only this session's mounts: other pytest sessions may be running beside us
                if base and fields[2].startswith("fuse") and fields[1].startswith(base + "/"):
                    subprocess.run(["fusermount3", "-uz", fields[1].replace("\\040", " ")],
                                   capture_output=True, timeout=10)
    except OSError:
        pass
    if os.environ.get("CI") and _skipped_mount_tests:
        print("\nCI: mount or browser tests were skipped, which counts as failure:")
        for t in _skipped_mount_tests:
            print("  " + t)
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CI") and not os.path.exists("/dev/fuse"):
        raise pytest.UsageError("CI needs /dev/fuse for the mount tests")
