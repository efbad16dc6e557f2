"""glibc's malloc policy of ``memfuse serve`` and the sidecar (``memfuse.procmem``), each in a
fresh Python process (the policy is process-wide):

- buffers of ~1 MiB made and dropped over and over (an append to a 1 MiB journal: SQLite's
  copy of the row, the joined content) reuse their pages: a few minor faults per round, not
  256 (the 128 KiB mmap threshold of sessions 14-22 mapped and zeroed each one again);
- what a burst of big buffers leaves free, fragmented by small live objects between them,
  leaves the RSS within a few ``Trimmer`` periods (attack18 F10: serve's RSS after big
  bodies), and stays without the trimmer.
"""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc policy")]


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_megabyte_buffers_made_again_and_again_reuse_their_pages():
    out = _run("""
        import resource
        from memfuse.procmem import fix_mmap_threshold
        assert fix_mmap_threshold()
        def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        content, kept = b"j" * (1 << 20), []
        for i in range(20):  # warm: the heap grows to what the loop needs
            content = content + b"%d\\n" % i
        f0 = faults()
        for i in range(200):  # an append's join, the previous contents dropped in turn
            content = content + b"line %d\\n" % i
            kept.append(content)
            if len(kept) > 3:
                kept.pop(0)
        print((faults() - f0) / 200)
    """)
    assert float(out) < 32  # 128 KiB threshold: ~257 a round (every page of each join)


@pytest.mark.parametrize("trimmer", [True, False])
def test_a_burst_s_free_memory_leaves_the_rss_with_the_trimmer(trimmer):
    out = _run(f"""
        import re, time
        from memfuse.procmem import Trimmer, fix_mmap_threshold
        assert fix_mmap_threshold()
        def rss(): return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
        blocks = [b"b" * (1 << 20) + b"%d" % i for i in range(128)]  # 128 MiB of bodies
        before = rss()
        del blocks[::2]  # half of them freed: holes between live blocks, not the heap's top
        held = rss()
        t = Trimmer(every=0.1, free_min=16 << 20)
        if {trimmer}:
            t.start()
        time.sleep(1.0)
        t.stop()
        print(before - held, held - rss(), t.trims)
    """)
    given_at_free, given_later, trims = (int(x) for x in out.split())
    assert given_at_free < 8  # glibc keeps the holes' pages (only a heap's top is trimmed at a free)
    if trimmer:
        assert given_later >= 48 and trims == 1  # once: the heap's free pages were given back
    else:
        assert given_later < 8 and trims == 0


def test_what_is_freed_after_a_trim_mid_burst_is_given_back_too():
    # attack23 MED: gated on the RSS, a trim made at a burst's peak kept what the burst
    # freed after it (the RSS never grew again past the peak)
    out = _run("""
        import re, time
        from memfuse.procmem import Trimmer, fix_mmap_threshold
        assert fix_mmap_threshold()
        def rss(): return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
        blocks = [b"b" * (1 << 20) + b"%d" % i for i in range(160)]
        del blocks[:64:2]  # a first part of the burst freed: 32 MiB of holes
        t = Trimmer(every=0.1, free_min=16 << 20).start()
        time.sleep(0.5)
        first = t.trims
        del blocks[32::2]  # more of the burst freed after that trim: 48 MiB
        held = rss()
        time.sleep(0.8)
        t.stop()
        print(first, t.trims, held - rss())
    """)
    first, trims, given = (int(x) for x in out.split())
    assert first == 1 and trims == 2 and given >= 32
