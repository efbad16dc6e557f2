"""The FUSE adapter's per-request metrics (``metrics.OpStats`` / ``FuseOpsCollector``): kept as
plain numbers on the hot path, they must still reach ``/metrics`` as the counter and the
latency histogram they were before (``memfuse_fuse_ops_total``, ``memfuse_fuse_op_seconds``),
errors counted apart (``memfuse_fuse_errors_total``). Handlers driven directly, no mount.
"""
from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import pyfuse3
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, Settings
from memfuse.sidecar.fuse_ops import MemfuseOps
from memfuse.sidecar.journal import Journal
from memfuse.sidecar.metrics import LAT_BUCKETS, TIME_EVERY, Metrics, OpStats
from memfuse.wire import Record, sha256_hex


class Ctx:
    uid = gid = pid = 0
    umask = 0o022


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's exposition, parsed back: (name, sorted labels) -> value."""
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def make_ops(tmp: Path, metrics: Metrics) -> tuple[MemfuseOps, int]:
    fs = Filesystem(BlobCache(tmp / "blobs.db"), None, Journal(tmp / "outbox.db"), Settings(),
                    "ws", dirs_file=tmp / "dirs.json")
    now = datetime.now(timezone.utc)
    data = b"hello\n"
    rec = Record(id="r1", store="s", path="a.md", type="note", version=1, sha256=sha256_hex(data),
                 size=len(data), created_at=now, updated_at=now, updated_by="t", seq=1,
                 content=data.decode())
    fs.add_store("s", "read_write", [rec])
    return MemfuseOps(fs, metrics), fs.stores["s"].root.children["a.md"].ino


async def test_requests_reach_the_exposition_as_counter_and_histogram(tmp_path: Path) -> None:
    m = Metrics()
    ops, ino = make_ops(tmp_path, m)
    for _ in range(3):
        fi = await ops.open(ino, os.O_RDONLY, Ctx)
        assert await ops.read(fi.fh, 0, 100) == b"hello\n"
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
    with pytest.raises(pyfuse3.FUSEError):
        await ops.getattr(999_999, Ctx)  # unknown inode: ENOENT, still a request
    got = samples(m)
    for op in ("open", "read", "flush", "release"):
        # every request counted; the first of every TIME_EVERY timed (a sampled histogram)
        assert got[("memfuse_fuse_ops_total", (("op", op),))] == 3
        assert got[("memfuse_fuse_op_seconds_count", (("op", op),))] == 1
        assert got[("memfuse_fuse_op_seconds_bucket", (("le", "+Inf"), ("op", op)))] == 1
        assert got[("memfuse_fuse_op_seconds_sum", (("op", op),))] > 0
    assert got[("memfuse_fuse_ops_total", (("op", "getattr"),))] == 1
    assert got[("memfuse_fuse_op_seconds_count", (("op", "getattr"),))] == 1  # a failure too
    assert got[("memfuse_fuse_errors_total", (("errno", "ENOENT"), ("op", "getattr")))] == 1


async def test_one_request_in_time_every_is_timed_every_one_counted(tmp_path: Path) -> None:
    m = Metrics()
    ops, ino = make_ops(tmp_path, m)
    n = 2 * TIME_EVERY + 1  # the 1st, the (TIME_EVERY + 1)th and the (2 TIME_EVERY + 1)th timed
    for _ in range(n):
        await ops.getattr(ino, Ctx)
    got = samples(m)
    assert got[("memfuse_fuse_ops_total", (("op", "getattr"),))] == n
    assert got[("memfuse_fuse_op_seconds_count", (("op", "getattr"),))] == 3
    assert 0 < got[("memfuse_fuse_op_seconds_sum", (("op", "getattr"),))] < 1


def test_opstats_buckets_are_cumulative_with_prometheus_bounds() -> None:
    m = Metrics()
    st = m.fuse_ops.labels("lookup")
    assert isinstance(st, OpStats)
    for s in (LAT_BUCKETS[0], LAT_BUCKETS[0] * 1.01, 0.003, 31.0):  # on a bound: in that bucket
        st.observe(s)
    m.fuse_ops.labels(op="statfs").inc(2)  # counted only: no histogram
    got = samples(m)
    b = {le: v for (name, labels), v in got.items()
         if name == "memfuse_fuse_op_seconds_bucket" and ("op", "lookup") in labels
         for k, le in labels if k == "le"}
    assert b["5e-05"] == 1 and b["0.0001"] == 2 and b["0.0025"] == 2 and b["0.005"] == 3
    assert b["30.0"] == 3 and b["+Inf"] == 4
    assert got[("memfuse_fuse_ops_total", (("op", "lookup"),))] == 4 == st.count
    assert got[("memfuse_fuse_ops_total", (("op", "statfs"),))] == 2
    assert not any(name.startswith("memfuse_fuse_op_seconds") and ("op", "statfs") in labels
                   for name, labels in got)


async def test_what_every_close_counts_takes_no_prometheus_lock(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every create-write-close counts the kernel's ``security.capability`` probe
    (``memfuse_fuse_errors_total{errno="ENODATA"}``), an API call with its latency
    (``Metrics.api_observer``) and a commit (``memfuse_outbox_committed_total``): plain
    numbers updated on the trio thread (``metrics.PlainCounter``, ``ApiLatency``), not
    prometheus-client's children, whose ``inc`` / ``observe`` take a lock and make three
    Python calls each (bench/README.md, "The close path, session 20: sidecar"). They still
    reach the exposition as the counters and the histogram they were."""
    import prometheus_client.values as values

    locked = 0
    inc = values.MutexValue.inc

    def counting(self: object, amount: float) -> None:
        nonlocal locked
        locked += 1
        inc(self, amount)

    monkeypatch.setattr(values.MutexValue, "inc", counting)
    m = Metrics()
    ops, ino = make_ops(tmp_path, m)
    observe = m.api_observer()
    for seconds in (0.003, 0.004, 7.0):
        with pytest.raises(pyfuse3.FUSEError):
            await ops.getxattr(ino, b"security.capability", Ctx)
        observe("POST /v1/stores/{}/records", "201", seconds)
        m.commits.labels("put").inc()
    observe("POST /v1/stores/{}/records", "503", 0.2)
    assert locked == 0
    got = samples(m)
    ep = "POST /v1/stores/{}/records"
    assert got[("memfuse_fuse_errors_total", (("errno", "ENODATA"), ("op", "getxattr")))] == 3
    assert got[("memfuse_api_calls_total", (("endpoint", ep), ("status", "201")))] == 3
    assert got[("memfuse_api_calls_total", (("endpoint", ep), ("status", "503")))] == 1
    assert got[("memfuse_api_call_seconds_count", (("endpoint", ep),))] == 4
    assert got[("memfuse_api_call_seconds_sum", (("endpoint", ep),))] == pytest.approx(7.207)
    assert got[("memfuse_api_call_seconds_bucket", (("endpoint", ep), ("le", "0.005")))] == 2
    assert got[("memfuse_api_call_seconds_bucket", (("endpoint", ep), ("le", "5.0")))] == 3
    assert got[("memfuse_api_call_seconds_bucket", (("endpoint", ep), ("le", "+Inf")))] == 4
    assert got[("memfuse_outbox_committed_total", (("op", "put"),))] == 3
    assert len(LAT_BUCKETS) + 1 == sum(1 for k in got if k[0] == "memfuse_api_call_seconds_bucket")
