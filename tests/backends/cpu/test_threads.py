"""How many threads a step runs on beside other work (`kvcache.backends.cpu.threads`)."""

from __future__ import annotations

import pytest

from kvcache.backends.cpu.threads import CoreWatch, threads_beside_other_work


class Readings:
    """/proc/stat's busy and total ticks, this process's CPU seconds and a clock, set by hand."""

    def __init__(self) -> None:
        self.busy, self.own, self.now = 1000, 5.0, 100.0

    def watch(self) -> CoreWatch:
        return CoreWatch(ticks=lambda: (self.busy, 10**6), own=lambda: self.own, clock=lambda: self.now)


def test_busy_elsewhere_is_the_machines_busy_time_less_this_processs_own_over_the_time_between():
    readings = Readings()
    watch = readings.watch()
    readings.now += 2.0  # two seconds: the machine busy 3 CPU-seconds, 1 of them this process's
    readings.busy += 300  # (100 ticks a second)
    readings.own += 1.0
    assert watch.busy_elsewhere() == pytest.approx(1.0)


def test_this_processs_own_threads_never_count_as_other_work():
    readings = Readings()
    watch = readings.watch()
    readings.now += 1.0
    readings.busy += 200
    readings.own += 2.0  # both cores, all of it ours
    assert watch.busy_elsewhere() == 0.0
    assert threads_beside_other_work(2, watch.busy_elsewhere(), cores=2) == 2


@pytest.mark.parametrize(("elsewhere", "threads", "cores", "expected"), [
    (0.0, 2, 2, 2), (0.4, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (5.0, 2, 2, 1), (1.0, 1, 2, 1),
    (2.0, 8, 8, 6), (1.0, 2, 8, 2),
])
def test_threads_beside_other_work_leave_the_busy_cores_to_it_and_never_drop_below_one(
        elsewhere, threads, cores, expected):
    readings = Readings()
    watch = readings.watch()
    readings.now += 1.0
    readings.busy += int(100 * elsewhere)
    assert threads_beside_other_work(threads, watch.busy_elsewhere(), cores=cores) == expected


def test_without_proc_stat_nothing_counts_as_busy():
    watch = CoreWatch(ticks=lambda: None)
    assert watch.busy_elsewhere() == 0.0
