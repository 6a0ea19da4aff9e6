"""torch's CPU thread count, set for a block and restored; and how many cores other work leaves."""

from __future__ import annotations

import os
import time

import torch


class torch_threads:  # noqa: N801 (used as a function: `with torch_threads(1): ...`)
    """Run the block with `threads` torch CPU threads (None: leave as is), then restore.
    A class, not a generator-based context manager: it wraps every decode step."""

    __slots__ = ("threads", "before")

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self.before = 0

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc_info) -> None:
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.before)


#: /proc/stat's clock ticks a second (USER_HZ)
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_and_total_ticks() -> tuple[int, int] | None:
    """(ticks every CPU spent busy at normal priority or above, ticks in all) since boot, from
    /proc/stat's first line; None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user, nice, system, idle, iowait, irq, softirq, steal: niced work is not counted busy (the
    # scheduler gives a nice-19 process a sliver of a core beside a thread of normal priority)
    idle = fields[1] + fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle, sum(fields[:8])


def _own_seconds() -> float:
    """CPU seconds this process has used (every thread, user and system)."""
    return sum(os.times()[:2])


class CoreWatch:
    """How many cores other processes kept busy between `CoreWatch()` and `busy_elsewhere()`:
    the machine's busy CPU time less this process's own, over the time between. The decode
    kernels' threads meet at every layer, so one thread sharing a core with another process's
    waits a scheduler slice for it at each meeting; a step on the free cores alone runs faster.
    `ticks` ((busy, total) clock ticks since boot, or None), `own` (this process's CPU seconds)
    and `clock` (seconds) are where it reads them."""

    def __init__(self, ticks=_busy_and_total_ticks, own=_own_seconds, clock=time.monotonic) -> None:
        self.read_ticks, self.read_own, self.clock = ticks, own, clock
        self.started, self.ticks, self.own = clock(), ticks(), own()

    def busy_elsewhere(self) -> float:
        """Cores kept busy by other processes, on average, since this watch started (0.0 where
        /proc/stat cannot be read or no time has passed)."""
        ticks, elapsed = self.read_ticks(), self.clock() - self.started
        if ticks is None or self.ticks is None or elapsed <= 0:
            return 0.0
        busy = (ticks[0] - self.ticks[0]) / _TICKS - (self.read_own() - self.own)
        return max(0.0, busy / elapsed)


def threads_beside_other_work(threads: int, busy: float, cores: int | None = None) -> int:
    """`threads` lowered to the `cores` (default: the machine's) that `busy` cores of other work
    (`CoreWatch.busy_elsewhere`, rounded) leave free; never below 1."""
    cores = cores or os.cpu_count() or threads
    return max(1, min(threads, cores - round(busy)))
