"""Records at the size limits through a real mount and a real ``memfuse serve`` (attack 12,
A2; verifier N1 of session 12; docs/API.md "A record fits in one request"): a store may not
allow records larger than one request carries, counting the true worst case of the body (a
control character escaped six-fold, ``memfuse.defs.RECORD_BODY_GROWTH``), so a file at the
store's limit made only of control characters commits; a file over the limit is EFBIG at
write(2).

A store whose limit was set under a larger ``--max-body`` keeps it when the server restarts
with a smaller one: the server names it in a warning at start (``stores_over_body_bound``),
and its records past the body bound are refused 413 ``too_large`` before the server reads
them; that refusal reaches the agent (EFBIG at the close that waits for it,
``state=rejected``, an errors.log line, the content kept in the file), never an endless retry:
a later small write of the same store commits and ``status.json`` says the control plane is
reachable.

On main a file of ``\\x01`` at the store's limit was refused EFBIG at close (its JSON body was
three times the bound's allowance), and nothing named a store over a lowered ``--max-body``.
"""
from __future__ import annotations

import json

import msgspec
import pytest

from memfuse.defs import RECORD_BODY_MIN, largest_record, record_body_bound
from memfuse.errors import ApiError
from mountcheck import errors_log, status, wait_drained, write_file, xattr
from mountutil import Rig, live_records

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

OK = {"open": None, "write": None, "close": None}
MIB = 1 << 20
WORST = b"\x01"  # escaped as \u0001: six bytes of JSON for one of content


def test_a_record_of_control_characters_at_the_limit_commits_through_a_mount(tmp_path):
    # the smallest front door (6 MiB + 64 KiB: the store's largest record then 1 MiB): the
    # content scans of the sidecar cost seconds per 8 MiB on a loaded machine
    body_max = RECORD_BODY_MIN
    largest = largest_record(body_max)
    with Rig(tmp_path, serve_args=("--max-body", str(body_max))) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", stores=("bigs",), start=False)  # mounted once the limit is set
        # the store's limit agrees with the front door's: 64 MiB (attack 12) is refused, and
        # so is one byte more than a request carries
        for too_big in (64 * MIB, largest + 1):
            with pytest.raises(ApiError) as refused:
                cp.call("update_store", "bigs", max_record_bytes=too_big, max_store_bytes=512 * MIB)
            assert (refused.value.status, refused.value.code) == (422, "invalid_limit")
        cp.call("update_store", "bigs", max_record_bytes=largest, max_store_bytes=512 * MIB)
        sc.start()
        mnt = sc.mountpoint
        bigs = mnt / "bigs"

        # over the store's limit: EFBIG at write(2), nothing sent
        assert write_file(bigs / "over.txt", WORST * (largest + 1))["write"] == "EFBIG"

        # at the limit, every byte a control character: its JSON body is six times its size
        data = WORST * largest
        assert write_file(bigs / "ctl.txt", data) == OK
        body = len(msgspec.json.encode({"path": "ctl.txt", "content": data.decode()}))
        assert 6 * largest < body <= record_body_bound(largest) == body_max
        wait_drained(mnt, timeout=60)
        rec = live_records(cp, "bigs")["ctl.txt"]
        assert rec.size == largest and rec.content == data.decode()
        assert xattr(bigs / "ctl.txt", "state") == "clean"
        assert "over.txt" not in live_records(cp, "bigs")


def test_a_store_over_a_lowered_body_bound_is_named_at_start_and_its_413_is_a_verdict(tmp_path):
    # a store allowed 2 MiB records under a front door that carried them; the server then
    # restarts with the smallest one (largest record 1 MiB)
    wide = record_body_bound(2 * MIB)
    with Rig(tmp_path, serve_args=("--max-body", str(wide))) as rig:
        cp = rig.cp
        rig.workspace("ws", ("bigs", "other"))
        cp.call("update_store", "bigs", max_record_bytes=2 * MIB, max_store_bytes=512 * MIB)
        cp.stop()
        offset = cp.log.stat().st_size
        cp.restart(("--max-body", str(RECORD_BODY_MIN)))
        with cp.log.open("rb") as f:
            f.seek(offset)
            lines = [json.loads(x) for x in f.read().splitlines() if x.startswith(b"{")]
        warned = [x for x in lines if x.get("event") == "stores_over_body_bound"]
        assert len(warned) == 1, lines
        w = warned[0]
        assert w["level"] == "warning" and w["stores"] == "bigs" and w["count"] == 1, w  # not "other"
        assert w["max_body"] == RECORD_BODY_MIN and w["largest_record"] == largest_record(RECORD_BODY_MIN)
        assert w["max_body_needed"] == wide and "--max-body" in w["msg"] and "max-record-bytes" in w["msg"]
        assert cp.call("get_store", "bigs").max_record_bytes == 2 * MIB  # kept, never changed behind the admin's back

        mnt = rig.sidecar("ws").mountpoint  # waits for "bigs", the first of its stores
        bigs = mnt / "bigs"
        # within the store's limit, but its body is past the front door's bound: 413
        # too_large before the server reads it, EFBIG at the close that waits for it
        data = WORST * (2 * MIB)
        got = write_file(bigs / "ctl.txt", data)
        assert got == {"open": None, "write": None, "close": "EFBIG"}, got
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
