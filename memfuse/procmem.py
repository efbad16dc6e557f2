"""Process-wide memory settings shared by ``memfuse mount`` and ``memfuse serve``."""
from __future__ import annotations

M_MMAP_THRESHOLD = -3  # mallopt(3) parameter (glibc's malloc.h)
MMAP_THRESHOLD = 128 << 10  # bytes: glibc's default starting value, kept fixed


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at 128 KiB (``mallopt(M_MMAP_THRESHOLD)``; returns
    whether it took). glibc raises the threshold to the size of every mmapped block that is
    freed (up to 32 MiB), so after the first big buffer (a mirror file read whole, a snapshot
    page; in ``memfuse serve`` a request body, a batch's contents) every buffer up to that
    size comes from the heap, and the heap is trimmed only when its free top exceeds twice
    the threshold: the freed buffers of a load or a save stay
    in the process's RSS (~20 MiB at 100,000 records). Fixed, each buffer of 128 KiB or more
    is its own mapping, returned to the kernel when freed (mallopt(3): setting the threshold
    disables the dynamic adjustment). No-op where the C library has no ``mallopt``."""
    import ctypes  # loaded already (trio imports it)

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
