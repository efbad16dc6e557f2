"""The one rule for a duration in seconds: what a duration flag (``memfuse.cli.common.Seconds``,
and so its ``MEMFUSE_<FLAG>`` variable) and a sidecar's options (``MountConfig``, the core's
``Settings``) take. A number (``int`` or ``float``, not ``bool``) from a lower bound (0 unless
said; ``low_open``: more than it) up to :data:`MAX_SECONDS`; ``nan``, a number past either
bound and ``inf`` are refused, except that a duration whose ``forever`` says it means "wait
forever" takes ``inf``. No click here: the sidecar's core imports it.

(attack26: a ``nan`` commit wait made a close fail with EIO at once and its write commit
afterwards; cfg27: ``MountConfig(commit_wait=1e300)`` was taken and overflowed the clocks it
is added to.)
"""
from __future__ import annotations

import math

#: the longest duration taken (about 31 years): longer ones overflow the clocks they are added
#: to (``time.sleep``, ``threading.Event.wait``, trio's deadlines); a ``forever`` duration also
#: takes ``inf``
MAX_SECONDS = 1e9

#: what a refused duration is, said after it (``'nan' is not a number of seconds``)
NOT_SECONDS = "is not a number of seconds"


def seconds_bounds(low: float = 0.0, *, low_open: bool = False, forever: bool = False) -> str:
    """The durations the rule takes, in words: ``from 0 to 1000000000``, ``above 0 and at most
    1000000000`` (``low_open``), with `` (or inf: forever)`` after it for a ``forever`` one."""
    words = (f"above {low:g} and at most {MAX_SECONDS:.0f}" if low_open
             else f"from {low:g} to {MAX_SECONDS:.0f}")
    return words + (" (or inf: forever)" if forever else "")


def seconds_problem(value: object, low: float = 0.0, *, low_open: bool = False,
                    forever: bool = False) -> str | None:
    """``None`` when ``value`` is a duration the rule takes (see the module); otherwise what is
    wrong with it, to be said after it: :data:`NOT_SECONDS` (not a number, or ``nan``), or that
    followed by :func:`seconds_bounds` (a number below ``low``, ``low`` itself when
    ``low_open``, past :data:`MAX_SECONDS`, ``inf`` unless ``forever``, ``-inf``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_SECONDS
    if isinstance(value, float) and math.isnan(value):
        return NOT_SECONDS
    if value == math.inf and forever:
        return None
    if value < low or (low_open and value == low) or value > MAX_SECONDS:
        return f"{NOT_SECONDS} {seconds_bounds(low, low_open=low_open, forever=forever)}"
    return None


def check_seconds(owner: object, *names: str, positive: tuple[str, ...] = (),
                  forever: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming the field (``MountConfig.commit_wait = 1e+300 is not a
    number of seconds from 0 to 1000000000``) when one of ``owner``'s duration fields
    ``names`` is not a duration :func:`seconds_problem` takes: from 0 (``positive``: above 0)
    to :data:`MAX_SECONDS`; ``forever``: ``inf`` taken too, as "wait forever". The CLI refuses
    such values with a usage error first; this keeps any other caller from passing them."""
    for name in names:
        value = getattr(owner, name)
        problem = seconds_problem(value, low_open=name in positive, forever=name in forever)
        if problem is not None:
            raise ValueError(f"{type(owner).__name__}.{name} = {value!r} {problem}")
