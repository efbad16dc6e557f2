"""Deterministic profiles of a running sidecar, toggled by signals (bench/README.md, "The close
path, session 10: sidecar"): with this directory on ``PYTHONPATH`` and ``MEMFUSE_SIGPROF=PREFIX``
in the environment, a ``memfuse mount`` or ``memfuse serve`` process (or ``barefs.py``) starts cProfile on its main
thread (the trio thread) at ``SIGUSR1`` and, at ``SIGUSR2``, stops it and writes the stats to
``PREFIX.PID`` (``pstats``; call counts per file written are load-independent). Any other
process, or without the variable, nothing happens. A bench tool, never imported by memfuse."""
import os
import signal
import sys

if os.environ.get("MEMFUSE_SIGPROF") and ("mount" in sys.argv or "serve" in sys.argv
                                          or any(a.endswith("barefs.py") for a in sys.argv)):
    import cProfile

    _prof = cProfile.Profile()

    def _on(sig: int, frame: object) -> None:
        _prof.enable()

    def _off(sig: int, frame: object) -> None:
        _prof.disable()
        _prof.dump_stats(f"{os.environ['MEMFUSE_SIGPROF']}.{os.getpid()}")
        _prof.clear()

    signal.signal(signal.SIGUSR1, _on)
    signal.signal(signal.SIGUSR2, _off)
