"""Cost of the content checks that run on every write (issue 20): the secret detector per KB
of ordinary notes, and the write-time judge (``memfuse.sidecar.writecheck``) over a 1 MiB
file written in 4 KiB chunks against one scan of the whole file.

    .venv/bin/python bench/bench_writecheck.py

No mount: pure functions, timed in this process (CPU time, ``time.process_time``, so the
figures hold on a loaded machine). The notes are the generated corpus of
``tests/test_secret_corpus.py`` (hashes, UUIDs, base64 images, URLs, code, config, JSONL,
prose about credentials, non-ASCII); "prose" is plain English text.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memfuse.content import find_secret  # noqa: E402
from memfuse.sidecar.writecheck import WINDOW, WriteChecker  # noqa: E402
from test_secret_corpus import NOTES, _note  # noqa: E402


def cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    r = random.Random(20)
    notes = [_note(r, i) for i in range(NOTES)]
    total = sum(len(n.encode()) for n in notes)
    flagged = sum(find_secret(n) is not None for n in notes)
    dt = min(cpu(lambda: [find_secret(n) for n in notes]) for _ in range(3))
    print(f"notes: {NOTES} ({total / 1e6:.2f} MB), flagged {flagged}; "
          f"find_secret {dt * 1e6 / (total / 1024):.0f} us CPU per KB")
    big = "".join(notes).encode()[: 1 << 20]
    prose = (b"the quick brown fox jumps over the lazy dog; we shipped the release on friday. " * 14000)[: 1 << 20]
    for name, data in (("notes", big), ("prose", prose)):
        def chunked() -> None:
            buf = bytearray()
            ck = WriteChecker(buf, trusted=True, type_rule=lambda t: None)
            for off in range(0, len(data), 4096):
                chunk = data[off:off + 4096]
                ck.check_write(buf, len(buf), chunk)
                buf += chunk
        w = min(cpu(chunked) for _ in range(3))
        f = min(cpu(lambda: find_secret(data.decode("utf-8", "ignore"))) for _ in range(3))
        print(f"{name}: 1 MiB in 4 KiB writes {w * 1000:.0f} ms CPU ({w * 1e6 / 256:.0f} us per write), "
              f"one scan of the whole file {f * 1000:.0f} ms: {w / f:.1f}x (window {WINDOW} B)")


if __name__ == "__main__":
    main()
