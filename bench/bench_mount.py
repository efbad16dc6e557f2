"""Mount time, cold ``grep -r`` and sidecar RSS with the 10,000-record store.

    .venv/bin/python bench/bench_mount.py [--quick]

- mount time: from starting the ``memfuse mount`` process until ``os.listdir(MOUNT/big)``
  returns the store's top directories, polled every 2 ms. Two cases: a fresh cache directory
  (the sidecar takes a full snapshot with content: 10,000 records through the API) and the
  cache directory of an earlier mount (it resumes from the saved change-feed cursor). Target
  ≤ 2 s. The bare floor's start (copy the local tree into memory, mount) is shown beside it.
  The detail has where the time goes, from the sidecar's log: process start → admin API up
  (imports) → store loaded → mounted.
- cold ``grep -r``: the first ``grep -r`` after each mount (kernel caches empty), memfuse vs the
  bare floor's first grep after its mount vs the first ``grep -r`` after mounting a local ext4
  file system holding the data set (an image on a loop device, so its dentry, inode and page
  caches start empty too; the image file itself stays in the host's page cache, as memfuse's
  blob cache does). Target ≤ 3× local. The detail also has local from disk (image pages
  evicted first) and the warm local directory. Without root / loop devices, local falls back
  to the warm local directory (a stricter denominator; the row's note says so).
- RSS: ``VmRSS`` of the sidecar from ``/proc/PID/status`` after the mount and after the cold
  grep read every file (the largest is the figure; ``VmHWM`` in the detail). Target ≤ 100 MiB.
  The detail also has the RSS of a sidecar whose only store is empty, and so the cost per
  record.
"""
from __future__ import annotations

import shutil
import subprocess
import time

from common import MEMFUSE, Bare, LocalImage, Mount, Row, Session, grep, main_for, median, rss_kib

PHASES = {"admin API listening": "admin_up", "store loaded": "store_loaded", "mounted": "mounted"}


def phases(m) -> dict[str, float]:
    out = {}
    for ev in m.log_events():
        msg = str(ev.get("msg", ""))
        k = next((v for p, v in PHASES.items() if msg.startswith(p)), None)
        if k and k not in out:
            out[k] = round(ev["_t"] - m.started_at, 3)
    return out


def run(s: Session) -> list[Row]:
    k = 1 if s.quick else 3
    s.big_token()  # populate first (not timed here)
    n = len(s.files)

    t0 = time.perf_counter()
    subprocess.run([MEMFUSE, "--help"], capture_output=True, check=True)
    cli_start = time.perf_counter() - t0

    grep(s.local)
    local_warm = median([grep(s.local)[0] for _ in range(3)])
    img = LocalImage(s, s.local)
    local_cold, local_disk = [], None
    if img.build():
        for i in range(k + 1):
            try:
                g, _ = grep(img.mount(evict_image=(i == k)))
            finally:
                img.umount()
            if i < k:
                local_cold.append(g)
            else:
                local_disk = g
        local = median(local_cold)
        local_note = "local = first grep after mounting an ext4 image of the data set (loop device)"
    else:
        local = local_warm
        local_note = f"local = warm local directory (no loop mount: {img.error})"
    s.say(f"local: warm {local_warm:.3f} s, first after mount {local:.3f} s, from disk {local_disk}")

    bare_mount, bare_cold = [], []
    for i in range(k):
        b = Bare(s, s.local, f"bare-cold{i}")
        try:
            bare_mount.append(b.start(expect=s.files[0][0].split("/")[0]))
            bare_cold.append(grep(b.mountpoint)[0])
        finally:
            b.stop()
    s.say(f"bare floor: mount {median(bare_mount):.2f} s, cold grep {median(bare_cold):.2f} s")

    fresh, warm, cold, rss, samples = [], [], [], [], []
    cache = s.dir / "cache" / "mount-test"
    for case in ["fresh"] * k + ["warm"] * k:
        if case == "fresh":
            shutil.rmtree(cache, ignore_errors=True)
        m = s.new_reader(f"{case}{len(samples)}", cache_dir=cache)
        try:
            dt = m.start(s.BIG)
            r_mount = rss_kib(m.pid)
            g, lines = grep(m.mountpoint / s.BIG)
            r_grep = rss_kib(m.pid)
        finally:
            m.stop()
        (fresh if case == "fresh" else warm).append(dt)
        cold.append(g)
        rss.append(max(r_mount["VmRSS"], r_grep["VmRSS"]))
        samples.append({"cache": case, "mount_s": round(dt, 3), "cold_grep_s": round(g, 3),
                        "lines": lines, "rss_after_mount_kib": r_mount["VmRSS"],
                        "rss_after_grep_kib": r_grep["VmRSS"], "hwm_kib": r_grep["VmHWM"],
                        "phases_s": phases(m)})
        s.say(f"memfuse mount ({case} cache): {dt:.2f} s, cold grep {g:.2f} s, "
              f"RSS {r_grep['VmRSS'] / 1024:.0f} MiB")

    # the same sidecar with an empty store: what the records themselves cost
    m = Mount(s, s.cp, "ws-empty", s.workspace("ws-empty", ("empty",)), "empty")
    try:
        m.start("empty", nonempty=False)
        time.sleep(0.5)
        rss_empty = rss_kib(m.pid)["VmRSS"]
    finally:
        m.stop()

    detail = {"samples": samples, "cli_help_s": round(cli_start, 3), "records": n}
    return [
        Row("mount_fresh", f"mount of a {n}-record store, fresh cache (full snapshot)",
            median(fresh), "s", bare=median(bare_mount), target=2.0, detail=detail),
        Row("mount_warm", f"mount of a {n}-record store, warm cache (resume from cursor)",
            median(warm), "s", bare=median(bare_mount), target=2.0),
        Row("grep_cold", f"cold grep -r (first after mount), {n} files", median(cold), "s",
            local=local, bare=median(bare_cold), ratio_vs="local", target=3.0, note=local_note,
            detail={"memfuse_s": cold, "bare_s": bare_cold, "local_first_after_mount_s": local_cold,
                    "local_from_disk_s": local_disk, "local_warm_s": local_warm,
                    "vs_bare": median(cold) / median(bare_cold),
                    "vs_local_warm": median(cold) / local_warm}),
        Row("rss", f"sidecar RSS at {n} records", max(rss) / 1024, "MiB", target=100.0,
            detail={"hwm_mib": max(x["hwm_kib"] for x in samples) / 1024,
                    "empty_store_mib": rss_empty / 1024,
                    "kib_per_record": (max(rss) - rss_empty) / n}),
    ]


if __name__ == "__main__":
    raise SystemExit(main_for(run, "mount"))
