"""Process-wide memory settings shared by ``memfuse mount`` and ``memfuse serve``: glibc's
malloc policy (``fix_mmap_threshold``) and the thread that gives freed memory back
(``Trimmer``).

The policy, and why (bench/README.md, "Appends, session 23: the allocator"):

- glibc's default raises its mmap threshold to the size of every mapped block that is freed
  (up to 32 MiB) and its trim threshold to twice that: after the first big buffer, every
  buffer up to that size comes from the heap and stays in the process's RSS once freed
  (attack18 F10: ``memfuse serve`` 140 MB → 1 GB idle after big bodies; the sidecar ~20 MiB
  more after a 100,000-record load). So both thresholds are fixed (``mallopt(3)``: setting
  one disables the dynamic adjustment).
- Sessions 14-22 fixed the mmap threshold at 128 KiB: every buffer of 128 KiB or more was a
  mapping of its own, made and unmade per use. An append to a 1 MiB journal makes several
  such buffers (SQLite's copy of the row and the new row in ``memfuse serve``, the joined
  content in the sidecar), and each of their 256 pages faulted in and was zeroed again at
  every append: ``memfuse serve`` spent 3.5 ms of CPU on an append to 1 MiB against 1.1 ms
  at 4 KiB.
- Now the mmap threshold is ``MMAP_THRESHOLD`` (4 MiB: every record up to the default
  1 MiB bound, and its JSON, comes from the heap and its pages are reused) and the trim
  threshold ``TRIM_THRESHOLD`` (8 MiB: a heap's free top up to that stays mapped between
  two appends). What a burst leaves free beyond that, in the heaps' tops or between live
  blocks, is given back by ``Trimmer`` (``malloc_trim(0)``) within ``TRIM_EVERY`` s once
  the free heap memory passes ``TRIM_FREE_MIN`` (and moved since its last trim).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any

log = logging.getLogger("memfuse.procmem")

M_TRIM_THRESHOLD = -1  # mallopt(3) parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
#: bytes: a buffer this big or bigger is a mapping of its own, given back when freed
MMAP_THRESHOLD = 4 << 20
#: bytes: the free top of a heap is given back when it passes this (at a free)
TRIM_THRESHOLD = 8 << 20
#: s between two looks at the free heap memory (``Trimmer``)
TRIM_EVERY = 2.0
#: bytes of free heap memory (``mallinfo2().fordblks``) from which ``Trimmer`` trims
TRIM_FREE_MIN = 16 << 20
#: bytes the free heap memory must have moved by since the last trim for another
TRIM_MOVED = 1 << 20


@functools.cache
def _libc() -> Any:
    """This process's C library (one handle: ``Trimmer`` looks every few seconds), None
    where it cannot be opened."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def fix_mmap_threshold() -> bool:
    """Set glibc's malloc thresholds (module docstring): mmap ``MMAP_THRESHOLD``, trim
    ``TRIM_THRESHOLD``, both fixed. Returns whether both took; a no-op (False) where the C
    library has no ``mallopt``. Call before the first big buffer (process start)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): ten ``size_t``."""
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes free inside malloc's heaps (``mallinfo2().fordblks``: freed, not given back),
    None where the C library has no ``mallinfo2``."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = (), _Mallinfo2
    return int(fn().fordblks)


def trim() -> bool:
    """``malloc_trim(0)``: give the free pages of every heap back to the kernel. Returns
    whether any was; False where the C library has none."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(fn(0))


class Trimmer:
    """A daemon thread that, every ``every`` s, gives the heaps' free memory back
    (``trim``) when at least ``free_min`` bytes are free in them (``free_heap_bytes``) and
    that figure moved by ``TRIM_MOVED`` or more since the last trim (something was freed or
    taken since): what a burst of big buffers leaves behind leaves the RSS within ``every``
    s, and an idle process's heap is not walked again every period. A steady stream of
    appends refaults its buffers' pages once per trim at most (module docstring).
    ``start`` / ``stop``; ``trims``: how many trims ran. Nothing happens where glibc's
    ``mallinfo2`` is missing. (attack23: gated on the RSS instead, a trim made mid-burst
    kept what the burst freed after it in the RSS.)"""

    def __init__(self, every: float = TRIM_EVERY, free_min: int = TRIM_FREE_MIN) -> None:
        self.every = every
        self.free_min = free_min
        self.trims = 0
        #: the free heap bytes the last trim left, None before the first
        self.free_after: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Trimmer:
        if self._thread is None and free_heap_bytes() is not None:
            self._thread = threading.Thread(target=self._run, name="memfuse-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """One look (class docstring): whether it trimmed."""
        free = free_heap_bytes()
        if free is None or free < self.free_min:
            return False
        if self.free_after is not None and abs(free - self.free_after) < TRIM_MOVED:
            return False
        trim()
        self.trims += 1
        self.free_after = free_heap_bytes()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a look that fails is logged; the next one runs
                log.warning("giving free memory back failed; tried again later", exc_info=True)


_TRIMMER: Trimmer | None = None  # GUARDED_BY(_TRIMMER_LOCK): the process's (``start_trimmer``)
_TRIMMER_LOCK = threading.Lock()


def start_trimmer() -> Trimmer:
    """The process's one ``Trimmer``, started at the first call (``memfuse serve`` and a
    mount call it after ``fix_mmap_threshold``; a test process running several gets one)."""
    global _TRIMMER
    with _TRIMMER_LOCK:
        if _TRIMMER is None:
            _TRIMMER = Trimmer().start()
        return _TRIMMER


__all__ = ["start_trimmer", "fix_mmap_threshold", "free_heap_bytes", "trim", "Trimmer", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]
