"""File attributes on real mounts with real tools: permission bits and mtime are record
attributes kept by the control plane (chmod, touch -d, install -m, cp -p, shutil.copy2 /
copytree), so they survive a sidecar restart (warm and fresh cache) and reach another
sidecar; a chmod or utimens of a clean file makes one metadata-only version and uploads no
content; directory modes stay in the sidecar (docs/SEMANTICS.md)."""
from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from mountutil import MEMFUSE, ControlPlane, Rig, Sidecar, live_records, sh, wait_until

pytestmark = pytest.mark.mount

T2020 = "2020-01-02"


def versions(cp: ControlPlane, path: str, store: str = "default"):
    rec = live_records(cp, store)[path]
    return cp.call("versions", store, rec.id)


def api_calls(sc: Sidecar) -> dict[str, float]:
    """The sidecar's ``memfuse_api_calls_total`` by endpoint (all statuses summed)."""
    admin = json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())["admin"]
    text = httpx.get(f"http://{admin}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^memfuse_api_calls_total\{(.*)\} (\S+)$', text, re.M):
        endpoint = re.search(r'endpoint="([^"]*)"', m.group(1)).group(1)
        out[endpoint] = out.get(endpoint, 0) + float(m.group(2))
    return out


def content_uploads(calls: dict[str, float]) -> float:
    return sum(v for k, v in calls.items() if k.startswith(("PUT ", "POST /v1/stores/{}/records")))


def outbox_empty(sc: Sidecar) -> bool:
    st = json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())
    return st["outbox"]["depth"] == 0


def test_script_mode_and_mtime_survive_restarts(tmp_path):
    """The issue's scenario: chmod 755 + touch -d on a script, then restart the sidecar with
    its cache and with a fresh one: still executable, mtime kept to the nanosecond."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws")
        d = sc.mountpoint / "default"
        sh(f"printf '#!/bin/sh\\necho ran\\n' > s.sh && chmod 755 s.sh && touch -d {T2020} s.sh", d)
        assert sh("./s.sh", d).stdout == "ran\n"
        before = os.stat(d / "s.sh")
        assert stat.S_IMODE(before.st_mode) == 0o755
        want_mtime = int(sh(f"date -d {T2020} +%s", d).stdout) * 10**9
        assert before.st_mtime_ns == want_mtime
        wait_until(lambda: outbox_empty(sc), timeout=10.0, what="outbox drained")
        rec = live_records(cp)["s.sh"]
        assert (rec.mode, rec.mtime_ns) == (0o755, want_mtime)
        vs = versions(cp, "s.sh")
        # the chmod's version pins the mtime the file showed then (chmod(2) leaves st_mtime)
        pinned = vs[1].mtime_ns
        assert pinned is not None and pinned != want_mtime
        assert [(v.operation.value, v.mode, v.mtime_ns) for v in vs] == [
            ("created", 0o644, None), ("modified", 0o755, pinned), ("modified", 0o755, want_mtime)]
        assert len({v.sha256 for v in vs}) == 1  # attribute versions carry no new content

        for fresh in (False, True):
            sc.stop()
            if fresh:
                shutil.rmtree(sc.cache_dir)
            sc.start()
            st = os.stat(d / "s.sh")
            assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o755, want_mtime), fresh
            assert sh("./s.sh", d).stdout == "ran\n"
        # a write sets the mtime again (an explicit one is gone), the mode stays
        sh("echo 'echo again' >> s.sh", d)
        wait_until(lambda: outbox_empty(sc), timeout=10.0, what="outbox drained")
        rec = live_records(cp)["s.sh"]
        assert (rec.mode, rec.mtime_ns) == (0o755, None)
        assert os.stat(d / "s.sh").st_mtime_ns > want_mtime
        assert sh("./s.sh", d).stdout == "ran\nagain\n"


def test_a_move_keeps_the_mtime_across_restarts_and_exports(tmp_path):
    """Issue 20: ``echo one > c.md; sleep; mv c.md d.md``: after a restart (fresh cache too)
    and in an export, d.md shows the time of the write, not of the mv; so does a file moved
    with its directory."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws")
        d = sc.mountpoint / "default"
        sh("echo one > c.md && mkdir dir && echo two > dir/e.md", d)
        wait_until(lambda: outbox_empty(sc), timeout=10.0, what="outbox drained")
        written = {p: live_records(cp)[p].updated_at for p in ("c.md", "dir/e.md")}
        time.sleep(1.5)
        sh("mv c.md d.md && mv dir moved", d)
        wait_until(lambda: outbox_empty(sc), timeout=10.0, what="outbox drained")
        recs = live_records(cp)
        for old, new in (("c.md", "d.md"), ("dir/e.md", "moved/e.md")):
            want = int(written[old].timestamp() * 10**6) * 1000
            assert recs[new].mtime_ns is not None and abs(recs[new].mtime_ns - want) < 10**6, new
            assert recs[new].updated_at > written[old]  # the move's version is later
        for fresh in (False, True):
            sc.stop()
            if fresh:
                shutil.rmtree(sc.cache_dir)
            sc.start()
            for new in ("d.md", "moved/e.md"):
                assert os.stat(d / new).st_mtime_ns == recs[new].mtime_ns, (fresh, new)
        out = tmp_path / "export"
        sh(f"{MEMFUSE} export default {out} --control-plane {cp.url} "
           f"--token-file {cp.token_file}", tmp_path, timeout=60)
        for new in ("d.md", "moved/e.md"):
            assert os.stat(out / new).st_mtime_ns == recs[new].mtime_ns, new


def test_chown_to_another_owner_is_eperm_and_a_no_op_chown_succeeds(tmp_path):
    """Owner and group are the mount's (nothing stores them): a chown that changes nothing
    succeeds, one to another owner is EPERM (``tar x`` says so), never shown until a
    restart and then lost."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws")
        d = sc.mountpoint / "default"
        sh("echo one > f.md", d)
        st = os.stat(d / "f.md")
        os.chown(d / "f.md", st.st_uid, st.st_gid)
        os.chown(d / "f.md", -1, -1)
        with pytest.raises(PermissionError):
            os.chown(d / "f.md", st.st_uid + 1000, -1)
        with pytest.raises(PermissionError):
            os.chown(d / "f.md", -1, st.st_gid + 1000)
        r = sh("chown 1234:1234 f.md", d, check=False)
        assert r.returncode == 1 and "Operation not permitted" in r.stderr, r.stderr
        # tar x of files owned by another uid, as root: reported, the content still there
        src = tmp_path / "src"
        src.mkdir()
        (src / "t.md").write_text("tar\n")
        os.chown(src / "t.md", 1234, 1234)
        sh(f"tar -C {src} -cf {tmp_path}/a.tar t.md", tmp_path)
        r = sh(f"tar -xf {tmp_path}/a.tar", d, check=False)
        assert r.returncode != 0 and "Cannot change ownership" in r.stderr, r.stderr
        assert (d / "t.md").read_text() == "tar\n"
        assert (os.stat(d / "t.md").st_uid, os.stat(d / "f.md").st_uid) == (st.st_uid, st.st_uid)
        sc.stop()
        sc.start()
        assert (os.stat(d / "t.md").st_uid, os.stat(d / "t.md").st_gid) == (st.st_uid, st.st_gid)


def test_chmod_of_a_clean_file_is_one_version_without_upload(tmp_path):
    """chmod / touch -d of a committed file: one metadata-only version each (same sha256,
    no PUT or POST of content); a chmod to the same mode, none; sed -i and a Python
    replace keep the mode and make exactly one version; another sidecar sees the attributes."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("wa")
        rig.workspace("wb")
        a = rig.sidecar("wa", mountpoint=tmp_path / "ma", cache_dir=tmp_path / "ca")
        b = rig.sidecar("wb", mountpoint=tmp_path / "mb", cache_dir=tmp_path / "cb")
        da, db_ = a.mountpoint / "default", b.mountpoint / "default"
        sh("echo 'alpha beta' > notes.md", da)
        wait_until(lambda: outbox_empty(a), timeout=10.0, what="outbox drained")
        n0 = len(versions(cp, "notes.md"))
        calls0 = api_calls(a)
        shown = os.stat(da / "notes.md").st_mtime_ns
        time.sleep(0.05)  # the chmod's version gets a later updated_at
        sh("chmod 640 notes.md", da)
        wait_until(lambda: outbox_empty(a) and len(versions(cp, "notes.md")) == n0 + 1, timeout=10.0, what="one version")
        # chmod(2) changes the ctime, not the mtime: here, in the other sidecar, on the record
        assert os.stat(da / "notes.md").st_mtime_ns == shown
        assert live_records(cp)["notes.md"].mtime_effective_ns() == shown
        wait_until(lambda: stat.S_IMODE(os.stat(db_ / "notes.md").st_mode) == 0o640, timeout=10.0,
                   what="the chmod in the other sidecar")
        assert os.stat(db_ / "notes.md").st_mtime_ns == shown
        sh("chmod 640 notes.md && chmod g+r notes.md", da)  # the same mode again: nothing
        sh(f"touch -m -d '{T2020} 10:11:12.123456789' notes.md", da)
        wait_until(lambda: outbox_empty(a) and len(versions(cp, "notes.md")) == n0 + 2, timeout=10.0, what="mtime version")
        time.sleep(0.3)
        vs = versions(cp, "notes.md")
        assert len(vs) == n0 + 2
        assert [v.operation.value for v in vs[n0:]] == ["modified", "modified"]
        assert {v.sha256 for v in vs} == {vs[0].sha256}
        calls1 = api_calls(a)
        assert content_uploads(calls1) == content_uploads(calls0), (calls0, calls1)
        assert calls1.get("PATCH /v1/stores/{}/records/{}", 0) - calls0.get("PATCH /v1/stores/{}/records/{}", 0) == 2
        mtime = os.stat(da / "notes.md").st_mtime_ns
        assert mtime % 10**9 == 123456789
        # the other sidecar sees both through the change feed
        wait_until(lambda: (stat.S_IMODE(os.stat(db_ / "notes.md").st_mode),
                            os.stat(db_ / "notes.md").st_mtime_ns) == (0o640, mtime),
                   timeout=10.0, what="mode and mtime in the other sidecar")
        # ... and a chmod made there comes back
        sh("chmod 600 notes.md", db_)
        wait_until(lambda: stat.S_IMODE(os.stat(da / "notes.md").st_mode) == 0o600,
                   timeout=10.0, what="remote chmod applied")

        # sed -i (fchmod on its temp file) and Python's replace: one version each, mode kept
        sh("chmod 755 notes.md", da)
        wait_until(lambda: outbox_empty(a) and live_records(cp)["notes.md"].mode == 0o755, timeout=10.0, what="chmod")
        n1 = len(versions(cp, "notes.md"))
        sh("sed -i s/alpha/gamma/ notes.md", da)
        wait_until(lambda: outbox_empty(a), timeout=10.0, what="outbox drained")
        recs = live_records(cp)
        assert sorted(recs) == ["notes.md"] and recs["notes.md"].mode == 0o755
        assert len(versions(cp, "notes.md")) == n1 + 1
        assert stat.S_IMODE(os.stat(da / "notes.md").st_mode) == 0o755
        wait_until(lambda: (db_ / "notes.md").read_text() == "gamma beta\n", timeout=10.0, what="sed result remote")
        assert stat.S_IMODE(os.stat(db_ / "notes.md").st_mode) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount for another user")
def test_copy_tools_keep_modes_and_times_as_a_normal_user(tmp_path):
    """install -m 750, cp -p, shutil.copy2 / copytree of 0440 files and 0555 directories,
    run as an unprivileged user (so permission bits are enforced), into the mount, across a
    restart, and back out with cp -a; then copytree into the mount again."""
    user = pwd.getpwnam("nobody")
    uid, gid = user.pw_uid, user.pw_gid
    base = Path(tempfile.mkdtemp(prefix="memfuse-attrs-", dir="/tmp"))  # reachable by nobody
    os.chmod(base, 0o755)
    as_user = "runuser -u nobody -- "
    with Rig(tmp_path) as rig:
        cp = rig.cp
        # after the sidecar is stopped and unmounted
        rig.defer(sh, f"chmod -R u+w {base}; rm -rf {base}", "/", 30, False)
        sc = rig.sidecar("ws", "--uid", str(uid), "--gid", str(gid), "--allow-other",
                         mountpoint=base / "mnt")
        d = sc.mountpoint / "default"
        src = base / "src"
        (src / "ro").mkdir(parents=True)
        (src / "ro" / "a.md").write_text("read only\n")
        (src / "ro" / "b.sh").write_text("#!/bin/sh\necho bee\n")
        (src / "tool.sh").write_text("#!/bin/sh\necho tool\n")
        os.chmod(src / "ro" / "a.md", 0o440)
        os.chmod(src / "ro" / "b.sh", 0o550)
        t_a = 1620000000_123456789
        os.utime(src / "ro" / "a.md", ns=(t_a, t_a))
        os.chmod(src / "ro", 0o555)
        sh(f"chown -R nobody {src} && chmod 755 {base}", base)
        py = "python3 -c 'import shutil, sys; getattr(shutil, sys.argv[1])(sys.argv[2], sys.argv[3])'"

        sh(as_user + f"install -m 750 {src}/tool.sh {d}/inst.sh", base)
        sh(as_user + f"cp -p {src}/ro/a.md {d}/cp.md", base)
        sh(as_user + f"{py} copy2 {src}/ro/a.md {d}/c2.md", base)
        sh(as_user + f"{py} copytree {src}/ro {d}/tree", base)
        assert sh(as_user + f"{d}/inst.sh", base).stdout == "tool\n"

        def check(where: Path) -> None:
            for name in ("cp.md", "c2.md", "tree/a.md"):
                st = os.stat(where / name)
                assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o440, t_a), name
            assert stat.S_IMODE(os.stat(where / "inst.sh").st_mode) == 0o750
            assert stat.S_IMODE(os.stat(where / "tree" / "b.sh").st_mode) == 0o550
            assert stat.S_IMODE(os.stat(where / "tree").st_mode) == 0o555
            assert os.stat(where / "tree").st_uid == uid
            # permission bits are enforced: a 0440 file refuses writes, a 0555 dir creates
            r = sh(as_user + f"bash -c 'echo x >> {where}/tree/a.md'", base, check=False)
            assert r.returncode != 0 and "Permission denied" in r.stderr
            r = sh(as_user + f"touch {where}/tree/new.md", base, check=False)
            assert r.returncode != 0 and "Permission denied" in r.stderr

        check(d)
        wait_until(lambda: outbox_empty(sc), timeout=10.0, what="outbox drained")
        recs = live_records(cp)
        assert {p: (r.mode, r.mtime_ns) for p, r in recs.items() if p != "inst.sh"} == {
            "cp.md": (0o440, t_a), "c2.md": (0o440, t_a), "tree/a.md": (0o440, t_a),
            "tree/b.sh": (0o550, recs["tree/b.sh"].mtime_ns)}
        assert recs["inst.sh"].mode == 0o750

        sc.stop()
        sc.start()
        check(d)  # the directory's mode is kept by this sidecar's cache
        # and back out: cp -a, then copytree into the mount again (a 0555 source dir)
        out = base / "out"
        sh(f"mkdir -p {out} && chown nobody {out}", base)
        sh(as_user + f"cp -a {d}/tree {out}/tree", base)
        st = os.stat(out / "tree" / "a.md")
        assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o440, t_a)
        assert stat.S_IMODE(os.stat(out / "tree").st_mode) == 0o555
        sh(as_user + f"{py} copytree {out}/tree {d}/tree2", base)
        assert stat.S_IMODE(os.stat(d / "tree2").st_mode) == 0o555
        assert (d / "tree2" / "a.md").read_text() == "read only\n"
        wait_until(lambda: outbox_empty(sc), timeout=10.0, what="outbox drained")
        assert live_records(cp)["tree2/a.md"].mode == 0o440
