"""A write refused at write(2) through a shared ``mmap`` (attack18 F13): ``msync`` fails with
``EPERM`` and ``errors.log`` names it, and the kernel's page cache no longer holds the refused
bytes afterwards: ``cat`` on the same mount, another process, shows what the file held before
the write (docs/SEMANTICS.md, "Refusals": the file keeps what it held before that write).

Secret-shaped text is built at run time, never written in the repository.
"""
from __future__ import annotations

import mmap
import os
import random
import string
import subprocess

import pytest

from mountcheck import errors_log, wait_drained
from mountutil import live_records, serve_and_mount

pytestmark = pytest.mark.mount


def _github_token() -> bytes:
    rnd = random.Random(13)
    return ("gh" + "p_" + "".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(36))).encode()


def test_refused_mmap_write_leaves_no_refused_bytes_in_the_page_cache(tmp_path):
    tok = _github_token()
    before = b"x" * 100 + b"\n"
    with serve_and_mount(tmp_path) as (cp, sc):
        p = sc.mountpoint / "default" / "mm.md"
        p.write_bytes(before)
        wait_drained(sc.mountpoint)
        fd = os.open(p, os.O_RDWR)
        try:
            m = mmap.mmap(fd, len(before))
            try:
                m[10:10 + len(tok) + 2] = b" " + tok + b" "
                with pytest.raises(OSError) as e:
                    m.flush()
                assert e.value.errno == 1  # EPERM
            finally:
                m.close()
        finally:
            try:
                os.close(fd)
            except OSError:
                pass  # the close may report the refusal again
        shown = subprocess.run(["cat", str(p)], capture_output=True, timeout=30, check=True).stdout
        assert shown == before
        wait_drained(sc.mountpoint)
        assert live_records(cp)["mm.md"].content == before.decode()
        assert [(e["path"], e["errno"], e["code"]) for e in errors_log(sc.mountpoint)] == \
            [("mm.md", "EPERM", "secret_detected")]
