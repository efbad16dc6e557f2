"""Records at the size limits through a real mount and a real ``memfuse serve`` (attack 12,
A2; docs/API.md, "Limits"): a store may not allow records larger than one request carries;
a file over the store's limit is EFBIG at write(2); a file within the limit whose JSON body
is over the front door's bound (control characters are escaped six-fold) is refused 413
``too_large`` before the server reads it, and that refusal reaches the agent (EFBIG at the
close that waits for it, ``state=rejected``, an errors.log line, the content kept in the
file), never an endless retry: a later small write of the same store commits and
``status.json`` says the control plane is reachable.

On main the 413 reached the sidecar as a broken send (``write_error``): the entry was
retried for ever, every later write of the store stayed pending and the mount reported the
control plane unreachable.
"""
from __future__ import annotations

import json

import msgspec
import pytest

from memfuse.defs import largest_record, record_body_bound
from memfuse.errors import ApiError
from mountcheck import errors_log, status, wait_drained, write_file, xattr
from mountutil import ControlPlane, Sidecar, live_records

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

OK = {"open": None, "write": None, "close": None}
MIB = 1 << 20


def test_a_record_the_front_door_refuses_is_a_verdict_not_an_outage(tmp_path):
    # a front door of 3 MiB (the store's largest record then ~1.47 MiB): the content scans
    # of the sidecar cost seconds per 8 MiB on a loaded machine
    body_max = 3 * MIB
    largest = largest_record(body_max)
    cp = ControlPlane(tmp_path, extra_args=("--max-body", str(body_max))).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("bigs", "other"))
        # the store's limit agrees with the front door's: 64 MiB (attack 12) is refused, and
        # so is one byte more than a request carries
        for too_big in (64 * MIB, largest + 1):
            with pytest.raises(ApiError) as refused:
                cp.call("update_store", "bigs", max_record_bytes=too_big, max_store_bytes=512 * MIB)
            assert (refused.value.status, refused.value.code) == (422, "invalid_limit")
        cp.call("update_store", "bigs", max_record_bytes=largest, max_store_bytes=512 * MIB)
        mnt = tmp_path / "mnt"
        sc = Sidecar(cp, "ws", tok, mnt, tmp_path / "cache").start(expect="bigs")
        bigs = mnt / "bigs"

        # over the store's limit: EFBIG at write(2), nothing sent
        assert write_file(bigs / "over.txt", b"x" * (largest + 1))["write"] == "EFBIG"

        # at the limit, but its JSON body is just over the front door's bound: a quote is
        # escaped as two bytes (the rule's factor), a control character as six
        ctl = 64 * 1024
        data = b'"' * (largest - ctl) + b"\x01" * ctl
        assert len(data) == largest and record_body_bound(largest) <= body_max
        body = len(msgspec.json.encode({"path": "ctl.txt", "content": data.decode()}))
        assert body_max < body < body_max + 5 * ctl
        got = write_file(bigs / "ctl.txt", data)
        assert got == {"open": None, "write": None, "close": "EFBIG"}, got  # the close waits for it
        assert xattr(bigs / "ctl.txt", "state") == "rejected"
        assert (bigs / "ctl.txt").read_bytes() == data  # what close accepted stays in the file
        logged = [e for e in errors_log(mnt) if "ctl.txt" in json.dumps(e)]
        assert logged and "EFBIG" in json.dumps(logged), errors_log(mnt)

        # the store's later writes commit; the control plane is reachable
        assert write_file(bigs / "small.md", b"small\n") == OK
        assert write_file(mnt / "other" / "o.md", b"other\n") == OK
        wait_drained(mnt, timeout=30)
        assert live_records(cp, "bigs")["small.md"].content == "small\n"
        assert "ctl.txt" not in live_records(cp, "bigs")
        st = status(mnt)
        assert st["control_plane"]["reachable"] is True, st["control_plane"]
        assert xattr(bigs / "small.md", "state") == "clean"
    finally:
        try:
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()
