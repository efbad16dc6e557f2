"""The test rig's teardown rule (``mountutil.Rig``, ``ControlPlane``, ``Sidecar``), with real
processes and mounts: whatever happens in a test, no ``memfuse`` process and no mount is left
behind, and a frozen control plane stops cleanly.

- A block that fails stops every sidecar (unmounted) and then the control plane, frozen or
  not, with SIGTERM (exit 0), not the SIGKILL of a process that would not answer it.
- A teardown step that fails skips none of the later ones; its error is chained to the
  test's own.
- A sidecar whose start fails half-way (its process runs, the mount never shows what the test
  waits for) is stopped and unmounted by ``start`` itself, and starts again fine.
"""
from __future__ import annotations

import time

import pytest

from mountutil import ControlPlane, Rig, is_mounted

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]


class Boom(Exception):
    """The test's own failure."""


def test_a_failing_block_stops_every_sidecar_then_the_control_plane_even_frozen(tmp_path):
    with pytest.raises(Boom):
        with Rig(tmp_path) as rig:
            a = rig.sidecar("ws")
            b = rig.sidecar("wb", mountpoint=tmp_path / "mb", cache_dir=tmp_path / "cb")
            idle = rig.sidecar("ws", mountpoint=tmp_path / "m3", cache_dir=tmp_path / "c3",
                               start=False)
            assert is_mounted(a.mountpoint) and is_mounted(b.mountpoint)
            rig.cp.freeze()
            t0 = time.monotonic()
            raise Boom
    took = time.monotonic() - t0
    for sc in (a, b):
        assert sc.proc is not None and sc.proc.returncode == 0, (sc.ws, sc.proc.returncode)
        assert not is_mounted(sc.mountpoint)
    assert idle.proc is None and not is_mounted(idle.mountpoint)
    assert rig.cp.proc is not None and rig.cp.proc.returncode == 0  # SIGTERM answered: thawed
    assert took < 25, took  # a frozen server ignoring SIGTERM waited 30 s for SIGKILL


def test_a_failing_teardown_step_skips_none_of_the_others(tmp_path):
    def broken() -> None:
        raise RuntimeError("a teardown step failed")

    with pytest.raises(RuntimeError) as failed:
        with Rig(tmp_path) as rig:
            a = rig.sidecar("ws")
            rig.defer(broken)  # runs after b's stop, before a's
            b = rig.sidecar("ws", mountpoint=tmp_path / "mb", cache_dir=tmp_path / "cb")
            raise Boom
    assert isinstance(failed.value.__context__, Boom)  # the test's own error is kept
    for sc in (a, b):
        assert sc.proc is not None and sc.proc.poll() is not None and not is_mounted(sc.mountpoint)
    assert rig.cp.proc is not None and rig.cp.proc.poll() is not None


def test_a_sidecar_start_that_fails_half_way_leaves_no_process_and_no_mount(tmp_path):
    with Rig(tmp_path) as rig:
        sc = rig.sidecar("ws", start=False)
        with pytest.raises(AssertionError, match="timed out waiting for mount"):
            sc.start(expect="no-such-store", timeout=5)  # mounted, but never shows that store
        assert sc.proc is not None and sc.proc.poll() is not None
        assert not is_mounted(sc.mountpoint)
        sc.start(expect="default")  # the same sidecar starts again
        assert (sc.mountpoint / "default").is_dir()


def test_a_frozen_control_plane_stops_with_sigterm_and_restarts_on_its_port(tmp_path):
    cp = ControlPlane(tmp_path).start()
    try:
        url = cp.url
        cp.freeze()
        t0 = time.monotonic()
        cp.stop()
        assert cp.proc is not None and cp.proc.returncode == 0 and time.monotonic() - t0 < 25
        cp.restart(("--no-streams",))
        assert cp.url == url and "--no-streams" in cp.proc.args
        assert cp.call("list_stores") is not None
    finally:
        cp.stop()
