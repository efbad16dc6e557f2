"""Ctrl-C of a process blocked in close(2) or fsync(2) on the mount (docs/SEMANTICS.md, "Writes
and close"): the wait for the control plane answers ``EINTR`` once the process has a stop
signal to take.

When a process waiting for a FUSE request gets a signal it does not block, the kernel sends
``FUSE_INTERRUPT`` for that request and then waits, uninterruptibly but for SIGKILL, for the
filesystem's answer (linux fs/fuse/dev.c, ``request_wait_answer``). pyfuse3 3.5 never hands
that message to Python: libfuse answers it itself, and pyfuse3 registers no
``fuse_req_interrupt_func`` and passes ``flush`` / ``fsync`` neither the request nor its
context (pyfuse3 handlers.pxi). So the sidecar looks from the other side: the thread that
opened the descriptor (``RequestContext.pid`` at open / create, a thread id) is watched
while its close or fsync waits for the control plane, and the wait ends when
``/proc/<pid>/status`` shows one of :data:`STOP_SIGNALS` pending that the thread does not
block (``(SigPnd | ShdPnd) & ~SigBlk``: the condition on which the kernel sent the
interrupt, narrowed to the signals that stop a program). The write stays accepted and
queued, as after any close that returned before the control plane answered.

Limits: only the wait for the control plane is watched (``Filesystem.flush`` / ``fsync``),
not the wait for the sidecar's own outbox journal (its own bounds); the watched thread is
the descriptor's opener (pyfuse3 gives no pid for flush or fsync), so a close or fsync by
another process (a child that inherited the descriptor) waits its whole bound, as does one
whose opener's thread has exited or whose pid the sidecar's pid namespace does not show
(``pid`` 0).
"""
from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable
from types import TracebackType

import trio

log = logging.getLogger(__name__)

#: s between two looks at the waiting processes' pending signals (while any waits)
POLL = 0.1

#: the signals that end a wait: those a person or a supervisor sends to stop a program
#: (Ctrl-C, Ctrl-\\, a tool's timeout, a closed terminal). Not SIGCHLD, SIGWINCH, SIGALRM...,
#: which a program takes in passing (vim resizing while it fsyncs would see EINTR, and
#: "E667: Fsync failed", where it sees success today)
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})


def _mask(signals: Iterable[int]) -> int:
    """The bit mask of ``signals`` as ``/proc/<pid>/status`` shows sets: signal n is bit n-1."""
    m = 0
    for s in signals:
        m |= 1 << (int(s) - 1)
    return m


_STOP_MASK = _mask(STOP_SIGNALS)


def signal_pending(pid: int, signals: Iterable[int] | None = None, proc: str = "/proc") -> bool:
    """Whether thread ``pid`` has one of ``signals`` (default :data:`STOP_SIGNALS`) pending
    that it does not block: in ``SigPnd`` (its own) or ``ShdPnd`` (its process's) and not in
    ``SigBlk``, read from ``<proc>/<pid>/status`` (proc(5)). False when the thread is gone
    or unreadable (``pid`` 0: unknown)."""
    if pid <= 0:
        return False
    want = _STOP_MASK if signals is None else _mask(signals)
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return False
    pending = blocked = 0
    for line in text.split(b"\n"):
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            pending |= int(line.split(b":", 1)[1], 16)
        elif line.startswith(b"SigBlk:"):
            blocked = int(line.split(b":", 1)[1], 16)
    return bool(pending & ~blocked & want)


class Interrupts:
    """The openers of the mount's writable descriptors and the close / fsync waits to end
    when their opener is signalled. ``pending(pid)`` tells whether a thread has a stop
    signal to take (default :func:`signal_pending`); ``poll``: s between looks. ``run`` is
    the sidecar's background task that looks while any request waits.

    A wait is watched through the cancel scope it already has (``Filesystem.flush`` /
    ``fsync``: ``with trio.move_on_at(deadline) as scope, interrupts.watch(fh, scope) as
    w:``): a trio cancel scope costs ~48,000 instructions to open and close, a watch a dict
    insert and delete."""

    def __init__(self, pending: Callable[[int], bool] = signal_pending, poll: float = POLL) -> None:
        self.pending = pending
        self.poll = poll
        self.openers: dict[int, int] = {}  # fh -> the opener's thread id
        self._waiting: dict[Watch, None] = {}  # the waits watched now
        self._wake = trio.Event()

    def opened(self, fh: int, pid: int) -> None:
        """Handle ``fh`` was opened (for writing) by thread ``pid`` (0: not known)."""
        if pid:
            self.openers[fh] = pid

    def released(self, fh: int) -> None:
        """Handle ``fh`` is gone."""
        self.openers.pop(fh, None)

    def watch(self, fh: int, scope: trio.CancelScope) -> Watch:
        """The context of one close or fsync wait of ``fh`` inside ``scope``: the scope is
        cancelled when the opener of ``fh`` gets a stop signal, and ``interrupted`` is then
        true on the watch (a deadline's cancellation leaves it false)."""
        return Watch(self, self.openers.get(fh, 0), scope)

    async def run(self) -> None:
        """Look at the waiting requests' threads every ``poll`` s while any waits; cancel
        the wait of each that has a stop signal to take. Never returns."""
        while True:
            if not self._waiting:
                self._wake = trio.Event()
                await self._wake.wait()
            await trio.sleep(self.poll)
            for w in list(self._waiting):
                if not w.interrupted and self.pending(w.pid):
                    log.info("a close or fsync waiting on the mount was interrupted by a signal "
                             "to its process; answered EINTR, the write stays queued",
                             extra={"pid": w.pid})
                    w.interrupted = True
                    w.scope.cancel()


class Watch:
    """One wait watched by ``Interrupts`` (see ``Interrupts.watch``); ``interrupted`` tells
    whether its opener's signal ended it."""

    __slots__ = ("_owner", "pid", "scope", "interrupted")

    def __init__(self, owner: Interrupts, pid: int, scope: trio.CancelScope) -> None:
        self._owner = owner
        self.pid = pid
        self.scope = scope
        self.interrupted = False

    def __enter__(self) -> Watch:
        if self.pid:
            self._owner._waiting[self] = None
            self._owner._wake.set()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.pid:
            del self._owner._waiting[self]
