"""Every refusal the sidecar can decide alone fails at the syscall while the control plane is
down (docs/SEMANTICS.md, refusals): content not UTF-8 or holding NUL (EILSEQ), a bad
frontmatter type (EINVAL), a secret (EPERM) at close; record size (EFBIG) at write; record
count and store bytes (ENOSPC) at create / write; bad names (EINVAL / ENAMETOOLONG) at create;
special files (EPERM). A valid write made meanwhile closes with 0 and commits once the control
plane is back; nothing refused reaches it.
"""
from __future__ import annotations

import errno
import os

import pytest

from mountcheck import MountEnv, outcome, wait_drained, write_file, xattr
from test_refusals import CONTENT_REFUSALS, OK

pytestmark = pytest.mark.mount


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = MountEnv(tmp_path_factory.mktemp("offline"),
                 stores={"default": {}, "small": {"max_record_bytes": 64},
                         "fewrec": {"max_records": 1}, "fewbytes": {"max_store_bytes": 100}})
    try:
        e.start()
        yield e
    finally:
        e.stop()


@pytest.mark.timeout(240)
def test_local_refusals_fail_at_the_syscall_with_the_control_plane_down(env):
    d = env.store("default")
    assert write_file(env.store("fewrec") / "one.md", b"1\n") == OK
    wait_drained(env.root)
    env.cp.stop()  # from here on the sidecar cannot ask anyone

    got, want = {}, {}
    for kind, (err, make_bad, _fixed, _t, where) in CONTENT_REFUSALS.items():
        name = "c-" + "".join(ch if ch.isalnum() else "-" for ch in kind) + ".md"
        got[kind] = write_file(d / name, make_bad())
        want[kind] = ({"open": None, "write": errno.errorcode[err], "close": None} if where == "write"
                      else {"open": None, "write": None, "close": errno.errorcode[err]})
        assert xattr(d / name, "state") == "rejected", kind
    got["size"] = write_file(env.store("small") / "big.md", b"x" * 65)
    want["size"] = {"open": None, "write": "EFBIG", "close": None}
    got["record count"] = write_file(env.store("fewrec") / "two.md", b"2\n")
    want["record count"] = {"open": "ENOSPC", "write": "skipped", "close": "skipped"}
    got["store bytes"] = write_file(env.store("fewbytes") / "b.md", b"y" * 101)
    want["store bytes"] = {"open": None, "write": "ENOSPC", "close": None}
    got["control char name"] = write_file(d / "bad\x01name.md", b"z\n")
    want["control char name"] = {"open": "EINVAL", "write": "skipped", "close": "skipped"}
    got["long name"] = write_file(d / ("n" * 256), b"z\n")
    want["long name"] = {"open": "ENAMETOOLONG", "write": "skipped", "close": "skipped"}
    got["mkdir bad name"] = {"mkdir": outcome(lambda: os.mkdir(d / "a\u200bb"))}
    want["mkdir bad name"] = {"mkdir": "EINVAL"}
    got["symlink"] = {"symlink": outcome(lambda: os.symlink("x", d / "link"))}
    want["symlink"] = {"symlink": "EPERM"}
    got["fifo"] = {"mkfifo": outcome(lambda: os.mkfifo(d / "fifo"))}
    want["fifo"] = {"mkfifo": "EPERM"}
    # a valid write is accepted meanwhile: close 0, pending until the control plane is back
    got["valid"] = write_file(d / "ok.md", b"fine\n")
    want["valid"] = OK
    assert got == want
    assert xattr(d / "ok.md", "state") == "pending"

    env.cp.start()
    wait_drained(env.root, timeout=60)
    assert env.contents("default") == {"ok.md": "fine\n"}
    assert set(env.contents("fewrec")) == {"one.md"}
    assert env.contents("small") == {} and env.contents("fewbytes") == {}
