"""A store taken out of a running mount and put back (admin ``memfuse mounts remove`` / ``add``
on the sidecar's Unix socket, as the CLI does; or a workspace detach / attach through the
control plane) while another mount appends to a shared journal (attack 11, F6 and F7): the
next append of the mount that took the store out is an append onto what its new tree holds,
each line once, and a change it queued before the removal shows on the store loaded again
and is kept (docs/SEMANTICS.md, "Life cycle": what the outbox holds shows on top of a store
loaded again, as at a restart)."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from mountutil import drained, read, sh, two_sidecars, wait_until

pytestmark = pytest.mark.mount

BASE = "# journal\n" + "x" * 4000 + "\n"  # above the append threshold (APPEND_MIN_BYTES)
A_LINES = "".join(f"A-{i}\n" for i in range(1, 6))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("remount")) as cp_a_b:
        yield cp_a_b


def _admin(sc) -> httpx.Client:
    """The sidecar's admin API on its Unix socket (where ``memfuse mounts`` talks)."""
    st = json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())
    return httpx.Client(transport=httpx.HTTPTransport(uds=st["admin_socket"]),
                        base_url="http://sidecar", timeout=60)


def _start(pair) -> tuple[str, object, object]:
    """A journal ``BASE`` + ``B-1`` written by B, seen by both mounts."""
    cp, a, b = pair
    name = "j-" + uuid.uuid4().hex[:6] + ".md"
    pa, pb = a.mountpoint / "shared" / name, b.mountpoint / "shared" / name
    pa.write_text(BASE)
    wait_until(lambda: read(pb) == BASE, what="journal visible in B")
    sh(f"echo B-1 >> {pb}", pb.parent, timeout=30)
    drained(b)
    wait_until(lambda: read(pa) == BASE + "B-1\n", what="B's line visible in A")
    return name, pa, pb


def _final(pair, name: str, want: str) -> None:
    """The control plane and both mounts hold ``want``."""
    cp, a, b = pair
    drained(a, b)
    rec = cp.call("find_record", "shared", name)
    got = cp.call("get_record", "shared", rec.id).content
    assert got == want, got[len(BASE):]
    pa, pb = a.mountpoint / "shared" / name, b.mountpoint / "shared" / name
    wait_until(lambda: read(pa) == want and read(pb) == want, timeout=30,
               what="both mounts show the journal")


def test_append_after_mounts_remove_and_add_is_sent_once(pair):
    """F6: B's store out (admin remove), A appends five lines, B's store back (admin add),
    B appends: each line once (on main: A's five lines twice, B's append cut at the length
    of the version B knew before the removal)."""
    cp, a, b = pair
    name, pa, pb = _start(pair)
    with _admin(b) as adm:
        r = adm.delete("/v1/mounts/shared")
        assert r.status_code == 200, r.text
        assert r.json()["uncommitted"] == 0
        sh(f"for i in 1 2 3 4 5; do echo A-$i >> {pa}; done", pa.parent, timeout=60)
        drained(a)
        r = adm.post("/v1/mounts/shared")
        assert r.status_code == 200, r.text
    assert read(pb) == BASE + "B-1\n" + A_LINES  # the store loaded anew
    sh(f"echo B-2 >> {pb}", pb.parent, timeout=30)
    _final(pair, name, BASE + "B-1\n" + A_LINES + "B-2\n")


def test_append_after_detach_and_attach_is_sent_once(pair):
    """F6 through the control plane: B's workspace detached from the store and attached
    again (the sidecar reconciles on the events) while A appends."""
    cp, a, b = pair
    name, pa, pb = _start(pair)
    cp.call("detach", "wb", "shared")
    wait_until(lambda: not (b.mountpoint / "shared").exists(), 30, "the store leaves B's mount")
    sh(f"for i in 1 2 3 4 5; do echo A-$i >> {pa}; done", pa.parent, timeout=60)
    drained(a)
    cp.call("attach", "wb", "shared", access="read_write")
    wait_until(lambda: read(pb) == BASE + "B-1\n" + A_LINES, 30, "the store back in B's mount")
    sh(f"echo B-2 >> {pb}", pb.parent, timeout=30)
    _final(pair, name, BASE + "B-1\n" + A_LINES + "B-2\n")


def test_append_after_a_restart_is_sent_once(pair):
    """The same from a previous process: B stopped, A appends, B started again (its journal's
    key map names B's last commit, older than what the store loaded holds), B appends."""
    cp, a, b = pair
    name, pa, pb = _start(pair)
    b.stop()
    try:
        sh(f"for i in 1 2 3 4 5; do echo A-$i >> {pa}; done", pa.parent, timeout=60)
        drained(a)
    finally:
        b.start(expect="shared")
    assert read(pb) == BASE + "B-1\n" + A_LINES
    sh(f"echo B-2 >> {pb}", pb.parent, timeout=30)
    _final(pair, name, BASE + "B-1\n" + A_LINES + "B-2\n")


def test_append_queued_at_removal_shows_when_put_back_and_is_kept(pair):
    """F7: B's append queued while the control plane is down (close 0), B's store out with
    it in the outbox, the control plane back, A appends, B's store back: B's mount shows its
    queued line, and B's next append keeps it (on main: B-2 gone from the live content, a
    conflict line naming B's own write)."""
    cp, a, b = pair
    name, pa, pb = _start(pair)
    cp.stop()
    try:
        sh(f"echo B-2 >> {pb}", pb.parent, timeout=30)  # accepted: in B's outbox journal
        with _admin(b) as adm:
            r = adm.delete("/v1/mounts/shared")
            assert r.status_code == 200, r.text
            assert r.json()["uncommitted"] == 1
    finally:
        cp.start()
    sh(f"for i in 1 2 3 4 5; do echo A-$i >> {pa}; done", pa.parent, timeout=60)
    drained(a)
    with _admin(b) as adm:
        r = adm.post("/v1/mounts/shared")
        assert r.status_code == 200, r.text
    view = read(pb)
    # what the outbox holds shows on top of the store loaded again: the queued line (alone on
    # the version it was written on while it waits, or merged onto A's lines once committed)
    assert view in (BASE + "B-1\nB-2\n", BASE + "B-1\n" + A_LINES + "B-2\n"), (view or "")[-80:]
    sh(f"echo B-3 >> {pb}", pb.parent, timeout=30)
    _final(pair, name, BASE + "B-1\n" + A_LINES + "B-2\nB-3\n")
    assert name not in (b.mountpoint / ".memfuse" / "errors.log").read_text()  # no conflict line


def test_write_refused_at_detach_is_merged_after_attach(pair):
    """N2 (verify 11): a write of B committed while B's workspace is detached from the store
    is refused ``404 store_not_attached`` and its file kept ``rejected``; A appends while the
    store is out; the store attached again, B appends to the kept file: the fix is sent on
    the version it was refused over, so A's lines are kept (on main: the rejected file's
    base became the version the store loaded, and B's whole put dropped A-1..A-5 with no
    conflict line)."""
    cp, a, b = pair
    name, pa, pb = _start(pair)
    f = open(pb, "a")
    try:
        f.write("B-2\n")
        f.flush()  # dirty at the detach: committed by the removal, refused by the CP
        cp.call("detach", "wb", "shared")
        wait_until(lambda: not (b.mountpoint / "shared").exists(), 30, "the store leaves B's mount")
    finally:
        try:
            f.close()
        except OSError:
            pass  # the store is gone from the mount (ESTALE)
    sh(f"for i in 1 2 3 4 5; do echo A-$i >> {pa}; done", pa.parent, timeout=60)
    drained(a)
    cp.call("attach", "wb", "shared", access="read_write")
    wait_until(lambda: (b.mountpoint / "shared").exists(), 30, "the store back in B's mount")
    kept = read(pb)
    assert kept == BASE + "B-1\nB-2\n", (kept or "")[len(BASE):]  # rejected, kept as written
    sh(f"echo B-3 >> {pb}", pb.parent, timeout=30)
    _final(pair, name, BASE + "B-1\n" + A_LINES + "B-2\nB-3\n")
