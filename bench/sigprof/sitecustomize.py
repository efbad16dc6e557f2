"""Profiles of a running sidecar, toggled by signals (bench/README.md, "The close path,
session 10: sidecar"): with this directory on ``PYTHONPATH`` and ``MEMFUSE_SIGPROF=PREFIX`` in
the environment, a ``memfuse mount`` or ``memfuse serve`` process (or ``barefs.py``) starts a
profile of its main thread (the trio thread) at ``SIGUSR1`` and, at ``SIGUSR2``, stops it and
writes it to ``PREFIX.PID`` (its directory made if missing; a failed write said on stderr,
never raised into the process). Any other process, or without the variable, nothing happens. A
bench tool, never imported by memfuse.

Two kinds (``MEMFUSE_SIGPROF_MODE``):

- ``cprofile`` (the default): cProfile, stats in ``pstats`` form (call counts per file written
  are load-independent; times carry cProfile's cost per call).
- ``sample``: a statistical profile of CPU time: ``setitimer(ITIMER_PROF)`` every
  ``MEMFUSE_SIGPROF_US`` µs of process CPU (default 500) and, at each tick, the main thread's
  Python stack at its next bytecode boundary (so time in a C call or a syscall counts for the
  Python line that made it; time blocked in ``epoll`` is not CPU and is never sampled). Output:
  collapsed stacks (``frame;frame;... count`` per line, flamegraph.pl's input), root first.
- ``opcodes``: every bytecode the main thread executes counted per code object
  (``sys.settrace`` with ``f_trace_opcodes``; ~50x slower): lines ``opcodes<TAB>calls<TAB>
  file:line:qualname``, most opcodes first. Load-independent like cProfile's call counts,
  and unlike them it weighs a function by the work it does (bench/README.md, "The close
  path, session 20: sidecar": trio's share of a file, per loop pass and per task step).

With ``MEMFUSE_THREAD_NAMES=1`` every Python thread of any process started with this directory
on ``PYTHONPATH`` also gets its Python name as its OS name (``prctl(PR_SET_NAME)``, the first
15 bytes), so ``/proc/PID/task/*/comm`` tells the threads apart (``bench/prof_echo.py``).
"""
import os
import signal
import sys

if os.environ.get("MEMFUSE_THREAD_NAMES") == "1":
    import ctypes
    import threading

    _libc = ctypes.CDLL(None, use_errno=True)
    _inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def _named(self: threading.Thread) -> None:
        try:
            _libc.prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except Exception:
            pass
        _inner(self)

    threading.Thread._bootstrap_inner = _named  # type: ignore[attr-defined]

if os.environ.get("MEMFUSE_SIGPROF") and ("mount" in sys.argv or "serve" in sys.argv
                                          or any(a.endswith("barefs.py") for a in sys.argv)):
    from collections.abc import Callable

    _out = os.environ["MEMFUSE_SIGPROF"]

    def _dump(write: Callable[[str], object]) -> None:
        """``write(path)`` the stats to ``PREFIX.PID``, its directory made if missing; a write
        that fails is said on stderr, never raised: the handler runs on the profiled process's
        main thread, where an exception would end it (a sidecar under prof_write.py died so,
        and the bench with ConnectionAbortedError on its mount)."""
        path = f"{_out}.{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write(path)
        except OSError as e:
            print(f"sigprof: stats not written to {path}: {e}", file=sys.stderr, flush=True)
    if os.environ.get("MEMFUSE_SIGPROF_MODE", "cprofile") == "sample":
        import collections

        _counts: collections.Counter = collections.Counter()
        _every = int(os.environ.get("MEMFUSE_SIGPROF_US", "500")) / 1e6

        def _tick(sig: int, frame: object) -> None:
            names = []
            f = frame
            while f is not None:
                co = f.f_code  # type: ignore[attr-defined]
                names.append(f"{co.co_filename.rsplit('/', 2)[-2:][-1]}:{co.co_name}:{f.f_lineno}")  # type: ignore[attr-defined]
                f = f.f_back  # type: ignore[attr-defined]
            _counts[";".join(reversed(names))] += 1

        def _on(sig: int, frame: object) -> None:
            _counts.clear()
            signal.signal(signal.SIGPROF, _tick)
            signal.setitimer(signal.ITIMER_PROF, _every, _every)

        def _off(sig: int, frame: object) -> None:
            signal.setitimer(signal.ITIMER_PROF, 0, 0)

            def write(path: str) -> None:
                with open(path, "w") as fh:
                    for stack, n in _counts.most_common():
                        fh.write(f"{stack} {n}\n")

            _dump(write)
    elif os.environ.get("MEMFUSE_SIGPROF_MODE") == "opcodes":
        import collections

        _ops: collections.Counter = collections.Counter()
        _calls: collections.Counter = collections.Counter()

        def _local(frame: object, event: str, arg: object) -> object:
            if event == "opcode":
                _ops[frame.f_code] += 1  # type: ignore[attr-defined]
            return _local

        def _global(frame: object, event: str, arg: object) -> object:
            frame.f_trace_opcodes = True  # type: ignore[attr-defined]
            _calls[frame.f_code] += 1  # type: ignore[attr-defined]
            return _local

        def _on(sig: int, frame: object) -> None:
            _ops.clear()
            _calls.clear()
            sys.settrace(_global)
            f = frame
            while f is not None:  # the frames running now (trio.run's) count from here on
                f.f_trace, f.f_trace_opcodes = _local, True  # type: ignore[attr-defined]
                f = f.f_back  # type: ignore[attr-defined]

        def _off(sig: int, frame: object) -> None:
            sys.settrace(None)
            f = frame
            while f is not None:
                f.f_trace = None  # type: ignore[attr-defined]
                f = f.f_back  # type: ignore[attr-defined]

            def write(path: str) -> None:
                with open(path, "w") as fh:
                    for co in sorted(set(_ops) | set(_calls), key=lambda c: -_ops[c]):
                        fh.write(f"{_ops[co]}\t{_calls[co]}\t{co.co_filename}:{co.co_firstlineno}:"
                                 f"{co.co_qualname}\n")

            _dump(write)
    else:
        import cProfile

        _prof = cProfile.Profile()

        def _on(sig: int, frame: object) -> None:
            _prof.enable()

        def _off(sig: int, frame: object) -> None:
            _prof.disable()
            _dump(_prof.dump_stats)
            _prof.clear()

    signal.signal(signal.SIGUSR1, _on)
    signal.signal(signal.SIGUSR2, _off)

# ``bench_api_create.py --steady``: ``memfuse serve`` reads token revocations (SQLite) at most
# every MEMFUSE_BENCH_REVOCATION_S s instead of every second, so that a request slowed ~50x by
# valgrind on a loaded machine does not hop to a worker thread for them (one request in ~300
# does at native speed, but nearly every one past 0.5 s a request): the instructions then
# counted per request are the request's own, whatever the round's wall time.
if os.environ.get("MEMFUSE_BENCH_REVOCATION_S") and "serve" in sys.argv:
    import memfuse.server.tokens as _tokens

    _tokens.REVOCATION_CHECK_SECONDS = float(os.environ["MEMFUSE_BENCH_REVOCATION_S"])
